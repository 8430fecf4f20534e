"""Several relays on one PostgreSQL, and the LISTEN/NOTIFY wake-up.

* three relay processes (``python -m tests.relay_proc``, each its own engine and
  LISTEN connection) drain 2,000 approved deliveries to the Slack stand-in process:
  every one posted exactly once (the stand-in's own record), none left pending;
* a delivery committed by another connection wakes a relay loop whose poll interval is
  long, within about 100 ms; the listener survives losing its connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.app import App
from leadgate.core.clock import FakeClock, RandomIds, SystemClock
from leadgate.core.config import Settings
from leadgate.database import schema as t
from leadgate.database.db import Database
from outbox.channel import OutboundMessage, Sent
from outbox.store import NOTIFY_CHANNEL, Outbox
from tests.helpers import eventually, start_worker
from tests.outbox_support import (
    MigratedTemplates,
    RelayProcess,
    ScriptedChannel,
    StandinProcess,
    binding_row,
    delivery_counts,
    make_org_and_agents,
    seed_items,
)

N = 2_000
REPLICAS = 3


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplates:
    return MigratedTemplates(tmp_path_factory.mktemp("outbox-replica-templates"))


@pytest.fixture
def url(postgres_server: Any, templates: MigratedTemplates) -> str:
    return templates.pg_url(postgres_server)


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    proc = StandinProcess()
    yield proc
    proc.stop()


async def test_three_relay_processes_drain_2000_exactly_once(
    url: str, standin: StandinProcess
) -> None:
    db = Database(url)
    clock = SystemClock()
    relays = [
        RelayProcess(url, standin.api_url, batch=50, concurrency=32, poll_s=30)
        for _ in range(REPLICAS)
    ]
    try:
        # Due only in an hour: nobody starts before every replica listens.
        later = clock.now_ms() + 3_600_000
        seeded = await seed_items(db, clock, RandomIds(), N, next_attempt_at=later)
        for relay in relays:
            relay.wait_ready()
        started = time.perf_counter()
        async with db.tx() as conn:
            released = await conn.execute(
                t.deliveries.update()
                .where(t.deliveries.c.status == "pending")
                .values(next_attempt_at=clock.now_ms())
            )
            assert released.rowcount == N
            await conn.execute(sa.text(f"SELECT pg_notify('{NOTIFY_CHANNEL}', '')"))
        deadline = time.monotonic() + 60
        while True:
            counts = await delivery_counts(db)
            if counts.get("sent") == N or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
        stats = [relay.stop() for relay in relays]
    finally:
        for relay in relays:
            if relay.proc.poll() is None:
                relay.kill()
    try:
        counts = await delivery_counts(db)
        assert counts == {"sent": N}, counts
        posted = Counter(p["text"] for p in standin.posts())
        assert len(posted) == N and max(posted.values()) == 1
        assert set(posted) == {d["text"] for d in seeded.deliveries}
        per_relay = [s.get("sent", 0) for s in stats]
        assert sum(per_relay) == N
        assert sum(1 for n in per_relay if n > 0) >= 2, per_relay
        async with db.read() as conn:
            completed = await conn.scalar(
                sa.select(sa.func.count()).where(t.work_items.c.status == "completed")
            )
        assert completed == N
        print(f"\n{N} deliveries by {REPLICAS} relays in {elapsed:.2f} s: {per_relay}")
    finally:
        await db.close()


# ------------------------------------------------------------------- LISTEN/NOTIFY


#: Woken by NOTIFY, not by the 30 s poll: a tenth of it. A wake-up takes milliseconds on
#: an idle machine, but 0.1 s (the fastest of three), 0.5 s and 1 s were within reach of
#: a loaded 2-CPU machine running two test workers, each with its own PostgreSQL.
WOKEN_S = 3.0


@pytest.fixture
async def looping(url: str) -> AsyncIterator[tuple[App, ScriptedChannel, asyncio.Queue[float]]]:
    """A Service on PostgreSQL with its runner loops started and a 30 s poll: only a
    NOTIFY can wake its relay quickly. The queue receives the time of each send."""
    sends: asyncio.Queue[float] = asyncio.Queue()

    def record(_: OutboundMessage) -> Sent:
        sends.put_nowait(time.perf_counter())
        return Sent("x")

    channel = ScriptedChannel("slack", script=[record] * 10)
    settings = Settings.model_validate(
        {"database": {"url": url}, "runners": {"poll_interval_s": 30}}
    )
    service = App(settings, clock=FakeClock(), channels={"slack": channel}, enable_adapters=False)
    await start_worker(service)
    yield service, channel, sends
    await service.stop()


async def enqueue_elsewhere(url: str, org_id: str, clock: FakeClock) -> float:
    """Commit a reply delivery through another engine; returns the commit time."""
    other = Database(url)
    try:
        async with other.tx() as conn:
            await Outbox(clock, RandomIds()).enqueue_reply(
                conn,
                org_id=org_id,
                binding=binding_row("bnd_elsewhere", address={"channel": "C1"}),
                text="from another replica",
            )
        return time.perf_counter()
    finally:
        await other.close()


async def test_notify_from_another_connection_wakes_the_relay(
    url: str, looping: tuple[App, ScriptedChannel, asyncio.Queue[float]]
) -> None:
    service, _, sends = looping
    assert isinstance(service.clock, FakeClock)
    org_id, _, _ = await make_org_and_agents(service.db, service.clock, service.ids)
    latencies = []
    for _ in range(3):
        committed = await enqueue_elsewhere(url, org_id, service.clock)
        sent = await asyncio.wait_for(sends.get(), timeout=WOKEN_S)
        latencies.append(sent - committed)
    print(f"\nNOTIFY wake-up latencies: {[f'{x * 1000:.1f} ms' for x in latencies]}")
    assert max(latencies) < WOKEN_S, latencies


async def test_listener_reconnects_after_losing_its_connection(
    url: str, looping: tuple[App, ScriptedChannel, asyncio.Queue[float]]
) -> None:
    service, _, sends = looping
    assert isinstance(service.clock, FakeClock)
    org_id, _, _ = await make_org_and_agents(service.db, service.clock, service.ids)
    changes = service.db.table_changes
    assert changes is not None
    before = changes.token(("agents",))
    async with service.db.tx() as conn:
        killed = await conn.scalar(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN%' "
                "AND pid <> pg_backend_pid()"
            )
        )
    assert killed == 1  # the one listener: the outbox's and the lead runners' channels

    def reconnected() -> bool:  # its token changes when the connection goes and comes
        token = changes.token(("agents",))
        return token is not None and token != before

    await eventually(reconnected, 10)
    committed = await enqueue_elsewhere(url, org_id, service.clock)
    sent = await asyncio.wait_for(sends.get(), timeout=WOKEN_S)
    assert sent - committed < WOKEN_S


async def test_a_submission_on_another_replica_wakes_this_lead_runner(
    url: str, looping: tuple[App, ScriptedChannel, asyncio.Queue[float]]
) -> None:
    """An API replica's submission reaches a worker replica's lead runner through
    NOTIFY, not at its next poll (30 s here): the item is reviewed within :data:`WOKEN_S`."""
    from leadgate.core.types import Gated
    from tests.helpers import api_trigger, make_agent, make_org
    from tests.stack import build_stack

    service, _, _ = looping
    api_replica = build_stack(url)
    try:
        org = await make_org(api_replica, name=f"replicas-{time.monotonic_ns()}")
        await make_agent(api_replica, org, "lead")
        worker = await make_agent(api_replica, org, "worker", lead="lead")
        outcome = await api_replica.turns.run(api_trigger(org, worker, "do it #complete"))
        assert isinstance(outcome, Gated)
        submitted = time.perf_counter()
        while True:
            async with service.db.read() as conn:
                status = await conn.scalar(
                    sa.select(t.work_items.c.status).where(
                        t.work_items.c.id == outcome.work_item_id
                    )
                )
            if status not in ("reviewQueued", "reviewing") or time.perf_counter() - submitted > 15:
                break
            await asyncio.sleep(0.02)
        reviewed_after = time.perf_counter() - submitted
    finally:
        await api_replica.stop()
    assert status in ("approved", "completed"), status
    assert reviewed_after < WOKEN_S, reviewed_after
