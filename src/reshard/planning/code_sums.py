"""Distinct integer codes and sums per code, for the cost model's millions of (chunk, pair) codes.

``np.unique(codes, return_inverse=True)`` argsorts: on this project's scale (13.5 million codes
for one phase of a 2,048-GPU plan) that takes seconds. Codes are non-negative and small enough
that each can carry its position in its low bits: one plain sort of those packed values then
gives the same order (ties kept in position order) several times faster.

>>> codes, inverse = distinct_codes(np.array([7, 3, 7, 0]))
>>> codes.tolist(), inverse.tolist()
([0, 3, 7], [2, 1, 2, 0])
>>> keys, sums = sum_by_code(np.array([7, 3, 7]), np.array([1.0, 2.0, 4.0]))
>>> keys.tolist(), sums.tolist()
([3, 7], [2.0, 5.0])
"""

from __future__ import annotations

import numpy as np


def distinct_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct, inverse)`` as ``np.unique(codes.ravel(), return_inverse=True)`` gives them, for
    integer ``codes`` (read in row order): the distinct codes ascending, each code's index among them.
    Codes that are negative or too large to carry their position go through ``np.unique`` itself."""
    codes = np.asarray(codes).reshape(-1)
    n = len(codes)
    bits = max(n.bit_length(), 1)
    if not n or codes.min() < 0 or int(codes.max()) >= 1 << (63 - bits):
        distinct, inverse = np.unique(codes, return_inverse=True)
        return distinct, inverse.reshape(-1)
    packed = (codes.astype(np.int64) << bits) | np.arange(n, dtype=np.int64)
    packed.sort()
    position = packed & ((1 << bits) - 1)
    packed >>= bits
    starts = np.empty(n, bool)
    starts[0] = True
    np.not_equal(packed[1:], packed[:-1], out=starts[1:])
    inverse = np.empty(n, np.int64)
    inverse[position] = np.cumsum(starts) - 1
    return packed[starts], inverse


def sum_by_code(codes: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct codes ascending, weights summed per code)``; each sum adds its weights in their
    order in ``weights``, as ``np.bincount`` does."""
    distinct, inverse = distinct_codes(codes)
    return distinct, np.bincount(inverse, weights=np.asarray(weights).reshape(-1), minlength=len(distinct))


def sum_rows_by_code(codes: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct codes ascending, the rows [n, k] summed per code)``: ``np.add.at`` along the first
    axis, by one sort and ``np.add.reduceat`` (several times faster on the cost model's few long rows;
    flattening each row into codes for :func:`sum_by_code` is not). Integer rows sum exactly in any order.

    >>> keys, sums = sum_rows_by_code(np.array([2, 0, 2]), np.array([[1, 2], [3, 4], [5, 6]]))
    >>> keys.tolist(), sums.tolist()
    ([0, 2], [[3, 4], [6, 8]])
    """
    if not len(codes):
        return codes, rows[:0]
    order = np.argsort(codes, kind="stable")
    codes = codes[order]
    starts = np.flatnonzero(np.concatenate([[True], codes[1:] != codes[:-1]]))
    return codes[starts], np.add.reduceat(rows[order], starts, axis=0)


__all__ = ["distinct_codes", "sum_by_code", "sum_rows_by_code"]
