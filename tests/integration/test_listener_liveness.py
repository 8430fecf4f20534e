"""A LISTEN connection that dies without a word is found and replaced.

A TCP proxy on 127.0.0.1 stands between the listener and PostgreSQL. "Going silent" stops
forwarding bytes on the connections it carries without closing them: what a host that
vanished or a firewall that dropped an idle flow looks like to the client (no FIN, no
reset, no termination event). The listener must count the connection as lost (so the
configuration cache stops being used) and open a new one, which hears notifications again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from outbox.store import listen_all
from tests.helpers import eventually


class SilenceableProxy:
    """Forwards 127.0.0.1 TCP connections to ``target``; :meth:`go_silent` makes every
    connection open at that moment drop all further bytes, both ways, without closing."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.server: asyncio.Server | None = None
        self.silenced: set[int] = set()
        self.open: set[int] = set()
        self._next = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self, port: int = 0) -> int:
        """Listen on ``port`` (any free one for 0; the same one again after
        :meth:`stop`: the target reachable again); the port."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        bound: int = self.server.sockets[0].getsockname()[1]
        return bound

    def go_silent(self) -> None:
        self.silenced |= self.open

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._next += 1
        number = self._next
        self.open.add(number)
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if number in self.silenced:
                        continue  # swallowed: the peer hears nothing, and no FIN either
                    dst.write(data)
                    await dst.drain()
            if number not in self.silenced:
                dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self.open.discard(number)

    async def stop(self) -> None:
        """Stop listening and close every flow (the silenced ones kept theirs open)."""
        if self.server is not None:
            self.server.close()
        for writer in self._writers:
            writer.close()


@pytest.fixture
async def proxied_url(pg_url: str) -> AsyncIterator[tuple[str, SilenceableProxy]]:
    url = make_url(pg_url)
    assert url.host is not None and url.port is not None
    proxy = SilenceableProxy(url.host, url.port)
    port = await proxy.start()
    yield url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False), proxy
    await proxy.stop()


async def test_a_listener_gone_silent_is_counted_lost_and_replaced(
    pg_url: str, proxied_url: tuple[str, SilenceableProxy], caplog: pytest.LogCaptureFixture
) -> None:
    url, proxy = proxied_url
    heard: asyncio.Queue[str] = asyncio.Queue()
    events: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    task = asyncio.create_task(
        listen_all(
            url,
            {"liveness_test": heard.put_nowait},
            stop,
            on_connect=[lambda: events.put_nowait("connected")],
            on_lost=[lambda: events.put_nowait("lost")],
            reconnect_s=0.05,
            check_s=0.1,
            # Not what is checked (a silent connection is never answered): wide enough
            # that a healthy check on a loaded machine is not counted lost (0.3 s was: a
            # spurious "lost" and reconnection put the order of events out).
            check_timeout_s=2.0,
        )
    )
    notifier = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        assert await asyncio.wait_for(events.get(), timeout=10) == "connected"
        await notifier.execute("NOTIFY liveness_test, 'before'")
        assert await asyncio.wait_for(heard.get(), timeout=5) == "before"

        proxy.go_silent()
        await notifier.execute("NOTIFY liveness_test, 'unheard'")
        # Lost within a check and its timeout, then connected again through the proxy.
        assert await asyncio.wait_for(events.get(), timeout=10) == "lost"
        assert await asyncio.wait_for(events.get(), timeout=10) == "connected"
        await notifier.execute("NOTIFY liveness_test, 'after'")
        assert await asyncio.wait_for(heard.get(), timeout=5) == "after"
        assert heard.empty()  # 'unheard' went into the silent connection
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        await notifier.close()
    assert await asyncio.wait_for(events.get(), timeout=1) == "lost"  # stopped
    # Said in the log as every database fault is: naming its rule.
    said = [r.getMessage() for r in caplog.records if r.name == "leadgate.outbox"]
    assert any("liveness check (service.unavailable)" in line for line in said), said


async def test_a_listener_that_cannot_connect_names_the_rule_and_keeps_trying(
    proxied_url: tuple[str, SilenceableProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """The database's port closed: each try is a WARNING naming ``service.unavailable``
    (the database-down test counts every line that does not), and the listener connects
    once the port answers again."""
    url, proxy = proxied_url
    port = make_url(url).port
    assert port is not None
    await proxy.stop()
    events: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    task = asyncio.create_task(
        listen_all(
            url,
            {"liveness_test": lambda _: None},
            stop,
            on_connect=[lambda: events.put_nowait("connected")],
            reconnect_s=0.02,
        )
    )
    try:
        await eventually(
            lambda: sum("cannot connect" in r.getMessage() for r in caplog.records) >= 2, 5
        )
        said = [r.getMessage() for r in caplog.records if "cannot connect" in r.getMessage()]
        assert all("(service.unavailable)" in line for line in said), said
        assert events.empty()
        await proxy.start(port)
        assert await asyncio.wait_for(events.get(), timeout=10) == "connected"
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_a_quiet_but_healthy_listener_is_kept(
    pg_url: str, proxied_url: tuple[str, SilenceableProxy]
) -> None:
    """Liveness checks alone do not cost a connection that answers them."""
    url, _ = proxied_url
    events: list[str] = []
    stop = asyncio.Event()
    task = asyncio.create_task(
        listen_all(
            url,
            {"liveness_test": lambda _: None},
            stop,
            on_connect=[lambda: events.append("connected")],
            on_lost=[lambda: events.append("lost")],
            check_s=0.02,
            # A healthy check slower than this counted as lost on a loaded machine:
            # the production bound (README: within 5 s), the answers are what is checked.
            check_timeout_s=5.0,
        )
    )
    try:
        await eventually(lambda: events, 10.0)  # connected (200 x 10 ms was all)
        await asyncio.sleep(0.3)  # about fifteen checks
        assert events == ["connected"]
        # The checks keep the connection recognisable to an operator.
        other = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            shown = await other.fetchval(
                "SELECT query FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        finally:
            await other.close()
        assert shown == 'LISTEN "liveness_test"'
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
