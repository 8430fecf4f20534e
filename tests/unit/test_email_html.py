"""The HTML fallback of an inbound mail's text (:func:`bots.email_parse._html_to_text`):
what it keeps, and that its work grows with the input, not with its square."""

from __future__ import annotations

import pytest

from bots.email_parse import _html_to_text, parse_mail


class Scanned(str):
    """A str that counts the characters its ``find`` calls walk over."""

    walked = 0

    def find(self, sub: str, start: int | None = 0, end: int | None = None) -> int:  # type: ignore[override]
        begin = start or 0
        at = str.find(self, sub, begin, len(self) if end is None else end)
        Scanned.walked += (len(self) if at < 0 else at + len(sub)) - begin
        return at


def test_the_text_of_a_mail_without_its_markup_scripts_or_quotes() -> None:
    markup = (
        "<html><head><title>t</title><style>p {color: red}</style></head><body>"
        "<p>Hello <b>there</b> &amp; welcome</p><div>second<br/>line</div>"
        "<!-- a comment > with a bracket --><SCRIPT>alert(1)</Script >"
        "<blockquote>old <blockquote>older</blockquote> quoted</blockquote>"
        "<p>1 &lt; 2</p>a</body></html>"
    )
    assert _html_to_text(markup) == "Hello there & welcome\nsecond\nline\n1 < 2\na"


@pytest.mark.parametrize(
    "unit", ["<script>", "<a ", "<", "<blockquote>", "<!--", "<style><", "<p>x</p><", "&"]
)
def test_the_walk_is_linear_on_unclosed_and_repeated_tags(unit: str) -> None:
    # The regular expressions this replaced took 13.6 s on one 100 KB mail of these,
    # with the event loop held; the standard library's HTMLParser, minutes.
    markup = Scanned(unit * (50_000 // len(unit)))
    Scanned.walked = 0
    _html_to_text(markup)
    assert Scanned.walked <= 2 * len(markup)


@pytest.mark.parametrize("charset", ["base64", "rot13", "no-such-charset", "latin-1"])
def test_a_charset_that_is_no_text_encoding_reads_as_utf8(charset: str) -> None:
    # base64 and rot13 are codecs but no text encodings: a LookupError, which turned the
    # mail into "550 Message has no text body" with a traceback in the log.
    raw = (
        "From: a@example.com\r\nTo: b@x.example\r\nSubject: s\r\nMessage-ID: <x@y>\r\n"
        f"Content-Type: text/plain; charset={charset}\r\n\r\nhello there\r\n"
    ).encode()
    mail = parse_mail(raw, "a@example.com")
    assert mail is not None and mail.text == "hello there"
