"""``Idempotency-Key`` claims and database faults (leadgate.operations.idempotency), on
the class itself (the REST route's use of it: tests/integration/test_openai_surface.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.auth import Principal
from leadgate.core.errors import NOTHING_STORED, DatabaseDamaged, Unavailable
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.database.pg import PgConnection
from leadgate.operations import idempotency as idempotency_mod
from leadgate.operations.idempotency import LEASE_MS, NOT_HELD, TTL_MS, HeldAnswer, Idempotency
from tests.fakes import CommitLandsLater, DownFor, lose_the_next_commit
from tests.helpers import (
    beside_a_locker_in_key_order,
    counted,
    make_org,
    ours,
    seq_scans_only,
)
from tests.stack import Stack, build_stack
from tests.unit.test_lost_claims import cut_short, stalled


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


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_in_doubt_that_lands_late_is_given_back_for_a_retry_on_another_replica(
    stack: Stack, commit_lands_later: Callable[[Database], CommitLandsLater]
) -> None:
    """As above, but the client's retry reaches another replica, which cannot give back
    a claim whose owner token it does not know: the replica that made the claim gives
    it back when its look falls due (its loop runs :meth:`Idempotency.run_once`), and
    the retry runs. It was answered 409 ``idempotency.in_progress`` until the claim's
    lease lapsed, a minute on, unless a keyed request happened to reach the first
    replica. (PostgreSQL only: a SQLite COMMIT is never in doubt.)"""
    org = await make_org(stack)
    here = Idempotency(stack.db, stack.clock, stack.ids)
    there = Idempotency(stack.db, stack.clock, stack.ids)  # another replica's
    woken: list[bool] = []
    here.wake = lambda: woken.append(True)
    principal = Principal(org.id, frozenset())
    assert await here.run_once() is False and here.due_in_s() is None  # (nothing watched)
    assert (await here.begin(principal, "other", "fp-other")).action == "run"  # (its sweep)
    assert (await there.begin(principal, "other-2", "fp-other")).action == "run"
    late = commit_lands_later(stack.db)
    with pytest.raises(Unavailable):
        await here.begin(principal, "k-3", "fp")
    await late.land()  # after the give-back that found nothing
    assert woken and here.due_in_s() == 1.0  # its loop sleeps until the first look
    stack.clock.advance(1_000)
    assert (await there.begin(principal, "k-3", "fp")).action == "running"
    assert await here.run_once() is True  # the look, due: given back
    stack.clock.advance(1_000)  # the client's retry, after the 503's Retry-After
    claim = await there.begin(principal, "k-3", "fp")
    assert claim.action == "run" and claim.external_event_id is not None
    assert here.due_in_s() is None
    # The other keys' claims were never touched.
    assert (await here.begin(principal, "other", "fp-other")).action == "running"
    assert (await there.begin(principal, "other-2", "fp-other")).action == "running"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_give_back_loop_that_meets_the_database_away_keeps_the_claim_watched(
    stack: Stack,
    commit_lands_later: Callable[[Database], CommitLandsLater],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop's look fails (the database away again): the fault is raised for the
    loop to back off on, and the claim stays watched, due at once; the next look gives
    it back. (A swallowed failure with the token due would spin the loop.)"""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    assert (await idem.begin(principal, "other", "fp-other")).action == "run"  # (its sweep)
    late = commit_lands_later(stack.db)
    with pytest.raises(Unavailable):
        await idem.begin(principal, "k-4", "fp")
    await late.land()
    stack.clock.advance(1_000)
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.run_once()
    assert idem.due_in_s() == 0.0
    assert await idem.run_once() is True
    assert idem.due_in_s() is None
    assert (await idem.begin(principal, "k-4", "fp")).action == "run"


@pytest.mark.parametrize("keep_key", [False, True])
async def test_a_release_the_database_kept_from_being_written_is_tried_again(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, keep_key: bool
) -> None:
    """The request failed before its intake (the database away) and so did its release
    (or its lapse, after an intake in doubt): nothing holds the key, but it answered the
    client's retry 409 ``idempotency.in_progress`` until the claim's lease lapsed, a
    minute on. The hand-back is tried again when due, so the retry (after the 503's 2 s)
    runs, with the key's event id when it was kept."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    claim = await idem.begin(principal, "k-5", "fp")
    assert claim.action == "run"
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    # (Not raised: the client is told its own request's error, the give-back watched.)
    await (idem.lapse if keep_key else idem.release)(principal, claim)
    assert idem.due_in_s() == 1.0
    stack.clock.advance(2_000)  # the client's retry
    retry = await idem.begin(principal, "k-5", "fp")
    assert retry.action == "run"
    assert (retry.external_event_id == claim.external_event_id) is keep_key


@pytest.mark.parametrize("fault", ["down", "down at the first look too", "cancelled"])
async def test_an_answer_the_database_kept_from_being_stored_is_stored_by_the_watch(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The request took its message in and answered, and storing the answer failed (or
    was cut short). The answer is held and stored at the watch's look (1 s on; at once
    when cancelled; again at the next look when the database is still away then), and
    until then the key answers ``running`` with the look's wait (not the lease's 5 s):
    the retry after it gets the answer. The claim's lease was ended instead, and the
    retry took the key over and was told the answer was lost."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    claim = await idem.begin(principal, "k-6", "fp")
    assert claim.action == "run"
    answer = {"status": 502, "body": {"error": {"rule": "model.failed"}}}
    finish = idem.finish(principal, claim, answer, provisional=True)
    if fault == "cancelled":
        await cut_short(stalled(stack, monkeypatch, "tx"), finish)
    else:
        monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
        with pytest.raises(Unavailable):
            await finish
        running = await idem.begin(principal, "k-6", "fp")
        assert (running.action, running.retry_after_s) == ("running", 1)
        stack.clock.advance(1_000)  # the watch's look is due
    if fault == "down at the first look too":
        monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
        running = await idem.begin(principal, "k-6", "fp")  # (its look failed first)
        assert (running.action, running.retry_after_s) == ("running", 1)
    retry = await idem.begin(principal, "k-6", "fp")
    assert (retry.action, retry.response) == ("replay", answer)
    assert not idem._lost and _budget_free(idem)  # (nothing left held)


async def test_a_held_answer_whose_store_fails_again_is_tried_at_each_pass_and_request(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store of a held answer fails at its look (the database still away): the
    answer stays due, so the loop's next pass tries it after the loop's back-off (not a
    gap of its own) and so does the next keyed request here, which is why the 409 after
    that says ``Retry-After: 1`` (what the README says of these retries); the retry
    after the database is back gets it replayed."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    claim = await idem.begin(principal, "k-8", "fp")
    answer = {"status": 409, "body": {"error": {"rule": "turn.busy"}}}
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, claim, answer, provisional=True)
    assert idem.due_in_s() == 1.0
    stack.clock.advance(1_000)
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):  # the loop's look: it backs off
        await idem.run_once()
    stack.clock.advance(3_000)
    assert idem.due_in_s() == 0.0  # due still: the loop's next pass tries it
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    running = await idem.begin(principal, "k-8", "fp")  # (its try failed first)
    assert (running.action, running.retry_after_s) == ("running", 1)
    retry = await idem.begin(principal, "k-8", "fp")
    assert (retry.action, retry.response) == ("replay", answer)
    assert not idem._lost and _budget_free(idem)


async def test_an_answer_past_the_budget_ends_the_claims_lease(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unstored answer that does not fit in what the watch holds
    (``ANSWERS_HELD_BYTES``) is not kept: the claim's lease is ended, so the retry takes
    the key over at once with the key's event id (its intake then finds the message
    taken in: ``idempotency.lost``)."""
    monkeypatch.setattr(idempotency_mod, "ANSWERS_HELD_BYTES", 10)
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    claim = await idem.begin(principal, "k-6", "fp")
    answer = {"status": 502, "body": {"error": {"rule": "model.failed"}}}
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, claim, answer, provisional=True)
    assert not idem._lost
    retry = await idem.begin(principal, "k-6", "fp")
    assert (retry.action, retry.external_event_id) == ("run", claim.external_event_id)
    assert retry.owner != claim.owner


async def test_a_stalled_requests_failed_answer_leaves_the_takeovers_lease_alone(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of the lease after a failed store is fenced by the claim's token: a
    request that stalled past its lease (and was taken over) and then failed to store
    its answer does not end the lease of the request that took it over (whose retry
    would then run beside it)."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    stalled = await idem.begin(principal, "k-7", "fp")
    stack.clock.advance(LEASE_MS + 1)
    takeover = await idem.begin(principal, "k-7", "fp")
    assert takeover.action == "run"
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, stalled, {"status": 200, "body": {}})
    assert (await idem.begin(principal, "k-7", "fp")).action == "running"


def _held(idem: Idempotency) -> list[HeldAnswer]:
    """The answers ``idem``'s watch holds now (those out for a look not among them)."""
    return [look.token for look in idem._lost if isinstance(look.token, HeldAnswer)]


def _budget_free(idem: Idempotency) -> bool:
    """Whether nothing of the held answers' budget is taken (bytes and room alike): an
    answer stored, given up or back from a cancelled look that kept its share filled
    the budget for good, and every later answer was refused."""
    return idem._held_bytes == 0 and idem._lost.kept == 0 and idem._lost.has_room()


def _lost_answers(reason: str) -> float:
    return counted("leadgate_idempotency_answers_lost_total", reason=reason)


@pytest.mark.parametrize("budget", ["bytes", "answers"])
async def test_an_answer_out_for_a_look_counts_against_the_watchs_budget(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """The watch's budget (``ANSWERS_HELD_BYTES``, or as many answers as it watches
    tokens) has room for one answer. While that answer is out for a look (its store
    running, here cut short), a second answer's store fails: it is not held (its
    claim's lease ended, counted), and the first, back from its look, is all the watch
    holds. The second was held beside it: the watch counted only the answers it had in
    hand, and held twice its budget once the first came back."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    first = await idem.begin(principal, "k-a", "fp")
    second = await idem.begin(principal, "k-b", "fp")
    answer = {"status": 502, "body": {"error": {"rule": "model.failed"}}}
    if budget == "bytes":
        size = len(json.dumps(answer, separators=(",", ":")))
        monkeypatch.setattr(idempotency_mod, "ANSWERS_HELD_BYTES", 2 * size - 1)
    else:
        monkeypatch.setattr(idem._lost, "limit", 1)
    real_tx = stack.db.tx
    monkeypatch.setattr(stack.db, "tx", DownFor(real_tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, first, answer, provisional=True)
    stack.clock.advance(1_000)  # the watch's look is due
    stall = stalled(stack, monkeypatch, "tx")
    look = asyncio.ensure_future(idem.run_once())
    await asyncio.wait_for(stall.entered.wait(), 10)  # the answer is out for its look
    not_held, lost = NOT_HELD.total, _lost_answers(budget)
    monkeypatch.setattr(stack.db, "tx", DownFor(real_tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, second, answer, provisional=True)
    look.cancel()  # (a shutdown, say): the first answer goes back to the watch
    with pytest.raises(asyncio.CancelledError):
        await look
    assert [held.key_hash for held in _held(idem)] == [first.key_hash]
    assert (NOT_HELD.total, _lost_answers(budget)) == (not_held + 1, lost + 1)
    retry = await idem.begin(principal, "k-b", "fp")  # its lease ended: taken over
    assert (retry.action, retry.external_event_id) == ("run", second.external_event_id)
    replay = await idem.begin(principal, "k-a", "fp")  # (its look came first)
    assert (replay.action, replay.response) == ("replay", answer)
    assert not idem._lost and _budget_free(idem)


async def _refuse_answers_saying(db: Database, marker: str) -> None:
    """Make the database refuse (a constraint of its own, as a trigger) to store an
    answer under its key when the answer holds ``marker``: a fault that no wait ends."""
    if db.is_postgres:
        ddl = [
            "CREATE FUNCTION refuse_answer() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'answer refused' USING ERRCODE = 'check_violation'; END $$",
            "CREATE TRIGGER refuse_answer BEFORE UPDATE ON idempotency_keys FOR EACH ROW "
            f"WHEN (NEW.response::text LIKE '%{marker}%') EXECUTE FUNCTION refuse_answer()",
        ]
    else:
        ddl = [
            "CREATE TRIGGER refuse_answer BEFORE UPDATE OF response ON idempotency_keys "
            f"WHEN NEW.response LIKE '%{marker}%' BEGIN SELECT RAISE(ABORT, 'answer refused'); END"
        ]
    async with db.tx() as conn:
        for statement in ddl:
            await conn.execute(sa.text(statement))


async def test_an_answer_the_database_refuses_is_given_up_at_its_look(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A held answer whose store fails for a reason no wait ends (here the database
    refuses it: a constraint; a bug would do the same) is given up at that look: one
    ERROR naming its request and its rule, counted, and its claim's lease ended, so the
    retry takes the key over and is told the answer was lost. The answers due after it
    in the same look are stored. It was raised from every look, every 30 s at most, for
    as long as the process ran: its bytes held for ever, and every token due after it
    never looked at (the other answer here never stored)."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    refused_claim = await idem.begin(principal, "k-refused", "fp")
    other_claim = await idem.begin(principal, "k-other", "fp")
    refused: dict[str, Any] = {"status": 502, "body": {"error": {"rule": "refuse.me"}}}
    other = {"status": 409, "body": {"error": {"rule": "turn.busy"}}}
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 2, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, refused_claim, refused, request_id="req-refused")
    with pytest.raises(Unavailable):
        await idem.finish(principal, other_claim, other, provisional=True)
    await _refuse_answers_saying(stack.db, "refuse.me")
    stack.clock.advance(1_000)  # both looks are due, the refused answer's first
    given_up = _lost_answers("unstorable")
    caplog.set_level(logging.INFO, logger="leadgate.idempotency")
    await idem.run_once()  # (not raised: the loop has nothing to back off for)
    assert _held(idem) == [] and _lost_answers("unstorable") == given_up + 1
    [error] = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    said = error.getMessage()
    assert "req-refused" in said and "refuse.me" in said and "idempotency.lost" in said
    assert "IntegrityError" in said and error.exc_info is None  # (no SQL, no answer text)
    replay = await idem.begin(principal, "k-other", "fp")
    assert (replay.action, replay.response) == ("replay", other)
    await idem.run_once()  # (the lease's end, due at once)
    assert not idem._lost and _budget_free(idem)
    retry = await idem.begin(principal, "k-refused", "fp")
    assert (retry.action, retry.external_event_id) == ("run", refused_claim.external_event_id)
    assert len([r for r in ours(caplog) if r.levelno >= logging.ERROR]) == 1


@pytest.mark.parametrize("fault", ["database away", "database damaged"])
async def test_a_held_answer_is_kept_through_a_database_fault_at_its_look(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """A database fault at the look (the database away, or damaged until its operator
    repairs it) is no reason to give the answer up: the look's failure is raised for
    the loop to back off on, the answer stays held and counted, and it is stored at a
    later look. Only a fault that is not the database's gives an answer up."""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    claim = await idem.begin(principal, "k-9", "fp")
    answer = {"status": 502, "body": {"error": {"rule": "model.failed"}}}
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await idem.finish(principal, claim, answer, provisional=True)
    stack.clock.advance(1_000)
    error: Callable[[], Exception] | None = None
    if fault == "database damaged":
        error = lambda: DatabaseDamaged("index damaged")  # noqa: E731
    given_up = _lost_answers("unstorable")
    caplog.set_level(logging.INFO, logger="leadgate.idempotency")
    for _ in range(3):  # (the loop's passes, after its back-off)
        monkeypatch.setattr(
            stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False, error=error)
        )
        with pytest.raises(Unavailable if error is None else DatabaseDamaged):
            await idem.run_once()
        stack.clock.advance(5_000)
        assert [held.key_hash for held in _held(idem)] == [claim.key_hash]
    assert _lost_answers("unstorable") == given_up
    assert not [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert await idem.run_once() is True
    replay = await idem.begin(principal, "k-9", "fp")
    assert (replay.action, replay.response) == ("replay", answer)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_given_back_between_its_insert_and_its_read_is_claimed_again(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a request's INSERT met the key's claim (held by another request), and
    that claim was given back (deleted on another connection: a watch's give-back, or
    its request's release) before the SELECT that reads it: the SELECT found no row and
    the request was answered 500 (``NoResultFound``). The key is free: it is claimed.
    (SQLite's claim holds the write lock from its first statement: nothing comes between.)"""
    org = await make_org(stack)
    idem = Idempotency(stack.db, stack.clock, stack.ids)
    principal = Principal(org.id, frozenset())
    first = await idem.begin(principal, "k-3", "fp")
    assert first.action == "run"
    execute = PgConnection.execute
    given_back: list[bool] = []

    async def then_given_back(
        self: PgConnection, statement: sa.Executable, *args: Any, **kwargs: Any
    ) -> Any:
        result = await execute(self, statement, *args, **kwargs)
        met = isinstance(statement, sa.Insert) and statement.table.name == "idempotency_keys"
        if met and not given_back and not result.rowcount:
            given_back.append(True)
            await idem.release(principal, first)  # (its own transaction, connection)
        return result

    monkeypatch.setattr(PgConnection, "execute", then_given_back)
    claim = await idem.begin(principal, "k-3", "fp")
    assert given_back == [True]
    assert claim.action == "run" and claim.external_event_id is not None


async def test_a_sweep_deletes_its_keys_in_key_order(migrated_pg: str) -> None:
    """The TTL sweep deleted its old keys in the order its scan found them: at size a
    sequential scan, physical order. Beside a transaction holding two of those keys in
    key order (or another replica's sweep), it held the second while it waited for the
    first, and PostgreSQL ended one of the two (40P01 deadlock_detected). It now locks
    its keys in key order first: it waits for the first holding nothing."""
    await seq_scans_only(migrated_pg)
    stack = build_stack(migrated_pg)
    try:
        org = await make_org(stack)
        old = stack.clock.now_ms() - TTL_MS - 1
        k = t.idempotency_keys.c
        async with stack.db.tx() as conn:
            for key_hash in ("a", "b"):
                await conn.execute(
                    t.idempotency_keys.insert().values(
                        org_id=org.id, key_hash=key_hash, fingerprint="fp", created_at=old,
                        lease_expires_at=old, response=None, owner=None,
                    )
                )  # fmt: skip
        async with stack.db.tx() as conn:
            # The first key's newest version goes after the second's in the table: a
            # scan in physical order finds the second first.
            await conn.execute(
                t.idempotency_keys.update().where(k.key_hash == "a").values(owner=None)
            )
        idem = Idempotency(stack.db, stack.clock, stack.ids)
        principal = Principal(org.id, frozenset())
        await beside_a_locker_in_key_order(
            stack.db,
            t.idempotency_keys,
            [(org.id, "a"), (org.id, "b")],
            lambda: idem.begin(principal, "new", "fp"),  # (its sweep first)
        )
        async with stack.db.read() as conn:
            kept = (await conn.execute(sa.select(k.key_hash))).scalars().all()
        assert len(kept) == 1 and kept[0] not in ("a", "b")  # the new claim's (hashed) key
    finally:
        await stack.stop()
