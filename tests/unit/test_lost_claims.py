"""The watch of claims in doubt not found landed (leadgate.core.runners.LostClaims): one
token to one look, bounded, and kept through a look cut short; and its users' looks
(lead review, relay, turn recovery, Idempotency-Key claims) cancelled mid-way."""

from __future__ import annotations

from leadgate.core.clock import MINUTE_MS
from leadgate.core.runners import DROPPED, LostClaims
from leadgate.operations.idempotency import HeldKey


def test_each_due_token_goes_to_one_look_and_a_token_found_is_not_watched_again() -> None:
    """Several loops of a runner share one watch: a token due is handed to one of them;
    those not found come back for a later look, the one found does not."""
    lost: LostClaims[str] = LostClaims()
    for token in ("a", "b", "c"):
        lost.watch(token, due=0, lapses=MINUTE_MS)
    first, second = lost.take_due(0), lost.take_due(0)
    assert [look.token for look in first] == ["a", "b", "c"] and second == []
    assert not lost and lost.next_due() is None
    found, *missed = first
    for look in missed:
        lost.not_found(look, 0)
    assert lost.take_due(999) == []  # the next look is one gap (first_ms) on
    assert [look.token for look in lost.take_due(1_000)] == ["b", "c"]
    assert found.token == "a" and not lost


def test_a_full_watch_drops_the_tokens_whose_lease_lapses_soonest_and_counts_them() -> None:
    """A long outage under load (a keyed request per claim in doubt) cannot grow the
    watch past its limit: the token whose lease lapses soonest goes (its lease expiry
    takes its rows back), counted and logged; the next look is found without a scan."""
    lost: LostClaims[str] = LostClaims(name="idempotency", limit=3)
    logged = DROPPED.total
    for n in range(5):
        lost.watch(f"t{n}", due=10 - n, lapses=MINUTE_MS + n)
    assert len(lost) == 3 and lost.dropped == 2 and DROPPED.total == logged + 2
    lost.watch("sooner", due=0, lapses=1)  # lapses before every one watched: not taken in
    assert len(lost) == 3 and lost.dropped == 3
    assert lost.next_due() == 6
    assert [look.token for look in lost.take_due(10)] == ["t4", "t3", "t2"]


def test_the_watch_holds_a_typed_token() -> None:
    """An Idempotency-Key claim's give-back is watched as what it is (key, owner,
    takeover), not a string of them joined."""
    lost: LostClaims[HeldKey] = LostClaims()
    held = HeldKey("org_1", "ab" * 32, "ik_1", took_over=True)
    lost.watch(held, due=0, lapses=MINUTE_MS)
    [look] = lost.take_due(0)
    assert look.token is held and look.token.took_over
