"""Email, parsing: the text of an inbound mail and the threading of its reply.

Plain text is extracted from the message (HTML as a fallback, charsets decoded safely),
quoted text is stripped, and the ids a reply threads on (``Message-ID``, ``References``)
are collected. Automatic mail (RFC 3834) is recognised so that it runs no turn.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import hashlib
import html
import logging
import re
from dataclasses import dataclass
from email.message import EmailMessage

from leadgate.core.logs import raised_at

log = logging.getLogger(__name__)

MAX_CHARS = 1_000_000
# Long threads would grow References without bound; RFC 5322 allows trimming the middle.
MAX_REFERENCES = 20
#: ``multipart`` parts a message may declare: real mail nests a handful (alternative
#: inside mixed inside a forward); 3,000 nested ones took 2.4 s of parsing.
MAX_MULTIPARTS = 100
_MULTIPART = re.compile(rb"content-type:[ \t]*multipart/", re.IGNORECASE)


class TooManyParts(ValueError):
    """The message declares more than :data:`MAX_MULTIPARTS` multipart parts."""


# No blanks or control characters: an id goes back out in In-Reply-To and References.
_MSGID = re.compile(r"<[^<>\s\x00-\x1f\x7f]+>")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: How an attribution line ("On <date>, <someone> wrote:") starts, in the languages of
#: the clients below: English, German, French, Spanish, Italian, Dutch, Portuguese.
_ATTRIBUTION_OPENERS = ("On ", "Am ", "Le ", "El ", "Il ", "Op ", "Em ")
#: How it ends: "wrote:" (Gmail, Apple Mail, Thunderbird) and its translations; German
#: and Dutch put the sender after the verb ("schrieb Ann <ann@x>:").
_WROTE = re.compile(
    r"(?:\b(?:wrote|a écrit|escribió|ha scritto|escreveu)\s*:|\b(?:schrieb|schreef)\b[^:]*:)\s*$",
    re.IGNORECASE,
)
_ORIGINAL = re.compile(
    r"^\s*-{2,}\s*(Original Message|Forwarded message|Ursprüngliche Nachricht"
    r"|Message d'origine|Mensaje original|Messaggio originale|Oorspronkelijk bericht"
    r"|Mensagem original)\s*-{2,}",
    re.IGNORECASE,
)
#: The subject of a forward, as clients in the languages above mark it (``Fwd:``, ``FW:``,
#: German ``WG:``, French ``TR:``, Spanish ``RV:``, Italian ``I:``, Dutch ``Doorst:``,
#: Portuguese ``Enc:``): its quoted mail is what the person sends on to be read.
_FORWARD_SUBJECT = re.compile(r"\s*(?:fwd?|wg|tr|rv|i|doorst|enc)\s*:", re.IGNORECASE)
#: The header names Outlook writes above a quoted mail, in its display language, by the
#: English name they stand for (Outlook translates them: ``Von:``/``Gesendet:``,
#: ``De :``/``Envoyé :``, ``De:``/``Enviado:``, ``Da:``/``Inviato:``, ``Van:``/``Verzonden:``).
_HEADER_NAMES = {
    "from": ("from", "von", "de", "da", "van"),
    "sent": ("sent", "gesendet", "envoyé", "enviado", "inviato", "verzonden"),
    "date": ("date", "datum", "fecha", "data"),
    "to": ("to", "an", "à", "para", "a", "aan"),
    "cc": ("cc",),
    "subject": ("subject", "betreff", "objet", "asunto", "oggetto", "onderwerp", "assunto"),
}
_HEADER_NAME = {name: english for english, names in _HEADER_NAMES.items() for name in names}
#: A header line of a quoted mail as Outlook writes it above the original (``*From:*``
#: when bold HTML was turned into text; French puts a space before the colon).
_QUOTED_HEADER = re.compile(
    r"\*?(" + "|".join(sorted(_HEADER_NAME, key=len, reverse=True)) + r")\s?:\*?(?:\s|$)",
    re.IGNORECASE,
)
#: Lines after a ``From:`` line that are searched for the rest of its header block.
_HEADER_SPAN = 6
#: Outlook's rule above the quoted headers (32 underscores; other clients draw shorter).
_RULE = re.compile(r"_{10,}")
_AUTOMATIC_HEADERS = ("X-Autoreply", "X-Autorespond", "List-Id")
_HTML_TAG_NAME = re.compile(r"(/?)\s*([a-zA-Z][a-zA-Z0-9]*)")
#: Elements dropped with everything in them (a blockquote is the quoted earlier mail).
_HTML_DROPPED = frozenset({"script", "style", "head", "template", "title"})
_HTML_BLOCK_ENDS = frozenset({"p", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6"})


# ----------------------------------------------------------------------------- parsing


def _decode_part(part: email.message.Message) -> str:
    """A text part's content as str; unknown charsets and bad bytes never raise."""
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset()
    if charset:
        try:
            return payload.decode(charset, errors="replace")
        # An unknown label ("unknown-8bit", "x-user-defined"), a codec that is no text
        # encoding (base64, rot13), or one that cannot replace (idna raised, and the
        # mail was refused as having no text).
        except (LookupError, UnicodeError):
            pass
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        # 8-bit text no known charset names is mostly Windows-1252 (Latin-1's superset):
        # read so, its letters are kept (UTF-8 with replacement turned "Grüße" into
        # "Gr\ufffd\ufffde", losing them).
        return payload.decode("cp1252", errors="replace")


def _html_to_text(markup: str) -> str:
    """A crude HTML-to-text conversion, good enough for a chat message, in one pass.

    Hand-rolled on purpose: the regular expressions this replaced, and the standard
    library's ``HTMLParser`` alike, take time that grows with the square of the input on
    unclosed tags (``<script>`` without its end; ``<a <a <a ...``: 2 s for 10 KB, minutes
    for 100 KB), and this runs for any sender a route allows. Every step here moves
    forward with ``str.find`` or an anchored match, so the whole is linear.
    """
    parts: list[str] = []
    quoted = 0  # inside a <blockquote>: the earlier mail, dropped
    i, n = 0, len(markup)
    while i < n:
        lt = markup.find("<", i)
        if lt < 0:
            lt = n
        if not quoted:
            parts.append(markup[i:lt])
        if lt >= n:
            break
        if markup.startswith("<!--", lt):
            end = markup.find("-->", lt + 4)
            i = n if end < 0 else end + 3
            continue
        gt = markup.find(">", lt + 1)
        if gt < 0:  # a "<" no tag follows: text
            if not quoted:
                parts.append(markup[lt:])
            break
        i = gt + 1
        tag = _HTML_TAG_NAME.match(markup, lt + 1, gt)
        if tag is None:  # <!DOCTYPE ...>, <?xml ...?>, "< 3 >"
            continue
        closing, name = bool(tag[1]), tag[2].lower()
        if name in _HTML_DROPPED and not closing:
            end = _element_end(markup, name, i)
            i = n if end < 0 else end
        elif name == "blockquote":
            quoted = max(0, quoted - 1) if closing else quoted + 1
        elif not quoted and (name == "br" or (closing and name in _HTML_BLOCK_ENDS)):
            parts.append("\n")
    text = html.unescape("".join(parts)).replace("\xa0", " ")
    return "\n".join(line.strip() for line in text.splitlines())


def _element_end(markup: str, name: str, start: int) -> int:
    """Where ``</name>`` ends, from ``start`` on (-1: never closed)."""
    lowered_close = "</" + name
    i = start
    while True:
        at = markup.find("<", i)
        if at < 0:
            return -1
        if markup[at : at + len(lowered_close)].lower() == lowered_close:
            gt = markup.find(">", at)
            return -1 if gt < 0 else gt + 1
        i = at + 1


def extract_text(message: email.message.EmailMessage) -> str | None:
    """The message's text: text/plain, else (none, or a blank one) text/html stripped;
    None when there is none."""
    try:
        part = message.get_body(preferencelist=("plain",))
        plain = _decode_part(part) if part is not None else ""
        # Some senders put an empty text/plain beside the HTML that holds the text: it
        # was read as the text, and the mail refused as having none.
        if plain.strip():
            return plain
        part = message.get_body(preferencelist=("html",))
        if part is not None:
            return _html_to_text(_decode_part(part))
    except Exception as exc:  # a malformed MIME tree: treat as having no text
        # Its type and where, not its text or traceback, which quote the header the
        # email package choked on (a part's Content-Disposition).
        log.info(
            "email: could not walk the MIME structure (%s at %s)",
            type(exc).__name__,
            raised_at(exc),
        )
    return None


def strip_quoted(text: str) -> str:
    """Drop quoted reply text: ``>`` lines, and everything from where a quoted mail
    starts: "On ... wrote:" (Gmail, Apple Mail, Thunderbird), an "-----Original
    Message-----" line, or Outlook's block of the original's headers (``From:`` with
    ``Sent:`` or ``Date:`` and ``To:`` or ``Subject:`` on the lines below it), with the
    rule of underscores above it; each also as German, French, Spanish, Italian, Dutch
    and Portuguese clients write it ("Am ... schrieb ...:", ``Von:``/``Gesendet:``).

    Hand-rolled: the libraries for this on PyPI were tried on these samples, and
    ``mail-parser-reply`` cut a reply at any line starting ``From:`` (a reviewer's
    reason that mentions one), while ``quotequail`` missed Outlook's header block without
    its rule (Outlook for Mac) and brings lxml; neither ships type information. The
    few patterns here are the ones clients write above the quoted original.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    stripped_lines = [line.strip() for line in lines]
    kept: list[str] = []
    attribution_ends = -1  # the last line of the attribution being dropped
    dropped = False  # a quoted line was dropped since the last line of text kept
    for i, line in enumerate(lines):
        stripped = stripped_lines[i]
        if _ORIGINAL.match(stripped) or _quoted_headers(stripped_lines, i):
            break
        if i <= attribution_ends:
            continue
        if stripped.startswith(_ATTRIBUTION_OPENERS):
            if _WROTE.search(stripped) and _quote_follows(stripped_lines, i + 1):
                attribution_ends = i
            # clients wrap a long attribution line: "On Mon, ... Alice <\na@x> wrote:"
            elif (
                i + 1 < len(lines)
                and _WROTE.search(f"{stripped} {stripped_lines[i + 1]}")
                and _quote_follows(stripped_lines, i + 2)
            ):
                attribution_ends = i + 1
        # The attribution and the ">" lines below it are the quoted mail; unquoted lines
        # after them are the person's answers between its quotes (bottom-posted, or
        # inline), kept: ending the text at the attribution lost them.
        if i <= attribution_ends or stripped.startswith(">"):
            dropped = True
            continue
        if not stripped and dropped and kept and not kept[-1]:
            continue  # one blank line stands for the quote between two answers
        if stripped:
            dropped = False
        kept.append(line.rstrip())
    while kept and (not kept[-1].strip() or _RULE.fullmatch(kept[-1].strip())):
        kept.pop()  # the blank lines and the rule above the quoted mail
    return "\n".join(kept).strip()


def _quote_follows(lines: list[str], start: int) -> bool:
    """Whether an attribution line ending before ``start`` (of ``lines``, stripped) stands
    above a quoted mail: its next non-blank line is quoted (``>``), or there is none (HTML
    whose ``<blockquote>`` was dropped). A sentence of the person's own that happens to
    read so ("El informe que Juan escribió:", then the figures) goes on with their text,
    which is kept: cutting there lost everything below it."""
    for line in lines[start:]:
        if line:
            return line.startswith(">")
    return True


def _quoted_headers(lines: list[str], i: int) -> bool:
    """Whether line ``i`` of ``lines`` (stripped) starts the header block Outlook writes
    above a quoted mail:
    ``From:``, then ``Sent:`` or ``Date:`` and ``To:`` or ``Subject:`` among the next
    non-blank lines. A ``From:`` alone (a sentence that mentions one) is not one."""
    first = _QUOTED_HEADER.match(lines[i])
    if first is None or _HEADER_NAME[first[1].lower()] != "from":
        return False
    names: set[str] = set()
    # A bounded window, not the rest of the mail: a mail of many "From:" lines must not
    # be read again from each (HTML turned into text has blank lines between headers).
    following = [line for line in lines[i + 1 : i + 1 + 3 * _HEADER_SPAN] if line]
    for line in following[:_HEADER_SPAN]:
        header = _QUOTED_HEADER.match(line)
        if header is not None:
            names.add(_HEADER_NAME[header[1].lower()])
    return bool(names & {"sent", "date"}) and bool(names & {"to", "subject"})


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
    """Parse ``raw``; None when it has no text body (after quoted text is removed).
    :class:`TooManyParts` before any parsing for a message nested past the bound."""
    if len(_MULTIPART.findall(raw)) > MAX_MULTIPARTS:
        raise TooManyParts(f"more than {MAX_MULTIPARTS} multipart parts")
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
    precedence = one_line(message.get("Precedence")).lower()
    automatic = (
        not envelope_sender
        or (bool(auto) and auto != "no")
        # What RFC 3834 leaves to custom: the marks vacation responders, bulk senders
        # and mailing lists put on their mail. A reply to any of them starts a loop or
        # answers a whole list.
        or precedence in ("bulk", "junk", "list", "auto_reply")
        or any(message.get(name) is not None for name in _AUTOMATIC_HEADERS)
    )

    body = extract_text(message)
    if body is None:
        return None
    subject = one_line(message.get("Subject"))
    if _FORWARD_SUBJECT.match(subject):
        # Kept whole: the forwarded mail under its header block (Outlook) or its
        # "Forwarded message" line (Gmail) is what the worker is to read; cut as a
        # quoted original, the worker got "Please summarise." alone.
        text = body.replace("\r\n", "\n").strip()
    else:
        text = strip_quoted(body)
    if not text:
        return None
    return ParsedMail(
        message_id=message_id,
        root_id=root_id,
        sender=sender,
        subject=subject,
        references=" ".join(chain),
        text=text,
        automatic=automatic,
    )
