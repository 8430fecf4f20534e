"""Sessions as their clients see them (SPEC 13): the transcript and the review-status SSE.

* ``GET /v1/agents/{agent}/sessions/{session}/messages[?after=<message id>&limit=1..100]``:
  ``{"object": "list", "data": [{"id", "role", "content", "createdAt"}], "has_more"}``,
  visible messages oldest first (an unknown session is an empty list).
* ``GET /v1/agents/{agent}/sessions/{session}/events``: ``text/event-stream`` of the
  session's public event log (:mod:`leadgate.domain.session_events`)::

      id: 7
      event: message
      data: {"id": "msg_...", "role": "assistant", "content": "...", "createdAt": "..."}

      id: 8
      event: review
      data: {"status": "delivered"}

  From the start of the log, or after ``Last-Event-ID`` (the ``id`` of the last event a
  client received: nothing is sent twice or skipped). A ``: keepalive`` comment goes out
  whenever ``heartbeat_s`` passed without an event. The handler reads the durable log
  itself, a page at a time, when woken (:class:`leadgate.operations.event_hub.EventHub`)
  or at each heartbeat: what a connection holds is one page, plus the socket buffers. A
  reader that does not take a write within ``write_timeout_s`` is dropped (it resumes
  with ``Last-Event-ID``). Shutdown ends every stream. Every ``reauth_s`` (5 s, the key
  cache's lifetime) the stream checks again that its caller may still read the session:
  the key (or console session) and, as when it opened, ``agent:trigger`` and the agent
  in the caller's organization. Once the key is revoked, the session logged out or
  expired, the user demoted or removed, or the agent deleted, the stream sends
  ``event: end`` / ``data: {"reason": "...", "rule": "..."}`` and ends, so nobody keeps
  hearing a session they could no longer open. (Two indexed reads per stream every
  ``reauth_s``, none per event.) A deactivated agent's stream goes on: deactivation
  stops new turns, not reads, and its held work may still be revealed. A database
  fault (a check or a read the database could not answer) does not end the stream: it
  is tried again every second, with heartbeats going on meanwhile.

``{session}`` is the public session name (``X-Session-Id``, ``user``, MCP ``session``, or
``default``); ``{agent}`` the worker's id, slug or name; bearer key with
``agent:trigger``; another organization's agent is 404. :func:`stream_events` serves the
Studio page's stream too (console cookie instead of a key).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.decoding import decimal_int, query_value, single_header
from leadgate.core.errors import (
    AuthError,
    DatabaseDamaged,
    LeadgateError,
    NotFound,
    Unavailable,
    ValidationError,
    quoted,
)
from leadgate.core.logs import loggable
from leadgate.domain.session_events import SessionEvent
from leadgate.operations.access import PRINCIPAL_TTL_S
from leadgate.operations.transcripts import (
    SessionRef,
    TranscriptPage,
    parse_limit,
    public_event,
)
from leadgate.web.common import PrincipalLookup, StreamSlots, authenticate, damaged_answers

log = logging.getLogger("leadgate.web.events")

#: Events read (and held) per query.
PAGE = 50


class SessionReads(Protocol):
    """What the routes read (:class:`leadgate.operations.transcripts.Transcripts`)."""

    async def messages(
        self,
        principal: Principal,
        agent_ref: str,
        name: str,
        *,
        after: str | None = None,
        limit: int = 100,
        with_review: bool = False,
    ) -> TranscriptPage: ...

    async def find(self, principal: Principal, agent_ref: str, name: str) -> SessionRef: ...

    async def open(self, principal: Principal, agent_ref: str, name: str) -> str: ...

    async def events(self, session_id: str, *, after: int, limit: int) -> list[SessionEvent]: ...


class Wakeup(Protocol):
    """A reader's wake-up flag (:class:`leadgate.operations.event_hub.Waiter`)."""

    event: asyncio.Event


class Wakeups(Protocol):
    """Wake-ups for sessions (:class:`leadgate.operations.event_hub.EventHub`)."""

    closing: asyncio.Event

    def subscribe(self, session_id: str) -> Any: ...

    def unsubscribe(self, waiter: Any) -> None: ...

    async def keep_notified(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class StreamSettings:
    """Timing of event streams (injectable: tests use short ones) and the process's
    stream slots (one :class:`StreamSlots` shared by the REST and Studio routes)."""

    heartbeat_s: float = 15.0
    write_timeout_s: float = 30.0
    #: How often an open stream checks its key or console session again.
    reauth_s: float = PRINCIPAL_TTL_S
    page: int = PAGE
    #: After a database fault, an open stream checks and reads again this often (it stays
    #: open: the reader would reconnect into 503s, which ``EventSource`` gives up on).
    fault_retry_s: float = 1.0
    slots: StreamSlots = field(default_factory=StreamSlots)


class _Dropped(Exception):
    """The reader stopped reading (a write timed out) or went away."""


_LAST_EVENT_ID_TEXT = "Last-Event-ID must be the id of an event of this stream"


def last_event_id(request: web.Request) -> int:
    """The ``Last-Event-ID`` header: where a resuming reader left off (0: the start).
    Sent twice, a 400 ``header.repeated`` (the first was taken silently)."""
    raw = (single_header(request, "Last-Event-ID") or "").strip()
    if not raw:
        return 0
    after = decimal_int(raw)
    if after is None:
        raise ValidationError(_LAST_EVENT_ID_TEXT, rule="events.last_event_id")
    return after


async def _is_event_of(reads: SessionReads, session_id: str, seq: int) -> bool:
    """Whether the session's log holds the event ``seq`` (one indexed read)."""
    found = await reads.events(session_id, after=seq - 1, limit=1)
    return bool(found) and found[0].seq == seq


Recheck = Callable[[], Awaitable[Principal]]
"""The caller's principal again (an ``AuthError`` once its key or session is gone)."""

#: The ``end`` event's reason when the key or console session itself is gone.
GONE_REASON = "the key or console session is no longer valid"


async def _may_still_read(
    reads: SessionReads, recheck: Recheck, agent: str, name: str, session_id: str
) -> None:
    """Raise the :class:`LeadgateError` that now keeps the caller from the stream's
    session: its key revoked or console session ended (``AuthError``), its user demoted
    below ``agent:trigger`` (``PermissionDenied``), the agent deleted, or the name now
    opening another session (``NotFound``). Two indexed reads, every ``reauth_s``: the
    key's check alone let a demoted Studio user, or a reader of a deleted agent, go on
    hearing the session for as long as the stream stayed open."""
    principal = await recheck()
    ref = await reads.find(principal, agent, name)
    if ref.session_id != session_id:
        raise NotFound(
            f"session {quoted(name)} of agent {quoted(agent)} is no longer this stream's session",
            rule="events.session",
        )


def _end_event(exc: LeadgateError) -> bytes:
    """The ``end`` event telling the reader why its stream ended (and the rule)."""
    reason = GONE_REASON if isinstance(exc, AuthError) else exc.message
    data = {"reason": reason, "rule": exc.rule}
    return f"event: end\ndata: {json.dumps(data)}\n\n".encode()


async def stream_events(
    request: web.Request,
    reads: SessionReads,
    hub: Wakeups,
    settings: StreamSettings,
    principal: Principal,
    agent: str,
    name: str,
    recheck: Recheck,
) -> web.StreamResponse:
    """Serve one session's event stream (see the module docstring)."""
    after = last_event_id(request)
    # The slot is taken before the first await (see StreamSlots).
    with settings.slots.take(request):
        session_id = await reads.open(principal, agent, name)  # 404 before any stream
        if after and not await _is_event_of(reads, session_id, after):
            # An id this session never gave (another session's, a stored one reused for a
            # new session): resuming after it skipped every event up to it, unseen.
            raise ValidationError(_LAST_EVENT_ID_TEXT, rule="events.last_event_id")
        # Every replica's writes to the session wake readers from here on (a 503 if the mark
        # fails); the first read of the log, after subscribing, covers what came before.
        await hub.keep_notified(session_id)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold events back
            }
        )
        await response.prepare(request)
        waiter = hub.subscribe(session_id)

        async def send(data: bytes) -> None:
            try:
                await asyncio.wait_for(response.write(data), settings.write_timeout_s)
            except TimeoutError:
                raise _Dropped("write timed out") from None
            except (ConnectionError, RuntimeError) as exc:  # reset, or a closing transport
                raise _Dropped(str(exc)) from None

        try:
            await send(b": connected\n\n")
            last_write = last_auth = time.monotonic()
            woken = True  # read the log: at the start, when woken, at each heartbeat
            failing = False  # the database failed the last check or read
            while not hub.closing.is_set():
                waiter.event.clear()
                try:
                    if time.monotonic() - last_auth >= settings.reauth_s:
                        try:
                            await _may_still_read(reads, recheck, agent, name, session_id)
                        except (DatabaseDamaged, Unavailable):
                            raise  # the database, not the key (which may well be valid)
                        except LeadgateError as exc:
                            await send(_end_event(exc))
                            break
                        last_auth = time.monotonic()
                    if woken:
                        events = await reads.events(session_id, after=after, limit=settings.page)
                        for event in events:
                            name_, data = public_event(event)
                            await send(
                                f"id: {event.seq}\nevent: {name_}\n"
                                f"data: {json.dumps(data)}\n\n".encode()
                            )
                            after = event.seq
                            last_write = time.monotonic()
                        if len(events) == settings.page:
                            continue  # more to catch up on
                    failing = False
                except Unavailable as exc:
                    # A database hiccup: keep the stream, check and read again shortly.
                    # (A fault of the key's re-check ended it as a revoked key, and
                    # Studio took that for a logout.) One line for a run of them.
                    if not failing:
                        log.warning(
                            "event stream of session %s waits for the database (%s)",
                            session_id,
                            exc.detail or exc.rule,
                        )
                    failing = True
                # Woken by the hub, by the heartbeat, or (without reading) to check again.
                quiet = time.monotonic() - last_write
                wait_s = max(min(settings.heartbeat_s - quiet, settings.reauth_s), 0.0)
                if failing:
                    wait_s = settings.fault_retry_s
                try:
                    await asyncio.wait_for(waiter.event.wait(), wait_s)
                    woken = True
                except TimeoutError:
                    woken = time.monotonic() - last_write >= settings.heartbeat_s
                    if woken:
                        await send(b": keepalive\n\n")
                        last_write = time.monotonic()
                woken = woken or failing  # (what failed is read again)
        except _Dropped as exc:
            log.info("event stream of session %s dropped: %s", session_id, exc)
            if request.transport is not None:
                request.transport.close()
            return response
        except DatabaseDamaged as exc:
            # Logged as a request meeting it is: a line a minute, naming the file. It
            # was a traceback per stream, and a reader reconnecting every few seconds
            # (as EventSource does) wrote one every few seconds. The reader is told
            # why the stream ends, as when its key is revoked.
            damaged_answers(request).note(request, exc)
            with contextlib.suppress(_Dropped):
                reason = {"reason": exc.message}
                await send(f"event: end\ndata: {json.dumps(reason)}\n\n".encode())
        except Exception as exc:
            # The reader resumes with Last-Event-ID; nothing is lost with the connection.
            log.error("event stream of session %s failed", session_id, exc_info=loggable(exc))
            if request.transport is not None:
                request.transport.close()
            return response
        finally:
            hub.unsubscribe(waiter)
        with contextlib.suppress(ConnectionError):  # shutting down; the client may be gone
            await response.write_eof()
        return response


async def transcript_response(
    request: web.Request, reads: SessionReads, principal: Principal
) -> web.Response:
    """The transcript page named by the request's path and query."""
    page = await reads.messages(
        principal,
        request.match_info["agent"],
        request.match_info["session"],
        after=query_value(request, "after") or None,
        limit=parse_limit(query_value(request, "limit")),
    )
    return web.json_response(page)


async def events_response(
    request: web.Request,
    reads: SessionReads,
    hub: Wakeups,
    settings: StreamSettings,
    authenticate_with: PrincipalLookup,
    *,
    cookie: bool,
) -> web.StreamResponse:
    """The event stream of the session named by the request's path (authenticated here,
    and again every ``settings.reauth_s`` while it is open)."""

    def recheck() -> Awaitable[Principal]:
        return authenticate(request, authenticate_with, cookie=cookie)

    principal = await recheck()
    agent, name = request.match_info["agent"], request.match_info["session"]
    return await stream_events(request, reads, hub, settings, principal, agent, name, recheck)


def setup(
    app: web.Application,
    *,
    authenticate_with: PrincipalLookup,
    reads: SessionReads,
    hub: Wakeups,
    settings: StreamSettings | None = None,
) -> None:
    """Register the transcript and events routes under ``/v1/agents/{agent}/sessions``."""
    stream_settings = settings or StreamSettings()

    async def messages(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=False)
        return await transcript_response(request, reads, principal)

    async def events(request: web.Request) -> web.StreamResponse:
        return await events_response(
            request, reads, hub, stream_settings, authenticate_with, cookie=False
        )

    base = "/v1/agents/{agent}/sessions/{session}"
    app.router.add_get(f"{base}/messages", messages)
    app.router.add_get(f"{base}/events", events)
