"""The service's aiohttp runner: a request aiohttp cannot parse is answered in the one JSON
error envelope, like every other refused request; a listener holds at most ``[server]
max_connections`` connections (:class:`ConnectionLimit`), and answers their clients do not
read are bounded in time and bytes (:class:`SendBounds`).

aiohttp answers such a request (a bad request line, header or body framing) itself, before
any handler or middleware runs, with a plain-text 400 that quotes the offending bytes back.
Its protocol handler has no hook for that answer and its server takes no handler class, so
this module subclasses the two (``RequestHandler.handle_error`` and ``Server.__call__``)
and builds the server the application runner made with the subclass. Hand-rolled because no
library covers it; ``tests/fuzz/test_request_edges.py`` sends such requests to the real
service, so an aiohttp upgrade that moves these hooks fails there, not in production.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from leadgate.core.config import Settings
from leadgate.core.logs import Tally
from leadgate.core.metrics import METRICS
from leadgate.web.common import SERVER_NAME, error_body, retry_headers, spread_wait_ms

log = logging.getLogger("leadgate.web")

#: What a client is told about a request aiohttp could not parse: the rule, never its bytes.
MALFORMED_MESSAGE = (
    "the request is not valid HTTP/1.1 (its request line, a header or the body's framing)"
)


class ConnectionLimit:
    """At most ``limit`` open connections on one listener (``[server] max_connections``).

    Every connection costs a file descriptor until it closes, and a process may open only
    so many (``RLIMIT_NOFILE``): without a bound, a flood of idle connections (each held
    up to ``idle_timeout_s``) took them all, and the service could accept no request, open
    no database file and make no post until they timed out (a throwaway probe: 1,100 idle
    connections against a limit of 1,024 files, ``/healthz`` unanswered for 10 s and
    122,881 log lines of ``socket.accept() out of system resource``).

    At the limit, a new connection closes the connection idle the longest (waiting for its
    first request's headers, or between keep-alive requests; aiohttp's own test of
    idleness), so requests keep being answered however many idle connections someone
    opens; the HTTP clients reconnect when a kept-alive connection closes. Only when every
    open connection has a request under way is the new one answered 503
    ``server.connections`` with ``Retry-After`` (1-3 s) and closed, before anything is
    read.
    Counted when aiohttp makes the connection's protocol, not when it connects, for the
    reason :class:`bots.email._CountedSMTP` gives. Both are counted in
    ``leadgate_http_connections_closed_total{listener,reason}`` and logged as one WARNING
    every 10 s at most.
    """

    def __init__(
        self,
        limit: int,
        *,
        listener: str = "main",
        now: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.limit = limit
        self.listener = listener
        self._jitter = jitter
        #: connections open now (made and not yet lost or closed to make room)
        self.open = 0
        self.evictions = Tally(
            log,
            "http: %d idle connection(s) closed to make room for new ones "
            "(%s listener at [server] max_connections = %d)",
            now=now,
        )
        self.refusals = Tally(
            log,
            "http: %d connection(s) answered 503 [server.connections] and closed: "
            "every one of the %s listener's %d connections had a request under way",
            now=now,
        )
        METRICS.http_connections.labels(listener).set_function(lambda: self.open)

    def evicted(self) -> None:
        """Count an idle connection closed to make room."""
        self.open -= 1
        self.evictions.add(self.listener, self.limit)
        METRICS.http_connections_closed.labels(self.listener, "evicted").inc()

    def refused(self) -> int:
        """Count a connection refused with 503; the wait to ask for, in milliseconds: 1 s
        plus up to 2 s drawn at random, as for every 503 (``UnavailableAnswers``)."""
        self.refusals.add(self.listener, self.limit)
        METRICS.http_connections_closed.labels(self.listener, "refused").inc()
        return spread_wait_ms(1, self._jitter())


class SendBounds:
    """Answers their clients do not read, bounded in time and bytes (``[server]
    send_timeout_s``, ``max_unsent_bytes``).

    What the kernel's socket buffer cannot take of an answer waits in the process (in the
    transport's buffer, and the response's body with it) until the client reads it or
    goes. A throwaway probe: 20 clients that asked for a 9 MB transcript page (100
    messages of 99,000 characters) and never read it took the service from 129 to 466 MB,
    and held it there; a few hundred would have taken gigabytes, with any key of any
    organization.

    A connection whose transport has paused writing (its buffer past asyncio's
    high-water mark) is *stalled*. It is reset (its buffer dropped) once its buffer has
    not shrunk for ``send_timeout_s``: as nginx's ``send_timeout``, a client that keeps
    reading, however slowly, keeps its connection. Whenever the stalled connections'
    buffers together pass ``max_unsent_bytes``, the ones whose last progress is oldest
    are reset until they fit. Counted in ``leadgate_http_connections_closed_total``
    (``send_timeout``, ``unsent_bytes``), logged as one WARNING every 10 s at most; the
    bytes waiting are ``leadgate_http_unsent_bytes``.
    """

    def __init__(
        self,
        send_timeout_s: float = 30.0,
        max_unsent_bytes: int = 64 << 20,
        *,
        listener: str = "main",
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.send_timeout_s = send_timeout_s
        self.max_unsent_bytes = max_unsent_bytes
        self.listener = listener
        self._now = now
        # stalled connection -> [its unsent bytes at its last progress, when that was]
        self._stalled: dict[_JsonErrorsHandler, list[float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._check_soon = False
        self.timeouts = Tally(
            log,
            "http: %d connection(s) reset: their clients took nothing of the answer for "
            "[server] send_timeout_s = %s (%s listener)",
            now=now,
        )
        self.over_budget = Tally(
            log,
            "http: %d connection(s) reset: answers waiting for clients that did not read "
            "them passed [server] max_unsent_bytes = %d (%s listener)",
            now=now,
        )
        METRICS.http_unsent_bytes.labels(listener).set_function(self.unsent)

    def unsent(self) -> int:
        """Bytes of answers waiting on stalled connections now."""
        return sum(handler.unsent for handler in self._stalled)

    @property
    def stalled_count(self) -> int:
        """Connections stalled now."""
        return len(self._stalled)

    def stalled(self, handler: _JsonErrorsHandler) -> None:
        """``handler``'s transport paused writing: watch it."""
        self._stalled[handler] = [handler.unsent, self._now()]
        loop = asyncio.get_running_loop()
        if not self._check_soon:
            # Not from inside the transport's write that paused it.
            self._check_soon = True
            loop.call_soon(self._budget_soon)
        if self._timer is None:
            self._timer = loop.call_later(min(1.0, self.send_timeout_s / 4), self._tick)

    def resumed(self, handler: _JsonErrorsHandler) -> None:
        """``handler`` is writing again, or gone."""
        self._stalled.pop(handler, None)

    def check(self) -> None:
        """Reset the stalled connections past the timeout, then keep the budget."""
        now = self._now()
        for handler, progress in list(self._stalled.items()):
            unsent = handler.unsent
            if unsent < progress[0]:
                progress[0], progress[1] = unsent, now
            elif now - progress[1] >= self.send_timeout_s:
                self._reset(handler, "send_timeout")
        self._keep_budget()

    def _budget_soon(self) -> None:
        self._check_soon = False
        self._keep_budget()

    def _keep_budget(self) -> None:
        total = self.unsent()
        if total <= self.max_unsent_bytes:
            return
        oldest_first = sorted(self._stalled.items(), key=lambda item: item[1][1])
        for handler, _ in oldest_first:
            total -= handler.unsent
            self._reset(handler, "unsent_bytes")
            if total <= self.max_unsent_bytes:
                break

    def _tick(self) -> None:
        self._timer = None
        self.check()
        if self._stalled:
            self._timer = asyncio.get_running_loop().call_later(
                min(1.0, self.send_timeout_s / 4), self._tick
            )

    def _reset(self, handler: _JsonErrorsHandler, reason: str) -> None:
        self._stalled.pop(handler, None)
        handler.reset()
        METRICS.http_connections_closed.labels(self.listener, reason).inc()
        if reason == "send_timeout":
            self.timeouts.add(self.send_timeout_s, self.listener)
        else:
            self.over_budget.add(self.max_unsent_bytes, self.listener)


#: A connection beyond the limit while every open one is busy: the whole answer, sent
#: before its request is read (loopback clients still read it when their request was in).
_REFUSAL_BODY = json.dumps(
    error_body(
        503,
        "the service holds as many connections as it can; try again shortly",
        "service_unavailable",
        "server.connections",
    )
).encode()


def _refusal(wait_ms: int) -> bytes:
    """The 503 asking for ``wait_ms``, with the headers every 503 carries."""
    headers = {
        "Server": SERVER_NAME,
        "Content-Type": "application/json; charset=utf-8",
        **retry_headers(wait_ms),
        "Connection": "close",
        "Content-Length": str(len(_REFUSAL_BODY)),
    }
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"HTTP/1.1 503 Service Unavailable\r\n{head}\r\n".encode() + _REFUSAL_BODY


class _RefusedConnection(asyncio.Protocol):
    """A connection beyond :class:`ConnectionLimit` with none idle to close: the 503, then
    closed at once (holding its descriptor while it waits for the request would let a
    flood take them all again)."""

    def __init__(self, limit: ConnectionLimit) -> None:
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        wait_ms = self._limit.refused()
        transport.write(_refusal(wait_ms))
        transport.close()


class _JsonErrorsHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors as JSON and counted in
    its listener's :class:`ConnectionLimit`."""

    __slots__ = ("_limit", "_sends")

    def __init__(
        self,
        manager: Any,
        *,
        limit: ConnectionLimit | None,
        sends: SendBounds | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._limit = limit
        self._sends = sends

    @property
    def unsent(self) -> int:
        """Bytes written to the connection that the kernel has not taken yet."""
        transport = self.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._sends is not None:
            self._sends.stalled(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._sends is not None:
            self._sends.resumed(self)

    def reset(self) -> None:
        """Drop what is unsent and close at once (``close`` would wait for the client to
        read it)."""
        transport = self.transport
        if transport is not None:
            transport.abort()

    @property
    def idle(self) -> bool:
        """Waiting for a request's headers (the first, or the next on a kept-alive
        connection): what aiohttp's keep-alive timer closes."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def evict(self) -> None:
        """Close this idle connection to make room (counted once)."""
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.evicted()
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.open -= 1
        if self._sends is not None:
            self._sends.resumed(self)
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's version logs (MalformedRequestFilter makes that one quiet line) and
        # raises when a response has already begun; its text answer is replaced.
        super().handle_error(request, status, exc, message)
        if status >= 500:
            # Not reached from our routes (error_middleware answers every exception);
            # kept in the envelope for anything aiohttp itself fails at.
            body = error_body(status, "internal error", "internal_error", "internal")
        else:
            body = error_body(status, MALFORMED_MESSAGE, "malformed_request", "http.malformed")
        response = web.json_response(body, status=status, headers={"Server": SERVER_NAME})
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    """aiohttp's low-level server, making :class:`_JsonErrorsHandler` connections up to
    its :class:`ConnectionLimit`."""

    limit: ConnectionLimit | None = None
    sends: SendBounds | None = None

    def __call__(self) -> asyncio.BaseProtocol:  # type: ignore[override]
        limit = self.limit
        if limit is not None:
            if limit.open >= limit.limit and not self._close_one_idle():
                return _RefusedConnection(limit)
            limit.open += 1
        return _JsonErrorsHandler(
            self, limit=limit, sends=self.sends, loop=self._loop, **self._kwargs
        )

    def _close_one_idle(self) -> bool:
        # Oldest first: the server's connections are a dict, in the order they came.
        for handler in self._connections:
            if isinstance(handler, _JsonErrorsHandler) and handler.idle:
                handler.evict()
                return True
        return False


class ServiceRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer unparseable requests in the JSON
    envelope (rule ``http.malformed``) instead of aiohttp's plain text, whose listener
    holds at most ``limit``'s connections (:class:`ConnectionLimit`) and whose unread
    answers are bounded by ``sends`` (:class:`SendBounds`; none: unbounded)."""

    def __init__(
        self,
        app: web.Application,
        *,
        limit: ConnectionLimit | None = None,
        sends: SendBounds | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.limit = limit
        self.sends = sends

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        # The same server (the application's handler and request factory, our keyword
        # arguments), built with the subclass.
        server = _JsonErrorsServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
        server.limit = self.limit
        server.sends = self.sends
        return server


#: Descriptors kept for everything but the HTTP listeners' connections (the database,
#: channel clients and model providers, log and database files), on top of the database
#: pool and the SMTP listener's own bound (:func:`connection_budget`).
RESERVED_FILES = 256

#: ``max_connections`` of the separate metrics listener (``[server] metrics_host``).
METRICS_CONNECTIONS = 64


def reserved_files(settings: Settings, role: str) -> int:
    """The descriptors ``serve`` keeps beside the main listener's connections:
    :data:`RESERVED_FILES`, the database pool, the metrics listener's bound when it runs,
    and the SMTP listener's bound when this role listens for mail (api and all, with
    ``[email] listen_host`` or ``listen_port``; an outbound-only relay opens one
    connection at a time, which the 256 cover)."""
    smtp = settings.email.max_connections if settings.email.listens and role != "worker" else 0
    metrics = METRICS_CONNECTIONS if settings.server.metrics_host else 0
    return RESERVED_FILES + settings.database.pool_size + smtp + metrics


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (what a service
    manager leaves at 1,024 by default, to spare programs that use ``select``; asyncio
    uses epoll) and return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit above the kernel's nr_open
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_budget(configured: int, open_files: int, reserved: int) -> int:
    """``[server] max_connections``, lowered (with a WARNING) when it and ``reserved``
    other descriptors would not fit in ``open_files``: the limit must bind before the
    process runs out of descriptors, or a flood would stall it anyway."""
    room = open_files - reserved
    if configured <= room:
        return configured
    lowered = max(1, room)
    log.warning(
        "[server] max_connections = %d lowered to %d: this process may open %d files "
        "(RLIMIT_NOFILE; raise its hard limit, e.g. LimitNOFILE= in a systemd unit) and "
        "keeps %d of them for the database, channels and SMTP",
        configured,
        lowered,
        open_files,
        reserved,
    )
    return lowered
