"""Bytes per rank pair held as three arrays, readable as the ``{(src, dst): bytes}`` map.

The cost model reads millions of pairs at scale (a pipelined plan's chunks on 3,072 ranks);
building a dict of them, then arrays again, costs more than the sums. :class:`PairArrays`
keeps the arrays (sorted by pair, positive bytes) and builds the dict only when asked.

>>> pairs = PairArrays(np.array([0, 1]), np.array([2, 3]), np.array([100, 40]))
>>> dict(pairs), pairs[(1, 3)], len(pairs)
({(0, 2): 100, (1, 3): 40}, 40, 2)
>>> pairs.rank_totals(4).tolist()     # bytes each rank sends or receives
[100, 40, 100, 40]
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import numpy as np


class PairArrays(Mapping):
    """``{(src, dst): bytes}`` as arrays ``src``, ``dst``, ``nbytes`` (int64, one entry per pair,
    in the order of the map's keys)."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        self.src = np.asarray(src, np.int64)
        self.dst = np.asarray(dst, np.int64)
        self.nbytes = np.asarray(nbytes, np.int64)

    @cached_property
    def _dict(self) -> dict[tuple[int, int], int]:
        return dict(zip(zip(self.src.tolist(), self.dst.tolist()), self.nbytes.tolist()))

    def __getitem__(self, pair: tuple[int, int]) -> int:
        return self._dict[pair]

    def __iter__(self):
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self.nbytes)

    def __eq__(self, other) -> bool:
        return dict(self) == dict(other) if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return f"PairArrays({self._dict!r})"

    def rank_totals(self, num_ranks: int, weights: np.ndarray | None = None) -> np.ndarray:
        """Per rank, the sum of ``weights`` (default: the bytes) of the pairs it is in, as either end."""
        w = self.nbytes if weights is None else weights
        return (np.bincount(self.src, weights=w, minlength=num_ranks)
                + np.bincount(self.dst, weights=w, minlength=num_ranks)).astype(np.int64)


__all__ = ["PairArrays"]
