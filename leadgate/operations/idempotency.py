"""``Idempotency-Key`` of ``POST /v1/chat/completions``: one turn per key.

The same key in the same organization within :data:`TTL_MS` (24 h) runs at most one turn:
the first request's answer is stored and every later request gets it back (or the same
409); a request with the same key but a different body (or session) is refused (400,
``idempotency.mismatch``). Only a SHA-256 of (organization, key) is stored, with a
SHA-256 of the request (its fingerprint).

While the first request runs, a second one gets 409 ``idempotency.in_progress`` with
``Retry-After`` (at most :data:`RETRY_AFTER_MAX_S`). The request running keeps its claim
fresh (:meth:`Idempotency.held` renews it every :data:`RENEW_EVERY_S`); once nothing
renews it (its process died) it lapses after :data:`LEASE_MS`, and the next request takes
it over and runs the turn again with the same external event id, which the intake
de-duplicates in its own transaction (``inbound_events``): a message that was already
taken in is not taken twice (the turn answers :class:`~leadgate.core.types.Duplicate`,
which the route reports as an answer that was lost with the crash), and one that was not
is taken now. A message whose turn was recorded as a run (a worker with a lead) is not
lost: the takeover runs that turn itself when no process runs it
(:func:`leadgate.turns.runs.claim_for_retry`), or waits for turn recovery's rerun, which
stores its answer under the key (:meth:`Idempotency.store_recovered`). A release that
a database fault kept from being written is tried again (:meth:`Idempotency.release`),
not left to the lease. An answer that a fault kept from
being stored after the turn (:meth:`Idempotency.finish`) is kept in memory (up to
:data:`ANSWERS_HELD_BYTES`, and as many as the watch holds tokens, those out for a look
counted: a give-back never takes an answer's place) and stored by the same watch once
the database is back: the retry gets it replayed. While either waits,
``idempotency.in_progress`` names the watch's next look as its ``Retry-After``. Past
that budget, once the process that held it stopped, or once its store failed for a
reason that is no database fault (the database refuses it, a bug: no wait would store
it, :meth:`Idempotency._give_up`), the claim lapses and the retry is told the answer was
lost (a busy answer is told busy again: the intake knows the message was recorded busy).

Each claim carries an owner token (``idempotency_keys.owner``): its renewals and its
release are fenced by it, so a request that stalled past its lease (and was taken over)
can neither extend nor delete the claim of the request that took it over. Its answer is
still stored by :meth:`Idempotency.finish` when it has one: the intake let only one of
the two take the message in, so it is the only real answer there is, and it is stored
over the takeover's "lost" answer whichever of the two finishes first.

Where the answer is written: a turn's own answer (the completion or the gated 409; a
stream's frames, its closing ones made before they are sent) by :meth:`Idempotency.store`
in the turn's last transaction, with the reply or the withheld text, so that the two
commit together or not at all (a crash after that commit leaves a replayable answer, and
a fault storing it fails the turn: ``turn.interrupted``). Every other answer by
:meth:`Idempotency.finish` after the turn, in a transaction of its own: a "lost" one and
the busy 409 (decided by the intake: the turn has no last transaction), and an error
after the message was taken in (the turn's transaction is what failed, or never came).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.core.auth import Principal
from leadgate.core.clock import HOUR_MS, MINUTE_MS, Clock, IdFactory, RandomIds
from leadgate.core.errors import (
    NOTHING_STORED,
    DatabaseDamaged,
    LeadgateError,
    Unavailable,
    ValidationError,
    log_failure,
)
from leadgate.core.logs import Tally, loggable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import Lost, LostClaims, seconds_until
from leadgate.core.tasks import alongside
from leadgate.core.types import Gated, Reply
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.faults import unavailable
from leadgate.database.sql import insert_ignore_stmt, is_locked, locked_by_id

#: How long a key's first answer is kept and replayed.
TTL_MS = 24 * HOUR_MS
#: How long a claim nobody renews holds the key (its request died, or could not release
#: it): a minute, not the 15 it was, which locked a key that long after a crash, a
#: database fault, or a client gone mid-stream.
LEASE_MS = MINUTE_MS
#: How often a running request renews its claim (real seconds: a background task).
RENEW_EVERY_S = 20.0
#: The longest ``Retry-After`` of ``idempotency.in_progress``: the official clients wait
#: that long between their (two) retries, so a wait taken from the lease left them
#: idle for up to a minute for an answer that came in seconds.
RETRY_AFTER_MAX_S = 5
#: How often a claim tries its INSERT again when the claim it met was given back before
#: it could read it (PostgreSQL: the give-back committed between the two statements).
CLAIM_TRIES = 3
#: The most bytes (as JSON) of answers a process keeps in memory for its watch to store,
#: when a database fault kept them from being stored after their turn
#: (:meth:`Idempotency.finish`), those out for a look (their store running) included;
#: an answer past it is not kept: its claim's lease is ended instead, and the retry is
#: told the answer was lost.
ANSWERS_HELD_BYTES = 16 * 1024 * 1024
#: Keys are 1..255 printable ASCII characters.
KEY_LIMIT = 255
#: Expired keys are deleted at most this often per process.
SWEEP_EVERY_MS = 10 * MINUTE_MS

_K = t.idempotency_keys.c
log = logging.getLogger("leadgate.idempotency")

#: Answers a fault kept from their keys that the watch had no room for (past
#: :data:`ANSWERS_HELD_BYTES`, or as many answers held as it watches tokens): their
#: claims' leases are ended instead. One WARNING a minute at most.
NOT_HELD = Tally(
    log,
    "%d unstored Idempotency-Key answer(s) not held (the %s held reached %d): their "
    "claims' leases are ended, and their retries are told the answer was lost",
    every_s=60.0,
)


@dataclass(frozen=True)
class Claim:
    """What :meth:`Idempotency.begin` decided.

    ``run``: this request runs the turn, with ``external_event_id`` (then
    :meth:`Idempotency.finish` or :meth:`Idempotency.release`). ``replay``: answer
    ``response`` (what :meth:`finish` stored). ``running``: the first request is still
    running; retry after ``retry_after_s``.
    """

    action: str
    key_hash: str
    external_event_id: str | None = None
    #: The claim's token (``run`` only): its renewals and release are fenced by it.
    owner: str | None = None
    response: dict[str, Any] | None = None
    retry_after_s: int = 1
    #: The claim took a lapsed one over (``run`` only): its event id is the first
    #: request's, under which that request may have taken its message in.
    took_over: bool = False


def fingerprint(*parts: bytes) -> str:
    """SHA-256 of a request's parts (each length-prefixed, so they cannot run together)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def _check_key(key: str) -> str:
    if not 1 <= len(key) <= KEY_LIMIT or not all(" " <= ch <= "~" for ch in key):
        raise ValidationError(
            f"Idempotency-Key must be 1 to {KEY_LIMIT} printable ASCII characters",
            rule="idempotency.key",
        )
    return key


class Idempotency:
    """Claims, answers and releases idempotency keys (see the module docstring).

    Also a runner (:meth:`run_once`, :meth:`due_in_s`): every process that serves the
    REST API runs it in a loop (woken through :attr:`wake`), which gives back the
    claims in doubt that landed after their give-back when their look falls due, and
    stores the answers a fault kept from being stored (:class:`HeldAnswer`)."""

    name = "idempotency"

    def __init__(self, db: Database, clock: Clock, ids: IdFactory | None = None) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids or RandomIds()
        self._next_sweep = 0
        #: wakes the loop that runs :meth:`run_once` (set by the composition root): a
        #: token added to the watch may be due sooner than the loop's sleep
        self.wake: Callable[[], None] = lambda: None
        #: claims in doubt whose give-back found nothing (see :meth:`_give_back_lost`),
        #: and answers waiting to be stored (:meth:`finish`)
        #: (an answer held is never dropped for a give-back: :meth:`_hold` refuses it
        #: room instead, which ends its claim's lease at once)
        self._lost: LostClaims[HeldKey | HeldAnswer] = LostClaims(
            name="idempotency",
            on_watch=lambda: self.wake(),
            keep=lambda token: isinstance(token, HeldAnswer),
        )
        #: the bytes of the answers held (:meth:`_hold`), out for a look or not: what
        #: :data:`ANSWERS_HELD_BYTES` bounds (the watch's own count sees only the answers
        #: in hand, and one held while another was out for a look went past the budget)
        self._held_bytes = 0

    def due_in_s(self) -> float | None:
        """Seconds (by this clock) until the next look for a claim in doubt is due, or
        None when none is watched: the loop sleeps no longer than this."""
        return seconds_until(self.clock.now_ms(), self._lost.next_due())

    async def run_once(self) -> bool:
        """Look for the claims in doubt whose look is due (:meth:`_give_back_lost`),
        without waiting for a keyed request here: the client's retry may reach another
        replica, which cannot give back a claim it does not hold, and was answered 409
        ``idempotency.in_progress`` until the claim's lease lapsed, a minute on. True
        when a token left the watch (its claim given back, its lease lapsed, or its
        answer stored). A failed look is raised (the loop backs off)."""
        if not self._lost:  # (every pass: nothing to look at without a fault)
            return False
        watched = len(self._lost)
        failure = await self._give_back_lost(self.clock.now_ms())
        if failure is not None:
            raise failure
        return len(self._lost) < watched

    async def begin(self, principal: Principal, key: str, request_fingerprint: str) -> Claim:
        """Claim ``key`` for this request, or say why not (400 when the key was used for
        another request)."""
        key_hash = fingerprint(principal.org_id.encode(), _check_key(key).encode())
        org = principal.org_id
        now = self.clock.now_ms()
        await self._sweep(now)
        owner = self.ids.new("ik")
        fresh = {
            "org_id": org,
            "key_hash": key_hash,
            "fingerprint": request_fingerprint,
            "created_at": now,
            "lease_expires_at": now + LEASE_MS,
            "response": None,
            "owner": owner,
        }
        if self._lost:  # (only after a claim in doubt; a failure is the claim's to meet)
            await self._give_back_lost(now)
        took_over: list[bool] = []  # set once a takeover's UPDATE ran
        try:
            claim = await self._claim(key_hash, request_fingerprint, now, fresh, took_over)
        except Unavailable as fault:
            # The claim's COMMIT may have landed with its answer lost (PostgreSQL: the
            # connection dropped after the server committed). Kept, that claim would
            # answer the client's retry 409 ``idempotency.in_progress`` for a request
            # that runs nowhere, until its lease lapsed. Given back now, fenced by its
            # owner token (:meth:`_give_back`); in doubt and not found (or the database
            # still away), looked for again (:meth:`_give_back_lost`).
            token = HeldKey(org, key_hash, owner, keep_key=bool(took_over))
            try:
                found = await self._give_back(token)
            except Exception:  # (the database still away: the next request looks)
                found, due = False, now
            except BaseException:  # (cancelled: the next request looks, if in doubt)
                if fault.in_doubt:
                    self._lost.watch(token, due=now, lapses=now + LEASE_MS)
                raise
            else:
                due = self.clock.now_ms() + self._lost.first_ms
            if fault.in_doubt and not found:
                self._lost.watch(token, due=due, lapses=now + LEASE_MS)
            if fault.in_doubt:
                # Only the key's claim may have been written, and it is given back (or
                # watched): nothing of the request ran, and its retry with the key is
                # what to do. The fault's own "it may have been stored, check whether
                # it was" would send the client looking for a request that never ran.
                told = Unavailable(
                    NOTHING_STORED, rule=fault.rule, retry_after_s=fault.retry_after_s
                )
                told.detail = fault.detail
                raise told from fault
            raise
        if claim.action == "running" and self._lost:  # (no cost without a fault)
            return self._next_look(org, claim, now)
        return claim

    def _next_look(self, org_id: str, claim: Claim, now: int) -> Claim:
        """``claim`` (running) whose ``Retry-After`` is this process's next look at the
        key, when it watches one (a give-back or an answer to store): the key can be
        retried then, which is often sooner than the cap of the lease's minute. Another
        replica knows nothing of the watch, and says what the lease says."""
        looks = [
            lost.due
            for lost in self._lost
            if lost.token.org_id == org_id and lost.token.key_hash == claim.key_hash
        ]
        if not looks:
            return claim
        wait_s = max(1, min(claim.retry_after_s, -(-(min(looks) - now) // 1000)))
        return dataclasses.replace(claim, retry_after_s=wait_s)

    async def _give_back_lost(self, now: int) -> Exception | None:
        """The server may apply a claim in doubt after its give-back found nothing (the
        give-back, on a fresh connection, raced it): the key would then answer
        ``idempotency.in_progress`` until the claim's lease lapsed, a minute, for a
        request that runs nowhere. So the give-back is tried again, a second on and
        then at doubling gaps until that lease would have lapsed
        (:class:`~leadgate.core.runners.LostClaims`), by this process's loop
        (:meth:`run_once`) or the next keyed request here, whichever comes first (the
        client's retry, when it comes here: the 503 says 2 to 4 s). An answer held for its
        key (:class:`HeldAnswer`) is stored, and done with once its statement ran; one
        whose store fails for a reason that is no database fault is given up
        (:meth:`_give_up`), and the look goes on. A database fault is returned (the
        tokens not looked at stay watched, due as before: each keyed request here tries
        them again, and the loop after its back-off, 0.5 s doubling to 5 s, so a
        ``Retry-After`` for them says 1)."""
        due = self._lost.take_due(now)
        for n, lost in enumerate(due):
            token = lost.token
            try:
                if isinstance(token, HeldAnswer):
                    await self._store_held(token)
                    self._let_go(lost, token)
                    continue
                found = await self._give_back(token)
            except Exception as exc:
                if isinstance(token, HeldAnswer) and _never_stored(exc):
                    self._give_up(lost, token, exc)
                    continue
                self._lost.put_back(due[n:])
                return exc
            except BaseException:  # (the request cancelled: the rest stay watched)
                self._lost.put_back(due[n:])
                raise
            if not found:
                self._lost.not_found(lost, now)
        return None

    async def _give_back(self, token: HeldKey) -> bool:
        """Give back the claim ``token`` names while it holds its key with no answer
        stored; True when it did. A new claim is deleted (the key is free again), as
        :meth:`release` does. A takeover's key is kept with its lease ended, as
        :meth:`lapse` does: it holds the external event id under which the request that
        died may have taken its message in, and the retry must take it over with that id
        (deleted, the retry claimed it afresh under a new one, and the intake took the
        message in a second time)."""
        held = (
            _K.org_id == token.org_id,
            _K.key_hash == token.key_hash,
            _K.owner == token.owner,
            _K.response.is_(None),
        )
        async with self.db.tx() as conn:
            if token.keep_key:
                statement: sa.Executable = (
                    t.idempotency_keys.update()
                    .where(*held)
                    .values(lease_expires_at=self.clock.now_ms())
                )
            else:
                statement = t.idempotency_keys.delete().where(*held)
            done = await conn.execute(statement)
        return bool(done.rowcount)

    async def _claim(
        self,
        key_hash: str,
        request_fingerprint: str,
        now: int,
        fresh: dict[str, Any],
        took_over: list[bool],
    ) -> Claim:
        """:meth:`begin`'s transaction: ``fresh`` is the claim's row if the key is free;
        ``took_over`` is told when the claim takes over a lapsed one (its UPDATE ran)."""
        org, owner = fresh["org_id"], fresh["owner"]
        where = (_K.org_id == org, _K.key_hash == key_hash)
        async with self.db.tx() as conn:
            insert = insert_ignore_stmt(conn.dialect.name, t.idempotency_keys)
            query = sa.select(t.idempotency_keys).where(*where)
            if self.db.is_postgres:
                query = query.with_for_update()
            row = None
            for _ in range(CLAIM_TRIES):
                if (await conn.execute(insert, fresh)).rowcount:
                    return Claim("run", key_hash, _external_id(org, key_hash, now), owner=owner)
                row = (await conn.execute(query)).first()
                if row is not None:
                    break
                # PostgreSQL: the claim the INSERT met was given back (deleted) before the
                # SELECT read it (a watch's give-back, or its request's release, on another
                # connection): the key is free, and is claimed again (a 500 until now).
            if row is None:
                raise Unavailable(
                    "the Idempotency-Key was claimed and given back again while this "
                    "request claimed it; retry",
                    rule="service.unavailable",
                )
            if row.created_at <= now - TTL_MS:
                # Older than a day: the key is free again (a new turn, a new event id).
                await conn.execute(t.idempotency_keys.update().where(*where).values(fresh))
                return Claim("run", key_hash, _external_id(org, key_hash, now), owner=owner)
            if row.fingerprint != request_fingerprint:
                raise ValidationError(
                    "this Idempotency-Key was used for a different request in the last 24 "
                    "hours; send a new key with a new request",
                    rule="idempotency.mismatch",
                )
            if row.response is not None:
                return Claim("replay", key_hash, response=dict(row.response))
            if row.lease_expires_at > now:
                wait_s = max(1, min(RETRY_AFTER_MAX_S, -(-(row.lease_expires_at - now) // 1000)))
                return Claim("running", key_hash, retry_after_s=wait_s)
            # The request that took the key died mid-turn: take it over. The intake
            # de-duplicates on the same event id, so its message is not taken twice.
            # Fenced on what was read: of two requests taking over at once (SQLite
            # without FOR UPDATE), only one wins; the other is told to retry.
            took_over.append(True)
            taken = await conn.execute(
                t.idempotency_keys.update()
                .where(
                    *where,
                    _K.lease_expires_at == row.lease_expires_at,
                    _K.response.is_(None),
                )
                .values(lease_expires_at=now + LEASE_MS, owner=owner)
            )
            if not taken.rowcount:
                return Claim("running", key_hash, retry_after_s=1)
            return Claim(
                "run",
                key_hash,
                _external_id(org, key_hash, row.created_at),
                owner=owner,
                took_over=True,
            )

    @contextlib.asynccontextmanager
    async def held(self, principal: Principal, claim: Claim) -> AsyncIterator[None]:
        """Keep ``claim`` from lapsing while its request runs (a turn may take minutes)."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(RENEW_EVERY_S)
                try:
                    async with self.db.tx() as conn:
                        renewed = await conn.execute(
                            t.idempotency_keys.update()
                            .where(*_owned(principal, claim))
                            .values(lease_expires_at=self.clock.now_ms() + LEASE_MS)
                        )
                    if not renewed.rowcount:
                        # Taken over after this request stalled past its lease (or its
                        # answer is stored): the claim is another request's now.
                        log.info("an Idempotency-Key claim was taken over; renewal stops")
                        return
                except Exception as exc:  # the next round tries again
                    log_failure(log, exc, "renewing an Idempotency-Key claim failed")

        async with alongside(renew(), name="idempotency-renewal"):
            yield

    async def finish(
        self,
        principal: Principal,
        claim: Claim,
        response: dict[str, Any],
        *,
        provisional: bool = False,
        request_id: str | None = None,
    ) -> None:
        """Store the answer of the request that ran the turn (replayed from now on).

        ``provisional``: stored only while no answer is. Either it is only "the first
        request's answer was lost" (this request took the key over, and the intake found
        the message already taken in: the first request, stalled, may still finish and
        store the real one, in either order, and the real one must be what is replayed),
        or it is an error met after the message was taken in: the turn's last
        transaction stores its answer (:meth:`store`), and a fault at its COMMIT may
        have come after the commit landed (in doubt), so an answer found stored is the
        turn's and stands. Any other answer is always stored (over a provisional one).

        A failure to store it is raised after the answer is handed to the watch
        (:meth:`_hold`), which stores it 1 s on, and while that fails, at each keyed
        request here and each pass of its loop (after the loop's back-off), until the
        statement runs: meanwhile the claim holds the key (its retry is told 409
        ``idempotency.in_progress``, ``Retry-After`` that look, 1 once it failed), and
        then the retry gets the answer replayed. A look whose store fails for a reason
        that is no database fault gives the answer up (:meth:`_give_up`, which names
        ``request_id`` in its log line). An answer past the watch's budget
        (:data:`ANSWERS_HELD_BYTES`, or a watch full of answers: :meth:`_hold`) is not
        held: the claim's lease is ended
        (:meth:`lapse`, fenced by its owner token; one that fails too is tried again),
        and since the message was taken in (or recorded busy), the client's retry takes
        the key over with its event id and the intake answers it ``idempotency.lost``
        (or busy again), as after a crash; so does a retry after this process stopped
        with the answer held. It was told ``idempotency.lost`` at once, the answer in
        hand."""
        try:
            async with self.db.tx() as conn:
                await _write_answer(conn, principal.org_id, claim.key_hash, response, provisional)
        except Exception:
            # (The answer's own failure is the one to raise; the lapse's, if any, is
            # watched and tried again.)
            now = self.clock.now_ms()
            due = now + self._lost.first_ms
            if not self._hold(
                principal, claim, response, provisional, due=due, request_id=request_id
            ):
                await self.lapse(principal, claim)
            raise
        except BaseException:  # (cancelled: no write now; the watch's first look does it)
            now = self.clock.now_ms()
            if not self._hold(
                principal, claim, response, provisional, due=now, request_id=request_id
            ):
                if claim.owner is not None:
                    token = HeldKey(principal.org_id, claim.key_hash, claim.owner, keep_key=True)
                    self._lost.watch(token, due=now, lapses=now + LEASE_MS)
            raise

    def _hold(
        self,
        principal: Principal,
        claim: Claim,
        response: dict[str, Any],
        provisional: bool,
        *,
        due: int,
        request_id: str | None,
    ) -> bool:
        """Hand ``response``, unstored, to the watch (looked at from ``due``); False when
        it does not fit in :data:`ANSWERS_HELD_BYTES` beside the answers held already, or
        the watch is full of them (:data:`~leadgate.core.runners.MAX_WATCHED` tokens,
        none a give-back it may drop for it), those out for a look counted in both:
        counted and logged (:data:`NOT_HELD`)."""
        size = len(json.dumps(response, separators=(",", ":")))
        if self._held_bytes + size > ANSWERS_HELD_BYTES:
            NOT_HELD.add("bytes", ANSWERS_HELD_BYTES)
            METRICS.idempotency_answers_lost.labels("bytes").inc()
            return False
        if not self._lost.has_room():
            NOT_HELD.add("answers", self._lost.limit)
            METRICS.idempotency_answers_lost.labels("answers").inc()
            return False
        token = HeldAnswer(
            principal.org_id,
            claim.key_hash,
            response,
            provisional,
            size,
            claim.owner,
            request_id,
        )
        self._lost.watch(token, due=due, lapses=self.clock.now_ms() + LEASE_MS)
        self._held_bytes += size
        return True

    def _let_go(self, lost: Lost[HeldKey | HeldAnswer], answer: HeldAnswer) -> None:
        """``answer``, taken for a look, leaves the watch (stored, or given up): its
        bytes and its room are free again."""
        self._lost.done(lost)
        self._held_bytes -= answer.size

    def _give_up(
        self, lost: Lost[HeldKey | HeldAnswer], answer: HeldAnswer, exc: Exception
    ) -> None:
        """``answer``'s store failed for a reason no wait ends (:func:`_never_stored`):
        it leaves the watch (which tried it at every look, every 30 s at most, for as
        long as the process ran: its bytes held, every token due after it never looked
        at). One ERROR names its request and its rule (without the driver's text or a
        traceback: the statement's parameters are the answer), it is counted, and its
        claim's lease is ended as for an answer not held (fenced by its owner token:
        watched, due now, for the loop's next pass, which it wakes), so the retry takes
        the key over and is told ``idempotency.lost`` (busy again for a busy message)."""
        self._let_go(lost, answer)
        METRICS.idempotency_answers_lost.labels("unstorable").inc()
        log.error(
            "an unstored Idempotency-Key answer (request %s, status %s, rule %s) is given "
            "up: storing it failed with %s, which is no database fault (no wait stores "
            "it); its claim's lease is ended, and the retry is told idempotency.lost",
            answer.request_id or "unknown",
            answer.response.get("status"),
            _rule_of(answer.response),
            type(exc).__name__,
        )
        if answer.owner is not None:
            now = self.clock.now_ms()
            token = HeldKey(answer.org_id, answer.key_hash, answer.owner, keep_key=True)
            self._lost.watch(token, due=now, lapses=now + LEASE_MS)

    async def _store_held(self, answer: HeldAnswer) -> None:
        """Store ``answer`` as :meth:`finish` would have (whoever holds the key now)."""
        async with self.db.tx() as conn:
            await _write_answer(
                conn, answer.org_id, answer.key_hash, answer.response, answer.provisional
            )

    @staticmethod
    async def store(
        conn: Conn, principal: Principal, claim: Claim, response: dict[str, Any]
    ) -> None:
        """Store the real answer of the request that ran the turn, in the caller's
        transaction ``conn``: REST writes a turn's answer in the turn's last transaction,
        so that the turn's end and its replayable answer commit together or not at all.
        Stored over a "lost" one and whatever the claim's owner (see :meth:`finish`)."""
        await _write_answer(conn, principal.org_id, claim.key_hash, response, False)

    async def used(self, principal: Principal, key: str) -> bool:
        """Whether ``key`` was used in the caller's organization within :data:`TTL_MS`
        (claimed, or answered): a request for a model found missing goes on to
        :meth:`begin` when it was, for the key's answer or its takeover (its message may
        have been taken in before the agent was deleted). One read; no claim."""
        key_hash = fingerprint(principal.org_id.encode(), _check_key(key).encode())
        async with self.db.read() as conn:
            found = await conn.scalar(
                sa.select(_K.created_at).where(
                    _K.org_id == principal.org_id, _K.key_hash == key_hash
                )
            )
        return found is not None and found > self.clock.now_ms() - TTL_MS

    async def answer_of(self, principal: Principal, claim: Claim) -> dict[str, Any] | None:
        """The answer stored under ``claim``'s key now, if any: a takeover that found its
        message's turn ended reads whether a rerun stored the answer meanwhile
        (:meth:`store_recovered`; it commits with the end of the run the takeover
        found gone)."""
        async with self.db.read() as conn:
            stored = await conn.scalar(
                sa.select(_K.response).where(
                    _K.org_id == principal.org_id, _K.key_hash == claim.key_hash
                )
            )
        return dict(stored) if stored is not None else None

    async def store_recovered(
        self, conn: Conn, external_event_id: str, outcome: Reply | Gated | LeadgateError
    ) -> None:
        """Store the answer of a turn that turn recovery ran again from a keyed
        request's stored message (its process died), in the rerun's last transaction
        ``conn``, under the key whose claim took the message in under
        ``external_event_id`` (nothing for any other event id, or once the key is
        another claim's: a day on). The turn path knows the answer, not the request
        (its model name, whether it streamed), so it is stored as :data:`RECOVERED`
        (the text, usage, and the completion's ``id`` and ``created``, fixed now), and
        the route makes the completion (or the stream) of it from the retry, whose
        request is the first one (:meth:`begin` refuses another with the key). Stored
        over no answer, or over one that told the client its answer was lost or not
        to send the message again (``idempotency.lost``, ``turn.interrupted``,
        ``intake.in_doubt``): the rerun's is the answer those stood for.

        ``outcome`` an error: the run ended failed (the rerun's model failed, or turn
        recovery gave the turn up), stored in the transaction that ends it. Its status,
        message, code and rule are stored (``error``), and the route answers them as a
        live request's failure is answered (the 502 and its rule, or the stream's one
        error frame).

        ``outcome`` :class:`~leadgate.core.types.Gated` with no rerun: turn recovery
        surfaced the dead turn's committed handoff to a person, in its claim's
        transaction; the retry gets a live gated turn's answer."""
        parsed = _parse_external_id(external_event_id)
        if parsed is None:
            return
        org_id, key_hash, created_at = parsed
        where = (_K.org_id == org_id, _K.key_hash == key_hash, _K.created_at == created_at)
        query = sa.select(_K.response).where(*where)
        if self.db.is_postgres:
            query = query.with_for_update()
        row = (await conn.execute(query)).first()
        if row is None or not _replaceable(row.response):
            return
        recovered: dict[str, Any] = {
            "id": f"chatcmpl-{self.ids.new('c')}",
            "created": self.clock.now_ms() // 1000,
            "gated": isinstance(outcome, Gated),
        }
        status = 409
        if isinstance(outcome, LeadgateError):
            status = outcome.status
            recovered["error"] = {
                "message": outcome.message,
                "code": outcome.code,
                "rule": outcome.rule,
            }
        elif isinstance(outcome, Reply):
            status = 200
            usage = outcome.usage
            recovered["content"] = outcome.text
            recovered["usage"] = None if usage is None else list(dataclasses.astuple(usage))
        await conn.execute(
            t.idempotency_keys.update()
            .where(*where)
            .values(response={"status": status, RECOVERED: recovered})
        )

    async def release(self, principal: Principal, claim: Claim) -> None:
        """The request failed before its message was taken in: forget the key, so that a
        retry runs the turn. Only this request's own claim: one taken over (it stalled
        past its lease) is the other request's to keep. A claim that took a lapsed one
        over has its lease ended instead (:meth:`lapse`): its event id is the first
        request's, which may have taken the message in (deleted, the key's next claim
        had a new event id, and the intake took that message in a second time)."""
        await self._hand_back(principal, claim, keep_key=claim.took_over)

    async def lapse(self, principal: Principal, claim: Claim) -> None:
        """The request failed with its intake's commit in doubt (it may have taken the
        message in): keep the key, and with it the intake's external event id, but end
        the claim's lease now, so that a retry takes it over at once. Its intake then
        de-duplicates: a message taken in is not taken twice (the retry gets
        ``idempotency.lost``), one that was not is taken in now. :meth:`release` would
        give the retry a new event id and could take the message in a second time."""
        await self._hand_back(principal, claim, keep_key=True)

    async def _hand_back(self, principal: Principal, claim: Claim, *, keep_key: bool) -> None:
        """:meth:`release` (``keep_key`` false) or :meth:`lapse` ``claim``, fenced by its
        owner token. When that write fails (the database away, as it often is when the
        turn failed before its intake), no request holds the key, yet it answered the
        client's retry 409 ``idempotency.in_progress`` until the claim's lease lapsed, a
        minute on. So the claim is watched (:meth:`_give_back_lost`): handed back 1 s on
        and then at doubling gaps, by this process's loop or its next keyed request,
        until its lease would have lapsed. The failure is logged, not raised: the
        caller's client is told what its own request came to (raised, a request refused
        before its intake, a 404 model say, or a retry told ``idempotency.in_progress``
        while recovery reruns its turn, was answered 503 "nothing was stored, retry").
        A cancellation is raised (the request is gone), the claim watched the same."""
        if claim.owner is None:  # (only a claim that runs holds the key)
            return
        token = HeldKey(principal.org_id, claim.key_hash, claim.owner, keep_key=keep_key)
        try:
            await self._give_back(token)
        except BaseException as exc:
            # In doubt it may have landed: a later look then finds nothing, as fenced.
            now = self.clock.now_ms()
            self._lost.watch(token, due=now + self._lost.first_ms, lapses=now + LEASE_MS)
            if not isinstance(exc, Exception):
                raise
            log.warning(
                "giving back an Idempotency-Key claim failed (tried again 1 s on): %s",
                type(exc).__name__,
                exc_info=loggable(exc) if unavailable(exc) is None else None,
            )

    async def _sweep(self, now: int) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY_MS
        async with self.db.tx() as conn:
            sweep = _SWEEP_IN_KEY_ORDER if conn.dialect.name == "postgresql" else _SWEEP
            await conn.execute(sweep, {"p_cutoff": now - TTL_MS})


_OLD = _K.created_at <= sa.bindparam("p_cutoff")
#: The TTL sweep: the keys older than ``p_cutoff`` deleted.
_SWEEP = t.idempotency_keys.delete().where(_OLD)
_SWEPT = locked_by_id(t.idempotency_keys, _OLD, name="swept")
#: PostgreSQL: the same, its rows locked in key order first (:func:`locked_by_id`): a
#: plain ``DELETE`` locks them in the order its scan finds them (physical order at size),
#: and two replicas sweeping at once, or a sweep beside a transaction holding two of
#: those keys in key order, met the other way round as a deadlock (40P01).
_SWEEP_IN_KEY_ORDER = t.idempotency_keys.delete().where(is_locked(t.idempotency_keys, _SWEPT))


class HeldAnswer(NamedTuple):
    """An answer :meth:`Idempotency.finish` could not store, held for the watch to
    store (:meth:`Idempotency._store_held`)."""

    #: the key's row: its organization and key hash
    org_id: str
    key_hash: str
    response: dict[str, Any]
    #: stored only while the key has no answer (see :meth:`Idempotency.finish`)
    provisional: bool
    #: its size as JSON, counted against :data:`ANSWERS_HELD_BYTES`
    size: int
    #: the claim's owner token: its lease is ended when the answer is given up
    owner: str | None
    #: the id of the request it answers (its log lines'), named if it is given up
    request_id: str | None


def _never_stored(exc: Exception) -> bool:
    """Whether ``exc``, met storing a held answer, is no fault of the database's state:
    not its unavailability (:func:`~leadgate.database.faults.unavailable`: busy, down,
    full, a statement cancelled...) and not its damage (repaired by its operator, after
    which the answer is stored). What is left (a constraint or a value the database
    refuses, a bug) fails the same statement every time."""
    return not isinstance(exc, DatabaseDamaged) and unavailable(exc) is None


class HeldKey(NamedTuple):
    """What a claim's give-back (:meth:`Idempotency._give_back`) takes, also what
    :class:`~leadgate.core.runners.LostClaims` watches for a claim in doubt, or for a
    release or lapse that failed."""

    #: the key's row: its organization and key hash
    org_id: str
    key_hash: str
    #: the claim's owner token, which fences the give-back
    owner: str
    #: its lease is ended and the key kept (a claim that took a lapsed one over, or
    #: whose intake may have taken the message in: :meth:`Idempotency.lapse`), else the
    #: key is deleted (a new claim, or :meth:`Idempotency.release`)
    keep_key: bool


async def _write_answer(
    conn: Conn, org_id: str, key_hash: str, response: dict[str, Any], provisional: bool
) -> None:
    """Store ``response`` under the key (``provisional``: only while it has none)."""
    where = [_K.org_id == org_id, _K.key_hash == key_hash]
    if provisional:
        where.append(_K.response.is_(None))
    await conn.execute(t.idempotency_keys.update().where(*where).values(response=response))


def _owned(principal: Principal, claim: Claim) -> tuple[sa.ColumnElement[bool], ...]:
    """The key's row while ``claim`` still holds it (no answer stored yet)."""
    return (
        _K.org_id == principal.org_id,
        _K.key_hash == claim.key_hash,
        _K.owner == claim.owner,
        _K.response.is_(None),
    )


#: The stored answer's field of an answer turn recovery's rerun stored
#: (:meth:`Idempotency.store_recovered`): ``{"id", "created", "gated", "content",
#: "usage": [prompt, completion] | null}``, from which the route makes the completion,
#: or ``{"id", "created", "gated": false, "error": {"message", "code", "rule"}}`` (the
#: answer's status the error's) for a run that ended failed.
RECOVERED = "recovered"
#: The rules of stored answers a rerun's answer replaces: each told its client that the
#: answer was lost, or not to send the message again (which the rerun then answered).
_REPLACEABLE_RULES = frozenset({"idempotency.lost", "turn.interrupted", "intake.in_doubt"})


def _replaceable(response: Any) -> bool:
    """Whether a rerun's answer is stored over ``response`` (the key's stored answer)."""
    return response is None or _rule_of(response) in _REPLACEABLE_RULES


def _rule_of(response: Any) -> str | None:
    """The rule of the error a stored answer ``response`` is (its body's, or a stream's
    one error frame's), else None."""
    if not isinstance(response, dict):
        return None
    body = response.get("body")
    frames = response.get("frames")
    if isinstance(frames, list) and frames and isinstance(frames[-1], str):
        # A stream that ended in its one error frame (``data: {"error": ...}``).
        with contextlib.suppress(ValueError):
            body = json.loads(frames[-1].removeprefix("data: "))
    error = body.get("error") if isinstance(body, dict) else None
    rule = error.get("rule") if isinstance(error, dict) else None
    return rule if isinstance(rule, str) else None


def _parse_external_id(external_event_id: str) -> tuple[str, str, int] | None:
    """(organization, key hash, claim's ``created_at``) of an event id that
    :func:`_external_id` made, else None (another surface's event)."""
    if not external_event_id.startswith(_EXTERNAL_PREFIX):
        return None
    head, key_hash, created_at = external_event_id.rsplit(":", 2)
    return head[len(_EXTERNAL_PREFIX) :], key_hash, int(created_at)


_EXTERNAL_PREFIX = "idem:"


def _external_id(org_id: str, key_hash: str, created_at: int) -> str:
    # The intake's de-duplication id (inbound_events.external_event_id, unique): one per
    # claim of the key, the same for a takeover of that claim.
    return f"{_EXTERNAL_PREFIX}{org_id}:{key_hash}:{created_at}"
