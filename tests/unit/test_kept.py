"""leadgate.core.kept.Kept: a value comes back only under the token it was kept with."""

from __future__ import annotations

from leadgate.core.kept import Kept


def test_a_value_comes_back_only_under_an_equal_token() -> None:
    kept: Kept[str, int] = Kept(max_entries=8)
    kept.put((1, 2), "a", 10)
    assert kept.get((1, 2), "a") == 10
    assert kept.get((1, 3), "a") is None  # something may have changed since
    assert kept.get((1, 2), "b") is None


def test_no_token_keeps_and_finds_nothing() -> None:
    kept: Kept[str, int] = Kept(max_entries=8)
    kept.put(None, "a", 10)
    assert kept.get((1,), "a") is None
    kept.put((1,), "a", 10)
    assert kept.get(None, "a") is None


def test_past_its_bound_it_starts_over_but_a_known_key_is_replaced() -> None:
    kept: Kept[int, int] = Kept(max_entries=2)
    kept.put("t", 1, 1)
    kept.put("t", 2, 2)
    kept.put("t2", 2, 22)  # a key already there: no start over
    assert (kept.get("t", 1), kept.get("t2", 2)) == (1, 22)
    kept.put("t", 3, 3)
    assert (kept.get("t", 1), kept.get("t2", 2), kept.get("t", 3)) == (None, None, 3)
