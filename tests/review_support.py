"""Review-card test support: a Stack with the review notifier, the SLA runner and
scripted channels wired the way :mod:`leadgate.app` wires them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from leadgate.core.config import ReviewSettings
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Trigger
from leadgate.database import schema as t
from leadgate.review import destinations as dest
from leadgate.review.cards import ReviewNotifier
from leadgate.review.sla import SlaRunner
from outbox.channel import Card
from tests.helpers import Env, Org, api_trigger, make_agent, make_org, session_item
from tests.outbox_support import ScriptedChannel
from tests.stack import Stack

PUBLIC_URL = "https://leadgate.example"
REVIEW_CHANNEL = "C0REVIEW"
ESCALATION_CHANNEL = "C0ESCALATE"


@dataclass
class ReviewEnv:
    """A stack, its channels, the notifier and SLA runner, an org with a worker."""

    stack: Stack
    channels: dict[str, ScriptedChannel]
    notifier: ReviewNotifier
    sla: SlaRunner
    org: Org
    worker: dict[str, Any]

    @property
    def slack(self) -> ScriptedChannel:
        return self.channels["slack"]

    async def escalated(self, session: str, text: str = "hard #escalate #complete") -> str:
        """A work item of the worker that the lead escalated (awaitingHuman)."""
        await self.stack.turns.run(api_trigger(self.org, self.worker, text, session))
        await drain(self.stack.lead_runner)
        return await session_item(self.stack, session)

    async def deliveries(self, item_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        d = t.deliveries.c
        query = sa.select(t.deliveries).where(d.work_item_id == item_id)
        if kind is not None:
            query = query.where(d.kind == kind)
        async with self.stack.db.read() as conn:
            rows = (await conn.execute(query.order_by(d.created_at, d.id))).all()
        return [dict(r._mapping) for r in rows]

    async def episodes(self, item_id: str) -> list[dict[str, Any]]:
        e = t.review_episodes.c
        async with self.stack.db.read() as conn:
            rows = (
                await conn.execute(
                    sa.select(t.review_episodes)
                    .where(e.work_item_id == item_id)
                    .order_by(e.created_at, e.id)
                )
            ).all()
        return [dict(r._mapping) for r in rows]

    def posted_cards(self, channel: str = "slack") -> list[Card]:
        return [m.card for m in self.channels[channel].calls if m.card is not None]


async def review_env(
    make_stack: Callable[..., Stack],
    *,
    escalation: bool = True,
    **defaults: str,
) -> ReviewEnv:
    """A :class:`ReviewEnv`: Slack (notify: ``C0REVIEW``) and, with ``escalation``,
    Slack ``C0ESCALATE`` as the escalate tier; ``defaults`` are ``[review]`` values."""
    channels = {name: ScriptedChannel(name) for name in ("slack", "email", "teams", "discord")}
    stack = make_stack(channels=dict(channels))
    settings = ReviewSettings.model_validate(defaults)
    notifier = ReviewNotifier(
        stack.clock, stack.ids, stack.outbox, public_url=PUBLIC_URL, defaults=settings
    )
    stack.outbox.on_review_needed(notifier.open)
    sla = SlaRunner(stack.db, stack.clock, stack.ids, stack.outbox, notifier)
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    await add_destination(stack, org.id, "slack", f"T0001:{REVIEW_CHANNEL}")
    if escalation:
        await add_destination(stack, org.id, "slack", ESCALATION_CHANNEL, tier="escalate")
    return ReviewEnv(stack, channels, notifier, sla, org, worker)


async def add_destination(
    env: Env,
    org_id: str,
    channel: str,
    target: str,
    *,
    tier: str = "notify",
    agent_id: str | None = None,
) -> dest.Destination:
    """``leadgate notify add`` in a test."""
    async with env.db.tx() as conn:
        return await dest.add_destination(
            conn,
            env.clock,
            env.ids,
            org_id=org_id,
            agent_id=agent_id,
            channel=channel,
            target=target,
            tier=tier,
        )


def slack_trigger(env: ReviewEnv, text: str, thread: str = "1.1") -> Trigger:
    """A message of the worker's from a Slack thread (its answer is posted by the relay)."""
    return Trigger(
        org_id=env.org.id,
        agent_id=env.worker["id"],
        session_key=f"slack:T1:C9:{thread}",
        text=text,
        binding=BindingSpec(
            BindingKind.slack, {"team": "T1", "channel": "C9", "thread_ts": thread}
        ),
    )


def reply_rows(
    org_id: str, item_id: str, statuses: list[str], now: int, prefix: str
) -> list[dict[str, Any]]:
    """Rows of API reply deliveries of ``item_id`` to insert at once, one per status,
    ``<prefix><i>`` made at ``now + i``: a long delivery history without running
    its sends."""
    return [
        {
            "id": f"{prefix}{i}",
            "org_id": org_id,
            "work_item_id": item_id,
            "kind": "reply",
            "action": "post",
            "channel": "api",
            "address": {},
            "text": "t",
            "status": status,
            "attempts": 1,
            "next_attempt_at": now + i,
            "created_at": now + i,
            "updated_at": now + i,
        }
        for i, status in enumerate(statuses)
    ]
