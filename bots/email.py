"""Email: an SMTP listener in the service's own event loop, and an SMTP sender.

Inbound (``[email] listen_host`` / ``listen_port``): ``aiosmtpd``'s ``SMTP`` protocol
served with ``loop.create_server`` (not aiosmtpd's ``Controller``, which runs a second
thread and loop). Authenticity is the route's sender allow-list:

* ``RCPT TO``: the recipient and the envelope sender must resolve to a route, otherwise
  ``550 5.1.1 No such recipient or sender not allowed``, so that the sending server
  bounces and the human learns at once (accepting and dropping would be silent);
* ``DATA``: the ``From:`` header, the address a reply goes to, must be allowed as well
  (otherwise ``550 5.7.1``); the message must be at most 1 MB (``552``) and have a
  non-empty text body after quoted text is removed (``550 5.6.0``).

Accepted mail is answered ``250`` at once and runs one turn per routed recipient in the
background. Automatic mail (null sender, ``Auto-Submitted`` other than ``no``) is
accepted and dropped so that two auto-responders cannot loop (RFC 3834).

Outbound: :class:`EmailChannel` sends a threaded reply with ``aiosmtplib``, step by step,
so that it knows whether the message's final dot was written (see :meth:`_deliver`).
"""

from __future__ import annotations

import asyncio
import codecs
import email
import email.policy
import email.utils
import hashlib
import html
import logging
import re
import socket
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any

import aiosmtplib
from aiohttp import web
from aiosmtpd.smtp import SMTP, Envelope, Session

from bots.base import Adapter, Core, RouteMatch
from engine.config import EmailSettings, Settings
from engine.types import BindingKind, BindingSpec, Trigger
from outbox.channel import Channel, OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain

log = logging.getLogger(__name__)

CHANNEL = "email"
MAX_MESSAGE_BYTES = 1_048_576
MAX_CHARS = 1_000_000
# Long threads would grow References without bound; RFC 5322 allows trimming the middle.
_MAX_REFERENCES = 20

_TEMPFAIL = "451 4.3.0 Temporary failure, please try again later"

_MSGID = re.compile(r"<[^<>\s]+>")
_WROTE = re.compile(r"\bwrote:\s*$", re.IGNORECASE)
_ORIGINAL = re.compile(r"^\s*-{2,}\s*(Original Message|Forwarded message)\s*-{2,}", re.I)
_HTML_DROP = re.compile(r"<(script|style|head)\b.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_HTML_BREAK = re.compile(r"<\s*(br|/p|/div|/li|/tr|/h[1-6])\b[^>]*>", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]*>")


# ----------------------------------------------------------------------------- parsing


def _decode_part(part: email.message.Message) -> str:
    """A text part's content as str; unknown charsets and bad bytes never raise."""
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset() or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        charset = "utf-8"
    return payload.decode(charset, errors="replace")


def _html_to_text(markup: str) -> str:
    """A crude HTML-to-text conversion; good enough for a chat message."""
    text = _HTML_DROP.sub("", markup)
    text = re.sub(r"<blockquote\b.*?</blockquote\s*>", "", text, flags=re.I | re.S)
    text = _HTML_BREAK.sub("\n", text)
    text = html.unescape(_HTML_TAG.sub("", text)).replace("\xa0", " ")
    return "\n".join(line.strip() for line in text.splitlines())


def extract_text(message: email.message.EmailMessage) -> str | None:
    """The message's text: text/plain, else text/html stripped; None when there is none."""
    try:
        part = message.get_body(preferencelist=("plain",))
        if part is not None:
            return _decode_part(part)
        part = message.get_body(preferencelist=("html",))
        if part is not None:
            return _html_to_text(_decode_part(part))
    except Exception:  # a malformed MIME tree: treat as having no text
        log.info("email: could not walk the MIME structure", exc_info=True)
    return None


def strip_quoted(text: str) -> str:
    """Drop quoted reply text: ``>`` lines and everything from "On ... wrote:" on."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    kept: list[str] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if _ORIGINAL.match(stripped):
            break
        if stripped.startswith("On ") and (
            _WROTE.search(stripped)
            # clients wrap a long attribution line: "On Mon, ... Alice <\na@x> wrote:"
            or (i + 1 < len(lines) and _WROTE.search(lines[i + 1].strip()))
        ):
            break
        if stripped.startswith(">"):
            continue
        kept.append(line.rstrip())
    return "\n".join(kept).strip()


def _msgids(value: object) -> list[str]:
    return _MSGID.findall(str(value)) if value else []


def _one_line(value: object) -> str:
    return " ".join(str(value or "").split())


def reply_subject(subject: str) -> str:
    """``Re: <subject>``, without doubling an existing ``Re:``."""
    subject = _one_line(subject)
    if subject.lower().startswith("re:"):
        return subject
    return f"Re: {subject}".strip()


@dataclass(frozen=True)
class ParsedMail:
    """What the turn needs from one inbound message."""

    message_id: str
    root_id: str
    sender: str
    subject: str
    references: str
    text: str
    automatic: bool


def parse_mail(raw: bytes, envelope_sender: str) -> ParsedMail | None:
    """Parse ``raw``; None when it has no text body (after quoted text is removed)."""
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    own = _msgids(message.get("Message-ID"))
    # A missing Message-ID is derived from the content so that a resent copy of the
    # same message still de-duplicates.
    message_id = own[0] if own else f"<{hashlib.sha256(raw).hexdigest()[:32]}@leadgate.invalid>"
    references = _msgids(message.get("References"))
    in_reply_to = _msgids(message.get("In-Reply-To"))
    root_id = (references or in_reply_to or [message_id])[0]
    parent_chain = references or in_reply_to[:1]
    chain = [*parent_chain, message_id]
    if len(chain) > _MAX_REFERENCES:
        chain = [chain[0], *chain[-(_MAX_REFERENCES - 1) :]]

    header_from = ""
    try:
        addresses = message["From"].addresses if message["From"] is not None else ()
        if addresses:
            header_from = addresses[0].addr_spec
    except Exception:  # an unparseable From header: fall back to the envelope
        header_from = ""
    sender = (header_from or envelope_sender).strip().lower()

    auto = _one_line(message.get("Auto-Submitted")).lower()
    automatic = not envelope_sender or (bool(auto) and auto != "no")

    body = extract_text(message)
    if body is None:
        return None
    text = strip_quoted(body)
    if not text:
        return None
    return ParsedMail(
        message_id=message_id,
        root_id=root_id,
        sender=sender,
        subject=_one_line(message.get("Subject")),
        references=" ".join(chain),
        text=text,
        automatic=automatic,
    )


# ----------------------------------------------------------------------------- inbound


def _envelope_sender(envelope: Envelope) -> str:
    """The MAIL FROM address, lower-case; "" for the null reverse-path of bounces."""
    sender = (envelope.mail_from or "").strip().lower()
    # aiosmtpd reports MAIL FROM:<> as "<>"
    return "" if sender == "<>" else sender


class EmailHandler:
    """aiosmtpd handler: route check at RCPT, parse and hand over at DATA."""

    def __init__(self, core: Core) -> None:
        self._core = core
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
        try:
            route = await self._core.resolve_route(
                CHANNEL, {"address": recipient, "sender": sender}
            )
        except Exception:
            # A database hiccup must not bounce the mail for good: the sender retries 4xx.
            log.exception("email: route lookup failed")
            return _TEMPFAIL
        if route is None:
            return "550 5.1.1 No such recipient or sender not allowed"
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
            return "552 5.3.4 Message too big"
        envelope_sender = _envelope_sender(envelope)
        try:
            mail = parse_mail(raw, envelope_sender)
        except Exception:
            log.warning("email: unparseable message", exc_info=True)
            return "554 5.6.0 Message could not be parsed"
        if mail is None:
            return "550 5.6.0 Message has no text body"
        if mail.automatic:
            log.info("email: dropped automatic mail %s (RFC 3834)", mail.message_id)
            return "250 2.0.0 OK"

        routes = self._routes.pop(envelope, {})
        accepted: list[tuple[str, RouteMatch]] = []
        for recipient, route in routes.items():
            if mail.sender != envelope_sender:
                # The reply goes to From:, so From: must be allowed too.
                try:
                    found = await self._core.resolve_route(
                        CHANNEL, {"address": recipient, "sender": mail.sender}
                    )
                except Exception:
                    log.exception("email: route lookup failed")
                    return _TEMPFAIL
                if found is None:
                    continue
                route = found
            accepted.append((recipient, route))
        if not accepted:
            return "550 5.7.1 Sender not allowed"

        for recipient, route in accepted:
            trigger = Trigger(
                org_id=route.org_id,
                agent_id=route.agent_id,
                session_key=f"email:{recipient}:{mail.root_id}",
                text=mail.text,
                binding=BindingSpec(
                    BindingKind.email,
                    {
                        "to": mail.sender,
                        "from": recipient,
                        "subject": reply_subject(mail.subject),
                        "in_reply_to": mail.message_id,
                        "references": mail.references,
                    },
                    silent=route.silent,
                    route_id=route.route_id,
                ),
                # Per recipient: one mail to two routed addresses is two triggers.
                external_event_id=f"email:{recipient}:{mail.message_id}",
            )
            self._core.spawn(self._core.submit(trigger), name=f"email-turn {mail.message_id}")
        return "250 2.0.0 OK"


# ----------------------------------------------------------------------------- outbound


def message_id_for(idempotency_key: str, from_address: str) -> str:
    """``<{key}@{domain of from}>``: the same delivery always carries the same id."""
    local = re.sub(r"[^A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]", "-", idempotency_key)
    local = re.sub(r"\.{2,}", ".", local).strip(".") or "leadgate"
    domain = email.utils.parseaddr(from_address)[1].rpartition("@")[2] or "leadgate.invalid"
    return f"<{local}@{domain}>"


def build_reply(
    address: dict[str, Any], text: str, idempotency_key: str, from_address: str
) -> EmailMessage:
    """The reply as a MIME message (raises ValueError for unusable header values)."""
    msg = EmailMessage()
    msg["From"] = from_address
    msg["To"] = str(address["to"])
    bound_from = str(address.get("from") or "")
    if bound_from and bound_from.lower() != email.utils.parseaddr(from_address)[1].lower():
        # A configured from_address (e.g. a no-reply sender) must not break the thread.
        msg["Reply-To"] = bound_from
    msg["Subject"] = _one_line(address.get("subject")) or "Re:"
    msg["Message-ID"] = message_id_for(idempotency_key, from_address)
    msg["Date"] = email.utils.formatdate(usegmt=True)
    if address.get("in_reply_to"):
        msg["In-Reply-To"] = _one_line(address["in_reply_to"])
    if address.get("references"):
        msg["References"] = _one_line(address["references"])
    # RFC 3834: a generated reply; well-behaved auto-responders will not answer it.
    msg["Auto-Submitted"] = "auto-replied"
    msg.set_content(text)
    return msg


def _smtp_payload(msg: EmailMessage) -> bytes:
    """The DATA payload: CRLF lines, dot-stuffed, ending with the final ``.``."""
    data = msg.as_bytes(policy=email.policy.SMTP)
    data = re.sub(rb"(?m)^\.", b"..", data)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"


def _by_code(code: int, what: str) -> SendOutcome:
    if 400 <= code < 500:
        return Retry(f"{what} (temporary, {code})")
    if code >= 500:
        return Permanent(f"{what} ({code})")
    return Retry(f"{what} (unexpected reply {code})")


class EmailChannel:
    """Sends replies through the configured SMTP relay (``smtp_host``)."""

    name = CHANNEL
    max_chars = MAX_CHARS

    def __init__(
        self,
        settings: EmailSettings,
        *,
        timeout_s: float = 30.0,
        local_hostname: str | None = None,
    ) -> None:
        self._settings = settings
        self._timeout_s = timeout_s
        # aiosmtplib would otherwise resolve the FQDN for EHLO on every connection.
        self._local_hostname = local_hostname or socket.gethostname() or "localhost"

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Send one reply; never raises for SMTP errors."""
        settings = self._settings
        if not settings.smtp_host:
            return Permanent("email: no [email] smtp_host configured")
        address = message.address
        from_address = settings.from_address or str(address.get("from") or "")
        if not address.get("to") or not from_address:
            return Permanent("email binding lacks a recipient or sender address")
        try:
            msg = build_reply(address, message.text, message.idempotency_key, from_address)
            payload = _smtp_payload(msg)
        except (ValueError, TypeError, UnicodeError) as exc:
            return Permanent(f"email: cannot build the message: {exc}")
        envelope_from = email.utils.parseaddr(from_address)[1]
        envelope_to = email.utils.parseaddr(str(address["to"]))[1]
        outcome = await self._deliver(envelope_from, envelope_to, payload)
        if isinstance(outcome, Sent):
            return Sent(str(msg["Message-ID"]))
        return outcome

    async def _deliver(self, mail_from: str, rcpt_to: str, payload: bytes) -> SendOutcome:
        """One SMTP transaction, done step by step.

        ``aiosmtplib.send`` raises the same timeout/disconnect errors whether they happen
        before the message was transmitted or while waiting for the server's verdict on
        it. Here DATA is sent as a command and, after ``354``, the content and its final
        dot are written with the protocol's ``write``: a failure before that write is a
        :class:`Retry` (nothing was handed over), one after it is :class:`Uncertain`
        (the server may have queued the message before the connection broke).
        """
        s = self._settings
        smtp = aiosmtplib.SMTP(
            hostname=s.smtp_host,
            port=s.smtp_port,
            username=s.smtp_username or None,
            password=s.smtp_password or None,
            start_tls=s.start_tls,
            timeout=self._timeout_s,
            local_hostname=self._local_hostname,
        )
        try:
            try:
                await smtp.connect()
                await smtp.mail(mail_from)
                await smtp.rcpt(rcpt_to)
                start = await smtp.execute_command(b"DATA")
            except aiosmtplib.SMTPResponseException as exc:
                return _by_code(exc.code, f"email: server refused: {exc.message}")
            except aiosmtplib.SMTPRecipientsRefused as exc:
                return Permanent(f"email: recipients refused: {exc}")
            except (aiosmtplib.SMTPTimeoutError, aiosmtplib.SMTPServerDisconnected) as exc:
                return Retry(f"email: {type(exc).__name__} before the message was sent: {exc}")
            except aiosmtplib.SMTPConnectError as exc:
                return Retry(f"email: cannot connect: {exc}")
            except OSError as exc:
                return Retry(f"email: network error before the message was sent: {exc}")
            except (aiosmtplib.SMTPException, ValueError, UnicodeError) as exc:
                # e.g. STARTTLS or AUTH required by config but not offered: a config issue
                return Permanent(f"email: {type(exc).__name__}: {exc}")
            if start.code != 354:
                return _by_code(start.code, f"email: DATA refused: {start.message}")

            protocol = smtp.protocol
            if protocol is None:
                return Retry("email: connection lost before the message was sent")
            try:
                protocol.write(payload)
            except aiosmtplib.SMTPServerDisconnected as exc:
                return Retry(f"email: connection lost before the message was sent: {exc}")
            # From here on the server may have the whole message. No await between the
            # write above and read_response below, so the reply cannot be missed.
            try:
                reply = await protocol.read_response(timeout=self._timeout_s)
            except aiosmtplib.SMTPTimeoutError as exc:
                return Uncertain(f"email: no reply after the message was sent: {exc}")
            except (aiosmtplib.SMTPServerDisconnected, OSError) as exc:
                return Uncertain(f"email: connection lost after the message was sent: {exc}")
            except aiosmtplib.SMTPException as exc:
                return Uncertain(f"email: unreadable reply after the message was sent: {exc}")
            if reply.code == 250:
                await self._quit(smtp)
                return Sent()
            return _by_code(reply.code, f"email: message refused: {reply.message}")
        finally:
            smtp.close()

    async def _quit(self, smtp: aiosmtplib.SMTP) -> None:
        try:
            await smtp.quit(timeout=min(self._timeout_s, 5.0))
        except Exception:  # the message is already accepted; QUIT is a courtesy
            log.debug("email: QUIT failed", exc_info=True)

    async def close(self) -> None:
        """Nothing to release: one connection per send."""


# ----------------------------------------------------------------------------- adapter


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
    ) -> None:
        self._settings = settings
        self._idle_timeout_s = idle_timeout_s
        self._hostname = hostname or socket.gethostname() or "localhost"
        self.handler = EmailHandler(core)
        self.email_channel = EmailChannel(
            settings, timeout_s=send_timeout_s, local_hostname=self._hostname
        )
        self.channel: Channel = self.email_channel
        #: bound inbound port once started (None: not listening)
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: weakref.WeakSet[SMTP] = weakref.WeakSet()

    @property
    def listens(self) -> bool:
        """Whether inbound SMTP is configured (port 0 = any free port)."""
        return bool(self._settings.listen_host or self._settings.listen_port)

    def mount(self, app: web.Application) -> None:
        """Run the SMTP listener for the app's lifetime (no HTTP routes)."""
        app.cleanup_ctx.append(self._lifecycle)

    def _protocol(self) -> SMTP:
        smtp = SMTP(
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

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
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
    if not (mail.listen_host or mail.listen_port or mail.smtp_host):
        return None
    return EmailAdapter(mail, core)
