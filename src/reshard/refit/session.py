"""The refit session: a trainer and its inference engines, connected once, refitted every step.

Call sequence, on every rank of the refit group (training ranks, inference ranks, colocated ranks
with both sides)::

    s = RefitSession.connect(source=..., destination=..., store_addr="host:5678", rank=r,
                             world_size=n)            # or group=..., or env:// as torchrun sets it
        - rendezvous: a standalone process group (beside any the process has), or the given one
        - every rank contributes its sides' parts; all ranks merge them into the same two layouts
        - one plan (direct, or hierarchical over NVLink domains), and its digest checked by every
          rank before any byte moves; a mismatch (shape, missing tensor, buffer) raises the same
          RefitError on every rank, naming the tensor and rank
    stats = s.refit(version=3)  # every step: sources send, destinations receive in place
    stats = s.refit(version=4)  # the same plan, replayed
    s.close()

A refit either commits its version on every rank or raises :class:`RefitError` on every rank
(every wait is bounded by ``timeout``). Destination state: ``"ready"`` at ``version`` after a
commit, ``"updating"`` during a refit, ``"poisoned"`` after a failed one (its buffers may hold a
mix of versions; the engine must not serve them).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from ..execution.base import RunStats, agree
from ..execution.executor import ReshardExecutor
from ..execution.group import DEFAULT_TIMEOUT, Group
from ..execution.methods import HIERARCHICAL, RESHARD, method_plan
from ..layout import Layout
from ..planning.plan import PhasedPlan
from ..tensors import LayoutError
from .sides import Side, WriteReport

DEFAULT_BUCKET_BYTES = 256 << 20
AUTO = "auto"
READY, UPDATING, POISONED = "ready", "updating", "poisoned"


class RefitError(RuntimeError):
    """A refit (or connecting a session) failed; raised on every rank, naming the phase and, where
    known, the rank(s) and tensor at fault."""


@dataclass
class RefitStats:
    """What one rank did in one refit."""

    rank: int
    version: object
    seconds: float  # the whole refit on this rank: transfer, post-processing, commit
    sent_bytes: int
    recv_bytes: int
    peak_staging_bytes: int  # transfer staging (two rounds in flight, <= max_bucket_bytes) + staged destinations
    in_place_bytes: int  # destination bytes written straight into live storage
    reprocessed_bytes: int  # destination bytes staged, then put in place by the engine's post-load path
    run: RunStats  # the executor's figures, per phase


class RefitSession:
    """One pairing of a trainer and its inference engines (see module doc)."""

    def __init__(self, group: Group, *, source: Side | None = None, destination: Side | None = None,
                 method: str = AUTO, domains: Mapping[int, int] | None = None,
                 max_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, timeout: timedelta = DEFAULT_TIMEOUT,
                 failure: str | None = None) -> None:
        self.group = group
        self.rank = group.rank
        self.source, self.destination = source, destination
        self.timeout = timeout
        self.version: object = None
        self.state = READY
        for side, what in ((source, "source"), (destination, "destination")):
            if side is not None and side.rank != self.rank:
                raise RefitError(f"rank {self.rank}: its {what} side was built for rank {side.rank}")
        t0 = time.perf_counter()
        parts = group.all_gather_object((self.rank, _part(source), _part(destination), failure), timeout)
        failed = [f"rank {r}: {f}" for r, _, _, f in parts if f]
        if failed:  # a rank could not build its side: every rank stops here, with its reason
            raise RefitError("connect: " + "; ".join(failed))
        error = None
        try:
            src = _merge([s for _, s, _, _ in parts], "source")
            dst = _merge([d for _, _, d, _ in parts], "destination")
            if domains is None and method == AUTO:
                domains = detect_domains(group)
            self.method = (HIERARCHICAL if domains else RESHARD) if method == AUTO else method
            self.plan: PhasedPlan = method_plan(self.method, src, dst, max_bucket_bytes=max_bucket_bytes,
                                                domains=domains)
            self.executor = ReshardExecutor(self.plan, group, timeout=timeout)
            error = self.executor.check(source.read() if source else {},
                                        destination.begin_write() if destination else {})
            if destination is not None:
                destination.abort_write()
        except (LayoutError, ValueError) as e:
            error = f"rank {self.rank}: {e}"
        fingerprint = self.plan.fingerprint() if error is None else "-"
        try:
            agree(group, fingerprint, error)
        except LayoutError as e:
            raise RefitError(f"connect: {e}") from None
        self.connect_s = time.perf_counter() - t0

    @classmethod
    def connect(cls, *, source: Side | None = None, destination: Side | None = None,
                group: Group | dist.ProcessGroup | None = None, store_addr: str | None = None,
                rank: int | None = None, world_size: int | None = None, backend: str | None = None,
                timeout: timedelta = DEFAULT_TIMEOUT, **options) -> "RefitSession":
        """Rendezvous and build the session. The group is ``group`` if given; else a standalone group
        over the TCP store at ``store_addr`` (``"host:port"``, hosted by rank 0) with explicit ``rank``
        and ``world_size``; else torch's default group (``env://`` as torchrun sets it, or
        ``rs.init_process_group``). ``options``: ``method`` (``"auto"``, ``"reshard"``,
        ``"hierarchical"``), ``domains`` (``{rank: NVLink domain}``), ``max_bucket_bytes``, ``failure``
        (why this rank has no side to offer: every rank raises it at once instead of waiting)."""
        if group is not None:
            g = Group.of(group)
        elif store_addr is not None:
            if rank is None or world_size is None:
                raise RefitError("connect: store_addr needs rank and world_size")
            g = Group.connect(store_addr, rank, world_size, backend=backend, timeout=timeout)
        else:
            g = Group()
        try:
            return cls(g, source=source, destination=destination, timeout=timeout, **options)
        except BaseException:
            if g is not group:
                g.close()
            raise

    def refit(self, version: object = None) -> RefitStats:
        """Move this step's weights: sources send, destinations receive, every rank commits ``version``.
        Collective over the group; raises :class:`RefitError` on every rank if any rank fails."""
        t0 = time.perf_counter()
        self.state = UPDATING
        report, error, run = WriteReport(), None, None
        try:
            src = self.source.read() if self.source else {}
            dst = self.destination.begin_write() if self.destination else {}
            run = self.executor.run(src, dst)
            if self.destination is not None:
                report = self.destination.end_write()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        outcomes = self.group.all_gather_object((self.rank, error), self.timeout)
        failed = [e for _, e in outcomes if e]
        if failed:
            self.state = POISONED
            raise RefitError(f"refit to version {version!r} failed: " + "; ".join(failed))
        self.version, self.state = version, READY
        return RefitStats(self.rank, version, time.perf_counter() - t0, run.sent_bytes, run.recv_bytes,
                          run.peak_staging_bytes + report.staging_bytes, report.in_place_bytes,
                          report.reprocessed_bytes, run)

    def close(self) -> None:
        """Release the session's group (a standalone one; torch's groups belong to their owner)."""
        self.group.close()


def _part(side: Side | None) -> Layout | None:
    return None if side is None else side.layout


def _merge(parts: list[Layout | None], what: str) -> Layout:
    got = [p for p in parts if p is not None]
    if not got:
        raise LayoutError(f"no rank holds a {what} side")
    return Layout.merge(got)


def detect_domains(group: Group) -> dict[int, int] | None:
    """NVLink domains on GPUs: ranks on one host share one (the common case of 8-GPU nodes);
    ``None`` on CPUs (gloo), where there is no NVLink to use."""
    if group.backend != "nccl":
        return None
    hosts = group.all_gather_object(os.environ.get("RESHARD_DOMAIN") or socket.gethostname())
    index = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return {r: index[h] for r, h in enumerate(hosts)} if len(index) > 1 else None


__all__ = ["AUTO", "DEFAULT_BUCKET_BYTES", "POISONED", "READY", "RefitError", "RefitSession", "RefitStats",
           "UPDATING", "detect_domains"]
