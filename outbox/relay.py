"""The outbox relay: claims due deliveries in batches, posts them, commits outcomes.

One relay per process (several per PostgreSQL cluster). A claim is a fenced batch update
(``pending -> sending`` with a lease token and a send lease); on PostgreSQL the rows are
chosen with ``FOR UPDATE SKIP LOCKED`` so replicas never claim the same row, on SQLite
``BEGIN IMMEDIATE`` serializes claims. Each outcome is committed fenced by its lease token
(``... WHERE id = :id AND lease_token = :token AND status = 'sending'``), in the same
transaction as the work item's move to ``completed`` / ``failed``. A ``sending`` row whose
lease expired means a relay died mid-send: for a channel post that is an uncertain send
(``deliveryUnknown``), never retried automatically; internal actions (reveal, silent,
scheduled) are idempotent and simply go back to ``pending``.

Throughput and latency: :meth:`Relay.run_once` is a pipeline, not a claim-send-commit
lockstep.

* one database "turn" at a time: a single transaction that commits every outcome
  finished since the previous turn and, when the pipeline wants more, claims the next
  batch; sends run meanwhile (up to ``concurrency``, with half a batch queued behind);
* a group of successful sends is a handful of statements whatever its size (one fenced
  ``UPDATE ... WHERE id IN (...)`` per lease token, the platform ids, one ``UPDATE`` of
  the work items, one multi-row audit insert); outcomes linger up to
  :data:`COMMIT_LINGER_S` to be committed in larger groups (the post already happened,
  only its bookkeeping waits), which leaves SQLite's single writer to approvals;
* claims are demand-driven: at the start, after a full claim, when poked (every enqueue
  that was not handed over pokes the relay through the after-commit hook or PostgreSQL
  NOTIFY), when a retry it scheduled is due, and at least every
  :data:`CLAIM_RECHECK_MS` as a safety net;
* local hand-off (:func:`outbox.store.set_local_relay`): while the service's relay loop
  runs, a delivery enqueued in the same process is written already claimed for it and
  handed over after commit, so an approval is posted without any database round trip
  between its commit and the send.

``run_once`` returns when nothing is due and nothing is in flight (or after
``max_rows_per_run`` rows, so that the runner loop regains control); every outcome of the
rows it took is committed by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from engine import schema as t
from engine import workitems
from engine.clock import Clock, IdFactory
from engine.db import Database
from engine.errors import TransitionError
from engine.metrics import METRICS
from engine.workitems import Status
from outbox.channel import Channel, OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain
from outbox.store import DeliveryStatus

log = logging.getLogger("leadgate.relay")
D = t.deliveries.c

SEND_LEASE_MS = 120_000
#: How often (by the relay's clock) ``run_once`` looks for expired send leases.
EXPIRY_CHECK_MS = 1_000
_NEVER = 2**62
#: How long a finished send's outcome may wait to be committed with others.
COMMIT_LINGER_S = 0.010
#: A relay that is poked on every enqueue still claims at least this often (by its
#: clock) when its loop runs: retries become due with time, not with an enqueue.
CLAIM_RECHECK_MS = 1_000
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0
INTERNAL_ACTIONS = frozenset({"reveal", "silent", "scheduled"})
NO_BINDING_ERROR = "no active binding for the session"
LEASE_EXPIRED_ERROR = (
    "send lease expired: the relay stopped mid-send; the message may or may not have been posted"
)
#: Attempts (and pauses between them) at committing a group of outcomes before giving
#: up; rows of a group that cannot be committed stay ``sending`` and their send lease
#: expiry turns them into ``deliveryUnknown`` (never a second post).
COMMIT_RETRY_DELAYS_S = (0.05, 0.5, 2.0)


def split_text(text: str, limit: int) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` characters, on line breaks or
    spaces where possible. Nothing is dropped: ``"".join`` of the parts, modulo the
    break characters, gives the text back."""
    if len(text) <= limit:
        return [text]
    parts: list[str] = []
    rest = text
    while len(rest) > limit:
        cut = rest.rfind("\n", 0, limit)
        if cut < limit // 2:
            cut = rest.rfind(" ", 0, limit)
        if cut < limit // 2:
            cut = limit
        parts.append(rest[:cut])
        rest = rest[cut:].lstrip("\n ") if cut < limit else rest[cut:]
    if rest:
        parts.append(rest)
    return parts


# The platform message ids of a committed group (one cached statement, run as an
# executemany; the rows were fenced by the status update just before).
_SET_EXTERNAL_ID = (
    t.deliveries.update()
    .where(D.id == sa.bindparam("b_id"))
    .values(external_id=sa.bindparam("b_external"))
)


@dataclass
class _Done:
    row: dict[str, Any]
    outcome: SendOutcome


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
        max_attempts: int = 8,
        rand: Callable[[], float] = random.random,
        send_lease_ms: int = SEND_LEASE_MS,
        max_rows_per_run: int | None = None,
    ) -> None:
        if batch < 1 or concurrency < 1 or max_attempts < 1 or send_lease_ms < 1:
            raise ValueError("batch, concurrency, max_attempts and send_lease_ms must be >= 1")
        self.db = db
        self.clock = clock
        self.ids = ids
        self.channels = channels
        self.batch = batch
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.rand = rand
        self.send_lease_ms = send_lease_ms
        self.max_rows_per_run = max_rows_per_run or 10 * batch
        self._sem = asyncio.Semaphore(concurrency)
        self._expiry_every_ms = max(1, min(EXPIRY_CHECK_MS, send_lease_ms // 4))
        self._next_expiry_check = 0
        # Local hand-off (outbox.store.set_local_relay): rows enqueued in this process
        # arrive already claimed under this token, after their transaction committed.
        self.handoff_token = ids.new("lease")
        self._handed: list[dict[str, Any]] = []
        self._active = 0
        self._progress: asyncio.Event | None = None
        # Demand-driven claims: set poked_on_enqueue when every enqueue in reach pokes
        # this relay (the service's after-commit hook, PostgreSQL NOTIFY).
        self.poked_on_enqueue = False
        self._poked = False
        self._backlog = False
        self._last_empty_claim = -CLAIM_RECHECK_MS
        self._next_due = _NEVER  # earliest retry this relay scheduled

    def has_room(self) -> bool:
        """Whether another send can start now (for the local hand-off)."""
        return self._active + len(self._handed) < self.concurrency

    def accept(self, rows: list[dict[str, Any]]) -> None:
        """Rows handed over after their enqueuing transaction committed: send them."""
        self._handed.extend(rows)
        if self._progress is not None:
            self._progress.set()

    async def release_handoffs(self) -> int:
        """Shutting down: give rows handed over but not started back to ``pending``."""
        rows, self._handed = self._handed, []
        if not rows:
            return 0
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            res = await conn.execute(
                t.deliveries.update()
                .where(
                    D.id.in_([r["id"] for r in rows]),
                    D.lease_token == self.handoff_token,
                    D.status == DeliveryStatus.sending.value,
                )
                .values(
                    status=DeliveryStatus.pending.value,
                    lease_token=None,
                    lease_expires_at=None,
                    attempts=D.attempts - 1,
                    updated_at=now,
                )
            )
        return int(res.rowcount or 0)

    # ------------------------------------------------------------------ the loop

    async def run_once(self) -> bool:
        """Expire send leases (when due), then claim, send and commit until nothing is
        due. True when it did any work."""
        worked = False
        now = self.clock.now_ms()
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + self._expiry_every_ms
            if await self.expire_send_leases() > 0:
                worked = self._poked = True
        # Claim at once unless nothing can be due: the relay is told of every enqueue
        # (pokes), found nothing a moment ago, and was not poked since. Rows handed over
        # locally need no claim at all.
        claim = not (
            self.poked_on_enqueue
            and not self._poked
            and not self._backlog
            and now < self._next_due
            and now - self._last_empty_claim < CLAIM_RECHECK_MS
        )
        if claim and now >= self._next_due:
            self._next_due = _NEVER
        return await self._pump(claim) > 0 or worked

    def poke(self) -> None:
        """Something became due (an enqueue that was not handed over, an operator retry,
        another replica's NOTIFY): claim at the next opportunity."""
        self._poked = True
        if self._progress is not None:
            self._progress.set()

    async def _pump(self, claim: bool = True) -> int:
        """The claim / send / commit pipeline; returns the number of rows claimed.

        One database "turn" at a time: a single transaction that commits every outcome
        finished since the previous turn and, when the pipeline wants more, claims the
        next batch. Sends run meanwhile; a turn starts as soon as the previous one ended
        and there is something to commit or to claim.
        """
        sending: set[asyncio.Task[_Done]] = set()
        finished: list[_Done] = []
        turn: asyncio.Task[list[dict[str, Any]]] | None = None
        turn_limit = 0
        more = claim  # due rows may be waiting for a claim
        claimed = 0
        high_water = self.concurrency + max(1, self.batch // 2)
        failure: BaseException | None = None
        # Completions are collected by done-callbacks and signalled through one event:
        # O(1) per finished send, where asyncio.wait() over every task in flight would
        # re-register a callback on each of them at every wake-up.
        progress = asyncio.Event()
        self._progress = progress

        def start(row: dict[str, Any]) -> None:
            send = asyncio.create_task(self._deliver(row))
            sending.add(send)
            self._active = len(sending)
            send.add_done_callback(send_done)

        loop = asyncio.get_running_loop()
        oldest = 0.0  # loop time at which the oldest uncommitted outcome finished

        def send_done(task: asyncio.Task[_Done]) -> None:
            nonlocal oldest
            sending.discard(task)
            self._active = len(sending)
            if not task.cancelled():
                if not finished:
                    oldest = loop.time()
                finished.append(task.result())  # _deliver never raises
            progress.set()

        def turn_done(_: asyncio.Task[Any]) -> None:
            progress.set()

        try:
            while True:
                if self._handed and claimed < self.max_rows_per_run:
                    handed, self._handed = self._handed, []
                    claimed += len(handed)
                    for row in handed:
                        start(row)
                if turn is None:
                    if self._poked:
                        self._poked, more = False, True
                    want = (
                        more
                        and failure is None
                        and claimed < self.max_rows_per_run
                        and len(sending) < high_water
                    )
                    # Outcomes linger a little to be committed in larger groups (the
                    # post already happened; only its bookkeeping waits): fewer writer
                    # turns leave the database to approvals.
                    commit_now = bool(finished) and (
                        want
                        or len(finished) >= max(1, self.batch // 4)
                        or loop.time() - oldest >= COMMIT_LINGER_S
                    )
                    if want or commit_now:
                        turn_limit = min(self.batch, self.max_rows_per_run - claimed) if want else 0
                        group, finished = finished, []
                        turn = asyncio.create_task(self._turn(group, turn_limit))
                        turn.add_done_callback(turn_done)
                if turn is None and not sending and not finished:
                    break
                if turn is None and finished:
                    linger = oldest + COMMIT_LINGER_S - loop.time()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(progress.wait(), timeout=max(0.0, linger))
                else:
                    await progress.wait()
                progress.clear()
                if turn is not None and turn.done():
                    task, turn = turn, None
                    try:
                        rows = task.result()
                    except Exception as exc:
                        # Claiming failed (outcomes were committed apart, see _turn):
                        # finish what is in flight, then report.
                        failure = exc
                        continue
                    if turn_limit:
                        claimed += len(rows)
                        more = len(rows) >= turn_limit
                        if not rows:
                            self._last_empty_claim = self.clock.now_ms()
                        for row in rows:
                            start(row)
        except BaseException:
            # Cancelled (shutdown): rows still in flight keep their send lease; its expiry
            # makes posts deliveryUnknown, never a second post.
            for pending_task in (*sending, turn):
                if pending_task is not None:
                    pending_task.cancel()
            raise
        finally:
            self._progress = None
            self._active = 0
        self._backlog = more and failure is None
        if failure is not None:
            raise failure
        return claimed

    async def _turn(self, group: list[_Done], limit: int) -> list[dict[str, Any]]:
        """Commit ``group`` and claim up to ``limit`` rows, in one transaction.

        When that transaction fails, the outcomes are committed on their own (with
        retries) and the claim error is raised: outcomes of sends that happened are
        never dropped because the claim part failed.
        """
        try:
            now = self.clock.now_ms()
            async with self.db.tx() as conn:
                if group:
                    await self._complete_in(conn, group, now)
                return await self._claim_in(conn, limit) if limit else []
        except Exception:
            if group:
                await self._commit_group(group)
            if not limit:
                return []
            raise

    async def _commit_group(self, group: list[_Done]) -> None:
        for attempt, delay in enumerate((*COMMIT_RETRY_DELAYS_S, None)):
            try:
                await self.complete(group)
                return
            except Exception:
                if delay is None:
                    log.exception(
                        "could not commit %d delivery outcomes; their send leases will "
                        "expire (posts become deliveryUnknown)",
                        len(group),
                    )
                    return
                log.warning("committing delivery outcomes failed (attempt %d)", attempt + 1)
                await asyncio.sleep(delay)

    # ------------------------------------------------------------------- leases

    async def expire_send_leases(self) -> int:
        """A relay died mid-send: posts become deliveryUnknown, internal ones pending."""
        now = self.clock.now_ms()
        internal = D.action.in_(sorted(INTERNAL_ACTIONS))
        expired = self.db.skip_locked(
            sa.select(D.id).where(
                D.status == DeliveryStatus.sending.value, D.lease_expires_at < now
            )
        )
        async with self.db.tx() as conn:
            chosen = await self._locked_ids(conn, expired)
            if chosen is not None and not chosen:
                return 0
            rows = (
                await conn.execute(
                    t.deliveries.update()
                    .where(
                        D.id.in_(expired.scalar_subquery() if chosen is None else chosen),
                        D.status == DeliveryStatus.sending.value,
                        D.lease_expires_at < now,
                    )
                    .values(
                        status=sa.case(
                            (internal, DeliveryStatus.pending.value),
                            else_=DeliveryStatus.deliveryUnknown.value,
                        ),
                        error=sa.case((internal, sa.null()), else_=LEASE_EXPIRED_ERROR),
                        lease_token=None,
                        lease_expires_at=None,
                        updated_at=now,
                    )
                    .returning(D.id, D.action, D.channel, D.org_id, D.work_item_id)
                )
            ).all()
            unknown = [r for r in rows if r.action not in INTERNAL_ACTIONS]
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
        for r in unknown:
            log.warning("delivery %s: send lease expired mid-send: deliveryUnknown", r.id)
            METRICS.deliveries.labels(r.channel, "deliveryUnknown").inc()
        return len(rows)

    async def _locked_ids(self, conn: AsyncConnection, query: sa.Select[Any]) -> list[str] | None:
        """PostgreSQL: run the ``FOR UPDATE SKIP LOCKED`` selection on its own and return
        the ids it locked. Inside ``UPDATE ... WHERE id IN (subquery)`` the planner may
        evaluate the subquery more than once, and with SKIP LOCKED each evaluation picks
        other rows, so one claim could take far more than its ``LIMIT``. SQLite (one
        writer, the subquery evaluated once): ``None``, use the subquery inline."""
        if not self.db.is_postgres:
            return None
        return [str(r) for r in (await conn.execute(query)).scalars().all()]

    async def claim(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Claim up to ``limit`` (default ``batch``) due deliveries under one lease token
        (fenced; SKIP LOCKED on PostgreSQL)."""
        async with self.db.tx() as conn:
            return await self._claim_in(conn, limit or self.batch)

    async def _claim_in(self, conn: AsyncConnection, limit: int) -> list[dict[str, Any]]:
        now = self.clock.now_ms()
        token = self.ids.new("lease")
        due = self.db.skip_locked(
            sa.select(D.id)
            .where(D.status == DeliveryStatus.pending.value, D.next_attempt_at <= now)
            .order_by(D.next_attempt_at, D.id)
            .limit(limit)
        )
        chosen = await self._locked_ids(conn, due)
        if chosen is not None and not chosen:
            return []
        rows = (
            await conn.execute(
                t.deliveries.update()
                .where(
                    D.id.in_(due.scalar_subquery() if chosen is None else chosen),
                    D.status == DeliveryStatus.pending.value,
                )
                .values(
                    status=DeliveryStatus.sending.value,
                    lease_token=token,
                    lease_expires_at=now + self.send_lease_ms,
                    attempts=D.attempts + 1,
                    updated_at=now,
                )
                .returning(*t.deliveries.c)
            )
        ).all()
        out = [dict(r._mapping) for r in rows]
        out.sort(key=lambda r: (r["next_attempt_at"], r["id"]))
        return out

    # -------------------------------------------------------------------- sends

    async def _deliver(self, row: dict[str, Any]) -> _Done:
        try:
            return _Done(row, await self._send(row))
        except Exception as exc:  # a bug must not lose the outcome (or the pipeline)
            log.exception("delivery %s: unexpected error", row["id"])
            return _Done(row, Uncertain(f"relay error: {type(exc).__name__}"))

    async def _send(self, row: dict[str, Any]) -> SendOutcome:
        if row["action"] in INTERNAL_ACTIONS:
            return Sent()
        if row["channel"] == "none" or not row["binding_id"]:
            return Permanent(NO_BINDING_ERROR)
        channel = self.channels.get(row["channel"])
        if channel is None:
            return Permanent(f"channel {row['channel']} is not configured")
        if not row["text"]:
            return Sent()
        parts = split_text(row["text"], channel.max_chars)
        external: str | None = None
        async with self._sem:
            for index, part in enumerate(parts):
                # Stable per delivery (and part): the same on every attempt.
                key = row["id"] if index == 0 else f"{row['id']}.{index}"
                try:
                    outcome = await channel.send(
                        OutboundMessage(
                            delivery_id=row["id"],
                            idempotency_key=key,
                            address=row["address"],
                            text=part,
                            kind=row["kind"],
                        )
                    )
                except Exception as exc:  # an adapter bug must not lose the delivery
                    log.exception("channel %s raised instead of mapping an error", row["channel"])
                    outcome = Uncertain(f"adapter error: {type(exc).__name__}")
                if not isinstance(outcome, Sent):
                    if index > 0:
                        # Earlier parts are posted: resending would duplicate them.
                        return Uncertain(
                            f"part {index + 1} of {len(parts)}: {getattr(outcome, 'error', '')}"
                        )
                    return outcome
                external = external or outcome.external_id
        return Sent(external)

    def backoff_s(self, attempts: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter (half fixed, half random), never sooner than
        Retry-After."""
        base = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))
        delay = base * (0.5 + 0.5 * self.rand())
        return float(max(delay, retry_after or 0.0))

    # ------------------------------------------------------------------ commits

    async def complete(self, done: list[_Done]) -> None:
        """Commit a group of outcomes in one transaction."""
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            await self._complete_in(conn, done, now)

    async def _complete_in(self, conn: AsyncConnection, done: list[_Done], now: int) -> None:
        sent = [d for d in done if isinstance(d.outcome, Sent)]
        if sent:
            await self._commit_sent(conn, sent, now)
        for item in done:
            if not isinstance(item.outcome, Sent):
                await self._commit_one(conn, item.row, item.outcome, now)

    async def _commit_sent(self, conn: AsyncConnection, sent: list[_Done], now: int) -> None:
        """Successful sends: a few statements for the whole group, whatever its size."""
        by_token: dict[str, list[_Done]] = {}
        for d in sent:
            by_token.setdefault(d.row["lease_token"], []).append(d)
        committed: set[str] = set()
        for token, group in by_token.items():
            rows = (
                await conn.execute(
                    t.deliveries.update()
                    .where(
                        D.id.in_([d.row["id"] for d in group]),
                        D.lease_token == token,
                        D.status == DeliveryStatus.sending.value,
                    )
                    .values(
                        status=DeliveryStatus.sent.value,
                        lease_token=None,
                        lease_expires_at=None,
                        updated_at=now,
                        error=None,
                    )
                    .returning(D.id)
                )
            ).all()
            committed.update(r.id for r in rows)
        external = [
            {"b_id": d.row["id"], "b_external": d.outcome.external_id}
            for d in sent
            if isinstance(d.outcome, Sent)
            and d.outcome.external_id is not None
            and d.row["id"] in committed
        ]
        if external:
            await conn.execute(_SET_EXTERNAL_ID, external)
        items: list[str] = []
        reveal: list[str] = []
        counts: Counter[tuple[str, str]] = Counter()
        for d in sent:
            row = d.row
            if row["id"] not in committed:
                log.warning("delivery %s: send lease lost before commit", row["id"])
                counts[row["channel"], "leaseLost"] += 1
                continue
            counts[row["channel"], "sent"] += 1
            if row["kind"] == "gating" and row["work_item_id"]:
                items.append(row["work_item_id"])
                if row["action"] == "reveal":
                    reveal.append(row["work_item_id"])
        for (channel, label), count in counts.items():
            METRICS.deliveries.labels(channel, label).inc(count)
        if reveal:
            await conn.execute(
                t.messages.update()
                .where(
                    t.messages.c.id.in_(
                        sa.select(t.work_items.c.gated_message_id).where(
                            t.work_items.c.id.in_(reveal)
                        )
                    )
                )
                .values(lead_gated=False)
            )
        if items:
            moved = await workitems.transition_many(
                conn,
                self.clock,
                self.ids,
                items,
                src=Status.approved,
                dst=Status.completed,
                actor="system:relay",
                action="delivered",
            )
            if len(moved) != len(items):
                for item_id in set(items) - set(moved):
                    log.warning("work item %s was not approved when its delivery finished", item_id)

    async def _commit_one(
        self, conn: AsyncConnection, row: dict[str, Any], outcome: SendOutcome, now: int
    ) -> None:
        values: dict[str, Any] = {"lease_token": None, "lease_expires_at": None, "updated_at": now}
        item_dst: Status | None = None
        label = type(outcome).__name__.lower()
        if isinstance(outcome, Sent):
            values.update(
                status=DeliveryStatus.sent.value, external_id=outcome.external_id, error=None
            )
            item_dst = Status.completed
        elif isinstance(outcome, Retry):
            if row["attempts"] >= self.max_attempts:
                values.update(
                    status=DeliveryStatus.failed.value,
                    error=f"gave up after {row['attempts']} attempts: {outcome.error}",
                )
                item_dst = Status.failed
                label = "failed"
            else:
                delay = self.backoff_s(row["attempts"], outcome.delay_s)
                values.update(
                    status=DeliveryStatus.pending.value,
                    error=outcome.error,
                    next_attempt_at=now + int(delay * 1000),
                )
                self._next_due = min(self._next_due, values["next_attempt_at"])
        elif isinstance(outcome, Permanent):
            values.update(status=DeliveryStatus.failed.value, error=outcome.error)
            item_dst = Status.failed
        else:
            values.update(status=DeliveryStatus.deliveryUnknown.value, error=outcome.error)
            label = "deliveryUnknown"
        res = await conn.execute(
            t.deliveries.update()
            .where(
                D.id == row["id"],
                D.lease_token == row["lease_token"],
                D.status == DeliveryStatus.sending.value,
            )
            .values(**values)
        )
        if not res.rowcount:
            log.warning("delivery %s: send lease lost before commit", row["id"])
            METRICS.deliveries.labels(row["channel"], "leaseLost").inc()
            return
        METRICS.deliveries.labels(row["channel"], label).inc()
        if row["action"] == "reveal" and isinstance(outcome, Sent):
            await conn.execute(
                t.messages.update()
                .where(
                    t.messages.c.id
                    == sa.select(t.work_items.c.gated_message_id)
                    .where(t.work_items.c.id == row["work_item_id"])
                    .scalar_subquery()
                )
                .values(lead_gated=False)
            )
        if row["kind"] != "gating" or row["work_item_id"] is None:
            return
        if item_dst is None:
            if values["status"] == DeliveryStatus.deliveryUnknown.value:
                await workitems.audit(
                    conn,
                    self.clock,
                    self.ids,
                    org_id=row["org_id"],
                    actor="system:relay",
                    action="deliveryUnknown",
                    work_item_id=row["work_item_id"],
                    delivery_id=row["id"],
                    text=values.get("error"),
                )
            return
        try:
            await workitems.transition(
                conn,
                self.clock,
                self.ids,
                row["work_item_id"],
                src=Status.approved,
                dst=item_dst,
                actor="system:relay",
                action="delivered" if item_dst == Status.completed else "deliveryFailed",
                text=values.get("error"),
            )
        except TransitionError:
            log.warning(
                "work item %s was not approved when its delivery finished", row["work_item_id"]
            )
