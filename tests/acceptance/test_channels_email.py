"""Email through the real service: SMTP in (the service's own listener), SMTP out.

One ``leadgate serve`` process for the module with ``[email] listen_host/listen_port``
(inbound, on a free port) and ``smtp_host/smtp_port`` = the SMTP sink stand-in (a
subprocess), whose control port shows what the service sent. Mail is sent with
aiosmtplib. Sessions are per thread (the root ``Message-ID``), so each test starts a new
thread.
"""

from __future__ import annotations

import asyncio
import email.utils
import uuid
from collections.abc import Iterator
from email.message import EmailMessage
from typing import Any

import aiosmtplib
import pytest

from tests.acceptance.channel_kit import (
    FAST_RUNNERS,
    MAIL_PLAIN,
    MAIL_SILENT,
    MAIL_STRICT,
    MAIL_WORK,
    Operator,
    Standin,
    channel_template,
    prepared_service,
    stays,
    total_turns,
    turn_counts,
    wait_until,
)
from tests.service_proc import DemoTemplate, ServiceProcess, free_port

ALICE = "alice@example.com"


@pytest.fixture(scope="module")
def sink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    with Standin("smtp", "--http-port", "0", log_dir=tmp_path_factory.mktemp("smtp")) as s:
        yield s


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    sink: Standin,
) -> Iterator[ServiceProcess]:
    template = channel_template(demo_template, lambda: tmp_path_factory.mktemp("routes"))
    proc = prepared_service(
        template,
        tmp_path_factory.mktemp("svc-email"),
        config={
            **FAST_RUNNERS,
            "email": {
                "listen_host": "127.0.0.1",
                "listen_port": free_port(),
                "smtp_host": "127.0.0.1",
                "smtp_port": sink.port,
            },
        },
    )
    with service_guard(proc.start()):
        yield proc


# ---------------------------------------------------------------------------- helpers


def mail(
    to: str,
    subject: str,
    body: str,
    *,
    sender: str = ALICE,
    in_reply_to: str | None = None,
) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = f"Someone <{sender}>"
    msg["To"] = to
    msg["Subject"] = subject
    msg["Message-ID"] = email.utils.make_msgid(domain=sender.rpartition("@")[2])
    msg["Date"] = email.utils.formatdate()
    if in_reply_to:
        msg["In-Reply-To"] = in_reply_to
        msg["References"] = in_reply_to
    msg.set_content(body)
    return msg


def send(svc: ServiceProcess, msg: EmailMessage, *, envelope_from: str | None = None) -> None:
    port = svc.config_dict()["email"]["listen_port"]
    asyncio.run(
        aiosmtplib.send(
            msg,
            hostname="127.0.0.1",
            port=port,
            sender=envelope_from,
            timeout=10,
        )
    )


def replies_to(sink: Standin, message_id: str) -> list[dict[str, Any]]:
    return [m for m in sink.records("messages") if m["in_reply_to"] == message_id]


def sent_to(sink: Standin, address: str) -> list[dict[str, Any]]:
    return [m for m in sink.records("attempts") if address in (m.get("rcpt_tos") or [])]


# ---------------------------------------------------------------------------- tests


def test_plain_reply_is_threaded_to_the_sender(svc: ServiceProcess, sink: Standin) -> None:
    msg = mail(MAIL_PLAIN, "Quarterly numbers", "hello there\n\nOn Monday, Bob wrote:\n> old")
    send(svc, msg)
    message_id = str(msg["Message-ID"])

    replies = wait_until(lambda: replies_to(sink, message_id), what="the reply")
    assert len(replies) == 1
    reply = replies[0]
    assert reply["rcpt_tos"] == [ALICE]
    assert email.utils.parseaddr(reply["to"])[1] == ALICE
    assert reply["subject"] == "Re: Quarterly numbers"
    assert reply["in_reply_to"] == message_id
    assert reply["references"] == message_id
    assert email.utils.parseaddr(reply["from"])[1] == MAIL_PLAIN
    assert reply["body"].strip() == "Echo: hello there"
    stays(lambda: len(replies_to(sink, message_id)) == 1, what="exactly one reply")


def test_completed_turn_is_mailed_once_after_lead_approval(
    svc: ServiceProcess, sink: Standin
) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    msg = mail(MAIL_WORK, "Draft the memo", f"draft it {marker} #complete")
    send(svc, msg)
    message_id = str(msg["Message-ID"])

    detail = op.wait_item(marker, "completed")
    replies = replies_to(sink, message_id)
    assert [r["body"].strip() for r in replies] == [f"Echo: draft it {marker} #complete"]
    assert replies[0]["subject"] == "Re: Draft the memo"
    assert replies[0]["references"] == message_id
    assert replies[0]["rcpt_tos"] == [ALICE]
    assert [(d["action"], d["status"], d["channel"]) for d in detail["deliveries"]] == [
        ("post", "sent", "email")
    ]
    stays(lambda: len(replies_to(sink, message_id)) == 1, what="exactly one reply")


def test_escalated_item_waits_for_a_human_then_mails_once(
    svc: ServiceProcess, sink: Standin
) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    msg = mail(MAIL_WORK, "Refund request", f"refund {marker} #complete #escalate")
    send(svc, msg)
    message_id = str(msg["Message-ID"])

    item = op.wait_item(marker, "awaitingHuman")
    stays(lambda: not replies_to(sink, message_id), what="nothing mailed while waiting")

    op.decide(item["id"], "approve")
    replies = wait_until(lambda: replies_to(sink, message_id), what="the approved reply")
    assert [r["body"].strip() for r in replies] == [f"Echo: refund {marker} #complete #escalate"]
    assert replies[0]["subject"] == "Re: Refund request"
    op.wait_item(marker, "completed")
    stays(lambda: len(replies_to(sink, message_id)) == 1, what="exactly one reply")


def test_mail_while_under_review_is_busy(svc: ServiceProcess, sink: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    first = mail(MAIL_WORK, "Contract", f"review {marker} #complete #escalate")
    send(svc, first)
    item = op.wait_item(marker, "awaitingHuman")

    before = turn_counts(svc)
    follow_up = mail(
        MAIL_WORK,
        "Re: Contract",
        f"{marker}-again: any news?",
        in_reply_to=str(first["Message-ID"]),
    )
    send(svc, follow_up)
    wait_until(
        lambda: turn_counts(svc).get("busy", 0) == before.get("busy", 0) + 1, what="busy turn"
    )
    after = turn_counts(svc)
    assert {k: v for k, v in after.items() if k != "busy"} == {
        k: v for k, v in before.items() if k != "busy"
    }, "a busy message must run no turn"
    stays(
        lambda: (
            not replies_to(sink, str(first["Message-ID"]))
            and not replies_to(sink, str(follow_up["Message-ID"]))
        ),
        what="nothing mailed",
    )
    detail = op.detail(item["id"])
    assert detail["status"] == "awaitingHuman"
    assert f"{marker}-again" not in detail["taskContext"]
    op.decide(item["id"], "cancel")


def test_silent_route_mails_nothing(svc: ServiceProcess, sink: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    sender = f"quiet-{marker}@example.com"
    plain_before = turn_counts(svc).get("plain", 0)
    first = mail(MAIL_SILENT, "Note", f"quiet {marker}", sender=sender)
    send(svc, first)
    wait_until(lambda: turn_counts(svc).get("plain", 0) >= plain_before + 1, what="plain turn")
    send(
        svc,
        mail(
            MAIL_SILENT,
            "Re: Note",
            "finish #complete",
            sender=sender,
            in_reply_to=str(first["Message-ID"]),
        ),
    )
    item = op.wait_item(marker, "completed")
    assert [(d["action"], d["status"]) for d in item["deliveries"]] == [("silent", "sent")]
    assert item["id"] in [r["id"] for r in op.activity()]
    stays(lambda: not sent_to(sink, sender), what="nothing mailed on a silent route")


def test_sender_the_route_does_not_allow_runs_no_turn(svc: ServiceProcess, sink: Standin) -> None:
    before = total_turns(svc)
    stranger = "bob@other.example"
    with pytest.raises(aiosmtplib.SMTPRecipientsRefused):
        send(svc, mail(MAIL_STRICT, "Let me in", "please answer", sender=stranger))
    # The envelope sender is allowed but From: (where the reply would go) is not.
    forged = mail(MAIL_STRICT, "Let me in", "please answer", sender="mallory@evil.example")
    with pytest.raises(aiosmtplib.SMTPDataError):
        send(svc, forged, envelope_from="carol@allowed.example")
    stays(
        lambda: (
            total_turns(svc) == before
            and not sent_to(sink, stranger)
            and not sent_to(sink, "mallory@evil.example")
        ),
        what="no turn and no mail",
    )

    # An allowed sender is answered.
    ok = mail(MAIL_STRICT, "Hello", "allowed here", sender="carol@allowed.example")
    send(svc, ok)
    replies = wait_until(lambda: replies_to(sink, str(ok["Message-ID"])), what="the reply")
    assert replies[0]["rcpt_tos"] == ["carol@allowed.example"]
    assert replies[0]["body"].strip() == "Echo: allowed here"


def test_automatic_mail_runs_no_turn(svc: ServiceProcess, sink: Standin) -> None:
    """An auto-reply (RFC 3834) is accepted and dropped, so two responders cannot loop."""
    before = total_turns(svc)
    auto = mail(MAIL_PLAIN, "Out of office", "I am away", sender="away@example.com")
    auto["Auto-Submitted"] = "auto-replied"
    send(svc, auto)
    stays(
        lambda: total_turns(svc) == before and not sent_to(sink, "away@example.com"),
        what="no turn and no mail",
    )
