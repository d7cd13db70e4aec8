"""GRPO with TRL, the vLLM engine refitted through reshard after every step.

    python examples/trl_grpo.py [--steps 3]                                  # one process
    python -m torch.distributed.run --nproc_per_node 2 examples/trl_grpo.py  # two trainer ranks

Runs on a laptop's CPU. TRL's ``GRPOTrainer`` becomes ``ReshardGRPOTrainer``; nothing else in the
script changes. In colocate mode (this example) each trainer process runs TRL's in-process vLLM
engine and reshard refits it from the trainer's weights (local copies, plus the other ranks'
shards when the trainer is sharded), then resets its prefix cache and labels it with the step.
For server mode start ``vllm serve MODEL --weight-transfer-config '{"backend": "reshard"}'`` (with
``VLLM_SERVER_DEV_MODE=1``) and pass ``vllm_mode="server", vllm_server_base_url=...``: docs/trl.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def reward_length(completions, **kwargs):
    """Longer completions score higher: a reward a tiny random model can move."""
    return [len(c) / 10.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description="GRPO with TRL, refitted through reshard")
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))

    import torch
    from datasets import Dataset
    from trl import GRPOConfig

    from reshard.apps.toy_models import save_checkpoint
    from reshard.integrations.trl import ReshardGRPOTrainer

    path = os.path.join(tempfile.gettempdir(), "reshard-trl-example")
    if rank == 0:
        save_checkpoint(path, "dense", dtype=torch.float32)  # a tiny random Qwen3 and its tokenizer
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
    prompts = Dataset.from_dict({"prompt": ["hello world", "the quick brown fox", "jumps over", "the lazy dog"] * 8})
    args = GRPOConfig(output_dir=os.path.join(path, "out"), use_cpu=True, bf16=False, max_steps=opts.steps,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=8, learning_rate=5e-2,
                      logging_steps=1, report_to=[], save_strategy="no", use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=256)
    trainer = ReshardGRPOTrainer(model=path, reward_funcs=reward_length, args=args, train_dataset=prompts)
    trainer.train()
    trainer.close_refit()
    if rank == 0:
        for sync in trainer.syncs:
            print(f"refit: step {sync.step} -> engine version {sync.version!r}, {sync.seconds:.3f} s, "
                  f"{sync.sent_bytes} bytes sent, {sync.recv_bytes} received by this rank")
        for rollout in trainer.rollouts:
            print(f"rollouts at step {rollout.step}: engine version {rollout.before!r} (expected {rollout.expected!r})")
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        print(f"rewards per step: {[round(r, 3) for r in rewards]}")


if __name__ == "__main__":
    main()
