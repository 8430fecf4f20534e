"""The parts unit tests drive, built straight from their modules (no composition root).

A unit test exercises one module against its real database; :class:`Stack` holds that
database, a :class:`FakeClock` and the few collaborators the turn path, the lead runner
and the relay need, wired the way :mod:`leadgate.app` wires them but without surfaces,
adapters or background loops (drive runners with :func:`leadgate.core.runners.drain`).
``wakes`` records the wake-up callables the components were given.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from leadgate.core.clock import FakeClock, IdFactory, RandomIds
from leadgate.database.db import Database
from leadgate.flows.runs import FlowService
from leadgate.review.runner import LeadRunner
from leadgate.turns.path import TurnService
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.registry import ProviderRegistry
from leadgate.turns.providers.script import ScriptProvider
from outbox.channel import Channel
from outbox.relay import Relay
from outbox.store import OUTBOX_TOPIC, Outbox


@dataclass
class Stack:
    """Database, clock, ids and the turn path / lead runner / relay / flows on them."""

    db: Database
    clock: FakeClock
    ids: IdFactory
    providers: ProviderRegistry
    outbox: Outbox
    turns: TurnService
    lead_runner: LeadRunner
    relay: Relay
    flows: FlowService
    channels: dict[str, Channel] = field(default_factory=dict)
    wakes: dict[str, asyncio.Event] = field(default_factory=dict)

    def wake(self, name: str) -> None:
        """Record a wake-up (the app would wake the runner of that name)."""
        self.wakes.setdefault(name, asyncio.Event()).set()

    async def stop(self) -> None:
        """Close providers and the database."""
        await self.providers.close()
        await self.db.close()


def build_stack(
    url: str,
    *,
    providers: dict[str, Provider] | None = None,
    channels: dict[str, Channel] | None = None,
    clock: FakeClock | None = None,
    ids: IdFactory | None = None,
) -> Stack:
    """A :class:`Stack` on the migrated database at ``url``."""
    db = Database(url)
    clock = clock or FakeClock()
    ids = ids or RandomIds()
    registry = ProviderRegistry(providers or {"script": ScriptProvider()})
    outbox = Outbox(clock, ids)
    wakes: dict[str, asyncio.Event] = {}

    def waker(name: str) -> object:
        return lambda: wakes.setdefault(name, asyncio.Event()).set()

    turns = TurnService(
        db,
        clock,
        ids,
        registry,
        outbox,
        on_review_queued=waker("lead-review"),  # type: ignore[arg-type]
        on_delivery_queued=waker("outbox-relay"),  # type: ignore[arg-type]
    )
    verdict_wake = waker("verdict")
    lead = LeadRunner(db, clock, ids, registry, outbox, on_verdict=lambda v: verdict_wake())  # type: ignore[operator]
    channels = dict(channels or {})
    # As in the app: a gating delivery that becomes deliveryUnknown asks the outbox's
    # review hook for cards (a no-op until a test sets one with on_review_needed).
    relay = Relay(db, clock, ids, channels, review_needed=outbox.review_needed)
    # As in the app: every committed enqueue pokes the relay.
    db.on_commit(OUTBOX_TOPIC, relay.poke)
    relay.poked_on_enqueue = True
    flows = FlowService(db, clock, ids, turns)
    return Stack(db, clock, ids, registry, outbox, turns, lead, relay, flows, channels, wakes)
