"""The listener's bounds on a real listener (:class:`ServiceRunner` on 127.0.0.1, raw
sockets and aiohttp's client).

``[server] max_connections``: the longest-idle connection makes room, a busy one never
does, and with every connection busy a newcomer is answered 503 in the envelope.
``send_timeout_s`` and ``max_unsent_bytes``: an answer its client does not read is
dropped after the timeout, or sooner when such answers pass the byte budget; a client
that keeps reading keeps its connection."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from leadgate.core.metrics import METRICS
from leadgate.web.runner import ConnectionLimit, SendBounds, ServiceRunner
from tests.helpers import eventually


class Clock:
    """The limit's log interval, moved by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


BIG = 16 * 1024 * 1024
#: More than one unread BIG answer leaves in the process (the kernel takes a few MB).
BUDGET = 20 * 1024 * 1024


@asynccontextmanager
async def listener(
    limit: ConnectionLimit | None,
    release: asyncio.Event,
    entered: list[int] | None = None,
    sends: SendBounds | None = None,
) -> AsyncIterator[tuple[str, int]]:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def slow(request: web.Request) -> web.Response:
        if entered is not None:
            entered.append(1)
        await release.wait()
        return web.json_response({"ok": "slow"})

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG)

    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)
    # A failing test leaves stalled answers behind: do not wait a minute for them.
    runner = ServiceRunner(
        app, limit=limit, sends=sends, access_log=None, keepalive_timeout=30, shutdown_timeout=1
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield host, port
    finally:
        await runner.cleanup()


async def request(host: str, port: int, path: str = "/") -> tuple[int, bytes]:
    """One request on a fresh connection: its status and body."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def closed_count(reason: str, listener: str = "test") -> float:
    value = METRICS.registry.get_sample_value(
        "leadgate_http_connections_closed_total", {"listener": listener, "reason": reason}
    )
    return value or 0.0


async def test_idle_connections_make_room_oldest_first(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limit = ConnectionLimit(3, listener="test", now=clock)
    evicted_before = closed_count("evicted")
    caplog.set_level(logging.WARNING, logger="leadgate.web")
    async with listener(limit, asyncio.Event()) as (host, port):
        idle = [await asyncio.open_connection(host, port) for _ in range(3)]
        await eventually(lambda: limit.open == 3)
        # A fourth connection closes the first (idle the longest), and is answered.
        assert await request(host, port) == (200, b'{"ok": true}')
        assert closed_count("evicted") - evicted_before == 1
        # Closed by the server (10 s: only "it did not hang"; it is closed at once).
        assert await asyncio.wait_for(idle[0][0].read(), 10) == b""
        assert not idle[1][0].at_eof() and not idle[2][0].at_eof()
        for _, writer in idle:
            writer.close()
        await eventually(lambda: limit.open == 0)
        # A kept-alive connection that has had its answer is idle too: the oldest now.
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{host}:{port}/") as resp:
                assert resp.status == 200
            idle = [await asyncio.open_connection(host, port) for _ in range(2)]
            await eventually(lambda: limit.open == 3)
            assert (await request(host, port))[0] == 200
            assert closed_count("evicted") - evicted_before == 2  # the session's, not these
            assert not any(reader.at_eof() for reader, _ in idle)
            # The client opens a new connection for its next request.
            async with session.get(f"http://{host}:{port}/") as resp:
                assert resp.status == 200
        await eventually(lambda: limit.open == 2)  # the two idle ones
        gauge = METRICS.registry.get_sample_value("leadgate_http_connections", {"listener": "test"})
        assert gauge == limit.open
        for _, writer in idle:
            writer.close()
    # One WARNING for the lot, within the log interval.
    lines = [r.getMessage() for r in caplog.records if "to make room" in r.getMessage()]
    assert lines == [
        "http: 1 idle connection(s) closed to make room for new ones "
        "(test listener at [server] max_connections = 3)"
    ]
    assert limit.open == 0


async def test_with_every_connection_busy_a_newcomer_is_a_503_in_the_envelope() -> None:
    release = asyncio.Event()
    limit = ConnectionLimit(2, listener="test")
    refused_before = closed_count("refused")
    entered: list[int] = []
    async with listener(limit, release, entered) as (host, port):
        busy = [asyncio.create_task(request(host, port, "/slow")) for _ in range(2)]
        await eventually(lambda: len(entered) == 2)  # both under way
        status, body = await request(host, port)
        assert status == 503
        error = json.loads(body)["error"]
        assert error["rule"] == "server.connections" and error["code"] == "service_unavailable"
        assert closed_count("refused") - refused_before == 1
        # The busy ones were never closed to make room; once they end there is room again.
        release.set()
        assert [r[0] for r in await asyncio.gather(*busy)] == [200, 200]
        await eventually(lambda: limit.open == 0)
        assert (await request(host, port))[0] == 200


async def test_the_503_carries_retry_after_and_closes() -> None:
    release = asyncio.Event()
    limit = ConnectionLimit(1, listener="test", jitter=lambda: 0.75)
    entered: list[int] = []
    async with listener(limit, release, entered) as (host, port):
        busy = asyncio.create_task(request(host, port, "/slow"))
        await eventually(lambda: len(entered) == 1)
        reader, writer = await asyncio.open_connection(host, port)
        raw = await asyncio.wait_for(reader.read(), 5)  # no request sent: answered anyway
        writer.close()
        raw_head, _, body = raw.partition(b"\r\n\r\n")
        head = raw_head.decode().lower()
        assert head.startswith("http/1.1 503")
        # 1 s and up to 2 s more, drawn at random (here 0.75 of it), as for every 503.
        assert "retry-after: 3\r\n" in head and "retry-after-ms: 2500\r\n" in head
        assert "connection: close" in head
        assert f"content-length: {len(body)}" in head
        assert json.loads(body)["error"]["rule"] == "server.connections"
        assert "server: leadgate" in head
        release.set()
        await busy


def reading(writer: asyncio.StreamWriter) -> asyncio.ReadTransport:
    """``writer``'s transport, which reads too (typeshed types it as write-only)."""
    transport = writer.transport
    assert isinstance(transport, asyncio.ReadTransport)
    return transport


async def unread_answer(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Ask for a 16 MB answer on a connection with a small receive buffer, and read none
    of it: the kernel takes little, the rest waits in the service."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    reading(writer).pause_reading()
    writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return reader, writer


async def reset_by_server(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, already: int = 0
) -> bool:
    """Whether the server reset the connection (reading it through, after the ``already``
    bytes read, ends in an error or short of the whole answer)."""
    reading(writer).resume_reading()
    got = already
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
            got += len(chunk)
    except ConnectionResetError:
        return True
    finally:
        writer.close()
    return got < BIG


async def test_unread_answers_past_the_byte_budget_are_dropped_oldest_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sends = SendBounds(send_timeout_s=600, max_unsent_bytes=BUDGET, listener="test")
    before = closed_count("unsent_bytes")
    caplog.set_level(logging.WARNING, logger="leadgate.web")
    async with listener(None, asyncio.Event(), sends=sends) as (host, port):
        first = await unread_answer(host, port)
        await eventually(lambda: sends.stalled_count == 1)
        second = await unread_answer(host, port)
        # Two unread answers pass the budget: the one stalled first is dropped.
        await eventually(lambda: closed_count("unsent_bytes") - before == 1)
        assert sends.stalled_count == 1 and 0 < sends.unsent() <= BUDGET
        assert await reset_by_server(*first)
        assert not await reset_by_server(*second)  # read through: the whole 16 MB
        await eventually(lambda: sends.stalled_count == 0)
    assert any(f"max_unsent_bytes = {BUDGET}" in r.getMessage() for r in caplog.records)


async def test_an_answer_left_unread_past_the_send_timeout_is_dropped() -> None:
    clock = Clock()
    sends = SendBounds(send_timeout_s=5, listener="test", now=clock)
    before = closed_count("send_timeout")
    async with listener(None, asyncio.Event(), sends=sends) as (host, port):
        idle_reader = await unread_answer(host, port)
        slow_reader = await unread_answer(host, port)
        await eventually(lambda: sends.stalled_count == 2)
        clock.t = 4.0
        # One client reads a little: its answer made progress, the other's did not.
        unsent = sends.unsent()
        reading(slow_reader[1]).resume_reading()
        await slow_reader[0].readexactly(6 << 20)
        reading(slow_reader[1]).pause_reading()
        await eventually(lambda: sends.unsent() < unsent)
        sends.check()
        clock.t = 6.0
        sends.check()  # 6 s without progress for one, 2 s for the other
        assert closed_count("send_timeout") - before == 1
        assert sends.stalled_count == 1
        assert await reset_by_server(*idle_reader)
        assert not await reset_by_server(*slow_reader, already=6 << 20)
