"""Staged receives: a refit lands beside the live weights and is put in place only after it committed.

A destination side written in place holds a mix of versions while the bytes arrive, so it cannot
serve, and a refit that fails part way poisons it. :class:`StagedSide` wraps any destination
:class:`~reshard.refit.sides.Side`: a refit writes every byte of this rank into staging (the
side's own staging for the buffers its engine post-processes, a shadow buffer for each live one),
the live tensors stay as they were, and :meth:`StagedSide.apply` puts the staged bytes in place
once every rank has committed. Per rank, a refit to version 2 over live version 1::

    step                 live buffers        staging           may serve
    receive (refit)      version 1           filling with 2    version 1
    prepared             version 1           all of 2, in the  version 1
                                             engine's form
    committed            version 1           all of 2          version 1
    apply()              version 2           freed             version 2 (after the copy)
    receive fails        version 1           dropped           version 1 (nothing torn)

Once every byte arrived, before the commit decision, the wrapped side may *prepare* what it
staged (:meth:`~reshard.refit.sides.Side.prepare_staged`: a vLLM worker runs the engine's post-load
processing on copies of its layers there, the repacking the CPU kernels need), still beside the
live state, so that :meth:`apply` only swaps it in. A failure while preparing fails the refit on
every rank before the commit, like any other, and leaves the live version serving.

On CUDA the receive runs on a side stream of its own (:meth:`StagedSide.receiving`), so that the
engine's kernels on its current stream are not ordered behind the refit's copies; the end of the
receive is recorded as an event, and :meth:`apply` makes its stream wait for that event before it
copies. That path is written for NCCL engines and has not run here (this machine has no GPU).

The staging costs :attr:`StagedSide.staging_bytes` per rank, bounded by ``limit_bytes`` (the
option ``max_receive_staging_bytes``), checked when the side is made. :meth:`apply` is local: a
copy of each staged box into its live buffer, then the wrapped side's own post-processing
(:meth:`~reshard.refit.sides.Side.end_write`: vLLM's layerwise reload, for instance).

>>> import torch, reshard as rs
>>> from reshard.refit.sides import Side
>>> w = torch.zeros(2, 3)
>>> side = StagedSide(Side.from_layout(rs.Layout.from_placements(rs.TensorSpec("w", (2, 3), torch.float32),
...     [0], (1,), [rs.Replicate()]), 0, {"w": w}))
>>> buffers = side.begin_write(); _ = buffers["w"].fill_(7.0); _ = side.end_write()
>>> float(w.sum()), side.staged            # received and committed, not yet in place
(0.0, True)
>>> report = side.apply(); float(w.sum()), report.paths
(42.0, {'w': 'staged'})
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..execution import faults
from ..tensors import LayoutError, buffer_view
from .sides import Side, WriteReport

STAGED, STAGED_REPROCESSED = "staged", "staged, reprocessed"  # WriteReport.paths of a staged refit


class StagedSide:
    """``side`` (a destination side) receiving into staging, put in place by :meth:`apply` (see module
    doc). ``limit_bytes``: the most staging this rank may hold (None: no bound); more is a
    LayoutError naming the rank and the option."""

    def __init__(self, side: Side, limit_bytes: int | None = None) -> None:
        self.side = side
        self.rank, self.layout, self.tensors = side.rank, side.layout, side.tensors
        self.staging_bytes = side.layout_bytes()  # every byte of this rank's pieces lands in staging first
        if limit_bytes is not None and self.staging_bytes > limit_bytes:
            raise LayoutError(f"rank {side.rank}: a staged receive needs {self.staging_bytes} bytes of staging, more "
                              f"than max_receive_staging_bytes={limit_bytes}; raise it, or receive in place "
                              f"(receive='in-place')")
        self._buffers: dict[str, torch.Tensor] | None = None  # what the last receive wrote (None: nothing staged)
        self._shadows: dict[str, torch.Tensor] = {}
        self._received = False
        self._arrived = None  # CUDA: an event recorded on the receive's stream once every byte arrived

    @property
    def device(self) -> torch.device:
        tensor = next(iter(self.side.tensors.values()), None)
        return getattr(self.side, "device", None) or (tensor.device if tensor is not None else torch.device("cpu"))

    @contextmanager
    def receiving(self):
        """Where a staged receive runs: on CUDA a side stream of this thread's own (see module doc), else as is."""
        device = self.device
        if device.type != "cuda":
            yield
            return
        torch.cuda.set_device(device)  # the current device is per thread: a receive thread has to set it
        with torch.cuda.stream(torch.cuda.Stream(device)):
            yield

    @property
    def staged(self) -> bool:
        """Whether a received version waits to be put in place."""
        return self._buffers is not None and self._received

    # ------------------------------------------------------------------ the session's calls
    def begin_write(self) -> dict[str, torch.Tensor]:
        """Staging for every buffer this rank receives: the side's own staging, a shadow of each live buffer."""
        self.abort_write()
        inner = self.side.begin_write()
        live = {name for name, tensor in inner.items() if self.side.tensors.get(name) is tensor}
        self._shadows = {name: torch.empty_like(inner[name]) for name in sorted(live)}
        self._buffers = {**inner, **self._shadows}
        self._received = False
        return dict(self._buffers)

    def end_write(self) -> WriteReport:
        """Every byte has arrived (before the commit decision): the wrapped side prepares what it staged
        (beside the live state); nothing is put in place yet."""
        self.side.prepare_staged()
        if self.device.type == "cuda":
            self._arrived = torch.cuda.Event()
            self._arrived.record()
        self._received = True
        return WriteReport(staging_bytes=self.staging_bytes)

    def abort_write(self) -> None:
        """Drop what is staged; the live buffers are untouched."""
        if self._buffers is not None:
            self.side.abort_write()
        self._buffers, self._shadows, self._received, self._arrived = None, {}, False, None

    def apply(self) -> WriteReport:
        """Put the staged version in place (local): each staged box into its live buffer, then the side's
        own post-processing. Returns what went where, per buffer (:attr:`WriteReport.paths`)."""
        if not self.staged:
            raise RuntimeError(f"rank {self.rank}: no received version is staged to put in place")
        faults.hit("apply")
        shadows = self._shadows
        stream = _wait_for(self._arrived)
        with torch.inference_mode():  # live parameters are autograd leaves or inference tensors
            for name, shadow in shadows.items():
                _copy_pieces(self.side, name, shadow)
                if stream is not None:  # allocated on the receive's stream: free it only after these copies
                    shadow.record_stream(stream)
        self._buffers, self._shadows, self._received, self._arrived = None, {}, False, None
        report = self.side.end_write()
        paths = {name: STAGED for name in shadows}
        paths.update({name: STAGED_REPROCESSED for name in self.side.layout.buffers(self.rank) if name not in shadows})
        return WriteReport(in_place_bytes=report.in_place_bytes, reprocessed_bytes=report.reprocessed_bytes,
                           staging_bytes=self.staging_bytes, paths=paths)

    def layout_bytes(self, buffers=None) -> int:
        return self.side.layout_bytes(buffers)

    def read(self):
        return self.side.read()


def _wait_for(event):
    """Order this thread's current CUDA stream after ``event`` (None: not on CUDA); the stream."""
    if event is None:
        return None
    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    return stream


def _copy_pieces(side: Side, name: str, shadow: torch.Tensor) -> None:
    """The boxes of ``side``'s pieces in buffer ``name``, from ``shadow`` into the live buffer (the whole
    buffer at once where the pieces cover it)."""
    live = side.tensors[name]
    pieces = [p for p in side.layout.pieces(side.rank) if p.buffer == name]
    if sum(math.prod(p.sizes) for p in pieces) == live.numel():  # pieces of one rank do not overlap
        live.copy_(shadow)
        return
    for p in pieces:
        buffer_view(live, p.buffer_offsets, p.sizes).copy_(buffer_view(shadow, p.buffer_offsets, p.sizes))


__all__ = ["STAGED", "STAGED_REPROCESSED", "StagedSide"]
