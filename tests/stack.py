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
from leadgate.core.runners import drain
from leadgate.database.db import Database
from leadgate.database.pg import CHANGES_CHANNEL
from leadgate.flows.runs import FlowService
from leadgate.review.decisions import ended_by_flow
from leadgate.review.runner import LeadRunner
from leadgate.runners.revisions import RevisionRunner
from leadgate.turns.path import TurnService
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.registry import ProviderRegistry
from leadgate.turns.providers.script import ScriptProvider
from outbox.channel import Channel
from outbox.relay import Relay
from outbox.store import OUTBOX_TOPIC, Outbox, listen_all


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

    #: PostgreSQL, after :meth:`listen_for_changes`: the table names heard, in order
    heard: asyncio.Queue[str] | None = None
    _listening: tuple[asyncio.Event, asyncio.Task[None]] | None = None

    def wake(self, name: str) -> None:
        """Record a wake-up (the app would wake the runner of that name)."""
        self.wakes.setdefault(name, asyncio.Event()).set()

    async def listen_for_changes(self) -> None:
        """PostgreSQL: LISTEN for changes of agents, presets and policy rules as the
        service does (``App._listen``), so the intake keeps them between turns; returns
        once listening. No-op on SQLite."""
        changes = self.db.table_changes
        if changes is None or self._listening is not None:
            return
        heard: asyncio.Queue[str] = asyncio.Queue()
        self.heard = heard

        def notified(payload: str) -> None:
            changes.notified(payload)
            heard.put_nowait(payload)

        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            listen_all(
                self.db.url,
                {CHANGES_CHANNEL: notified},
                stop,
                on_connect=[changes.connected],
                on_lost=[changes.lost],
                ready=ready.set,
            )
        )
        self._listening = (stop, task)
        await asyncio.wait_for(ready.wait(), timeout=10)

    async def heard_of(self, table: str) -> None:
        """PostgreSQL: wait (bounded) until this process heard of a change of ``table``
        committed by another connection. No-op when not listening (SQLite's
        ``data_version`` knows at once)."""
        if self.heard is None:
            return
        while True:
            payload = await asyncio.wait_for(self.heard.get(), timeout=10)
            name, _, sender = payload.partition(" ")
            if name == table and sender != self.db.notify_tag:
                return

    async def settle(self, *, relay: bool = False) -> None:
        """Run lead reviews and revision turns (with ``relay``, the relay too) until none
        has work."""
        revisions = RevisionRunner(self.turns)
        for _ in range(50):
            worked = await drain(self.lead_runner) + await drain(revisions)
            if relay:
                worked += await drain(self.relay)
            if not worked:
                return
        raise AssertionError("the runners never settled")

    async def stop(self) -> None:
        """Stop listening; close providers and the database."""
        if self._listening is not None:
            stop, task = self._listening
            self._listening = None
            stop.set()
            await task
        await self.providers.close()
        await self.db.close()


def build_stack(
    url: str,
    *,
    providers: dict[str, Provider] | None = None,
    channels: dict[str, Channel] | None = None,
    clock: FakeClock | None = None,
    ids: IdFactory | None = None,
    statements_alone: bool = True,
) -> Stack:
    """A :class:`Stack` on the migrated database at ``url`` (``statements_alone``: see
    :attr:`Database.statements_alone`)."""
    db = Database(url, statements_alone=statements_alone)
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
    flows.item_ended = lambda conn, item_id: ended_by_flow(conn, outbox, item_id)
    return Stack(db, clock, ids, registry, outbox, turns, lead, relay, flows, channels, wakes)
