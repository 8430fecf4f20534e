"""Email, parsing: the text of an inbound mail and the threading of its reply.

Plain text is extracted from the message (HTML as a fallback, charsets decoded safely),
quoted text is stripped (a forward, attached or inline, is kept whole), and the ids a
reply threads on (``Message-ID``, ``References``, else ``In-Reply-To`` and the thread our
reply's id carries) are collected. Automatic mail (RFC 3834) is recognised so that it runs
no turn.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import email
import email.policy
import email.utils
import hashlib
import html
import logging
import re
from dataclasses import dataclass
from email.message import EmailMessage

from binding.routes import fold_address
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
#: Lines an attribution may be wrapped over: clients wrap a long one ("On Mon, ... Alice
#: Example <" / "alice@example.com>" / "wrote:"). Bounded, so that a paragraph of the
#: person's own that starts "On ..." is never read as one down to a distant "wrote:".
_ATTRIBUTION_LINES = 3
#: Blanks other than the space that clients put in an attribution: a no-break space
#: (U+00A0, French "a écrit :") and a narrow one (U+202F), and the other Unicode spaces.
_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ORIGINAL = re.compile(
    r"^\s*-{2,}\s*(Original Message|Ursprüngliche Nachricht"
    r"|Message d'origine|Mensaje original|Messaggio originale|Oorspronkelijk bericht"
    r"|Mensagem original)\s*-{2,}",
    re.IGNORECASE,
)
#: The subject of a forward, as clients in the languages above mark it (``Fwd:``, ``FW:``,
#: German ``WG:``, French ``TR:``, Spanish ``RV:``, Italian ``I:``, Dutch ``Doorst:``,
#: Portuguese ``Enc:``): its quoted mail is what the person sends on to be read.
_FORWARD_SUBJECT = re.compile(r"\s*(?:fwd?|wg|tr|rv|i|doorst|enc)\s*:", re.IGNORECASE)
#: The line a client writes above the mail it forwards, whatever the subject says (the
#: "Fwd:" may have been edited away): Gmail's "---------- Forwarded message ---------"
#: (and its translations), Apple Mail's "Begin forwarded message:".
_FORWARD_MARKER = re.compile(
    r"^[ \t]*(?:-{2,}[ \t]*(?:Forwarded message|Weitergeleitete Nachricht|Message transféré"
    r"|Mensaje reenviado|Messaggio inoltrato|Doorgestuurd bericht|Mensagem encaminhada)"
    r"[ \t]*-{2,}|Begin forwarded message[ \t]*:)",
    re.IGNORECASE | re.MULTILINE,
)
#: The subject of a reply (``Re:``, German ``AW:``, Dutch ``Antw:``, Italian ``R:``,
#: Portuguese ``RES:``, Scandinavian ``SV:``): such a mail quotes the one it answers.
_REPLY_SUBJECT = re.compile(r"\s*(?:re|aw|antw|r|res|sv)\s*:", re.IGNORECASE)
#: The header names Outlook writes above a quoted mail, in its display language, by the
#: English name they stand for (Outlook translates them: ``Von:``/``Gesendet:``,
#: ``De :``/``Envoyé :``, ``De:``/``Enviado:``, ``Da:``/``Inviato:``, ``Van:``/``Verzonden:``).
_HEADER_NAMES = {
    "from": ("from", "von", "de", "da", "van"),
    # Brazilian Outlook writes "Enviado em:" (older releases "Enviada em:").
    "sent": (
        "sent",
        "gesendet",
        "envoyé",
        "enviado",
        "enviado em",
        "enviada em",
        "inviato",
        "verzonden",
    ),
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
#: Header lines a quoted block holds at most (From, Sent, To, Cc, Subject and one more).
_HEADER_SPAN = 6
#: Lines that may stand between two header lines of a block: a long ``From:`` or ``To:``
#: wrapped by the client. A third ends the block: it is text.
_HEADER_GAP = 2
#: The headers a quoted block starts with: ``From:`` (Outlook), ``Date:`` (Outlook.com
#: and Hotmail write ``Date:``, ``Subject:``, ``From:``, ``To:``), ``Sent:``.
_BLOCK_STARTS = frozenset({"from", "sent", "date"})
#: The rule above the quoted headers: Outlook's 32 underscores (other clients draw
#: shorter), or a row of dashes (an HTML ``<hr>`` some converters turn into one).
_RULE = re.compile(r"_{10,}|-{10,}")
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


def _html_to_text(markup: str, *, quotes: bool = False) -> str:
    """A crude HTML-to-text conversion, good enough for a chat message, in one pass.

    Hand-rolled on purpose: the regular expressions this replaced, and the standard
    library's ``HTMLParser`` alike, take time that grows with the square of the input on
    unclosed tags (``<script>`` without its end; ``<a <a <a ...``: 2 s for 10 KB, minutes
    for 100 KB), and this runs for any sender a route allows. Every step here moves
    forward with ``str.find`` or an anchored match, so the whole is linear.

    ``quotes``: a ``<blockquote>``'s text is kept (a forward: Apple Mail puts the mail it
    forwards in one), not dropped as the quoted earlier mail of a reply.
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
        elif name == "blockquote" and not quotes:
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


def extract_text(message: email.message.EmailMessage, *, quotes: bool = False) -> str | None:
    """The message's text: text/plain, else (none, or a blank one) text/html stripped
    (``quotes``: with its ``<blockquote>``s); None when there is none."""
    try:
        part = message.get_body(preferencelist=("plain",))
        plain = _decode_part(part) if part is not None else ""
        # Some senders put an empty text/plain beside the HTML that holds the text: it
        # was read as the text, and the mail refused as having none.
        if plain.strip():
            return plain
        part = message.get_body(preferencelist=("html",))
        if part is not None:
            return _html_to_text(_decode_part(part), quotes=quotes)
    except Exception as exc:  # a malformed MIME tree: treat as having no text
        # Its type and where, not its text or traceback, which quote the header the
        # email package choked on (a part's Content-Disposition).
        log.info(
            "email: could not walk the MIME structure (%s at %s)",
            type(exc).__name__,
            raised_at(exc),
        )
    return None


def _attached_messages(message: EmailMessage) -> list[str]:
    """The text of each mail attached to ``message`` (``message/rfc822``, the way some
    clients forward), under the forward line and its ``From:``, ``Date:``, ``Subject:``
    and ``To:``: read as a forward. Attached mails inside those are not opened."""
    texts: list[str] = []
    try:
        for part in message.iter_attachments():
            if part.get_content_type() != "message/rfc822":
                continue
            inner = part.get_content()
            if not isinstance(inner, EmailMessage):
                continue
            text = (extract_text(inner, quotes=True) or "").replace("\r\n", "\n").strip()
            if not text:
                continue
            headers = [
                f"{name}: {one_line(inner.get(name))}"
                for name in ("From", "Date", "Subject", "To")
                if inner.get(name) is not None
            ]
            texts.append("\n".join(["---------- Forwarded message ---------", *headers, "", text]))
    except Exception as exc:  # a malformed attached mail: as having none
        log.info(
            "email: could not read an attached message (%s at %s)",
            type(exc).__name__,
            raised_at(exc),
        )
    return texts


def strip_quoted(text: str, *, headers: bool = True) -> str:
    """Drop quoted reply text: ``>`` lines, and everything from where a quoted mail
    starts: "On ... wrote:" (Gmail, Apple Mail, Thunderbird), an "-----Original
    Message-----" line, or the block of the original's headers Outlook writes (``From:``
    with ``Sent:`` or ``Date:`` and ``To:`` or ``Subject:`` on the lines below it; from
    Outlook.com, ``Date:`` first: :func:`_quoted_headers`), with the rule above it; each
    also as German, French, Spanish, Italian, Dutch and Portuguese clients write it
    ("Am ... schrieb ...:", ``Von:``/``Gesendet:``).

    Hand-rolled: the libraries for this on PyPI were tried on these samples, and
    ``mail-parser-reply`` cut a reply at any line starting ``From:`` (a reviewer's
    reason that mentions one), while ``quotequail`` missed Outlook's header block without
    its rule (Outlook for Mac) and brings lxml; neither ships type information. The
    few patterns here are the ones clients write above the quoted original.

    ``headers=False``: an Outlook header block ends nothing (a mail that answers none
    quotes none; its ``From:``/``Sent:``/``To:`` lines were pasted in, and are text).
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    # Compared with the other blanks as spaces: "a\u00a0écrit\u00a0:" is "a écrit :".
    stripped_lines = [_SPACES.sub(" ", line).strip() for line in lines]
    kept: list[str] = []
    attribution_ends = -1  # the last line of the attribution being dropped
    dropped = False  # a quoted line was dropped since the last line of text kept
    for i, line in enumerate(lines):
        stripped = stripped_lines[i]
        if _ORIGINAL.match(stripped) or (headers and _quoted_headers(stripped_lines, i)):
            break
        if i <= attribution_ends:
            continue
        if stripped.startswith(_ATTRIBUTION_OPENERS):
            attribution_ends = _attribution_end(stripped_lines, i)
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


def _attribution_end(lines: list[str], i: int) -> int:
    """The last line of the attribution starting at line ``i`` of ``lines`` (stripped),
    wrapped over up to :data:`_ATTRIBUTION_LINES` lines ("On Mon, ... Alice <" /
    "a@x> wrote:"), with a quote below it; -1 when it is none."""
    joined = ""
    for end in range(i, min(i + _ATTRIBUTION_LINES, len(lines))):
        joined = f"{joined} {lines[end]}" if joined else lines[end]
        if _WROTE.search(joined):
            return end if _quote_follows(lines, end + 1) else -1
    return -1


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
    """Whether line ``i`` of ``lines`` (stripped) starts the header block a client writes
    above a quoted mail: ``From:``, ``Sent:`` or ``Date:`` and ``To:`` or ``Subject:``,
    starting with one of the first two kinds (Outlook's ``From:``, Outlook.com's
    ``Date:``), each header line no more than :data:`_HEADER_GAP` lines of wrapped text
    from the one before it. A ``From:`` alone (a sentence that mentions one) is not one,
    and neither is a ``From:`` line of the person's own above a quoted block: a header
    met twice ends the block, so that the text is cut at the quoted one's (it was cut at
    theirs, and everything they wrote below it was lost)."""
    first = _QUOTED_HEADER.match(lines[i])
    if first is None or _HEADER_NAME[first[1].lower()] not in _BLOCK_STARTS:
        return False
    names = {_HEADER_NAME[first[1].lower()]}
    gap = 0
    # A bounded window, not the rest of the mail: a mail of many "From:" lines must not
    # be read again from each (HTML turned into text has blank lines between headers).
    for line in lines[i + 1 : i + 1 + 3 * _HEADER_SPAN]:
        if not line:
            continue
        header = _QUOTED_HEADER.match(line)
        if header is None:
            gap += 1
            if gap > _HEADER_GAP:
                break
            continue
        name = _HEADER_NAME[header[1].lower()]
        if name in names:
            break  # another block starts here
        names.add(name)
        gap = 0
    return "from" in names and bool(names & {"sent", "date"}) and bool(names & {"to", "subject"})


#: Our replies' Message-IDs carry the first Message-ID of their thread after this mark,
#: base32 (``<key.t.<base32>@domain>``): a reply to one that names it alone, in
#: ``In-Reply-To`` without ``References`` (many mobile clients), continues that thread.
_THREAD_MARK = ".t."
#: The longest thread id carried so (a longer one is not: the reply threads on ours).
MAX_THREAD_ID = 200


def thread_mark(root: str) -> str:
    """What our reply's Message-ID carries for the thread whose first id is ``root``
    ("" for none, or one over :data:`MAX_THREAD_ID` characters)."""
    inner = root.removeprefix("<").removesuffix(">")
    if not inner or len(inner) > MAX_THREAD_ID:
        return ""
    code = base64.b32encode(inner.encode("utf-8", "surrogateescape")).decode("ascii")
    return _THREAD_MARK + code.rstrip("=").lower()


def thread_of(msgid: str) -> str | None:
    """The thread's first Message-ID that ``msgid`` (one of our replies') carries, or
    None. Whoever sends it can name any thread so, as with ``References``: a session is
    keyed by its sender too, so only their own."""
    local = msgid.removeprefix("<").removesuffix(">").rpartition("@")[0]
    code = local.rpartition(_THREAD_MARK)[2] if _THREAD_MARK in local else ""
    if not code:
        return None
    try:
        inner = base64.b32decode(code.upper() + "=" * (-len(code) % 8)).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeError):
        return None
    root = f"<{inner}>"
    # A Message-ID names its host: a mark that decodes to anything else is none of ours.
    return root if "@" in inner and _MSGID.fullmatch(root) else None


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
    #: ``From:`` (else the envelope sender) lower-case: who wrote, as routes, sessions
    #: and reviewers compare it (mail providers fold a local part's case)
    sender: str
    #: :attr:`sender` as the mail wrote it, where the answer goes: RFC 5321 (2.4) has a
    #: local part's case kept, for the few servers that tell ``Ann`` from ``ann``
    reply_to: str
    #: :attr:`sender` as one correspondent is compared (its domain IDNA-encoded)
    correspondent: str
    subject: str
    references: str
    text: str
    automatic: bool
    #: The one mail ``In-Reply-To`` names when nothing else tells its thread (no
    #: ``References``, none of our replies): perhaps the person's own earlier mail, whose
    #: session the adapter looks up (:meth:`in_thread`); "" for any other mail.
    lone_parent: str = ""

    def in_thread(self, root: str) -> ParsedMail:
        """This mail as continuing the thread whose first Message-ID is ``root`` (the
        thread :attr:`lone_parent` was found in): ``root`` leads its ``References``, so
        that our reply's Message-ID carries it (:func:`thread_mark`) as it does when the
        client sent ``References`` itself."""
        chain = [root, *self.references.split()]
        if len(chain) > MAX_REFERENCES:
            chain = [chain[0], *chain[-(MAX_REFERENCES - 1) :]]
        return dataclasses.replace(self, root_id=root, references=" ".join(chain), lone_parent="")


def parse_mail(raw: bytes, envelope_sender: str) -> ParsedMail | None:
    """Parse ``raw`` (``envelope_sender``: ``MAIL FROM`` as sent, "" for none); None
    when it has no text body (after quoted text is removed). :class:`TooManyParts`
    before any parsing for a message nested past the bound."""
    if len(_MULTIPART.findall(raw)) > MAX_MULTIPARTS:
        raise TooManyParts(f"more than {MAX_MULTIPARTS} multipart parts")
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    own = _msgids(message.get("Message-ID"))
    # A missing Message-ID is derived from the content so that a resent copy of the
    # same message still de-duplicates.
    message_id = own[0] if own else f"<{hashlib.sha256(raw).hexdigest()[:32]}@leadgate.invalid>"
    # RFC 5322 3.6.4: the thread is References, else the one mail In-Reply-To names
    # (with the thread it belongs to, when it is one of our replies).
    references = _msgids(message.get("References"))
    in_reply_to = _msgids(message.get("In-Reply-To"))[:1]
    parent_chain = references or in_reply_to
    lone_parent = ""
    if not references and in_reply_to:
        root = thread_of(in_reply_to[0])
        if root is not None and root != in_reply_to[0]:
            parent_chain = [root, *in_reply_to]
        else:
            lone_parent = in_reply_to[0]
    root_id = (parent_chain or [message_id])[0]
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
    written = (header_from or envelope_sender).strip()
    sender = written.lower()

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
    attached = _attached_messages(message)
    if body is None and not attached:
        return None
    subject = one_line(message.get("Subject"))
    if attached or _FORWARD_SUBJECT.match(subject) or _FORWARD_MARKER.search(body or ""):
        # Kept whole: the forwarded mail under its header block (Outlook), its
        # "Forwarded message" line (Gmail, also with "Fwd:" taken out of the subject),
        # in Apple Mail's HTML blockquote, or attached, is what the worker is to read;
        # cut as a quoted original, the worker got "Please summarise." alone.
        whole = (extract_text(message, quotes=True) or "").replace("\r\n", "\n").strip()
        text = "\n\n".join(part for part in (whole, *attached) if part)
    else:
        # Only a reply quotes an earlier mail under its headers: in any other mail
        # From:/Sent:/To: lines were pasted in, and cutting there lost them.
        replying = bool(parent_chain) or bool(_REPLY_SUBJECT.match(subject))
        text = strip_quoted(body or "", headers=replying)
    if not text:
        return None
    return ParsedMail(
        message_id=message_id,
        root_id=root_id,
        sender=sender,
        reply_to=written,
        correspondent=fold_address(sender),
        subject=subject,
        references=" ".join(chain),
        text=text,
        automatic=automatic,
        lone_parent=lone_parent,
    )
