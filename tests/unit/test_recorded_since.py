"""Where a Discord (and a Slack) catch-up starts (``binding.bindings.recorded_since``, read at each
gateway READY): every session that ever took in a gateway message, found one index seek
each, with the gateway messages it took in within the window; nothing of the other
channels' events, nor of a Discord slash command's."""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa

from binding import bindings
from binding.bindings import recorded_since
from leadgate.core.types import DISCORD_MESSAGE_EVENT as DISCORD
from leadgate.core.types import SLACK_MESSAGE_EVENT as SLACK
from leadgate.database import schema as t
from tests.stack import Stack

NOW = 10_000_000
SINCE = NOW - 3_600_000
OLD, RECENT = SINCE - 1, SINCE
_EVENT_IDS = itertools.count()


def _session(n: int, key: str, agent: str = "agt_1") -> dict[str, object]:
    return {"id": f"ses_{n:02d}", "org_id": "org_1", "agent_id": agent, "key": key}


def _event(session: int, event_id: str | None, at: int) -> dict[str, object]:
    return {
        "id": f"evt_{next(_EVENT_IDS)}",
        "org_id": "org_1",
        "agent_id": "agt_1",
        "session_id": f"ses_{session:02d}",
        "work_item_id": None,
        "outcome": "accepted",
        "content": "x",
        "external_event_id": event_id,
        "created_at": at,
    }


async def test_each_gateway_session_once_with_its_messages_of_the_window(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = [
        _session(1, "discord:1:10"),
        _session(2, "discord:1:10", agent="agt_2"),  # a second agent in that channel
        _session(3, "discord:@me:30"),  # only old messages: caught up from the window
        _session(4, "discord:1:40"),  # slash commands only: not a gateway session
        _session(5, "slack:T1:C1"),
        _session(6, "api:key_1:u"),
        # Many sessions between them, each its own seek.
        *(_session(n, f"discord:2:{n}") for n in range(10, 40)),
    ]
    events = [
        _event(1, "discord:message:100", OLD),
        _event(1, "discord:message:101", RECENT),
        _event(2, "discord:message:102", NOW),
        _event(3, "discord:message:300", OLD),
        _event(4, "discord:interaction:400", NOW),
        _event(5, "slack:T1:C1:1.1", NOW),
        _event(6, "discord:message:is-not-a-gateway-session", NOW),  # (keys filter it)
        _event(6, None, NOW),
        *(_event(n, f"discord:message:{n}000", NOW if n % 2 else OLD) for n in range(10, 40)),
    ]
    async with stack.db.tx() as conn:
        await conn.execute(
            t.sessions.insert(),
            [{**s, "created_at": 0, "event_seq": 0, "watched_until": 0} for s in sessions],
        )
        await conn.execute(t.inbound_events.insert(), events)
    async with stack.db.read() as conn:
        found = await recorded_since(conn, DISCORD, "discord:", SINCE)
    assert found == {
        "discord:1:10": ("discord:message:101", "discord:message:102"),
        "discord:@me:30": (),
        **{f"discord:2:{n}": (f"discord:message:{n}000",) if n % 2 else () for n in range(10, 40)},
    }
    # The sessions' recent events read a few sessions at a time: the same.
    monkeypatch.setattr(bindings, "_SESSIONS_PER_READ", 7)
    async with stack.db.read() as conn:
        assert await recorded_since(conn, DISCORD, "discord:", SINCE) == found
        assert await recorded_since(conn, DISCORD, "discord:@me:", SINCE) == {"discord:@me:30": ()}
        assert await recorded_since(conn, DISCORD, "discord:", NOW + 1) == {k: () for k in found}
        # Slack's catch-up reads Slack's events alone (its own index).
        assert await recorded_since(conn, SLACK, "slack:", SINCE) == {
            "slack:T1:C1": ("slack:T1:C1:1.1",)
        }
    async with stack.db.tx() as conn:
        await conn.execute(sa.delete(t.inbound_events))
    async with stack.db.read() as conn:
        assert await recorded_since(conn, DISCORD, "discord:", SINCE) == {}
