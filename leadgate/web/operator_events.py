"""``GET /operator/events``: live updates for the console (server-sent events).

Bearer key with ``agent:review`` or a console session, confined to the caller's
organization. Each connection checks the organization's change mark (see
:mod:`leadgate.review.changes`: two index reads) about once a second and, when it moved,
sends one event::

    event: change
    id: <mark>
    data: {"items": ["wi_…", …] | null, "queue": <actionable queue size>}

``items`` names the work items that changed (``null``: too many, refresh everything).
The first event is ``hello`` with the queue size; a comment line (``: keepalive``) goes
out every ``HEARTBEAT_S`` seconds of silence; ``end`` is sent when the session or key
stops being valid (checked every ``REAUTH_S``, 5 s). A database fault does not end the
stream (the console reads ``end`` as "stop following"): the check runs again at the next
tick, heartbeats going on meanwhile. Because the mark lives in the
database, an event reaches every replica's clients and survives restarts (a
reconnecting ``EventSource`` sends ``Last-Event-ID``; a different mark answers at once
with a full refresh).

Memory per connection is bounded: at most one event is built at a time and the next
check waits until it was written (a slow client slows only its own stream). At most
``MAX_STREAMS`` streams are open per process (503 beyond); all end at shutdown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.errors import DatabaseDamaged, LeadgateError, Unavailable
from leadgate.core.logs import loggable
from leadgate.operations.access import PRINCIPAL_TTL_S
from leadgate.web.common import PrincipalLookup, StreamSlots, authenticate, damaged_answers

if TYPE_CHECKING:
    from leadgate.operations.oversight import ChangesView

log = logging.getLogger("leadgate.web.events")

POLL_S = 1.0
HEARTBEAT_S = 15.0
#: How often a stream checks that its key or session is still valid: the key cache's
#: lifetime, so a revoked key's stream ends when its requests start being refused.
REAUTH_S = PRINCIPAL_TTL_S
MAX_STREAMS = 256


class MarkLike(Protocol):
    """An opaque change mark (compared for equality, sent as the event id)."""

    def token(self) -> str: ...


class ChangeFeed(Protocol):
    """What the stream needs (:class:`leadgate.operations.oversight.Oversight`)."""

    async def mark(self, principal: Principal) -> Any: ...

    async def changes(self, principal: Principal, since: Any) -> ChangesView: ...

    async def queue_size(self, principal: Principal) -> int: ...


def _event(name: str, data: Mapping[str, object], event_id: str | None = None) -> bytes:
    head = f"event: {name}\n" + (f"id: {event_id}\n" if event_id else "")
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def setup(
    app: web.Application,
    *,
    authenticate_with: PrincipalLookup,
    feed: ChangeFeed,
    poll_s: float = POLL_S,
    heartbeat_s: float = HEARTBEAT_S,
    reauth_s: float = REAUTH_S,
) -> None:
    """Register ``GET /operator/events``."""
    closing = asyncio.Event()
    slots = StreamSlots(MAX_STREAMS)

    async def on_shutdown(_: web.Application) -> None:
        closing.set()

    app.on_shutdown.append(on_shutdown)

    async def events(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request, authenticate_with, cookie=True)
        current = await feed.mark(principal)  # 403 here for a key without agent:review
        # The slot is taken before the stream's next await (see StreamSlots).
        with slots.take(request):
            return await _stream(request, principal, current)

    async def _stream(
        request: web.Request, principal: Principal, current: Any
    ) -> web.StreamResponse:
        size = await feed.queue_size(principal)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # proxies: do not buffer the stream
            }
        )
        await resp.prepare(request)
        try:
            await resp.write(b"retry: 3000\n\n")
            await resp.write(_event("hello", {"queue": size}, current.token()))
            resumed = request.headers.get("Last-Event-ID")
            if resumed and resumed != current.token():
                await resp.write(_event("change", {"items": None, "queue": size}, current.token()))
            await _follow(request, resp, principal, current)
        except ConnectionResetError:
            pass  # the client went away
        return resp

    async def _follow(
        request: web.Request, resp: web.StreamResponse, principal: Principal, current: Any
    ) -> None:
        last_write = last_auth = time.monotonic()
        failing = False
        while not closing.is_set():
            try:
                await asyncio.wait_for(closing.wait(), timeout=poll_s)
                return
            except TimeoutError:
                pass
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            now = time.monotonic()
            try:
                if now - last_auth >= reauth_s:
                    try:
                        principal = await authenticate(request, authenticate_with, cookie=True)
                    except (DatabaseDamaged, Unavailable):
                        raise  # the database, not the key (which may well be valid)
                    except LeadgateError:
                        reason = {"reason": "the session or key is not valid"}
                        await resp.write(_event("end", reason))
                        return
                    last_auth = now  # (after a fault: checked again at the next tick)
                new = await feed.mark(principal)
                if new != current:
                    changed = await feed.changes(principal, current)
                    await resp.write(_event("change", changed, new.token()))
                    current, last_write = new, now
                failing = False
            except DatabaseDamaged as exc:
                await _damaged(request, resp, exc)
                return
            except Unavailable as exc:
                # A database hiccup: keep the stream and try again at the next tick.
                # (Ending it, as it did, stopped the console following: it reads an
                # "end" as a revoked key.) One line for a run of them, no traceback.
                if not failing:
                    log.warning(
                        "operator events: the database failed (%s); the stream waits for it",
                        exc.detail or exc.rule,
                    )
                failing = True
            except LeadgateError as exc:
                await resp.write(_event("end", {"reason": exc.message}))
                return
            except ConnectionResetError:
                raise
            except Exception as exc:
                # Not a known fault: still keep the stream, with the traceback logged.
                if not failing:
                    log.warning(
                        "operator events: reading the change mark failed", exc_info=loggable(exc)
                    )
                failing = True
            if now - last_write >= heartbeat_s:
                await resp.write(b": keepalive\n\n")
                last_write = now

    async def _damaged(
        request: web.Request, resp: web.StreamResponse, exc: DatabaseDamaged
    ) -> None:
        """End the stream on a damaged database, counted as a request meeting it is
        (one ERROR line a minute naming the file): the stream ended with no log line,
        and the console reconnects every few seconds."""
        damaged_answers(request).note(request, exc)
        await resp.write(_event("end", {"reason": exc.message}))

    app.router.add_get("/operator/events", events)
