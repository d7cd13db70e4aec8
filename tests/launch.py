"""Start a trainer job and an inference job as separate process groups, as in disaggregated RL.

``launch(fn, [2, 2], *args)`` spawns 4 processes: ranks 0-1 form the trainer's default gloo group,
ranks 2-3 the inference job's, and every process also gets the address of a TCP store for the
refit session, which spans both jobs. ``fn(job, job_rank, rank, world, store_addr, *args)`` runs
in each (``job`` is the index of its job, ``rank`` its rank in the refit group).
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


def _entry(rank, fn, sizes, ports, store_addr, args):
    # torch.multiprocessing stops the other processes with SIGTERM when one fails: make that an exception,
    # so that their cleanup (closing vLLM engines, whose processes would outlive them) still runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"rank {rank}: stopped because another process failed"))
    torch.set_num_threads(1)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    job = max(j for j, s in enumerate(starts) if s <= rank)
    job_rank = rank - starts[job]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[job]))
    dist.init_process_group("gloo", rank=job_rank, world_size=sizes[job], timeout=datetime.timedelta(seconds=120))
    try:
        fn(job, job_rank, rank, sum(sizes), store_addr, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, sizes: list[int], *args) -> None:
    """Run ``fn`` in ``sum(sizes)`` processes, one default group per job (see module doc)."""
    ports = [free_port() for _ in sizes]
    store_addr = f"127.0.0.1:{free_port()}"
    mp.start_processes(_entry, args=(fn, sizes, ports, store_addr, args), nprocs=sum(sizes), join=True,
                       start_method="spawn")
