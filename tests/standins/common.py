"""Plumbing shared by the chat-platform stand-ins (:mod:`.slack_api`, :mod:`.discord_api`).

:class:`StandinBase` holds the failure-mode queue (``queue``, ``set_channel_mode``,
``reset``), the ``hang`` / ``reset`` / ``drop`` behaviours, the ``on_post`` hook (run
while a post waits for its answer), the ``/_standin/posts|requests|modes|reset`` control
endpoints
and the aiohttp lifecycle (``start`` on port 0, ``stop``, ``port``, ``base_url``,
``latency_ms``). :func:`serve_main` is the subprocess entry point that prints
``LISTENING <port>`` and serves until SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self

from aiohttp import web

__all__ = [
    "PORTAL_SESSION",
    "TRICKLE_S",
    "StandinBase",
    "abort_with_reset",
    "portal_page",
    "serve_main",
    "trickle",
]

#: Mode "trickle": the seconds between the bytes of an answer written a byte at a time
#: (each well within a client's read timeout).
TRICKLE_S = 0.1

#: The session id in the ``portal`` page's login link (every platform's stand-in).
PORTAL_SESSION = "9f86d081884c7d659a2feaa0c55ad015"


def portal_page(status: int = 200) -> web.Response:
    """A captive portal's page (its login link carries a session id), answered with
    ``status``: what the stand-ins' ``portal`` mode answers instead of the platform."""
    return web.Response(
        status=status,
        text=(
            "<html>\n<h1>Sign in to the guest network</h1>\n"
            f'<a href="/login?sid={PORTAL_SESSION}">Sign in</a>\n</html>'
        ),
        content_type="text/html",
    )


def abort_with_reset(request: web.Request) -> None:
    """Reset the request's TCP connection (SO_LINGER 0 + close sends RST)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def trickle(
    request: web.Request, body: bytes, record: dict[str, Any], stop: asyncio.Event
) -> web.StreamResponse:
    """Answer ``200`` with ``body`` (JSON) a byte every :data:`TRICKLE_S`, until ``stop``
    is set; ``record["trickled"]`` counts the bytes written, ``record["cut"]`` says the
    client hung up first."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    await response.prepare(request)
    record.update(trickled=0, cut=False)
    try:
        for byte in body:
            if stop.is_set():
                break
            await asyncio.sleep(TRICKLE_S)  # a slow answer's real time: what is tested
            await response.write(bytes([byte]))
            record["trickled"] += 1
    except (ConnectionError, RuntimeError):  # (aiohttp: "Cannot write to closing transport")
        record["cut"] = True
    return response


class StandinBase:
    """Failure modes, records, control API and lifecycle of an HTTP stand-in.

    Subclasses build the application in :meth:`make_app` (calling
    :meth:`_add_control_routes`) and answer JSON the platform's way in :meth:`_respond`.
    """

    def __init__(self, *, latency_ms: int, host: str, port: int) -> None:
        self.latency_ms = latency_ms
        self.host = host
        self._port = port
        self.posts: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self._queue: deque[str] = deque()
        self._key_modes: dict[str, str] = {}
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        #: awaited with each message post's record (``requests``) after the request was
        #: read and before it is answered in its mode (in process): what the test does
        #: there happens while the sender waits for the answer, its post in flight
        self.on_post: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    # -- control ---------------------------------------------------------------------------

    def queue(self, *modes: str) -> None:
        """Answer the next write requests with ``modes``, in order."""
        self._queue.extend(modes)

    def set_channel_mode(self, key: str, mode: str | None) -> None:
        """Answer every write to ``key`` (a channel id; for Discord webhooks the
        interaction token) with ``mode`` (``None`` clears it)."""
        if mode is None:
            self._key_modes.pop(key, None)
        else:
            self._key_modes[key] = mode

    def reset(self) -> None:
        """Forget records and modes."""
        self.posts.clear()
        self.requests.clear()
        self._queue.clear()
        self._key_modes.clear()

    @property
    def port(self) -> int:
        """The bound TCP port (after :meth:`start`)."""
        return self._port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self._port}"

    # -- lifecycle -------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """The aiohttp application (platform routes and control routes)."""
        raise NotImplementedError

    def _add_control_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/_standin/posts", self._get_posts)
        router.add_get("/_standin/requests", self._get_requests)
        router.add_post("/_standin/modes", self._set_modes)
        router.add_post("/_standin/reset", self._reset)

    async def start(self) -> Self:
        """Listen on ``host:port`` (port 0 picks a free one)."""
        self._release = asyncio.Event()
        self._runner = web.AppRunner(self.make_app(), shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self._port = sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Release hanging requests (their connections are reset), close long-lived
        sessions, stop listening."""
        self._release.set()
        await self._close_sessions()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _close_sessions(self) -> None:
        """Close long-lived sessions (websockets) before the runner shuts down."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- answering -------------------------------------------------------------------------

    def _respond(
        self, data: Any, *, status: int = 200, headers: dict[str, str] | None = None
    ) -> web.Response:
        """A JSON response, encoded as the platform does."""
        raise NotImplementedError

    async def _latency(self) -> None:
        if self.latency_ms:
            await asyncio.sleep(self.latency_ms / 1000)

    async def _posting(self, record: dict[str, Any]) -> None:
        """Record a message post's attempt and run :attr:`on_post` on it."""
        self.requests.append(record)
        if self.on_post is not None:
            await self.on_post(record)

    def _next_mode(self, key: str) -> str:
        if self._queue:
            return self._queue.popleft()
        return self._key_modes.get(key, "ok")

    async def _hang_or_reset(self, request: web.Request, mode: str) -> web.Response | None:
        """Act out ``hang`` / ``reset`` / ``drop`` (the connection closed, not reset,
        without an answer); None for any other mode."""
        if mode == "hang":
            await self._release.wait()
            abort_with_reset(request)
            return web.Response(status=503)
        if mode == "drop":
            transport = request.transport
            if transport is not None:
                transport.close()  # a FIN, not a RST: aiohttp's ServerDisconnectedError
            await asyncio.sleep(0.01)
            return web.Response(status=500)
        if mode == "reset":
            abort_with_reset(request)
            # Let connection_lost run so aiohttp does not try to write the response.
            await asyncio.sleep(0.01)
            return web.Response(status=500)
        return None

    # -- control API -----------------------------------------------------------------------

    async def _get_posts(self, request: web.Request) -> web.Response:
        return self._respond(self.posts)

    async def _get_requests(self, request: web.Request) -> web.Response:
        return self._respond(self.requests)

    async def _set_modes(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.queue(*body.get("queue", []))
        if "channel" in body:
            self.set_channel_mode(body["channel"], body.get("mode"))
        return self._respond({"ok": True})

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return self._respond({"ok": True})


async def _serve_forever(standin: StandinBase) -> None:
    await standin.start()
    print(f"LISTENING {standin.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await standin.stop()


def serve_main(
    argv: list[str] | None,
    build: Callable[[argparse.Namespace], StandinBase],
    *,
    description: str | None,
    default_token: str,
    extra_options: Mapping[str, str] | None = None,
) -> None:
    """Parse ``--host --port --latency-ms --token`` (+ ``extra_options``: flag -> default),
    build the stand-in from the arguments, print ``LISTENING <port>`` and serve until
    SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=int, default=0)
    parser.add_argument("--token", default=default_token)
    for flag, default in (extra_options or {}).items():
        parser.add_argument(flag, default=default)
    args = parser.parse_args(argv)
    asyncio.run(_serve_forever(build(args)))
