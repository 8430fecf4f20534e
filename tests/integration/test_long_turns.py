"""A recorded turn that runs longer than its run lease (``RUN_LEASE_MS``, 15 minutes),
in a process alive and beating, through two real apps on one database (both backends):
``runner``, whose turn is held in its model call (:class:`~tests.fakes.GateProvider`),
and ``other``, a worker whose turn recovery looks for runs to take over (its model under
the same name answers ``Echo: <text>``, so a rerun would show).

Nothing renewed such a run's lease while its turn ran: turn recovery took it over as a
stalled turn's and ran the channel turn again (the live turn's fenced last transaction
then rolled back: the model call and any tool's effects spent twice), or closed a REST
client run while its turn was still running. The heartbeat now renews the leases of the
runs its process's turns are running; a run whose turn is gone is not renewed and is
taken over when its lease lapses, as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from leadgate.app import App
from leadgate.core.clock import MINUTE_MS, FakeClock
from leadgate.core.runners import drain
from leadgate.core.types import Reply
from leadgate.database import schema as t
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns import runs
from leadgate.turns.intake import Accepted
from leadgate.turns.providers.script import ScriptProvider
from tests.fakes import GateProvider
from tests.helpers import Org, eventually, make_agent, make_org, slack_trigger
from tests.serving import Client, served_app


@dataclass
class Two:
    """The app running the held turn, the worker looking for runs, and their clock."""

    runner: App
    runner_client: Client
    other: App
    gate: GateProvider
    org: Org
    slow: dict[str, Any]
    clock: FakeClock

    async def beat_for(self, ms: int) -> None:
        """``ms`` pass, both processes beating every 5 minutes (as live ones do, far
        more often) and reaping nobody (both are alive)."""
        for _ in range(ms // (5 * MINUTE_MS)):
            self.clock.advance(5 * MINUTE_MS)
            await self.runner.liveness.beat()
            await self.other.liveness.beat()

    async def recovered(self) -> int:
        """How many claims the worker's turn recovery made."""
        return await drain(TurnRecovery(self.other.turns))

    async def table(self, table: sa.Table, *where: sa.ColumnElement[bool]) -> list[str]:
        """The ``text`` of reply deliveries, or the ids of turn runs."""
        column = table.c.text if table is t.deliveries else table.c.id
        async with self.other.db.read() as conn:
            return list((await conn.execute(sa.select(column).where(*where))).scalars())


@asynccontextmanager
async def two(url: str) -> AsyncIterator[Two]:
    """Both apps on ``url`` (one clock), registered, with agents ``slow`` (plain) and
    ``gated`` (a worker of lead ``lead``), both on the held model in ``runner``."""
    gate = GateProvider()
    clock = FakeClock()
    async with (
        served_app(url, providers={"script": ScriptProvider(), "gate": gate}, clock=clock) as (
            runner,
            runner_client,
        ),
        served_app(
            url, providers={"script": ScriptProvider(), "gate": ScriptProvider()}, clock=clock
        ) as (other, _other_client),
    ):
        org = await make_org(other)
        slow = await make_agent(other, org, "slow", model="gate")
        await make_agent(other, org, "lead")
        await make_agent(other, org, "gated", model="gate", lead="lead")
        await runner.start_liveness("api")
        await other.start_liveness("worker")
        try:
            yield Two(runner, runner_client, other, gate, org, slow, clock)
        finally:
            gate.release.set()


async def test_a_channel_turn_longer_than_its_run_lease_is_run_once(migrated_url: str) -> None:
    """Its model call outlasts the 15-minute lease: the heartbeat renewed it, so the
    worker's recovery takes nothing, and the live turn's reply is the one queued. It
    was taken over and rerun (``Echo: hi`` queued), the live turn's reply rolled back."""
    async with two(migrated_url) as env:
        trigger = slack_trigger(env.org, env.slow, "hi", "1.1")
        turn = asyncio.ensure_future(env.runner.turns.run(trigger))
        await eventually(lambda: env.gate.calls == 1, what="the model called")
        await env.beat_for(runs.RUN_LEASE_MS + 5 * MINUTE_MS)
        assert await env.recovered() == 0
        assert len(await env.table(t.turn_runs)) == 1  # still the live turn's
        env.gate.release.set()
        assert isinstance(await turn, Reply)
        assert await env.table(t.deliveries, t.deliveries.c.kind == "reply") == ["slow answer"]
        assert await env.table(t.turn_runs) == []
        assert env.gate.calls == 1


async def test_a_gated_rest_turn_longer_than_its_run_lease_keeps_its_run(
    migrated_url: str,
) -> None:
    """A REST turn of a worker with a lead outlasts its lease: its run stays its own
    (it was closed while the turn ran, as a stalled turn's: had the process died then,
    nothing would have answered the message) and the turn answers once."""
    async with two(migrated_url) as env:
        headers = {"Authorization": f"Bearer {env.org.key}", "X-Session-Id": "s"}
        body = {"model": "gated", "messages": [{"role": "user", "content": "hi"}]}
        request = asyncio.ensure_future(
            env.runner_client.post("/v1/chat/completions", json=body, headers=headers)
        )
        await eventually(lambda: env.gate.calls == 1, what="the model called")
        await env.beat_for(runs.RUN_LEASE_MS + 5 * MINUTE_MS)
        assert await env.recovered() == 0
        assert len(await env.table(t.turn_runs)) == 1
        env.gate.release.set()
        resp = await request
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "slow answer"
        assert await env.table(t.turn_runs) == []
        env.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await env.recovered() == 0
        assert env.gate.calls == 1


async def test_a_run_whose_turn_is_gone_is_taken_over_though_its_process_beats(
    migrated_url: str,
) -> None:
    """A stalled turn: its run was recorded and nothing runs it in its live process (no
    renewal), so its lease lapses 15 minutes on and recovery reruns it (a channel's)."""
    async with two(migrated_url) as env:
        taken = await env.runner.turns.take(slack_trigger(env.org, env.slow, "hi", "2.1"))
        assert isinstance(taken, Accepted)
        await env.beat_for(runs.RUN_LEASE_MS - 5 * MINUTE_MS)
        assert await env.recovered() == 0  # its lease has 5 minutes left
        await env.beat_for(5 * MINUTE_MS)
        env.clock.advance(1)
        assert await env.recovered() == 1
        assert await env.table(t.deliveries, t.deliveries.c.kind == "reply") == ["Echo: hi"]
