"""The one turn path every way in ends on (SPEC 3).

``TurnService.run(trigger)`` takes an external message in (intake rules), runs the worker
model with ``complete_task`` offered only under a matching trusted context, and ends in
one of :data:`engine.types.Outcome`. ``run_revision`` runs an internal revision turn
(lead feedback or a human's return) on the same path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from binding import bindings
from engine import agents as agents_mod
from engine import history, policy, workitems
from engine import schema as t
from engine.clock import Clock, IdFactory
from engine.db import Conn, Database
from engine.errors import ModelError, TransitionError, ValidationError
from engine.metrics import METRICS
from engine.providers.base import ChatMessage, ModelRequest, Provider, TextDelta, ToolCall, ToolSpec
from engine.sql import insert_ignore_stmt
from engine.types import Busy, Duplicate, Gated, Outcome, Reply, Trigger
from engine.workitems import Status
from outbox.store import enqueue_reply

log = logging.getLogger("leadgate.turns")

TASK_CONTEXT_LIMIT = 50_000
SNAPSHOT_LIMIT = 100_000
SUMMARY_LIMIT = 2_000
MESSAGE_LIMIT = 100_000
SESSION_KEY_LIMIT = 500  # sessions.key is VARCHAR(500)
MAX_MODEL_CALLS = 4
REVISION_LEASE_MS = 5 * 60_000

COMPLETE_TASK = ToolSpec(
    name="complete_task",
    description=(
        "Call this once the task is finished. Your reply is then held for review by your "
        "lead before anyone sees it. Give a short summary of what you did."
    ),
    parameters={
        "type": "object",
        "properties": {
            "summary": {
                "type": "string",
                "description": "What was done, 1 to 2,000 characters.",
                "minLength": 1,
                "maxLength": SUMMARY_LIMIT,
            }
        },
        "required": ["summary"],
        "additionalProperties": False,
    },
)

DeltaSink = Callable[[str], Awaitable[None]]

# Hot statements, built once: building a statement and its cache key costs about as much
# event-loop time as executing it.
_INSERT_MESSAGE = t.messages.insert()
_INSERT_EVENT = t.inbound_events.insert()
_INSERT_WORK_ITEM = t.work_items.insert()
_W = t.work_items.c
_UPDATE_EVENT = t.inbound_events.update().where(t.inbound_events.c.id == sa.bindparam("p_id"))
# Appending to an item's task: fenced by status so a concurrent move is not overwritten.
_APPEND_TASK = t.work_items.update().where(
    _W.id == sa.bindparam("p_id"), _W.status == Status.inProgress.value
)
#: complete_task's tool result when the signal was recorded for this turn.
SUBMITTED = json.dumps({"ok": True, "status": "submitted for lead review"})


@dataclass(frozen=True)
class TurnContext:
    """Trusted, server-side context of a turn. Never model input."""

    org_id: str
    agent_id: str
    session_id: str
    binding_id: str
    turn_id: str
    work_item_id: str | None = None
    revision: int | None = None
    # False when the turn's binding can never post (api, studio, silent): a plain reply
    # then has nothing to queue, whichever binding is active by the end of the turn.
    binding_posts: bool = True


class ProviderRegistry:
    """Model providers by configured name."""

    def __init__(self, providers: dict[str, Provider]) -> None:
        self._providers = providers

    @property
    def names(self) -> frozenset[str]:
        """Configured model names."""
        return frozenset(self._providers)

    def get(self, name: str) -> Provider:
        """The provider for ``name`` (ModelError when the config lost it)."""
        try:
            return self._providers[name]
        except KeyError:
            raise ModelError(f"model {name!r} is not configured", rule="model.unknown") from None


def validate_message(text: str) -> str:
    """External messages: non-empty, at most 100,000 characters, no NUL bytes."""
    if not isinstance(text, str) or not text.strip():
        raise ValidationError("the message must not be empty", rule="message.empty")
    if len(text) > MESSAGE_LIMIT:
        raise ValidationError(
            f"the message is longer than {MESSAGE_LIMIT:,} characters", rule="message.too_long"
        )
    if "\x00" in text:
        raise ValidationError("the message contains a NUL character", rule="message.invalid")
    return text


class TurnService:
    """Runs turns. One instance per process; safe to call concurrently."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        providers: ProviderRegistry,
        *,
        on_review_queued: Callable[[], None] = lambda: None,
        on_delivery_queued: Callable[[], None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.providers = providers
        self.on_review_queued = on_review_queued
        self.on_delivery_queued = on_delivery_queued
        self.history = history.HistoryCache()
        db.on_commit_payloads(history.TOPIC, self.history.apply)

    # ------------------------------------------------------------------ intake

    async def run(
        self,
        trigger: Trigger,
        *,
        on_delta: DeltaSink | None = None,
        on_start: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome:
        """Take ``trigger`` in and run the worker's turn.

        ``on_delta`` receives text as the model produces it, but only when nothing can
        withhold or rewrite it (no lead, no output policy rules); otherwise the text is
        delivered whole after the turn. ``on_start`` is awaited once the message was
        accepted (not busy, not a duplicate), before the model runs.
        """
        validate_message(trigger.text)
        if not trigger.session_key or len(trigger.session_key) > SESSION_KEY_LIMIT:
            raise ValidationError(
                f"the session id must be 1..{SESSION_KEY_LIMIT} characters", rule="session.length"
            )
        for attempt in range(3):
            try:
                intake = await self._intake(trigger)
                break
            except IntegrityError:
                # PostgreSQL: a concurrent intake created the session's active item first;
                # the unique partial index refused ours. Run the rules again.
                if attempt == 2:
                    raise
        if isinstance(intake, Busy | Duplicate):
            METRICS.turns.labels("busy" if isinstance(intake, Busy) else "duplicate").inc()
            return intake
        ctx, agent, gated_turn, rules, history = intake
        if on_start is not None:
            await on_start()
        return await self._execute(
            ctx, agent, gated_turn, rules, trigger.text, None, on_delta, history=history
        )

    async def _intake(
        self, trigger: Trigger
    ) -> (
        Busy
        | Duplicate
        | tuple[TurnContext, dict[str, Any], bool, list[policy.Rule], list[ChatMessage]]
    ):
        """One write transaction: the agent (by id, slug or name: REST and MCP pass the
        caller's reference, so an unknown agent is a NotFound before any stream starts),
        its lead, the session and its binding, the intake rules, the user message, the
        policy rules and the history the model will see."""
        now = self.clock.now_ms()
        async with self.db.fast_tx() as conn:
            agent, lead = await agents_mod.find_agent_and_lead(
                conn, trigger.org_id, trigger.agent_id
            )
            if not agent["active"]:
                raise ValidationError(f"agent {agent['name']!r} is inactive", rule="agent.inactive")
            session_id, current_binding = await bindings.open_session(
                conn, self.clock, self.ids, trigger.org_id, agent["id"], trigger.session_key
            )
            event_id = self.ids.new("evt")
            event = {
                "id": event_id,
                "org_id": trigger.org_id,
                "agent_id": agent["id"],
                "session_id": session_id,
                "outcome": "accepted",
                "content": trigger.text[:TASK_CONTEXT_LIMIT],
                "external_event_id": trigger.external_event_id,
                "work_item_id": None,
                "created_at": now,
            }
            # An event with an external id is written first: that row is the
            # de-duplication. Without one it is written once its outcome and work item are
            # known; a plain chat turn (no lead) writes none, its user message is its record.
            recorded = trigger.external_event_id is not None
            if recorded:
                insert = insert_ignore_stmt(conn.dialect.name, t.inbound_events)
                if not (await conn.execute(insert, event)).rowcount:
                    return Duplicate()
            item_id: str | None = None
            revision: int | None = None
            if lead is not None:
                item = await workitems.active_for(conn, agent["id"], session_id, lock=True)
                if item is not None and item["status"] != Status.inProgress:
                    # Busy: recorded for audit, not appended, no turn (SPEC 3 rule 3).
                    busy = {"outcome": "rejectedBusy", "work_item_id": item["id"]}
                    if recorded:
                        await conn.execute(_UPDATE_EVENT, {"p_id": event_id, **busy})
                    else:
                        await conn.execute(_INSERT_EVENT, {**event, **busy})
                    return Busy(work_item_id=item["id"])
            if lead is not None and self.db.is_postgres:
                # Read the binding again after the item lock: a concurrent intake of the
                # session may have replaced it while we waited.
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
            if lead is not None:
                if item is None:
                    item_id = self.ids.new("wi")
                    revision = 0
                    await conn.execute(
                        _INSERT_WORK_ITEM,
                        {
                            "id": item_id,
                            "org_id": trigger.org_id,
                            "agent_id": agent["id"],
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
                else:
                    item_id = item["id"]
                    revision = item["revision"]
                    context = (item["task_context"] + "\n\n" + trigger.text)[:TASK_CONTEXT_LIMIT]
                    res = await conn.execute(
                        _APPEND_TASK,
                        {
                            "p_id": item_id,
                            "task_context": context,
                            "last_activity_at": now,
                            "binding_id": binding_id,
                            "updated_at": now,
                        },
                    )
                    if not res.rowcount:
                        raise TransitionError("work item changed during intake", rule="intake")
                if recorded:
                    await conn.execute(_UPDATE_EVENT, {"p_id": event_id, "work_item_id": item_id})
                else:
                    await conn.execute(_INSERT_EVENT, {**event, "work_item_id": item_id})
            await self._store_message(
                conn, trigger.org_id, session_id, item_id, "user", trigger.text
            )
            rules = await policy.load_rules(conn, trigger.org_id)
            history = await self.history.read(conn, session_id)
        ctx = TurnContext(
            org_id=trigger.org_id,
            agent_id=agent["id"],
            session_id=session_id,
            binding_id=binding_id,
            turn_id=self.ids.new("turn"),
            work_item_id=item_id,
            revision=revision,
            binding_posts=trigger.binding.kind.is_channel and not trigger.binding.silent,
        )
        return ctx, agent, lead is not None, rules, history

    # ------------------------------------------------------------- revisions

    async def claim_revision(self) -> dict[str, Any] | None:
        """Claim one inProgress item whose feedback waits for an internal turn."""
        now = self.clock.now_ms()
        w = t.work_items.c
        async with self.db.tx() as conn:
            query = self.db.skip_locked(
                sa.select(w.id)
                .where(
                    w.status == Status.inProgress.value,
                    w.pending_feedback.is_not(None),
                    sa.or_(w.lease_expires_at.is_(None), w.lease_expires_at < now),
                )
                .order_by(w.updated_at)
                .limit(1)
            )
            item_id = await conn.scalar(query)
            if item_id is None:
                return None
            token = self.ids.new("lease")
            row = (
                await conn.execute(
                    t.work_items.update()
                    .where(
                        w.id == item_id,
                        w.status == Status.inProgress.value,
                        w.pending_feedback.is_not(None),
                    )
                    .values(lease_token=token, lease_expires_at=now + REVISION_LEASE_MS)
                    .returning(*t.work_items.c)
                )
            ).first()
        return None if row is None else dict(row._mapping)

    async def run_revision(self, item: dict[str, Any]) -> Outcome:
        """Dispatch the stored feedback to the worker as a new internal turn."""
        feedback = item["pending_feedback"] or ""
        async with self.db.tx() as conn:
            agent = await agents_mod.find_agent(
                conn, item["org_id"], item["agent_id"], include_deleted=True
            )
            binding = await bindings.active_binding(conn, item["session_id"])
            await self._store_message(
                conn, item["org_id"], item["session_id"], item["id"], "internal", feedback
            )
            rules = await policy.load_rules(conn, item["org_id"])
            history = await self.history.read(conn, item["session_id"])
        ctx = TurnContext(
            org_id=item["org_id"],
            agent_id=item["agent_id"],
            session_id=item["session_id"],
            binding_id=binding["id"] if binding else "",
            turn_id=self.ids.new("turn"),
            work_item_id=item["id"],
            revision=item["revision"],
        )
        return await self._execute(ctx, agent, True, rules, feedback, item, None, history=history)

    # -------------------------------------------------------------- the turn

    async def _execute(
        self,
        ctx: TurnContext,
        agent: dict[str, Any],
        gated_turn: bool,
        rules: list[policy.Rule],
        text: str,
        revision_item: dict[str, Any] | None,
        on_delta: DeltaSink | None,
        *,
        history: list[ChatMessage] | None = None,
    ) -> Outcome:
        """Run the model; ``history`` is the session's as read when the turn was taken in
        (read here when not given)."""
        provider = self.providers.get(agent["model"])
        if history is None:
            async with self.db.read() as conn:
                history = await self.history.read(conn, ctx.session_id)
        messages = [ChatMessage("system", agent["instructions"] or "You are a helpful agent.")]
        messages += history
        # complete_task only under a trusted context that names an inProgress item.
        tools = [COMPLETE_TASK] if gated_turn and ctx.work_item_id else []
        live = on_delta if (not gated_turn and not rules) else None
        parts: list[str] = []
        signalled = False  # this turn's complete_task was acknowledged
        feedback = revision_item["pending_feedback"] if revision_item else None
        try:
            for _ in range(MAX_MODEL_CALLS):
                calls: list[ToolCall] = []
                round_text: list[str] = []
                request = ModelRequest(messages=messages, tools=tools, revision_feedback=feedback)
                async for event in provider.stream(request):
                    if isinstance(event, TextDelta):
                        round_text.append(event.text)
                        if live is not None and event.text:
                            await live(event.text)
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
                    messages.append(ChatMessage("tool", result, tool_call_id=call.id))
        except ModelError:
            METRICS.turns.labels("error").inc()
            raise
        except Exception as exc:
            METRICS.turns.labels("error").inc()
            log.exception("model provider failed")
            raise ModelError("the model failed while producing this turn") from exc
        return await self._finish(
            ctx,
            gated_turn,
            rules,
            "".join(parts),
            revision_item,
            streamed=live is not None,
            signalled=signalled,
        )

    async def _tool(self, ctx: TurnContext, call: ToolCall, offered: list[ToolSpec]) -> str:
        if call.name not in {tool.name for tool in offered}:
            return json.dumps({"error": f"unknown tool {call.name!r}"})
        summary = call.arguments.get("summary")
        if call.arguments_error or not isinstance(summary, str) or not summary.strip():
            return json.dumps({"error": "complete_task needs a non-empty summary"})
        if len(summary) > SUMMARY_LIMIT:
            return json.dumps({"error": "summary must be at most 2,000 characters"})
        w = t.work_items.c
        async with self.db.tx() as conn:
            res = await conn.execute(
                t.work_items.update()
                .where(
                    w.id == ctx.work_item_id,
                    w.status == Status.inProgress.value,
                    w.session_id == ctx.session_id,
                    w.agent_id == ctx.agent_id,
                )
                .values(signal_summary=summary, signal_turn_id=ctx.turn_id)
            )
            await self._store_message(
                conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "tool", summary, "complete_task"
            )
        if not res.rowcount:
            return json.dumps({"error": "no in-progress work item matches this turn"})
        return SUBMITTED

    async def read_signal(self, conn: AsyncConnection, ctx: TurnContext) -> str | None:
        """The summary complete_task left for this turn, or ``None``."""
        w = t.work_items.c
        row = (
            await conn.execute(
                sa.select(w.signal_summary).where(
                    w.id == ctx.work_item_id, w.signal_turn_id == ctx.turn_id
                )
            )
        ).first()
        return None if row is None else row.signal_summary

    async def _finish(
        self,
        ctx: TurnContext,
        gated_turn: bool,
        rules: list[policy.Rule],
        text: str,
        revision_item: dict[str, Any] | None,
        *,
        streamed: bool = False,
        signalled: bool = False,
    ) -> Outcome:
        signal: str | None = None
        if gated_turn and ctx.work_item_id:
            try:
                async with self.db.read() as conn:
                    signal = await self.read_signal(conn, ctx)
            except Exception:
                # Fail closed: when we cannot tell whether the work was handed off,
                # the text is withheld.
                log.exception("reading the completion signal failed; withholding the reply")
                return await self._withhold(ctx, text, revision_item)
        if signal is not None:
            return await self._submit(ctx, text, signal, revision_item)
        if signalled:
            # complete_task was acknowledged, but another turn of the same item signalled
            # (or submitted) meanwhile and this turn's signal is gone: still withheld.
            log.warning("completion signal of turn %s was superseded; withholding", ctx.turn_id)
            return await self._withhold(ctx, text, revision_item)
        screened = policy.screen(text, rules) if rules else text
        if revision_item is None and not ctx.binding_posts:
            # API, studio and silent turns only store the reply: the short transaction.
            async with self.db.fast_tx() as fast:
                await self._store_message(
                    fast, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", screened
                )
        else:
            # A reply that may be queued for a channel: the outbox's in-process hand-off
            # needs the general transaction.
            await self._store_reply(ctx, screened, revision_item)
        METRICS.turns.labels("plain").inc()
        return Reply(screened, streamed=streamed)

    async def _store_reply(
        self, ctx: TurnContext, text: str, revision_item: dict[str, Any] | None
    ) -> None:
        queued = None
        async with self.db.tx() as conn:
            await self._store_message(
                conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", text
            )
            await self._release_revision(conn, revision_item)
            if revision_item is None:
                binding = await bindings.active_binding(conn, ctx.session_id)
                if binding is not None and binding["id"] == ctx.binding_id:
                    queued = await enqueue_reply(
                        conn, self.clock, self.ids, org_id=ctx.org_id, binding=binding, text=text
                    )
        if queued:
            self.on_delivery_queued()

    async def _withhold(
        self, ctx: TurnContext, text: str, revision_item: dict[str, Any] | None
    ) -> Outcome:
        """Store the text withheld (leadGated) without a submission: fail closed."""
        async with self.db.tx() as conn:
            await self._store_message(
                conn,
                ctx.org_id,
                ctx.session_id,
                ctx.work_item_id,
                "assistant",
                text,
                gated=True,
            )
            await self._release_revision(conn, revision_item)
        METRICS.turns.labels("gated").inc()
        return Gated(work_item_id=ctx.work_item_id, revision=ctx.revision)

    async def _release_revision(self, conn: Conn, revision_item: dict[str, Any] | None) -> None:
        if revision_item is None:
            return
        w = t.work_items.c
        await conn.execute(
            t.work_items.update()
            .where(w.id == revision_item["id"], w.lease_token == revision_item["lease_token"])
            .values(pending_feedback=None, lease_token=None, lease_expires_at=None)
        )

    async def _submit(
        self, ctx: TurnContext, text: str, summary: str, revision_item: dict[str, Any] | None
    ) -> Outcome:
        async with self.db.tx() as conn:
            message_id = await self._store_message(
                conn, ctx.org_id, ctx.session_id, ctx.work_item_id, "assistant", text, gated=True
            )
            await self._release_revision(conn, revision_item)
            item = await workitems.get(conn, str(ctx.work_item_id))
            binding = await bindings.active_binding(conn, ctx.session_id)
            problems = provenance_problems(ctx, item, binding, message_id)
            values = {
                "summary": summary,
                "snapshot": text[:SNAPSHOT_LIMIT],
                "gated_message_id": message_id,
                "signal_summary": None,
                "signal_turn_id": None,
                "binding_id": binding["id"] if binding else None,
                "last_activity_at": self.clock.now_ms(),
            }
            try:
                if problems:
                    await workitems.transition(
                        conn,
                        self.clock,
                        self.ids,
                        item["id"],
                        src=Status.inProgress,
                        dst=Status.awaitingHuman,
                        actor="system:turn",
                        action="incompleteProvenance",
                        text="; ".join(problems),
                        values=values,
                    )
                else:
                    await workitems.transition(
                        conn,
                        self.clock,
                        self.ids,
                        item["id"],
                        src=Status.inProgress,
                        dst=Status.reviewQueued,
                        actor="system:turn",
                        action="completeTask",
                        text=summary,
                        values=values,
                    )
            except TransitionError:
                # Cancelled (or otherwise moved) while the turn ran: the text stays withheld.
                log.warning("work item %s left inProgress during the turn", item["id"])
        if not problems:
            self.on_review_queued()
        METRICS.turns.labels("gated").inc()
        return Gated(work_item_id=ctx.work_item_id, revision=ctx.revision)

    async def _store_message(
        self,
        conn: Conn,
        org_id: str,
        session_id: str,
        work_item_id: str | None,
        role: str,
        content: str,
        tool_name: str | None = None,
        *,
        gated: bool = False,
    ) -> str:
        message_id = self.ids.new("msg")
        await conn.execute(
            _INSERT_MESSAGE,
            {
                "id": message_id,
                "org_id": org_id,
                "session_id": session_id,
                "work_item_id": work_item_id,
                "role": role,
                "content": content,
                "lead_gated": gated,
                "tool_name": tool_name,
                "created_at": self.clock.now_ms(),
            },
        )
        return message_id


def provenance_problems(
    ctx: TurnContext,
    item: dict[str, Any],
    binding: dict[str, Any] | None,
    gated_message_id: str | None,
) -> list[str]:
    """What is missing or inconsistent in a submission's provenance (empty = complete)."""
    problems = []
    if not ctx.work_item_id or item["id"] != ctx.work_item_id:
        problems.append("work item id missing or inconsistent")
    if not ctx.session_id or item["session_id"] != ctx.session_id:
        problems.append("session missing or inconsistent")
    if binding is None or binding["session_id"] != item["session_id"]:
        problems.append("no active binding for the session")
    if not gated_message_id:
        problems.append("gated message id missing")
    return problems


async def visible_transcript(
    conn: AsyncConnection, org_id: str, session_id: str
) -> list[dict[str, Any]]:
    """The transcript as users may see it: leadGated rows are skipped."""
    m = t.messages.c
    rows = (
        await conn.execute(
            sa.select(m.id, m.role, m.content, m.created_at)
            .where(
                m.org_id == org_id,
                m.session_id == session_id,
                m.role.in_(["user", "assistant"]),
                sa.not_(m.lead_gated),
            )
            .order_by(m.created_at, m.id)
        )
    ).all()
    return [dict(r._mapping) for r in rows]
