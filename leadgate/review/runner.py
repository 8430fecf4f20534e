"""The lead review runner (SPEC 4).

Claims ``reviewQueued`` items with a fenced 20-minute lease, gives the lead model a
server-built envelope and exactly three tools, and commits the verdict through
:func:`review.decisions.commit_verdict` fenced by the lease token, so a runner that lost
its lease (another replica re-claimed the item after expiry) cannot commit anything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import sqlalchemy as sa

from leadgate.core.clock import MINUTE_MS, Clock, IdFactory
from leadgate.core.errors import ModelError, NotFound, TransitionError, Unavailable
from leadgate.core.metrics import METRICS
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import workitems
from leadgate.domain.processes import owner_gone
from leadgate.domain.rows import WorkItem
from leadgate.domain.workitems import Status
from leadgate.review.decisions import Verdict, commit_verdict
from leadgate.turns.providers.base import (
    ChatMessage,
    ModelRequest,
    Provider,
    TextDelta,
    ToolCall,
    ToolSpec,
)
from leadgate.turns.providers.registry import ProviderRegistry
from outbox.store import Outbox

log = logging.getLogger("leadgate.review")

LEASE_MS = 20 * MINUTE_MS
MAX_EXPIRIES = 3
MAX_EXECUTIONS = 4
W = t.work_items.c

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
        on_verdict: Callable[[], None] = lambda: None,
        owner: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.providers = providers
        self.outbox = outbox
        # Wakes the relay (approval) and the revision dispatcher (changes requested).
        self.on_verdict = on_verdict
        #: this process (``lease_owner`` of its review leases; see domain.processes)
        self.owner = owner
        #: (item id, lease token) of claimed items to give back to the queue
        self._held: list[tuple[str, str | None]] = []
        #: lease tokens of claims whose commit may or may not have landed
        self._uncertain: list[str] = []

    async def expire_leases(self) -> int:
        """Return items whose review lease expired, or whose holder is known dead
        (:mod:`leadgate.domain.processes`: taken back at once), to the queue (the 3rd
        time: a human)."""
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            rows = (
                await conn.execute(
                    sa.select(W.id, W.lease_token, W.lease_expiries).where(
                        W.status == Status.reviewing.value,
                        sa.or_(W.lease_expires_at < now, owner_gone(W.lease_owner)),
                    )
                )
            ).all()
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
        return len(rows)

    async def claim(self) -> WorkItem | None:
        """Claim the oldest queued item; ``None`` when the queue is empty."""
        now = self.clock.now_ms()
        token = self.ids.new("lease")
        try:
            async with self.db.tx() as conn:
                item_id = await conn.scalar(
                    self.db.skip_locked(
                        sa.select(W.id)
                        .where(W.status == Status.reviewQueued.value)
                        .order_by(W.updated_at, W.id)
                        .limit(1)
                    )
                )
                if item_id is None:
                    return None
                try:
                    return await workitems.transition(
                        conn,
                        self.clock,
                        self.ids,
                        item_id,
                        src=Status.reviewQueued,
                        dst=Status.reviewing,
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
        except Exception:
            # The connection may have dropped after the COMMIT reached the server: the
            # claim may stand. Give back whatever holds this token once the database is
            # back, rather than leave it reviewing for the whole lease.
            self._uncertain.append(token)
            raise

    async def run_once(self) -> bool:
        """Expire leases, then claim and review one item. True when it did work."""
        await self._release_held()
        await self.expire_leases()
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
            self._held.append(
                (item.id, item.lease_token)
            )  # the lead's reads failed: review it again later
            raise
        METRICS.reviews.labels(verdict.value if why is None else "escalatedBySystem").inc()
        try:
            async with self.db.tx() as conn:
                try:
                    await commit_verdict(
                        conn,
                        self.outbox,
                        item,
                        verdict,
                        actor=f"lead:{item.lead_agent_id}",
                        feedback=feedback if why is None else why,
                        src=Status.reviewing,
                        lease_token=item.lease_token,
                    )
                except TransitionError:
                    log.warning("lost the review lease of %s; verdict dropped", item.id)
                    return
        except Unavailable:
            # The verdict could not be stored (database down): give the item back to the
            # queue as soon as the database is back, instead of holding its 20-minute
            # lease while alive.
            self._held.append((item.id, item.lease_token))
            raise
        self.on_verdict()

    async def _release_held(self) -> None:
        """Return items whose verdict could not be committed to ``reviewQueued``."""
        while self._uncertain:
            token = self._uncertain.pop(0)
            try:
                async with self.db.read() as conn:
                    item_id = await conn.scalar(
                        sa.select(W.id).where(
                            W.lease_token == token, W.status == Status.reviewing.value
                        )
                    )
            except Exception:
                self._uncertain.append(token)
                raise
            if item_id is not None:
                self._held.append((item_id, token))
        while self._held:
            # Several review loops share this list: take the item first.
            held = self._held.pop(0)
            try:
                await self._release(*held)
            except Exception:
                self._held.append(held)
                raise

    async def _release(self, item_id: str, lease_token: str | None) -> None:
        """Give one held item back to the queue (fenced by its lease)."""
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
                    text="the verdict could not be stored; the review runs again",
                    lease_token=lease_token,
                    values={"lease_token": None, "lease_expires_at": None, "lease_owner": None},
                )
            except TransitionError:
                pass  # taken back or moved meanwhile

    async def _decide(self, item: WorkItem) -> tuple[Verdict, str | None, str | None]:
        """(verdict, the lead's feedback, why the system escalated instead or None)."""
        async with self.db.read() as conn:
            try:
                lead = await agents_mod.find_agent(conn, item.org_id, item.lead_agent_id)
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
                log.warning("lead execution %d failed: %s", execution, exc)
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
