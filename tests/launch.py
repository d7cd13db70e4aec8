"""Start a trainer job and an inference job as separate process groups, as in disaggregated RL.

``launch(fn, [2, 2], *args)`` spawns 4 processes: ranks 0-1 form the trainer's default gloo group,
ranks 2-3 the inference job's, and every process also gets the address of a TCP store for the
refit session, which spans both jobs. ``fn(job, job_rank, rank, world, store_addr, *args)`` runs
in each (``job`` is the index of its job, ``rank`` its rank in the refit group), once every process
of every job is up: a timeout ``fn`` sets never includes another process's start.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reshard.execution.process_group import free_port

# Spawning a process, importing torch and the test module and forming its job's group takes ~5 s
# here, ~20 s with both cores busy: 300 s is a margin of 15x or more.
READY_TIMEOUT = datetime.timedelta(seconds=300)


def _await_every_process(ready_addr: str, world: int, rank: int) -> None:
    """A barrier of all the launch's processes on the store the launcher hosts (bounded)."""
    host, _, port = ready_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=READY_TIMEOUT, wait_for_workers=False)
    if store.add("launch/ready", 1) == world:
        store.set("launch/everyone", "1")
    try:
        store.wait(["launch/everyone"])
    except RuntimeError as e:  # torch's DistStoreError is a RuntimeError
        raise RuntimeError(f"rank {rank}: not every launched process was up within {READY_TIMEOUT}") from e


def _entry(rank, fn, sizes, ports, store_addr, ready_addr, args):
    # torch.multiprocessing stops the other processes with SIGTERM when one fails: make that an exception,
    # so that their cleanup (closing vLLM engines, whose processes would outlive them) still runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"rank {rank}: stopped because another process failed"))
    torch.set_num_threads(1)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    job = max(j for j, s in enumerate(starts) if s <= rank)
    job_rank = rank - starts[job]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[job]))
    # the job's group waits for its peers' start too: 120 s, a margin of 6x over ~20 s under load
    dist.init_process_group("gloo", rank=job_rank, world_size=sizes[job], timeout=datetime.timedelta(seconds=120))
    _await_every_process(ready_addr, sum(sizes), rank)
    try:
        fn(job, job_rank, rank, sum(sizes), store_addr, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, sizes: list[int], *args) -> None:
    """Run ``fn`` in ``sum(sizes)`` processes, one default group per job (see module doc)."""
    ports = [free_port() for _ in sizes]
    store_addr = f"127.0.0.1:{free_port()}"
    ready_port = free_port()
    # hosts the barrier of _await_every_process while the processes run
    ready_store = dist.TCPStore("127.0.0.1", ready_port, is_master=True, timeout=READY_TIMEOUT, wait_for_workers=False)
    mp.start_processes(_entry, args=(fn, sizes, ports, store_addr, f"127.0.0.1:{ready_port}", args),
                       nprocs=sum(sizes), join=True, start_method="spawn")
    del ready_store
