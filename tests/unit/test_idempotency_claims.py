"""``Idempotency-Key`` claims and database faults (leadgate.operations.idempotency), on
the class itself (the REST route's use of it: tests/integration/test_openai_surface.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leadgate.core.auth import Principal
from leadgate.core.errors import NOTHING_STORED, Unavailable
from leadgate.database.db import Database
from leadgate.operations.idempotency import LEASE_MS, Idempotency
from tests.fakes import CommitLandsLater, lose_the_next_commit
from tests.helpers import make_org
from tests.stack import Stack


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_in_doubt_that_lands_after_its_give_back_is_given_back_on_the_retry(
    stack: Stack, commit_lands_later: Callable[[Database], CommitLandsLater]
) -> None:
    """The claim's COMMIT answer was lost, its give-back (right after, on a fresh
    connection) found nothing, and then the server applied the claim: the key is held
    by a request that runs nowhere. The client's retry (after the 503's 2 s) gives it
    back first and runs; it was answered 409 ``idempotency.in_progress`` until the
    claim's lease lapsed, a minute on. (PostgreSQL only: a SQLite COMMIT is never in
    doubt.)"""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    assert (await idem.begin(principal, "other", "fp-other")).action == "run"  # (its sweep)
    late = commit_lands_later(stack.db)
    with pytest.raises(Unavailable) as raised:
        await idem.begin(principal, "k-1", "fp")
    assert isinstance(raised.value.__cause__, Unavailable) and raised.value.__cause__.in_doubt
    # Told of the request, not of the key's claim: it never ran, retry it with the key.
    assert (raised.value.message, raised.value.in_doubt) == (NOTHING_STORED, False)
    await late.land()  # after the give-back that found nothing
    stack.clock.advance(500)  # a request too soon for the next look
    assert (await idem.begin(principal, "k-1", "fp")).action == "running"
    stack.clock.advance(1_500)  # the retry, after the 503's Retry-After
    claim = await idem.begin(principal, "k-1", "fp")
    assert claim.action == "run" and claim.external_event_id is not None
    # The other key's claim (another owner) was never touched.
    assert (await idem.begin(principal, "other", "fp-other")).action == "running"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_takeover_in_doubt_given_back_keeps_the_keys_event_id(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key's first request died mid-turn (it may have taken its message in, under
    the key's external event id); a request took the key over, and that claim's COMMIT
    landed with its answer lost. Its give-back ends its lease and keeps the key, so the
    retry takes it over at once with the same event id (the intake then takes the
    message in once). It deleted the key: the retry claimed it afresh under a new event
    id, and a message taken in by the first request was taken in a second time.
    (PostgreSQL only: a SQLite COMMIT is never in doubt.)"""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    first = await idem.begin(principal, "k-2", "fp")
    assert first.action == "run" and first.external_event_id is not None
    stack.clock.advance(LEASE_MS + 1)  # its process died: nothing renews the claim
    lose_the_next_commit(monkeypatch, stack.db, alone=False)
    with pytest.raises(Unavailable) as raised:
        await idem.begin(principal, "k-2", "fp")
    assert isinstance(raised.value.__cause__, Unavailable) and raised.value.__cause__.in_doubt
    assert raised.value.message == NOTHING_STORED
    stack.clock.advance(2_000)  # the client's retry
    retry = await idem.begin(principal, "k-2", "fp")
    assert (retry.action, retry.external_event_id) == ("run", first.external_event_id)
