"""An SMTP sink on 127.0.0.1 (aiosmtpd served with ``loop.create_server``).

It accepts mail like a real relay, records every accepted message, and can be told to
fail the next transactions the ways real SMTP servers fail.

In-process use::

    sink = SmtpSink()
    await sink.start()               # sink.port is the bound port (port 0 allowed)
    sink.fail_next("hang")
    ...
    sink.messages                    # accepted messages, oldest first (see _describe)
    sink.attempts                    # every transaction that reached RCPT or DATA
    sink.on_data = hook              # awaited with each message before it is answered
    sink.slow_s = 0.6                # each MAIL and RCPT answered that much later
    await sink.close()

As a subprocess (acceptance tests)::

    python -m tests.standins.smtp --port 0 --http-port 0
    # prints "LISTENING <smtp port>" then "HTTP <http port>"

With a login (``SmtpSink(login=("user", "password"))``, ``--login user:password``) it
asks for ``AUTH`` (``PLAIN`` or ``LOGIN``, over plain TCP, as a relay on a private
network may) before ``MAIL FROM``: a transaction without it is ``530 5.7.0``, wrong
credentials ``535 5.7.8``. Every try is in ``auths`` (the user name and whether it
matched; never the password).

HTTP side port (only with ``--http-port``):

* ``GET  /_standin/messages``  -> JSON list of accepted messages
* ``GET  /_standin/attempts``  -> JSON list of every transaction, with its ``mode``
* ``GET  /_standin/auths``     -> JSON list of ``AUTH`` tries: ``{"user", "ok"}``
* ``POST /_standin/fail``      -> body ``{"mode": ..., "count": 1}``
* ``POST /_standin/reset``     -> clears records and pending failures

Failure modes (each consumes one transaction, chosen at ``MAIL FROM``):

* ``"reject_rcpt"``   ``550 5.1.1`` at RCPT (refused recipient, permanent)
* ``"tempfail_rcpt"`` ``450 4.2.1`` at RCPT (temporary)
* ``"hang_rcpt"``     never answers RCPT (a timeout before any content was sent)
* ``"tempfail"``      ``451 4.3.0`` after the message content (temporary)
* ``"tempfail_quoting"`` ``451 4.7.1`` after the message content, quoting its first line
* ``"reject"``        ``554 5.7.1`` after the message content (permanent)
* ``"hang"``          reads the whole message, never answers
* ``"drop"``          reads the whole message, then closes the connection
* ``"accept_2xx"``    takes the message (recorded in ``messages``) with ``252 2.0.0``, a
  positive answer other than RFC 5321's ``250``
* ``"odd_3xx"``       reads the whole message, answers ``354`` (neither taken nor refused)
"""

from __future__ import annotations

import argparse
import asyncio
import email
import email.policy
import signal
import sys
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from email.message import EmailMessage
from typing import Any

from aiohttp import web
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

FAILURE_MODES = frozenset(
    {
        "reject_rcpt",
        "tempfail_rcpt",
        "hang_rcpt",
        "tempfail",
        "tempfail_quoting",
        "reject",
        "hang",
        "drop",
        "accept_2xx",
        "odd_3xx",
    }
)


def _describe(envelope: Envelope, raw: bytes, mode: str) -> dict[str, Any]:
    """The record of one message: envelope, main headers, text body (LF line ends), raw."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    body_part = msg.get_body(preferencelist=("plain",))
    body = body_part.get_content() if body_part is not None else ""
    # The wire form has CRLF line ends; a decoded quoted-printable body keeps them.
    body = body.replace("\r\n", "\n")
    return {
        "mode": mode,
        "mail_from": envelope.mail_from,
        "rcpt_tos": list(envelope.rcpt_tos),
        "from": str(msg.get("From", "")),
        "to": str(msg.get("To", "")),
        "reply_to": str(msg.get("Reply-To", "")) or None,
        "subject": str(msg.get("Subject", "")),
        "message_id": str(msg.get("Message-ID", "")) or None,
        "in_reply_to": str(msg.get("In-Reply-To", "")) or None,
        "references": str(msg.get("References", "")) or None,
        "auto_submitted": str(msg.get("Auto-Submitted", "")) or None,
        "body": body,
        "raw": raw.decode("utf-8", "replace"),
    }


class SmtpSink:
    """A recording SMTP server with scripted failures."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        smtputf8: bool = True,
        login: tuple[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        #: offer SMTPUTF8 (RFC 6531), as Postfix and the big providers do
        self.smtputf8 = smtputf8
        #: the user name and password ``AUTH`` must give (None: no ``AUTH`` asked for)
        self.login = login
        #: every ``AUTH`` try, oldest first: the user name given and whether it matched
        self.auths: list[dict[str, Any]] = []
        #: accepted messages, oldest first
        self.messages: list[dict[str, Any]] = []
        #: every transaction that reached RCPT or DATA, with its mode
        self.attempts: list[dict[str, Any]] = []
        self._failures: deque[str] = deque()
        self._modes: weakref.WeakKeyDictionary[Envelope, str] = weakref.WeakKeyDictionary()
        self._server: asyncio.base_events.Server | None = None
        self._connections: weakref.WeakSet[SMTP] = weakref.WeakSet()
        self._closing = asyncio.Event()
        #: awaited with each transaction's record after its message was read and before
        #: it is answered (in process): what the test does there happens while the
        #: sender waits for the answer, its send in flight
        self.on_data: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        #: seconds each MAIL and RCPT answer waits (in process): a relay slow at every
        #: step, as a tarpit is, each step within the sender's timeout
        self.slow_s = 0.0

    def fail_next(self, mode: str, *, count: int = 1) -> None:
        """Make the next ``count`` transactions fail with ``mode``."""
        if mode not in FAILURE_MODES:
            raise ValueError(f"unknown failure mode {mode!r}")
        self._failures.extend([mode] * count)

    def reset(self) -> None:
        """Forget records and pending failures."""
        self.messages.clear()
        self.attempts.clear()
        self.auths.clear()
        self._failures.clear()

    async def start(self) -> None:
        """Listen; ``self.port`` holds the bound port afterwards."""
        loop = asyncio.get_running_loop()

        def factory() -> SMTP:
            smtp = SMTP(
                self,
                hostname="smtp-standin",
                ident="standin ESMTP",
                loop=loop,
                enable_SMTPUTF8=self.smtputf8,
                **self._auth_options(),
            )
            self._connections.add(smtp)
            return smtp

        self._server = await loop.create_server(factory, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _auth_options(self) -> dict[str, Any]:
        """aiosmtpd's options for :attr:`login` (none without one)."""
        if self.login is None:
            return {}
        return {
            "authenticator": self._authenticate,
            "auth_required": True,
            "auth_require_tls": False,
        }

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any
    ) -> AuthResult:
        """aiosmtpd's authenticator: ``data`` is the ``LoginPassword`` given by ``PLAIN``
        or ``LOGIN``."""
        assert self.login is not None
        if not isinstance(data, LoginPassword):
            return AuthResult(success=False, handled=False)
        user = data.login.decode("utf-8", "replace")
        ok = (user, data.password.decode("utf-8", "replace")) == self.login
        self.auths.append({"user": user, "mechanism": mechanism, "ok": ok})
        return AuthResult(success=ok, handled=False)

    async def close(self) -> None:
        """Stop listening, release hanging sessions and close connections."""
        self._closing.set()
        if self._server is not None:
            self._server.close()
            for smtp in list(self._connections):
                if smtp.transport is not None:
                    smtp.transport.close()
            await self._server.wait_closed()
            self._server = None

    # aiosmtpd hooks -------------------------------------------------------------------

    async def handle_MAIL(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        """Start a transaction and pick its failure mode."""
        await self._slowly()
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        self._modes[envelope] = self._failures.popleft() if self._failures else "ok"
        return "250 OK"

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        """Accept, refuse or stall a recipient according to the mode."""
        await self._slowly()
        mode = self._modes.get(envelope, "ok")
        if mode.endswith("_rcpt"):
            self.attempts.append(
                {"mode": mode, "mail_from": envelope.mail_from, "rcpt_tos": [address]}
            )
        if mode == "reject_rcpt":
            return "550 5.1.1 Recipient address rejected"
        if mode == "tempfail_rcpt":
            return "450 4.2.1 Mailbox temporarily unavailable"
        if mode == "hang_rcpt":
            await self._closing.wait()
            return "421 4.3.2 Shutting down"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 OK"

    async def _slowly(self) -> None:
        if self.slow_s > 0:
            await asyncio.sleep(self.slow_s)  # a slow relay's real time: what is tested

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        """Record the message, then answer according to the mode."""
        mode = self._modes.get(envelope, "ok")
        raw = envelope.original_content or b""
        record = _describe(envelope, raw, mode)
        self.attempts.append(record)
        if self.on_data is not None:
            await self.on_data(record)
        if mode == "ok":
            self.messages.append(record)
            return "250 2.0.0 OK: queued"
        if mode == "accept_2xx":
            self.messages.append(record)
            return "252 2.0.0 Queued"
        if mode == "odd_3xx":
            return "354 Go ahead"
        if mode == "tempfail":
            return "451 4.3.0 Temporary failure, try again later"
        if mode == "tempfail_quoting":
            # As content filters do: the reply quotes what it refused.
            line = record["body"].strip().splitlines()[0][:200]
            return f"451 4.7.1 Refused for now, it says: {line}"
        if mode == "reject":
            return "554 5.7.1 Message rejected"
        if mode == "hang":
            await self._closing.wait()
            return "421 4.3.2 Shutting down"
        # "drop": the whole message was read; vanish without a reply.
        if isinstance(server.transport, asyncio.Transport):
            server.transport.abort()
        await self._closing.wait()
        return "421 4.3.2 Shutting down"

    # HTTP side port -----------------------------------------------------------------

    def make_http_app(self) -> web.Application:
        """The control/records application for ``--http-port``."""

        async def messages(request: web.Request) -> web.Response:
            return web.json_response(self.messages)

        async def attempts(request: web.Request) -> web.Response:
            return web.json_response(self.attempts)

        async def auths(request: web.Request) -> web.Response:
            return web.json_response(self.auths)

        async def fail(request: web.Request) -> web.Response:
            spec = await request.json()
            try:
                self.fail_next(str(spec["mode"]), count=int(spec.get("count", 1)))
            except (KeyError, ValueError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
            return web.json_response({"pending": len(self._failures)})

        async def reset(request: web.Request) -> web.Response:
            self.reset()
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/_standin/messages", messages)
        app.router.add_get("/_standin/attempts", attempts)
        app.router.add_get("/_standin/auths", auths)
        app.router.add_post("/_standin/fail", fail)
        app.router.add_post("/_standin/reset", reset)
        return app


async def _main(host: str, port: int, http_port: int | None, login: tuple[str, str] | None) -> None:
    sink = SmtpSink(host, port, login=login)
    await sink.start()
    print(f"LISTENING {sink.port}", flush=True)
    runner: web.AppRunner | None = None
    if http_port is not None:
        runner = web.AppRunner(sink.make_http_app())
        await runner.setup()
        await web.TCPSite(runner, host, http_port).start()
        print(f"HTTP {runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    # SIGTERM (what a test harness sends) ends the process cleanly with exit code 0.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await sink.close()
        if runner is not None:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.standins.smtp --port 0 [--http-port 0] [--login user:password]``."""
    parser = argparse.ArgumentParser(description="SMTP sink stand-in")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument("--login", default=None, help="user:password that AUTH must give")
    args = parser.parse_args(argv)
    login = None
    if args.login is not None:
        user, _, password = args.login.partition(":")
        login = (user, password)
    try:
        asyncio.run(_main(args.host, args.port, args.http_port, login))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
