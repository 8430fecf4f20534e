"""The two event streams (``/operator/events`` and a session's ``/events``) meeting a
database fault: the stream stays open and goes on once the database answers again.

Both ended on a fault of the key's re-check as if the key had been revoked (``end``:
"not valid"), which the console takes for "stop following" and Studio for a logout; the
operator stream also ended on a fault reading its change mark. The streams are served
over real HTTP on 127.0.0.1 with fakes of what they read (their ports)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from leadgate.core.auth import Principal, Scope
from leadgate.core.errors import AuthError, Unavailable
from leadgate.domain.session_events import SessionEvent
from leadgate.operations.oversight import ChangesView
from leadgate.operations.transcripts import SessionRef, TranscriptPage
from leadgate.web import operator_events
from leadgate.web.sessions_api import StreamSettings, stream_events

pytestmark = pytest.mark.timeout(30)

EVERYTHING = frozenset({"lookup", "find", "mark", "changes", "events"})
PRINCIPAL = Principal("org_1", frozenset(Scope), key_id="key_1")


def fault() -> Unavailable:
    """What :func:`leadgate.database.faults.unavailable` makes of a database fault."""
    error = Unavailable("cannot store this request right now", rule="service.unavailable")
    error.detail = "database is locked"
    return error


@dataclass
class Database:
    """The database as the fakes see it: which calls it fails (all, or only the
    ``"mark"``), and how often it failed."""

    down: frozenset[str] = frozenset()
    revoked: bool = False
    failed: int = 0
    failed_once_more: asyncio.Event = field(default_factory=asyncio.Event)

    def ask(self, call: str) -> None:
        if call in self.down:
            self.failed += 1
            self.failed_once_more.set()
            raise fault()

    async def failures(self, count: int) -> None:
        """Wait until the database failed ``count`` more calls."""
        target = self.failed + count
        async with asyncio.timeout(5):  # (a stream that ended asks no more)
            while self.failed < target:
                self.failed_once_more.clear()
                await self.failed_once_more.wait()

    async def lookup(self, token: str | None, session: str | None) -> Principal | None:
        self.ask("lookup")
        return None if self.revoked or token is None else PRINCIPAL


@dataclass(frozen=True)
class Mark:
    value: int

    def token(self) -> str:
        return str(self.value)


@dataclass
class Feed:
    """The organization's change feed (:class:`leadgate.operations.oversight.Oversight`)."""

    db: Database
    mark_value: int = 0

    async def mark(self, principal: Principal) -> Mark:
        self.db.ask("mark")
        return Mark(self.mark_value)

    async def changes(self, principal: Principal, since: Any) -> ChangesView:
        self.db.ask("changes")
        return {"items": ["wi_1"], "queue": 1}

    async def queue_size(self, principal: Principal) -> int:
        return 0


@dataclass
class Log:
    """A session's event log (:class:`leadgate.operations.transcripts.Transcripts`)."""

    db: Database
    written: list[SessionEvent] = field(default_factory=list)

    async def messages(self, *args: Any, **kwargs: Any) -> TranscriptPage:
        raise NotImplementedError

    async def find(self, principal: Principal, agent_ref: str, name: str) -> SessionRef:
        self.db.ask("find")
        return SessionRef("agt_1", "ses_1")

    async def open(self, principal: Principal, agent_ref: str, name: str) -> str:
        return "ses_1"

    async def events(self, session_id: str, *, after: int, limit: int) -> list[SessionEvent]:
        self.db.ask("events")
        return [e for e in self.written if e.seq > after][:limit]


@dataclass
class Hub:
    """Wake-ups (:class:`leadgate.operations.event_hub.EventHub`), woken by the test."""

    closing: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: list[Any] = field(default_factory=list)

    def subscribe(self, session_id: str) -> Any:
        waiter = type("Waiter", (), {"event": asyncio.Event()})()
        self.waiters.append(waiter)
        return waiter

    def unsubscribe(self, waiter: Any) -> None:
        self.waiters.remove(waiter)

    async def keep_notified(self, session_id: str) -> None:
        return None

    def wake(self) -> None:
        for waiter in self.waiters:
            waiter.event.set()


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[TestClient[Any, Any]]:
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def next_event(resp: ClientResponse) -> tuple[str, dict[str, Any]]:
    """The next named event (comments, ids and retry lines skipped)."""
    name, data = "", ""
    async with asyncio.timeout(10):
        while True:
            line = (await resp.content.readline()).decode()
            assert line, "the stream ended"
            line = line.rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and name:
                return name, json.loads(data)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "leadgate.web.events" and r.levelno >= 30]


AUTH = {"Authorization": "Bearer lg.key_1.secret"}


async def test_the_operator_stream_waits_out_a_database_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = Database()
    feed = Feed(db)
    app = web.Application()
    # The key is checked again at every tick: the fault meets the re-check first.
    operator_events.setup(app, authenticate_with=db.lookup, feed=feed, poll_s=0.01, reauth_s=0)
    async with serve(app) as client:
        stream = await client.get("/operator/events", headers=AUTH)
        assert await next_event(stream) == ("hello", {"queue": 0})
        db.down = EVERYTHING
        await db.failures(5)  # five ticks in a row, the stream open all along
        db.down = frozenset()
        feed.mark_value = 1
        assert await next_event(stream) == ("change", {"items": ["wi_1"], "queue": 1})
        # A fault of the change mark alone (the key's check answered) waits as well.
        db.down = frozenset({"mark"})
        await db.failures(3)
        db.down = frozenset()
        feed.mark_value = 2
        assert (await next_event(stream))[0] == "change"
        # A key revoked is still the end.
        db.revoked = True
        assert await next_event(stream) == ("end", {"reason": "the session or key is not valid"})
    said = [r.getMessage() for r in warnings_of(caplog)]
    assert len(said) == 2, said  # one line a run of faults
    assert all("waits for it" in s and "database is locked" in s for s in said)
    assert not [r for r in warnings_of(caplog) if r.exc_info], "no traceback"


async def test_a_session_stream_waits_out_a_database_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = Database()
    log = Log(db)
    hub = Hub()
    settings = StreamSettings(heartbeat_s=60, reauth_s=0, fault_retry_s=0.01)

    async def recheck() -> Principal:
        principal = await db.lookup("lg.key_1.secret", None)
        if principal is None:
            raise AuthError("revoked", rule="auth.key")
        return principal

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, log, hub, settings, PRINCIPAL, "a", "s", recheck)

    app = web.Application()
    app.router.add_get("/events", handler)
    async with serve(app) as client:
        stream = await client.get("/events")
        assert (await stream.content.readline()) == b": connected\n"
        db.down = EVERYTHING
        hub.wake()
        await db.failures(5)  # the re-check, then again every fault_retry_s
        log.written.append(SessionEvent(1, "review", "pending", None, None, None, None))
        db.down = frozenset()
        # Read again once the database answers, without being woken.
        assert await next_event(stream) == ("review", {"status": "pending"})
        db.revoked = True
        hub.wake()
        assert await next_event(stream) == (
            "end",
            {"reason": "the key or console session is no longer valid", "rule": "auth.key"},
        )
    said = [r.getMessage() for r in warnings_of(caplog)]
    assert len(said) == 1 and "waits for the database (database is locked)" in said[0], said
    assert not [r for r in warnings_of(caplog) if r.exc_info], "no traceback"
