"""Forming the one process group a refit runs over, and spawning local ranks.

Ranks ``0 .. M-1`` are usually the training (source) side and ``M .. M+N-1`` the
inference (destination) side, but plans use global ranks, so any assignment works,
colocated ranks included.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    store_addr: str | None = None,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> dist.ProcessGroup:
    """Join the refit group and return it.

    With ``store_addr=None`` the rendezvous is ``env://`` (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` as torchrun sets them); otherwise it is
    a TCP store at ``"host:port"`` with explicit ``rank`` and ``world_size``.
    On CUDA each process uses device ``LOCAL_RANK`` (or ``rank % device_count``).
    """
    backend = backend or default_backend()
    if store_addr is None:
        init_method = "env://"
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    else:
        if rank is None or world_size is None:
            raise ValueError("init_process_group: store_addr needs explicit rank and world_size")
        init_method = f"tcp://{store_addr}"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return dist.group.WORLD


def _ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A free TCP port on loopback, outside the kernel's ephemeral range: a port the kernel hands out
    (gloo's own connections take them) could be taken between this call and the store binding it."""
    ephemeral = _ephemeral_ports()
    for _ in range(200):
        port = random.randrange(10000, ephemeral.start) if ephemeral.start > 11000 else random.randrange(10000, 65536)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, addr: str, backend: str | None, timeout: timedelta,
           args: tuple) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, store_addr=addr, backend=backend, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, backend: str | None = None,
          timeout: timedelta = timedelta(minutes=5)) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes joined in one group
    (``timeout`` bounds the waits of torch's own collectives on it; executors and sessions take theirs).

    ``fn`` must be importable (a module-level function). Raises if any process fails.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive int, got {world_size!r}")
    addr = f"127.0.0.1:{free_port()}"
    mp.start_processes(_entry, args=(fn, world_size, addr, backend, timeout, args), nprocs=world_size, join=True,
                       start_method="spawn")
