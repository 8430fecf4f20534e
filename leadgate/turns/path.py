"""The one turn path every way in ends on (SPEC 3).

``TurnService.run(trigger)`` takes an external message in (:mod:`leadgate.turns.intake`),
runs the worker model with ``complete_task`` offered only under a matching trusted
context, and ends in one of :data:`leadgate.core.types.Outcome`. ``run_revision`` runs an
internal revision turn (lead feedback or a human's return) on the same path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from binding import bindings
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import (
    DatabaseDamaged,
    IntakeInDoubt,
    LeadgateError,
    ModelError,
    NotFound,
    TransitionError,
    TurnInterrupted,
    Unavailable,
    ValidationError,
)
from leadgate.core.limits import (
    SNAPSHOT_LIMIT,
    SUMMARY_LIMIT,
    UNSTORABLE,
    validate_message,
    validate_session_key,
)
from leadgate.core.logs import loggable
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.runners import LOCKED_RECHECK_MS, LostClaims
from leadgate.core.types import (
    BindingKind,
    Busy,
    Duplicate,
    Gated,
    Outcome,
    Reply,
    Trigger,
    Usage,
    not_processed,
)
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, count_after_commit, damage_met
from leadgate.database.faults import DATABASE_FAULTS, unavailable
from leadgate.database.sql import insert_ignore_stmt, later_of_sql, one_row
from leadgate.domain import agents as agents_mod
from leadgate.domain import policy, session_events, workitems
from leadgate.domain.processes import owner_gone
from leadgate.domain.rows import Agent, Binding, WorkItem
from leadgate.domain.workitems import Status
from leadgate.turns import runs
from leadgate.turns.context import COMPLETE_TASK, ITEM_GONE, SUBMITTED, TurnContext
from leadgate.turns.history import TOPIC as HISTORY_TOPIC
from leadgate.turns.history import HistoryCache
from leadgate.turns.intake import Accepted, Intake, duplicate_if_taken_in
from leadgate.turns.messages import VisibleWrites, store_message
from leadgate.turns.providers.base import ChatMessage, ModelRequest, TextDelta, ToolCall, ToolSpec
from leadgate.turns.providers.registry import ProviderRegistry
from leadgate.turns.runs import GAVE_UP_RULE
from outbox.store import Outbox

log = logging.getLogger("leadgate.turns")

MAX_MODEL_CALLS = 4
#: How often a recorded channel turn retries its last transaction on a database fault.
FINISH_RETRIES = 6
REVISION_LEASE_MS = 5 * 60_000

DeltaSink = Callable[[str], Awaitable[None]]
#: What a caller writes in the last transaction of an API turn that ends in a reply or
#: withheld (REST's answer under its Idempotency-Key): it commits with the turn's end, or
#: neither does.
TurnAnswer = Callable[[Conn, Reply | Gated], Awaitable[None]]
#: What a rerun of a recorded turn writes in its last transaction for each external event
#: id its messages were taken in under (:attr:`TurnService.keyed_answer`): its answer, or
#: the error its end stands for (the model's, or the give-up's) when it ends failed.
KeyedAnswer = Callable[[Conn, str, Reply | Gated | LeadgateError], Awaitable[None]]
_W = t.work_items.c
# Hot statements are built once: the plan cache keys on the statement object, and
# building one per call (with its cache key) costs more than SQLite takes to run it.


def _revision_waits(items: sa.FromClause) -> tuple[sa.ColumnElement[bool], ...]:
    """An ``inProgress`` item (of ``items``: the table or an alias) whose feedback waits
    for its revision turn."""
    c = items.c
    return (c.status == Status.inProgress.value, c.pending_feedback.is_not(None))


def _revision_claimable(items: sa.FromClause) -> sa.ColumnElement[bool]:
    """... and is claimable: no revision lease, or one that lapsed or whose holder is
    gone."""
    c = items.c
    return sa.or_(
        c.lease_expires_at.is_(None),
        c.lease_expires_at < sa.bindparam("p_now"),
        owner_gone(c.lease_owner),
    )


_REVISION_WAITS = _revision_waits(t.work_items)
_REVISION_CLAIMABLE = _revision_claimable(t.work_items)
#: The claim's pick, in its transaction: the claimable item waiting longest.
_REVISION_DUE = (
    sa.select(_W.id).where(*_REVISION_WAITS, _REVISION_CLAIMABLE).order_by(_W.updated_at).limit(1)
)
_REVISION_HEAD = _REVISION_DUE.with_for_update(skip_locked=True).cte("head")
_OTHER = t.work_items.alias("other")
#: PostgreSQL: the pick (``FOR UPDATE SKIP LOCKED``), always one row: its ``id`` NULL when
#: it took nothing, and ``locked`` then says whether claimable items were there all the
#: same, locked by another transaction (the pick skips them): another replica's claim,
#: or a fenced move that lost its race for the item (a person's approval or cancel beside
#: the return that made it claimable) and keeps the row lock until its commit, with no
#: wake-up after it. Such a claim must not leave the dispatcher asleep until the poll.
_REVISION_PICK = sa.select(
    _REVISION_HEAD.c.id,
    sa.exists()
    .where(
        *_revision_waits(_OTHER),
        _revision_claimable(_OTHER),
        _OTHER.c.id.is_distinct_from(_REVISION_HEAD.c.id),
    )
    .label("locked"),
).select_from(one_row(_REVISION_HEAD))
#: The claim's read before it: the claimable item waiting longest or, when none is, the
#: one whose revision lease lapses first (its ``lease_expires_at``: when the revision
#: dispatcher is due again). One pass over the same rows as ``_REVISION_DUE``'s when
#: nothing is due (the common case: both read every ``inProgress`` row off the status
#: index, then order the few whose feedback waits); it replaced that read plus a second
#: one for the earliest lapse after every empty pass.
_REVISION_NEXT = (
    sa.select(_W.id, _W.lease_expires_at, _REVISION_CLAIMABLE.label("claimable"))
    .where(*_REVISION_WAITS)
    .order_by(
        sa.case((_REVISION_CLAIMABLE, 0), else_=1),
        sa.case((_REVISION_CLAIMABLE, _W.updated_at), else_=_W.lease_expires_at),
    )
    .limit(1)
)
#: A revision claim's token looked for (:meth:`TurnService.claim_revision_or_lapse`): the
#: item that holds it with its feedback still waiting.
_REVISION_HELD = sa.select(t.work_items).where(
    *_REVISION_WAITS, _W.lease_token == sa.bindparam("p_token")
)
_CLAIM_REVISION = (
    t.work_items.update()
    .where(
        _W.id == sa.bindparam("p_id"),
        _W.status == Status.inProgress.value,
        _W.pending_feedback.is_not(None),
    )
    .returning(*t.work_items.c)
)
#: complete_task's signal, fenced on the turn's own item, session and worker
_SIGNAL = t.work_items.update().where(
    _W.id == sa.bindparam("p_id"),
    _W.status == Status.inProgress.value,
    _W.session_id == sa.bindparam("p_session"),
    _W.agent_id == sa.bindparam("p_agent"),
)
#: PostgreSQL: complete_task's signal and its tool message as one statement outside a
#: transaction block (``Database.write_alone``): one round trip where the transaction
#: took four (``BEGIN``, the signal, the message, ``COMMIT``). A tool message has no
#: session event (store_message writes none for it); the message is stored whether or
#: not the signal matched, as the transaction stores it.
_SIGNAL_ROW = (
    _SIGNAL.values(
        signal_summary=sa.bindparam("signal_summary"),
        signal_turn_id=sa.bindparam("signal_turn_id"),
    )
    .returning(_W.id)
    .cte("signal")
)
_M = t.messages.c
_TOOL_MESSAGE = (
    t.messages.insert()
    .values(
        id=sa.bindparam("m_id", type_=_M.id.type),
        org_id=sa.bindparam("m_org", type_=_M.org_id.type),
        session_id=sa.bindparam("p_session", type_=_M.session_id.type),
        work_item_id=sa.bindparam("p_id", type_=_M.work_item_id.type),
        role="tool",
        content=sa.bindparam("m_content", type_=_M.content.type),
        lead_gated=False,
        tool_name=COMPLETE_TASK.name,
        created_at=session_events.message_created_at(
            sa.bindparam("m_at", type_=_M.created_at.type),
            sa.bindparam("p_session", type_=_M.session_id.type),
        ),
    )
    .cte("tool_message")
)
_SIGNAL_ALONE = (
    sa.select(sa.func.count().label("signalled")).select_from(_SIGNAL_ROW).add_cte(_TOOL_MESSAGE)
)
_READ_SIGNAL = sa.select(_W.signal_summary).where(
    _W.id == sa.bindparam("p_item"), _W.signal_turn_id == sa.bindparam("p_turn")
)


def _submit_alone() -> sa.TextClause:
    """PostgreSQL: a submission whose provenance is complete, as one statement outside a
    transaction block (``Database.write_alone``); see :meth:`TurnService._submit`.

    It writes what the submission's transaction writes (the withheld answer, the end of
    the turn's run, the fenced move ``inProgress -> reviewQueued`` taking the summary
    complete_task left, its audit row, its session event, the lead runners' NOTIFY) only
    when every condition under which that transaction would move the item holds, with the
    item (and the run, when the turn is fenced on it) locked: this turn's signal, the
    item's session, an active binding of that session, and the run still this turn's.
    Otherwise it writes nothing, and the transaction decides as before (withheld, a
    human's review for incomplete provenance, a lost run). One round trip where the
    transaction took ten (``BEGIN``, the message, the run, the item, the binding, the move,
    its audit row, the NOTIFY, the session event, ``COMMIT``).

    A revision's submission (``:rev_lease``, the revision runner's lease; NULL for a
    first one) also gives that lease back with the move, when the item still holds it,
    as the transaction's release does before its move. Its session event is not written:
    a revised item is ``pending`` to the client before and after (public_status)."""
    src, dst = Status.inProgress, Status.reviewQueued
    workitems.require_move(src, dst, event=True)
    # (the events are those of a first submission; a revision's move is not public)
    events = session_events.postgres_moved_item_events("first_moved", src.value, dst.value)
    assert events is not None  # (require_move: the move changes the public status)
    return sa.text(
        "WITH run_locked AS ("
        " SELECT id FROM turn_runs WHERE lease_token = :run_token FOR UPDATE"
        "), ok AS MATERIALIZED ("
        " SELECT w.id, w.org_id, w.session_id, w.signal_summary,"
        " (SELECT b.id FROM bindings AS b WHERE b.session_id = w.session_id AND b.active"
        " AND b.org_id = w.org_id LIMIT 1) AS binding_id"
        " FROM work_items AS w"
        " WHERE w.id = :item AND w.status = :src AND w.session_id = :session"
        " AND w.signal_turn_id = :turn"
        " AND (NOT CAST(:fenced AS boolean) OR EXISTS (SELECT 1 FROM run_locked))"
        " FOR UPDATE OF w"
        "), go AS (SELECT * FROM ok WHERE binding_id IS NOT NULL"
        "), answer AS ("
        " INSERT INTO messages (id, org_id, session_id, work_item_id, role, content,"
        " lead_gated, tool_name, created_at)"
        " SELECT CAST(:m_id AS varchar), go.org_id, go.session_id, go.id, 'assistant',"
        " CAST(:content AS varchar), true, NULL, "
        + session_events.message_created_at_sql(":now", "go.session_id")
        + " FROM go"
        "), run_done AS ("
        " DELETE FROM turn_runs WHERE id IN (SELECT id FROM run_locked)"
        " AND EXISTS (SELECT 1 FROM go)"
        "), moved AS ("
        " UPDATE work_items AS w SET status = :dst, summary = go.signal_summary,"
        " snapshot = :snapshot, gated_message_id = :m_id, signal_summary = NULL,"
        " signal_turn_id = NULL, binding_id = go.binding_id, last_activity_at = :now,"
        f" updated_at = {later_of_sql('now', 'w.updated_at')},"
        # The revision's lease given back (a NULL :rev_lease matches nothing).
        " pending_feedback = CASE WHEN w.lease_token = CAST(:rev_lease AS varchar)"
        " THEN NULL ELSE w.pending_feedback END,"
        " lease_token = CASE WHEN w.lease_token = CAST(:rev_lease AS varchar)"
        " THEN NULL ELSE w.lease_token END,"
        " lease_expires_at = CASE WHEN w.lease_token = CAST(:rev_lease AS varchar)"
        " THEN NULL ELSE w.lease_expires_at END,"
        " lease_owner = CASE WHEN w.lease_token = CAST(:rev_lease AS varchar)"
        " THEN NULL ELSE w.lease_owner END"
        " FROM go WHERE w.id = go.id"
        " RETURNING w.id, w.org_id, w.session_id, w.revision, w.updated_at,"
        " go.signal_summary AS summary"
        "), first_moved AS (SELECT * FROM moved WHERE revision = 0"
        "), audit_row AS ("
        " INSERT INTO audit (id, org_id, work_item_id, delivery_id, actor, action,"
        " from_status, to_status, text, created_at)"
        " SELECT CAST(:audit_id AS varchar), moved.org_id, moved.id, NULL, 'system:turn',"
        " 'completeTask', CAST(:src AS varchar), CAST(:dst AS varchar), moved.summary,"
        " moved.updated_at FROM moved"
        ")" + events.ctes + " SELECT (SELECT count(*) FROM moved) AS moved,"
        " (SELECT count(pg_notify(:review_channel, :sender)) FROM moved) AS notified, "
        + events.columns
    ).bindparams(
        src=src.value, dst=dst.value, review_channel=workitems.REVIEW_CHANNEL, **events.params
    )


_SUBMIT_ALONE = _submit_alone()


class TurnService:
    """Runs turns. One instance per process; safe to call concurrently.

    ``on_review_queued`` is called after a submission committed (wakes the lead runner);
    ``outbox`` queues plain replies on channel bindings in the reply's transaction.
    """

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        providers: ProviderRegistry,
        outbox: Outbox,
        *,
        on_review_queued: Callable[[], None] = lambda: None,
        on_delivery_queued: Callable[[], None] = lambda: None,
        owner: Callable[[], str | None] = lambda: None,
        maybe_reaped: Callable[[str], bool] = lambda process_id: False,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.db = db
        #: whether this process, registered under the given id when a turn took its
        #: message in, may have been reaped since (Liveness.maybe_reaped)
        self.maybe_reaped = maybe_reaped
        self.clock = clock
        self.ids = ids
        self.providers = providers
        self.outbox = outbox
        self.on_review_queued = on_review_queued
        self.on_delivery_queued = on_delivery_queued
        self.history = HistoryCache()
        db.on_commit_payloads(HISTORY_TOPIC, self.history.apply)
        #: lease tokens of this process's recorded runs whose turn stopped on a database
        #: fault, or whose intake's commit was in doubt and could not be read back (the
        #: turn never started, the run may exist): the recovery runner takes them over
        #: once the database is back (in an ``api`` process, which runs no runners, its
        #: own turn recovery loop: only this process knows them)
        self.orphans: set[str] = set()
        #: lease tokens of the recorded runs this process's turns are running now (from
        #: :meth:`execute`'s start to its end): the heartbeat renews their leases
        #: (:meth:`renew_runs`), so turn recovery takes a run over only when its process
        #: is dead or its turn is gone (it ended without ending its run)
        self.running: set[str] = set()
        #: plain REST/MCP/Studio turns (no run recorded) that stopped on a database fault
        #: after their intake, their clients told not to send the message again: the run
        #: row to record for each (by its lease token) once the database is back, then
        #: rerun as an orphan (:meth:`record_owed`). In this process's memory only: lost
        #: if it dies first (nothing stored tells such a message from an answered one).
        self.owed: dict[str, dict[str, Any]] = {}
        #: when each turn of :meth:`run` in flight began (at or before its message's
        #: time), a plain REST/MCP/Studio turn's until it ends: :meth:`turns_since`
        self._in_flight: dict[object, int] = {}
        #: owed runs of intakes in doubt (:meth:`_owe_in_doubt`) whose record found their
        #: message absent: the server may still apply such an intake after that look
        #: (PostgreSQL: a statement whose connection dropped can commit after a read on
        #: another connection found nothing), and its client, finding it in the
        #: transcript then, sends nothing. Looked for again a second on, then at
        #: doubling gaps, until a run lease after the first look (:meth:`record_owed`).
        self.owed_lost: LostClaims[dict[str, Any]] = LostClaims(
            name="owed-turns", on_watch=lambda: self.recovery_due()
        )
        #: Set by the composition root to the recovery runner's wake: called when a run
        #: is orphaned or watched (:meth:`orphaned`, :attr:`lost`) outside that runner's
        #: passes, so it looks now (or at the look's time), not at its next poll.
        self.recovery_due: Callable[[], None] = lambda: None
        #: lease tokens of runs not found where they may still land (an intake in doubt
        #: whose read-back found nothing; orphans a recovery claim did not find, when an
        #: intake or a recovery claim in doubt may yet be applied): looked for again by the
        #: recovery runner's claim when due, until their run's lease would have lapsed
        #: (:func:`leadgate.turns.runs.claim`)
        self.lost: LostClaims[runs.RunLook] = LostClaims(
            name="turn-recovery", on_watch=lambda: self.recovery_due()
        )
        self.intake = Intake(
            db, clock, ids, self.history, owner=owner, doubted=self.orphaned, lost=self.lost
        )
        #: lease tokens of revision claims whose commit was in doubt, looked for by the
        #: revision dispatcher's next passes (:meth:`claim_revision_or_lapse`)
        self.revisions_lost: LostClaims[str] = LostClaims(name="revision-dispatch")
        #: Replies of API turns (on PostgreSQL, concurrent ones in one statement).
        self.visible = VisibleWrites(db, clock, ids)
        self.owner = owner
        #: the wait between tries of a recorded channel turn's last transaction (tests
        #: make it instant)
        self.sleep = sleep
        #: Set by the composition root (REST's ``Idempotency-Key`` store): writes a rerun
        #: turn's answer, in its last transaction, under the key whose event id its
        #: message was taken in under (nothing for other event ids), so that the key's
        #: retry gets the rerun's answer (see :meth:`resume`).
        self.keyed_answer: KeyedAnswer | None = None

    async def run(
        self,
        trigger: Trigger,
        *,
        on_delta: DeltaSink | None = None,
        on_start: Callable[[], Awaitable[None]] | None = None,
        answer: TurnAnswer | None = None,
        retake: bool = False,
    ) -> Outcome:
        """Take ``trigger`` in and run the worker's turn.

        ``on_delta`` receives text as the model produces it, but only when nothing can
        withhold or rewrite it (no lead, no output policy rules); otherwise the text is
        delivered whole after the turn. ``on_start`` is awaited once the message was
        accepted (not busy, not a duplicate), before the model runs. ``answer`` is
        awaited inside the turn's last transaction, with the reply or the withheld text
        (see :data:`TurnAnswer`).

        A database fault after the intake committed is :class:`TurnInterrupted`, never
        the fault's own "nothing was stored, retry": the message is stored, and every
        caller (REST, MCP, Studio, flows, schedules) must not send it again.

        ``retake`` (REST's retry of an ``Idempotency-Key`` whose first request's process
        died): when the message was taken in already (a duplicate) and its recorded run
        is left with no live process running it, the run is claimed
        (:func:`leadgate.turns.runs.claim_for_retry`) and the turn runs here from the
        stored message, answered as this call's own; a run still being run is
        ``Duplicate(running=True)``.
        """
        # At or before the message's own time: the created_at of the run a fault makes
        # this process owe (the order of recovery's claims).
        taken_at = self.clock.now_ms()
        # In flight from before its message is stamped, so that no heartbeat misses it.
        flight = object()
        self._in_flight[flight] = taken_at
        try:
            try:
                intake = await self.take(trigger)
            except IntakeInDoubt as exc:
                self._owe_in_doubt(trigger, exc, taken_at)
                raise
            if not isinstance(intake, Accepted) or intake.ctx.taken_by is None:
                del self._in_flight[flight]  # (a recorded run or none: not searched)
            if isinstance(intake, Duplicate) and retake and not intake.busy:
                assert trigger.external_event_id is not None
                again = await self._retaken(trigger.external_event_id)
                if again is None:
                    return intake
                if not isinstance(again, Accepted):
                    return Duplicate(running=True)
                intake = again
            if isinstance(intake, Busy | Duplicate):
                return intake
            if on_start is not None:
                await on_start()
            try:
                return await self.execute(intake, on_delta=on_delta, answer=answer)
            except TurnInterrupted:
                raise
            except Exception as exc:
                # A model error is never read as a database fault, whatever its causes are.
                fault = None
                if not isinstance(exc, LeadgateError) or isinstance(exc, Unavailable):
                    fault = unavailable(exc)
                if fault is None:
                    # Answered with its failure: not one for recovery to answer again (nor
                    # the run it recorded if this process was reaped meanwhile).
                    taken_by = intake.ctx.taken_by
                    reaped = taken_by is not None and self.maybe_reaped(taken_by)
                    await self.intake.settled(trigger, intake, take_back=reaped)
                    raise
                self._owe(trigger, intake, taken_at)
                raise TurnInterrupted(fault.detail) from exc
        finally:
            # (Owed, it is in owed now: turns_since still counts it.)
            self._in_flight.pop(flight, None)

    def turns_since(self) -> int | None:
        """When the oldest plain REST/MCP/Studio turn this process has in flight, or owes
        (stopped on a database fault, its run not recorded yet: :attr:`owed`,
        :attr:`owed_lost`), began: at or before its message's time (None: none). Written
        with each heartbeat (:attr:`leadgate.domain.processes.Liveness.turns_since`), so
        that turn recovery's search of this process once it is gone reaches back to it
        (:func:`leadgate.turns.runs.record_taken`): no limit bounds a whole turn (the
        model's timeout bounds each wait for its next bytes, not a long stream), and a
        search bounded by the run lease alone missed a turn that ran longer."""
        owed = [int(values["created_at"]) for values in self.owed.values()]
        owed += [int(look.token["created_at"]) for look in self.owed_lost]
        return min([*self._in_flight.values(), *owed], default=None)

    def _owe(self, trigger: Trigger, turn: Accepted, taken_at: int) -> None:
        """``turn`` stopped on a database fault and its client is told not to send the
        message again: when it recorded no run (a plain REST/MCP/Studio turn), nothing
        would ever answer the message. This process owes it (:attr:`owed`), and its
        turn recovery is woken to record and rerun it once the database is back."""
        values = self.intake.owed_run(trigger, turn, taken_at)
        if values is None:
            return
        self.owed[str(values["lease_token"])] = values
        self.recovery_due()

    def _owe_in_doubt(self, trigger: Trigger, exc: IntakeInDoubt, taken_at: int) -> None:
        """A plain turn's intake was in doubt and its read-back failed too
        (``intake.in_doubt``): its client is told to send the message only if the
        transcript lacks it. When it landed, the client finds it there, unanswered, and
        sends nothing: this process owes its turn (:attr:`owed`), recorded (from the
        message: its session is not known here) once the database is back, or not when
        the message is not there (the client sends it again) or a later message came
        (the resend, whose turn answers it). A turn that recorded a run needs none (the
        recovery has that run: :attr:`orphans`)."""
        if exc.message_id is None:
            return
        values = self.intake.owed_in_doubt(trigger, exc.message_id, exc.agent_id, taken_at)
        if values is None:
            return
        self.owed[str(values["lease_token"])] = values
        self.recovery_due()

    async def record_owed(self, *, every_look: bool = False) -> None:
        """Record the runs of :attr:`owed` (each in a transaction of its own,
        :func:`leadgate.turns.runs.record_owed`) and hand them to turn recovery as
        orphans, which reruns them from the stored message as it does a gated turn's
        stopped on a database fault. A database fault stops it: the rest stay owed,
        recorded at a later pass (the same rows, so a try in doubt that landed is not
        recorded twice). A run whose record fails for another reason (the database
        refuses the row, a bug) is given up with an ERROR naming its session: tried
        again it would fail the same way at every pass, for ever, and the turn
        recovery's claims, which come after this, would never run.

        An intake in doubt whose message is not there yet is looked for again
        (:attr:`owed_lost`, those due now): dropped at the first look, a message the
        server applied after it stayed unanswered, its client finding it in the
        transcript and sending nothing. ``every_look`` (a stop): those not due yet too,
        this process's last chance to record them."""
        now = self.clock.now_ms()
        for token, values in list(self.owed.items()):
            recorded = await self._record_owed(values)
            # (pop: a stop's record of them may run beside the recovery loop's)
            if self.owed.pop(token, None) is not None and recorded == runs.NOT_TAKEN_IN:
                # (Not woken: this is the recovery's own pass, or the stop.)
                self.owed_lost.watch(
                    values,
                    due=now + self.owed_lost.first_ms,
                    lapses=now + runs.RUN_LEASE_MS,
                    wake=False,
                )
        looks = self.owed_lost.take_due(_EVER if every_look else now) if self.owed_lost else []
        for n, look in enumerate(looks):
            try:
                recorded = await self._record_owed(look.token)
            except BaseException:
                self.owed_lost.put_back(looks[n:])
                raise
            if recorded != runs.NOT_TAKEN_IN:
                self.owed_lost.done(look)
            elif now + look.gap <= look.lapses:
                self.owed_lost.not_found(look, now)
            else:
                self.owed_lost.done(look)
                log.info(
                    "owed run of an intake in doubt not recorded: its message %s was not "
                    "taken in (its client sends it again)",
                    look.token.get("message_id"),
                )

    async def _record_owed(self, values: dict[str, Any]) -> str | None:
        """:meth:`record_owed` of one run: what :func:`leadgate.turns.runs.record_owed`
        answered (its token an orphan once recorded), or None when it was given up."""
        try:
            recorded = await runs.record_owed(self.db, values, self.clock.now_ms())
        except (Unavailable, DatabaseDamaged):
            raise
        except Exception as exc:
            log.error(
                "could not record the owed run of session %s (its message stays unanswered)",
                values.get("session_id"),
                exc_info=loggable(exc),
            )
            return None
        if recorded == runs.RECORDED:
            self.orphans.add(str(values["lease_token"]))
        elif recorded == runs.ANSWERED_LATER:
            log.info(
                "owed run of session %s not rerun: a later message of the session "
                "was taken in, whose turn answers it",
                values.get("session_id"),
            )
        return recorded

    async def take(self, trigger: Trigger) -> Accepted | Busy | Duplicate:
        """The intake alone (one short transaction): what a channel awaits before it
        answers its platform. An accepted channel turn is recorded as a run."""
        validate_message(trigger.text)
        validate_session_key(trigger.session_key)
        for attempt in range(3):
            try:
                intake = await self.intake.take(trigger)
                break
            except IntegrityError:
                # PostgreSQL: a concurrent intake created the session's active item first;
                # the unique partial index refused ours. Run the rules again.
                if attempt == 2:
                    raise
        if isinstance(intake, Busy | Duplicate):
            labelled(METRICS.turns, "busy" if isinstance(intake, Busy) else "duplicate").inc()
        return intake

    async def execute(
        self,
        turn: Accepted,
        *,
        on_delta: DeltaSink | None = None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        """Run an accepted turn. When it fails, a recorded channel run tells the person
        (a failure notice, the run closed, in one transaction); a database fault leaves
        the run to the recovery runner (nothing can be written now). A turn that failed
        otherwise and whose run's closing then met a database fault is left to the
        recovery runner too, and raises that fault (from the turn's error): no notice
        was queued, and the run is not over (a channel's failed hook ends what waits
        for it, a client is told not to send the message again)."""
        token = turn.ctx.run_token
        if token is not None:
            self.running.add(token)
        try:
            return await self._execute(turn, "", None, on_delta, answer)
        except Exception as exc:
            if token is not None:
                fault = await self._fail_run(turn.ctx, exc)
                if fault is not None:
                    raise fault from exc
            raise
        finally:
            if token is not None:
                self.running.discard(token)

    async def renew_runs(self, conn: Conn, owner: str, now: int) -> None:
        """Renew the leases of the runs this process's turns are running
        (:attr:`running`), leased to ``owner``: one statement in the heartbeat's
        transaction, none when no recorded turn runs (:func:`leadgate.turns.runs.renew`)."""
        if self.running:
            await runs.renew(conn, owner, sorted(self.running), now)

    async def _fail_run(self, ctx: TurnContext, exc: Exception) -> Exception | None:
        """End the run of a turn that failed with ``exc``, or leave it to the recovery
        runner; the database fault that closing it met (it is left to recovery), if
        any."""
        token = ctx.run_token
        if isinstance(exc, Unavailable) or token is None:
            if token is not None:
                self.orphaned(token)
            return None
        try:
            if ctx.recovered_client:
                # What a live request is answered for this failure (its 502, or a 500
                # for an error that is not the engine's own).
                failure = (
                    exc
                    if isinstance(exc, LeadgateError)
                    else LeadgateError("internal error", rule="internal")
                )
                why = runs.KEYED_RESEND_FAILED_TEXT if ctx.keyed_resend else runs.CLIENT_FAILED_TEXT
                await self._end_client_run(ctx, token, ctx.work_item_id, why, failure)
            else:
                await self._close_run(ctx, token, notice=runs.FAILURE_NOTICE)
        except Exception as closing:
            log.warning("closing failed run %s failed; recovery takes it over", token)
            self.orphaned(token)
            return closing if isinstance(closing, DATABASE_FAULTS) else None
        return None

    def orphaned(self, token: str) -> None:
        """The recorded run under ``token`` has no turn running it (its turn stopped on a
        database fault, its intake's read-back failed, or the process is too busy): the
        recovery runner takes it over, woken for it."""
        self.orphans.add(token)
        self.recovery_due()

    async def _close_run(self, ctx: TurnContext, token: str, *, notice: str | None) -> None:
        """Delete the runs of ``token`` and (channels that post) queue ``notice``."""
        queued = None
        async with self.db.tx() as conn:
            await runs.finish(conn, token, fenced=ctx.run_fenced, held=ctx.run_count)
            if notice and ctx.binding_posts:
                queued = await self._queue_reply(conn, ctx, notice)
        if queued:
            self.on_delivery_queued()

    async def _give_up_flow_turn(self, ctx: TurnContext, token: str, item_id: str) -> None:
        """Close the runs of ``token`` and abandon their flow node's item, in one
        transaction (fenced by the run's lease: one process does it): a flow posts no
        notice and retries nothing, so the item is what tells the flow."""
        async with self.db.tx() as conn:
            await runs.finish(conn, token, fenced=ctx.run_fenced, held=ctx.run_count)
            abandoned = await runs.abandon_given_up(conn, self.clock, self.ids, item_id)
        if abandoned:
            log.warning(
                "flow node turn of session %s given up; work item %s abandoned (its flow "
                "run fails)",
                ctx.session_id,
                item_id,
            )

    async def _end_client_run(
        self,
        ctx: TurnContext,
        token: str,
        item_id: str | None,
        why: str,
        failure: LeadgateError,
    ) -> None:
        """End a REST/MCP/Studio turn that turn recovery ran and could not finish (its
        model failed, or it was given up): its client was told not to send the message
        again, so nobody would. In one transaction, fenced by the run's lease: the runs
        of ``token`` closed, the failure notice stored as the session's answer (the
        transcript is where such a client looks; its events stream shows it), and the
        work item abandoned (audit ``turnGaveUp``, ``why``; the stream's ``review``
        event says ``abandoned``). Left ``inProgress``, it waited a week for the
        abandonment sweeper with the requester never answered. A keyed REST request's
        key gets ``failure`` (:meth:`_store_keyed`): its retry is told the error, not
        ``idempotency.lost`` for good. A plain turn's run (``item_id`` None: recorded
        late, :meth:`record_owed`) has no item to abandon; its notice is stored all the
        same (closed silently, the message had no answer and nobody a word). Neither
        is done when its session took a later message (:meth:`_answered_later`: during
        the failed model call, or before a give-up), whose turn answers it: the notice,
        stored after that answer, told the person their message went unanswered, and a
        gated session's item, which that message was added to and its turn works in,
        was abandoned under it (fenced on ``inProgress``: one the follow-up handed to
        review stayed, the notice stored all the same). Its run is closed alone."""
        abandoned = False
        async with self.db.tx() as conn:
            if await self._answered_later(conn, ctx):
                # (Closed unanswered: one of its runs taken back meanwhile is no answer
                # given twice, so its fence is the lease alone.)
                await runs.finish(conn, token, fenced=ctx.run_fenced)
                return
            await runs.finish(conn, token, fenced=ctx.run_fenced, held=ctx.run_count)
            # (Naming the message: it ended, on purpose, and turn recovery's search does
            # not take it for unanswered.)
            await self._store(
                conn,
                ctx.org_id,
                ctx.session_id,
                item_id,
                "assistant",
                runs.FAILURE_NOTICE,
                answers=ctx.answers,
            )
            await self._store_keyed(conn, ctx.keyed_events, failure)
            if item_id is not None:
                abandoned = await runs.abandon_given_up(
                    conn, self.clock, self.ids, item_id, text=why, flow=False
                )
        log.warning(
            "recovered turn of session %s ended with a failure notice%s",
            ctx.session_id,
            f"; work item {item_id} abandoned" if abandoned else "",
        )

    async def reject_inbound(self, trigger: Trigger, refused: ValidationError) -> bool:
        """A channel message that breaks a message rule (too long, NUL ...): recorded as
        a rejected inbound event and answered with a notice saying why, in one
        transaction; no turn. A platform's redelivery of it is a duplicate (no second
        notice). False when it was a duplicate or nothing can be posted. A redelivery
        after its worker was deleted is a duplicate all the same
        (:func:`~leadgate.turns.intake.duplicate_if_taken_in`, looked up only then), not
        ``agent.not_found``."""
        now = self.clock.now_ms()
        queued = None
        async with self.db.tx() as conn:
            agent = await self._taking_worker(conn, trigger)
            if agent is None:
                return False
            session_id, current, _ = await bindings.open_session(
                conn, self.clock, self.ids, trigger.org_id, agent.id, trigger.session_key
            )
            event = {
                "id": self.ids.new("evt"),
                "org_id": trigger.org_id,
                "agent_id": agent.id,
                "session_id": session_id,
                "work_item_id": None,
                "outcome": "rejectedInvalid",
                # What can be stored of it (PostgreSQL text holds no NUL).
                "content": _storable(trigger.text)[:1000],
                "external_event_id": trigger.external_event_id,
                "created_at": now,
            }
            insert = insert_ignore_stmt(conn.dialect.name, t.inbound_events)
            if not (await conn.execute(insert, event)).rowcount:
                return False
            await bindings.activate(
                conn, self.clock, self.ids, trigger.org_id, session_id, trigger.binding, current
            )
            binding = await bindings.active_binding(conn, session_id)
            if binding is not None and not trigger.binding.silent:
                queued = await self.outbox.enqueue_reply(
                    conn,
                    org_id=trigger.org_id,
                    binding=binding,
                    text=not_processed(refused),
                )
        if queued:
            self.on_delivery_queued()
        return queued is not None

    async def refuse_if_worker_off(self, trigger: Trigger) -> None:
        """A channel message that breaks a message rule, answered by its adapter itself
        and recorded nowhere (a Discord ``/ask``: its interaction response says why):
        its worker's refusal (``agent.not_found``, ``agent.inactive``) is raised when the
        worker is deleted or deactivated, as :meth:`reject_inbound` and the intake of
        the same message within the rules refuse it. One read, on this path only."""
        async with self.db.read() as conn:
            await self._taking_worker(conn, trigger)

    async def _taking_worker(self, conn: Conn, trigger: Trigger) -> Agent | None:
        """The worker of ``trigger``, read on a rejected message's path: raises its
        refusal (``agent.not_found``, ``agent.inactive``) when it is deleted or
        deactivated, as the message within the rules would be refused (that its worker
        is off is what the person can act on, and stays so however the message is
        rewritten), unless the message was taken in already (a redelivery: ``None``,
        a duplicate, :func:`~leadgate.turns.intake.duplicate_if_taken_in`)."""
        try:
            agent = await agents_mod.find_agent(conn, trigger.org_id, trigger.agent_id)
            if not agent.active:
                raise agents_mod.inactive_agent(agent)
        except (NotFound, ValidationError) as refusal:
            await duplicate_if_taken_in(conn, trigger, refusal)
            return None
        return agent

    # ----------------------------------------------------------- recovery

    async def _retaken(self, external_event_id: str) -> Accepted | str | None:
        """The run of the message taken in under ``external_event_id``, claimed for its
        client's retry and ready to run (see :meth:`run`'s ``retake``), or what
        :func:`~leadgate.turns.runs.claim_for_retry` said instead."""
        claimed = await runs.claim_for_retry(
            self.db,
            self.clock,
            self.ids,
            external_event_id=external_event_id,
            owner=self.owner(),
            doubted=self.orphaned,
        )
        if not isinstance(claimed, runs.Claimed):
            return claimed
        try:
            ctx, _kind, item = await self._claimed_context(claimed)
            # The client is here: it is answered as by its first request (not recovered:
            # a failure is its 502, the item left for its next message).
            ctx = dataclasses.replace(ctx, recovered_client=False, retaken=True)
            turn = await self._accepted(claimed, ctx, item)
            assert turn is not None  # (not recovered: no later message is looked for)
            return turn
        except BaseException:
            # Claimed, leased to this live process, and no turn runs it: left so, the
            # run waited out its lease (the retries told the key is in progress) and
            # was then closed as a live owner's stalled turn, the message never
            # answered. Recovery reruns it now and stores its answer under the key.
            self.orphaned(claimed.token)
            raise

    async def _claimed_context(
        self, claimed: runs.Claimed
    ) -> tuple[TurnContext, BindingKind, WorkItem | None]:
        """The turn context of a claimed run (its lease fences the turn's end)."""
        async with self.db.read() as conn:
            binding = await bindings.get_binding(conn, claimed.binding_id)
            item = await workitems.get(conn, claimed.work_item_id) if claimed.work_item_id else None
        kind = BindingKind(binding.kind) if binding is not None else BindingKind.api
        ctx = TurnContext(
            org_id=claimed.org_id,
            agent_id=claimed.agent_id,
            session_id=claimed.session_id,
            binding_id=claimed.binding_id,
            turn_id=claimed.turn_id,
            work_item_id=claimed.work_item_id,
            revision=item.revision if item is not None else None,
            binding_posts=binding is not None and kind.is_channel and not binding.silent,
            run_token=claimed.token,
            run_fenced=True,
            run_count=len(claimed.run_ids),
            recovered_client=kind in (BindingKind.api, BindingKind.studio),
            keyed_resend=claimed.keyed_resend,
            keyed_events=claimed.external_event_ids,
            answers=claimed.message_id,
        )
        return ctx, kind, item

    async def _accepted(
        self, claimed: runs.Claimed, ctx: TurnContext, item: WorkItem | None
    ) -> Accepted | None:
        """A claimed run's turn, from its stored message (the session's history, without
        the messages whose clients send them again: their resends' turns answer them).

        None: a rerun whose session took in a later user message (:meth:`_answered_later`),
        looked for first in this read (one statement; it was a write transaction of its
        own before this read: on SQLite the writer's lock taken to read, on PostgreSQL
        two round trips more), its run then closed fenced by its lease, and the model
        not called (it was, and its answer dropped at the end: the call's cost spent,
        and a tool with effects run, for nothing). A live turn's (a keyed retry's
        takeover) reaches no statement more."""
        turn: Accepted | None = None
        async with self.db.read() as conn:
            if not await self._answered_later(conn, ctx):
                agent = await agents_mod.find_agent(
                    conn, claimed.org_id, claimed.agent_id, include_deleted=True
                )
                rules = await policy.load_rules(conn, claimed.org_id)
                history = await self.history.read(
                    conn, claimed.session_id, without=claimed.not_answered
                )
                turn = Accepted(ctx, agent, item is not None, rules, history)
        if turn is None:
            async with self.db.tx() as conn:
                await runs.finish(conn, ctx.run_token, fenced=True)
        return turn

    def _keyed_answer(self, ctx: TurnContext) -> TurnAnswer | None:
        """What a rerun writes in its last transaction for the keyed requests whose
        messages it answers (:meth:`_store_keyed`), or None."""
        if self.keyed_answer is None or not ctx.keyed_events:
            return None

        async def answer(conn: Conn, outcome: Reply | Gated) -> None:
            await self._store_keyed(conn, ctx.keyed_events, outcome)

        return answer

    async def store_surfaced(self, conn: Conn, external_event_ids: tuple[str, ...]) -> None:
        """A recovery claim surfaced a dead turn's committed handoff to a human
        (:data:`runs.SURFACED <leadgate.turns.runs.SURFACED>`), in its transaction
        ``conn``: the turn ended gated, as it would have live, so each keyed request whose
        message it answers gets what a live gated turn's request gets (the gated 409, or
        a stream with no text), not ``idempotency.lost``. The approved answer then shows
        in the transcript."""
        await self._store_keyed(conn, external_event_ids, Gated(None, None))

    async def _store_keyed(
        self, conn: Conn, keyed: tuple[str, ...], outcome: Reply | Gated | LeadgateError
    ) -> None:
        """Store ``outcome`` (a rerun's answer, the error its failed end stands for, or
        a surfaced handoff's gate) under the key of each keyed request among ``keyed``
        (the external event ids the run's messages were taken in under;
        :attr:`keyed_answer`), in the transaction ``conn`` that ends the run."""
        if self.keyed_answer is None:
            return
        for external_event_id in keyed:
            await self.keyed_answer(conn, external_event_id, outcome)

    async def resume(self, claimed: runs.Claimed) -> Outcome | None:
        """Carry out a claimed run (see :mod:`leadgate.turns.runs`): re-run the turn, or
        send the failure notice of a run that never finished. ``None``: nothing ran."""
        ctx, kind, item = await self._claimed_context(claimed)
        if claimed.action == "gaveUp":
            if kind is BindingKind.flow and claimed.work_item_id is not None:
                await self._give_up_flow_turn(ctx, claimed.token, claimed.work_item_id)
            elif ctx.recovered_client:
                gave_up = ModelError(runs.GAVE_UP_MESSAGE, rule=GAVE_UP_RULE)
                why = (
                    runs.KEYED_RESEND_GAVE_UP_TEXT if ctx.keyed_resend else runs.CLIENT_GAVE_UP_TEXT
                )
                await self._end_client_run(ctx, claimed.token, claimed.work_item_id, why, gave_up)
            else:
                await self._close_run(ctx, claimed.token, notice=runs.FAILURE_NOTICE)
            return None
        if claimed.action != runs.RERUN:
            return None
        turn = await self._accepted(claimed, ctx, item)
        if turn is None:
            return None
        try:
            return await self.execute(turn, answer=self._keyed_answer(ctx))
        except LeadgateError:
            return None

    # ------------------------------------------------------------- revisions

    async def claim_revision(self) -> WorkItem | None:
        """Claim one inProgress item whose feedback waits for an internal turn."""
        claimed = await self.claim_revision_or_lapse()
        return claimed if isinstance(claimed, WorkItem) else None

    async def claim_revision_or_lapse(self) -> WorkItem | int | None:
        """Claim one inProgress item whose feedback waits for an internal turn; when none
        is claimable, when the earliest revision lease held lapses (ms, by this clock;
        learned from the same read), or None when no lease is held, or when another
        process claimed the item this one read as claimable (it holds a fresh lease).
        PostgreSQL: when the claimable items were all row-locked by another transaction,
        when to look again (:data:`LOCKED_RECHECK_MS` on): a fenced move that lost its
        race for the item keeps its row lock to the end of its transaction (PostgreSQL's
        row locks outlive a failed recheck of ``WHERE``), and no wake-up follows.

        A claim whose ``COMMIT`` is in doubt (PostgreSQL) may have landed, or may land
        later: its item would then wait under a token nobody holds until its lease
        lapsed (:data:`REVISION_LEASE_MS`, 5 minutes), its feedback undispatched. So its
        token is watched (:attr:`revisions_lost`): the next pass (after the loop's
        back-off) looks for it first, then 1 s on and at doubling gaps until that lease
        would have lapsed, and an item found holding it is this process's claim (the
        look is the claim: its lease is this process's token)."""
        now = self.clock.now_ms()
        if self.revisions_lost:  # (only after a claim in doubt)
            held = await self._look_for_lost_revisions(now)
            if held is not None:
                return held
        # Read first: mostly nothing is due, and a read takes no write lock (the claim
        # below is fenced, so a stale read claims nothing).
        async with self.db.read() as conn:
            first = (await conn.execute(_REVISION_NEXT, {"p_now": now})).first()
        if first is None:
            return None
        if not first.claimable:
            return int(first.lease_expires_at)
        token = self.ids.new("lease")
        try:
            async with self.db.tx() as conn:
                if self.db.is_postgres:
                    pick = (await conn.execute(_REVISION_PICK, {"p_now": now})).one()
                    item_id, locked = pick.id, bool(pick.locked)
                else:  # (one writer: no row is locked)
                    item_id, locked = await conn.scalar(_REVISION_DUE, {"p_now": now}), False
                if item_id is None:
                    # Claimable items locked by another transaction: look again soon,
                    # whoever holds them may commit with no wake-up for this process.
                    return now + LOCKED_RECHECK_MS if locked else None
                row = (
                    await conn.execute(
                        _CLAIM_REVISION,
                        {
                            "p_id": item_id,
                            "lease_token": token,
                            "lease_expires_at": now + REVISION_LEASE_MS,
                            "lease_owner": self.owner(),
                        },
                    )
                ).first()
        except Unavailable as fault:
            if fault.in_doubt:
                self.revisions_lost.watch(token, due=now, lapses=now + REVISION_LEASE_MS)
            raise
        return None if row is None else WorkItem.from_row(row)

    async def _look_for_lost_revisions(self, now: int) -> WorkItem | None:
        """The item that holds a watched revision claim's token whose look is due (the
        claim landed: this process holds it), else None (each token not found is looked
        for again later, until its lease would have lapsed)."""
        due = self.revisions_lost.take_due(now)
        for n, lost in enumerate(due):
            try:
                async with self.db.read() as conn:
                    row = (await conn.execute(_REVISION_HELD, {"p_token": lost.token})).first()
            except BaseException:  # (cancelled too: the tokens not looked for stay watched)
                self.revisions_lost.put_back(due[n:])
                raise
            if row is not None:
                self.revisions_lost.put_back(due[n + 1 :])
                return WorkItem.from_row(row)
            self.revisions_lost.not_found(lost, now)
        return None

    async def run_revision(self, item: WorkItem) -> Outcome:
        """Dispatch the stored feedback to the worker as a new internal turn."""
        feedback = item.pending_feedback or ""
        async with self.db.tx() as conn:
            agent = await agents_mod.find_agent(
                conn, item.org_id, item.agent_id, include_deleted=True
            )
            binding = await bindings.active_binding(conn, item.session_id)
            await self._store(conn, item.org_id, item.session_id, item.id, "internal", feedback)
            rules = await policy.load_rules(conn, item.org_id)
            history = await self.history.read(conn, item.session_id)
        ctx = TurnContext(
            org_id=item.org_id,
            agent_id=item.agent_id,
            session_id=item.session_id,
            binding_id=binding.id if binding else "",
            turn_id=self.ids.new("turn"),
            work_item_id=item.id,
            revision=item.revision,
        )
        return await self._execute(Accepted(ctx, agent, True, rules, history), feedback, item, None)

    # -------------------------------------------------------------- the turn

    async def _execute(
        self,
        turn: Accepted,
        text: str,
        revision_item: WorkItem | None,
        on_delta: DeltaSink | None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        """Run the model (at most :data:`MAX_MODEL_CALLS` rounds of tool calls)."""
        ctx, agent, gated_turn, rules = turn.ctx, turn.agent, turn.gated, turn.rules
        messages = [ChatMessage("system", agent.instructions or "You are a helpful agent.")]
        messages += turn.history
        # complete_task only under a trusted context that names an inProgress item.
        tools = [COMPLETE_TASK] if gated_turn and ctx.work_item_id else []
        live = on_delta if (not gated_turn and not rules) else None
        parts: list[str] = []
        signalled = False  # this turn's complete_task was acknowledged
        # This turn's valid complete_task found its item no longer inProgress (another
        # turn of the session submitted first, or it was cancelled): the text was meant
        # for review, so it is withheld, never shown as a reply. (A summary that breaks
        # the rules is a tool error the model may mend; without a signal the turn is
        # plain, SPEC 3.)
        handed_off = False
        usage: Usage | None = None  # summed over the turn's model calls
        feedback = revision_item.pending_feedback if revision_item else None
        try:
            # In the try: a model the config no longer has is a model error, logged and
            # counted like any (it was neither).
            provider = self.providers.get(agent.model)
            for _ in range(MAX_MODEL_CALLS):
                calls: list[ToolCall] = []
                round_text: list[str] = []
                request = ModelRequest(messages=messages, tools=tools, revision_feedback=feedback)
                async for event in provider.stream(request):
                    if isinstance(event, TextDelta):
                        round_text.append(event.text)
                        if live is not None and event.text:
                            await live(event.text)
                    elif isinstance(event, Usage):
                        usage = event if usage is None else usage + event
                    else:
                        calls.append(event)
                parts.extend(round_text)
                if not calls:
                    break
                messages.append(
                    ChatMessage("assistant", "".join(round_text), tool_calls=tuple(calls))
                )
                for call in calls:
                    result = await self._tool(ctx, call, tools)
                    signalled = signalled or result == SUBMITTED
                    handed_off = handed_off or result == ITEM_GONE
                    messages.append(ChatMessage("tool", result, tool_call_id=call.id))
        except (ModelError, Unavailable) as exc:
            # Unavailable: complete_task's write met a database fault (a 503, not a model
            # failure).
            labelled(METRICS.turns, "error").inc()
            # Logged once, here, for every surface (the request id rides the log context);
            # the line names the provider and status, never the key or any text (not the
            # provider's own words either: they may echo the request).
            if isinstance(exc, ModelError):
                log.warning("model error: %s [%s]", exc.summary, exc.rule)
            else:
                log.warning("database unavailable: %s [%s]", exc.message, exc.rule)
            raise
        except Exception as exc:
            labelled(METRICS.turns, "error").inc()
            log.error("model provider failed", exc_info=loggable(exc))
            raise ModelError("the model failed while producing this turn") from exc
        text = "".join(parts)
        for attempt in range(FINISH_RETRIES + 1):
            try:
                outcome = await self._finish(
                    turn,
                    text,
                    revision_item,
                    streamed=live is not None,
                    signalled=signalled,
                    handed_off=handed_off,
                    usage=usage,
                    answer=answer,
                )
                break
            except Unavailable:
                # A recorded channel turn keeps its answer in hand while the database is
                # away (nobody waits on an HTTP request): its last transaction is tried
                # again, rather than left for recovery to redo the model's work.
                if not turn.ctx.run_fenced or attempt == FINISH_RETRIES:
                    raise
                await self.sleep(min(5.0, 0.5 * 2**attempt))
        else:  # pragma: no cover - the loop always breaks or raises
            raise AssertionError("unreachable")
        return outcome

    async def _tool(self, ctx: TurnContext, call: ToolCall, offered: list[ToolSpec]) -> str:
        if call.name not in {tool.name for tool in offered}:
            return json.dumps({"error": f"unknown tool {call.name!r}"})
        summary = call.arguments.get("summary")
        if call.arguments_error or not isinstance(summary, str) or not summary.strip():
            return json.dumps({"error": "complete_task needs a non-empty summary"})
        if len(summary) > SUMMARY_LIMIT:
            return json.dumps({"error": "summary must be at most 2,000 characters"})
        signal = {
            "p_id": ctx.work_item_id,
            "p_session": ctx.session_id,
            "p_agent": ctx.agent_id,
            "signal_summary": summary,
            "signal_turn_id": ctx.turn_id,
        }
        if self.db.statements_alone:
            alone = await self.db.write_alone(
                _SIGNAL_ALONE,
                {
                    **signal,
                    "m_id": self.ids.new("msg"),
                    "m_org": ctx.org_id,
                    "m_content": summary,
                    "m_at": self.clock.now_ms(),
                },
            )
            signalled = bool(alone.scalar())
        else:
            async with self.db.tx() as conn:
                res = await conn.execute(_SIGNAL, signal)
                await self._store(
                    conn,
                    ctx.org_id,
                    ctx.session_id,
                    ctx.work_item_id,
                    "tool",
                    summary,
                    tool_name=COMPLETE_TASK.name,
                )
            signalled = bool(res.rowcount)
        if not signalled:
            return ITEM_GONE
        return SUBMITTED

    async def read_signal(self, conn: Conn, ctx: TurnContext) -> str | None:
        """The summary complete_task left for this turn, or ``None``."""
        row = (
            await conn.execute(_READ_SIGNAL, {"p_item": ctx.work_item_id, "p_turn": ctx.turn_id})
        ).first()
        return None if row is None else row.signal_summary

    async def signalled_item(self, conn: Conn, ctx: TurnContext) -> tuple[str | None, WorkItem]:
        """The turn's work item and the summary its complete_task left (``None`` when
        another turn's signal or submission replaced it), in one SELECT."""
        item = await workitems.get(conn, str(ctx.work_item_id))
        return (item.signal_summary if item.signal_turn_id == ctx.turn_id else None), item

    async def _finish(
        self,
        turn: Accepted,
        text: str,
        revision_item: WorkItem | None,
        *,
        streamed: bool,
        signalled: bool,
        handed_off: bool = False,
        usage: Usage | None = None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        ctx = turn.ctx
        signal: str | None = None
        if turn.gated and ctx.work_item_id and signalled:
            # This turn's complete_task was acknowledged: its signal is read in the
            # submission's own transaction (withheld there if it was superseded).
            return await self._submit(ctx, text, None, revision_item, answer)
        if turn.gated and ctx.work_item_id:
            try:
                async with self.db.read() as conn:
                    signal = await self.read_signal(conn, ctx)
            except Unavailable:
                # Nothing is shown either way; raising keeps the turn whole, so that its
                # last transaction can be tried again (a channel turn) or the client
                # retries (REST), instead of withholding text no review will ever see.
                raise
            except Exception as exc:
                # Fail closed: when we cannot tell whether the work was handed off,
                # the text is withheld.
                log.error(
                    "reading the completion signal failed; withholding the reply",
                    exc_info=loggable(exc),
                )
                return await self._withhold(ctx, text, revision_item, answer)
        if signal is not None:
            return await self._submit(ctx, text, signal, revision_item, answer)
        if signalled or handed_off:
            # The turn meant its text for review, but its signal is gone (another turn of
            # the item signalled or submitted meanwhile) or was refused (the item had
            # left inProgress): still withheld, never shown unreviewed.
            log.warning("completion signal of turn %s is gone; withholding", ctx.turn_id)
            return await self._withhold(ctx, text, revision_item, answer)
        screened = policy.screen(text, turn.rules) if turn.rules else text
        if revision_item is None and not ctx.binding_posts and ctx.run_token is None:
            if ctx.taken_by is not None and self.maybe_reaped(ctx.taken_by):
                return await self._store_answered(
                    ctx, screened, streamed, usage, answer, taken_back=True
                )
            if answer is not None:
                return await self._store_answered(ctx, screened, streamed, usage, answer)
            # API and studio turns only store the reply: on PostgreSQL one statement.
            await self.visible.store(
                org_id=ctx.org_id,
                session_id=ctx.session_id,
                work_item_id=ctx.work_item_id,
                role="assistant",
                content=screened,
                answers=ctx.message_id,
            )
        elif revision_item is None and not ctx.binding_posts:
            # Silent channel turns (and API turns with a run: a worker's with a lead) store
            # the reply and end their run: the short transaction.
            async with self.db.tx() as fast:
                if await self._answered_later(fast, ctx):
                    await runs.finish(fast, ctx.run_token, fenced=ctx.run_fenced)
                    return Duplicate()
                stored = await self._retaken_answer(fast, ctx) if ctx.retaken else None
                if stored is None:
                    await self._store(
                        fast,
                        ctx.org_id,
                        ctx.session_id,
                        ctx.work_item_id,
                        "assistant",
                        screened,
                        answers=ctx.answers,
                    )
                else:
                    screened = stored
                if not ctx.retaken:
                    await runs.finish(
                        fast, ctx.run_token, fenced=ctx.run_fenced, held=ctx.run_count
                    )
                if answer is not None:
                    reply = Reply(screened, streamed, usage)
                    await answer(fast, reply)
                    count_after_commit(fast, labelled(METRICS.turns, "plain"))
                    return reply
        else:
            # A reply that may be queued for a channel: the outbox's in-process hand-off
            # needs the general transaction.
            await self._store_reply(ctx, screened, revision_item)
        labelled(METRICS.turns, "plain").inc()
        return Reply(screened, streamed, usage)

    async def _retaken_answer(self, conn: Conn, ctx: TurnContext) -> str | None:
        """End the run of a keyed retry's takeover (``ctx.retaken``) in its last
        transaction ``conn``: the text of the answer the thought-dead process's own turn
        stored for the message meanwhile, which the retry answers instead of storing a
        second (:func:`runs.end_retaken <leadgate.turns.runs.end_retaken>`), or None."""
        assert ctx.run_token is not None and ctx.answers is not None  # (a claimed run's)
        stored = await runs.end_retaken(conn, ctx.run_token, ctx.session_id, ctx.answers)
        if stored is not None:
            log.info(
                "turn %s's message was answered by its first process's own turn (thought "
                "dead); its answer is not stored again",
                ctx.turn_id,
            )
        return stored

    async def _answered_later(self, conn: Conn, ctx: TurnContext) -> bool:
        """Whether turn recovery's rerun of a REST/MCP/Studio run (``ctx``, a plain or a
        gated worker's: :func:`_may_be_answered_later`) is to end without an answer,
        its run closed: its session took in a user message
        after the run's (a follow-up, or the resend of one told to send it only if
        not there) while it ran, or before its claim. That message's own turn, shown
        the run's message unanswered, answers it (the rerun, shown the follow-up,
        answered it too). So too when an answer naming the run's message was stored
        (``messages.answers``, :func:`runs.answered_later
        <leadgate.turns.runs.answered_later>`): its process, thought dead, was alive and
        its turn answered. Read before the rerun's model call
        (:meth:`_accepted`) and again in its last transaction (a message
        may come during the call); no live turn's (their context is no recovered
        client's). A keyed run rerun because its client was told nothing was stored is
        answered all the same: its key's retry waits for that answer, and no turn of its
        own runs for it."""
        if not _may_be_answered_later(ctx):
            return False
        assert ctx.run_token is not None  # (a recovered run's)
        if not await runs.answered_later(conn, ctx.session_id, ctx.run_token, ctx.answers):
            return False
        log.info(
            "rerun of session %s ends unanswered: a later message of the session was "
            "taken in, whose turn answers it, or its own turn's answer was stored",
            ctx.session_id,
        )
        return True

    async def _store_answered(
        self,
        ctx: TurnContext,
        text: str,
        streamed: bool,
        usage: Usage | None,
        answer: TurnAnswer | None,
        *,
        taken_back: bool = False,
    ) -> Reply:
        """An API turn's reply and the caller's ``answer`` of it, in one transaction: a
        fault in either leaves neither (the turn is interrupted), and once it commits
        the answer is there for a retry whatever becomes of this process.

        ``taken_back``: its process may have been reaped while it ran
        (:attr:`maybe_reaped`), so the transaction first deletes the run turn recovery
        may have recorded for its message meanwhile (:func:`runs.take_back
        <leadgate.turns.runs.take_back>`): recovery does not answer it a second time
        (a rerun in flight fails its fenced end). When recovery's rerun of it committed
        first (its resend wait and its model call both within this turn's one), its
        answer names the message (``messages.answers``): this turn stores no second one,
        and its caller gets the stored answer's text (one answer to the request, the one
        in the transcript; a streamed request's text went out already, its own turn's).
        Only such a turn can meet a recorded run of its own message,
        and its process knows in memory whether it may have been reaped, so a healthy
        process's plain turn reaches none of this."""
        async with self.db.tx() as conn:
            stored = None
            if taken_back:
                assert ctx.message_id is not None  # (a plain turn's: set with taken_by)
                await runs.take_back(conn, ctx.message_id)
                stored = await runs.stored_answer(conn, ctx.session_id, ctx.message_id)
            if stored is not None:
                log.info(
                    "turn %s's answer was stored already by turn recovery (its process "
                    "was thought dead); not stored again",
                    ctx.turn_id,
                )
                text = stored
            else:
                await self._store(
                    conn,
                    ctx.org_id,
                    ctx.session_id,
                    ctx.work_item_id,
                    "assistant",
                    text,
                    answers=ctx.message_id,
                )
            reply = Reply(text, streamed, usage)
            if answer is not None:
                await answer(conn, reply)
        labelled(METRICS.turns, "plain").inc()
        return reply

    async def _store_reply(
        self, ctx: TurnContext, text: str, revision_item: WorkItem | None
    ) -> None:
        queued = None
        async with self.db.tx() as conn:
            await self._store(conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", text)
            await self._release_revision(conn, revision_item)
            await runs.finish(conn, ctx.run_token, fenced=ctx.run_fenced, held=ctx.run_count)
            if revision_item is None:
                queued = await self._queue_reply(conn, ctx, text)
        if queued:
            self.on_delivery_queued()

    async def _queue_reply(self, conn: Conn, ctx: TurnContext, text: str) -> object | None:
        """Queue ``text`` as a reply on the binding of the message that ran the turn (a
        channel binding that posts), threaded to that message (SPEC 10), also when a
        later message's binding has become the session's active one meanwhile. Nothing
        is queued when the session has no active binding (its bindings deactivated) or
        its active one is silent (its route made silent since: nothing is to be posted
        there any more)."""
        binding = await bindings.active_binding(conn, ctx.session_id)
        if binding is None or binding.silent:
            return None
        if binding.id != ctx.binding_id:
            # A later message with its own address (a Discord message, a Teams
            # activity, an email; not a Slack one: a thread's messages share its
            # address) was taken in while this turn ran: its binding is the active one,
            # not this turn's. Rare: the usual turn reads the active binding alone.
            binding = await bindings.get_binding(conn, ctx.binding_id)
            if binding is None:
                return None
        return await self.outbox.enqueue_reply(conn, org_id=ctx.org_id, binding=binding, text=text)

    async def _withhold(
        self,
        ctx: TurnContext,
        text: str,
        revision_item: WorkItem | None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        """Store the text withheld (leadGated) without a submission: fail closed."""
        gated = Gated(work_item_id=ctx.work_item_id, revision=ctx.revision)
        async with self.db.tx() as conn:
            await self._store(
                conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", text, gated=True
            )
            await self._release_revision(conn, revision_item)
            await runs.finish(conn, ctx.run_token, fenced=ctx.run_fenced, held=ctx.run_count)
            if answer is not None:
                await answer(conn, gated)
        labelled(METRICS.turns, "gated").inc()
        return gated

    async def _release_revision(self, conn: Conn, revision_item: WorkItem | None) -> None:
        if revision_item is None:
            return
        await conn.execute(
            t.work_items.update()
            .where(_W.id == revision_item.id, _W.lease_token == revision_item.lease_token)
            .values(
                pending_feedback=None, lease_token=None, lease_expires_at=None, lease_owner=None
            )
        )

    async def _submit(
        self,
        ctx: TurnContext,
        text: str,
        summary: str | None,
        revision_item: WorkItem | None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        """Store the withheld text and move the item on: ``reviewQueued``, or
        ``awaitingHuman`` when the provenance is incomplete.

        ``summary`` None: read this turn's signal first, in the same transaction; when it
        is gone (another turn of the item signalled or submitted meanwhile) the text is
        only stored withheld. With ``answer`` the transaction decides (the one statement
        cannot write it)."""
        try:
            alone = answer is None and await self._submit_alone(ctx, text, revision_item)
        except Unavailable:
            raise  # nothing is shown; the turn is tried again whole (see _finish)
        except Exception as exc:
            # The statement wrote nothing: the transaction decides, failing closed.
            log.error(
                "the one-statement submission failed; trying the transaction",
                exc_info=loggable(exc),
            )
            alone = False
        if alone:
            self.on_review_queued()
            labelled(METRICS.turns, "gated").inc()
            return Gated(work_item_id=ctx.work_item_id, revision=ctx.revision)
        async with self.db.tx() as conn:
            message_id = await self._store(
                conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", text, gated=True
            )
            await self._release_revision(conn, revision_item)
            await runs.finish(conn, ctx.run_token, fenced=ctx.run_fenced, held=ctx.run_count)
            item: WorkItem | None = None
            if summary is None:
                # The signal is a column of the item the transition reads anyway: one
                # SELECT for both.
                try:
                    summary, item = await self.signalled_item(conn, ctx)
                except Exception as exc:
                    if unavailable(exc) is not None or damage_met(conn, exc) is not None:
                        # A database fault, still the driver's error inside the body:
                        # the transaction's end raises it as Unavailable (or
                        # DatabaseDamaged) and the turn's last transaction is tried
                        # again (see _finish). Withholding here committed the text
                        # with the run finished and the item left inProgress, its
                        # signal never acted on: the work never reached its review.
                        raise
                    # Fail closed: when we cannot tell whether the work was handed off,
                    # the text is withheld.
                    log.error(
                        "reading the completion signal failed; withholding", exc_info=loggable(exc)
                    )
            if summary is None:
                log.warning("completion signal of turn %s was superseded; withholding", ctx.turn_id)
                problems: list[str] | None = None
            else:
                problems = await self._move_on(conn, ctx, text, summary, message_id, item)
            gated = Gated(work_item_id=ctx.work_item_id, revision=ctx.revision)
            if answer is not None:
                await answer(conn, gated)
        if problems is not None and not problems:
            self.on_review_queued()
        labelled(METRICS.turns, "gated").inc()
        return gated

    async def _submit_alone(
        self, ctx: TurnContext, text: str, revision_item: WorkItem | None
    ) -> bool:
        """PostgreSQL: the submission as one statement (:data:`_SUBMIT_ALONE`) when its
        provenance is complete, a revision's with its lease given back; False, with
        nothing written, when the transaction must decide (another backend, a superseded
        signal, a moved item, no active binding, a lost run)."""
        if not self.db.statements_alone or not ctx.work_item_id:
            return False
        now = self.clock.now_ms()
        result = await self.db.write_alone(
            _SUBMIT_ALONE,
            {
                "run_token": ctx.run_token,
                "fenced": ctx.run_fenced,
                "item": ctx.work_item_id,
                "session": ctx.session_id,
                "turn": ctx.turn_id,
                "m_id": self.ids.new("msg"),
                "content": text,
                "snapshot": text[:SNAPSHOT_LIMIT],
                "audit_id": self.ids.new("aud"),
                "now": now,
                "ev_at": now,
                "sender": self.db.notify_tag,
                "rev_lease": None if revision_item is None else revision_item.lease_token,
            },
            signals_from=lambda row: session_events.woken(row.ev_sessions),
        )
        if not result.one().moved:
            return False
        labelled(METRICS.transitions, Status.inProgress.value, Status.reviewQueued.value).inc()
        return True

    async def _move_on(
        self,
        conn: Conn,
        ctx: TurnContext,
        text: str,
        summary: str,
        message_id: str,
        item: WorkItem | None = None,
    ) -> list[str] | None:
        """The submission's transition (in ``conn``); the provenance problems found, or
        None when the item had left ``inProgress`` and nothing moved. ``item``: the item
        as this transaction already read it."""
        if item is None:
            item = await workitems.get(conn, str(ctx.work_item_id))
        binding = await bindings.active_binding(conn, ctx.session_id)
        problems = provenance_problems(ctx, item, binding, message_id)
        values = {
            "summary": summary,
            "snapshot": text[:SNAPSHOT_LIMIT],
            "gated_message_id": message_id,
            "signal_summary": None,
            "signal_turn_id": None,
            "binding_id": binding.id if binding else None,
            "last_activity_at": self.clock.now_ms(),
        }
        dst = Status.awaitingHuman if problems else Status.reviewQueued
        try:
            await workitems.transition(
                conn,
                self.clock,
                self.ids,
                item.id,
                src=Status.inProgress,
                dst=dst,
                actor="system:turn",
                action="incompleteProvenance" if problems else "completeTask",
                text="; ".join(problems) if problems else summary,
                values=values,
            )
        except TransitionError:
            # Cancelled (or otherwise moved) while the turn ran: the text stays withheld.
            log.warning("work item %s left inProgress during the turn", item.id)
            return None
        if problems:
            await self.outbox.review_needed(conn, item.id, dst.value)
        else:
            await workitems.notify_review_queued(conn)
        return problems

    async def _store(
        self,
        conn: Conn,
        org_id: str,
        session_id: str,
        work_item_id: str | None,
        role: str,
        content: str,
        *,
        tool_name: str | None = None,
        gated: bool = False,
        answers: str | None = None,
    ) -> str:
        return await store_message(
            conn,
            self.clock,
            self.ids,
            org_id=org_id,
            session_id=session_id,
            work_item_id=work_item_id,
            role=role,
            content=content,
            tool_name=tool_name,
            gated=gated,
            answers=answers,
        )


#: Later than any look is due (:meth:`TurnService.record_owed`'s ``every_look``).
_EVER = 2**62


def _may_be_answered_later(ctx: TurnContext) -> bool:
    """Whether ``ctx`` is a rerun that a later message of its session ends unanswered
    (:meth:`TurnService._answered_later`): a recovered REST/MCP/Studio run not rerun
    for a keyed client's resend, a plain worker's or a gated one's. A gated session's
    follow-up is added to the same ``inProgress`` item and runs its own turn, shown the
    cut message unanswered, as a plain one's does: the rerun answered the session a
    second time after it, and its failure or give-up stored the failure notice after
    that answer and abandoned the item the follow-up's turn works in. (A rerun whose
    ``complete_task`` committed its signal never reaches a look: its handoff goes on.)"""
    return ctx.recovered_client and not ctx.keyed_resend


def _storable(text: str) -> str:
    """``text`` with what no database can store (NUL, lone surrogates) replaced."""
    return UNSTORABLE.sub("\ufffd", text)


def provenance_problems(
    ctx: TurnContext, item: WorkItem, binding: Binding | None, gated_message_id: str | None
) -> list[str]:
    """What is missing or inconsistent in a submission's provenance (empty = complete)."""
    problems = []
    if not ctx.work_item_id or item.id != ctx.work_item_id or item.org_id != ctx.org_id:
        problems.append("work item id missing or inconsistent")
    if not ctx.session_id or item.session_id != ctx.session_id:
        problems.append("session missing or inconsistent")
    if binding is None:
        problems.append("no active binding for the session")
    elif binding.session_id != item.session_id or binding.org_id != item.org_id:
        # Not reachable through the service's own writes; a row changed by hand (or a
        # bug) must not send the answer to another session's or organization's address.
        problems.append("binding inconsistent with the work item")
    if not gated_message_id:
        problems.append("gated message id missing")
    return problems
