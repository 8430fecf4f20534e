"""Email, parsing: the text of an inbound mail and the threading of its reply.

Plain text is extracted from the message (HTML as a fallback, charsets decoded safely),
quoted text is stripped, and the ids a reply threads on (``Message-ID``, ``References``)
are collected. Automatic mail (RFC 3834) is recognised so that it runs no turn.
"""

from __future__ import annotations

import codecs
import email
import email.policy
import email.utils
import hashlib
import html
import logging
import re
from dataclasses import dataclass
from email.message import EmailMessage

log = logging.getLogger(__name__)

MAX_CHARS = 1_000_000
# Long threads would grow References without bound; RFC 5322 allows trimming the middle.
MAX_REFERENCES = 20

# No blanks or control characters: an id goes back out in In-Reply-To and References.
_MSGID = re.compile(r"<[^<>\s\x00-\x1f\x7f]+>")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
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


def one_line(value: object) -> str:
    """``value`` on one line: runs of blanks and control characters (a NUL from an
    encoded word, say) become one space."""
    return " ".join(_CONTROL.sub(" ", str(value or "")).split())


def utf8_address(address: str) -> str | None:
    """An address as the text it is: ``None`` when it is not UTF-8 or holds a control
    character. The email package and aiosmtpd hand 8-bit bytes over as surrogate escapes
    (an SMTPUTF8 ``jürgen@example.de`` too); those are decoded here, and an address that
    does not decode could be neither stored (the databases refuse lone surrogates) nor
    written to again."""
    try:
        text = address.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return None
    return None if _CONTROL.search(text) else text


def reply_subject(subject: str) -> str:
    """``Re: <subject>``, without doubling an existing ``Re:``."""
    subject = one_line(subject)
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
    if len(chain) > MAX_REFERENCES:
        chain = [chain[0], *chain[-(MAX_REFERENCES - 1) :]]

    header_from = ""
    try:
        addresses = message["From"].addresses if message["From"] is not None else ()
        if addresses:
            header_from = utf8_address(addresses[0].addr_spec) or ""
    except Exception:  # an unparseable From header: fall back to the envelope
        header_from = ""
    sender = (header_from or envelope_sender).strip().lower()

    auto = one_line(message.get("Auto-Submitted")).lower()
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
        subject=one_line(message.get("Subject")),
        references=" ".join(chain),
        text=text,
        automatic=automatic,
    )
