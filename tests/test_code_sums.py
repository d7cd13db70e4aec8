"""The packed sort of :mod:`reshard.planning.code_sums` against ``np.unique`` and ``np.bincount``."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.planning.code_sums import distinct_codes, sum_by_code

# codes near the largest that still carry their position (the fallback to np.unique above it)
BIG = (1 << 60) - 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 40), st.integers(BIG - 3, BIG + 3), st.integers(0, 1 << 62)),
                min_size=1, max_size=60),
       st.integers(0, 2 ** 32 - 1))
def test_distinct_codes_and_sums_are_those_of_unique_and_bincount(codes, seed):
    codes = np.array(codes, np.int64)
    weights = np.random.default_rng(seed).random(len(codes)) * 1e6
    distinct, inverse = distinct_codes(codes)
    expect, expect_inverse = np.unique(codes, return_inverse=True)
    assert distinct.tolist() == expect.tolist() and inverse.tolist() == expect_inverse.tolist()
    keys, sums = sum_by_code(codes, weights)
    assert keys.tolist() == expect.tolist()
    assert sums.tolist() == np.bincount(expect_inverse, weights=weights).tolist()  # same order of adding


def test_a_two_dimensional_array_of_codes_is_read_in_row_order():
    codes = np.array([[4, 1], [4, 0]])
    keys, sums = sum_by_code(codes, np.array([[1.0, 2.0], [3.0, 4.0]]))
    assert keys.tolist() == [0, 1, 4] and sums.tolist() == [4.0, 2.0, 4.0]
    assert distinct_codes(np.zeros(0, np.int64))[0].tolist() == []
