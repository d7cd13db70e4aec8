"""Helpers of the vLLM tests: the package's toy checkpoints and engine inspection, prompts, cleanup."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import torch

from reshard.apps.toy_models import save_checkpoint  # noqa: F401  (re-exported for the tests)
from reshard.integrations.vllm.inspect import close_engine, engine_tensors, refit_stats  # noqa: F401

PROMPTS = ["hello world", "the quick brown fox"]


@contextmanager
def reap_engine_processes():
    """Kill the vLLM processes (``VLLM::EngineCore``, ``VLLM::Worker...``) a test started and left
    behind: when a test's process is killed while it holds an engine, the engine's processes
    outlive it (they are not told their parent died)."""
    def engine_pids() -> set[int]:
        out = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"VLLM::"):
                        out.add(int(pid))
            except OSError:
                continue
        return out

    before = engine_pids()
    try:
        yield
    finally:
        for pid in engine_pids() - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype
            or not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))]
