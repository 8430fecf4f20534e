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
rejected inbound event and not appended.

A plain turn on PostgreSQL (an agent without a lead, an existing session whose binding
stays, no external event id, no run to record) writes nothing but its user message and
that message's session event. It is taken in without a transaction block
(:meth:`Intake._take_plain`), as one statement (``Database.write_alone``,
:func:`leadgate.turns.history.store_into_window`): it finds the session and its active
binding, stores the message and its event only if that binding is the turn's, and
returns the history window as it was before the message (the agent and the policy rules
come from the cache). One round trip instead of ``BEGIN``, three statements and
``COMMIT``. Nothing is lost by it: the statement is atomic by itself; the window read
in it, with the message added, is the window a read after storing it gives (a message
another turn stores meanwhile is one that came after this one's); when the session is
missing or its binding differs it writes nothing and the transaction runs instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from binding import bindings
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import TransitionError, ValidationError
from leadgate.core.limits import TASK_CONTEXT_LIMIT
from leadgate.core.types import BindingKind, Busy, Duplicate, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.sql import insert_ignore_stmt
from leadgate.domain import policy, workitems
from leadgate.domain.agents import LeadConfig
from leadgate.domain.config_cache import ConfigCache
from leadgate.domain.rows import Agent, WorkItem
from leadgate.domain.workitems import Status
from leadgate.turns import runs
from leadgate.turns.context import TurnContext
from leadgate.turns.history import HistoryCache, store_into_window, to_message
from leadgate.turns.messages import store_message
from leadgate.turns.providers.base import ChatMessage

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
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.history = history
        #: the process that runs what it takes in (``lease_owner`` of recorded runs)
        self.owner = owner
        #: the agent and policy rules of recent intakes (SQLite; see its module)
        self.config = ConfigCache()

    async def take(self, trigger: Trigger) -> IntakeResult:
        """Take ``trigger`` in (one transaction on the inline connection on SQLite).

        One body on purpose: every statement here runs inside the one short transaction,
        in this order (agent, session, de-duplication, busy check, binding, item, message,
        policy, history); the steps that are more than a statement are methods. On
        PostgreSQL a turn that may be plain tries :meth:`_take_plain` first (no
        transaction block; see the module docstring).
        """
        if (
            self.db.is_postgres
            and trigger.external_event_id is None
            and not trigger.binding.kind.is_channel
        ):
            plain = await self._take_plain(trigger)
            if plain is not None:
                return plain
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            agent, lead = await self.config.agent_and_lead(conn, trigger.org_id, trigger.agent_id)
            if not agent.active:
                raise ValidationError(f"agent {agent.name!r} is inactive", rule="agent.inactive")
            session_id, current_binding, new_session = await bindings.open_session(
                conn, self.clock, self.ids, trigger.org_id, agent.id, trigger.session_key
            )
            event = self._event(trigger, agent, session_id, now)
            new_item_id: str | None = None
            if lead is not None and new_session:
                # A new session's item is new too: its id goes into the event row now
                # (no second write of the event once the item exists).
                new_item_id = event.values["work_item_id"] = self.ids.new("wi")
            if trigger.external_event_id is not None and not await event.record_first(conn):
                return Duplicate()
            item: WorkItem | None = None
            if lead is not None and not new_session:  # a new session has no item yet
                item = await workitems.active_for(conn, agent.id, session_id, lock=True)
                if item is not None and item.status != Status.inProgress:
                    # Busy: recorded for audit, not appended, no turn (SPEC 3 rule 3).
                    await event.finish(conn, outcome="rejectedBusy", work_item_id=item.id)
                    return Busy(work_item_id=item.id)
                if self.db.is_postgres:
                    # Read the binding again after the item lock: a concurrent intake of
                    # the session may have replaced it while we waited.
                    current_binding = bindings.UNREAD
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
            )
            turn_id = self.ids.new("turn")
            run_token = None
            kind = trigger.binding.kind
            if kind.is_channel or (lead is not None and kind in _CLIENT_KINDS):
                # Recorded: if this process dies before the turn's last transaction, the
                # recovery runner takes the run over (leadgate.turns.runs).
                run_token = self.ids.new("lease")
                await runs.record(
                    conn,
                    {
                        "id": self.ids.new("run"),
                        "org_id": trigger.org_id,
                        "agent_id": agent.id,
                        "session_id": session_id,
                        "binding_id": binding_id,
                        "work_item_id": item_id,
                        "message_id": message_id,
                        "policy": runs.RERUN if kind.is_channel else runs.CLIENT,
                        "turn_id": turn_id,
                        "lease_owner": self.owner(),
                        "lease_token": run_token,
                        "lease_expires_at": now + runs.RUN_LEASE_MS,
                        "attempts": 1,
                        "created_at": now,
                    },
                )
            rules = await self.config.rules(conn, trigger.org_id)
            if new_session:
                # Its only message is the one just stored.
                history = [to_message("user", trigger.text)]
                self.history.started(conn, session_id)
            else:
                history = await self.history.read(conn, session_id)
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
        )
        return Accepted(ctx, agent, lead is not None, rules, history)

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
        found = await store_into_window(
            self.db,
            message_id,
            org_id=trigger.org_id,
            agent_id=agent.id,
            key=trigger.session_key,
            binding=trigger.binding,
            content=trigger.text,
            created_at=now,
        )
        if found is None:
            return None
        session, window = found
        assert session.binding is not None  # stored only into a session bound so
        history = window.with_newest((now, message_id), ChatMessage("user", trigger.text))
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
        )
        return Accepted(ctx, agent, False, rules, history)

    def _event(self, trigger: Trigger, agent: Agent, session_id: str, now: int) -> _Event:
        # A plain chat turn (no lead, no external id) writes no event at all: its user
        # message is its record.
        return _Event(
            {
                "id": self.ids.new("evt"),
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
            {
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
            },
        )
        await workitems.audit(
            conn,
            self.clock,
            self.ids,
            org_id=trigger.org_id,
            actor="system:intake",
            action="create",
            work_item_id=item_id,
            to_status=Status.inProgress.value,
        )
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
