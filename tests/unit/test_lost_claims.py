"""The watch of claims in doubt not found landed (leadgate.core.runners.LostClaims): one
token to one look, bounded, and kept through a look cut short; and its users' looks
(lead review, relay, turn recovery, Idempotency-Key claims) cancelled mid-way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from leadgate.core.auth import Principal
from leadgate.core.clock import MINUTE_MS
from leadgate.core.runners import DROPPED, LostClaims
from leadgate.operations.idempotency import LEASE_MS, HeldKey, Idempotency
from leadgate.review.runner import _CLAIM_FAILED, _CLAIM_IN_DOUBT, _LostClaim
from leadgate.turns import runs
from outbox.relay import _Doubted
from tests.fakes import StallsOnce
from tests.helpers import make_org
from tests.stack import Stack

T = TypeVar("T")


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


def test_a_full_watch_never_drops_a_token_it_keeps() -> None:
    """Tokens ``keep`` holds (an Idempotency-Key answer to store: only the watch has
    it) are never what a full watch drops: a token it may drop goes instead, the newcomer
    when none is watched; there is no room for another kept one once every token is
    kept; and one taken for a look comes back even when the watch filled meanwhile."""
    lost: LostClaims[str] = LostClaims(limit=2, keep=lambda token: token.startswith("k"))
    lost.watch("k1", due=0, lapses=1)
    lost.watch("g1", due=0, lapses=2)
    lost.watch("g2", due=0, lapses=3)  # g1 goes (lapses soonest of those it may drop)
    assert sorted(look.token for look in lost) == ["g2", "k1"] and lost.has_room()
    lost.watch("k2", due=0, lapses=4)  # g2 goes
    assert sorted(look.token for look in lost) == ["k1", "k2"] and not lost.has_room()
    lost.watch("g3", due=0, lapses=5)  # nothing it may drop but the newcomer
    assert sorted(look.token for look in lost) == ["k1", "k2"] and lost.dropped == 3
    taken = lost.take_due(0)
    lost.watch("g4", due=1, lapses=6)
    lost.watch("g5", due=1, lapses=7)
    lost.put_back(taken)  # (the look failed): both back, g4 and g5 dropped for them
    assert sorted(look.token for look in lost) == ["k1", "k2"] and lost.dropped == 5


def test_a_kept_token_out_for_a_look_still_takes_its_room() -> None:
    """A kept token taken for a look counts against the watch's room until it comes back
    (:meth:`put_back`) or is done with (:meth:`done`): while it was out the watch said
    it had room, and a kept token watched then and the one put back took the watch past
    its limit (every token kept, none it could drop for them)."""
    lost: LostClaims[str] = LostClaims(limit=1, keep=lambda token: token.startswith("k"))
    lost.watch("k1", due=0, lapses=1)
    taken = lost.take_due(0)
    assert not lost and not lost.has_room()  # out for its look, still counted
    lost.put_back(taken)
    assert len(lost) == 1 and not lost.has_room()
    [look] = lost.take_due(0)
    lost.done(look)  # (stored: it leaves the watch)
    assert lost.has_room()
    lost.watch("g1", due=0, lapses=2)  # a token it may drop takes no kept room
    assert lost.has_room()


def test_the_watch_holds_a_typed_token() -> None:
    """An Idempotency-Key claim's give-back is watched as what it is (key, owner,
    takeover), not a string of them joined."""
    lost: LostClaims[HeldKey] = LostClaims()
    held = HeldKey("org_1", "ab" * 32, "ik_1", keep_key=True)
    lost.watch(held, due=0, lapses=MINUTE_MS)
    [look] = lost.take_due(0)
    assert look.token is held and look.token.keep_key


# ------------------------------------------------ a look cut short (cancelled)


async def cut_short(stall: StallsOnce, look: Awaitable[object]) -> None:
    """Run ``look`` until it waits on the stalled database call, then cancel it (as a
    shutdown, or a request whose client went away, does)."""
    task = asyncio.ensure_future(look)
    await asyncio.wait_for(stall.entered.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def stalled(stack: Stack, monkeypatch: pytest.MonkeyPatch, method: str) -> StallsOnce:
    stall = StallsOnce(getattr(stack.db, method))
    monkeypatch.setattr(stack.db, method, stall)
    return stall


def watching(lost: LostClaims[T], stack: Stack, *tokens: T) -> Callable[[], list[T]]:
    """Watch ``tokens`` (due now); returns what is still watched, due by then, in the
    order they were watched."""
    now = stack.clock.now_ms()
    for token in tokens:
        lost.watch(token, due=now, lapses=now + 10 * MINUTE_MS)

    def left() -> list[T]:
        due = [look.token for look in lost.take_due(stack.clock.now_ms())]
        return [token for token in tokens if token in due]

    return left


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_review_runners_look_cancelled_keeps_its_tokens_watched(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = stack.lead_runner
    claims = [_LostClaim("lease_a", _CLAIM_IN_DOUBT), _LostClaim("lease_b", _CLAIM_FAILED)]
    left = watching(runner._lost, stack, *claims)
    await cut_short(stalled(stack, monkeypatch, "read"), runner._release_held())
    assert left() == claims


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("watch", ["claims", "hand-offs"])
async def test_a_relays_give_back_cancelled_keeps_its_tokens_watched(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, watch: str
) -> None:
    relay = stack.relay
    if watch == "claims":
        claims = ["lease_a", "lease_b"]
        left = watching(relay._uncertain_claims, stack, *claims)
        await cut_short(stalled(stack, monkeypatch, "tx"), relay.release_uncertain_claims())
        assert left() == claims
    else:
        doubted = [_Doubted("dlv_a", []), _Doubted("dlv_b", [])]
        still = watching(relay._doubted, stack, *doubted)
        await cut_short(stalled(stack, monkeypatch, "tx"), relay.release_doubted())
        assert still() == doubted


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_recovery_claim_cancelled_keeps_its_looks_watched(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = stack.turns.lost
    looks = [runs.RunLook("lease_a", rerun=True), runs.RunLook("lease_b", rerun=False)]
    left = watching(lost, stack, *looks)
    claim = runs.claim(
        stack.db, stack.clock, stack.ids, owner=None, orphans=stack.turns.orphans, lost=lost
    )
    await cut_short(stalled(stack, monkeypatch, "tx"), claim)
    assert left() == looks


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_an_idempotency_give_back_cancelled_keeps_its_claims_watched(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next keyed request gives back the claims in doubt that are due; cancelled
    (its client went away), those it had not given back are still watched."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    assert (await idem.begin(principal, "other", "fp")).action == "run"  # (its sweep)
    now = stack.clock.now_ms()
    held = [HeldKey(org.id, f"{n:064x}", f"ik_{n}", keep_key=False) for n in range(2)]
    for each in held:
        idem._lost.watch(each, due=now, lapses=now + LEASE_MS)
    await cut_short(stalled(stack, monkeypatch, "tx"), idem.begin(principal, "k", "fp"))
    assert [look.token for look in idem._lost.take_due(now)] == held
