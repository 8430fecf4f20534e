"""Email: an SMTP listener in the service's own event loop, and an SMTP sender.

Inbound (``[email] listen_host`` / ``listen_port``): ``aiosmtpd``'s ``SMTP`` protocol
served with ``loop.create_server`` (not aiosmtpd's ``Controller``, which runs a second
thread and loop). Authenticity is the route's sender allow-list:

* ``RCPT TO``: the recipient and the envelope sender must resolve to a route, otherwise
  ``550 5.1.1 No such recipient or sender not allowed``, so that the sending server
  bounces and the human learns at once (accepting and dropping would be silent);
* ``DATA``: the ``From:`` header, the address a reply goes to, must be allowed as well,
  by each recipient's route: a recipient whose route does not allow it gets no part of
  the mail (a WARNING naming it and the rule ``email.sender`` when another part was
  taken, ``550 5.7.1`` when none was); the message must be at most 1 MiB (``552 5.3.4``
  naming ``email.too_large``, also at ``MAIL FROM`` for a larger declared ``SIZE``) and
  have a non-empty text body after quoted text is removed (``550 5.6.0``).

A recipient ``<local>+<token>@<domain>`` of ``[email] review_reply_address`` is a reply
to a review card instead (see :class:`EmailHandler`; README "Review cards and chat
decisions").

Accepted mail is recorded durably (one turn per routed recipient, :func:`bots.base.accept`)
before it is answered ``250``; the turns run in the background. A database that cannot
record it gets ``451`` (the sending server retries). A mail whose text breaks a message
rule (NUL, over 100,000 characters) is answered with a reply saying why. Automatic mail
(null sender, ``Auto-Submitted`` other than ``no``) is accepted and dropped so that two
auto-responders cannot loop (RFC 3834).

Outbound: :class:`EmailChannel` sends a threaded reply with ``aiosmtplib``, step by step,
so that it knows whether the message's final dot was written (see :meth:`_deliver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, AnyStr

from aiohttp import web
from aiosmtpd.smtp import SMTP, Envelope, Session

from binding.routes import fold_address
from bots.base import Adapter, Core, accept
from bots.email_out import EmailChannel, build_reply, message_id_for
from bots.email_parse import (
    MAX_MULTIPARTS,
    ParsedMail,
    TooManyParts,
    parse_mail,
    reply_subject,
    strip_quoted,
    utf8_address,
)
from bots.review_base import Answer, ChatReviewBackend
from leadgate.core.config import EmailSettings, Settings
from leadgate.core.errors import DatabaseDamaged, LeadgateError
from leadgate.core.limits import EVENT_ID_LIMIT, SESSION_KEY_LIMIT, bounded
from leadgate.core.logs import Tally, loggable, raised_at
from leadgate.core.types import BindingKind, Inbound, RouteMatch
from leadgate.review.replies import AnswerTo, parse_reply, token_of

__all__ = [
    "EmailAdapter",
    "EmailChannel",
    "EmailHandler",
    "build_reply",
    "create",
    "message_id_for",
    "parse_mail",
    "reply_subject",
    "strip_quoted",
]

log = logging.getLogger(__name__)

CHANNEL = "email"
MAX_MESSAGE_BYTES = 1_048_576

_TEMPFAIL = "451 4.3.0 Temporary failure, please try again later"
#: The rule of a card reply address whose token names no card (or cannot be one).
REPLY_TOKEN_RULE = "review.reply_token"
_NO_CARD = f"550 5.1.1 No such review card ({REPLY_TOKEN_RULE})"
#: The rule of a routed recipient whose route allows the envelope sender but not the
#: ``From:`` address (the one the reply would go to).
SENDER_RULE = "email.sender"
_SENDER_REFUSED = f"550 5.7.1 Sender not allowed ({SENDER_RULE})"
# The rules of the other SMTP refusals, named in them as those two are.
ROUTE_RULE = "email.route"
ADDRESS_RULE = "email.address"
RECIPIENTS_RULE = "email.recipients"
PARTS_RULE = "email.parts"
PARSE_RULE = "email.parse"
BODY_RULE = "email.body"
TOO_LARGE_RULE = "email.too_large"
_TOO_LARGE = f"552 5.3.4 Message too big: at most {MAX_MESSAGE_BYTES} bytes ({TOO_LARGE_RULE})"


# ----------------------------------------------------------------------------- inbound


def _envelope_address(envelope: Envelope) -> str:
    """The MAIL FROM address as sent; "" for the null reverse-path of bounces."""
    sender = (envelope.mail_from or "").strip()
    # aiosmtpd reports MAIL FROM:<> as "<>"
    return "" if sender == "<>" else sender


def _envelope_sender(envelope: Envelope) -> str:
    """The MAIL FROM address lower-case, as routes compare it; "" for a bounce's."""
    return _envelope_address(envelope).lower()


class EmailHandler:
    """aiosmtpd handler: route check at RCPT, parse and hand over at DATA.

    With :meth:`answer_cards` (``[email] review_reply_address`` set and the review
    backend wired), a recipient ``<local>+<token>@<domain>`` of that address is a reply
    to a review card: taken at RCPT when its token names a card (``550 5.1.1`` naming
    the rule ``review.reply_token`` otherwise), decided at DATA before the ``250``
    (``451`` when the database cannot take it), and answered with a mail saying what
    became of it: an outbox row committed with the decision, sent by the relay."""

    def __init__(self, core: Core) -> None:
        self._core = core
        #: The review backend and the card reply address (None / "": replies to cards
        #: are not taken, and such a recipient is routed like any other).
        self._reviews: ChatReviewBackend | None = None
        self._reply_address = ""
        # Card reply tokens taken at RCPT time, per envelope (recipient -> token).
        self._tokens: weakref.WeakKeyDictionary[Envelope, dict[str, str]] = (
            weakref.WeakKeyDictionary()
        )
        #: Mails that met a damaged database (their route looked up, or the mail
        #: recorded), each asked to retry (451): one ERROR line a minute at most naming
        #: the file or database, as runners and requests count it (a route lookup's was
        #: the driver's traceback per mail, a recording's a WARNING per mail).
        self.damaged = Tally(
            log,
            "email: %d mail(s) met a damaged database (asked to retry, 451): %s",
            every_s=60.0,
            level=logging.ERROR,
        )
        # Routes found at RCPT time, per envelope (RSET starts a new envelope).
        self._routes: weakref.WeakKeyDictionary[Envelope, dict[str, RouteMatch]] = (
            weakref.WeakKeyDictionary()
        )

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        """Accept a recipient only when it and the envelope sender resolve to a route."""
        recipient = address.strip().lower()
        sender = _envelope_sender(envelope)
        if len(envelope.rcpt_tos) >= MAX_RECIPIENTS:
            # Each routed recipient is a turn and a reply: one mail must not start
            # hundreds. 452 is RFC 5321's "too many recipients": the sending server
            # delivers the rest in another transaction.
            return f"452 4.5.3 Too many recipients ({RECIPIENTS_RULE})"
        # aiosmtpd hands over bytes that are not UTF-8 as surrogate escapes; such an
        # address can be neither looked up nor stored (the route lookup raised, and the
        # sender was told to retry a mail that could never be taken).
        if utf8_address(sender) != sender:
            return f"553 5.1.7 The sender address is not valid UTF-8 ({ADDRESS_RULE})"
        if utf8_address(recipient) != recipient:
            return f"553 5.1.3 The recipient address is not valid UTF-8 ({ADDRESS_RULE})"
        token = (
            token_of(self._reply_address, recipient)
            if self._reviews is not None and self._reply_address
            else None
        )
        if token is not None:
            return await self._card_recipient(envelope, address, recipient, token, rcpt_options)
        try:
            route = await self._core.resolve_route(
                CHANNEL, {"address": recipient, "sender": sender}
            )
        except Exception as exc:
            # A database hiccup must not bounce the mail for good: the sender retries 4xx.
            return self._lookup_failed(exc)
        if route is None:
            return f"550 5.1.1 No such recipient or sender not allowed ({ROUTE_RULE})"
        self._routes.setdefault(envelope, {})[recipient] = route
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        """Parse the message and start one turn per routed recipient."""
        raw = envelope.original_content
        if raw is None:
            raw = (
                envelope.content.encode("utf-8", "surrogateescape")
                if isinstance(envelope.content, str)
                else envelope.content or b""
            )
        if len(raw) > MAX_MESSAGE_BYTES:  # aiosmtpd's data_size_limit answers first
            return _TOO_LARGE
        envelope_sender = _envelope_sender(envelope)
        try:
            # Up to a megabyte of MIME, parsed in pure Python: off the event loop, so one
            # mail does not hold up every other request while it is taken apart.
            mail = await asyncio.to_thread(parse_mail, raw, _envelope_address(envelope))
        except TooManyParts:
            log.info("email: refused a message of more than %d MIME parts", MAX_MULTIPARTS)
            return f"554 5.6.0 Message has too many MIME parts ({PARTS_RULE})"
        except Exception as exc:
            # Its type and where, not its text or traceback: the email package's errors
            # quote the header they choked on (an IndexError raised while handling a
            # HeaderParseError "... but found '<the rest of the header>'").
            log.warning("email: unparseable message (%s at %s)", type(exc).__name__, raised_at(exc))
            return f"554 5.6.0 Message could not be parsed ({PARSE_RULE})"
        if mail is None:
            return f"550 5.6.0 Message has no text body ({BODY_RULE})"
        if mail.automatic:
            log.info("email: dropped automatic mail %s (RFC 3834)", mail.message_id)
            return "250 2.0.0 OK"

        tokens = self._tokens.pop(envelope, {})
        answers: list[Answer] = []
        for token in dict.fromkeys(tokens.values()):
            answer = await self._answer_card(token, mail, envelope_sender)
            if answer.kind == "unavailable":
                # Nothing may have been recorded: the sending server retries, and a
                # decision that did land is then found decided (harmless).
                return _TEMPFAIL
            answers.append(answer)
        routes = self._routes.pop(envelope, {})
        if answers and not routes:
            return "250 2.0.0 OK"
        accepted: list[tuple[str, RouteMatch]] = []
        # Parts not taken, with the rule why: said in the log when the mail is taken all
        # the same (its sender is told nothing else).
        refused: list[tuple[str, str]] = []
        for recipient, route in routes.items():
            if mail.sender != envelope_sender:
                # The reply goes to From:, so From: must be allowed too.
                try:
                    found = await self._core.resolve_route(
                        CHANNEL, {"address": recipient, "sender": mail.sender}
                    )
                except Exception as exc:
                    return self._lookup_failed(exc)
                if found is None:
                    refused.append((recipient, SENDER_RULE))
                    continue
                route = found
            accepted.append((recipient, route))
        if not accepted and not answers:
            return _SENDER_REFUSED

        # Whether some part of the mail was taken (a card decided or answered, a routed
        # recipient's message recorded): the mail's one answer cannot refuse it then.
        taken = bool(answers)
        for recipient, route in accepted:
            # One correspondent however its domains are written (bücher.example or
            # xn--bcher-kva.example): one session, one Message-ID taken once.
            who = f"{fold_address(recipient)}:{mail.correspondent}"
            try:
                threaded, session_key = await self._thread(mail, who, recipient, route)
            except Exception as exc:
                return self._lookup_failed(exc, "thread lookup")
            inbound = Inbound(
                channel=BindingKind.email,
                route_attrs={"address": recipient, "sender": mail.sender},
                # The thread with this sender: whoever else writes into it (or quotes its
                # Message-IDs) gets a session of their own, never this one's task or answer.
                session_key=session_key,
                text=mail.text,
                address={
                    # As written: its case kept (sessions and routes compare it folded).
                    "to": mail.reply_to,
                    "from": recipient,
                    "subject": reply_subject(mail.subject),
                    "in_reply_to": mail.message_id,
                    "references": threaded.references,
                },
                # Per recipient: one mail to two routed addresses is two triggers. Per
                # sender: the key is unique across organizations, and another sender's
                # mail under the same Message-ID (quoted or made up), taken first, made
                # this one a duplicate, dropped after its 250.
                external_event_id=bounded(f"email:{who}:{mail.message_id}", EVENT_ID_LIMIT),
            )
            # Recorded before the 250: once the sender is told OK, the mail is ours.
            try:
                await accept(self._core, inbound, name=f"email-turn {mail.message_id}")
            except DatabaseDamaged as exc:
                self.damaged.add(exc.detail)
                return _TEMPFAIL
            except LeadgateError as exc:
                if exc.status >= 500:
                    log.warning("email: could not record the mail (%s); asking to retry", exc.rule)
                    return _TEMPFAIL
                # This recipient's part alone (its agent deactivated since its route was
                # made, say): one answer covers every recipient, and a 554 would bounce
                # the parts the others took (answered all the same), or, coming first,
                # keep them from being taken at all.
                refused.append((recipient, exc.rule))
                continue
            except Exception as exc:
                log.error("email: recording the mail failed", exc_info=loggable(exc))
                return _TEMPFAIL
            taken = True
        if not taken:
            log.info("email: refused a mail: %s", ", ".join(rule for _, rule in refused))
            # The rule of the first part refused (the log names them all).
            return f"554 5.6.0 Message could not be processed ({refused[0][1]})"
        for recipient, rule in refused:
            # Nobody else is told: the sender got a 250 for the parts that were taken.
            log.warning("email: took a mail but not its part to %s: %s", recipient, rule)
        return "250 2.0.0 OK"

    async def _thread(
        self, mail: ParsedMail, who: str, recipient: str, route: RouteMatch
    ) -> tuple[ParsedMail, str]:
        """``mail`` as threaded with the correspondent ``who`` (``recipient:sender``,
        folded), and the key of its session.

        A mail whose ``In-Reply-To`` alone names one the thread of which nothing else
        tells (:attr:`ParsedMail.lone_parent`) continues the session of the mail it
        names: the person's own earlier mail (they added to it, or their client answered
        their sent copy), its event looked up (one seek of the event ids' unique index;
        the event id names ``who``), else one of our replies sent before our Message-IDs
        carried their thread, looked up by the delivery that sent it (one seek of
        ``ix_deliveries_email_reply_external``), in the route's organization and only
        when it went to this correspondent from this recipient. Never another's session;
        other mail asks nothing."""
        prefix = f"email:{who}:"
        key = bounded(f"{prefix}{mail.root_id}", SESSION_KEY_LIMIT)
        if not mail.lone_parent:
            return mail, key
        event = bounded(f"{prefix}{mail.lone_parent}", EVENT_ID_LIMIT)
        found = await self._core.event_session_key(event)
        if found is None:
            found = await self._core.email_reply_session_key(
                route.org_id, mail.lone_parent, sent_to=mail.sender, sent_from=recipient
            )
        if found is None or found == key or not found.startswith(prefix):
            return mail, key
        root = found.removeprefix(prefix)
        # The thread's first Message-ID, unless the key had to be cut to a digest (one
        # of hundreds of characters): the session goes on all the same.
        if bounded(f"{prefix}{root}", SESSION_KEY_LIMIT) == found:
            mail = mail.in_thread(root)
        return mail, found

    async def handle_exception(self, error: Exception) -> str:
        """aiosmtpd's hook for what handling a command raised past our own handling (a
        bug): ``451``, so that the sending server keeps the mail and retries, and one
        ERROR line with the traceback. aiosmtpd's own answer was a permanent ``500
        Error: (<type>) <its text>``: the mail bounced for good, its text (which may
        quote the mail) told to the sender, the traceback logged as it stood."""
        log.error(
            "email: handling an SMTP command failed; asking to retry", exc_info=loggable(error)
        )
        return _TEMPFAIL

    def answer_cards(self, reviews: ChatReviewBackend, reply_address: str) -> None:
        """Take replies to review cards at ``reply_address`` plus a token, decided (and
        answered, through the outbox) by ``reviews``."""
        self._reviews = reviews
        self._reply_address = reply_address

    async def _card_recipient(
        self,
        envelope: Envelope,
        address: str,
        recipient: str,
        token: str,
        rcpt_options: list[str],
    ) -> str:
        """RCPT of a card reply address: taken when its token names a card."""
        assert self._reviews is not None
        if not token:
            return _NO_CARD
        try:
            card = await self._reviews.reply_card(token)
        except Exception as exc:
            return self._lookup_failed(exc)
        if card is None:
            return _NO_CARD
        self._tokens.setdefault(envelope, {})[recipient] = token
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 OK"

    async def _answer_card(self, token: str, mail: ParsedMail, envelope_sender: str) -> Answer:
        """The reply's decision on the card of ``token``, and the answer mail to its
        sender queued in the outbox (both committed when this returns, unless it is
        ``unavailable``)."""
        assert self._reviews is not None
        verb, rest = parse_reply(mail.text)
        answer_to = AnswerTo(
            to=mail.reply_to,
            subject=reply_subject(mail.subject),
            in_reply_to=mail.message_id,
            references=mail.references,
        )
        return await self._reviews.email_reply(
            token, mail.sender, envelope_sender, verb, rest, answer_to
        )

    def _lookup_failed(self, exc: Exception, what: str = "route lookup") -> str:
        """A lookup (``what``: a route's, a thread's) that raised: 451 (the sender
        retries), said in the log as a runner says it: a damaged database in
        :attr:`damaged`'s line, the database unavailable (a 5xx :class:`LeadgateError`)
        in a line without a traceback, and anything else (a bug) with its traceback."""
        if isinstance(exc, DatabaseDamaged):
            self.damaged.add(exc.detail)
        elif isinstance(exc, LeadgateError) and exc.status >= 500:
            log.warning("email: %s met a database fault (%s); asking to retry", what, exc.rule)
        else:
            log.error("email: %s failed", what, exc_info=loggable(exc))
        return _TEMPFAIL


#: Routed recipients taken per mail (RFC 5321 asks a server to take at least 100 RCPT
#: commands; a mail to more is delivered again for the rest, after a 452).
MAX_RECIPIENTS = 100


# ----------------------------------------------------------------------------- adapter


#: How aiosmtpd words its refusals of a mail over ``data_size_limit`` (``552 Error:
#: message size exceeds fixed maximum message size``, ``552 Error: Too much mail data``).
_LIBRARY_TOO_LARGE = "552 Error:"


class _CountedSMTP(SMTP):
    """aiosmtpd's session protocol, counted in its adapter's ``open_sessions`` from its
    creation until its connection is lost (``[email] max_connections``).

    Counted when made, not in ``connection_made``: asyncio accepts up to its backlog of
    connections at once and makes each one's protocol before any ``connection_made``
    runs, so a count taken there let 141 sessions past a limit of 100 (a throwaway probe
    of 3,000 connections at once). Without TLS, asyncio schedules ``connection_made`` in
    the same step that makes the protocol, so ``connection_lost`` follows for each."""

    def __init__(self, adapter: EmailAdapter, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adapter = adapter
        self._counted = True
        adapter.open_sessions += 1

    def connection_lost(self, error: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._adapter.open_sessions -= 1
        super().connection_lost(error)

    async def push(self, status: AnyStr) -> None:
        """Send ``status``; aiosmtpd's own refusal of a mail over ``data_size_limit``
        (at ``MAIL FROM`` for a declared ``SIZE``, or after ``DATA``, whose lines past
        the limit it reads and drops, keeping none) is our rule-named one instead."""
        if isinstance(status, str) and status.startswith(_LIBRARY_TOO_LARGE):
            await super().push(_TOO_LARGE)
            return
        await super().push(status)


class _TooManySessions(asyncio.Protocol):
    """A connection beyond ``[email] max_connections``: ``421`` and closed at once (RFC
    5321 3.8), before any SMTP session or read. The sending server keeps the mail and
    retries later; a flood of idle connections cannot hold more than the limit."""

    def __init__(self, adapter: EmailAdapter) -> None:
        self._adapter = adapter

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self._adapter.refusals.add(self._adapter.max_connections)
        host = self._adapter.hostname
        transport.write(f"421 4.3.2 {host} too many connections, try again later\r\n".encode())
        transport.close()


class EmailAdapter:
    """The SMTP listener (when configured) plus :class:`EmailChannel`."""

    def __init__(
        self,
        settings: EmailSettings,
        core: Core,
        *,
        send_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        hostname: str | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._idle_timeout_s = idle_timeout_s
        self._hostname = hostname or socket.gethostname() or "localhost"
        self.handler = EmailHandler(core)
        self.channel = EmailChannel(
            settings, timeout_s=send_timeout_s, local_hostname=self._hostname
        )
        #: bound inbound port once started (None: not listening)
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: weakref.WeakSet[SMTP] = weakref.WeakSet()
        #: SMTP sessions whose connection is open now
        self.open_sessions = 0
        #: connections refused with 421 (counted; one WARNING every 10 s at most)
        self.refusals = Tally(
            log,
            "email: %d SMTP connection(s) refused (421) at [email] max_connections = %d",
            now=now,
        )

    @property
    def hostname(self) -> str:
        """The name the listener greets with."""
        return self._hostname

    @property
    def max_connections(self) -> int:
        """``[email] max_connections``."""
        return self._settings.max_connections

    @property
    def listens(self) -> bool:
        """Whether inbound SMTP is configured (port 0 = any free port)."""
        return self._settings.listens

    def enable_reviews(self, backend: ChatReviewBackend) -> None:
        """Take replies to email review cards when ``[email] review_reply_address`` is
        set (the composition root calls this on every adapter that offers it)."""
        if self._settings.review_reply_address:
            self.handler.answer_cards(backend, self._settings.review_reply_address)

    def mount(self, app: web.Application) -> None:
        """Email has no HTTP routes (the SMTP listener runs in :meth:`lifespan`)."""

    def _protocol(self) -> asyncio.BaseProtocol:
        if self.open_sessions >= self.max_connections:
            return _TooManySessions(self)
        smtp = _CountedSMTP(
            self,
            self.handler,
            data_size_limit=MAX_MESSAGE_BYTES,
            enable_SMTPUTF8=True,
            hostname=self._hostname,  # aiosmtpd would call socket.getfqdn() per connection
            ident="leadgate ESMTP",
            timeout=self._idle_timeout_s,
            loop=asyncio.get_running_loop(),
        )
        self._connections.add(smtp)
        return smtp

    async def start(self) -> None:
        """Start listening (idempotent); sets :attr:`port`."""
        if not self.listens or self._server is not None:
            return
        host = self._settings.listen_host or "127.0.0.1"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, self._settings.listen_port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("email: SMTP listening on %s:%s", host, self.port)

    async def stop(self) -> None:
        """Stop listening and close open SMTP sessions."""
        if self._server is not None:
            self._server.close()
            for smtp in list(self._connections):
                if smtp.transport is not None:
                    smtp.transport.close()
            await self._server.wait_closed()
            self._server = None
        await self.channel.close()

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Run the SMTP listener (when configured) for the duration of the block."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()


def create(settings: Settings, core: Core) -> Adapter | None:
    """The email adapter, or None when neither inbound nor outbound is configured.

    Inbound listens when ``listen_host`` or ``listen_port`` is set (host defaults to
    127.0.0.1, port 0 picks a free port); outbound needs ``smtp_host``.
    """
    mail = settings.email
    if not mail.on:
        return None
    return EmailAdapter(mail, core)
