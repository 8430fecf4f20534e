"""The outbox relay: claims due deliveries in batches, posts them, commits outcomes.

One relay per process (several per PostgreSQL cluster). A claim is a fenced batch update
(``pending -> sending`` with a lease token and a send lease); on PostgreSQL the rows are
chosen with ``FOR UPDATE SKIP LOCKED`` so replicas never claim the same row, on SQLite
``BEGIN IMMEDIATE`` serializes claims. Each outcome is committed fenced by its lease token
(``... WHERE id = :id AND lease_token = :token AND status = 'sending'``), in the same
transaction as the work item's move to ``completed`` / ``failed``. A ``sending`` row whose
lease expired means a relay died mid-send: for a channel post that is an uncertain send
(``deliveryUnknown``), never retried automatically (a review card whose item was decided
meanwhile ends ``cancelled``); internal actions (reveal, silent, scheduled) are
idempotent and simply go back to ``pending``.

Throughput and latency: :meth:`Relay.run_once` is a pipeline (:mod:`outbox.pump`), not a
claim-send-commit lockstep.

* one database "turn" at a time: a single transaction that commits every outcome
  finished since the previous turn and, when the pipeline wants more, claims the next
  batch (on PostgreSQL each its own statement outside a transaction block); sends run
  meanwhile (up to ``concurrency``, with at most one round of sends or half a batch
  queued behind; see :mod:`outbox.pump`);
* a group of successful sends is a handful of statements whatever its size (one fenced
  ``UPDATE ... WHERE id IN (...)`` per lease token, the platform ids, one ``UPDATE`` of
  the work items, one multi-row audit insert); outcomes linger up to
  :data:`COMMIT_LINGER_S` to be committed in larger groups (the post already happened,
  only its bookkeeping waits), which leaves SQLite's single writer to approvals;
* claims are demand-driven: at the start, after a full claim, when poked (every enqueue
  that was not handed over pokes the relay through the after-commit hook or PostgreSQL
  NOTIFY), when a retry it scheduled is due or a send lease lapses (its loop sleeps no
  longer than :meth:`Relay.due_in_s`), :data:`LOCKED_RECHECK_MS` after a claim that left
  due rows locked by another transaction (PostgreSQL), and at least every
  :data:`CLAIM_RECHECK_MS` as a safety net;
* local hand-off (:class:`outbox.store.Outbox`): while the service's relay loop
  runs, a delivery enqueued in the same process is written already claimed for it and
  handed over after commit, so an approval is posted without any database round trip
  between its commit and the send.

``run_once`` returns when nothing is due and nothing is in flight (or after
``max_rows_per_run`` rows, so that the runner loop regains control); every outcome of the
rows it took is committed by then.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeGuard

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import Unavailable
from leadgate.core.logs import loggable
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.runners import LOCKED_RECHECK_MS, LostClaims, after_lapse, seconds_until
from leadgate.database import schema as t
from leadgate.database.db import Conn, Counts, Database, count_found, signal_after_commit
from leadgate.database.faults import DATABASE_FAULTS
from leadgate.database.plans import AnyRow
from leadgate.database.sql import one_row, unindexed
from leadgate.domain.processes import owner_gone
from leadgate.domain.rows import Delivery
from outbox.channel import (
    Card,
    Channel,
    OutboundMessage,
    Permanent,
    Retry,
    SendOutcome,
    Sent,
    Uncertain,
)
from outbox.outcomes import Done, OutcomeCommitter, RetryPolicy
from outbox.pump import Pump
from outbox.store import (
    ANSWER,
    CARD_KINDS,
    CARD_UPDATE,
    INTERNAL_ACTIONS,
    NEXT_PART_AT,
    OUTBOX_TOPIC,
    PARTS_POSTED,
    SEND_DEADLINE_S,
    SEND_LEASE_MS,
    DeliveryStatus,
    Handoff,
    ReviewNeeded,
    address_kept,
    count_cancelled,
    delivery_of,
    ended_meanwhile,
    taken_back,
)

log = logging.getLogger("leadgate.relay")
D = t.deliveries.c

#: How often (by the relay's clock) ``run_once`` looks for expired send leases.
EXPIRY_CHECK_MS = 1_000
_NEVER = 2**62
#: A relay that is poked on every enqueue still claims at least this often (by its
#: clock) when its loop runs: retries become due with time, not with an enqueue.
CLAIM_RECHECK_MS = 1_000
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0
#: The longest a platform's Retry-After puts a delivery's next attempt off: one of
#: "inf" or "1e400" (a hostile platform or proxy) is no time the database can keep.
RETRY_AFTER_CAP_S = 3600.0
NO_BINDING_ERROR = "no active binding for the session"
LEASE_EXPIRED_ERROR = (
    "send lease expired: the relay stopped mid-send; the message may or may not have been posted"
)
#: Attempts (and pauses between them) at committing a group of outcomes before giving
#: up; rows of a group that cannot be committed stay ``sending`` and their send lease
#: expiry turns them into ``deliveryUnknown`` (never a second post).
COMMIT_RETRY_DELAYS_S = (0.05, 0.5, 2.0)
#: The error of a delivery whose send's outcome could not be committed as it was (an
#: error not the database's: a value it refuses), recorded ``deliveryUnknown`` instead.
NOT_RECORDED_ERROR = (
    "the outcome of this send could not be recorded (outbox.outcome_not_recorded); it "
    "may have been posted, so it is not sent again by itself"
)
#: A card update whose card is not posted yet waits this long before looking again.
CARD_NOT_POSTED_RETRY_S = 2.0

# The claim, built once (a statement built per call paid SQLAlchemy's construction and
# cache key on every claim: about a tenth of the SQLite relay's transaction time, py-spy).
_CLAIM_VALUES = {
    "status": DeliveryStatus.sending.value,
    "lease_token": sa.bindparam("p_token"),
    "lease_expires_at": sa.bindparam("p_expires"),
    "lease_owner": sa.bindparam("p_owner"),
    "attempts": D.attempts + 1,
    "updated_at": sa.bindparam("p_now"),
}
_DUE = (
    sa.select(D.id)
    .where(D.status == DeliveryStatus.pending.value, D.next_attempt_at <= sa.bindparam("p_now"))
    .order_by(D.next_attempt_at, D.id)
    .limit(sa.bindparam("p_limit"))
)
# SQLite (one writer: the subquery is evaluated once, inside the write transaction).
_CLAIM = (
    t.deliveries.update()
    .where(D.id.in_(_DUE.scalar_subquery()), unindexed(D.status) == DeliveryStatus.pending.value)
    .values(_CLAIM_VALUES)
    .returning(*t.deliveries.c)
)
# PostgreSQL: one statement, run outside a transaction block (one round trip; the claim
# transaction was four: BEGIN, the locked selection, the update, COMMIT). The selection is
# a MATERIALIZED CTE, evaluated exactly once: inside ``UPDATE ... WHERE id IN (subquery)``
# the planner may evaluate the subquery more than once, and with SKIP LOCKED each
# evaluation picks other rows, so one claim could take far more than its LIMIT.
_LOCKED_DUE = _DUE.with_for_update(skip_locked=True).cte("due").prefix_with("MATERIALIZED")
_CLAIMED = (
    t.deliveries.update()
    .where(D.id == _LOCKED_DUE.c.id, D.status == DeliveryStatus.pending.value)
    .values(_CLAIM_VALUES)
    .returning(*t.deliveries.c)
    .cte("claimed")
)
_OTHER = t.deliveries.alias("other")
#: The claim's rows (none: one row of NULLs), each with ``locked``: whether due rows were
#: there that the selection did not take (it skips rows locked by another transaction;
#: when it took fewer than its ``LIMIT``, those are what it skipped). Another relay's
#: claim, or a fenced move that lost its race for the row (an outcome commit beside the
#: send lease expiry that put the row back to ``pending``, a second operator retry of
#: one delivery) and keeps the row lock until its commit, with no wake-up after it. Such
#: a claim must not take the outbox for empty (see :meth:`Relay._claim_alone`).
_CLAIM_ALONE = sa.select(
    _CLAIMED,
    sa.exists()
    .where(
        _OTHER.c.status == DeliveryStatus.pending.value,
        _OTHER.c.next_attempt_at <= sa.bindparam("p_now"),
        _OTHER.c.id.not_in(sa.select(_LOCKED_DUE.c.id)),
    )
    .label("locked"),
).select_from(one_row(_CLAIMED))

_SENDING = D.status == DeliveryStatus.sending.value
#: The send lease check's read, one statement (the ``sending`` rows alone, reached by the
#: status index): whether any send lease lapsed or has a holder known dead, and when the
#: earliest one not lapsed yet will. An idle check is this read, where it was a write
#: transaction; the second column tells the relay loop how long it may sleep
#: (:meth:`Relay.due_in_s`).
_SEND_LEASE_CHECK = sa.select(
    sa.exists()
    .where(
        _SENDING,
        sa.or_(D.lease_expires_at < sa.bindparam("p_now"), owner_gone(D.lease_owner)),
    )
    .label("expired"),
    sa.select(sa.func.min(D.lease_expires_at))
    .where(_SENDING, D.lease_expires_at >= sa.bindparam("p_now"))
    .scalar_subquery()
    .label("next_lapse"),
)


def split_text(text: str, limit: int, size: Callable[[str], int] = len) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` (as ``size`` measures: characters
    unless a channel counts otherwise, see :attr:`outbox.channel.Channel.max_chars`), on
    line breaks or spaces where possible. Nothing is dropped: ``"".join`` of the parts,
    modulo the break characters, gives the text back."""
    return [text[start:end] for start, end in split_spans(text, limit, size)]


def split_spans(text: str, limit: int, size: Callable[[str], int] = len) -> list[tuple[int, int]]:
    """Where each part of :func:`split_text` lies in ``text``: ``(start, end)`` offsets.

    The split is greedy and remembers nothing: the parts of ``text[start:]``, for a
    part's ``start``, are that part and the ones after it. So a retry that records where
    its next part starts (:data:`outbox.store.NEXT_PART_AT`) posts the rest of the text
    whatever the split is by then (the channel's limit changed by an upgrade)."""
    spans: list[tuple[int, int]] = []
    at = 0
    while at < len(text):
        rest = text[at:] if at else text
        end = limit if size is len else longest_fitting(rest, limit, size)
        if end >= len(rest):
            break
        cut = rest.rfind("\n", 0, end)
        if cut < end // 2:
            cut = rest.rfind(" ", 0, end)
        if cut < end // 2:
            cut = end
        spans.append((at, at + cut))
        # (the line breaks and spaces at a cut go with neither part)
        after = rest[cut:].lstrip("\n ") if cut < end else rest[cut:]
        at += len(rest) - len(after)
    if at < len(text) or not spans:
        spans.append((at, len(text)))
    return spans


def longest_fitting(text: str, limit: int, size: Callable[[str], int]) -> int:
    """The length of the longest head of ``text`` whose size is at most ``limit`` (at
    least 1: one character too large alone still goes out). A size counts each
    character at least once and grows with the head. Most text costs about the same per
    character, so a guess in proportion, then galloping from it, brackets the answer in
    a few probes (each probe measures a head of up to ``limit`` characters); a binary
    search settles the rest."""
    high = min(len(text), limit)
    whole = size(text[:high])
    if whole <= limit:
        return high
    guess = max(1, min(high - 1, high * limit // whole))
    if size(text[:guess]) > limit:
        low, high = 1, max(1, guess - 1)
    else:
        low, step = guess, 1
        while low + step < high and size(text[: low + step]) <= limit:
            low += step
            step *= 2
        high = min(high - 1, low + step - 1)
    while low < high:
        middle = (low + high + 1) // 2
        if size(text[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


class Relay:
    """Drains the outbox. ``run_once`` drains what is due; the runner loop repeats it."""

    name = "outbox-relay"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        channels: dict[str, Channel],
        *,
        batch: int = 100,
        concurrency: int = 64,
        stalled_after: int = 8,
        rand: Callable[[], float] = random.random,
        send_lease_ms: int = SEND_LEASE_MS,
        max_rows_per_run: int | None = None,
        review_needed: ReviewNeeded | None = None,
        owner: Callable[[], str | None] = lambda: None,
    ) -> None:
        if batch < 1 or concurrency < 1 or stalled_after < 1 or send_lease_ms < 1:
            raise ValueError("batch, concurrency, stalled_after and send_lease_ms must be >= 1")
        self.db = db
        self.clock = clock
        self.ids = ids
        self.channels = channels
        self.batch = batch
        self.concurrency = concurrency
        self.stalled_after = stalled_after
        self.rand = rand
        self.send_lease_ms = send_lease_ms
        #: this process (``lease_owner`` of its send leases; see domain.processes)
        self.owner = owner
        self.max_rows_per_run = max_rows_per_run or 10 * batch
        self.committer = OutcomeCommitter(
            clock, ids, RetryPolicy(stalled_after, self.backoff_s), review_needed=review_needed
        )
        self.review_needed = review_needed
        self._sem = asyncio.Semaphore(concurrency)
        self._expiry_every_ms = max(1, min(EXPIRY_CHECK_MS, send_lease_ms // 4))
        self._next_expiry_check = 0
        #: the earliest send lease not lapsed at the last lease check (None: none)
        self._next_lapse: int | None = None
        # Local hand-off (outbox.store.Outbox.attach): rows enqueued in this process
        # arrive already claimed under this token, after their transaction committed.
        self.handoff_token = ids.new("lease")
        self._handed: list[Delivery] = []
        # Outcomes of sends that happened but could not be committed yet (database down).
        self._uncommitted: list[Done] = []
        #: lease tokens of claims whose transaction failed (see
        #: :meth:`release_uncertain_claims`)
        self._uncertain_claims: LostClaims[str] = LostClaims(name="outbox-relay claims")
        #: hand-offs whose write may or may not have committed (see :meth:`in_doubt`)
        self._doubted: LostClaims[_Doubted] = LostClaims(name="outbox-relay hand-offs")
        self._active = 0
        self._pump: Pump | None = None
        # Demand-driven claims: set poked_on_enqueue when every enqueue in reach pokes
        # this relay (the service's after-commit hook, PostgreSQL NOTIFY).
        self.poked_on_enqueue = False
        self._poked = False
        self._backlog = False
        self._last_empty_claim = -CLAIM_RECHECK_MS
        #: when to claim again after a claim left due rows locked by another transaction
        #: (PostgreSQL; None: the last claim left none)
        self._locked_look: int | None = None

    # ------------------------------------------------------------ local hand-off

    def has_room(self) -> bool:
        """Whether another send can start now (for the local hand-off)."""
        return self._active + len(self._handed) < self.concurrency

    def accept(self, rows: list[Handoff]) -> None:
        """Rows handed over after their enqueuing transaction committed: send them."""
        self._handed.extend(delivery_of(handed.row) for handed in rows)
        if self._pump is not None:
            self._pump.wake()

    async def release_handoffs(self) -> int:
        """Shutting down: give rows handed over but not started back to ``pending``."""
        rows, self._handed = self._handed, []
        return len(await self._unhand([r.id for r in rows]))

    def in_doubt(self, rows: list[Handoff]) -> None:
        """Rows written claimed for this relay by a write that failed with a database
        fault (``Database.on_doubt_payloads``): they were never handed over, and may be
        in the database all the same, ``sending`` under this relay's hand-off lease,
        where nothing would post them before the lease expired (and then as an uncertain
        send). :meth:`run_once` gives back the ones that exist, and tries again those it
        did not find until their send lease would have lapsed: the server may apply the
        write after that first give-back (:class:`~leadgate.core.runners.LostClaims`).
        A row given back shows its write landed: what that write counts at its commit
        (:attr:`Handoff.held`) is counted then, once for all its rows."""
        now = self.clock.now_ms()
        for handed in rows:
            lost = _Doubted(handed.row["id"], handed.held)
            self._doubted.watch(lost, due=now, lapses=now + self.send_lease_ms)
        self.poke()

    async def release_doubted(self) -> int:
        """Give rows :meth:`in_doubt` named back to ``pending`` (fenced by this relay's
        hand-off lease: a write that did not commit left nothing to give back), those
        due for a try now."""
        now = self.clock.now_ms()
        due = self._doubted.take_due(now)
        try:
            released = await self._unhand([lost.token.id for lost in due])
        except BaseException:  # (cancelled too: they stay watched)
            self._doubted.put_back(due)
            raise
        for lost in due:
            if lost.token.id in released:
                # Its write landed, uncounted (a commit in doubt counts nothing): counted
                # now, as it would have been, once (the list is shared by its other rows
                # and by any other look for that write, and emptied).
                count_found(lost.token.held)
            else:
                self._doubted.not_found(lost, now)
        return len(released)

    async def _unhand(self, ids: list[str]) -> list[str]:
        """Rows handed over to this relay and never started, back to ``pending`` (the
        ids of those that were); a committed release wakes the relays."""
        if not ids:
            return []
        async with self.db.tx() as conn:
            mine = (D.id.in_(ids), D.lease_token == self.handoff_token)
            ended = await ended_meanwhile(conn, *mine)
            rows = (
                await conn.execute(
                    t.deliveries.update()
                    .where(*mine, unindexed(D.status) == DeliveryStatus.sending.value)
                    .values(self._given_back(ended))
                    .returning(D.id, D.channel, D.status)
                )
            ).all()
            if rows:
                signal_after_commit(conn, OUTBOX_TOPIC)
            _count_ended(conn, rows)
        return [str(r.id) for r in rows]

    # ------------------------------------------------------------------ the loop

    async def run_once(self) -> bool:
        """Expire send leases (when due), then claim, send and commit until nothing is
        due. True when it did any work."""
        worked = False
        if self._uncertain_claims and await self.release_uncertain_claims():
            worked = True
        if self._doubted and await self.release_doubted():
            worked = True
        if self._uncommitted:
            group, self._uncommitted = self._uncommitted, []
            try:
                await self._commit_each(group)
            except Exception:
                self._uncommitted = group + self._uncommitted
                raise
            worked = True
        now = self.clock.now_ms()
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + self._expiry_every_ms
            if await self.expire_send_leases() > 0:
                worked = self._poked = True
        next_due = self.committer.next_due if self.committer.next_due is not None else _NEVER
        # Claim at once unless nothing can be due: the relay is told of every enqueue
        # (pokes), found nothing a moment ago (nothing due, not due rows locked by
        # another transaction), and was not poked since. Rows handed over locally need
        # no claim at all.
        claim = not (
            self.poked_on_enqueue
            and not self._poked
            and not self._backlog
            and now < next_due
            and now - self._last_empty_claim < CLAIM_RECHECK_MS
            and self._locked_look is None
        )
        if claim and now >= next_due:
            self.committer.next_due = None
        pump = self._pump = Pump(self, claim=claim)
        try:
            return await pump.run() > 0 or worked
        finally:
            self._pump = None
            self._backlog = pump.backlog

    def leases_freed(self) -> None:
        """Processes were reaped, here or on another replica (or one shut down): send
        leases they held can be taken back now (:meth:`expire_send_leases`), so the next
        pass looks for them, not only when its timer says."""
        self._next_expiry_check = 0

    def due_in_s(self) -> float | None:
        """Seconds (by the relay's clock) until the earliest retry it scheduled falls due,
        or until its next lease check can find the earliest send lease it last saw lapsed,
        whichever is sooner; None when it knows of neither. The runner loop sleeps no
        longer than this (:func:`leadgate.core.runners.run_loop`): a 429 whose
        ``Retry-After`` is shorter than the poll is retried when the platform asked, and
        a delivery whose sender stalled or died unannounced is taken back when its lease
        lapses, not at the next poll. Only this relay knows of its retries; the others
        meet them at their polls, as one relay taking it is enough. Leases are read from
        the database (every replica's, as of the check): one renewed or finished since
        makes the loop wake early and look again. So does the next try of a give-back
        of a claim or a hand-off in doubt (:meth:`release_uncertain_claims`,
        :meth:`release_doubted`), when sooner, and the look again after a claim that
        left due rows locked by another transaction (:data:`LOCKED_RECHECK_MS`)."""
        lapse = after_lapse(self._next_lapse)
        # The check runs at most every _expiry_every_ms: never earlier than it can find it.
        check = None if lapse is None else max(lapse, self._next_expiry_check)
        return seconds_until(
            self.clock.now_ms(),
            self.committer.next_due,
            check,
            self._uncertain_claims.next_due(),
            self._doubted.next_due(),
            self._locked_look,
        )

    def poke(self) -> None:
        """Something became due (an enqueue that was not handed over, an operator retry,
        another replica's NOTIFY): claim at the next opportunity."""
        self._poked = True
        if self._pump is not None:
            self._pump.wake()

    # ------------------------------------------------------- what the pump calls

    def take_handed(self) -> list[Delivery]:
        """Rows handed over since the last call (the pump starts them)."""
        rows, self._handed = self._handed, []
        return rows

    def take_poke(self) -> bool:
        """Whether the relay was poked since the last call; clears the poke."""
        poked, self._poked = self._poked, False
        return poked

    def set_active(self, count: int) -> None:
        """Sends in flight (the hand-off's room check)."""
        self._active = count

    def claimed_none(self) -> None:
        """A claim found nothing due."""
        self._last_empty_claim = self.clock.now_ms()

    async def turn(self, group: list[Done], limit: int) -> list[Delivery]:
        """Commit ``group`` and claim up to ``limit`` rows: in one transaction on SQLite;
        on PostgreSQL the outcomes first (one statement for a group of posts), then the
        claim (one statement).

        When that fails, the outcomes are committed on their own (with retries) and the
        claim error is raised: outcomes of sends that happened are never dropped because
        the claim part failed.
        """
        token = self.ids.new("lease")
        try:
            now = self.clock.now_ms()
            if self.db.is_postgres:
                # The posts' outcomes in one statement (other outcomes: a transaction),
                # then the claim in one statement.
                if group:
                    await self.complete(group)
                    group = []
                return await self._claim_alone(limit, token) if limit else []
            async with self.db.tx() as conn:
                if group:
                    await self.committer.commit(conn, group, now)
                return await self._claim_in(conn, limit, token) if limit else []
        except Exception as exc:
            if limit:  # whatever failed, the claim may have committed: nothing was sent
                self._claim_failed(token, exc)
            if group:
                await self._commit_group(group)
            if not limit:
                return []
            raise

    async def _commit_group(self, group: list[Done]) -> None:
        for attempt, delay in enumerate((*COMMIT_RETRY_DELAYS_S, None)):
            try:
                await self._commit_each(group)
                return
            except Exception:
                if delay is None:
                    # Kept and committed again at the next run (the database may be
                    # back well within the send lease); if this process dies first, the
                    # lease lapses and the posts become deliveryUnknown (never re-sent).
                    log.warning(
                        "could not commit %d delivery outcomes yet; retrying them next run",
                        len(group),
                    )
                    self._uncommitted.extend(group)
                    return
                log.warning("committing delivery outcomes failed (attempt %d)", attempt + 1)
                await asyncio.sleep(delay)

    async def _commit_each(self, group: list[Done]) -> None:
        """Commit ``group`` (:meth:`complete`); raises only a database fault
        (:data:`DATABASE_FAULTS`), with ``group`` left holding the outcomes not committed,
        to commit again (the database comes back within the send lease).

        Any other error is about what the group's commit wrote, and committing it again
        meets it again: kept, it held every other outcome of the group, and the relay
        stopped claiming and taking back lapsed leases. The members are then committed one
        by one, and one that still fails is recorded ``deliveryUnknown``
        (:meth:`_record_unknown`)."""
        try:
            await self.complete(group)
        except DATABASE_FAULTS:
            raise
        except Exception:  # (met again one by one, and logged there)
            pass
        else:
            group.clear()
            return
        while group:
            try:
                await self.complete(group[:1])
            except DATABASE_FAULTS:
                raise
            except Exception as exc:
                await self._record_unknown(group[0], exc)
            del group[0]

    async def _record_unknown(self, done: Done, exc: Exception) -> None:
        """``done``'s outcome could not be committed, for ``exc``, not a database fault:
        its delivery becomes ``deliveryUnknown`` with a fixed error
        (:data:`NOT_RECORDED_ERROR`), never sent again by itself (it may have been
        posted; a person settles it), with one ERROR line. If even that cannot be
        committed (not for a database fault, which is raised), nothing more is tried:
        the send lease lapses and takes the row back as it does a dead relay's."""
        log.error(
            "delivery %s on %s: its send's outcome (%s) could not be recorded; "
            "recording it deliveryUnknown",
            done.row.id,
            done.row.channel,
            type(done.outcome).__name__,
            exc_info=loggable(exc),
        )
        # What the channel said is left out (it may be what the database refused); the
        # parts of a long text already posted are the relay's own counts, kept.
        unknown = Done(
            done.row, Uncertain(NOT_RECORDED_ERROR), done.parts_posted, None, done.next_part_at
        )
        try:
            await self.complete([unknown])
        except DATABASE_FAULTS:
            raise
        except Exception as again:
            log.error(
                "delivery %s: not even deliveryUnknown could be recorded; "
                "left to its send lease's expiry",
                done.row.id,
                exc_info=loggable(again),
            )

    async def complete(self, done: list[Done]) -> None:
        """Commit a group of outcomes in one transaction (PostgreSQL: a group of posts in
        one statement). An error raised once that statement committed leaves in ``done``
        only what is still to commit (:meth:`OutcomeCommitter.commit_alone`)."""
        now = self.clock.now_ms()
        if await self.committer.commit_alone(self.db, done, now):
            return
        async with self.db.tx() as conn:
            await self.committer.commit(conn, done, now)

    # ------------------------------------------------------------------- leases

    async def expire_send_leases(self) -> int:
        """A relay died mid-send: posts become deliveryUnknown, internal ones pending,
        and a review card whose wait a decision closed meanwhile ``cancelled``.

        Taken back when the send lease expired, or at once when its holder is known dead
        (:mod:`leadgate.domain.processes`). Either way a post that was in flight stays
        uncertain: it may have landed, so it is never retried by itself. First one read
        (:data:`_SEND_LEASE_CHECK`): whether there is anything to take back, and when the
        earliest lease not lapsed yet will (:meth:`due_in_s`).
        """
        now = self.clock.now_ms()
        async with self.db.read() as conn:
            check = (await conn.execute(_SEND_LEASE_CHECK, {"p_now": now})).one()
        self._next_lapse = check.next_lapse
        if not check.expired:
            return 0
        # Internal actions are idempotent, and so is editing a card: both go back to
        # pending. A post (a message or a card) may have landed: deliveryUnknown.
        internal = sa.or_(D.action.in_(sorted(INTERNAL_ACTIONS)), D.kind == CARD_UPDATE)
        lapsed = sa.or_(D.lease_expires_at < now, owner_gone(D.lease_owner))
        expired = self.db.skip_locked(
            sa.select(D.id).where(D.status == DeliveryStatus.sending.value, lapsed)
        )
        async with self.db.tx() as conn:
            # Cards whose wait a decision closed while they were being sent, and posts
            # whose item was cancelled then, end cancelled, as one whose send ended
            # uncertain then does (outcomes.OutcomeCommitter._commit_one): an operator
            # has nothing to settle for a decided item. Their items and waits are locked
            # first (see the function).
            ended = await ended_meanwhile(conn, lapsed)
            chosen = await self._locked_ids(conn, expired)
            if chosen is not None and not chosen:
                return 0
            status = sa.case(
                (internal, DeliveryStatus.pending.value),
                else_=DeliveryStatus.deliveryUnknown.value,
            )
            address: sa.ColumnElement[Any] = D.address
            # A post whose lease lapsed by time keeps when it did: its send may still be
            # posting, so an operator's Retry waits for it (outbox.store.recover). A
            # holder known dead posts nothing more: no wait then.
            in_flight = sa.and_(
                sa.not_(internal), D.lease_expires_at < now, sa.not_(owner_gone(D.lease_owner))
            )
            if ended:
                closed = D.id.in_(ended)
                status = sa.case((closed, DeliveryStatus.cancelled.value), else_=status)
                address = sa.case((closed, address_kept(D.address)), else_=D.address)
                in_flight = sa.and_(in_flight, sa.not_(closed))
            rows = (
                await conn.execute(
                    t.deliveries.update()
                    .where(
                        D.id.in_(expired.scalar_subquery() if chosen is None else chosen),
                        unindexed(D.status) == DeliveryStatus.sending.value,
                        lapsed,
                    )
                    .values(
                        status=status,
                        address=address,
                        error=sa.case((internal, sa.null()), else_=LEASE_EXPIRED_ERROR),
                        lease_token=None,
                        lease_expires_at=sa.case((in_flight, D.lease_expires_at), else_=sa.null()),
                        lease_owner=None,
                        updated_at=now,
                    )
                    .returning(
                        D.id, D.action, D.channel, D.org_id, D.work_item_id, D.kind, D.status
                    )
                )
            ).all()
            _count_ended(conn, rows)
            unknown = [r for r in rows if r.status == DeliveryStatus.deliveryUnknown.value]
            if unknown:
                await conn.execute(
                    t.audit.insert(),
                    [
                        {
                            "id": self.ids.new("aud"),
                            "org_id": r.org_id,
                            "work_item_id": r.work_item_id,
                            "delivery_id": r.id,
                            "actor": "system:relay",
                            "action": "deliveryUnknown",
                            "from_status": None,
                            "to_status": None,
                            "text": "send lease expired",
                            "created_at": now,
                        }
                        for r in unknown
                    ],
                )
                if self.review_needed is not None:
                    for r in unknown:
                        if r.kind == "gating" and r.work_item_id:
                            await self.review_needed(conn, r.work_item_id, "deliveryUnknown", r.id)
        for r in unknown:
            log.warning("delivery %s: send lease expired mid-send: deliveryUnknown", r.id)
            labelled(METRICS.deliveries, r.channel, "deliveryUnknown").inc()
        for r in rows:
            if r.status == DeliveryStatus.cancelled.value:
                log.warning(
                    "delivery %s: send lease expired mid-send, and its item was decided "
                    "meanwhile: cancelled",
                    r.id,
                )
        return len(rows)

    async def _locked_ids(self, conn: Conn, query: sa.Select[Any]) -> list[str] | None:
        """PostgreSQL: run the ``FOR UPDATE SKIP LOCKED`` selection on its own and return
        the ids it locked. Inside ``UPDATE ... WHERE id IN (subquery)`` the planner may
        evaluate the subquery more than once, and with SKIP LOCKED each evaluation picks
        other rows, so one claim could take far more than its ``LIMIT``. SQLite (one
        writer, the subquery evaluated once): ``None``, use the subquery inline."""
        if not self.db.is_postgres:
            return None
        return [str(r) for r in (await conn.execute(query)).scalars().all()]

    async def claim(self, limit: int | None = None) -> list[Delivery]:
        """Claim up to ``limit`` (default ``batch``) due deliveries under one lease token
        (fenced; SKIP LOCKED on PostgreSQL)."""
        token = self.ids.new("lease")
        try:
            if self.db.is_postgres:
                return await self._claim_alone(limit or self.batch, token)
            async with self.db.tx() as conn:
                return await self._claim_in(conn, limit or self.batch, token)
        except Exception as exc:
            self._claim_failed(token, exc)  # may have committed; nothing was sent
            raise

    def _claim_failed(self, token: str, exc: Exception) -> None:
        """The claim under ``token`` raised ``exc``: its rows, if it committed, are given
        back on the next pass (:meth:`release_uncertain_claims`). In doubt (its
        ``COMMIT``, or its one statement, sent with the connection lost), the server may
        apply it even after that give-back found nothing: the token is tried again until
        its send lease would have lapsed (:class:`~leadgate.core.runners.LostClaims`)."""
        now = self.clock.now_ms()
        in_doubt = isinstance(exc, Unavailable) and exc.in_doubt
        lapses = now + self.send_lease_ms if in_doubt else now
        self._uncertain_claims.watch(token, due=now, lapses=lapses)

    async def release_uncertain_claims(self) -> int:
        """Claims whose transaction failed (a database fault above all) may still have committed
        (the connection dropped after the COMMIT reached the server): their rows would sit
        in ``sending`` for the whole send lease, and a post would then go to an operator
        as an uncertain send. Nothing of them was sent (the claim raised before any send),
        so they go straight back to ``pending``, fenced by the claim's token (no other
        relay's claim has it). A claim in doubt is tried again until its lease would have
        lapsed: the server may apply it after a give-back that found nothing."""
        released = 0
        now = self.clock.now_ms()
        due = self._uncertain_claims.take_due(now)
        for n, lost in enumerate(due):
            try:
                async with self.db.tx() as conn:
                    ended = await ended_meanwhile(conn, D.lease_token == lost.token)
                    rows = (
                        await conn.execute(
                            t.deliveries.update()
                            .where(
                                D.lease_token == lost.token,
                                D.status == DeliveryStatus.sending.value,
                            )
                            .values(self._given_back(ended))
                            .returning(D.channel, D.status)
                        )
                    ).all()
                    if rows:
                        signal_after_commit(conn, OUTBOX_TOPIC)
                    _count_ended(conn, rows)
            except BaseException:  # (cancelled too: the rest stay watched)
                self._uncertain_claims.put_back(due[n:])
                raise
            if rows:
                released += len(rows)
            else:
                self._uncertain_claims.not_found(lost, now)
        return released

    def _given_back(self, ended: list[str]) -> dict[str, Any]:
        """The values of claimed rows never sent, given back: ``pending`` again (the claim
        no attempt), but a card whose wait a decision closed meanwhile, or a post whose
        item was cancelled meanwhile (``ended``, of :func:`outbox.store.ended_meanwhile`),
        ends ``cancelled``, as the decision cancels one not sent yet: put back, it would
        be posted after the decision (a card offering a decision already made). The
        decision saw it being sent and left it to its send (an email card's Reply-To
        leaves the row with it)."""
        values: dict[str, Any] = {
            "status": DeliveryStatus.pending.value,
            "lease_token": None,
            "lease_expires_at": None,
            "lease_owner": None,
            "attempts": D.attempts - 1,
            "updated_at": self.clock.now_ms(),
        }
        if ended:
            closed = D.id.in_(ended)
            values["status"] = sa.case(
                (closed, DeliveryStatus.cancelled.value), else_=DeliveryStatus.pending.value
            )
            values["address"] = sa.case((closed, address_kept(D.address)), else_=D.address)
        return values

    def _claim_params(self, limit: int, token: str) -> dict[str, Any]:
        now = self.clock.now_ms()
        return {
            "p_now": now,
            "p_limit": limit,
            "p_token": token,
            "p_expires": now + self.send_lease_ms,
            "p_owner": self.owner(),
        }

    async def _claim_alone(self, limit: int, token: str) -> list[Delivery]:
        """PostgreSQL: the claim as one statement of its own (:data:`_CLAIM_ALONE`).

        One that took fewer than ``limit`` rows while other due rows were there, locked
        by another transaction, does not leave the outbox for empty: the relay claims
        again after :data:`LOCKED_RECHECK_MS` (:meth:`run_once`, :meth:`due_in_s`).
        Whoever holds them may commit with no wake-up for this relay: a fenced move that
        lost its race for a row keeps its row lock to the end of its transaction
        (PostgreSQL's row locks outlive a failed recheck of ``WHERE``)."""
        params = self._claim_params(limit, token)
        rows = (await self.db.write_alone(_CLAIM_ALONE, params)).all()
        taken = [row[: len(Delivery._fields)] for row in rows if row.id is not None]
        locked = len(taken) < limit and any(row.locked for row in rows)
        self._locked_look = params["p_now"] + LOCKED_RECHECK_MS if locked else None
        return _in_claim_order(taken)

    async def _claim_in(self, conn: Conn, limit: int, token: str) -> list[Delivery]:
        """SQLite: the claim inside ``conn``'s transaction (:data:`_CLAIM`)."""
        rows = (await conn.execute(_CLAIM, self._claim_params(limit, token))).all()
        return _in_claim_order(rows)

    # -------------------------------------------------------------------- sends

    async def deliver(self, row: Delivery) -> Done:
        """Send one row; an unexpected error becomes an uncertain outcome (never raises)."""
        try:
            if row.kind in CARD_KINDS:
                return Done(row, await self._send_card(row))
            return await self._send(row)
        except Exception as exc:  # a bug must not lose the outcome (or the pipeline)
            log.error("delivery %s: unexpected error", row.id, exc_info=loggable(exc))
            return Done(row, Uncertain(f"relay error: {type(exc).__name__}"))

    async def _send(self, row: Delivery) -> Done:
        if row.action in INTERNAL_ACTIONS:
            return Done(row, Sent())
        if row.channel == "none" or not (row.binding_id or row.kind == ANSWER):
            return Done(row, Permanent(NO_BINDING_ERROR))
        if _all_posted(row):
            # Every part was posted by an earlier attempt whose outcome was not recorded
            # (its send lease lapsed first): an operator's Retry posts nothing again, and
            # completes it even once its channel is gone from the configuration.
            log.info("delivery %s: every part was posted already; nothing sent", row.id)
            return Done(row, Sent())
        channel = self.channels.get(row.channel)
        if channel is None:
            return _rest_refused(row, Permanent(f"channel {row.channel} is not configured"))
        if not row.text.strip():
            # Nothing to show: no post (Discord refuses whitespace alone for good, 400
            # 50006, as Slack does with no_text; an email or a Teams message of blanks
            # says nothing either).
            return Done(row, Sent())
        # (a channel whose limit is not in characters says how it measures)
        size = getattr(channel, "text_size", len)
        resume = resume_at(row, lambda: split_spans(row.text, channel.max_chars, size))
        if isinstance(resume, Uncertain):
            return Done(row, resume)
        # Parts an earlier attempt posted are not posted again: the rest of the text is
        # split again, from where they ended, whatever the split was then.
        # (not at the end of the text: that is _all_posted, above)
        posted, at = resume
        rest = row.text[at:]
        spans = split_spans(rest, channel.max_chars, size)
        count = posted + len(spans)
        external = row.external_id
        async with self._sem:
            # One deadline for the whole delivery, not each part: parts that each took
            # their channel's whole deadline kept the delivery past its send lease.
            # Time spent is summed step by step, a step back of the clock counting as
            # none: measured from the start, a clock set back mid-send gave the later
            # parts more than the whole deadline.
            spent_ms, last = 0, self.clock.now_ms()
            for n, (start, end) in enumerate(spans):
                index = posted + n
                now = self.clock.now_ms()
                spent_ms, last = spent_ms + max(0, now - last), now
                left_s = SEND_DEADLINE_S - spent_ms / 1000
                if left_s <= 0:
                    outcome: SendOutcome = Retry(
                        f"the delivery's send deadline ({SEND_DEADLINE_S:g} s) ran out: "
                        "not sent, on the next attempt"
                    )
                else:
                    # (the attempt's first part: the channel's own deadline, within this)
                    within_s = left_s if n else None
                    span = at + start, at + end
                    outcome = await self._send_part(channel, row, span, within_s)
                if not isinstance(outcome, Sent):
                    return _part_failed(row, outcome, index, count, external, at + start)
                external = external or outcome.external_id
                if n + 1 < len(spans):
                    after = index + 1, at + spans[n + 1][0]
                    stop = await self._record_parts(row, *after, external)
                    if stop is not None:
                        return _part_failed(row, stop, index + 1, count, external, after[1])
        # (the whole text posted: recorded on the row if the send lease lapsed before
        # this outcome is committed, OutcomeCommitter._record_all_posted)
        return Done(row, Sent(external), count, external, len(row.text))

    async def _record_parts(
        self, row: Delivery, posted: int, next_at: int, external: str | None
    ) -> Retry | Uncertain | None:
        """Record, before the next part is sent, that ``posted`` parts of ``row``'s
        text are (the next starting at ``next_at``): a relay that dies, or whose send
        lease lapses, mid-send leaves the record of what it posted, so an operator's
        Retry posts the rest only. ``None``: recorded, go on.

        Fenced by the send lease; a lease that lapsed meanwhile (the row taken back as
        ``deliveryUnknown`` by this attempt's expiry, no other attempt since) still
        gets the record, but nothing more is sent: the delivery is an operator's now,
        and a part posted after their Retry would be posted twice. A record that
        cannot be written (the database) sends nothing more either: a retry, with the
        record committed with its outcome."""
        values = {
            "address": {**row.address, PARTS_POSTED: posted, NEXT_PART_AT: next_at},
            "external_id": external,
        }
        ours = sa.and_(D.lease_token == row.lease_token, D.status == DeliveryStatus.sending.value)
        lapsed = taken_back(row)
        try:
            async with self.db.tx() as conn:
                found = (
                    await conn.execute(
                        t.deliveries.update()
                        .where(D.id == row.id, sa.or_(ours, lapsed))
                        .values(values)
                        .returning(D.status)
                    )
                ).first()
        except Exception as exc:
            log.warning(
                "delivery %s: the parts posted could not be recorded: %s",
                row.id,
                type(exc).__name__,
            )
            return Retry("the parts posted could not be recorded: not sent, on the next attempt")
        if found is not None and found.status == DeliveryStatus.sending.value:
            return None
        return Uncertain("the send lease lapsed mid-send: not sent; an operator's Retry sends it")

    async def _send_card(self, row: Delivery) -> SendOutcome:
        """A review card: one message (the adapter cuts it to the platform's limits), or
        the edit of a posted card, whose platform id is read from the card's own row."""
        channel = self.channels.get(row.channel)
        if channel is None:
            return Permanent(f"channel {row.channel} is not configured")
        raw = row.address.get("card")
        try:
            card = Card.from_json(raw) if isinstance(raw, dict) else None
        except TypeError:
            card = None
        message = OutboundMessage(
            delivery_id=row.id,
            idempotency_key=row.id,
            address=row.address,
            text=row.text,
            kind=row.kind,
            card=card,
        )
        op = "update" if row.kind == CARD_UPDATE else "post"
        async with self._sem:
            try:
                if row.kind == CARD_UPDATE:
                    outcome = await self._update_card(channel, row, message)
                else:
                    outcome = await channel.send(message)
            except Exception as exc:  # an adapter bug must not lose the delivery
                log.error(
                    "channel %s raised instead of mapping an error",
                    row.channel,
                    exc_info=loggable(exc),
                )
                outcome = Uncertain(f"adapter error: {type(exc).__name__}")
        labelled(METRICS.cards, row.channel, op, type(outcome).__name__.lower()).inc()
        return outcome

    async def _update_card(
        self, channel: Channel, row: Delivery, message: OutboundMessage
    ) -> SendOutcome:
        card_delivery = row.address.get("card_delivery_id")
        async with self.db.read() as conn:
            posted = (
                await conn.execute(sa.select(D.status, D.external_id).where(D.id == card_delivery))
            ).first()
        if posted is None:
            return Permanent(f"card delivery {card_delivery} does not exist")
        if posted.status == DeliveryStatus.sent.value and posted.external_id:
            return await channel.update(message, str(posted.external_id))
        if posted.status in (DeliveryStatus.pending.value, DeliveryStatus.sending.value):
            # Decided while the card was still on its way: edit it once it is posted.
            return Retry("the card is not posted yet", delay_s=CARD_NOT_POSTED_RETRY_S)
        # (committed cancelled, not failed: OutcomeCommitter._commit_one)
        return Permanent(f"the card was not posted ({posted.status}); nothing to update")

    async def _send_part(
        self, channel: Channel, row: Delivery, span: tuple[int, int], within_s: float | None
    ) -> SendOutcome:
        """Post ``row.text[start:end]`` (``span``) under its key (:func:`part_key`)."""
        start, end = span
        try:
            return await channel.send(
                OutboundMessage(
                    delivery_id=row.id,
                    idempotency_key=part_key(row.id, start, end),
                    address=row.address,
                    text=row.text[start:end],
                    kind=row.kind,
                    within_s=within_s,
                )
            )
        except Exception as exc:  # an adapter bug must not lose the delivery
            log.error(
                "channel %s raised instead of mapping an error", row.channel, exc_info=loggable(exc)
            )
            return Uncertain(f"adapter error: {type(exc).__name__}")

    def backoff_s(self, attempts: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter (half fixed, half random), never sooner than
        Retry-After, of which at most :data:`RETRY_AFTER_CAP_S` counts."""
        base = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))
        delay = base * (0.5 + 0.5 * self.rand())
        if retry_after is None or math.isnan(retry_after):
            return float(delay)
        return float(max(delay, min(retry_after, RETRY_AFTER_CAP_S)))


def part_key(delivery_id: str, start: int, end: int) -> str:
    """The idempotency key of the part ``text[start:end]`` of a delivery's text: the
    same key for the same text on every attempt, never for another text.

    The first part's key is the delivery's id: a one-part text's, as it always was, and
    the one Discord's interaction reply tells its first part by (it fills the deferred
    answer; ``bots.discord_out``). A later part's names where it starts and ends in the
    text (which a delivery never changes): a retry resumes from where the parts posted
    ended and splits the rest afresh, so when the split is not the same any more (a
    channel's limit changed by an upgrade) its part N may be another text than the
    first attempt's part N. Keyed by its number, a channel that de-duplicates by key
    (Discord's nonce, email's ``Message-ID``) dropped that other text as a repeat, or
    took a repeat of a text for new. The ``.start-end`` form never equals the
    ``.number`` keys of earlier versions, so a row sent across an upgrade can at worst
    post an uncertain part again, never have a part dropped for another's key. The one
    text that can share a key with another: a first part that may have been posted
    (nothing recorded) sent again by an operator's Retry after its channel's limit
    changed, which keeps the delivery's id."""
    return delivery_id if start == 0 else f"{delivery_id}.{start}-{end}"


def _part_failed(
    row: Delivery, outcome: SendOutcome, index: int, count: int, external: str | None, at: int
) -> Done:
    """A delivery of ``count`` parts whose part ``index``, starting at ``at`` in its
    text, was not (surely) posted: the parts before it were, and are recorded
    (:data:`outbox.store.PARTS_POSTED`, :data:`outbox.store.NEXT_PART_AT`) so that no
    later attempt, the relay's or an operator's retry, posts them again. Nothing
    posted yet, the part's outcome stands; otherwise a retry is a retry of the rest, and
    a part that may have been posted, or never will be, leaves the delivery uncertain
    (``deliveryUnknown``: an operator confirms it or retries the rest)."""
    if index == 0:
        return Done(row, outcome)
    error = f"part {index + 1} of {count}: {getattr(outcome, 'error', '')}"
    said = getattr(outcome, "said", "")
    if isinstance(outcome, Retry):
        return Done(row, Retry(error, outcome.delay_s, said), index, external, at)
    return Done(row, Uncertain(error, said), index, external, at)


def _rest_refused(row: Delivery, outcome: Permanent) -> Done:
    """``row`` cannot be sent (``outcome``) before any part of this attempt: failed for
    good, unless an earlier attempt posted some of its parts (:data:`PARTS_POSTED`).
    Then it is not "never posted": it is ``deliveryUnknown``, as a later part refused
    for good leaves it (:func:`_part_failed`), so that an operator may Retry the rest
    once the cause is fixed (the channel configured again), or Confirm it."""
    posted = row.address.get(PARTS_POSTED) if isinstance(row.address, dict) else None
    if not posted:
        return Done(row, outcome)
    return Done(
        row, Uncertain(f"after the parts posted ({posted!r:.20}): {outcome.error}", outcome.said)
    )


def resume_at(
    row: Delivery, spans: Callable[[], list[tuple[int, int]]]
) -> tuple[int, int] | Uncertain:
    """Where ``row``'s next attempt starts: (the parts earlier attempts posted, where in
    its text the next part starts), by what its address records (``(0, 0)``: nothing).

    A row recorded before the offset was (:data:`outbox.store.PARTS_POSTED` alone) is
    placed by ``spans``, the split of its whole text as it is now. A record that does
    not fit the text (hand-edited, a negative count, an offset past the end) is not
    followed: parts may have been posted, so posting from the start could post them
    again, and posting from a guess could skip one. The delivery is uncertain then
    (``deliveryUnknown``), nothing sent, for an operator. An offset at the very end
    says every part was posted: nothing is left to send."""
    address = row.address if isinstance(row.address, dict) else {}
    count, at = address.get(PARTS_POSTED), address.get(NEXT_PART_AT)
    if count is None and at is None:
        return 0, 0
    if _whole(count) and at is None:
        whole = spans()
        if count == 0 or count < len(whole):
            return count, whole[count][0]
    elif _whole(count) and _whole(at) and count > 0 and 0 < at <= len(row.text):
        # (at the end: every part was posted, OutcomeCommitter._record_all_posted)
        return count, at
    return Uncertain(
        f"the record of the parts posted ({PARTS_POSTED} {count!r:.20}, {NEXT_PART_AT} "
        f"{at!r:.20}) does not fit the text ({len(row.text)} characters): some parts may "
        "have been posted; nothing was sent"
    )


def _all_posted(row: Delivery) -> bool:
    """Whether ``row``'s record says every part of its text was posted (the next part
    at its end, OutcomeCommitter._record_all_posted): nothing is left to send, whatever
    its channel is now. (A record with the offset is read without a split, so no
    channel is needed to read it.)"""
    address = row.address if isinstance(row.address, dict) else {}
    if address.get(NEXT_PART_AT) is None:
        return False
    resume = resume_at(row, list)
    return not isinstance(resume, Uncertain) and resume[1] == len(row.text)


def _whole(value: object) -> TypeGuard[int]:
    """Whether ``value`` (read from JSON) is a count: an int, 0 or more (not a bool)."""
    return type(value) is int and value >= 0


def _count_ended(conn: Conn, given_back: Sequence[AnyRow]) -> None:
    """Count, once ``conn`` commits, the cards among rows a give-back or a lease expiry
    moved in it that ended ``cancelled`` (their wait was closed); the others are counted
    by their next attempt (``pending``) or as ``deliveryUnknown`` by the caller."""
    count_cancelled(
        conn, (r.channel for r in given_back if r.status == DeliveryStatus.cancelled.value)
    )


def _in_claim_order(rows: Sequence[Sequence[Any]]) -> list[Delivery]:
    """Claimed rows as deliveries, oldest due first (RETURNING keeps no order)."""
    out = [Delivery.from_row(r) for r in rows]
    out.sort(key=lambda r: (r.next_attempt_at, r.id))
    return out


class _Doubted(NamedTuple):
    """A hand-off whose write was in doubt, watched (:meth:`Relay.in_doubt`)."""

    #: the delivery's id
    id: str
    #: what its write counts (:attr:`outbox.store.Handoff.held`)
    held: Counts
