"""Email threads through the real SMTP listener on the real composition root (aiosmtplib
as the person's mail server, the SMTP sink stand-in as the outbound relay): a reply
whose ``In-Reply-To`` alone names the person's own earlier mail continues its session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from email.message import EmailMessage
from functools import partial

import aiosmtplib
import pytest
import sqlalchemy as sa

from bots.email_parse import thread_of
from leadgate.core.runners import drain
from leadgate.database import schema as t
from tests.helpers import eventually, make_agent, make_org, make_route
from tests.integration.test_email_review_replies import Env, _env
from tests.standins.smtp import SmtpSink

ASK = "ask@lg.example"
ALICE = "alice@acme.io"
BOB = "bob@acme.io"


@pytest.fixture
async def env(migrated_url: str, sink: SmtpSink) -> AsyncIterator[Env]:
    async for made in _env(migrated_url, sink, reply=""):
        yield made


async def send(port: int, message_id: str, text: str, *, sender: str = ALICE, to: str = "") -> None:
    """A mail from ``sender`` to :data:`ASK` over SMTP, ``In-Reply-To`` ``to`` alone (no
    ``References``, as many mobile clients send), taken (250)."""
    message = EmailMessage()
    message["From"] = sender
    message["To"] = ASK
    message["Subject"] = "Re: Report" if to else "Report"
    message["Message-ID"] = message_id
    if to:
        message["In-Reply-To"] = to
    message.set_content(text)
    await aiosmtplib.send(message, recipients=[ASK], hostname="127.0.0.1", port=port, timeout=5)


async def session_of(env: Env, sender: str, message_id: str) -> str:
    """The session the mail ``message_id`` of ``sender`` was taken in."""
    e = t.inbound_events.c
    event = f"email:{ASK}:{sender}:{message_id}"
    async with env.app.db.read() as conn:
        found = await conn.scalar(sa.select(e.session_id).where(e.external_event_id == event))
    assert found is not None, event
    return str(found)


async def test_a_reply_naming_the_persons_own_earlier_mail_continues_its_session(
    env: Env,
) -> None:
    """Alice writes, then adds "one more thing" by answering her own sent mail (her
    client names it in In-Reply-To alone), then answers that one too: one session, and
    the answer's References and Message-ID name the thread's first mail, so that a reply
    to the answer finds the thread again. (Each started a session of its own, rooted at
    her earlier mail, though that mail was in a session already.) Bob's mail naming
    Alice's gets a session of his own."""
    app = env.app
    org = await make_org(app)
    worker = await make_agent(app, org, "worker")
    await make_route(app, org, worker["id"], "email", {"address": ASK})

    await send(env.port, "<m1@mail.acme.io>", "Draft the quarterly report")
    await send(
        env.port, "<m2@mail.acme.io>", "One more thing: add the totals", to="<m1@mail.acme.io>"
    )
    await send(env.port, "<m3@mail.acme.io>", "And the margins", to="<m2@mail.acme.io>")
    await send(env.port, "<b1@mail.acme.io>", "Me too", sender=BOB, to="<m1@mail.acme.io>")

    first = await session_of(env, ALICE, "<m1@mail.acme.io>")
    assert await session_of(env, ALICE, "<m2@mail.acme.io>") == first
    assert await session_of(env, ALICE, "<m3@mail.acme.io>") == first
    assert await session_of(env, BOB, "<b1@mail.acme.io>") != first

    async def answered() -> list[dict[str, str]]:
        await drain(app.relay)
        return [m for m in env.sink.messages if m["in_reply_to"] == "<m2@mail.acme.io>"]

    await eventually(answered, what="the answer to the second mail")
    [answer] = await answered()
    assert answer["references"] == "<m1@mail.acme.io> <m2@mail.acme.io>"
    assert thread_of(answer["message_id"]) == "<m1@mail.acme.io>"


@pytest.mark.parametrize("gated", [False, True])
async def test_a_reply_naming_our_answer_sent_before_the_thread_mark_continues_its_session(
    env: Env, gated: bool
) -> None:
    """Alice answers our reply to her first mail, naming it in In-Reply-To alone, and
    that reply went out before our Message-IDs carried their thread (``.t.<base32>``):
    its session is found by the delivery that sent it, and the answer to her second mail
    names the thread's first one. (It started a session of its own, rooted at our
    reply.) Bob, naming the same reply of ours, is in no thread of Alice's: a session of
    his own. ``gated``: the worker's answers held for its lead, who approves them (a
    gated turn's answer is a delivery of another kind, naming its binding as well)."""
    app = env.app
    org = await make_org(app)
    if gated:
        await make_agent(app, org, "lead")
    worker = await make_agent(app, org, "worker", lead="lead" if gated else None)
    # (The scripted lead approves an answer to a message that ends "#complete".)
    done = " #complete" if gated else ""
    await make_route(app, org, worker["id"], "email", {"address": ASK})

    await send(env.port, "<m1@mail.acme.io>", "Draft the quarterly report" + done)
    first = await session_of(env, ALICE, "<m1@mail.acme.io>")

    async def answers_to(message_id: str) -> list[dict[str, str]]:
        await drain(app.lead_runner)
        await drain(app.relay)
        return [m for m in env.sink.messages if m["in_reply_to"] == message_id]

    await eventually(lambda: answers_to("<m1@mail.acme.io>"), what="the first answer")
    [answer] = await answers_to("<m1@mail.acme.io>")
    # As an older release sent and stored it: the same id without the thread's mark.
    marked = answer["message_id"].strip()
    local, _, domain = marked.strip("<>").partition("@")
    ours = f"<{local.partition('.t.')[0]}@{domain}>"
    assert thread_of(ours) is None
    d = t.deliveries.c
    async with app.db.tx() as conn:
        kind = await conn.scalar(sa.select(d.kind).where(d.external_id == marked))
        moved = await conn.execute(
            sa.update(t.deliveries).where(d.external_id == marked).values(external_id=ours)
        )
        assert moved.rowcount == 1
    assert kind == ("gating" if gated else "reply")

    await send(env.port, "<m2@mail.acme.io>", "Add the totals" + done, to=ours)
    await send(env.port, "<b1@mail.acme.io>", "Me too", sender=BOB, to=ours)

    assert await session_of(env, ALICE, "<m2@mail.acme.io>") == first
    assert await session_of(env, BOB, "<b1@mail.acme.io>") != first
    await eventually(lambda: answers_to("<m2@mail.acme.io>"), what="the second answer")
    [second] = await answers_to("<m2@mail.acme.io>")
    assert second["references"] == f"<m1@mail.acme.io> {ours} <m2@mail.acme.io>"
    assert thread_of(second["message_id"]) == "<m1@mail.acme.io>"


async def test_an_address_s_case_is_kept_for_the_answer_and_folded_for_the_session(
    env: Env,
) -> None:
    """Alice's client writes ``Alice.Smith@Acme.io``: the answer goes to that address
    as written (RFC 5321 2.4 keeps a local part's case; it went to
    ``alice.smith@acme.io``, lost on a server that tells the two apart). Her next mail,
    from her phone as ``alice.smith@acme.io``, is the same person in the same thread (mail
    providers fold case): one session, answered at the address that mail wrote."""
    app = env.app
    org = await make_org(app)
    worker = await make_agent(app, org, "worker")
    await make_route(app, org, worker["id"], "email", {"address": ASK, "sender": "*@acme.io"})

    async def answers_to(message_id: str) -> list[dict[str, object]]:
        await drain(app.relay)
        return [m for m in env.sink.messages if m["in_reply_to"] == message_id]

    written = "Alice.Smith@Acme.io"
    for sender, message_id in ((written, "<c1@acme.io>"), ("alice.smith@acme.io", "<c2@acme.io>")):
        message = EmailMessage()
        message["From"] = f"Alice Smith <{sender}>"
        message["To"] = ASK
        message["Subject"] = "Report"
        message["Message-ID"] = message_id
        if message_id != "<c1@acme.io>":
            message["References"] = "<c1@acme.io>"
        message.set_content("Draft the quarterly report")
        await aiosmtplib.send(
            message, recipients=[ASK], hostname="127.0.0.1", port=env.port, timeout=5
        )
        await eventually(partial(answers_to, message_id), what=f"the answer to {message_id}")
        [answer] = await answers_to(message_id)
        assert answer["rcpt_tos"] == [sender]
        assert str(answer["to"]) == sender

    folded = "alice.smith@acme.io"
    first = await session_of(env, folded, "<c1@acme.io>")
    assert await session_of(env, folded, "<c2@acme.io>") == first


@pytest.mark.parametrize(
    ("subject", "references"),
    [("Make it a table", True), ("Make it a table", False), ("FW: Re: Report", True)],
)
async def test_an_outlook_forward_of_our_answer_with_its_subject_edited_continues_the_thread(
    env: Env, subject: str, references: bool
) -> None:
    """Alice forwards our answer from Outlook back to the same address, the subject
    ("FW: Re: Report") edited to a request of its own. Outlook writes a forward as it
    writes a reply (its rule and header block above the forwarded mail) and names the
    forwarded mail in ``In-Reply-To`` (``references``: and ``References``, the chain):
    it continues the thread of the answer it forwards, the session whose transcript holds
    that answer already, and its text is her request, without the forwarded answer.
    (With its ``FW:`` kept it is read as a forward, kept whole, in the same session.)"""
    app = env.app
    org = await make_org(app)
    worker = await make_agent(app, org, "worker")
    await make_route(app, org, worker["id"], "email", {"address": ASK})

    await send(env.port, "<f1@mail.acme.io>", "Draft the quarterly report")

    async def answers_to(message_id: str) -> list[dict[str, str]]:
        await drain(app.relay)
        return [m for m in env.sink.messages if m["in_reply_to"] == message_id]

    await eventually(lambda: answers_to("<f1@mail.acme.io>"), what="the answer")
    [answer] = await answers_to("<f1@mail.acme.io>")
    ours = answer["message_id"].strip()

    forward = EmailMessage()
    forward["From"] = ALICE
    forward["To"] = ASK
    forward["Subject"] = subject
    forward["Message-ID"] = "<f2@mail.acme.io>"
    forward["In-Reply-To"] = ours
    if references:
        forward["References"] = f"<f1@mail.acme.io> {ours}"
    forward.set_content(
        "Make it a table please\n\n________________________________\n"
        f"From: ask <{ASK}>\nSent: Monday, December 7, 2026 10:02 AM\n"
        f"To: Alice <{ALICE}>\nSubject: Re: Report\n\nEcho: Draft the quarterly report\n"
    )
    await aiosmtplib.send(forward, recipients=[ASK], hostname="127.0.0.1", port=env.port, timeout=5)

    assert await session_of(env, ALICE, "<f2@mail.acme.io>") == await session_of(
        env, ALICE, "<f1@mail.acme.io>"
    )
    e = t.inbound_events.c
    event = f"email:{ASK}:{ALICE}:<f2@mail.acme.io>"
    async with app.db.read() as conn:
        content = await conn.scalar(sa.select(e.content).where(e.external_event_id == event))
    if subject.startswith("FW:"):
        assert content is not None and content.startswith("Make it a table please\n\n___")
        assert content.endswith("Echo: Draft the quarterly report")
    else:
        assert content == "Make it a table please"
