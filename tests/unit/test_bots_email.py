"""Inbound half of the email adapter: a real SMTP listener on 127.0.0.1, mail sent with
aiosmtplib, and a fake core."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from email.message import EmailMessage
from typing import Any, cast

import aiosmtplib
import pytest
from aiohttp import web

from bots.email import EmailAdapter, create, message_id_for, reply_subject, strip_quoted
from bots.email_parse import MAX_MULTIPARTS, TooManyParts, parse_mail
from bots.review_base import ChatReviewBackend
from leadgate.core.config import EmailSettings, Settings
from leadgate.core.errors import DatabaseDamaged, Unavailable
from leadgate.core.types import BindingKind, Inbound, RouteMatch
from leadgate.review.replies import ReplyCard
from tests.fakes import FakeCore, mount_adapter
from tests.helpers import eventually

BOT = "bot@leadgate.example"
ALICE = "alice@example.com"

RouteFn = Callable[[str, Mapping[str, str]], RouteMatch | None]


def _allow(*senders: str, address: str = BOT, silent: bool = False) -> RouteFn:
    """A route for ``address`` whose sender allow-list is ``senders`` (exact or *@domain)."""

    def routes(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        sender = attrs["sender"]
        allowed = any(
            sender == s or (s.startswith("*@") and sender.endswith(s[1:])) for s in senders
        )
        if channel == "email" and attrs["address"] == address and allowed:
            return RouteMatch("route-1", "org-1", "agent-1", silent=silent)
        return None

    return routes


class Listener:
    def __init__(self, adapter: EmailAdapter, core: FakeCore) -> None:
        self.adapter = adapter
        self.core = core
        assert adapter.port
        self.port = adapter.port

    async def send(
        self, message: EmailMessage | bytes, *, sender: str = ALICE, rcpt: list[str] | None = None
    ) -> Any:
        return await aiosmtplib.send(
            message,
            sender=sender,
            recipients=rcpt or [BOT],
            hostname="127.0.0.1",
            port=self.port,
            timeout=10,  # "it did not hang": 2 s was within a loaded machine's reach
        )


async def _listen(core: FakeCore) -> AsyncIterator[Listener]:
    """The adapter mounted on a real aiohttp app; its cleanup_ctx runs the listener."""
    adapter = EmailAdapter(EmailSettings(listen_host="127.0.0.1", listen_port=0), core)
    app = web.Application()
    mount_adapter(app, adapter)
    runner = web.AppRunner(app)
    await runner.setup()  # runs the startup half of cleanup_ctx
    try:
        yield Listener(adapter, core)
    finally:
        await runner.cleanup()


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    async for item in _listen(FakeCore(_allow(ALICE, "*@partner.example"))):
        yield item


def _mail(body: str = "Hello bot", **headers: str) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = headers.pop("From", "Alice <Alice@Example.com>")
    msg["To"] = BOT
    msg["Subject"] = headers.pop("Subject", "Quarterly report")
    msg["Message-ID"] = headers.pop("Message_ID", "<m1@client.example>")
    for name, value in headers.items():
        msg[name.replace("_", "-")] = value
    msg.set_content(body)
    return msg


async def test_plain_message_becomes_one_trigger(listener: Listener) -> None:
    await listener.send(_mail("Please summarise the report."), rcpt=["Bot@Leadgate.Example"])
    await listener.core.drain()

    assert {"address": BOT, "sender": ALICE} in listener.core.route_queries
    [trigger] = listener.core.triggers
    assert (trigger.org_id, trigger.agent_id) == ("org-1", "agent-1")
    assert trigger.text == "Please summarise the report."
    assert trigger.session_key == f"email:{BOT}:{ALICE}:<m1@client.example>"
    assert trigger.external_event_id == f"email:{BOT}:{ALICE}:<m1@client.example>"
    assert trigger.binding.kind is BindingKind.email
    assert trigger.binding.route_id == "route-1" and trigger.binding.silent is False
    assert trigger.binding.address == {
        "to": "Alice@Example.com",  # as From: wrote it: the session's sender is folded
        "from": BOT,
        "subject": "Re: Quarterly report",
        "in_reply_to": "<m1@client.example>",
        "references": "<m1@client.example>",
    }


async def test_another_sender_quoting_a_thread_gets_a_session_of_their_own() -> None:
    # Mallory learnt Alice's Message-ID and replies "into" her thread: her text must not
    # join Alice's task, and Alice's approved answer must not be mailed to Mallory.
    mallory = "mallory@elsewhere.example"
    async for listener in _listen(FakeCore(_allow(ALICE, mallory))):
        await listener.send(_mail("Please summarise the report."))
        await listener.send(
            _mail(
                "Also send me the figures",
                From=f"Mallory <{mallory}>",
                Message_ID="<evil@elsewhere.example>",
                In_Reply_To="<m1@client.example>",
                References="<m1@client.example>",
            ),
            sender=mallory,
        )
        await listener.core.drain()
        alice, other = listener.core.triggers
        assert alice.session_key == f"email:{BOT}:{ALICE}:<m1@client.example>"
        assert other.session_key == f"email:{BOT}:{mallory}:<m1@client.example>"
        assert other.binding.address["to"] == mallory


async def test_quoted_reply_text_is_stripped(listener: Listener) -> None:
    body = (
        "Yes, go ahead.\n"
        "> earlier line quoted inline\n"
        "Thanks\n"
        "\n"
        "On Mon, 1 Jan 2024 at 10:00, Lead Gate <bot@leadgate.example>\n"
        "wrote:\n"
        "> Echo: the previous answer\n"
    )
    await listener.send(_mail(body))
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == ["Yes, go ahead.\nThanks"]


async def test_answers_between_the_quotes_are_kept(listener: Listener) -> None:
    """A reply written below the quoted mail, or between its quoted lines (Thunderbird,
    mutt, anyone who answers inline): the text ended at the attribution line, and every
    answer below it was lost (a mail of nothing else was refused as having no text)."""
    inline = (
        "On Mon, Dec 7, 2026 at 10:02 AM Lead Gate <bot@leadgate.example> wrote:\n"
        "> Which plan do you want?\n"
        "The blue one.\n"
        "\n"
        "> And from when?\n"
        "From Friday on.\n"
    )
    below = (
        "Thanks.\n\nOn 7 Dec 2026, at 10:02, Lead Gate <bot@leadgate.example> wrote:\n\n"
        "> Shall I cancel it?\n\nYes, and send me the invoice.\n"
    )
    await listener.send(_mail(inline, Message_ID="<i1@client.example>"))
    await listener.send(_mail(below, Message_ID="<i2@client.example>"))
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == [
        "The blue one.\n\nFrom Friday on.",
        "Thanks.\n\nYes, and send me the invoice.",
    ]


async def test_a_sentence_that_reads_like_an_attribution_keeps_what_follows(
    listener: Listener,
) -> None:
    """A line of the person's own that starts and ends as an attribution does ("El ...
    escribió:", "Am ... schrieb:", "On ... wrote:") but stands above no quoted mail is
    their text: it cut the mail there, and what they wrote below it was lost (a mail of
    nothing else was refused as having no text)."""
    bodies = [
        "Hola,\nEl informe de ayer, que Juan escribió:\nventas 10, costes 4\nSaludos",
        "Am Montag fragte ich, was Ann schrieb:\n\nDie Zahlen stimmen nicht.",
        "On Monday the customer wrote:\nplease cancel my order",
    ]
    for n, body in enumerate(bodies):
        await listener.send(_mail(body, Message_ID=f"<s{n}@client.example>"))
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == bodies


#: A mail forwarded under Outlook's header block of it.
_FORWARDED = (
    "From: Bob <bob@supplier.example>\n"
    "Sent: Monday, December 7, 2026 09:12\n"
    "To: Alice <alice@example.com>\n"
    "Subject: Contract\n"
    "\n"
    "The price rises 4% from January."
)


async def test_a_forwarded_mail_is_kept_whole(listener: Listener) -> None:
    """A mail forwarded to the worker ("please summarise this") is the text it is to
    read: Gmail's "---------- Forwarded message ---------" line, and Outlook's header
    block of the forwarded mail under a ``FW:`` / ``WG:`` subject, were taken for a
    quoted original and cut away, and the worker got "Please summarise." alone."""
    forwarded = _FORWARDED
    gmail = "Please summarise.\n\n---------- Forwarded message ---------\n" + forwarded
    outlook = "Bitte zusammenfassen.\n\n________________________________\n" + forwarded
    await listener.send(_mail(gmail, Subject="Fwd: Contract", Message_ID="<f1@client.example>"))
    await listener.send(_mail(outlook, Subject="WG: Contract", Message_ID="<f2@client.example>"))
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == [gmail, outlook]


# A review card's mail as each client quotes it in a reply (the card shortened). The
# reviewer's text is the first two lines.
_CARD_HEADERS = (
    "From: Leadgate <review@lg.example>\n"
    "{sent}\n"
    "To: Ann Member <member@acme.io>\n"
    "Subject: Review needed: answer to bob@example.com\n"
)
_CARD = "Agent: worker\nFrom: api\nWhy: the lead escalated\nTo decide by email: Reply ..."
#: The card quoted line by line, as Gmail, Apple Mail and Thunderbird quote it.
_QUOTED = "".join(f"> {line}\n" for line in _CARD.splitlines())
QUOTING = {
    "outlook": (  # Outlook for Windows, Outlook on the web, Outlook for iOS
        "________________________________\n"
        + _CARD_HEADERS.format(sent="Sent: Monday, December 7, 2026 10:02 AM")
        + "\n"
        + _CARD
    ),
    "outlook_mac": (  # Outlook for Mac: no rule, Date: instead of Sent:
        _CARD_HEADERS.format(sent="Date: Monday, 7 December 2026 at 10:02") + "\n" + _CARD
    ),
    "outlook_bold": (  # Outlook's HTML headers as a text converter writes them
        "________________________________\n"
        "*From:* Leadgate <review@lg.example>\n"
        "*Sent:* Monday, December 7, 2026 10:02 AM\n"
        "*To:* Ann Member <member@acme.io>\n"
        "*Subject:* Review needed\n\n" + _CARD
    ),
    "original_message": (  # older Outlook, Lotus, many webmailers
        "-----Original Message-----\n"
        + _CARD_HEADERS.format(sent="Sent: Monday, December 7, 2026 10:02 AM")
        + "\n"
        + _CARD
    ),
    "gmail": ("On Mon, Dec 7, 2026 at 10:02 AM Leadgate <review@lg.example> wrote:\n\n" + _QUOTED),
    "gmail_wrapped": (
        "On Mon, Dec 7, 2026 at 10:02 AM Leadgate Review Desk <\nreview@lg.example> wrote:\n"
        + _QUOTED
    ),
    "apple_mail": ("> On 7 Dec 2026, at 10:02, Leadgate <review@lg.example> wrote:\n>\n" + _QUOTED),
    "thunderbird": ("On 07/12/2026 10:02, Leadgate wrote:\n" + _QUOTED),
    "thunderbird_no_attribution": _QUOTED,
    # Outlook and Gmail in other display languages translate the same forms.
    "outlook_de": (
        "________________________________\n"
        "Von: Leadgate <review@lg.example>\n"
        "Gesendet: Montag, 7. Dezember 2026 10:02\n"
        "An: Ann Member <member@acme.io>\n"
        "Betreff: Review needed\n\n" + _CARD
    ),
    "outlook_fr_bold": (
        "*De :* Leadgate <review@lg.example>\n"
        "*Envoyé :* lundi 7 décembre 2026 10:02\n"
        "*À :* Ann Member <member@acme.io>\n"
        "*Objet :* Review needed\n\n" + _CARD
    ),
    "outlook_es": (
        "De: Leadgate <review@lg.example>\n"
        "Enviado: lunes, 7 de diciembre de 2026 10:02\n"
        "Para: Ann Member <member@acme.io>\n"
        "Asunto: Review needed\n\n" + _CARD
    ),
    "outlook_it_mac": (
        "Da: Leadgate <review@lg.example>\n"
        "Data: lunedì 7 dicembre 2026 10:02\n"
        "A: Ann Member <member@acme.io>\n"
        "Oggetto: Review needed\n\n" + _CARD
    ),
    "outlook_nl": (
        "Van: Leadgate <review@lg.example>\n"
        "Verzonden: maandag 7 december 2026 10:02\n"
        "Aan: Ann Member <member@acme.io>\n"
        "Onderwerp: Review needed\n\n" + _CARD
    ),
    "original_message_de": (
        "-----Ursprüngliche Nachricht-----\n"
        + _CARD_HEADERS.format(sent="Sent: Monday, December 7, 2026 10:02 AM")
        + "\n"
        + _CARD
    ),
    "gmail_de_wrapped": (
        "Am Mo., 7. Dez. 2026 um 10:02 Uhr schrieb Leadgate Review Desk <\n"
        "review@lg.example>:\n" + _QUOTED
    ),
    # Outlook's header block as a client that wraps long lines sends it: each of From:,
    # Sent: and To: over two or three lines, and a wrapped bold one.
    "outlook_wrapped": (
        "________________________________\n"
        "From: Leadgate Review Desk of the\nFinance Department <review@lg.example>\n"
        "Sent: Monday, December 7, 2026\n10:02 AM\n"
        "To: Ann Member <member@acme.io>; Carol\nExample <carol@acme.io>; Dave\n"
        "<dave@acme.io>\nSubject: Review needed\n\n" + _CARD
    ),
    "outlook_wrapped_bold": (
        "*From:* Leadgate Review Desk\n   <review@lg.example>\n*Sent:* Monday,\n"
        "   December 7, 2026 10:02 AM\n*To:* Ann Member\n   <member@acme.io>\n"
        "*Subject:* Review needed\n\n" + _CARD
    ),
    "gmail_fr": (
        "Le lun. 7 déc. 2026 à 10:02, Leadgate <review@lg.example> a écrit :\n\n" + _QUOTED
    ),
    "gmail_es": (
        "El lun, 7 dic 2026 a las 10:02, Leadgate (<review@lg.example>) escribió:\n" + _QUOTED
    ),
    "gmail_it": (
        "Il giorno lun 7 dic 2026 alle ore 10:02 Leadgate <review@lg.example> ha scritto:\n"
        + _QUOTED
    ),
    "gmail_pt": (
        "Em seg., 7 de dez. de 2026 às 10:02, Leadgate <review@lg.example> escreveu:\n" + _QUOTED
    ),
    # Outlook.com and Hotmail: Date: first, From: third (talon's html_replies/hotmail).
    "outlook_com": (
        "Date: Mon, 7 Dec 2026 10:02:45 +0000\n"
        "Subject: Review needed\n"
        "From: review@lg.example\n"
        "To: member@acme.io\n\n" + _CARD
    ),
    # Brazilian Outlook: "Enviado em:", in older releases "Enviada em:".
    "outlook_pt_br": (
        "De: Leadgate <review@lg.example>\n"
        "Enviado em: segunda-feira, 7 de dezembro de 2026 10:02\n"
        "Para: Ann Member <member@acme.io>\n"
        "Assunto: Review needed\n\n" + _CARD
    ),
    "outlook_pt_br_old": (
        "De: review@lg.example\n"
        "Enviada em: segunda-feira, 7 de dezembro de 2026 10:02\n"
        "Para: member@acme.io\n"
        "Assunto: Review needed\n\n" + _CARD
    ),
    # Outlook's <hr> as a row of dashes (email_reply_parser's email_2_1).
    "outlook_dashes": (
        " ------------------------------\n\n"
        "*From:* Leadgate [mailto:review@lg.example]\n"
        "*Sent:* Monday, December 7, 2026 10:02 AM\n"
        "*To:* member@acme.io\n"
        "*Subject:* Review needed\n\n\n\n" + _CARD
    ),
}


@pytest.mark.parametrize("client", sorted(QUOTING))
def test_each_client_s_quoted_original_ends_the_text(client: str) -> None:
    """The reason of a reply to a review card is the text above the quoted card. An
    Outlook reply quotes the card under a rule and its headers: the card was read as
    part of the reason (``reject`` with the card as its text)."""
    own = "reject\nThe totals in the second table are wrong."
    for gap in ("\n\n", "\n"):
        assert strip_quoted(own + gap + QUOTING[client]) == own


#: Replies as clients sent them, the person's text above the quoted mail: samples from
#: talon's (mailgun/talon tests/fixtures) and email_reply_parser's (github/
#: email_reply_parser test/emails) fixtures, shortened.
_REAL_REPLIES = {
    # Outlook.com / Hotmail's HTML reply: the quoted headers Date: first.
    "hotmail_html": (
        "html",
        '<html><body><div dir="ltr">Hi. I am fine.<br><br>Thanks,<br>Alex<br><br>'
        '<div><hr id="stopSpelling">Date: Thu, 26 Jun 2014 13:53:45 +0400<br>'
        "Subject: Test message<br>From: abc@example.com<br>To: alex.l@example.com<br><br>"
        "Hello! How are you?<br><br>Thanks,<br>Sasha.</div></div></body></html>",
        "Hi. I am fine.\n\nThanks,\nAlex",
    ),
    # A From: line of the person's own at the top, an Outlook header block below their
    # text (email_2_4): the whole mail was read as quoted, and refused as having no text.
    "own_from_line": (
        "plain",
        "From: foo\nBar baz.\n\nOutlook with a reply directly above line\n\n"
        "From: CRM Comments [crm-comment@example.com]\n"
        "Sent: Friday, 23 March 2012 5:08 p.m.\nTo: John S. Greene\n"
        "Subject: [contact:106] John Greene\n\n"
        "> A new comment has been added to the Contact named 'John Greene':\n",
        "From: foo\nBar baz.\n\nOutlook with a reply directly above line",
    ),
    "date_from_to_subject": (
        "plain",
        "I have gained valuable experience.\n\n\n"
        "Date: Tue, 2 Oct 2012 02:35:10 +0000 \nFrom: john@example.com \n"
        "To: Smith, Shelly \nSubject: Tell us what you learned.\n\n\n\n"
        "Thank you for recently participating in our class.\n",
        "I have gained valuable experience.",
    ),
    "outlook_pt_br": (
        "plain",
        "I have gained valuable experience.\n\nDe: john@example.com\n"
        "Enviada em: sexta-feira, 27 de julho de 2012 15:09\n"
        "Para: shelly@example.com \nAssunto: Tell us what you learned.\n\n"
        "Thank you for recently participating in our class.\n",
        "I have gained valuable experience.",
    ),
    "outlook_dashes": (
        "plain",
        "Outlook with a reply\n\n\n ------------------------------\n\n"
        "*From:* Google Apps Sync Team [mailto:mail-noreply@google.com]\n"
        "*Sent:* Thursday, February 09, 2012 1:36 PM\n*To:* jow@xxxx.com\n"
        "*Subject:* Google Apps Sync was updated!\n\n\n\nDear Google Apps Sync user,\n",
        "Outlook with a reply",
    ),
}


@pytest.mark.parametrize("sample", sorted(_REAL_REPLIES))
async def test_real_replies_keep_the_persons_text_and_drop_the_quoted_mail(
    listener: Listener, sample: str
) -> None:
    """Each client's reply, sent over SMTP, is taken with the person's text alone:
    Outlook.com's quoted headers start with ``Date:`` (the quoted mail was kept), a
    Brazilian Outlook's with ``Enviada em:`` (kept too), a ``From:`` line of the
    person's own above the quoted block cut their text there (all of it, here), and a
    row of dashes above the block stayed at the end of the text."""
    subtype, body, text = _REAL_REPLIES[sample]
    message = _mail(Subject="Re: Test", In_Reply_To="<q1@client.example>")
    message.set_content(body, subtype=subtype)
    await listener.send(message)
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == [text]


def test_a_from_line_in_the_text_itself_is_not_a_quoted_original() -> None:
    text = (
        "return\nThe answer copies the\nFrom: line of the customer's mail into its body,"
        "\nand the\nTo: line too. Date it as sent on Monday."
    )
    assert strip_quoted(text) == text
    signed = "approve\n\n______________\nAnn Member, Acme"  # a rule is no quote alone
    assert strip_quoted(signed) == signed


def test_an_html_only_outlook_reply_ends_at_the_quoted_headers() -> None:
    # Outlook's HTML reply puts the original under a <hr> and a bold header block, in no
    # <blockquote>; its markup has line breaks between the tags.
    markup = (
        '<html><body><div dir="ltr">Return<br>\r\nAdd the Q3 figures.</div>\r\n'
        '<div id="appendonsend"></div>\r\n<hr style="display:inline-block;width:98%">\r\n'
        '<div id="divRplyFwdMsg" dir="ltr"><font face="Calibri, sans-serif">'
        "<b>From:</b> Leadgate &lt;review@lg.example&gt;<br>\r\n"
        "<b>Sent:</b> Monday, December 7, 2026 10:02 AM<br>\r\n"
        "<b>To:</b> Ann Member &lt;member@acme.io&gt;<br>\r\n"
        "<b>Subject:</b> Review needed</font>\r\n<div>&nbsp;</div></div>\r\n"
        "<div>Agent: worker<br>Why: the lead escalated</div></body></html>"
    )
    message = EmailMessage()
    message["From"] = "member@acme.io"
    message["Subject"] = "RE: Review needed"
    message["Message-ID"] = "<o1@acme.io>"
    message.set_content(markup, subtype="html")
    mail = parse_mail(bytes(message), "member@acme.io")
    assert mail is not None and mail.text == "Return\n\nAdd the Q3 figures."


def test_attributions_with_other_spaces_or_wrapped_over_three_lines_are_dropped() -> None:
    """A no-break space (U+00A0, U+202F) in "a écrit :", or an attribution wrapped over
    three lines, was not recognised: the line stayed in the text taken in."""
    own = "reject\nThe totals are wrong."
    for attribution in (
        "Le lun. 7 déc. 2026 à 10:02, Leadgate <review@lg.example> a\u00a0écrit\u00a0:",
        "Le\u202flun. 7 déc. 2026 à 10:02, Leadgate <review@lg.example> a\u202fécrit :",
        "On Mon, Dec 7, 2026 at 10:02 AM Leadgate Review Desk of\n"
        "the Finance Department <\nreview@lg.example> wrote:",
    ):
        assert strip_quoted(f"{own}\n\n{attribution}\n{_QUOTED}") == own, attribution
    # Bounded: a paragraph of the person's own that starts "On" and reaches a "wrote:"
    # only on its fourth line is kept.
    paragraph = "On Monday the board met\nand agreed the budget;\nthe minutes follow\nas Ann wrote:"
    assert strip_quoted(f"{paragraph}\n> Budget: 4.2m") == paragraph


def _forward(body: str, subject: str, *, html: bool = False, **headers: str) -> str | None:
    message = _mail(body, Subject=subject, **headers)
    if html:
        message.set_content(body, subtype="html")
    mail = parse_mail(bytes(message), ALICE)
    return None if mail is None else mail.text


def test_a_forward_is_kept_whole_without_its_fwd_subject() -> None:
    """Gmail's forward line with the "Fwd:" taken out of the subject, and headers pasted
    into a mail that answers none, were cut as a quoted original."""
    gmail = "Please summarise.\n\n---------- Forwarded message ---------\n" + _FORWARDED
    assert _forward(gmail, "Contract") == gmail
    pasted = "Can you answer this one?\n\n" + _FORWARDED
    assert _forward(pasted, "Contract") == pasted
    # A reply's quoted original is still cut, by its subject or its threading headers.
    assert _forward(pasted, "RE: Contract") == "Can you answer this one?"
    assert _forward(pasted, "Contract", In_Reply_To="<r@x>") == "Can you answer this one?"


def test_an_html_only_apple_mail_forward_keeps_the_forwarded_mail() -> None:
    """Apple Mail puts the mail it forwards in a ``<blockquote>``: it was dropped as a
    reply's quote, and the worker got "Please summarise." alone."""
    markup = (
        "<html><body><div>Please summarise.</div><div><br><div>Begin forwarded message:"
        '</div><br><blockquote type="cite"><div><b>From: </b>Bob &lt;bob@supplier.example'
        "&gt;</div><div><b>Subject: </b>Contract</div><div><b>To: </b>Alice</div><br>"
        "<div>The price rises 4% from January.</div></blockquote></div></body></html>"
    )
    for subject in ("Fwd: Contract", "Contract"):
        text = _forward(markup, subject, html=True)
        assert text is not None and text.startswith("Please summarise.\n"), text
        assert "Begin forwarded message:" in text and "From: Bob <bob@supplier.example>" in text
        assert text.endswith("The price rises 4% from January."), text


def test_html_only_gmail_and_outlook_forwards_keep_the_forwarded_mail() -> None:
    """Gmail's HTML forward (its "Forwarded message" line in a ``gmail_quote`` div) and
    Outlook's (an ``<hr>`` and the ``divRplyFwdMsg`` header block), in a mail with no
    text/plain part, with the subject's ``Fwd:`` / ``FW:`` or without it: the forwarded
    mail is kept under the person's words."""
    gmail = (
        '<div dir="ltr">Please summarise.<br><br><div class="gmail_quote">'
        '<div dir="ltr" class="gmail_attr">---------- Forwarded message ---------<br>'
        'From: <strong class="gmail_sendername" dir="auto">Bob</strong> <span dir="auto">'
        '&lt;<a href="mailto:bob@supplier.example">bob@supplier.example</a>&gt;</span><br>'
        "Date: Mon, Dec 7, 2026 at 9:12 AM<br>Subject: Contract<br>To: &lt;<a href="
        '"mailto:alice@acme.io">alice@acme.io</a>&gt;<br></div><br><br>'
        '<div dir="ltr">The price rises 4% from January.</div>\n</div></div>'
    )
    outlook = (
        "<html><body><div>Please summarise.</div><div><br></div>"
        '<hr style="display:inline-block;width:98%" tabindex="-1"><div id="divRplyFwdMsg" '
        'dir="ltr"><font face="Calibri, sans-serif" style="font-size:11pt"><b>From:</b> Bob '
        "&lt;bob@supplier.example&gt;<br><b>Sent:</b> Monday, December 7, 2026 9:12 AM<br>"
        "<b>To:</b> Alice &lt;alice@acme.io&gt;<br><b>Subject:</b> Contract</font>"
        '<div>&nbsp;</div></div><div><div dir="ltr">The price rises 4% from January.'
        "</div></div></body></html>"
    )
    # Also forwarded from inside a thread, the client naming the mail it forwards in
    # In-Reply-To: the forward line (Gmail's, whatever the subject) or the subject's
    # FW: / WG: (Outlook's, which writes no line) tells it from a reply.
    cases = [
        (gmail, "Fwd: Contract", False),
        (gmail, "Contract", False),
        (gmail, "Contract", True),
        (outlook, "FW: Contract", False),
        (outlook, "FW: Contract", True),
        (outlook, "WG: Contract", True),
        (outlook, "Contract", False),
    ]
    for markup, subject, threaded in cases:
        headers = {"In_Reply_To": "<orig@supplier.example>"} if threaded else {}
        text = _forward(markup, subject, html=True, **headers)
        assert text is not None and text.startswith("Please summarise.\n"), (subject, text)
        assert "From: Bob" in text and "Subject: Contract" in text, (subject, text)
        assert text.endswith("The price rises 4% from January."), (subject, text)


async def test_a_mail_that_is_only_an_attached_message_is_read_as_a_forward(
    listener: Listener,
) -> None:
    """A mail forwarded as an attachment (``message/rfc822``) alone was refused, 550
    (email.body)."""
    inner = EmailMessage()
    inner["From"] = "Bob <bob@supplier.example>"
    inner["To"] = ALICE
    inner["Subject"] = "Contract"
    inner["Date"] = "Mon, 07 Dec 2026 09:12:00 +0000"
    inner.set_content("The price rises 4% from January.")
    message = EmailMessage()
    message["From"] = ALICE
    message["To"] = BOT
    message["Subject"] = "Contract"
    message["Message-ID"] = "<att@client.example>"
    message.add_attachment(inner)
    await listener.send(message)
    await listener.core.drain()
    [trigger] = listener.core.triggers
    assert trigger.text == (
        "---------- Forwarded message ---------\n"
        "From: Bob <bob@supplier.example>\n"
        "Date: Mon, 07 Dec 2026 09:12:00 +0000\n"
        "Subject: Contract\n"
        f"To: {ALICE}\n\n"
        "The price rises 4% from January."
    )


def test_strip_quoted_forms() -> None:
    assert strip_quoted("ok\nOn Tue, Bob wrote:\n> x") == "ok"
    assert strip_quoted("ok\r\n-----Original Message-----\r\nFrom: x") == "ok"
    assert strip_quoted("> only quoted\n>> more") == ""
    assert strip_quoted("On my way, see you\nbye") == "On my way, see you\nbye"
    # A translated header alone, or an opener with no "wrote", ends nothing.
    kept = "return\nDe: la tabla\nAm Montag schrieb ich es neu\nLe total est faux"
    assert strip_quoted(kept) == kept


def test_reply_subject_is_not_doubled() -> None:
    assert reply_subject("Report") == "Re: Report"
    assert reply_subject("RE: Report") == "RE: Report"
    assert reply_subject("re:Report") == "re:Report"
    assert reply_subject("") == "Re:"
    assert reply_subject("a\r\n b") == "Re: a b"


async def test_threading_fields_follow_the_thread(listener: Listener) -> None:
    await listener.send(
        _mail(
            "Follow-up",
            Subject="Re: Quarterly report",
            Message_ID="<m3@client.example>",
            In_Reply_To="<m2@leadgate.example>",
            References="<m1@client.example> <m2@leadgate.example>",
        )
    )
    await listener.send(
        _mail("No references", Message_ID="<m5@client.example>", In_Reply_To="<m4@x.example>")
    )
    await listener.core.drain()
    first, second = listener.core.triggers
    assert first.session_key == f"email:{BOT}:{ALICE}:<m1@client.example>"
    assert first.binding.address["subject"] == "Re: Quarterly report"
    assert first.binding.address["in_reply_to"] == "<m3@client.example>"
    assert first.binding.address["references"] == (
        "<m1@client.example> <m2@leadgate.example> <m3@client.example>"
    )
    assert second.session_key == f"email:{BOT}:{ALICE}:<m4@x.example>"
    assert second.binding.address["references"] == "<m4@x.example> <m5@client.example>"


async def test_only_a_mail_whose_thread_nothing_tells_looks_up_the_mail_it_names(
    listener: Listener,
) -> None:
    """Alice answers her own earlier mail (In-Reply-To alone, "one more thing"): its
    session is looked up by that mail's event (this correspondent's own), and continued,
    the thread's first id leading References. A mail with References, or naming one of
    our replies, or none, asks nothing."""
    ours = message_id_for("dlv-1", BOT, "<m1@client.example>")
    await listener.send(_mail("First"))
    await listener.send(
        _mail(
            "With references",
            Message_ID="<m2@client.example>",
            In_Reply_To="<m1@client.example>",
            References="<m1@client.example>",
        )
    )
    await listener.send(_mail("To our reply", Message_ID="<m3@client.example>", In_Reply_To=ours))
    await listener.send(
        _mail("One more thing", Message_ID="<m4@client.example>", In_Reply_To="<m2@client.example>")
    )
    await listener.core.drain()
    assert listener.core.event_lookups == [f"email:{BOT}:{ALICE}:<m2@client.example>"]
    keys = {trigger.session_key for trigger in listener.core.triggers}
    assert keys == {f"email:{BOT}:{ALICE}:<m1@client.example>"}
    assert listener.core.triggers[-1].binding.address["references"] == (
        "<m1@client.example> <m2@client.example> <m4@client.example>"
    )


async def test_a_database_fault_looking_up_a_thread_is_451_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Down(FakeCore):
        async def event_session_key(self, external_event_id: str) -> str | None:
            raise Unavailable("database is locked", rule="service.unavailable")

    caplog.set_level(logging.INFO)
    async for listener in _listen(Down(_allow(ALICE))):
        with pytest.raises(aiosmtplib.SMTPDataError) as info:
            await listener.send(_mail("More", In_Reply_To="<m0@client.example>"))
        assert info.value.code == 451
        assert listener.core.triggers == []
    [said] = [r for r in caplog.records if r.name == "bots.email" and "thread" in r.getMessage()]
    assert said.levelno == logging.WARNING and said.exc_info is None
    assert "(service.unavailable)" in said.getMessage()


async def test_a_database_fault_looking_up_our_reply_a_mail_names_is_451() -> None:
    """A mail naming alone a mail that is none of the person's own (perhaps one of our
    replies, sent before our Message-IDs carried their thread) looks up the delivery
    that sent it, in the route's organization, to this sender from this recipient; a
    fault there is 451 as the first look-up's is."""

    class Down(FakeCore):
        async def email_reply_session_key(
            self, org_id: str, message_id: str, *, sent_to: str, sent_from: str
        ) -> str | None:
            self.sent_lookups.append(f"{org_id} {message_id} {sent_to} {sent_from}")
            raise Unavailable("database is locked", rule="service.unavailable")

    async for listener in _listen(Down(_allow(ALICE))):
        with pytest.raises(aiosmtplib.SMTPDataError) as info:
            await listener.send(_mail("More", In_Reply_To="<dlv-1@leadgate.example>"))
        assert info.value.code == 451
        assert listener.core.triggers == []
        assert listener.core.sent_lookups == [f"org-1 <dlv-1@leadgate.example> {ALICE} {BOT}"]


async def test_missing_message_id_gets_a_stable_one(listener: Listener) -> None:
    raw = (
        b"From: alice@example.com\r\nTo: bot@leadgate.example\r\nSubject: hi\r\n\r\nno id here\r\n"
    )
    await listener.send(raw)
    await listener.send(raw)
    await listener.core.drain()
    first, second = listener.core.triggers
    assert first.external_event_id == second.external_event_id
    assert first.external_event_id is not None
    assert first.external_event_id.endswith("@leadgate.invalid>")
    # the same key as its session's: a mail that starts a thread is its root
    assert first.external_event_id == first.session_key


async def test_multipart_with_latin1_and_broken_bytes(listener: Listener) -> None:
    raw = (
        b"From: alice@example.com\r\n"
        b"To: bot@leadgate.example\r\n"
        b"Subject: =?iso-8859-1?q?Gr=FC=DFe?=\r\n"
        b"Message-ID: <mp@client.example>\r\n"
        b"MIME-Version: 1.0\r\n"
        b'Content-Type: multipart/alternative; boundary="b1"\r\n'
        b"\r\n"
        b"--b1\r\n"
        b"Content-Type: text/plain; charset=iso-8859-1\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n"
        b"\r\n"
        b"Gr\xfc\xdfe aus K\xf6ln\r\n"
        b"--b1\r\n"
        b"Content-Type: text/html; charset=iso-8859-1\r\n"
        b"\r\n"
        b"<p>Gr\xfc\xdfe aus K\xf6ln</p>\r\n"
        b"--b1--\r\n"
    )
    broken = (
        b"From: alice@example.com\r\nTo: bot@leadgate.example\r\nSubject: bad\r\n"
        b"Message-ID: <bad@client.example>\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n"
        b"\r\nbroken \xff\xfe bytes\r\n"
    )
    unknown = (
        b"From: alice@example.com\r\nTo: bot@leadgate.example\r\nSubject: odd\r\n"
        b"Message-ID: <odd@client.example>\r\n"
        b"Content-Type: text/plain; charset=x-no-such-charset\r\n"
        b"\r\nplain words\r\n"
    )
    for raw_message in (raw, broken, unknown):
        await listener.send(raw_message)
    await listener.core.drain()
    texts = [t.text for t in listener.core.triggers]
    assert texts == ["Grüße aus Köln", "broken \ufffd\ufffd bytes", "plain words"]
    assert listener.core.triggers[0].binding.address["subject"] == "Re: Grüße"


async def test_8bit_text_no_known_charset_names_keeps_its_letters(listener: Listener) -> None:
    """Latin-1 text labelled with no charset Python knows (``unknown-8bit``, what mail
    gateways write for unlabelled 8-bit text; ``x-user-defined``), or with none at all:
    its letters were replaced with U+FFFD, what the person wrote lost. UTF-8 is still
    read as UTF-8; a charset that cannot decode with replacement (``idna``) gave no text
    at all, and the mail was refused with ``550 (email.body)``."""
    head = (
        b"From: alice@example.com\r\nTo: bot@leadgate.example\r\nSubject: s\r\n"
        b"Message-ID: <%d@client.example>\r\nMIME-Version: 1.0\r\n"
    )
    bodies = [
        (b'Content-Type: text/plain; charset="unknown-8bit"', b"Gr\xfc\xdfe aus K\xf6ln"),
        (b"Content-Type: text/plain; charset=x-user-defined", b"Gr\xfc\xdfe aus K\xf6ln"),
        (b"Content-Transfer-Encoding: 8bit", b"Gr\xfc\xdfe aus K\xf6ln"),
        (b"Content-Type: text/plain; charset=unknown-8bit", "Grüße aus Köln".encode()),
        (b"Content-Type: text/plain; charset=idna", b"Gr" + b"u" * 70 + b"sse"),
    ]
    for n, (header, body) in enumerate(bodies):
        await listener.send(head % n + header + b"\r\n\r\n" + body + b"\r\n")
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == [
        "Grüße aus Köln",
        "Grüße aus Köln",
        "Grüße aus Köln",
        "Grüße aus Köln",
        "Gr" + "u" * 70 + "sse",
    ]


async def test_a_blank_text_part_beside_html_reads_the_html(listener: Listener) -> None:
    """multipart/alternative with an empty text/plain and the text in text/html: the
    blank part was taken as the text and the mail refused as having none (550)."""
    msg = _mail("\n")
    msg.add_alternative("<p>Please call me back.</p>", subtype="html")
    await listener.send(msg)
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == ["Please call me back."]


async def test_html_only_message(listener: Listener) -> None:
    msg = _mail()
    msg.set_content(
        "<html><head><style>p {color: red}</style></head><body>"
        "<p>Hello &amp; welcome</p><div>second<br>line</div>"
        "<blockquote>old quoted text</blockquote></body></html>",
        subtype="html",
    )
    await listener.send(msg)
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == ["Hello & welcome\nsecond\nline"]


async def test_unrouted_recipient_is_550_at_rcpt(listener: Listener) -> None:
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as info:
        await listener.send(_mail(), rcpt=["nobody@leadgate.example"])
    [refusal] = info.value.recipients
    assert refusal.code == 550
    # Each SMTP refusal names its rule, as the card and From: refusals did already.
    assert refusal.message.endswith("(email.route)"), refusal.message
    await listener.core.drain()
    assert listener.core.triggers == []


async def test_sender_not_allowed_is_550(listener: Listener) -> None:
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as info:
        await listener.send(_mail(From="mallory@evil.example"), sender="mallory@evil.example")
    assert info.value.recipients[0].code == 550
    # allowed by domain
    await listener.send(_mail(From="carol@partner.example"), sender="carol@partner.example")
    await listener.core.drain()
    assert [t.binding.address["to"] for t in listener.core.triggers] == ["carol@partner.example"]


async def test_from_header_must_be_allowed_too(listener: Listener) -> None:
    # The envelope sender is allowed, but the reply would go to From: mallory.
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        await listener.send(_mail(From="mallory@evil.example"), sender=ALICE)
    assert info.value.code == 550
    await listener.core.drain()
    assert listener.core.triggers == []


async def test_a_recipient_whose_route_refuses_the_from_is_logged_when_the_mail_is_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both recipients' routes allow the envelope sender, only the bot's allows From:
    (bob). The other recipient gets no part and the mail is 250 for the bot's part: that
    part was dropped without a line, and an operator could not see why a mail to it went
    unanswered. A mail neither route's From: check lets through is still 550 5.7.1."""
    bob, sales = "bob@example.com", "sales@leadgate.example"
    core = FakeCore(
        lambda channel, attrs: (
            _allow(ALICE, bob)(channel, attrs) or _allow(ALICE, address=sales)(channel, attrs)
        )
    )
    async for listener in _listen(core):
        with caplog.at_level(logging.INFO, logger="bots.email"):
            await listener.send(_mail(From=bob), rcpt=[BOT, sales])
            await listener.core.drain()
            assert [t.binding.address["from"] for t in listener.core.triggers] == [BOT]
            lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bots.email"]
            assert lines == [
                (logging.WARNING, f"email: took a mail but not its part to {sales}: email.sender")
            ]
            with pytest.raises(aiosmtplib.SMTPDataError) as info:
                await listener.send(
                    _mail(From="mallory@evil.example", Message_ID="<m2@x>"), rcpt=[BOT, sales]
                )
            assert (info.value.code, info.value.message) == (
                550,
                "5.7.1 Sender not allowed (email.sender)",
            )
        assert len(listener.core.triggers) == 1
        assert len([r for r in caplog.records if r.name == "bots.email"]) == 1


TOO_LARGE = "5.3.4 Message too big: at most 1048576 bytes (email.too_large)"


async def test_oversize_message_is_552_naming_the_rule(listener: Listener) -> None:
    """A mail over 1 MiB sent without a declared ``SIZE`` was refused after its data
    by aiosmtpd's own ``552 Error: Too much mail data``, naming no rule, unlike every
    other refusal of the listener's. The session goes on: its next mail is taken."""
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=listener.port, timeout=10)
    big = _mail("x" * 70 + ("\n" + "y" * 70) * 16_000).as_bytes()
    async with client:
        await client.ehlo()
        await client.mail(ALICE)  # (no SIZE: aiosmtplib.send declares it)
        await client.rcpt(BOT)
        with pytest.raises(aiosmtplib.SMTPDataError) as info:
            await client.data(big)
        assert (info.value.code, info.value.message) == (552, TOO_LARGE)
        await listener.core.drain()
        assert listener.core.triggers == []
        await client.mail(ALICE)
        await client.rcpt(BOT)
        assert (await client.data(_mail("small").as_bytes())).code == 250
    await listener.core.drain()
    assert len(listener.core.triggers) == 1


async def test_a_declared_size_over_the_limit_is_552_naming_the_rule(
    listener: Listener,
) -> None:
    """A sender that declares the mail's ``SIZE`` at ``MAIL FROM`` (the listener
    advertises its limit in EHLO) is refused there, before any data, with the same
    rule-named reply (aiosmtpd's own said "552 Error: message size exceeds fixed
    maximum message size")."""
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=listener.port, timeout=10)
    async with client:
        await client.ehlo()
        assert client.supports_extension("size")
        with pytest.raises(aiosmtplib.SMTPSenderRefused) as info:
            await client.mail(ALICE, options=["SIZE=1048577"])
        assert (info.value.code, info.value.message) == (552, TOO_LARGE)
        # At the limit it is taken.
        assert (await client.mail(ALICE, options=["SIZE=1048576"])).code == 250
    # aiosmtplib.send declares the size of what it sends: refused at MAIL FROM.
    with pytest.raises(aiosmtplib.SMTPSenderRefused) as sent:
        await listener.send(_mail("x" * 70 + ("\n" + "y" * 70) * 16_000))
    assert (sent.value.code, sent.value.message) == (552, TOO_LARGE)
    await listener.core.drain()
    assert listener.core.triggers == []


def _nested(depth: int, text: str = "the innermost text") -> bytes:
    """A message whose body is ``depth`` multiparts, each inside the one before."""
    head = f"From: {ALICE}\r\nTo: {BOT}\r\nSubject: deep\r\nMessage-ID: <deep@x>\r\n"
    opening = "".join(
        f"Content-Type: multipart/mixed; boundary=b{n}\r\n\r\n--b{n}\r\n" for n in range(depth)
    )
    closing = "".join(f"\r\n--b{n}--\r\n" for n in reversed(range(depth)))
    inner = f"Content-Type: text/plain\r\n\r\n{text}"
    return (head + opening + inner + closing).encode()


async def test_a_message_nested_past_the_bound_is_refused_before_parsing(
    listener: Listener,
) -> None:
    """3,000 nested multiparts took 2.4 s of parsing; past MAX_MULTIPARTS (100) the
    message is refused (554) after a scan of its bytes."""
    bomb = _nested(3_000)
    started = time.perf_counter()
    with pytest.raises(TooManyParts):
        parse_mail(bomb, ALICE)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        await listener.send(bomb)
    assert (info.value.code, info.value.message) == (
        554,
        "5.6.0 Message has too many MIME parts (email.parts)",
    )
    # Real mail nests a handful of levels, and even 100 are read.
    mail = parse_mail(_nested(MAX_MULTIPARTS), ALICE)
    assert mail is not None and mail.text == "the innermost text"
    await listener.send(_nested(5))
    await listener.core.drain()
    assert [t.text for t in listener.core.triggers] == ["the innermost text"]


@pytest.mark.parametrize("body", ["", "   \n\n", "> only a quote\n"])
async def test_empty_body_is_550(listener: Listener, body: str) -> None:
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        await listener.send(_mail(body))
    assert info.value.code == 550
    assert info.value.message.endswith("(email.body)"), info.value.message
    assert listener.core.triggers == []


async def test_attachment_only_is_550(listener: Listener) -> None:
    msg = EmailMessage()
    msg["From"] = ALICE
    msg["To"] = BOT
    msg["Subject"] = "file"
    msg.add_attachment(b"\x00\x01", maintype="application", subtype="octet-stream")
    with pytest.raises(aiosmtplib.SMTPDataError) as info:
        await listener.send(msg)
    assert info.value.code == 550


@pytest.mark.parametrize(
    "mark",
    [
        {"Auto_Submitted": "auto-replied"},
        {"Precedence": "bulk"},
        {"Precedence": "List"},
        {"Precedence": "auto_reply", "X_Autorespond": "yes"},
        {"X_Autoreply": "yes"},
        {"List_Id": "Team <team.lists.example>"},
    ],
)
async def test_automatic_mail_runs_no_turn(listener: Listener, mark: dict[str, str]) -> None:
    await listener.send(_mail("I am out of office", **mark))
    await listener.core.drain()
    assert listener.core.triggers == []


async def test_silent_route_and_several_recipients() -> None:
    other = "sales@leadgate.example"

    def routes(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        if attrs["sender"] != ALICE:
            return None
        if attrs["address"] == BOT:
            return RouteMatch("r-bot", "org-1", "agent-1", silent=False)
        if attrs["address"] == other:
            return RouteMatch("r-sales", "org-1", "agent-2", silent=True)
        return None

    async for listener in _listen(FakeCore(routes)):
        refused, _ = await listener.send(_mail(), rcpt=[BOT, other, "nobody@leadgate.example"])
        assert set(refused) == {"nobody@leadgate.example"}
        await listener.core.drain()
        by_route = {t.binding.route_id: t for t in listener.core.triggers}
        assert set(by_route) == {"r-bot", "r-sales"}
        assert by_route["r-sales"].binding.silent is True
        assert by_route["r-sales"].session_key == f"email:{other}:{ALICE}:<m1@client.example>"
        assert by_route["r-sales"].binding.address["from"] == other


async def test_long_ids_are_bounded_so_no_recipient_is_refused_after_another_was_taken() -> None:
    """A legal Message-ID may be nearly 1,000 characters and an address 254: the ids the
    core stores (event id at most 300, session key 500) keep a digest instead, the same
    for the same mail, so one long recipient cannot refuse a mail another recipient
    already took (the sender would see a bounce while a reply went out)."""
    long_address = "a" * 240 + "@leadgate.example"
    message_id = "<" + "m" * 900 + "@client.example>"

    def routes(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        return RouteMatch("route-1", "org-1", "agent-1", silent=False)

    async for listener in _listen(FakeCore(routes)):
        await listener.send(_mail(Message_ID=message_id), rcpt=[BOT, long_address])
        await listener.send(_mail(Message_ID=message_id), rcpt=[BOT, long_address])  # again
        await listener.core.drain()
        recorded = listener.core.recorded
        assert [i.route_attrs["address"] for i in recorded] == [BOT, long_address] * 2
        for inbound in recorded:
            assert len(inbound.external_event_id) <= 300
            assert len(inbound.session_key) <= 500
        first, again = recorded[:2], recorded[2:]
        assert [i.external_event_id for i in first] == [i.external_event_id for i in again]
        assert len({i.external_event_id for i in first}) == 2
        assert recorded[0].address["in_reply_to"] == message_id  # threading keeps the id


async def test_a_mail_takes_at_most_a_hundred_recipients() -> None:
    def routes(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        return RouteMatch("route-1", "org-1", "agent-1", silent=True)

    everyone = [f"desk{i}@leadgate.example" for i in range(101)]
    async for listener in _listen(FakeCore(routes)):
        refused, _ = await listener.send(_mail(), rcpt=everyone)
        assert {address: code for address, (code, _) in refused.items()} == {everyone[-1]: 452}
        assert refused[everyone[-1]][1].endswith("(email.recipients)"), refused
        await listener.core.drain()
        assert len(listener.core.recorded) == 100


def test_create_depends_on_configuration() -> None:
    core = FakeCore(_allow())
    assert create(Settings(), core) is None
    outbound_only = create(Settings(email=EmailSettings(smtp_host="127.0.0.1")), core)
    assert isinstance(outbound_only, EmailAdapter) and not outbound_only.listens
    inbound = create(Settings(email=EmailSettings(listen_host="127.0.0.1")), core)
    assert isinstance(inbound, EmailAdapter) and inbound.listens
    assert inbound.channel.name == "email" and inbound.channel.max_chars == 1_000_000


async def test_outbound_only_adapter_does_not_listen() -> None:
    adapter = EmailAdapter(EmailSettings(smtp_host="127.0.0.1"), FakeCore(_allow()))
    app = web.Application()
    mount_adapter(app, adapter)
    runner = web.AppRunner(app)
    await runner.setup()
    assert adapter.port is None
    await runner.cleanup()


async def test_null_sender_runs_no_turn() -> None:
    # A bounce (MAIL FROM:<>) to a route without a sender allow-list: accepted, no turn.
    async for listener in _listen(
        FakeCore(lambda channel, attrs: RouteMatch("r", "o", "a", False))
    ):
        # aiosmtplib.send() would take an empty sender from From:, so talk SMTP directly.
        async with aiosmtplib.SMTP(hostname="127.0.0.1", port=listener.port, timeout=10) as smtp:
            await smtp.sendmail("", [BOT], _mail("Delivery failed").as_bytes())
        await listener.core.drain()
        assert listener.core.triggers == []


async def test_route_lookup_failure_is_a_temporary_failure() -> None:
    def broken(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        raise RuntimeError("database is down")

    async for listener in _listen(FakeCore(broken)):
        with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as info:
            await listener.send(_mail())
        assert info.value.recipients[0].code == 451
        assert listener.core.triggers == []


async def test_a_database_fault_at_rcpt_is_451_with_one_line_and_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def down(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        raise Unavailable("database is locked", rule="service.unavailable")

    caplog.set_level(logging.INFO)
    async for listener in _listen(FakeCore(down)):
        with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as info:
            await listener.send(_mail())
        assert info.value.recipients[0].code == 451
    # It was log.exception: a traceback per recipient of every retried mail.
    [said] = [r for r in caplog.records if r.name == "bots.email" and "route" in r.getMessage()]
    assert said.levelno == logging.WARNING and said.exc_info is None
    assert "(service.unavailable)" in said.getMessage()


class _FailingReviews:
    """A review backend that knows one card and whose decision raises a bug (no
    database fault: those are answered ``unavailable``)."""

    async def reply_card(self, token: str) -> ReplyCard | None:
        return ReplyCard("org-1", "item-1", "ep-1", "awaitingHuman", None, "card-1", "agent-1")

    async def email_reply(self, *args: object) -> Any:
        raise RuntimeError("a bug quoting the mail: my reason")


async def test_a_bug_while_taking_a_mail_is_451_without_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What handling a mail raised past the listener's own handling was aiosmtpd's
    ``500 Error: (RuntimeError) <its text>``: a permanent refusal, the mail bounced for
    good with the error's text (quoting the mail) told to the sender. It is a ``451``
    now (the sending server retries) and one ERROR line with the traceback."""
    async for listener in _listen(FakeCore(_allow(ALICE))):
        reviews = cast(ChatReviewBackend, _FailingReviews())
        listener.adapter.handler.answer_cards(reviews, "review@lg.example")
        with (
            caplog.at_level(logging.ERROR, logger="bots.email"),
            pytest.raises(aiosmtplib.SMTPDataError) as info,
        ):
            await listener.send(_mail("reject\nmy reason"), rcpt=[f"review+{'a' * 32}@lg.example"])
        assert info.value.code == 451, info.value
        assert "my reason" not in info.value.message
        [line] = [r for r in caplog.records if r.name == "bots.email"]
        assert line.getMessage() == "email: handling an SMTP command failed; asking to retry"
        assert line.exc_info is not None


async def _smtputf8_mail(port: int, envelope_sender: str, raw: bytes) -> None:
    """One mail ``raw`` (its lines CRLF-ended) from ``envelope_sender`` to the bot, sent
    with ``SMTPUTF8`` in raw SMTP lines (non-ASCII addresses, which the client library
    encodes first), and taken (250 after its final dot)."""
    replies = await _smtp_raw(
        port,
        [
            b"EHLO client.example",
            f"MAIL FROM:<{envelope_sender}> SMTPUTF8".encode(),
            f"RCPT TO:<{BOT}>".encode(),
            b"DATA",
            raw + b".",
            b"QUIT",
        ],
    )
    assert replies[5].startswith(b"250"), replies


async def _smtp_raw(port: int, commands: list[bytes]) -> list[bytes]:
    """One SMTP conversation of raw command lines (bytes no client library would send);
    the reply line of each (the last line of a multi-line reply)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def reply() -> bytes:
        while True:
            line = await reader.readline()
            if line[3:4] != b"-":
                return line.rstrip()

    replies = [await reply()]
    for command in commands:
        writer.write(command + b"\r\n")
        await writer.drain()
        replies.append(await reply())
    writer.close()
    return replies


async def test_an_address_that_is_not_utf8_is_553_at_rcpt(listener: Listener) -> None:
    # aiosmtpd hands such bytes over as surrogate escapes; the route lookup raised on
    # them and answered 451, so the sender's server retried a mail we could never take.
    replies = await _smtp_raw(
        listener.port,
        [
            b"EHLO client.example",
            b"MAIL FROM:<al\xffice@example.com>",
            b"RCPT TO:<" + BOT.encode() + b">",
            b"RSET",
            b"MAIL FROM:<" + ALICE.encode() + b">",
            b"RCPT TO:<b\xffot@leadgate.example>",
            b"QUIT",
        ],
    )
    assert replies[3].startswith(b"553 5.1.7"), replies
    assert replies[6].startswith(b"553 5.1.3"), replies
    assert all(replies[i].rstrip().endswith(b"(email.address)") for i in (3, 6)), replies
    await listener.core.drain()
    assert listener.core.triggers == []


async def test_utf8_addresses_and_headers_are_read_as_text() -> None:
    sender = "jürgen@exämple.de"
    async for listener in _listen(FakeCore(_allow(sender))):
        raw = (
            f"From: Jürgen <{sender}>\r\nTo: {BOT}\r\n"
            "Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe=00und_mehr?=\r\n"
            "Message-ID: <a\x01b@exämple.de>\r\n\r\nHallo Welt\r\n"
        ).encode()
        await _smtputf8_mail(listener.port, sender, raw)
        await listener.core.drain()
        [trigger] = listener.core.triggers
        # The From: address as text, not as surrogate escapes of its UTF-8 bytes.
        assert trigger.binding.address["to"] == sender
        # A NUL from an encoded word is a blank; a control character ends no id.
        assert trigger.binding.address["subject"] == "Re: Grüße und mehr"
        assert trigger.external_event_id is not None
        assert "\x01" not in trigger.external_event_id


async def test_an_idn_sender_is_one_correspondent_in_either_form() -> None:
    """``user@bücher.example`` and ``user@xn--bcher-kva.example`` are one sender: their
    mails in one thread are one session (they were two)."""
    written, ace = "user@bücher.example", "user@xn--bcher-kva.example"
    async for listener in _listen(FakeCore(_allow(written, ace))):
        thread = "<i1@bücher.example>"
        for sender, headers in (
            (written, f"Message-ID: {thread}\r\n"),
            (ace, f"Message-ID: <i2@bücher.example>\r\nReferences: {thread}\r\n"),
        ):
            raw = (
                f"From: <{sender}>\r\nTo: {BOT}\r\nSubject: Order\r\n{headers}\r\nMore books\r\n"
            ).encode()
            await _smtputf8_mail(listener.port, ace, raw)
        await listener.core.drain()
        first, second = listener.core.triggers
        assert first.session_key == second.session_key == f"email:{BOT}:{ace}:{thread}"
        # Each is answered at the address it wrote from.
        assert [t.binding.address["to"] for t in (first, second)] == [written, ace]


async def test_connections_beyond_the_limit_get_421_and_are_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``[email] max_connections``: idle sessions up to the limit hold; one more is
    answered ``421`` and closed before anything is read (the sender retries later); a
    closed session makes room. Refusals are one WARNING with their count."""
    settings = EmailSettings(listen_host="127.0.0.1", listen_port=0, max_connections=2)
    adapter = EmailAdapter(settings, FakeCore(_allow(ALICE)), hostname="mx.test")
    app = web.Application()
    mount_adapter(app, adapter)
    runner = web.AppRunner(app)
    await runner.setup()
    caplog.set_level(logging.WARNING, logger="bots.email")
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        # Six at once: asyncio makes every accepted connection's protocol before any
        # connection_made runs, so the count is taken when the protocol is made.
        async def connect() -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", adapter.port)
            return await reader.readline(), reader, writer

        burst = await asyncio.gather(*(connect() for _ in range(6)))
        refusal = b"421 4.3.2 mx.test too many connections, try again later\r\n"
        assert sorted(line[:3] for line, _, _ in burst) == [b"220"] * 2 + [b"421"] * 4
        for line, reader, writer in burst:
            if line.startswith(b"220 "):
                opened.append((reader, writer))
            else:
                assert line == refusal and await reader.read() == b""  # closed after it
                writer.close()
        assert adapter.open_sessions == 2
        assert adapter.refusals.total == 4
        _, first = opened.pop(0)
        first.close()
        await first.wait_closed()
        await eventually(lambda: adapter.open_sessions == 1, 2.0)
        assert adapter.port is not None
        replies = await _smtp_raw(adapter.port, [b"EHLO client.test", b"QUIT"])
        assert replies[0].startswith(b"220 ") and replies[-1].startswith(b"221")
    finally:
        for _, writer in opened:
            writer.close()
        await runner.cleanup()
    await eventually(lambda: adapter.open_sessions == 0, 2.0)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == ["email: 1 SMTP connection(s) refused (421) at [email] max_connections = 2"]


async def test_a_damaged_database_met_by_either_route_lookup_is_451_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At RCPT TO and again at DATA for a From: that is not the envelope's sender, each
    lookup meeting a damaged database was the driver's traceback per mail; recording
    the mail, a WARNING per mail. All are asked to retry, in one ERROR line a minute."""
    detail = "the SQLite database /srv/leadgate.db is damaged (SQLite: ...)"

    def damaged_for_bob(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        if attrs["sender"] in ("bob@example.com", "carol@example.com"):
            raise DatabaseDamaged(detail)
        return RouteMatch("route-1", "org-1", "agent-1", silent=False)

    class DamagedRecord(FakeCore):
        """Recording the mail meets the damage (its route was found at RCPT TO)."""

        async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Any:
            if inbound.route_attrs["sender"] == "dave@example.com":
                raise DatabaseDamaged(detail)
            return await super().record_inbound(inbound, notice=notice)

    async for listener in _listen(DamagedRecord(damaged_for_bob)):
        with pytest.raises(aiosmtplib.SMTPRecipientsRefused) as refused:
            await listener.send(_mail(), sender="carol@example.com")
        assert refused.value.recipients[0].code == 451
        for n in range(2):
            with pytest.raises(aiosmtplib.SMTPDataError) as info:
                await listener.send(_mail(From="bob@example.com", Message_ID=f"<b{n}@x>"))
            assert info.value.code == 451
        # Recording it was a WARNING per mail.
        with pytest.raises(aiosmtplib.SMTPDataError) as info:
            await listener.send(_mail(From="dave@example.com"), sender="dave@example.com")
        assert info.value.code == 451
        assert listener.core.triggers == []
        handler = listener.adapter.handler
    lines = [r for r in caplog.records if r.name == "bots.email" and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, lines
    assert (
        lines[0].getMessage()
        == f"email: 1 mail(s) met a damaged database (asked to retry, 451): {detail}"
    )
    assert lines[0].exc_info is None
    assert handler.damaged.total == 4
