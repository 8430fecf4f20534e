"""The benches' floors: ``bench.floor_server`` (``bench_rest --only floor``) must write what
a plain turn writes (a user message, a reply, an event each, in order), and the relay's
floor (``bench_outbox --floor``) must post every delivery once and mark it sent, or
their figures are not floors of the same work."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bench.floor_server import TOKEN, Floor


@pytest.fixture
def database(tmp_path: Path) -> str:
    from leadgate.database.db import upgrade

    path = tmp_path / "floor.db"
    upgrade(f"sqlite+aiosqlite:///{path}")
    return str(path)


async def test_each_turn_writes_its_message_reply_and_events_and_answers_the_echo(
    database: str,
) -> None:
    floor = Floor(database)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", floor.completions)
    async with TestClient(TestServer(app)) as client:

        async def turn(session: str, text: str, token: str = TOKEN) -> tuple[int, str]:
            body = {"model": "plain", "messages": [{"role": "user", "content": text}]}
            headers = {"Authorization": token, "X-Session-Id": session}
            async with client.post("/v1/chat/completions", json=body, headers=headers) as resp:
                return resp.status, await resp.text()

        assert (await turn("a", "no", token="Bearer other"))[0] == 401
        answers = await asyncio.gather(turn("a", "one"), turn("a", "two"), turn("b", "three"))
        assert [status for status, _ in answers] == [200, 200, 200]
        assert json.loads(answers[2][1])["choices"][0]["message"]["content"] == "Echo: three"

    conn = sqlite3.connect(database)
    rows = conn.execute(
        "SELECT s.key, m.role, m.content, e.seq FROM messages m"
        " JOIN sessions s ON s.id = m.session_id"
        " JOIN session_events e ON e.message_id = m.id ORDER BY s.key, e.seq"
    ).fetchall()
    a = [(role, content, seq) for key, role, content, seq in rows if key == "a"]
    assert [seq for *_, seq in a] == [1, 2, 3, 4]
    assert sorted(content for role, content, _ in a if role == "user") == ["one", "two"]
    assert sorted(content for role, content, _ in a if role == "assistant") == [
        "Echo: one",
        "Echo: two",
    ]
    assert [(r[1], r[2], r[3]) for r in rows if r[0] == "b"] == [
        ("user", "three", 1),
        ("assistant", "Echo: three", 2),
    ]
    # Nothing left open: every write was committed by its group.
    assert not floor.open and not floor.waiters


async def test_the_relay_floor_posts_every_delivery_once_and_marks_it_sent(
    tmp_path: Path,
) -> None:
    from bench.bench_outbox import Standin, floor_rate_sqlite

    standin = Standin()
    try:
        # A batch smaller than the concurrency, which is smaller than the deliveries:
        # several claims and outcome groups. The function checks the stand-in's posts
        # (each text once) and the rows (all sent) itself, and raises SystemExit if not.
        rate = await floor_rate_sqlite(standin, tmp_path, 40, 0, 7, 5)
        assert rate > 0
        assert len(standin.posts()) == 40
    finally:
        standin.stop()
