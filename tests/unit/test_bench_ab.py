"""``bench.ab``'s slice-by-slice spread, which the performance notes quote."""

from __future__ import annotations

import math

import pytest

from bench.ab import paired_spread


def test_the_spread_is_over_back_to_back_pairs() -> None:
    low, mid, high = paired_spread([1.1, 0.9, 1.0, 1.5], [1.0, 1.0, 1.0, 1.0])
    assert (low, mid, high) == pytest.approx((-0.1, 0.05, 0.5))


def test_a_slice_that_completed_nothing_is_left_out() -> None:
    # Unfiltered, the NaNs stay where they are in the sorted list (NaN compares false
    # both ways) and come out as the minimum and the maximum.
    low, mid, high = paired_spread([math.nan, 1.2, 0.8, 1.0], [1.0, 1.0, 1.0, math.nan])
    assert (low, mid, high) == pytest.approx((-0.2, 0.0, 0.2))


def test_no_pair_left_gives_no_figure() -> None:
    assert all(math.isnan(x) for x in paired_spread([math.nan], [1.0]))
