"""How a chat adapter quotes an answer that is not the platform's
(``bots.base.quoted_page``); each platform's quote is tested through its stand-in in
``tests/integration/test_bots_*_send.py``."""

from __future__ import annotations

from bots.base import quoted_page
from tests.standins.common import PORTAL_SESSION


def test_a_session_id_cut_off_where_the_reading_stops_is_left_out_too() -> None:
    """Only the start of a page is read, and its indentation collapses: a session id
    that the read cuts short is shorter than a secret-looking run, and was quoted as far
    as it was read."""
    page = "<html>" + " " * 440 + f'<a href="/login?sid={PORTAL_SESSION}{PORTAL_SESSION}">'
    expected = '<html> <a href="/login?sid=…'
    assert quoted_page(page) == expected
    assert quoted_page(page.encode()) == expected


def test_a_page_read_whole_keeps_its_last_word() -> None:
    assert quoted_page(b"<html>\n  Proxy  Error\n</html>") == "<html> Proxy Error </html>"
    assert quoted_page("token xoxb-1-2-abc here") == "token … here"
    assert quoted_page(b"") == ""
