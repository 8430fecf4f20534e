"""Outbound half of the email adapter: real aiosmtplib against the SMTP sink stand-in."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Mapping
from email.message import EmailMessage
from typing import Any

import aiosmtplib
import pytest

from bots.email import EmailAdapter, EmailChannel, message_id_for
from bots.email_parse import thread_of
from leadgate.core.config import EmailSettings
from leadgate.core.types import RouteMatch
from outbox.channel import OutboundMessage, Permanent, Retry, Sent, Uncertain
from outbox.store import SEND_DEADLINE_S, SEND_LEASE_MS
from tests.fakes import FakeCore
from tests.standins.smtp import SmtpSink

BOT = "bot@leadgate.example"
ALICE = "alice@example.com"

ADDRESS: dict[str, Any] = {
    "to": ALICE,
    "from": BOT,
    "subject": "Re: Quarterly report",
    "in_reply_to": "<m2@client.example>",
    "references": "<m1@client.example> <m2@client.example>",
}

#: The Message-ID of delivery ``dlv-42`` to ADDRESS: its key, then its thread's first
#: Message-ID (``<m1@client.example>``) base32 after ``.t.``.
DLV_42 = "<dlv-42.t.nuyuay3mnfsw45bomv4gc3lqnrsq@leadgate.example>"


def _channel(sink: SmtpSink, **settings: Any) -> EmailChannel:
    return EmailChannel(
        EmailSettings(smtp_host="127.0.0.1", smtp_port=sink.port, **settings),
        timeout_s=0.5,
        local_hostname="leadgate.test",
    )


def _message(
    address: Mapping[str, Any] = ADDRESS, text: str = "Echo: hi", key: str = "dlv-42"
) -> OutboundMessage:
    return OutboundMessage(
        delivery_id="42", idempotency_key=key, address=dict(address), text=text, kind="reply"
    )


async def test_reply_is_threaded_with_a_deterministic_message_id(sink: SmtpSink) -> None:
    channel = _channel(sink)
    outcome = await channel.send(_message())
    assert outcome == Sent(DLV_42)
    [mail] = sink.messages
    assert mail["mail_from"] == BOT and mail["rcpt_tos"] == [ALICE]
    assert mail["from"] == BOT and mail["to"] == ALICE
    assert mail["subject"] == "Re: Quarterly report"
    assert mail["in_reply_to"] == "<m2@client.example>"
    assert mail["references"] == "<m1@client.example> <m2@client.example>"
    assert mail["message_id"] == DLV_42
    assert mail["auto_submitted"] == "auto-replied"
    assert mail["reply_to"] is None
    assert mail["body"].strip() == "Echo: hi"

    # A resend of the same delivery carries the same Message-ID.
    assert await channel.send(_message()) == Sent(DLV_42)
    assert [m["message_id"] for m in sink.messages] == [DLV_42] * 2


async def test_inbound_to_outbound_round_trip(sink: SmtpSink) -> None:
    """The address the inbound half stores is what the outbound half needs."""
    core = FakeCore(lambda channel, attrs: RouteMatch("r", "o", "a", silent=False))
    adapter = EmailAdapter(
        EmailSettings(listen_host="127.0.0.1", smtp_host="127.0.0.1", smtp_port=sink.port),
        core,
        send_timeout_s=0.5,
    )
    await adapter.start()
    try:
        inbound = EmailMessage()
        inbound["From"] = "Alice <alice@example.com>"
        inbound["To"] = BOT
        inbound["Subject"] = "Quarterly report"
        inbound["Message-ID"] = "<orig@client.example>"
        inbound.set_content("Summarise it please")
        assert adapter.port
        await aiosmtplib.send(
            inbound,
            sender=ALICE,
            recipients=[BOT],
            hostname="127.0.0.1",
            port=adapter.port,
            timeout=10,  # "it did not hang": 2 s was within a loaded machine's reach
        )
        await core.drain()
        [trigger] = core.triggers
        outcome = await adapter.channel.send(_message(trigger.binding.address, "Echo: done"))
        assert isinstance(outcome, Sent)
        # Alice's phone answers the reply naming it in In-Reply-To alone (no References):
        # the answer continues the thread (it started a session of its own).
        answer = EmailMessage()
        answer["From"] = "Alice <alice@example.com>"
        answer["To"] = BOT
        answer["Subject"] = "Re: Quarterly report"
        answer["Message-ID"] = "<answer@client.example>"
        answer["In-Reply-To"] = str(outcome.external_id)
        answer.set_content("And the totals too")
        await aiosmtplib.send(
            answer, sender=ALICE, recipients=[BOT], hostname="127.0.0.1", port=adapter.port
        )
        await core.drain()
        [_, follow_up] = core.triggers
        assert follow_up.session_key == trigger.session_key
        assert follow_up.binding.address["references"] == (
            f"<orig@client.example> {outcome.external_id} <answer@client.example>"
        )
    finally:
        await adapter.stop()
    [mail] = sink.messages
    assert mail["to"] == ALICE and mail["from"] == BOT
    assert mail["subject"] == "Re: Quarterly report"
    assert mail["in_reply_to"] == "<orig@client.example>"
    assert mail["references"] == "<orig@client.example>"
    assert mail["message_id"] == "<dlv-42.t.n5zgsz2amnwgszlooqxgk6dbnvygyzi@leadgate.example>"


async def test_configured_from_address_keeps_replies_in_the_thread(sink: SmtpSink) -> None:
    channel = _channel(sink, from_address="Lead Gate <noreply@mail.leadgate.example>")
    outcome = await channel.send(_message())
    assert outcome == Sent("<dlv-42.t.nuyuay3mnfsw45bomv4gc3lqnrsq@mail.leadgate.example>")
    [mail] = sink.messages
    assert mail["mail_from"] == "noreply@mail.leadgate.example"
    assert mail["from"] == "Lead Gate <noreply@mail.leadgate.example>"
    assert mail["reply_to"] == BOT


async def test_dots_and_non_ascii_survive(sink: SmtpSink) -> None:
    text = "Grüße!\n.\n.leading dot\n..two\nend"
    address = {**ADDRESS, "subject": "Re: Grüße aus Köln"}
    assert isinstance(await _channel(sink).send(_message(address, text)), Sent)
    [mail] = sink.messages
    assert mail["body"].rstrip("\n") == text
    assert mail["subject"] == "Re: Grüße aus Köln"


async def test_a_correspondent_at_a_utf8_address_is_answered_there(sink: SmtpSink) -> None:
    jurgen = "jürgen@exämple.de"
    address = {**ADDRESS, "to": f"Jürgen <{jurgen}>", "subject": "Re: Grüße"}
    outcome = await _channel(sink).send(_message(address, "Hallo Jürgen"))
    assert outcome == Sent(DLV_42)
    [mail] = sink.messages
    assert mail["rcpt_tos"] == [jurgen] and mail["mail_from"] == BOT
    assert mail["to"] == f"Jürgen <{jurgen}>" and mail["subject"] == "Re: Grüße"
    assert mail["body"].strip() == "Hallo Jürgen"
    # An ASCII exchange stays as it was (no SMTPUTF8 asked for).
    assert isinstance(await _channel(sink).send(_message(key="dlv-43")), Sent)


async def test_a_utf8_address_without_smtputf8_at_the_relay_is_permanent() -> None:
    sink = SmtpSink(smtputf8=False)
    await sink.start()
    try:
        address = {**ADDRESS, "to": "jürgen@exämple.de"}
        outcome = await _channel(sink).send(_message(address))
        assert isinstance(outcome, Permanent) and "SMTPUTF8" in outcome.error
        assert sink.attempts == [] and sink.messages == []
    finally:
        await sink.close()


def test_message_id_is_derived_from_the_key() -> None:
    assert message_id_for("dlv-1", "Bot <bot@x.example>") == "<dlv-1@x.example>"
    assert message_id_for("a b:c<d>", "bot@x.example") == "<a-b-c-d-@x.example>"
    assert message_id_for("k", "") == "<k@leadgate.invalid>"
    # With its thread's first Message-ID, base32 (a long one is left out).
    assert message_id_for("k", "bot@x.example", "<m1@client.example>") == (
        "<k.t.nuyuay3mnfsw45bomv4gc3lqnrsq@x.example>"
    )
    assert thread_of("<k.t.nuyuay3mnfsw45bomv4gc3lqnrsq@x.example>") == "<m1@client.example>"
    assert message_id_for("k", "bot@x.example", f"<{'a' * 300}@x>") == "<k@x.example>"
    # Ids that carry no thread, or a mark that does not decode to one.
    for other in ("<k@x.example>", "<a.t.@x>", "<a.t.1!@x>", "<a.t.ee@x>", "<>"):
        assert thread_of(other) is None, other


@pytest.mark.parametrize(
    ("mode", "outcome_class"),
    [
        ("reject_rcpt", Permanent),
        ("tempfail_rcpt", Retry),
        ("hang_rcpt", Retry),  # timeout before any content was sent
        ("tempfail", Retry),  # 451 after the content: the server refused it
        ("reject", Permanent),  # 554 after the content
        ("hang", Uncertain),  # the content was written, no verdict came back
        ("drop", Uncertain),  # the content was written, then the connection died
    ],
)
async def test_failure_modes(sink: SmtpSink, mode: str, outcome_class: type) -> None:
    sink.fail_next(mode)
    outcome = await _channel(sink).send(_message())
    assert isinstance(outcome, outcome_class), outcome
    assert sink.messages == []
    # The next transaction goes through.
    assert isinstance(await _channel(sink).send(_message()), Sent)


async def test_connection_refused_is_retry() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    channel = EmailChannel(
        EmailSettings(smtp_host="127.0.0.1", smtp_port=port), timeout_s=0.5, local_hostname="t"
    )
    assert isinstance(await channel.send(_message()), Retry)


async def test_unusable_configuration_or_address_is_permanent(sink: SmtpSink) -> None:
    no_relay = EmailChannel(EmailSettings(), timeout_s=0.5)
    assert isinstance(await no_relay.send(_message()), Permanent)
    channel = _channel(sink)
    assert isinstance(await channel.send(_message({**ADDRESS, "to": ""})), Permanent)
    assert isinstance(await channel.send(_message({"to": ALICE})), Permanent)  # no sender
    bad_subject = {**ADDRESS, "to": "a@b.example\r\nBcc: victim@example.com"}
    assert isinstance(await channel.send(_message(bad_subject)), Permanent)
    assert sink.messages == []


async def test_starttls_required_but_not_offered_is_permanent(sink: SmtpSink) -> None:
    outcome = await _channel(sink, start_tls=True).send(_message())
    assert isinstance(outcome, Permanent)
    assert sink.messages == []


async def test_a_positive_answer_other_than_250_after_the_message_is_sent(sink: SmtpSink) -> None:
    """Any 2yz after the final dot means the relay took the message: retrying it (what
    an "unexpected reply" was) mailed it twice."""
    sink.fail_next("accept_2xx")
    assert await _channel(sink).send(_message()) == Sent(DLV_42)
    assert [m["mode"] for m in sink.messages] == ["accept_2xx"]
    # Neither a 2yz nor a refusal: the relay may hold the message, so it is not sent again.
    sink.fail_next("odd_3xx")
    outcome = await _channel(sink).send(_message())
    assert isinstance(outcome, Uncertain) and "unexpected reply 354" in outcome.error


async def test_a_relay_slow_at_every_step_is_given_up_on_within_the_send_deadline(
    sink: SmtpSink,
) -> None:
    """Each step waited up to its timeout and nothing bounded their sum: a relay slow at
    every step (8 steps of 30 s) kept a send past its 2-minute lease, whose lapse took the
    delivery back as deliveryUnknown and threw the send's own outcome away (a mail sent,
    or never sent, left to an operator's guess). Now the steps before the message end
    within deadline_s - timeout_s, nothing sent: a retry."""
    assert SEND_DEADLINE_S <= SEND_LEASE_MS / 2000  # two rounds of sends per lease
    sink.slow_s = 0.6  # MAIL and RCPT each well within the step's timeout of 1 s
    channel = EmailChannel(
        EmailSettings(smtp_host="127.0.0.1", smtp_port=sink.port),
        timeout_s=1.0,
        deadline_s=2.0,
        local_hostname="leadgate.test",
    )
    started = time.monotonic()
    outcome = await channel.send(_message())
    assert isinstance(outcome, Retry), outcome
    assert "took longer than 1 s before the message could be sent" in outcome.error
    assert time.monotonic() - started < 4.0  # (1 s: far below a loaded machine's reach)
    assert sink.messages == []
    # The same relay, quick again: the delivery's next attempt goes through.
    sink.slow_s = 0.0
    assert await channel.send(_message()) == Sent(DLV_42)


async def test_a_part_with_too_little_of_its_deliverys_deadline_left_is_not_sent(
    sink: SmtpSink,
) -> None:
    """The answer to a message is waited for up to timeout_s after its final dot: a later
    part of a long text started with less than that left of its delivery's send deadline
    (``within_s``) could outlive it, and the send lease. Such a part is not sent (a
    retry, nothing written); one with more left gets it, its steps before the message
    within what is left less timeout_s."""
    channel = _channel(sink)  # timeout_s=0.5
    outcome = await channel.send(dataclasses.replace(_message(), within_s=0.4))
    assert outcome == Retry(
        "email: 0.4 s left of the delivery's send deadline, less than the 0.5 s the answer "
        "to the message may take; nothing was sent"
    )
    assert sink.attempts == []
    sink.slow_s = 0.3  # MAIL and RCPT: 0.6 s, past the 0.5 s left before the message
    outcome = await channel.send(dataclasses.replace(_message(), within_s=1.0))
    assert isinstance(outcome, Retry), outcome
    assert "took longer than 0.5 s before the message could be sent" in outcome.error
    assert sink.messages == []
    sink.slow_s = 0.0
    outcome = await channel.send(dataclasses.replace(_message(), within_s=1.0))
    assert outcome == Sent(DLV_42)
