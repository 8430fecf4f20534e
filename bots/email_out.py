"""Email, outbound: a threaded reply sent with aiosmtplib, step by step.

:class:`EmailChannel` drives the SMTP exchange itself so that it knows whether the
message's final dot was written: a failure before it is :class:`~outbox.channel.Retry`,
after it :class:`~outbox.channel.Uncertain` (see :meth:`EmailChannel._deliver`). Each
delivery carries a deterministic ``Message-ID`` derived from its idempotency key.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import email.utils
import logging
import re
import socket
from email.message import EmailMessage
from typing import Any

import aiosmtplib

from bots.email_parse import MAX_CHARS, one_line, thread_mark
from leadgate.core.config import EmailSettings
from outbox.channel import (
    OutboundMessage,
    Permanent,
    Retry,
    SendOutcome,
    Sent,
    Uncertain,
    too_little_left,
)
from outbox.store import SEND_DEADLINE_S

log = logging.getLogger(__name__)

CHANNEL = "email"
#: The most a QUIT after an accepted message is waited for.
QUIT_TIMEOUT_S = 5.0


# ----------------------------------------------------------------------------- outbound


def message_id_for(idempotency_key: str, from_address: str, thread: str = "") -> str:
    """``<{key}@{domain of from}>``: the same delivery always carries the same id; with
    ``thread`` (its thread's first Message-ID) ``<{key}.t.{thread, base32}@...>``, so
    that a reply naming it alone (``In-Reply-To``, no ``References``) finds the thread."""
    local = re.sub(r"[^A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]", "-", idempotency_key)
    local = re.sub(r"\.{2,}", ".", local).strip(".") or "leadgate"
    local += thread_mark(thread)
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
    if address.get("reply_to"):
        # A review card answerable by reply: the reply goes to the card's own address.
        msg["Reply-To"] = str(address["reply_to"])
    elif bound_from and bound_from.lower() != email.utils.parseaddr(from_address)[1].lower():
        # A configured from_address (e.g. a no-reply sender) must not break the thread.
        msg["Reply-To"] = bound_from
    msg["Subject"] = one_line(address.get("subject")) or "Re:"
    references = one_line(address.get("references")).split()
    msg["Message-ID"] = message_id_for(
        idempotency_key, from_address, references[0] if references else ""
    )
    msg["Date"] = email.utils.formatdate(usegmt=True)
    if address.get("in_reply_to"):
        msg["In-Reply-To"] = one_line(address["in_reply_to"])
    if address.get("references"):
        msg["References"] = one_line(address["references"])
    # RFC 3834: a generated reply; well-behaved auto-responders will not answer it.
    msg["Auto-Submitted"] = "auto-replied"
    msg.set_content(text)
    return msg


def _smtp_payload(msg: EmailMessage, *, utf8: bool = False) -> bytes:
    """The DATA payload: CRLF lines, dot-stuffed, ending with the final ``.``
    (``utf8``: headers as UTF-8, RFC 6532, for an SMTPUTF8 transaction)."""
    data = msg.as_bytes(policy=email.policy.SMTPUTF8 if utf8 else email.policy.SMTP)
    data = re.sub(rb"(?m)^\.", b"..", data)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"


def _by_code(code: int, what: str, said: str = "") -> SendOutcome:
    """The outcome of a refusal with SMTP ``code``; ``said``: the relay's words, when they
    may quote the message (a reply to its content: see ``outbox.channel``)."""
    if 400 <= code < 500:
        return Retry(f"{what} (temporary, {code})", said=said)
    if code >= 500:
        return Permanent(f"{what} ({code})", said=said)
    return Retry(f"{what} (unexpected reply {code})", said=said)


class EmailChannel:
    """Sends replies through the configured SMTP relay (``smtp_host``)."""

    name = CHANNEL
    max_chars = MAX_CHARS

    def __init__(
        self,
        settings: EmailSettings,
        *,
        timeout_s: float = 30.0,
        deadline_s: float = SEND_DEADLINE_S,
        local_hostname: str | None = None,
    ) -> None:
        if deadline_s <= timeout_s:
            raise ValueError("deadline_s must be longer than timeout_s")
        self._settings = settings
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
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
        envelope_from = email.utils.parseaddr(from_address)[1]
        envelope_to = email.utils.parseaddr(str(address["to"]))[1]
        # A correspondent at jürgen@exämple.de is answered there: SMTPUTF8 (RFC 6531).
        utf8 = not (envelope_from + envelope_to).isascii()
        try:
            msg = build_reply(address, message.text, message.idempotency_key, from_address)
            payload = _smtp_payload(msg, utf8=utf8)
        except (ValueError, TypeError, UnicodeError) as exc:
            return Permanent(f"email: cannot build the message: {exc}")
        deadline_s = message.budget_s(self._deadline_s)
        if deadline_s <= self._timeout_s:
            # The answer to the message could not be waited for within the deadline.
            return too_little_left(
                "email", deadline_s, self._timeout_s, "the answer to the message"
            )
        outcome = await self._deliver(
            envelope_from, envelope_to, payload, utf8=utf8, deadline_s=deadline_s
        )
        if isinstance(outcome, Sent):
            return Sent(str(msg["Message-ID"]))
        return outcome

    # One body on purpose: the SMTP exchange step by step, each step's failure mapped
    # to Retry (before the final dot) or Uncertain (after it).
    async def _deliver(
        self, mail_from: str, rcpt_to: str, payload: bytes, *, utf8: bool, deadline_s: float
    ) -> SendOutcome:
        """One SMTP transaction, done step by step.

        ``aiosmtplib.send`` raises the same timeout/disconnect errors whether they happen
        before the message was transmitted or while waiting for the server's verdict on
        it. Here DATA is sent as a command and, after ``354``, the content and its final
        dot are written with the protocol's ``write``: a failure before that write is a
        :class:`Retry` (nothing was handed over), one after it is :class:`Uncertain`
        (the server may have queued the message before the connection broke).

        The whole send ends within ``deadline_s`` (the channel's own, at most
        :data:`SEND_DEADLINE_S`, or what is left of its delivery's: the message's
        ``within_s``): each step waits at most ``timeout_s``, the steps before the
        message (connect, greeting, EHLO, STARTTLS, AUTH, MAIL, RCPT, DATA) end within
        ``deadline_s - timeout_s`` together (past it: :class:`Retry`), so the answer to
        the message, waited for ``timeout_s``, comes within the deadline too; a QUIT
        after it gets what is left. Each step alone was bounded, and a relay slow at
        every step kept a send past its lease.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        before_message_s = deadline_s - self._timeout_s
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
                async with asyncio.timeout_at(deadline - self._timeout_s):
                    await smtp.connect()
                    options: list[str] = []
                    if utf8:
                        if smtp.is_ehlo_or_helo_needed:
                            await smtp.ehlo()
                        if not smtp.supports_extension("smtputf8"):
                            return Permanent(
                                "email: the relay does not offer SMTPUTF8, which a non-ASCII "
                                "address needs"
                            )
                        options = ["SMTPUTF8"]
                    encoding = "utf-8" if utf8 else "ascii"
                    await smtp.mail(mail_from, options=options, encoding=encoding)
                    await smtp.rcpt(rcpt_to, encoding=encoding)
                    start = await smtp.execute_command(b"DATA")
            except aiosmtplib.SMTPResponseException as exc:
                return _by_code(exc.code, f"email: server refused: {exc.message}")
            except aiosmtplib.SMTPRecipientsRefused as exc:
                return Permanent(f"email: recipients refused: {exc}")
            except (aiosmtplib.SMTPTimeoutError, aiosmtplib.SMTPServerDisconnected) as exc:
                return Retry(f"email: {type(exc).__name__} before the message was sent: {exc}")
            except TimeoutError:  # asyncio.timeout_at's (aiosmtplib's are caught above)
                return Retry(
                    f"email: the relay took longer than {before_message_s:g} s before the "
                    "message could be sent"
                )
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
            if 200 <= reply.code < 300:
                # 250 is the answer RFC 5321 names, but any 2yz is "completed": the
                # server took the message, and a retry would deliver it twice.
                await self._quit(smtp, deadline - loop.time())
                return Sent()
            if reply.code < 400:
                return Uncertain(
                    f"email: unexpected reply {reply.code} after the message was sent",
                    said=reply.message,
                )
            # (The relay's reply to the content may quote it: stored, never logged.)
            return _by_code(reply.code, "email: message refused", reply.message)
        finally:
            smtp.close()

    async def _quit(self, smtp: aiosmtplib.SMTP, left_s: float) -> None:
        if left_s <= 0:
            return  # the send's deadline: closing the connection does as well
        try:
            await smtp.quit(timeout=min(self._timeout_s, QUIT_TIMEOUT_S, left_s))
        except Exception:  # the message is already accepted; QUIT is a courtesy
            log.debug("email: QUIT failed", exc_info=True)

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """A sent mail cannot be edited (review cards by email are never updated)."""
        return Permanent("email: a sent message cannot be edited")

    async def close(self) -> None:
        """Nothing to release: one connection per send."""
