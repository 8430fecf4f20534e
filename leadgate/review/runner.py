"""The lead review runner (SPEC 4).

Claims ``reviewQueued`` items with a fenced 20-minute lease, gives the lead model a
server-built envelope and exactly three tools, and commits the verdict through
:func:`review.decisions.commit_verdict` fenced by the lease token, so a runner that lost
its lease (another replica re-claimed the item after expiry) cannot commit anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.core.clock import MINUTE_MS, Clock, IdFactory
from leadgate.core.errors import ModelError, NotFound, TransitionError, Unavailable
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.runners import LOCKED_RECHECK_MS, LostClaims, after_lapse, seconds_until
from leadgate.database import schema as t
from leadgate.database.db import (
    Conn,
    Counts,
    Database,
    count_after_commit,
    count_found,
    held_counts,
)
from leadgate.database.plans import AnyRow
from leadgate.database.sql import one_row
from leadgate.domain import workitems
from leadgate.domain.config_cache import ConfigCache
from leadgate.domain.processes import owner_gone
from leadgate.domain.rows import Agent, WorkItem
from leadgate.domain.workitems import Status
from leadgate.review.decisions import Verdict, approve_alone, commit_verdict
from leadgate.turns.providers.base import (
    ChatMessage,
    ModelRequest,
    Provider,
    TextDelta,
    ToolCall,
    ToolSpec,
)
from leadgate.turns.providers.registry import ProviderRegistry
from outbox.store import POST_KINDS, REVEAL_KINDS, Outbox

log = logging.getLogger("leadgate.review")
#: Why a claimed item goes back to the queue (its ``leaseReleased`` audit text). A verdict
#: that could not be stored is not one: it is kept and committed later.
_CLAIM_IN_DOUBT = "the claim met a database fault at its commit (it landed); the review runs again"
_CLAIM_FAILED = "the claim met an error and landed all the same; the review runs again"
_READS_FAILED = "the review's reads met a database fault; the review runs again"

LEASE_MS = 20 * MINUTE_MS
MAX_EXPIRIES = 3
MAX_EXECUTIONS = 4
#: :meth:`LeadRunner.run_once` looks for expired or orphaned review leases this often (by
#: its clock): a lease lasts 20 minutes, a dead holder is reaped every heartbeat.
EXPIRY_CHECK_MS = 1_000
#: A runner told of every enqueue (``poked_on_enqueue``) that found the queue empty
#: still claims at least this often: items queued by another replica wake it no faster
#: than its poll anyway.
CLAIM_RECHECK_MS = 1_000
W = t.work_items.c

_REVIEWING = W.status == Status.reviewing.value
_LAPSED = sa.or_(W.lease_expires_at < sa.bindparam("p_now"), owner_gone(W.lease_owner))
# Built once: the plan cache keys on the statement object (see leadgate.database.plans).
_EXPIRED = sa.select(W.id, W.lease_token, W.lease_expiries).where(_REVIEWING, _LAPSED)
#: The lease check's read, one statement: whether any review lease expired or has a
#: holder known dead, and when the earliest one lapses (both over the ``reviewing`` items
#: alone, reached by the status index). The second tells the runner loop how long it may
#: sleep (:meth:`LeadRunner.due_in_s`) at no extra round trip.
_LEASE_CHECK = sa.select(
    sa.exists().where(_REVIEWING, _LAPSED).label("expired"),
    sa.select(sa.func.min(W.lease_expires_at))
    .where(_REVIEWING)
    .scalar_subquery()
    .label("next_lapse"),
)
_IS_QUEUED = W.status == Status.reviewQueued.value
#: SQLite: the oldest queued items; two, so a claim also learns whether more are waiting
#: (its writers are serialized: no claim runs beside another).
_QUEUED = sa.select(W.id).where(_IS_QUEUED).order_by(W.updated_at, W.id).limit(2)
_HEAD = (
    sa.select(W.id)
    .where(_IS_QUEUED)
    .order_by(W.updated_at, W.id)
    .limit(1)
    .with_for_update(skip_locked=True)
    .cte("head")
)
_OTHER = t.work_items.alias("other")
_CLAIM_SRC, _CLAIM_DST = Status.reviewQueued, Status.reviewing
_CLAIMED, _CLAIM_AUDIT = workitems.moved_with_audit(
    _HEAD.c.id,
    src=_CLAIM_SRC,
    dst=_CLAIM_DST,
    actor="system:lead",
    action="claim",
    values={
        "lease_token": sa.bindparam("p_token"),
        "lease_expires_at": sa.bindparam("p_expires"),
        "lease_owner": sa.bindparam("p_owner"),
    },
    name="claimed",
)
#: PostgreSQL: the whole claim as one statement, run outside a transaction block
#: (:meth:`Database.write_alone`): the oldest queued item not locked by another claim
#: (:data:`_HEAD`) moved ``reviewQueued -> reviewing`` under the claim's lease, fenced by
#: status as :func:`leadgate.domain.workitems.transition` fences it, its ``claim`` audit
#: row, and whether any other item is queued. One round trip where the transaction took
#: five (``BEGIN``, the head, the move, the audit row, ``COMMIT``), and one for an empty
#: queue where it took three. Empty claims are common with several worker replicas:
#: every enqueue's NOTIFY wakes each of them, and all but one find nothing (with two
#: workers, one empty claim per gated lifecycle, measured with ``log_statement``). Only
#: the taken row is locked: ``LIMIT 2 ... FOR UPDATE`` would lock the one it only peeked
#: at too, and a claim running beside it would skip that one and take the queue for
#: empty while it still held an item.
_B = t.bindings.c


def _gating(session_id: sa.ColumnElement[str]) -> list[sa.Label[Any]]:
    """The session's active binding (and its kind) when an approval would post there or
    reveal the answer: the approval can then be one statement too
    (review.decisions.approve_alone)."""
    return [
        sa.select(column)
        .where(
            _B.session_id == session_id,
            _B.active,
            sa.not_(_B.silent),
            _B.kind.in_(sorted(POST_KINDS | REVEAL_KINDS)),
        )
        .limit(1)
        .scalar_subquery()
        .label(label)
        for column, label in ((_B.id, "gating_binding"), (_B.kind, "gating_kind"))
    ]


#: Always one row: a claim that took nothing has its columns NULL, and ``more`` then says
#: whether queued items were there all the same, locked by another transaction (the
#: head skips them): another replica's claim, or a fenced move that lost its race for
#: the row (a lease expiry beside a give-back) and keeps the row lock until its commit.
#: Such a claim must not take the queue for empty (see :meth:`LeadRunner._queue_seen`).
_CLAIM_ALONE = (
    sa.select(
        _CLAIMED,
        sa.exists()
        .where(_OTHER.c.status == _CLAIM_SRC.value, _OTHER.c.id.is_distinct_from(_CLAIMED.c.id))
        .label("more"),
        *_gating(_CLAIMED.c.session_id),
    )
    .select_from(one_row(_CLAIMED))
    .add_cte(_CLAIM_AUDIT)
)
#: A claim in doubt's read-back: the item its lease token holds, still ``reviewing``
#: (the rows :data:`_CLAIM_ALONE` returns but ``more``).
_CLAIM_LANDED = sa.select(t.work_items, *_gating(W.session_id)).where(
    W.lease_token == sa.bindparam("p_token"), W.status == _CLAIM_DST.value
)
#: bound on :attr:`LeadRunner._leads` (entries are taken by the review that follows)
_MAX_LEADS = 1_000
_BY_LEASE = sa.select(W.id).where(
    W.lease_token == sa.bindparam("p_token"), W.status == Status.reviewing.value
)

LEAD_TOOLS = [
    ToolSpec(
        "submit_lead_review",
        "Submit your verdict on the worker's submission. Call exactly once.",
        {
            "type": "object",
            "properties": {
                "verdict": {"type": "string", "enum": [v.value for v in Verdict]},
                "feedback": {
                    "type": "string",
                    "description": "What to change (changesRequested) or why (escalated).",
                    "maxLength": 10_000,
                },
            },
            "required": ["verdict"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "inspect_lead_messages",
        "Read the session transcript, including withheld (gated) assistant messages.",
        {
            "type": "object",
            "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 200}},
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "inspect_lead_artifacts",
        "List the artifacts the worker produced (tool results and attachments).",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
]

BAD_VERDICT = json.dumps({"error": "verdict must be approved, changesRequested or escalated"})

LEAD_SYSTEM = (
    "You are the lead reviewer. A worker agent says its task is complete. Review the "
    "submission against the task and call submit_lead_review exactly once with verdict "
    "approved, changesRequested (with feedback for the worker) or escalated (a human "
    "must decide). The user message is a JSON envelope built by the server."
)


class LeadRunner:
    """Claims and reviews queued work items."""

    name = "lead-review"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        providers: ProviderRegistry,
        outbox: Outbox,
        *,
        on_verdict: Callable[[Verdict], object] = lambda verdict: None,
        owner: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.providers = providers
        self.outbox = outbox
        #: called with each verdict after its commit (changes requested: the revision
        #: dispatcher has work; an approval's delivery wakes the relay by itself)
        self.on_verdict = on_verdict
        #: this process (``lease_owner`` of its review leases; see domain.processes)
        self.owner = owner
        #: (item id, lease token, why: audited) of claimed items to give back to the queue
        self._held: list[tuple[str, str | None, str]] = []
        #: claims in doubt not found landed (the read-back found nothing, or failed):
        #: they may land later, so their tokens are looked for again until their lease
        #: would have lapsed, and whatever holds one is given back; and claims that failed
        #: otherwise (nothing landed, as far as is known), looked for once, at the next
        #: pass
        self._lost: LostClaims[_LostClaim] = LostClaims(name="lead-review")
        #: verdicts the lead gave whose commit met a database fault: committed (fenced by
        #: their lease) once the database is back, not asked of the lead a second time
        self._verdicts: list[_Kept] = []
        #: Set by the composition root when every enqueue in this process calls
        #: :meth:`poke`: a pass then skips the claim while the queue is known empty.
        self.poked_on_enqueue = False
        self._pokes = 0
        #: ``_pokes`` as of the last claim that left the queue empty (-1: not known empty)
        self._empty_at = -1
        #: claims under way: each stands for one poke since the queue was last seen
        #: empty, so one submission wakes every review loop but only one of them claims
        self._claiming = 0
        #: Set by the composition root to the review loops' wake: called when a claim
        #: ends with more pokes than claims to answer them (see :meth:`claim`).
        self.wake: Callable[[], None] = lambda: None
        self._last_empty_claim = 0
        #: ``_pokes`` as of the start of the claim that last reported (:meth:`_queue_seen`)
        self._seen_pokes = -1
        #: when to claim again after a claim found queued items all locked (PostgreSQL;
        #: None: no such claim was the last to report)
        self._locked_look: int | None = None
        self._next_expiry_check = 0
        #: the earliest ``lease_expires_at`` of a review lease at the last lease check
        #: (any runner's, on any replica; None: none was held)
        self._next_lapse: int | None = None
        #: the lead agent read in a claim's transaction, by (item id, lease token)
        self._leads: dict[tuple[str, str | None], Agent] = {}
        #: PostgreSQL: the posting or revealing binding (id, kind) each claim saw (key as
        #: :attr:`_leads`)
        self._gating: dict[tuple[str, str | None], tuple[str, str]] = {}
        #: the lead agents read at claims, kept while their tables are unchanged
        self.config = ConfigCache()

    async def expire_leases(self) -> int:
        """Return items whose review lease expired, or whose holder is known dead
        (:mod:`leadgate.domain.processes`: taken back at once), to the queue (the 3rd
        time: a human). Items queued again are announced as a submission is: this
        process's review loops are poked after the commit, and the other replicas' lead
        runners hear ``NOTIFY leadgate_reviews`` (one per transaction), so they are
        claimed side by side rather than one after another by this loop."""
        now = self.clock.now_ms()
        # Read first: almost always nothing has expired, and a read takes no write lock.
        # Each move below is fenced by status and token, so a stale read moves nothing.
        # PostgreSQL: rows another replica's check is moving are skipped, not waited for:
        # a move that waited and then found the item queued would keep its row lock to
        # its commit, and claims skip a locked row.
        async with self.db.read() as conn:
            check = (await conn.execute(_LEASE_CHECK, {"p_now": now})).one()
        self._next_lapse = check.next_lapse
        if not check.expired:
            return 0
        queued = 0
        async with self.db.tx() as conn:
            rows = (await conn.execute(self.db.skip_locked(_EXPIRED), {"p_now": now})).all()
            for row in rows:
                expiries = row.lease_expiries + 1
                dst = Status.awaitingHuman if expiries >= MAX_EXPIRIES else Status.reviewQueued
                try:
                    await workitems.transition(
                        conn,
                        self.clock,
                        self.ids,
                        row.id,
                        src=Status.reviewing,
                        dst=dst,
                        actor="system:lease",
                        action="leaseExpired",
                        text=f"review lease expired ({expiries} of {MAX_EXPIRIES})",
                        lease_token=row.lease_token,
                        values={
                            "lease_token": None,
                            "lease_expires_at": None,
                            "lease_owner": None,
                            "lease_expiries": expiries,
                        },
                    )
                except TransitionError:
                    continue
                if dst == Status.awaitingHuman:
                    await self.outbox.review_needed(conn, row.id, dst.value)
                else:
                    queued += 1
            if queued:
                await workitems.notify_review_queued(conn)
        for _ in range(queued):
            self.poke()
        if queued:
            self.wake()
        return len(rows)

    def leases_freed(self) -> None:
        """Processes were reaped, here or on another replica (or one shut down): review
        leases they held can be taken back now, so the next pass looks for them, not
        only when its timer says."""
        self._next_expiry_check = 0

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until its next lease check can find a review
        lease lapsed: the earliest lease the last check saw, or None when it saw none.
        The review loops sleep no longer than this
        (:func:`leadgate.core.runners.run_loop`), so a lease whose holder is alive but
        stalled is taken back when it lapses, not up to a poll later. Read from the
        database, so it covers every replica's leases as of that check: one given back
        since makes the loops wake early and look again, and one taken since lapses
        after the earliest (every lease lasts :data:`LEASE_MS`), or is met by the
        checks that every pass, the poll's included, makes. The next look for the token
        of a claim in doubt (:class:`~leadgate.core.runners.LostClaims`) counts too, when
        sooner."""
        lapse = after_lapse(self._next_lapse)
        # The check runs at most every EXPIRY_CHECK_MS: never earlier than it can find it.
        check = None if lapse is None else max(lapse, self._next_expiry_check)
        return seconds_until(self.clock.now_ms(), check, self._lost.next_due(), self._locked_look)

    def poke(self) -> None:
        """An item was queued for review (after its commit): claim at the next pass."""
        self._pokes += 1

    async def claim(self) -> WorkItem | None:
        """Claim the oldest queued item; ``None`` when the queue is empty.

        On SQLite the lead agent is read in the claim's transaction (the review needs it
        next); on PostgreSQL the claim is one statement (:data:`_CLAIM_ALONE`) and the
        lead agent comes from the configuration cache, or is read by the review."""
        now = self.clock.now_ms()
        token = self.ids.new("lease")
        pokes = self._pokes  # before the read: a poke after it means "look again"
        self._claiming += 1
        try:
            if self.db.is_postgres:
                return await self._claim_alone(now, token, pokes)
            async with self.db.tx() as conn:
                ids = (await conn.execute(_QUEUED)).scalars().all()
                head, more = (ids[0] if ids else None), len(ids) > 1
                self._queue_seen(more, pokes, now)
                if head is None:
                    return None
                try:
                    item = await workitems.transition(
                        conn,
                        self.clock,
                        self.ids,
                        head,
                        src=_CLAIM_SRC,
                        dst=_CLAIM_DST,
                        actor="system:lead",
                        action="claim",
                        values={
                            "lease_token": token,
                            "lease_expires_at": now + LEASE_MS,
                            "lease_owner": self.owner(),
                        },
                    )
                except TransitionError:
                    return None
                with contextlib.suppress(NotFound):  # _decide escalates: read it again there
                    self._keep_lead(
                        item, token, await self.config.agent(conn, item.org_id, item.lead_agent_id)
                    )
                return item
        except Exception as exc:
            # Nor is the queue known to be empty any more: the next pass claims.
            self._empty_at = -1
            if isinstance(exc, Unavailable) and exc.in_doubt:
                return await self._claim_landed(token, now, exc)
            # (SQLite: a failed claim rolled back; the look for the token on the next
            # pass finds nothing.) One look: its lease lapses at once for the watch.
            self._lost.watch(_LostClaim(token, _CLAIM_FAILED), due=now, lapses=now)
            raise
        finally:
            self._claiming -= 1
            if self._empty_at >= 0 and self._pokes - self._empty_at > self._claiming:
                # Pokes landed while this claim ran that no claim answers: the loops
                # they woke saw it under way and slept, and it may have read the queue
                # before their items' commits, or taken another item. Wake them again.
                self.wake()

    async def _claim_alone(self, now: int, token: str, pokes: int) -> WorkItem | None:
        """PostgreSQL: :meth:`claim` in one statement (:data:`_CLAIM_ALONE`). The lead
        agent comes from the configuration cache when it is kept there (no connection);
        otherwise :meth:`_decide` reads it."""
        result = await self.db.write_alone(
            _CLAIM_ALONE,
            {
                "p_now": now,
                "p_token": token,
                "p_expires": now + LEASE_MS,
                "p_owner": self.owner(),
                "p_audit_id": self.ids.new("aud"),
            },
        )
        row = result.one()
        took = row.id is not None
        self._queue_seen(bool(row.more), pokes, now, locked=not took)
        return self._claimed(row, token) if took else None

    def _claimed(self, row: AnyRow, token: str) -> WorkItem:
        """The item of a claim's row (:data:`_CLAIM_ALONE`, :data:`_CLAIM_LANDED`), its
        gating binding and its lead (when kept) noted for its review."""
        item = WorkItem.from_row(row[: len(WorkItem._fields)])
        if row.gating_binding is not None:
            if len(self._gating) > _MAX_LEADS:  # claimed, never reviewed (tests)
                self._gating.clear()
            self._gating[item.id, token] = (row.gating_binding, row.gating_kind)
        lead = self.config.kept_agent(self.db.table_changes, item.org_id, item.lead_agent_id)
        if lead is not None:
            self._keep_lead(item, token, lead)
        # Last: a claim that raised before this is watched (_LostClaim), and its look,
        # finding it, counts it (_look_for_lost), so it is counted once either way.
        _count_claim()
        return item

    async def _claim_landed(self, token: str, claimed_at: int, fault: Unavailable) -> WorkItem:
        """A claim under ``token`` (made at ``claimed_at``) failed with ``fault`` in doubt
        (PostgreSQL: the connection dropped with its statement or its COMMIT sent): read
        back, on a fresh connection, whether it landed. Found (the item holds this very
        token, so no other claim won it), the review carries on with it as if the claim
        had answered. Not found, ``fault`` is raised (the next pass claims afresh), and
        the token is watched (:class:`~leadgate.core.runners.LostClaims`): the claim may
        still land after the read. When the read fails too, ``fault`` is raised and the
        token is watched from the next pass on. Whatever holds a watched token is given
        back (:meth:`_release_held`)."""
        lapses = claimed_at + LEASE_MS
        lost = _LostClaim(token, _CLAIM_IN_DOUBT)
        try:
            async with self.db.read() as conn:
                row = (await conn.execute(_CLAIM_LANDED, {"p_token": token})).first()
        except Unavailable:
            self._lost.watch(lost, due=claimed_at, lapses=lapses)
            raise fault from None
        if row is None:
            self._lost.watch(lost, due=self.clock.now_ms() + self._lost.first_ms, lapses=lapses)
            raise fault
        return self._claimed(row, token)

    def _queue_seen(self, more: bool, pokes: int, now: int, *, locked: bool = False) -> None:
        """What a claim that started at ``pokes`` learned of the queue: more waiting (the
        next pass claims), or empty after it. A claim that started before the one that
        last reported is ignored: on PostgreSQL a claim learns the queue only when its
        statement returns, and claims may return out of order; the later claim read the
        queue after the older one, so what the older one saw tells nothing new.

        ``locked``: the claim took nothing, so what ``more`` saw is held by another
        transaction; the loops claim again after :data:`LOCKED_RECHECK_MS`
        (:meth:`due_in_s`). Whoever holds it may commit without a wake-up for this
        process: a move that lost a race for the item keeps its row lock to the end of
        its transaction (PostgreSQL's row locks outlive a failed recheck of ``WHERE``)."""
        if pokes < self._seen_pokes:
            return
        self._seen_pokes = pokes
        self._locked_look = now + LOCKED_RECHECK_MS if more and locked else None
        if more:
            self._empty_at = -1
        else:
            self._empty_at, self._last_empty_claim = pokes, now

    def _keep_lead(self, item: WorkItem, token: str, lead: Agent) -> None:
        if len(self._leads) > _MAX_LEADS:  # claimed, never reviewed (tests)
            self._leads.clear()
        self._leads[item.id, token] = lead

    async def run_once(self) -> bool:
        """Expire leases (when due), then claim and review one item. True when it did
        work."""
        await self._commit_kept()
        await self._release_held()
        now = self.clock.now_ms()
        expired = 0
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + EXPIRY_CHECK_MS
            expired = await self.expire_leases()
        if (
            self.poked_on_enqueue
            and not expired
            and self._empty_at >= 0
            and self._claiming >= self._pokes - self._empty_at
            and now - self._last_empty_claim < CLAIM_RECHECK_MS
        ):
            # The last claim emptied the queue, and every poke since has a claim under
            # way for it: another claim now would find nothing (the review loops share
            # one wake event, so a single submission wakes all of them).
            return False
        item = await self.claim()
        if item is None:
            return False
        await self.review(item)
        return True

    async def review(self, item: WorkItem) -> None:
        """Run the lead on a claimed item and commit its verdict (fenced by the lease)."""
        try:
            verdict, feedback, why = await self._decide(item)
        except Unavailable:
            self._held.append((item.id, item.lease_token, _READS_FAILED))
            raise
        gating = self._gating.pop((item.id, item.lease_token), None)
        await self._commit(_Kept(item, verdict, feedback, why, gating))

    async def _commit_kept(self) -> None:
        """Commit the verdicts a database fault kept from their commit."""
        while self._verdicts:
            await self._commit(self._verdicts.pop(0))

    async def _commit(self, kept: _Kept) -> None:
        """Commit one verdict (fenced by the item's review lease)."""
        item, verdict, feedback, why, gating, doubts = kept
        actor = f"lead:{item.lead_agent_id}"
        # Counted once the verdict is stored: not when the lead gave it (a verdict the
        # lease fence drops was counted, and the item's next review counted again).
        reviewed = labelled(METRICS.reviews, verdict.value if why is None else "escalatedBySystem")
        # Made before the write: a commit in doubt is looked for by it (_landed).
        audit_id = self.ids.new("aud")
        held: Counts = [(reviewed, 1)]
        landed: Counts | None = None
        try:
            if (
                verdict == Verdict.approved
                and why is None
                and gating is not None
                and await approve_alone(
                    self.db,
                    self.outbox,
                    item,
                    *gating,
                    actor=actor,
                    feedback=feedback,
                    audit_id=audit_id,
                    held=held,
                )
            ):
                self.on_verdict(verdict)  # (one statement, committed and counted)
                return
            async with self.db.tx() as conn:
                held = held_counts(conn)
                try:
                    await commit_verdict(
                        conn,
                        self.outbox,
                        item,
                        verdict,
                        actor=actor,
                        feedback=feedback if why is None else why,
                        src=Status.reviewing,
                        lease_token=item.lease_token,
                        audit_id=audit_id,
                    )
                except TransitionError:
                    landed = await _landed(conn, doubts)
                    if landed is None:
                        log.warning("lost the review lease of %s; verdict dropped", item.id)
                        return
                else:
                    count_after_commit(conn, reviewed)
        except Unavailable as fault:
            # The verdict could not be stored (database down): kept, and committed on the
            # runner's first pass once the database is back, under the item's lease (the
            # lead is not asked again: it might not answer the same). If the lease is
            # gone by then, the fence drops it and the item's next review decides. A
            # commit in doubt may have landed: its audit row's id and what it counts are
            # kept with it, for the look of that retry.
            if fault.in_doubt:
                kept = kept._replace(doubts=(*doubts, (audit_id, held)))
            self._verdicts.append(kept)
            raise
        if landed is not None:
            # An earlier commit of this verdict was in doubt and landed (the retry's
            # fence found the lease gone, and its look the audit row): counted now, as
            # that commit would have, once (the relay's look for a post or card that
            # commit handed over shares the list: whichever finds it first counts).
            count_found(landed)
        self.on_verdict(verdict if why is None else Verdict.escalated)

    async def _release_held(self) -> None:
        """Return items whose verdict could not be committed to ``reviewQueued``, and
        those that claims in doubt took under a token nobody holds (the watched tokens
        whose look is due)."""
        await self._look_for_lost()
        while self._held:
            # Several review loops share this list: take the item first.
            held = self._held.pop(0)
            try:
                await self._release(*held)
            except Exception:
                self._held.append(held)
                raise

    async def _look_for_lost(self) -> None:
        """Look for the watched tokens whose look is due: an item found holding one is
        held for give-back, fenced by that token (a claim another runner or replica
        holds has a token of its own, so it is never touched)."""
        if not self._lost:  # (every pass: nothing to look at without a fault)
            return
        now = self.clock.now_ms()
        due = self._lost.take_due(now)
        for n, lost in enumerate(due):
            try:
                async with self.db.read() as conn:
                    item_id = await conn.scalar(_BY_LEASE, {"p_token": lost.token.token})
            except BaseException:  # (cancelled too: the tokens not looked for stay watched)
                self._lost.put_back(due[n:])
                raise
            if item_id is not None:
                # The claim landed (only it set this token) with its move uncounted: a
                # commit in doubt, or one that raised, counts nothing. Counted now, once
                # (a token found is watched no more), as its give-back will be.
                _count_claim()
                self._held.append((item_id, lost.token.token, lost.token.why))
            else:
                self._lost.not_found(lost, now)

    async def _release(self, item_id: str, lease_token: str | None, why: str) -> None:
        """Give one held item back to the queue (fenced by its lease), audited ``why``."""
        async with self.db.tx() as conn:
            try:
                await workitems.transition(
                    conn,
                    self.clock,
                    self.ids,
                    item_id,
                    src=Status.reviewing,
                    dst=Status.reviewQueued,
                    actor="system:lead",
                    action="leaseReleased",
                    text=why,
                    lease_token=lease_token,
                    values={"lease_token": None, "lease_expires_at": None, "lease_owner": None},
                )
            except TransitionError:
                return  # taken back or moved meanwhile
        self.poke()

    async def _decide(self, item: WorkItem) -> tuple[Verdict, str | None, str | None]:
        """(verdict, the lead's feedback, why the system escalated instead or None)."""
        lead = self._leads.pop((item.id, item.lease_token), None)
        if lead is None:
            async with self.db.read() as conn:
                try:
                    lead = await self.config.agent(conn, item.org_id, item.lead_agent_id)
                except NotFound:
                    return Verdict.escalated, None, "the lead agent no longer exists"
        if not lead.active:
            return Verdict.escalated, None, "the lead agent is inactive"
        try:
            provider = self.providers.get(lead.model)
        except ModelError as exc:
            return Verdict.escalated, None, exc.message
        envelope = {
            "taskContext": item.task_context,
            "summary": item.summary,
            "submissionSnapshot": item.snapshot,
            "revision": item.revision,
            "maxRevisionRounds": item.max_revision_rounds,
            "previousFeedback": item.last_feedback,
        }
        messages = [
            ChatMessage("system", (lead.instructions or "") + "\n\n" + LEAD_SYSTEM),
            ChatMessage("user", json.dumps(envelope)),
        ]
        for execution in range(1, MAX_EXECUTIONS + 1):
            try:
                text, calls = await self._execute(provider, messages)
            except Exception as exc:
                # A provider's own words may echo the request: logs get the summary.
                shown = exc.summary if isinstance(exc, ModelError) else exc
                log.warning("lead execution %d failed: %s", execution, shown)
                if execution == MAX_EXECUTIONS:
                    return Verdict.escalated, None, f"the lead model failed: {exc}"
                continue
            messages.append(ChatMessage("assistant", text, tool_calls=tuple(calls)))
            if not calls:
                messages.append(ChatMessage("user", "Call submit_lead_review with your verdict."))
            for call in calls:
                if call.name == "submit_lead_review":
                    decided = _verdict_of(call)
                    if decided is not None:
                        return decided[0], decided[1], None
                    messages.append(ChatMessage("tool", BAD_VERDICT, tool_call_id=call.id))
                    continue
                result = await self._inspect(item, call)
                messages.append(ChatMessage("tool", result, tool_call_id=call.id))
        return Verdict.escalated, None, f"no verdict after {MAX_EXECUTIONS} lead executions"

    async def _execute(
        self, provider: Provider, messages: list[ChatMessage]
    ) -> tuple[str, list[ToolCall]]:
        """One lead model call: its text and tool calls."""
        calls: list[ToolCall] = []
        text: list[str] = []
        request = ModelRequest(messages=messages, tools=LEAD_TOOLS, purpose="lead")
        async for event in provider.stream(request):
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, ToolCall):
                calls.append(event)
        return "".join(text), calls

    async def _inspect(self, item: WorkItem, call: ToolCall) -> str:
        m = t.messages.c
        async with self.db.read() as conn:
            if call.name == "inspect_lead_messages":
                limit = call.arguments.get("limit", 50)
                limit = limit if isinstance(limit, int) and 1 <= limit <= 200 else 50
                rows = (
                    await conn.execute(
                        sa.select(m.role, m.content, m.lead_gated)
                        .where(m.session_id == item.session_id)
                        .order_by(m.created_at.desc(), m.id.desc())
                        .limit(limit)
                    )
                ).all()
                return json.dumps(
                    [
                        {"role": r.role, "content": r.content, "leadGated": bool(r.lead_gated)}
                        for r in reversed(rows)
                    ]
                )
            if call.name == "inspect_lead_artifacts":
                artifacts = (
                    await conn.execute(
                        sa.select(m.tool_name, m.content)
                        .where(m.session_id == item.session_id, m.role == "tool")
                        .order_by(m.created_at, m.id)
                    )
                ).all()
                return json.dumps([{"tool": r.tool_name, "content": r.content} for r in artifacts])
        return json.dumps({"error": f"unknown tool {call.name!r}"})


def _verdict_of(call: ToolCall) -> tuple[Verdict, str | None] | None:
    """(verdict, feedback) of a submit_lead_review call; ``None`` for a bad verdict."""
    try:
        verdict = Verdict(str(call.arguments.get("verdict")))
    except ValueError:
        return None
    feedback = call.arguments.get("feedback")
    return verdict, feedback[:10_000] if isinstance(feedback, str) else None


#: The look for a verdict's commits in doubt: the one of their audit rows that landed.
_AUDIT_ID = sa.select(t.audit.c.id).where(t.audit.c.id.in_(sa.bindparam("p_ids", expanding=True)))


async def _landed(conn: Conn, doubts: tuple[tuple[str, Counts], ...]) -> Counts | None:
    """What the commit in doubt of a kept verdict that landed counts (``doubts``: the
    audit row id and counts of each commit in doubt), or None when none landed. Read in
    the retry's transaction after its fenced move matched nothing: that move waited for
    the item's row lock, so a commit in doubt still under way on the server has ended
    by then, and one that landed is seen (PostgreSQL reads what committed before each
    statement). At most one landed: each was fenced by the same lease."""
    if not doubts:
        return None
    found = await conn.scalar(_AUDIT_ID, {"p_ids": [audit_id for audit_id, _ in doubts]})
    return next((held for audit_id, held in doubts if audit_id == found), None)


def _count_claim() -> None:
    """Count a claim's move, found landed outside its own transaction (one statement
    run alone, or a claim read back after a fault): :func:`workitems.transition` counts
    it at commit inside one."""
    labelled(METRICS.transitions, _CLAIM_SRC.value, _CLAIM_DST.value).inc()


class _LostClaim(NamedTuple):
    """A claim the watch looks for (:class:`~leadgate.core.runners.LostClaims`): the
    item found holding its lease token is given back, audited for how the claim failed."""

    token: str
    #: the give-back's audit text: a fault in doubt at the claim's commit, or another
    #: error that the server applied the claim despite
    why: str


class _Kept(NamedTuple):
    """A lead's verdict on a claimed item, until it is committed."""

    item: WorkItem
    verdict: Verdict
    feedback: str | None
    why: str | None
    gating: tuple[str, str] | None
    #: each commit of it that was in doubt: its audit row's id, and what it counts
    #: (counted when a later retry, dropped by the lease fence, finds that row)
    doubts: tuple[tuple[str, Counts], ...] = ()
