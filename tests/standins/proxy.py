"""An HTTPS proxy stand-in on 127.0.0.1: what a proxy on the way to a platform does with
``CONNECT`` (``HTTPS_PROXY``), which requests (the Bot Framework SDK's client) sends for
an ``https`` URL before a byte of the request itself.

In-process use::

    proxy = ProxyStandin()
    await proxy.start()
    proxy.url                 # "http://127.0.0.1:PORT" (for HTTPS_PROXY)
    proxy.mode = "407"        # how the next CONNECTs are answered (see below)
    proxy.connects            # each CONNECT's target ("host:port"), oldest first
    proxy.ended               # client connections that have ended (the sender let go)
    await proxy.close()

Modes:

* ``"tunnel"`` (the default): ``200 Connection established``, then bytes are relayed
  both ways between the client and the target; with ``slow_s`` set, each byte of that
  answer is written that much later (a proxy trickling its answer, each byte within
  the client's read timeout); with ``hold_s`` set, the target's first bytes are held
  that long (a TLS server slow to answer the handshake);
* ``"403"``, ``"407"``: the tunnel is refused with that status (``407`` with
  ``Proxy-Authenticate: Basic``), and the connection closed: nothing reaches the target.

Anything but a ``CONNECT`` is answered ``405`` and closed.
"""

from __future__ import annotations

import asyncio
import contextlib

#: What each refusing mode answers a CONNECT with.
REFUSALS = {
    "403": b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    "407": (
        b"HTTP/1.1 407 Proxy Authentication Required\r\n"
        b'Proxy-Authenticate: Basic realm="proxy"\r\nContent-Length: 0\r\n'
        b"Connection: close\r\n\r\n"
    ),
}
MODES = frozenset({"tunnel", *REFUSALS})
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class ProxyStandin:
    """A CONNECT proxy (asyncio streams) whose answer to ``CONNECT`` is chosen by ``mode``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        #: how CONNECT is answered: "tunnel", "403" or "407"
        self.mode = "tunnel"
        #: seconds between the bytes of a tunnel's ``200`` (0: all at once)
        self.slow_s = 0.0
        #: seconds a tunnel holds the target's first bytes (a TLS server slow to answer
        #: the handshake)
        self.hold_s = 0.0
        #: each CONNECT's target ("host:port"), oldest first
        self.connects: list[str] = []
        #: client connections that have ended
        self.ended = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def url(self) -> str:
        """The proxy's URL, for ``HTTPS_PROXY``."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen; ``self.port`` holds the bound port afterwards."""
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._server is not None:
            self._server.close()
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away: what `ended` counts
        except asyncio.CancelledError:
            # Ended by close(): returns as a connection that ended (on Python 3.11,
            # asyncio's stream server logs an ERROR for a cancelled one: it reads the
            # exception of a cancelled task).
            if not self._closing:
                raise
        finally:
            self.ended += 1
            writer.close()
            self._tasks.discard(task)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, _, rest = head.partition(b" ")
        if method != b"CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return
        target = rest.split(b" ", 1)[0].decode("ascii")
        self.connects.append(target)
        if self.mode in REFUSALS:
            writer.write(REFUSALS[self.mode])
            await writer.drain()
            return
        host, _, port = target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        try:
            if self.slow_s > 0:
                for byte in ESTABLISHED:
                    await asyncio.sleep(self.slow_s)  # the trickle's real time: what is tested
                    writer.write(bytes([byte]))
                    await writer.drain()
            else:
                writer.write(ESTABLISHED)
                await writer.drain()
            pipes = {
                asyncio.ensure_future(_pipe(reader, up_writer)),
                asyncio.ensure_future(_pipe(up_reader, writer, hold_s=self.hold_s)),
            }
            try:
                # Either side ending ends the tunnel: the sender letting go shows at once.
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            up_writer.close()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, hold_s: float = 0.0
) -> None:
    """Copy ``reader`` to ``writer`` until the reader ends or the writer fails (the first
    bytes held ``hold_s``)."""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            if hold_s > 0:
                await asyncio.sleep(hold_s)  # a slow server's real time: what is tested
                hold_s = 0.0
            writer.write(chunk)
            await writer.drain()
