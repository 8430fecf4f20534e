"""Intake: taking one external message in, in one short write transaction (SPEC 3).

The transaction reads the agent (by id, slug or name: REST and MCP pass the caller's
reference, so an unknown agent is a NotFound before any stream starts) and its lead, the
session and its binding, applies the intake rules, stores the user message, and reads
the policy rules and the history the model will see. It ends in one typed result:
:class:`Accepted`, :class:`~leadgate.core.types.Busy` or
:class:`~leadgate.core.types.Duplicate`.

Intake rules for a worker with a resolved lead: no active item -> create one
``inProgress`` with the message (truncated to 50,000 characters) as task context; an
``inProgress`` item -> append; any other non-terminal status -> busy, recorded as a
rejected inbound event and not appended. On PostgreSQL the item is locked (``FOR
UPDATE``) before the message is stored, also by the transaction of a REST/MCP/Studio
message to a worker without a lead (its lead removed since the item was opened; not
appended to): a turn recovery claim waits for that lock (:mod:`leadgate.turns.runs`).

A plain turn on PostgreSQL (an agent without a lead, an existing session whose binding
stays, no external event id, no run to record) writes nothing but its user message and
that message's session event. It is taken in without a transaction block
(:meth:`Intake._take_plain`), as one statement (``Database.write_alone``,
:func:`leadgate.turns.history.store_into_window`; the intakes of concurrent turns in one
statement, :class:`leadgate.turns.history.PlainIntakes`): it finds the session and its active
binding, stores the message and its event only if that binding is the turn's, and
returns the history window as it was before the message (the agent and the policy rules
come from the cache). One round trip instead of ``BEGIN``, three statements and
``COMMIT``. Nothing is lost by it: the statement is atomic by itself; the window read
in it, with the message added, is the window a read after storing it gives (a message
another turn stores meanwhile is one that came after this one's); when the session is
missing or its binding differs it writes nothing and the transaction runs instead.

A write of the intake that fails *in doubt* (PostgreSQL: the connection dropped with its
``COMMIT``, or its one statement, sent: it may have landed; ``Unavailable.in_doubt``) is
settled by reading back, on a fresh connection, whether the user message it wrote (its
id made before the write) exists (:meth:`Intake._landed`): if it does, the intake
committed and the turn goes on as if the commit had answered; if it does not, the fault
stands, saying nothing was stored (``Unavailable.found_nothing``). When that read fails
too, the message may have been taken in: :class:`~leadgate.core.errors.IntakeInDoubt`,
which asks for no retry. Only the fault path reads back.

The transaction of a busy message (it records the rejected inbound event) is settled
the same way, by reading back that event (:meth:`Intake._settle_ended`): found, the
answer is :class:`~leadgate.core.types.Busy` as if the commit had answered. A duplicate
needs no read-back: what made it one (the event recorded before) was committed by
another transaction, and this one wrote nothing its answer depends on (at most a new
session row), so a duplicate in doubt is answered :class:`~leadgate.core.types.Duplicate`.
A duplicate reads whether that earlier event was recorded busy (``Duplicate.busy``):
its message is then not in the transcript, and a surface that answers the duplicate
(REST's Idempotency-Key takeover) answers it busy again.

A message whose worker is refused (deleted: ``agent.not_found``; deactivated:
``agent.inactive``) is a duplicate all the same when its external event id was taken
in already, while the worker was active (:func:`duplicate_if_taken_in`): a platform's retry or
catch-up, a re-delivered mail, a keyed REST retry of a message being answered or gated
in review is answered as it would be were the worker active still, not refused. Only
the refusal looks it up.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError

from binding import bindings
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import (
    IntakeInDoubt,
    LeadgateError,
    NotFound,
    TransitionError,
    Unavailable,
    ValidationError,
)
from leadgate.core.limits import TASK_CONTEXT_LIMIT
from leadgate.core.logs import loggable
from leadgate.core.runners import LostClaims
from leadgate.core.types import CHANNEL_KINDS, BindingKind, Busy, Duplicate, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.sql import insert_ignore_stmt
from leadgate.domain import policy, session_events, workitems
from leadgate.domain.agents import LeadConfig, inactive_agent
from leadgate.domain.config_cache import ConfigCache
from leadgate.domain.rows import Agent, WorkItem
from leadgate.domain.workitems import Status
from leadgate.turns import runs
from leadgate.turns.context import TurnContext
from leadgate.turns.history import HistoryCache, PlainIntake, PlainIntakes, to_message
from leadgate.turns.messages import message_values, store_message
from leadgate.turns.providers.base import ChatMessage

log = logging.getLogger("leadgate.turns")

# Hot statements, built once: building a statement and its cache key costs about as much
# event-loop time as executing it.
_INSERT_EVENT = t.inbound_events.insert()
_INSERT_WORK_ITEM = t.work_items.insert()
_W = t.work_items.c
_UPDATE_EVENT = t.inbound_events.update().where(t.inbound_events.c.id == sa.bindparam("p_id"))
# Appending to an item's task: fenced by status so a concurrent move is not overwritten.
_APPEND_TASK = t.work_items.update().where(
    _W.id == sa.bindparam("p_id"), _W.status == Status.inProgress.value
)


# An intake in doubt's read-back: its user message's session, with its active binding
# (the columns bindings.session_from_row reads).
_M, _B = t.messages.c, t.bindings.c
_LANDED = (
    sa.select(
        _M.session_id.label("id"),
        _B.id.label("binding_id"),
        _B.kind.label("binding_kind"),
        _B.address.label("binding_address"),
        _B.silent.label("binding_silent"),
    )
    .select_from(t.messages.outerjoin(t.bindings, (_B.session_id == _M.session_id) & _B.active))
    .where(_M.id == sa.bindparam("p_id"))
)
#: A busy intake in doubt's read-back: whether its rejected inbound event exists.
_EVENT_LANDED = sa.select(t.inbound_events.c.id).where(
    t.inbound_events.c.id == sa.bindparam("p_id")
)
#: The message taken in under an organization's external event id (unique).
_TAKEN = sa.select(
    t.inbound_events.c.agent_id,
    t.inbound_events.c.work_item_id,
    t.inbound_events.c.outcome == "rejectedBusy",
).where(
    t.inbound_events.c.org_id == sa.bindparam("p_org"),
    t.inbound_events.c.external_event_id == sa.bindparam("p_event"),
)


class TakenIn(NamedTuple):
    """A message the intake took in under an external event id (:func:`taken_in`)."""

    agent_id: str
    #: its work item; None when its worker had no lead at the intake (a plain turn)
    work_item_id: str | None
    #: it was recorded busy (its message not in the transcript: ``Duplicate.busy``)
    busy: bool = False


async def taken_in(conn: Conn, org_id: str, external_event_id: str) -> TakenIn | None:
    """The message taken in under ``external_event_id`` in ``org_id``, or None when none
    was. A caller that comes back to a turn of its own after a crash (a flow node
    executed again, a schedule's firing still due) goes on from the turn taken in: the
    intake would answer it a duplicate only once it read the agent as it is now, and
    refused it when the agent was deactivated or deleted since (``agent.inactive``,
    ``agent.not_found``)."""
    row = (await conn.execute(_TAKEN, {"p_org": org_id, "p_event": external_event_id})).first()
    if row is None:
        return None
    item = row.work_item_id
    return TakenIn(str(row.agent_id), None if item is None else str(item), bool(row[2]))


#: The refusals of a message's worker as it is now (deleted, or deactivated).
_WORKER_REFUSED = frozenset({"agent.not_found", "agent.inactive"})


async def duplicate_if_taken_in(conn: Conn, trigger: Trigger, refusal: LeadgateError) -> Duplicate:
    """The worker of ``trigger`` is refused (``refusal``: deleted or deactivated): a
    :class:`~leadgate.core.types.Duplicate` when its message was taken in already (its
    external event id recorded, while the worker was active), as it would be were the
    worker active still, whatever it is now; else ``refusal`` is raised. A platform's
    retry or catch-up, a re-delivered mail or a keyed REST retry of a message taken in
    (and being answered, or gated in review) was refused, and a chat surface's refusal
    told its person so. Looked up only on this path: an intake that reads its worker
    active runs no statement more."""
    if trigger.external_event_id is not None and refusal.rule in _WORKER_REFUSED:
        earlier = await taken_in(conn, trigger.org_id, trigger.external_event_id)
        if earlier is not None:
            return Duplicate(busy=earlier.busy)
    raise refusal


class _Landed(NamedTuple):
    """An intake in doubt found committed (:meth:`Intake._landed`)."""

    session: bindings.OpenSession
    #: the session's window, the message in it (read when asked for)
    history: list[ChatMessage] | None


@dataclass(frozen=True)
class Accepted:
    """The message was taken in: what the turn runs with."""

    ctx: TurnContext
    agent: Agent
    #: the worker has a resolved lead (complete_task may be offered)
    gated: bool
    rules: list[policy.Rule]
    history: list[ChatMessage]


IntakeResult = Accepted | Busy | Duplicate
#: Bindings whose clients wait for the answer and retry a cut turn themselves.
_CLIENT_KINDS = frozenset({BindingKind.api, BindingKind.studio})
#: A plain turn's message settled (:meth:`Intake.settled`).
_SETTLE = t.messages.update().where(t.messages.c.id == sa.bindparam("p_id")).values(taken_by=None)


#: Sessions (agent id, key) this process opened or saw lately: their next intake skips
#: :meth:`Intake._take_new`, whose statement would find them and write nothing.
MAX_SEEN_SESSIONS = 4096


@functools.lru_cache(maxsize=16)
def _new_session_alone(shape: tuple[tuple[str, tuple[str, ...]], ...]) -> sa.Select[Any]:
    """PostgreSQL: the rows of a new session's intake (``shape``: each table with the
    columns its row sets, ``sessions`` first) as one statement, each row inserted only
    when the session is (``INSERT ... ON CONFLICT DO NOTHING``): when (agent, key) exists
    already nothing is written. Parameters are ``<table>_<column>``. Built from the
    same row builders the intake transaction uses, so both write the same rows."""
    (first, session_columns), *others = shape
    if first != "sessions":
        raise ValueError("the session's row comes first")

    def param(table: sa.Table, column: str) -> Any:
        return sa.bindparam(f"{table.name}_{column}", type_=table.c[column].type)

    created = (
        pg_insert(t.sessions)
        .values({c: param(t.sessions, c) for c in session_columns})
        .on_conflict_do_nothing()
        .returning(t.sessions.c.id)
        .cte("new_session")
    )
    rows = []
    for name, columns in others:
        table = t.metadata.tables[name]
        selected = sa.select(*[param(table, c) for c in columns]).select_from(created)
        rows.append(
            table.insert()
            .from_select([table.c[c] for c in columns], selected, include_defaults=False)
            .cte(f"new_{name}")
        )
    return sa.select(created.c.id).add_cte(*rows)


#: Bindings whose recorded turns are run again after a crash: channels, schedules and
#: (lead-reviewed) flow nodes, which nobody will ask again (a client retries its own).
_RERUN_KINDS = frozenset({*CHANNEL_KINDS, BindingKind.scheduled, BindingKind.flow})
#: Whether a turn is recorded as a run (``turn_runs``), by whether it is gated. A flow's
#: lead-reviewed node is: its run waits on the turn's work item, which only a turn run
#: again takes on to the lead (flow recovery executes the node again without a second
#: intake). A plain node's is not: flow recovery takes the answer it stored, or fails
#: the run (flow.turn_lost) rather than run it twice. Sets, not tests of members: an
#: enum member read off its class costs about 0.4 us on Python 3.11, twice per turn.
_RECORDED_KINDS = {
    True: _RERUN_KINDS | _CLIENT_KINDS,
    False: _RERUN_KINDS - {BindingKind.flow},
}


def _recorded(kind: BindingKind, gated: bool) -> bool:
    """Whether a turn through ``kind`` is recorded as a run (``turn_runs``)."""
    return kind in _RECORDED_KINDS[gated]


def _rerun(kind: BindingKind) -> bool:
    """Whether a recorded turn through ``kind`` is run again after a crash."""
    return kind in _RERUN_KINDS


def _item_values(
    item_id: str,
    trigger: Trigger,
    agent: Agent,
    lead: LeadConfig,
    session_id: str,
    binding_id: str,
    now: int,
) -> dict[str, Any]:
    """A new ``inProgress`` work item of ``trigger``'s message."""
    return {
        "id": item_id,
        "org_id": trigger.org_id,
        "agent_id": agent.id,
        "session_id": session_id,
        "lead_agent_id": lead.lead_agent_id,
        "status": Status.inProgress.value,
        "completion_policy": lead.completion_policy.value,
        "max_revision_rounds": lead.max_revision_rounds,
        "revision": 0,
        "extra_allowance": 0,
        "task_context": trigger.text[:TASK_CONTEXT_LIMIT],
        "binding_id": binding_id,
        "lease_expiries": 0,
        "last_activity_at": now,
        "created_at": now,
        "updated_at": now,
    }


def _created(trigger: Trigger, item_id: str) -> dict[str, Any]:
    """The arguments of a new item's ``create`` audit row."""
    return {
        "org_id": trigger.org_id,
        "actor": "system:intake",
        "action": "create",
        "work_item_id": item_id,
        "to_status": Status.inProgress.value,
    }


@dataclass
class _Event:
    """The inbound event row of this intake (written once its outcome is known, or
    first when it carries an external id: that row is the de-duplication)."""

    values: dict[str, Any]
    recorded: bool = False

    async def record_first(self, conn: Conn) -> bool:
        """Insert now (ON CONFLICT DO NOTHING); False when the id was seen before."""
        self.recorded = True
        insert = insert_ignore_stmt(conn.dialect.name, t.inbound_events)
        return bool((await conn.execute(insert, self.values)).rowcount)

    async def finish(self, conn: Conn, **changes: Any) -> None:
        """Write the event's final outcome / work item."""
        if self.recorded:
            await conn.execute(_UPDATE_EVENT, {"p_id": self.values["id"], **changes})
        else:
            await conn.execute(_INSERT_EVENT, {**self.values, **changes})


class Intake:
    """Runs the intake transaction (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        history: HistoryCache,
        *,
        owner: Callable[[], str | None] = lambda: None,
        doubted: Callable[[str], None] = lambda _token: None,
        lost: LostClaims[runs.RunLook] | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.history = history
        #: the process that runs what it takes in (``lease_owner`` of recorded runs)
        self.owner = owner
        #: told the lease token of a recorded run whose intake was in doubt and could not
        #: be read back: the run may exist, under this process's lease, with no turn
        #: running it; the recovery takes it over once the database is back
        self.doubted = doubted
        #: watched for the lease token of a recorded run whose intake was in doubt and
        #: not found landed (see :meth:`_settle`)
        self.lost = lost
        #: the agent and policy rules of recent intakes (SQLite; see its module)
        self.config = ConfigCache()
        #: PostgreSQL: sessions lately opened or seen here (see :data:`MAX_SEEN_SESSIONS`)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        #: PostgreSQL: plain turns' intakes (concurrent ones in one statement)
        self.plain = PlainIntakes(db)

    def refuse_unknown(self, org_id: str, ref: str) -> None:
        """Raise NotFound when ``ref`` was lately found to name no agent of ``org_id``
        and nothing it is read from has been committed since
        (:meth:`ConfigCache.refuse_unknown`; no statement, no connection)."""
        self.config.refuse_unknown(self.db.committed_token, org_id, ref)

    async def take(self, trigger: Trigger) -> IntakeResult:
        """Take ``trigger`` in (one transaction on the inline connection on SQLite).

        One body on purpose: every statement here runs inside the one short transaction,
        in this order (agent, session, de-duplication, busy check, binding, item, message,
        policy, history); the steps that are more than a statement are methods. On
        PostgreSQL a turn that may be plain tries :meth:`_take_plain` first (no
        transaction block; see the module docstring). A model already found missing is
        refused before any of it (:meth:`ConfigCache.refuse_unknown`). A worker refused
        (deleted, or deactivated) whose message was taken in already is a duplicate
        (:func:`duplicate_if_taken_in`).
        """
        try:
            self.refuse_unknown(trigger.org_id, trigger.agent_id)
        except NotFound as refusal:
            if trigger.external_event_id is None:
                raise  # (no statement, no connection: nothing can have been taken in)
            async with self.db.read() as conn:
                return await duplicate_if_taken_in(conn, trigger, refusal)
        if (
            self.db.statements_alone
            and trigger.external_event_id is None
            and not trigger.binding.kind.is_channel
        ):
            plain = await self._take_plain(trigger)
            if plain is not None:
                return plain
        if self.db.statements_alone:
            opened = await self._take_new(trigger)
            if opened is not None:
                return opened
        now = self.clock.now_ms()
        message_id: str | None = None
        #: a busy or duplicate answer decided in the transaction (with the id of the
        #: event that records it), settled if the commit is in doubt
        ended: tuple[Busy | Duplicate, str] | None = None
        try:
            async with self.db.tx() as conn:
                try:
                    agent, lead = await self.config.agent_and_lead(
                        conn, trigger.org_id, trigger.agent_id
                    )
                    if not agent.active:
                        raise inactive_agent(agent)
                except (NotFound, ValidationError) as refusal:
                    # (a duplicate's event id is not read: _settle_ended answers it)
                    ended = await duplicate_if_taken_in(conn, trigger, refusal), ""
                    return ended[0]
                session_id, current_binding, new_session = await bindings.open_session(
                    conn, self.clock, self.ids, trigger.org_id, agent.id, trigger.session_key
                )
                taken_by = self._taken_by(trigger.binding.kind, lead is not None)
                keyed_id = self._keyed_message_id(trigger, taken_by)
                event = self._event(trigger, agent, session_id, now, keyed_id)
                new_item_id: str | None = None
                if lead is not None and new_session:
                    # A new session's item is new too: its id goes into the event row now
                    # (no second write of the event once the item exists).
                    new_item_id = event.values["work_item_id"] = self.ids.new("wi")
                if trigger.external_event_id is not None and not await event.record_first(conn):
                    # (Only a duplicate reads this: the answer of one recorded busy is busy
                    # again, its message not in the transcript.)
                    earlier = await taken_in(conn, trigger.org_id, trigger.external_event_id)
                    ended = Duplicate(busy=earlier is not None and earlier.busy), event.values["id"]
                    return ended[0]
                item: WorkItem | None = None
                if lead is not None and not new_session:  # a new session has no item yet
                    item = await workitems.active_for(conn, agent.id, session_id, lock=True)
                    if item is not None and item.status != Status.inProgress:
                        # Busy: recorded for audit, not appended, no turn (SPEC 3 rule 3).
                        await event.finish(conn, outcome="rejectedBusy", work_item_id=item.id)
                        ended = Busy(work_item_id=item.id), event.values["id"]
                        return ended[0]
                    if self.db.is_postgres:
                        # Read the binding again after the item lock: a concurrent intake of
                        # the session may have replaced it while we waited.
                        current_binding = bindings.UNREAD
                elif (
                    not new_session
                    and self.db.is_postgres
                    and trigger.binding.kind in _CLIENT_KINDS
                ):
                    # No lead now, but the session may hold the item and client run of a
                    # message taken in while the worker had one (its lead removed since):
                    # locked all the same, not appended to, so that a recovery claim or a
                    # keyed retry's takeover sees this message (leadgate.turns.runs). Client
                    # runs are in REST/MCP/Studio sessions only: no channel's, schedule's
                    # or flow's session key is one of theirs.
                    held = await workitems.active_for(conn, agent.id, session_id, lock=True)
                    if held is not None:
                        current_binding = bindings.UNREAD  # (it may have waited, as above)
                binding_id = await bindings.activate(
                    conn,
                    self.clock,
                    self.ids,
                    trigger.org_id,
                    session_id,
                    trigger.binding,
                    current_binding,
                )
                item_id: str | None = None
                revision: int | None = None
                if lead is not None:
                    item_id, revision = await self._open_item(
                        conn, trigger, agent, lead, session_id, binding_id, item, now, new_item_id
                    )
                    if not (event.recorded and item_id == new_item_id):  # else written with it
                        await event.finish(conn, work_item_id=item_id)
                message_id = await store_message(
                    conn,
                    self.clock,
                    self.ids,
                    org_id=trigger.org_id,
                    session_id=session_id,
                    work_item_id=item_id,
                    role="user",
                    content=trigger.text,
                    taken_by=taken_by,
                    message_id=keyed_id,
                )
                turn_id = self.ids.new("turn")
                run_token = None
                kind = trigger.binding.kind
                if _recorded(kind, lead is not None):
                    # Recorded: if this process dies before the turn's last transaction, the
                    # recovery runner takes the run over (leadgate.turns.runs).
                    run = self._run_values(
                        trigger, agent, session_id, binding_id, item_id, message_id, turn_id, now
                    )
                    run_token = run["lease_token"]
                    await runs.record(conn, run)
                rules = await self.config.rules(conn, trigger.org_id)
                if self.db.statements_alone:
                    self._saw(agent.id, trigger.session_key)
                if new_session:
                    # Its only message is the one just stored.
                    history = [to_message("user", trigger.text)]
                    self.history.started(conn, session_id)
                else:
                    history = await self.history.read(conn, session_id)
        except Unavailable as fault:
            if ended is not None:  # (its COMMIT failed: the answer was decided)
                return await self._settle_ended(*ended, fault)
            if message_id is None:
                raise  # (before the message: nothing to settle)
            await self._settle(message_id, fault, run_token, agent.id)
        ctx = TurnContext(
            org_id=trigger.org_id,
            agent_id=agent.id,
            session_id=session_id,
            binding_id=binding_id,
            turn_id=turn_id,
            work_item_id=item_id,
            revision=revision,
            binding_posts=trigger.binding.kind.is_channel and not trigger.binding.silent,
            run_token=run_token,
            run_fenced=run_token is not None and kind.is_channel,
            message_id=message_id,
            taken_by=taken_by,
        )
        return Accepted(ctx, agent, lead is not None, rules, history)

    async def _take_new(self, trigger: Trigger) -> Accepted | None:
        """PostgreSQL: the intake of a message that opens a new session, as one
        statement outside a transaction block (:func:`_new_session_alone`): the session,
        its binding, the inbound event, the work item and its ``create`` audit row (a
        worker with a lead), the user message and its session event, and the run. One
        round trip where the transaction took eleven (``BEGIN``, the session's lookup
        and its insert, seven rows, the event, ``COMMIT``). None, with nothing written,
        when the transaction must decide: the agent or its lead are not kept (no
        connection is taken for them here), the agent is inactive, or the session exists
        (it was seen here lately, or the statement finds it)."""
        known = self.config.known(self.db.table_changes, trigger.org_id, trigger.agent_id)
        if known is None:
            return None
        agent, lead, rules = known
        key = trigger.session_key
        if not agent.active or (agent.id, key) in self._seen:
            return None
        now = self.clock.now_ms()
        clock, ids, org_id, kind = self.clock, self.ids, trigger.org_id, trigger.binding.kind
        # Every column given: defaults computed in Python are not applied inside a CTE.
        session = {
            **bindings.session_values(clock, ids, org_id, agent.id, key),
            "event_seq": 1,
            "watched_until": 0,
        }
        session_id = str(session["id"])
        binding = bindings.binding_values(clock, ids, org_id, session_id, trigger.binding)
        binding_id = str(binding["id"])
        rows: dict[str, dict[str, Any]] = {"sessions": session, "bindings": binding}
        item_id: str | None = None
        taken_by = self._taken_by(kind, lead is not None)
        keyed_id = self._keyed_message_id(trigger, taken_by)
        event = self._event(trigger, agent, session_id, now, keyed_id)
        if lead is not None:
            item_id = event.values["work_item_id"] = self.ids.new("wi")
        if lead is not None or trigger.external_event_id is not None:
            rows["inbound_events"] = event.values
        if lead is not None and item_id is not None:
            rows["work_items"] = _item_values(
                item_id, trigger, agent, lead, session_id, binding_id, now
            )
            rows["audit"] = workitems.audit_values(clock, ids, **_created(trigger, item_id))
        message = message_values(
            clock,
            ids,
            org_id=org_id,
            session_id=session_id,
            work_item_id=item_id,
            role="user",
            content=trigger.text,
            taken_by=taken_by,
            message_id=keyed_id,
        )
        rows["messages"] = message
        # Its first event (as store_message queues it, numbered from the session's 0).
        rows["session_events"] = {
            "session_id": session_id,
            "seq": 1,
            "kind": session_events.MESSAGE,
            "message_id": message["id"],
            "status": None,
            "created_at": now,
        }
        turn_id = self.ids.new("turn")
        run_token: str | None = None
        if _recorded(kind, lead is not None):
            run = self._run_values(
                trigger, agent, session_id, binding_id, item_id, message["id"], turn_id, now
            )
            run_token = run["lease_token"]
            rows["turn_runs"] = run
        shape = tuple((name, tuple(values)) for name, values in rows.items())
        try:
            result = await self.db.write_alone(
                _new_session_alone(shape),
                {f"{name}_{c}": v for name, values in rows.items() for c, v in values.items()},
                # (a new session is nobody's to watch on another replica yet: no NOTIFY)
                signals=[(session_events.TOPIC, (session_id, True))],
            )
        except IntegrityError:
            return None  # e.g. its external event id was recorded: the transaction decides
        except Unavailable as fault:
            # Its message is written only with the new session: found, all of it landed.
            await self._settle(str(message["id"]), fault, run_token, agent.id)
        else:
            if result.first() is None:
                self._saw(agent.id, key)
                return None
        self._saw(agent.id, key)
        ctx = TurnContext(
            org_id=org_id,
            agent_id=agent.id,
            session_id=session_id,
            binding_id=binding_id,
            turn_id=turn_id,
            work_item_id=item_id,
            revision=0 if item_id is not None else None,
            binding_posts=kind.is_channel and not trigger.binding.silent,
            run_token=run_token,
            run_fenced=run_token is not None and kind.is_channel,
            message_id=str(message["id"]),
            taken_by=taken_by,
        )
        return Accepted(ctx, agent, lead is not None, rules, [to_message("user", trigger.text)])

    def _keyed_message_id(self, trigger: Trigger, taken_by: str | None) -> str | None:
        """The id, made now, of the user message of a plain REST/MCP/Studio turn
        (``taken_by`` its process) taken in under an external event id, which its
        inbound event's id is derived from (:meth:`_event`); None for any other."""
        if taken_by is None or trigger.external_event_id is None:
            return None
        # Made a few statements before the message's row, in the same transaction: its
        # place in the transcript (created_at, then id) holds, as the message is stamped
        # after the session's newest (PostgreSQL) or written by the one writer (SQLite).
        # (The other ways read the event without its id: an index of idem: events only,
        # written by every keyed intake, or a scan of the never-pruned table.)
        return self.ids.new("msg")

    def _taken_by(self, kind: BindingKind, gated: bool) -> str | None:
        """The ``taken_by`` of a user message taken in through ``kind``: this process
        for a plain REST/MCP/Studio turn's (it records no run; turn recovery reruns the
        message once this process is gone and nothing answered it,
        :func:`leadgate.turns.runs.record_taken`), else None."""
        if gated or kind not in _CLIENT_KINDS:
            return None
        return self.owner()

    def _saw(self, agent_id: str, key: str) -> None:
        self._seen[agent_id, key] = None
        self._seen.move_to_end((agent_id, key))
        if len(self._seen) > MAX_SEEN_SESSIONS:
            self._seen.popitem(last=False)

    async def _take_plain(self, trigger: Trigger) -> Accepted | None:
        """PostgreSQL: a plain turn taken in without a transaction block (see the
        module docstring); None when the turn is not one (then :meth:`take` runs the
        transaction: the agent and rules it reads here come from the cache there)."""
        known = self.config.known(self.db.table_changes, trigger.org_id, trigger.agent_id)
        if known is not None:
            agent, lead, rules = known
            if lead is not None or not agent.active:
                return None
        else:
            async with self.db.read() as conn:
                agent, lead = await self.config.agent_and_lead(
                    conn, trigger.org_id, trigger.agent_id
                )
                if lead is not None or not agent.active:
                    return None
                rules = await self.config.rules(conn, trigger.org_id)
        now = self.clock.now_ms()
        message_id = self.ids.new("msg")
        taken_by = self._taken_by(trigger.binding.kind, False)
        try:
            found = await self.plain(
                PlainIntake(
                    message_id,
                    trigger.org_id,
                    agent.id,
                    trigger.session_key,
                    trigger.binding,
                    trigger.text,
                    now,
                    taken_by,
                )
            )
        except Unavailable as fault:
            try:
                session, landed = await self._landed(message_id, fault, window=True)
            except IntakeInDoubt as doubt:
                doubt.message_id = message_id  # (no run: the turn path owes it)
                doubt.agent_id = agent.id
                raise
            assert landed is not None
            history = landed
        else:
            if found is None:
                return None
            session, window = found
            history = window.with_newest(ChatMessage("user", trigger.text))
        assert session.binding is not None  # stored only into a session bound so
        ctx = TurnContext(
            org_id=trigger.org_id,
            agent_id=agent.id,
            session_id=session.id,
            binding_id=session.binding.id,
            turn_id=self.ids.new("turn"),
            work_item_id=None,
            revision=None,
            binding_posts=False,  # not a channel
            run_token=None,
            run_fenced=False,
            message_id=message_id,
            taken_by=taken_by,
        )
        return Accepted(ctx, agent, False, rules, history)

    async def _settle(
        self, message_id: str, fault: Unavailable, run_token: str | None, agent_id: str
    ) -> None:
        """:meth:`_landed` for an intake that may have recorded a run (``run_token``):
        found, this process runs the turn now; unread, the run goes to the recovery
        (:attr:`doubted`), since it may exist with nothing running it; not found in doubt,
        the recovery watches for it (:attr:`lost`), since it may land after the read."""
        try:
            await self._landed(message_id, fault)
        except IntakeInDoubt as doubt:
            if run_token is not None:
                self.doubted(run_token)
            else:
                doubt.message_id = message_id  # (no run: the turn path owes it)
                doubt.agent_id = agent_id
            raise
        except Unavailable:
            if run_token is not None and fault.in_doubt and self.lost is not None:
                # Not found, but the server may still apply the intake after the read
                # raced it: its run would then wait out its lease (:data:`RUN_LEASE_MS
                # <leadgate.turns.runs.RUN_LEASE_MS>`) with nothing running it. The
                # recovery looks for its token until then (leadgate.turns.runs.claim).
                now = self.clock.now_ms()
                # Its client is told nothing was stored and sends it again: a run found
                # later is not rerun, unless keyed (its resend a duplicate: runs.RunLook).
                self.lost.watch(
                    runs.RunLook(run_token, rerun=False),
                    due=now + self.lost.first_ms,
                    lapses=now + runs.RUN_LEASE_MS,
                )
            raise

    async def _settle_ended(
        self, ended: Busy | Duplicate, event_id: str, fault: Unavailable
    ) -> Busy | Duplicate:
        """The transaction that decided ``ended`` (busy: it recorded the rejected event
        ``event_id``; a duplicate) failed with ``fault`` at its COMMIT. In doubt, a
        duplicate is one whether or not it landed (see the module docstring), and a
        busy message is busy if its event is found on a fresh connection. Raises
        ``fault`` when it is not in doubt or the event is not there (nothing was
        stored); :class:`IntakeInDoubt` when the read fails too."""
        if not fault.in_doubt:
            raise fault
        if isinstance(ended, Duplicate):
            return ended
        try:
            async with self.db.read() as conn:
                found = await conn.scalar(_EVENT_LANDED, {"p_id": event_id})
        except Unavailable as again:
            raise IntakeInDoubt(again.detail or fault.detail) from fault
        if found is None:
            raise fault.found_nothing()
        return ended

    async def _landed(
        self, message_id: str, fault: Unavailable, *, window: bool = False
    ) -> _Landed:
        """The intake that wrote the user message ``message_id`` failed with ``fault``:
        when that is in doubt (its commit may have landed), read back on a fresh
        connection whether the message exists, and return its session (its active
        binding, and with ``window`` its window) when it does. Raises ``fault`` when it
        does not, or when ``fault`` is not in doubt (nothing was stored);
        :class:`IntakeInDoubt` when the read fails too (it may have been taken in)."""
        if not fault.in_doubt:
            raise fault
        try:
            async with self.db.read() as conn:
                row = (await conn.execute(_LANDED, {"p_id": message_id})).first()
                history = None
                if row is not None and window:
                    history = await self.history.read(conn, row.id)
        except Unavailable as again:
            raise IntakeInDoubt(again.detail or fault.detail) from fault
        if row is None:
            raise fault.found_nothing()
        return _Landed(bindings.session_from_row(row), history)

    def owed_run(self, trigger: Trigger, turn: Accepted, taken_at: int) -> dict[str, Any] | None:
        """The ``turn_runs`` row that records ``turn`` late (None: it needs none, or
        has one): a plain REST/MCP/Studio turn that stopped on a database fault after
        its intake (``taken_at``: a time at or before its message's) and recorded no
        run. A ``client`` run, as a gated turn of theirs records in its intake."""
        ctx = turn.ctx
        if ctx.run_token is not None or ctx.message_id is None:
            return None
        if trigger.binding.kind not in _CLIENT_KINDS:
            return None  # (a plain flow node's: flow recovery takes it, flow.turn_lost)
        values = self._run_values(
            trigger,
            turn.agent,
            ctx.session_id,
            ctx.binding_id,
            ctx.work_item_id,
            ctx.message_id,
            ctx.turn_id,
            taken_at,
        )
        # (The id turn recovery records it under once this process is gone: one row.)
        values["id"] = runs.run_id_of(ctx.message_id)
        if ctx.taken_by is not None:
            # Held by the process that took it in, the one its message names: reaped
            # since (registered anew), the run is that gone process's, as the run turn
            # recovery's search records for the message is (owner_gone: any replica's
            # recovery takes it at once, not this process's own alone).
            values["lease_owner"] = ctx.taken_by
        return values

    async def settled(self, trigger: Trigger, turn: Accepted, *, take_back: bool = False) -> None:
        """A plain REST/MCP/Studio turn ended with no answer on purpose (its model
        failed, its client told so: a 502): its message is settled, never rerun by turn
        recovery once this process is gone (``taken_by`` cleared,
        :func:`leadgate.turns.runs.record_taken`). Off the answered path: one statement
        on a failure alone. ``take_back``: this process may have been reaped while the
        turn ran (``TurnService.maybe_reaped``), so recovery may have recorded the
        message's run already: it is deleted in the same transaction
        (:func:`leadgate.turns.runs.take_back`), as an answer's last transaction deletes
        it (it was rerun a minute on, its answer stored after the 502). When it fails
        too, a WARNING: after this process is gone, the message may be answered after
        all."""
        ctx = turn.ctx
        if ctx.run_token is not None or ctx.message_id is None:
            return
        if trigger.binding.kind not in _CLIENT_KINDS:
            return
        try:
            async with self.db.tx() as conn:
                if take_back:
                    await runs.take_back(conn, ctx.message_id)
                await conn.execute(_SETTLE, {"p_id": ctx.message_id})
        except Exception as exc:
            log.warning(
                "could not settle the failed plain turn of session %s (recovery may "
                "answer its message once this process is gone)",
                ctx.session_id,
                exc_info=loggable(exc),
            )

    def owed_in_doubt(
        self, trigger: Trigger, message_id: str, agent_id: str | None, taken_at: int
    ) -> dict[str, Any] | None:
        """The ``turn_runs`` row that records late the turn of a plain REST/MCP/Studio
        message whose intake was in doubt and whose read-back failed (None: not such a
        turn's): its session, agent and binding are not known here, and are read from
        the message when it is recorded (:func:`leadgate.turns.runs.record_owed`). With
        its worker's id (``agent_id``) and the session key: a look that finds the message
        absent notes the session's last event by them (its resend is told by it)."""
        if trigger.binding.kind not in _CLIENT_KINDS:
            return None
        return {
            "id": runs.run_id_of(message_id),
            "org_id": trigger.org_id,
            "agent_id": None,
            "session_id": None,
            "binding_id": None,
            "work_item_id": None,
            "message_id": message_id,
            "policy": runs.CLIENT,
            "turn_id": self.ids.new("turn"),
            "lease_owner": self.owner(),
            "lease_token": self.ids.new("lease"),
            "lease_expires_at": taken_at + runs.RUN_LEASE_MS,
            "attempts": 1,
            "created_at": taken_at,
            "external_event_id": trigger.external_event_id,
            # (what its look reads the session's last event by: runs.record_owed)
            runs.LOOK_AGENT: agent_id,
            runs.LOOK_KEY: trigger.session_key,
        }

    def _run_values(
        self,
        trigger: Trigger,
        agent: Agent,
        session_id: str,
        binding_id: str,
        item_id: str | None,
        message_id: str,
        turn_id: str,
        now: int,
    ) -> dict[str, Any]:
        """The ``turn_runs`` row recording this turn (a new lease token)."""
        return {
            "id": self.ids.new("run"),
            "org_id": trigger.org_id,
            "agent_id": agent.id,
            "session_id": session_id,
            "binding_id": binding_id,
            "work_item_id": item_id,
            "message_id": message_id,
            "policy": runs.RERUN if _rerun(trigger.binding.kind) else runs.CLIENT,
            "turn_id": turn_id,
            "lease_owner": self.owner(),
            "lease_token": self.ids.new("lease"),
            "lease_expires_at": now + runs.RUN_LEASE_MS,
            "attempts": 1,
            "created_at": now,
            "external_event_id": trigger.external_event_id,
        }

    def _event(
        self, trigger: Trigger, agent: Agent, session_id: str, now: int, message_id: str | None
    ) -> _Event:
        # A plain chat turn (no lead, no external id) writes no event at all: its user
        # message is its record. A keyed one's (``message_id``, made now) has an id
        # derived from its message's, by which turn recovery reads its external event id
        # once its process is gone (runs.event_id_of).
        return _Event(
            {
                "id": self.ids.new("evt") if message_id is None else runs.event_id_of(message_id),
                "org_id": trigger.org_id,
                "agent_id": agent.id,
                "session_id": session_id,
                "outcome": "accepted",
                "content": trigger.text[:TASK_CONTEXT_LIMIT],
                "external_event_id": trigger.external_event_id,
                "work_item_id": None,
                "created_at": now,
            }
        )

    async def _open_item(
        self,
        conn: Conn,
        trigger: Trigger,
        agent: Agent,
        lead: LeadConfig,
        session_id: str,
        binding_id: str,
        item: WorkItem | None,
        now: int,
        new_item_id: str | None = None,
    ) -> tuple[str, int]:
        """Create the session's work item (with ``new_item_id`` if given), or append to
        the ``inProgress`` one; returns (item id, revision)."""
        if item is not None:
            await self._append(conn, item, trigger.text, binding_id, now)
            return item.id, item.revision
        item_id = new_item_id or self.ids.new("wi")
        await conn.execute(
            _INSERT_WORK_ITEM,
            _item_values(item_id, trigger, agent, lead, session_id, binding_id, now),
        )
        await workitems.audit(conn, self.clock, self.ids, **_created(trigger, item_id))
        return item_id, 0

    async def _append(
        self, conn: Conn, item: WorkItem, text: str, binding_id: str, now: int
    ) -> None:
        """SPEC 3 rule 2: a message while ``inProgress`` is appended (fenced by status)."""
        context = (item.task_context + "\n\n" + text)[:TASK_CONTEXT_LIMIT]
        res = await conn.execute(
            _APPEND_TASK,
            {
                "p_id": item.id,
                "task_context": context,
                "last_activity_at": now,
                "binding_id": binding_id,
                "updated_at": now,
            },
        )
        if not res.rowcount:
            raise TransitionError("work item changed during intake", rule="intake")
