"""Messages and rounds: how a rank's copies become bounded, packed transfers.

All copies from rank ``s`` to rank ``d`` form one ordered stream. A rank's staging cap
(``max_bucket_bytes``: the most it stages at once) is shared by the two rounds in flight, so
each round gets ``B = round_cap(max_bucket_bytes)``, half of it (:func:`round_cap`); every
stream gets a per-round quota of ``B`` in proportion to its size (:func:`pair_quotas`)::

    q(s, d) = max(ALIGN, (B - ALIGN * max(n_s, n_d)) * A(s, d) / max(T_s, T_d))   rounded down to ALIGN

where ``A`` is the stream's staged bytes (payload plus alignment), ``T_x`` the sum of ``A``
over the streams of rank ``x`` and ``n_x`` their number (ranks ``x`` sends to plus ranks it
receives from). All streams of the busiest rank then end in the same round (about
``T / B`` rounds) instead of its big streams dragging on alone, and a rank stages at most
``sum(q) <= B`` bytes per round. The stream is cut into chunks of at most ``q`` bytes
(a copy bigger than what is left is split along its outer rows) and chunk ``j``
travels in round ``j``; both ends compute the same chunks from the same figures.

Inside a message each copy starts at a multiple of :data:`ALIGN` bytes so that
the staging bytes can be viewed as any dtype.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import numpy as np
import torch

ALIGN = 16


def check_max_bucket_bytes(value, what: str = "max_bucket_bytes") -> int | None:
    """A staging cap as a plain int (or ``None``: no cap), else ``ValueError`` naming ``what``.

    The cap is a whole number of bytes, at least :data:`ALIGN`: an int, or a float with an integral
    value (``64e6``); NaN, infinities, fractions, bools, zero and negative numbers are refused.

    >>> check_max_bucket_bytes(64e6), check_max_bucket_bytes(None)
    (64000000, None)
    >>> check_max_bucket_bytes(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: max_bucket_bytes must be a positive whole number of bytes (or None: no cap), got nan
    """
    if value is None:
        return None
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not number or not math.isfinite(value) or value != int(value) or value <= 0:
        raise ValueError(f"{what} must be a positive whole number of bytes (or None: no cap), got {value!r}")
    value = int(value)
    if value < ALIGN:
        raise ValueError(f"{what}={value} is smaller than {ALIGN} bytes")
    return value


ROUNDS_IN_FLIGHT = 2  # the reshard executor packs round j+1 and unpacks round j-1 while round j moves


def round_cap(max_bucket_bytes: int | None) -> int | None:
    """The staging cap of one round, from a rank's total staging cap ``max_bucket_bytes``: the
    executor keeps :data:`ROUNDS_IN_FLIGHT` rounds' buffers alive at once, so each gets a share.

    >>> round_cap(64 << 20) == 32 << 20, round_cap(None)
    (True, None)
    """
    return None if max_bucket_bytes is None else max(1, max_bucket_bytes // ROUNDS_IN_FLIGHT)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Copy(NamedTuple):
    """Copy box ``offsets/sizes`` of ``tensor`` from ``src_buffer`` at ``src_offsets`` to
    ``dst_buffer`` at ``dst_offsets``; ``dtype`` is the destination's (casts happen on the sender)."""

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_buffer: str
    src_offsets: tuple[int, ...]
    dst_buffer: str
    dst_offsets: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def narrow(self, dim: int, start: int, length: int) -> "Copy":
        """The sub-copy ``start:start+length`` along tensor dim ``dim``."""
        def shift(offs: tuple[int, ...]) -> tuple[int, ...]:
            k = len(offs) - len(self.sizes) + dim
            return offs[:k] + (offs[k] + start,) + offs[k + 1:]

        sizes = self.sizes[:dim] + (length,) + self.sizes[dim + 1:]
        return self._replace(offsets=shift(self.offsets), sizes=sizes, src_offsets=shift(self.src_offsets),
                             dst_offsets=shift(self.dst_offsets))


@dataclass
class Message:
    """Copies between this rank and ``peer`` in ``round``, packed back to back."""

    peer: int
    round: int
    copies: list[Copy] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Staging bytes, alignment included."""
        return sum(aligned(c.nbytes) for c in self.copies)

    @property
    def payload_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


def split_copy(c: Copy, max_bytes: int) -> list[Copy]:
    """Cut ``c`` into row-major consecutive sub-copies of at most ``max_bytes`` each."""
    esize = c.dtype.itemsize
    max_elems = max_bytes // esize
    if max_elems < 1:
        raise ValueError(f"max_bucket_bytes share {max_bytes} is smaller than one {c.dtype} element of {c.tensor!r}")
    if c.numel <= max_elems:
        return [c]
    # outermost dim whose trailing block fits
    inner = c.numel
    for dim, n in enumerate(c.sizes):
        inner //= n
        if inner <= max_elems:
            break
    rows = max(1, max_elems // inner)
    out = []
    for index in itertools.product(*(range(n) for n in c.sizes[:dim])):  # peel outer dims one index at a time
        sub = c
        for k, i in enumerate(index):
            sub = sub.narrow(k, i, 1)
        for start in range(0, c.sizes[dim], rows):
            out.append(sub.narrow(dim, start, min(rows, c.sizes[dim] - start)))
    return out


def chunk_stream(copies: list[Copy], quota: int | None) -> list[list[Copy]]:
    """Cut one pair's ordered copies into chunks of at most ``quota`` staging bytes."""
    if quota is None:
        return [copies] if copies else []
    chunks: list[list[Copy]] = []
    cur: list[Copy] = []
    used = 0
    for c in copies:
        for part in split_copy(c, quota):
            size = aligned(part.nbytes)
            if cur and used + size > quota:
                chunks.append(cur)
                cur, used = [], 0
            cur.append(part)
            used += size
    if cur:
        chunks.append(cur)
    return chunks


def pair_quotas(staged: Mapping[tuple[int, int], int], max_bucket_bytes: int | None
                ) -> dict[tuple[int, int], int | None]:
    """Per-round quota of every stream ``{(src, dst): staged bytes}`` (see module doc); ``None``: unbounded.

    >>> pair_quotas({(0, 2): 3000, (1, 2): 1000}, 1024)    # rank 2 takes 3/4 and 1/4 per round
    {(0, 2): 736, (1, 2): 240}
    """
    if max_bucket_bytes is None:
        return {p: None for p in staged}
    ranks = np.array(list(staged), np.int64).reshape(-1, 2)
    quotas = stream_quotas(ranks[:, 0], ranks[:, 1], np.fromiter(staged.values(), np.int64, len(staged)),
                           max_bucket_bytes)
    return dict(zip(staged, quotas.tolist()))


def stream_quotas(src: np.ndarray, dst: np.ndarray, staged: np.ndarray, max_bucket_bytes: int) -> np.ndarray:
    """:func:`pair_quotas` as arrays: the quota of stream ``(src[i], dst[i])`` staging ``staged[i]``
    bytes (int64; exact, as in Python integers).

    >>> stream_quotas(np.array([0, 1]), np.array([2, 2]), np.array([3000, 1000]), 1024).tolist()
    [736, 240]
    """
    if not len(staged):
        return np.zeros(0, np.int64)
    num = int(max(src.max(), dst.max())) + 1
    load = np.bincount(src, weights=staged, minlength=num) + np.bincount(dst, weights=staged, minlength=num)
    load = load.astype(np.int64)  # sums of whole bytes far below 2**53: exact
    count = np.bincount(src, minlength=num) + np.bincount(dst, minlength=num)
    room = max_bucket_bytes - ALIGN * np.maximum(count[src], count[dst])
    most = np.maximum(np.maximum(load[src], load[dst]), 1)
    if int(np.abs(room).max()) * int(staged.max()) >= 1 << 62:  # the product would leave int64: Python ints
        room, staged, most = room.astype(object), staged.astype(object), most.astype(object)
    share = room * staged // most
    return np.maximum(ALIGN, share - share % ALIGN).astype(np.int64)
