"""The session read surfaces (SPEC 13) through a real aiohttp server on 127.0.0.1, on
SQLite and PostgreSQL: the transcript route (paging, visible rows, one session namespace,
404 across organizations) and the review-status SSE stream (pending -> message ->
delivered, Last-Event-ID resumes without loss or repeat, heartbeats, a reader that stops
reading is dropped, shutdown ends streams). Runners are drained by hand (FakeClock)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient

from leadgate.app import App
from leadgate.core.auth import Scope
from leadgate.core.clock import FakeClock
from leadgate.core.errors import Unavailable
from leadgate.core.runners import drain
from leadgate.domain import orgs
from leadgate.operations.transcripts import PAGE_MAX, PAGE_MAX_CHARS
from tests.helpers import (
    Org,
    delete_agent,
    eventually,
    listening,
    make_agent,
    make_key,
    make_org,
)
from tests.serving import served_app

HEARTBEAT_S = 0.3


@dataclass
class Env:
    service: App
    client: TestClient[web.Request, web.Application]
    org: Org
    other: Org

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.org.key}"}

    async def chat(
        self, model: str, text: str, *, key: str | None = None, **extra: Any
    ) -> ClientResponse:
        headers = self.auth(key)
        headers.update(extra.pop("headers", {}))
        body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)

    async def transcript(
        self, agent: str, session: str, key: str | None = None, **query: str
    ) -> ClientResponse:
        return await self.client.get(
            f"/v1/agents/{agent}/sessions/{session}/messages", params=query, headers=self.auth(key)
        )

    async def settle(self) -> None:
        """Run the lead runner and the relay until nothing is left (approval, reveal)."""
        await drain(self.service.lead_runner)
        await drain(self.service.relay)


@asynccontextmanager
async def serving(migrated_url: str, **api: float) -> AsyncIterator[Env]:
    config = {"api": {"events_heartbeat_s": HEARTBEAT_S, "events_write_timeout_s": 0.5, **api}}
    async with served_app(migrated_url, config=config) as (service, client):
        org = await make_org(service)
        other = await make_org(service, "other")
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        await make_agent(service, other, "plain")
        yield Env(service, client, org, other)


@pytest.fixture
async def env(migrated_url: str) -> AsyncIterator[Env]:
    async with serving(migrated_url) as served:
        yield served


@pytest.fixture
async def rechecking_env(migrated_url: str) -> AsyncIterator[Env]:
    """Streams that check their key every 50 ms (instead of 5 s)."""
    async with serving(migrated_url, events_reauth_s=0.05) as served:
        yield served


def texts(page: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in page["data"]]


# ------------------------------------------------------------------------ transcript


async def test_transcript_pages_oldest_first(env: Env) -> None:
    for text in ("one", "two", "three"):
        assert (await env.chat("plain", text, headers={"X-Session-Id": "p"})).status == 200
    page = await (await env.transcript("plain", "p")).json()
    assert page["object"] == "list" and page["has_more"] is False
    assert texts(page) == [
        ("user", "one"),
        ("assistant", "Echo: one"),
        ("user", "two"),
        ("assistant", "Echo: two"),
        ("user", "three"),
        ("assistant", "Echo: three"),
    ]
    first = page["data"][0]
    assert set(first) == {"id", "role", "content", "createdAt"}
    assert first["createdAt"].endswith("Z")
    head = await (await env.transcript("plain", "p", limit="2")).json()
    assert texts(head) == texts(page)[:2] and head["has_more"] is True
    rest = await (await env.transcript("plain", "p", after=head["data"][-1]["id"])).json()
    assert texts(rest) == texts(page)[2:] and rest["has_more"] is False


async def test_a_page_ends_early_past_a_million_characters(env: Env) -> None:
    """A page holds at most PAGE_MAX_CHARS characters of text (always one message):
    ``has_more`` says there is more, and ``after`` pages through all of it."""
    long = "x" * 99_000  # just under the 100,000-character message limit
    for i in range(8):
        text = f"{i} {long}"
        assert (await env.chat("plain", text, headers={"X-Session-Id": "long"})).status == 200
    seen: list[str] = []
    after: str | None = None
    sizes: list[int] = []
    while True:
        query = {"after": after} if after else {}
        page = await (await env.transcript("plain", "long", **query)).json()
        sizes.append(len(page["data"]))
        assert sum(len(m["content"]) for m in page["data"]) <= PAGE_MAX_CHARS
        seen += [m["content"] for m in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert sizes == [10, 6]  # 16 messages of about 99,000 characters
    assert seen == [t for i in range(8) for t in (f"{i} {long}", f"Echo: {i} {long}")]
    # The page is cut in the database: it sends the ten rows and one more (the sign that
    # there is more), not all sixteen.
    reads = env.service.transcripts
    ref = await reads.find(env.org.principal, "plain", "long")
    assert ref.session_id is not None
    async with env.service.db.read() as conn:
        rows = await reads._page(conn, ref.session_id, None, PAGE_MAX)
    assert len(rows) == 11


@pytest.mark.parametrize(
    ("query", "rule"),
    [
        ({"limit": "0"}, "transcript.limit"),
        ({"limit": "101"}, "transcript.limit"),
        ({"limit": "ten"}, "transcript.limit"),
        ({"after": "msg_unknown"}, "transcript.after"),
    ],
)
async def test_bad_paging_is_400_naming_the_rule(
    env: Env, query: dict[str, str], rule: str
) -> None:
    await env.chat("plain", "hi", headers={"X-Session-Id": "q"})
    resp = await env.transcript("plain", "q", **query)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["rule"] == rule and error["param"] is None


async def test_a_query_parameter_given_twice_is_400_naming_it(env: Env) -> None:
    """``?limit=1&limit=2`` took the first value here and the last on MCP: a client could
    not tell which one counted. Now a 400 ``query.repeated`` naming the parameter; a
    parameter the route does not read may come any number of times."""
    await env.chat("plain", "hi", headers={"X-Session-Id": "q"})
    path = "/v1/agents/plain/sessions/q/messages"
    for query, name in (("limit=1&limit=2", "limit"), ("after=&after=x", "after")):
        resp = await env.client.get(f"{path}?{query}", headers=env.auth())
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["rule"] == "query.repeated" and error["param"] is None
        assert error["message"] == f"the query parameter {name} was given 2 times: give it once"
    resp = await env.client.get(f"{path}?limit=1&other=1&other=2", headers=env.auth())
    assert resp.status == 200 and len((await resp.json())["data"]) == 1


async def test_one_session_name_whichever_way_it_came(env: Env) -> None:
    await env.chat("plain", "by header", headers={"X-Session-Id": "same"})
    await env.chat("plain", "by user", user="same")
    await env.chat("plain", "by default")  # neither: the key's default session
    same = await (await env.transcript("plain", "same")).json()
    assert [t for r, t in texts(same) if r == "user"] == ["by header", "by user"]
    default = await (await env.transcript("plain", "default")).json()
    assert [t for r, t in texts(default) if r == "user"] == ["by default"]
    # "default" as a header is that default session too.
    await env.chat("plain", "named default", headers={"X-Session-Id": "default"})
    default = await (await env.transcript("plain", "default")).json()
    assert [t for r, t in texts(default) if r == "user"] == ["by default", "named default"]
    # Another key of the organization has its own default session.
    key = await make_key(env.service, env.org, Scope.trigger)
    assert (await (await env.transcript("plain", "default", key)).json())["data"] == []


async def test_gated_answer_is_absent_until_approved_then_in_place(env: Env) -> None:
    s = {"X-Session-Id": "g"}
    await env.chat("worker", "first", headers=s)
    gated = await env.chat("worker", "ship it #complete", headers=s)
    assert gated.status == 409
    before = await (await env.transcript("worker", "g")).json()
    assert texts(before) == [
        ("user", "first"),
        ("assistant", "Echo: first"),
        ("user", "ship it #complete"),
    ]
    assert "workItemId" not in json.dumps(before) and "wi_" not in json.dumps(before)
    await env.settle()
    after = await (await env.transcript("worker", "g")).json()
    assert texts(after) == [*texts(before), ("assistant", "Echo: ship it #complete")]


async def test_unknown_session_is_empty_and_other_org_is_404(env: Env) -> None:
    assert await (await env.transcript("plain", "never-used")).json() == {
        "object": "list",
        "data": [],
        "has_more": False,
    }
    await env.chat("plain", "mine", headers={"X-Session-Id": "x"})
    # The other organization's key: our agent does not exist for it (its own "plain"
    # is another agent with another session "x").
    theirs = await env.transcript("plain", "x", env.other.key)
    assert (await theirs.json())["data"] == []
    agent_id = (await (await env.client.get("/v1/agents", headers=env.auth())).json())["data"]
    ours = next(a["id"] for a in agent_id if a["slug"] == "plain")
    for path in ("messages", "events"):
        resp = await env.client.get(
            f"/v1/agents/{ours}/sessions/x/{path}", headers=env.auth(env.other.key)
        )
        assert resp.status == 404, path
        assert (await resp.json())["error"]["type"] == "not_found_error"


async def test_reads_need_a_key_with_trigger(env: Env) -> None:
    review_only = await make_key(env.service, env.org, Scope.review)
    for path in ("messages", "events"):
        resp = await env.client.get(f"/v1/agents/plain/sessions/x/{path}")
        assert resp.status == 401
        resp = await env.client.get(
            f"/v1/agents/plain/sessions/x/{path}", headers=env.auth(review_only)
        )
        assert resp.status == 403


# ---------------------------------------------------------------------------- events


class Stream:
    """An open SSE response, read event by event."""

    def __init__(self, resp: ClientResponse) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self, within: float = 10.0) -> dict[str, Any]:
        """The next event within ``within`` seconds (comments are collected aside)."""
        return await asyncio.wait_for(self._next(), within)

    async def _next(self) -> dict[str, Any]:
        fields: dict[str, str] = {}
        while True:
            raw = await self.resp.content.readline()
            assert raw, "the stream ended"
            line = raw.decode().rstrip("\n")
            if not line:
                if fields:
                    return {
                        "id": int(fields["id"]) if "id" in fields else None,
                        "event": fields["event"],
                        "data": json.loads(fields["data"]),
                    }
                continue
            if line.startswith(":"):
                self.comments.append(line)
                continue
            name, _, value = line.partition(": ")
            fields[name] = value

    def close(self) -> None:
        self.resp.close()


async def open_stream(
    env: Env, agent: str, session: str, last: int | None = None, key: str | None = None
) -> Stream:
    headers = env.auth(key)
    if last is not None:
        headers["Last-Event-ID"] = str(last)
    resp = await env.client.get(f"/v1/agents/{agent}/sessions/{session}/events", headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return Stream(resp)


async def test_stream_pending_then_message_then_delivered_and_resume(env: Env) -> None:
    stream = await open_stream(env, "worker", "e")  # before the session exists
    assert (
        await env.chat("worker", "do it #complete", headers={"X-Session-Id": "e"})
    ).status == 409
    user = await stream.next()
    pending = await stream.next()
    assert (user["event"], user["data"]["role"], user["data"]["content"]) == (
        "message",
        "user",
        "do it #complete",
    )
    assert (pending["event"], pending["data"]) == ("review", {"status": "pending"})
    await env.settle()
    answer = await stream.next()
    delivered = await stream.next()
    assert (answer["event"], answer["data"]["content"]) == ("message", "Echo: do it #complete")
    assert set(answer["data"]) == {"id", "role", "content", "createdAt"}
    assert (delivered["event"], delivered["data"]) == ("review", {"status": "delivered"})
    ids = [e["id"] for e in (user, pending, answer, delivered)]
    assert ids == sorted(ids) and len(set(ids)) == 4
    stream.close()
    # Nothing about the work item anywhere.
    for event in (user, pending, answer, delivered):
        assert not {"workItemId", "revision", "reason"} & set(event["data"])
    # Reconnect after the second event: exactly the third and fourth, then new ones.
    again = await open_stream(env, "worker", "e", last=pending["id"])
    assert [await again.next(), await again.next()] == [answer, delivered]
    await env.chat("worker", "and now", headers={"X-Session-Id": "e"})
    newer = [await again.next(), await again.next()]
    assert [e["data"]["content"] for e in newer] == ["and now", "Echo: and now"]
    assert newer[0]["id"] == delivered["id"] + 1
    again.close()
    # From the start: everything once, in order.
    full = await open_stream(env, "worker", "e")
    replay = [await full.next() for _ in range(6)]
    assert replay == [user, pending, answer, delivered, *newer]
    full.close()


async def test_stream_resumes_only_with_a_valid_id(env: Env) -> None:
    resp = await env.client.get(
        "/v1/agents/plain/sessions/z/events", headers={**env.auth(), "Last-Event-ID": "abc"}
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["rule"] == "events.last_event_id"
    # Sent twice: which one was meant is anybody's guess (the first was taken).
    resp = await env.client.get(
        "/v1/agents/plain/sessions/z/events",
        headers=[*env.auth().items(), ("Last-Event-ID", "1"), ("Last-Event-ID", "2")],
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["rule"] == "header.repeated"


async def test_a_last_event_id_the_session_never_gave_is_refused(env: Env) -> None:
    """An id past the session's log (another session's, or one kept from an earlier
    session) is a 400 before any stream; it opened a stream that skipped every event up
    to that id unseen. The session's own last id still resumes."""
    for text in ("one", "two", "three"):
        await env.chat("plain", text, headers={"X-Session-Id": "long"})
    long_ = await open_stream(env, "plain", "long")
    events = [await long_.next() for _ in range(6)]
    long_.close()
    await env.chat("plain", "first", headers={"X-Session-Id": "short"})
    for last in (events[-1]["id"], 10_000):
        resp = await env.client.get(
            "/v1/agents/plain/sessions/short/events",
            headers={**env.auth(), "Last-Event-ID": str(last)},
        )
        assert resp.status == 400, last
        assert (await resp.json())["error"]["rule"] == "events.last_event_id"
    short = await open_stream(env, "plain", "short", last=1)
    answer = await short.next()
    assert (answer["id"], answer["data"]["content"]) == (2, "Echo: first")
    short.close()
    resumed = await open_stream(env, "plain", "long", last=events[-1]["id"])
    await env.chat("plain", "four", headers={"X-Session-Id": "long"})
    assert (await resumed.next())["data"]["content"] == "four"
    resumed.close()


async def test_a_stream_ends_once_its_key_is_revoked(rechecking_env: Env) -> None:
    """A stream checks its key again every ``events_reauth_s``. Keys are cached for
    5 s of the service's clock, so the revocation is seen once that clock passed them."""
    env = rechecking_env
    key = await make_key(env.service, env.org, Scope.trigger)
    revoked = await open_stream(env, "plain", "rv", key=key)
    kept = await open_stream(env, "plain", "rv")  # the Owner key, still valid
    async with env.service.db.tx() as conn:
        await orgs.revoke_key(conn, env.service.clock, env.org.id, key.split(".")[1])
    # Still cached: the stream goes on and hears the session's next message.
    assert (await env.chat("plain", "one", headers={"X-Session-Id": "rv"})).status == 200
    assert (await revoked.next())["data"]["content"] == "one"
    assert (await kept.next())["data"]["content"] == "one"
    assert isinstance(env.service.clock, FakeClock)
    env.service.clock.advance(5_001)
    event = await revoked.next()
    while event["event"] == "message":  # the reply to "one" may still be on its way
        event = await revoked.next()
    assert event["event"] == "end" and event["id"] is None
    assert event["data"] == {
        "reason": "the key or console session is no longer valid",
        "rule": "auth.key",
    }
    assert await revoked.resp.content.read() == b""  # and the stream is over
    assert (await env.chat("plain", "two", headers={"X-Session-Id": "rv"})).status == 200
    for _ in range(3):  # the stream that is still allowed goes on
        event = await kept.next()
        if event["data"].get("content") == "two":
            break
    else:
        raise AssertionError("the kept stream did not hear the second message")
    kept.close()


async def test_a_stream_ends_once_its_agent_is_deleted(rechecking_env: Env) -> None:
    """The re-check asks whether the key may still read the session, not only whether
    the key is valid: a deleted agent's stream ends (it went on delivering the session's
    events, though every other read of the agent was a 404)."""
    env = rechecking_env
    doomed = await make_agent(env.service, env.org, "doomed")
    stream = await open_stream(env, "doomed", "dl")
    kept = await open_stream(env, "plain", "dl")
    assert (await env.chat("doomed", "one", headers={"X-Session-Id": "dl"})).status == 200
    assert (await stream.next())["data"]["content"] == "one"
    await delete_agent(env.service, env.org, doomed["id"])
    event = await stream.next()
    while event["event"] == "message":  # the reply to "one" may still be on its way
        event = await stream.next()
    assert event["event"] == "end"
    assert event["data"] == {
        "reason": "no agent 'doomed' in this organization",
        "rule": "agent.not_found",
    }
    assert await stream.resp.content.read() == b""
    # Another agent's stream of the same session name is not touched.
    assert (await env.chat("plain", "two", headers={"X-Session-Id": "dl"})).status == 200
    assert (await kept.next())["data"]["content"] == "two"
    kept.close()


async def test_readable_sessions_are_those_whose_agent_is_not_deleted(env: Env) -> None:
    """What MCP's subscription re-check reads (one statement per chunk of 500, so an
    unknown id, and more ids than a chunk, are fine)."""
    doomed = await make_agent(env.service, env.org, "doomed")
    reads = env.service.transcripts
    kept = await reads.open(env.org.principal, "plain", "r")
    gone = await reads.open(env.org.principal, "doomed", "r")
    theirs = await reads.open(env.other.principal, "plain", "r")
    unknown = {f"ses_unknown_{n}" for n in range(600)}
    assert await reads.readable({kept, gone, theirs, *unknown}) == {kept, gone, theirs}
    await delete_agent(env.service, env.org, doomed["id"])
    assert await reads.readable({kept, gone, theirs, *unknown}) == {kept, theirs}
    assert await reads.readable(set()) == set()


async def test_heartbeat_comments_while_idle(env: Env) -> None:
    stream = await open_stream(env, "plain", "hb")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        # Six beats' time for the two counted below: at 3.5 a loaded machine's late
        # heartbeats could leave only one in the window.
        await stream.next(within=HEARTBEAT_S * 6)
    assert stream.comments[0] == ": connected"
    assert stream.comments.count(": keepalive") >= 2, stream.comments
    assert time.monotonic() - started >= HEARTBEAT_S * 3
    stream.close()


async def test_a_stream_whose_session_cannot_be_marked_watched_is_a_503(env: Env) -> None:
    """PostgreSQL marks the session watched before the stream starts (other replicas
    NOTIFY it only then); a database that cannot is a 503 with Retry-After, before any
    stream, and the next try streams. (SQLite has no marks; a failing one stands in.)"""
    failures = [Unavailable("the database is unavailable", rule="database.unavailable")]
    marked: list[str] = []

    async def mark(session_ids: Sequence[str]) -> None:
        if failures:
            raise failures.pop()
        marked.extend(session_ids)

    env.service.event_hub.mark = mark
    resp = await env.client.get("/v1/agents/plain/sessions/down/events", headers=env.auth())
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["rule"] == "database.unavailable"
    assert env.service.event_hub.readers == 0
    stream = await open_stream(env, "plain", "down")
    assert len(marked) == 1
    stream.close()


async def test_many_events_arrive_in_pages_without_gaps(env: Env) -> None:
    for n in range(40):  # 80 events: more than one page
        await env.chat("plain", f"m{n}", headers={"X-Session-Id": "many"})
    stream = await open_stream(env, "plain", "many")
    events = [await stream.next() for _ in range(80)]
    assert [e["id"] for e in events] == list(range(1, 81))
    assert [e["data"]["content"] for e in events[::2]] == [f"m{n}" for n in range(40)]
    stream.close()


async def test_a_reader_that_stops_reading_is_dropped(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="leadgate.web.events")
    big = "x" * 90_000
    for _ in range(25):  # about 4.5 MB of events, far more than the socket buffers
        await env.chat("plain", big, headers={"X-Session-Id": "slow"})
    host, port = env.client.server.host, env.client.server.port
    assert isinstance(port, int)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    try:
        sock.sendall(
            (
                "GET /v1/agents/plain/sessions/slow/events HTTP/1.1\r\n"
                f"Host: {host}:{port}\r\nAuthorization: Bearer {env.org.key}\r\n\r\n"
            ).encode()
        )
        hub = env.service.event_hub
        await eventually(lambda: hub.readers == 1, 5.0, what="the stream started")
        # It never reads: once the buffers are full a write waits, times out (0.5 s)
        # and the server drops the connection and its reader.
        await eventually(lambda: hub.readers == 0, 10.0, what="the reader dropped")
        assert any("dropped: write timed out" in r.getMessage() for r in caplog.records)
    finally:
        sock.close()
    # Everybody else is served as before.
    stream = await open_stream(env, "plain", "slow", last=49)
    assert (await stream.next())["id"] == 50
    stream.close()


async def test_shutdown_ends_open_streams(env: Env) -> None:
    stream = await open_stream(env, "plain", "bye")
    await eventually(lambda: env.service.event_hub.readers)  # the stream is read
    # Only the server shuts down: the client keeps its connection open (closing the
    # client's session would end the stream from the client's side, whatever the
    # server did), so only the server's shutdown can end the stream.
    closing = asyncio.ensure_future(env.client.server.close())
    try:
        # Not aiohttp's shutdown timeout (60 s) that an open stream held it for; 3 s
        # was within a loaded machine's reach.
        rest = await asyncio.wait_for(stream.resp.content.read(), 10.0)
        assert b"event:" not in rest  # it ended, with nothing more to say
        await asyncio.wait_for(closing, 10.0)
    finally:
        stream.close()
        closing.cancel()
    assert env.service.event_hub.readers == 0


async def test_a_stream_hears_another_replica(pg_url: str) -> None:
    """Two services on one PostgreSQL: a turn on one wakes the stream on the other
    through LISTEN/NOTIFY (the heartbeat, which would also re-read, is far away)."""
    from leadgate.database.db import upgrade

    await asyncio.to_thread(upgrade, pg_url)
    api = {"events_heartbeat_s": 15.0}
    async with (
        served_app(pg_url, config={"api": api}) as (reader, reader_client),
        served_app(pg_url, config={"api": api}) as (writer, writer_client),
    ):
        org = await make_org(writer)
        await make_agent(writer, org, "plain")
        headers = {"Authorization": f"Bearer {org.key}"}
        resp = await reader_client.get("/v1/agents/plain/sessions/r/events", headers=headers)
        assert resp.status == 200
        stream = Stream(resp)
        await eventually(lambda: reader.event_hub.readers)  # the stream is read
        await listening(reader.db)  # (not its start: the turn's NOTIFY wakes the stream)
        sent = await writer_client.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": [{"role": "user", "content": "across"}]},
            headers={**headers, "X-Session-Id": "r"},
        )
        assert sent.status == 200
        first = await stream.next(within=5.0)
        second = await stream.next(within=5.0)
        assert [first["data"]["content"], second["data"]["content"]] == ["across", "Echo: across"]
        stream.close()


async def test_a_replica_listens_on_one_connection_for_every_channel(pg_url: str) -> None:
    """PostgreSQL signals every listening backend of the database for every NOTIFY
    (each then reads the queue in a transaction of its own), whatever it listens to: a
    process running surfaces and runners listens on its three channels (session events,
    outbox, reviews) over one connection, not three."""
    import asyncpg
    from aiohttp.test_utils import TestServer

    from leadgate.core.clock import FakeClock
    from leadgate.core.config import Settings
    from leadgate.database.db import upgrade
    from leadgate.database.pg import asyncpg_dsn

    await asyncio.to_thread(upgrade, pg_url)
    settings = Settings.model_validate({"database": {"url": pg_url}})
    service = App(settings, clock=FakeClock(), enable_adapters=False)
    client = TestClient(TestServer(service.web_app(run_runners=True), host="127.0.0.1"))
    probe = await asyncpg.connect(asyncpg_dsn(pg_url))
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE 'LISTEN %'"
    )
    try:
        await client.start_server()
        await eventually(lambda: probe.fetch(listening), 5)
        await asyncio.sleep(0.3)  # the others, if there were any, would be up by now
        assert len(await probe.fetch(listening)) == 1
        # ...and it hears each channel: a NOTIFY on the review channel wakes the runner.
        pokes = service.lead_runner._pokes
        await probe.execute("SELECT pg_notify('leadgate_reviews', '')")
        await eventually(lambda: service.lead_runner._pokes > pokes)
        assert service.lead_runner._pokes > pokes
        # Its own NOTIFYs (the payload names its Database) poked at commit already.
        pokes = service.lead_runner._pokes
        await probe.execute("SELECT pg_notify('leadgate_reviews', $1)", service.db.notify_tag)
        await probe.execute("SELECT pg_notify('leadgate_reviews', 'another replica')")
        await probe.execute("SELECT pg_notify('leadgate_reviews', $1)", service.db.notify_tag)
        await eventually(lambda: service.lead_runner._pokes > pokes)
        await asyncio.sleep(0.3)  # the notifications after it arrive in order, at once
        assert service.lead_runner._pokes == pokes + 1
    finally:
        await client.close()
        await service.stop()
        await probe.close()


async def test_streams_beyond_the_limit_are_503_until_one_closes(migrated_url: str) -> None:
    api = {"events_heartbeat_s": HEARTBEAT_S, "events_max_streams": 2}
    async with served_app(migrated_url, config={"api": api}) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        env = Env(service, client, org, org)
        first = await open_stream(env, "plain", "a")
        second = await open_stream(env, "plain", "b")
        refused = await client.get("/v1/agents/plain/sessions/c/events", headers=env.auth())
        assert refused.status == 503
        assert 5 <= int(refused.headers["Retry-After"]) <= 7  # 5 s, spread by up to 2
        assert (await refused.json())["error"]["rule"] == "events.limit"
        first.close()
        await eventually(lambda: service.event_hub.readers == 1, 5.0)
        third = await open_stream(env, "plain", "c")
        assert service.event_hub.readers == 2
        third.close()
        second.close()
        await eventually(lambda: service.event_hub.readers == 0, 5.0)
        # A burst of opens at once: the slot is taken before a stream's first await, so
        # no more than the limit get through (each one's session lookup and PostgreSQL
        # mark used to run between the check and the count).
        burst = await asyncio.gather(
            *(
                client.get(f"/v1/agents/plain/sessions/burst{i}/events", headers=env.auth())
                for i in range(8)
            )
        )
        assert sorted(r.status for r in burst) == [200, 200] + [503] * 6
        for r in burst:
            r.close()
