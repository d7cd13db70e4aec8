"""Train a tiny model under DeepSpeed ZeRO-3 and refit a live vLLM engine after each step, through ``reshard``.

    python examples/deepspeed_refit.py [--steps 4]

Runs on a laptop's CPU (DeepSpeed's CPU accelerator, gloo). The trainer is 2 processes holding a
tiny random Qwen3 under ZeRO-3 (each rank keeps half of every parameter, ``p.ds_tensor``); its rank
0 also runs a vLLM engine (``backend="reshard"``). Every step each trainer rank sends its own
partitions straight into the engine: no rank gathers a parameter.
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


def trainer(rank: int, world: int, path: str, steps: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard.execution.process_group import free_port
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo
    from reshard.integrations.vllm.inspect import close_engine

    deepspeed.init_distributed(dist_backend="gloo")  # joins the gloo group spawn made
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
    with deepspeed.zero.Init(config_dict_or_path=config):  # parameters are partitioned as they are made
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = AutoTokenizer.from_pretrained(path)(SENTENCE, return_tensors="pt").input_ids

    llm, port = None, [0]
    try:
        if rank == 0:  # the inference engine: the reshard backend is found through its vLLM plugin
            llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      weight_transfer_config=WeightTransferConfig(backend="reshard"))
            print(f"engine before training: {generate(llm)!r}", flush=True)
            port = [free_port()]
        dist.broadcast_object_list(port, src=0)
        # every trainer rank: connect once (layouts exchanged, one plan); ReshardSource reads ZeRO-3 partitions
        info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port[0],
                                      num_trainer_ranks=world, world_size=world + 1)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
        for step in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            model.step()
            start = time.perf_counter()
            stats = engine.send_weights(weight_version=f"step-{step}")  # every rank sends its own partitions
            seconds = time.perf_counter() - start
            sent = torch.tensor([stats.sent_bytes])
            dist.all_reduce(sent)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.3f}, refit {seconds * 1000:.0f} ms, "
                      f"{sent.item() / 2**20:.2f} MiB sent by {world} ranks, engine at {llm.get_weight_version()}: "
                      f"{generate(llm)!r}", flush=True)
        engine.shutdown()
    finally:
        if llm is not None:
            close_engine(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from reshard.apps.toy_models import save_checkpoint
    from reshard.execution.process_group import spawn

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "model")
        save_checkpoint(path, "dense", dtype=torch.float32, hidden_size=128, num_hidden_layers=2)
        spawn(trainer, 2, path, args.steps)


if __name__ == "__main__":  # vLLM and torch start processes that import this file again
    main()
