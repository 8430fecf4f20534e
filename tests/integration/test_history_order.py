"""A session's messages in the order the database took them, whatever the clocks of the
replicas that took them (two PostgreSQL replicas on one database, their clocks 2 s
apart): the window a worker's model sees and the transcript."""

from __future__ import annotations

from typing import Any

import pytest

from leadgate.core.clock import FakeClock
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.script import ScriptProvider
from tests.helpers import make_agent, make_org
from tests.serving import Client, served_app


async def _say(client: Client, key: str, text: str) -> str:
    """Send ``text`` in session ``s`` of agent ``plain``; the answer's text."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "s"}
    body = {"model": "plain", "messages": [{"role": "user", "content": text}]}
    resp = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return str(answer["choices"][0]["message"]["content"])


@pytest.mark.parametrize("skew_ms", [-2_000, 2_000], ids=["2s-behind", "2s-ahead"])
async def test_a_session_is_in_the_order_its_messages_were_taken_across_skewed_replicas(
    migrated_pg: str, skew_ms: int
) -> None:
    """PostgreSQL (SQLite's processes share one host's clock, each reading it inside
    its write transaction: leadgate.domain.session_events). "first" through one
    replica, then "second" through another whose clock is
    ``skew_ms`` from the first's: the second turn's model sees "second" as the newest
    message (the script provider echoes it), and the transcript, read through either
    replica, shows the exchanges in the order they were taken. By the replicas' clocks
    a message taken later by the replica behind sorted before the earlier one."""
    clock = FakeClock()
    other_clock = FakeClock(clock.now_ms() + skew_ms)
    providers: dict[str, Provider] = {"script": ScriptProvider()}
    async with (
        served_app(migrated_pg, providers=providers, clock=clock) as (service, here),
        served_app(migrated_pg, providers=providers, clock=other_clock) as (_, there),
    ):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        assert await _say(here, org.key, "first") == "Echo: first"
        other_clock.advance(1)
        assert await _say(there, org.key, "second") == "Echo: second"
        clock.advance(1)
        assert await _say(here, org.key, "third") == "Echo: third"
        taken = [
            ("user", "first"),
            ("assistant", "Echo: first"),
            ("user", "second"),
            ("assistant", "Echo: second"),
            ("user", "third"),
            ("assistant", "Echo: third"),
        ]
        for client in (here, there):
            resp = await client.get(
                "/v1/agents/plain/sessions/s/messages",
                headers={"Authorization": f"Bearer {org.key}"},
            )
            assert resp.status == 200, await resp.text()
            shown = [(m["role"], m["content"]) for m in (await resp.json())["data"]]
            assert shown == taken
