"""Email review cards answered by reply (``[email] review_reply_address``), through the
real SMTP listener (aiosmtplib as the reviewer's mail server) on the real composition
root, with the SMTP sink stand-in as the outbound relay: the card mail's Reply-To names
a random token kept only as a hash; a reply from a reviewer of the card's organization
decides through the chat decisions' fenced path (audited ``email``), before the 250;
everyone and everything else is refused and nothing changes."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any

import aiosmtplib
import pytest
import sqlalchemy as sa

from bots.email import EmailAdapter
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.errors import Unavailable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import orgs
from leadgate.review.destinations import add_destination
from leadgate.review.replies import token_hash
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import Uncertain
from tests.fakes import DownFor
from tests.helpers import (
    Org,
    api_trigger,
    counted,
    deliveries_counted,
    eventually,
    item_audit,
    item_row,
    make_agent,
    make_org,
    make_route,
    slack_trigger,
)
from tests.outbox_support import ScriptedChannel
from tests.standins.smtp import SmtpSink
from tests.statement_faults import PgFaults, SqliteFaults, injector

REPLY = "review@reviews.example.com"
BOT = "leadgate@lg.example"
ANN = "member@acme.io"
ZOE = "zoe@acme.io"
REPLY_TO = re.compile(r"review\+([0-9a-f]{32})@reviews\.example\.com")


@dataclass
class Env:
    app: App
    sink: SmtpSink
    port: int

    @property
    def slack(self) -> ScriptedChannel:
        channel = self.app.channels["slack"]
        assert isinstance(channel, ScriptedChannel)
        return channel


async def _env(
    migrated_url: str, sink: SmtpSink, reply: str = REPLY, review: dict[str, str] | None = None
) -> AsyncIterator[Env]:
    email: dict[str, Any] = {
        "listen_host": "127.0.0.1",
        "listen_port": 0,
        "smtp_host": "127.0.0.1",
        "smtp_port": sink.port,
        "from_address": BOT,
    }
    if reply:
        email["review_reply_address"] = reply
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "server": {"public_url": "https://lg.example"},
            "email": email,
            "review": review or {},
        }
    )
    app = App(settings, clock=FakeClock(), channels={"slack": ScriptedChannel("slack")})
    [adapter] = [a for a in app.adapters if isinstance(a, EmailAdapter)]
    await adapter.start()
    assert adapter.port
    try:
        yield Env(app, sink, adapter.port)
    finally:
        await adapter.stop()
        await app.stop()


@pytest.fixture
async def env(migrated_url: str, sink: SmtpSink) -> AsyncIterator[Env]:
    async for made in _env(migrated_url, sink):
        yield made


@pytest.fixture
async def env_expiring(migrated_url: str, sink: SmtpSink) -> AsyncIterator[Env]:
    """:func:`env` whose items expire after an hour without a decision."""
    async for made in _env(migrated_url, sink, review={"expire_after": "1h"}):
        yield made


@pytest.fixture
async def env_off(migrated_url: str, sink: SmtpSink) -> AsyncIterator[Env]:
    async for made in _env(migrated_url, sink, reply=""):
        yield made


async def setup(env: Env, name: str = "acme") -> tuple[Org, dict[str, Any]]:
    """An organization with a lead and a worker, its review cards mailed to its member;
    a Member and a Viewer."""
    app = env.app
    org = await make_org(app, name)
    await make_agent(app, org, "lead")
    worker = await make_agent(app, org, "worker", lead="lead")
    async with app.db.tx() as conn:
        await add_destination(
            conn,
            app.clock,
            app.ids,
            org_id=org.id,
            agent_id=None,
            channel="email",
            target=f"member@{name}.io",
            tier="notify",
        )
        for email, role in ((f"member@{name}.io", "Member"), (f"viewer@{name}.io", "Viewer")):
            await orgs.create_user(
                conn, app.clock, app.ids, org.id, email, role, orgs.hash_password("password1")
            )
    return org, worker


async def card_mail(env: Env, item_id: str) -> dict[str, Any]:
    """The newest card mail of ``item_id`` the relay sent."""
    await drain(env.app.relay)
    mails = [m for m in env.sink.messages if item_id in m["body"]]
    assert mails, [m["subject"] for m in env.sink.messages]
    return mails[-1]


async def escalated(env: Env, org: Org, worker: dict[str, Any], session: str) -> str:
    """A new item of ``worker`` that the lead escalated (awaitingHuman)."""
    known = {i["id"] for i in (await env.app.reviews.queue(org.principal))["items"]}
    await env.app.turns.run(api_trigger(org, worker, "hard #escalate #complete", session))
    await drain(env.app.lead_runner)
    queue = (await env.app.reviews.queue(org.principal))["items"]
    return str(
        next(i["id"] for i in queue if i["status"] == "awaitingHuman" and i["id"] not in known)
    )


async def reply(
    env: Env,
    to: str,
    text: str,
    *,
    sender: str = "member@acme.io",
    envelope: str | None = None,
    subject: str = "Re: Review needed",
    html: bool = False,
    headers: dict[str, str] | None = None,
) -> int:
    """Send a reply to ``to`` through the listener (``html``: an HTML-only mail in
    ISO-8859-1); the SMTP code it ended with (the first refusal, or 250)."""
    message = EmailMessage()
    message["From"] = sender
    message["To"] = to
    message["Subject"] = subject
    for name, value in (headers or {}).items():
        message[name] = value
    if html:
        message.set_content(text, subtype="html", charset="iso-8859-1")
    else:
        message.set_content(text)
    try:
        await aiosmtplib.send(
            message,
            sender=envelope or sender,
            recipients=[to],
            hostname="127.0.0.1",
            port=env.port,
            timeout=5,
        )
    except aiosmtplib.SMTPRecipientsRefused as exc:
        return exc.recipients[0].code
    except aiosmtplib.SMTPResponseException as exc:
        return exc.code
    return 250


async def answer_to(env: Env, who: str, count: int = 1) -> list[dict[str, Any]]:
    """The answers to replies mailed to ``who`` (at least ``count``): queued in the outbox
    by the listener, sent by a relay pass."""
    await drain(env.app.relay)
    mails = [m for m in env.sink.messages if m["rcpt_tos"] == [who] and m["in_reply_to"]]
    assert len(mails) >= count, env.sink.messages
    return mails


def email_approvals() -> float:
    """``leadgate_review_decisions_total{surface="email",verdict="approve"}``."""
    labels = {"surface": "email", "verdict": "approve"}
    found = METRICS.registry.get_sample_value("leadgate_review_decisions_total", labels)
    return found or 0.0


def reply_address(mail: dict[str, Any]) -> str:
    assert mail["reply_to"] is not None and REPLY_TO.fullmatch(mail["reply_to"]), mail
    return str(mail["reply_to"])


async def test_a_reviewer_approves_by_replying_to_the_card(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    card = await card_mail(env, item_id)
    to = reply_address(card)
    assert card["rcpt_tos"] == ["member@acme.io"]
    assert "first line 'approve'" in card["body"] or "'approve' as the first line" in card["body"]
    assert "quoted original" in card["body"]

    decided = email_approvals()
    quoted = "Approve\n\nOn Monday leadgate wrote:\n> reject this\n> " + card["body"][:200]
    assert await reply(env, to, quoted) == 250
    # Decided and committed before the 250.
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")
    approve = next(a for a in await item_audit(env.app, item_id) if a["action"] == "approve")
    assert approve["surface"] == "email"
    assert approve["identity"] == "email:member@acme.io"
    assert approve["actor"].startswith("user:")
    assert email_approvals() == decided + 1
    [answer] = await answer_to(env, "member@acme.io")
    assert answer["body"].startswith("Your decision was recorded: Approved by member@acme.io")
    assert answer["subject"] == "Re: Review needed" and answer["from"] == BOT

    # The same reply again (the sending server retried) finds it decided.
    assert await reply(env, to, "approve") == 250
    answers = await answer_to(env, "member@acme.io", 2)
    assert answers[-1]["body"].startswith("Already approved by member@acme.io (email) at ")
    actions = [a["action"] for a in await item_audit(env.app, item_id)]
    assert actions.count("approve") == 1


async def test_reject_with_a_reason_and_return_with_feedback(env: Env) -> None:
    org, worker = await setup(env)
    rejected = await escalated(env, org, worker, "s1")
    returned = await escalated(env, org, worker, "s2")
    to_reject = reply_address(await card_mail(env, rejected))
    to_return = reply_address(await card_mail(env, returned))
    assert to_reject != to_return

    # A reason is needed: nothing is decided without one, and the reviewer is told.
    assert await reply(env, to_reject, "reject") == 250
    [told] = await answer_to(env, "member@acme.io")
    assert told["body"].startswith("Nothing was decided: reason is required. Reply with")
    assert (await item_row(env.app, rejected))["status"] == "awaitingHuman"
    assert await reply(env, to_reject, "Reject: the figures are wrong\nsee page 2") == 250
    row = await item_row(env.app, rejected)
    assert row["status"] == "rejected"
    audit = next(a for a in await item_audit(env.app, rejected) if a["action"] == "reject")
    assert audit["text"] == "the figures are wrong\nsee page 2"
    assert audit["identity"] == "email:member@acme.io"

    # An HTML-only reply in Latin-1 is read as requester mail is.
    body = "<p>Return</p><p>Add the Zahlen für Q3.</p><blockquote>approve</blockquote>"
    assert await reply(env, to_return, body, html=True) == 250
    audit = next(a for a in await item_audit(env.app, returned) if a["action"] == "return")
    assert audit["text"] == "Add the Zahlen für Q3." and audit["surface"] == "email"


async def test_an_outlook_reply_s_reason_ends_above_the_quoted_card(env: Env) -> None:
    """Outlook quotes the card under a rule of underscores and the card's headers, in no
    ``>`` lines: the whole card was read as part of the reason."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    card = await card_mail(env, item_id)
    quoted = (
        "Reject\nThe figures are from Q2.\n\n________________________________\n"
        f"From: Leadgate <{BOT}>\nSent: Monday, December 7, 2026 10:02 AM\n"
        f"To: Ann Member <{ANN}>\nSubject: {card['subject']}\n\n{card['body']}"
    )
    assert await reply(env, reply_address(card), quoted) == 250
    assert (await item_row(env.app, item_id))["status"] == "rejected"
    audit = next(a for a in await item_audit(env.app, item_id) if a["action"] == "reject")
    assert audit["text"] == "The figures are from Q2."


async def test_an_unknown_first_word_decides_nothing_and_says_what_the_card_accepts(
    env: Env,
) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    # An out-of-office answer to the card is dropped: nothing decided, nothing answered.
    auto = {"Auto-Submitted": "auto-replied"}
    assert await reply(env, to, "approve", headers=auto) == 250
    for text in ("looks fine to me", "confirm"):
        assert await reply(env, to, text) == 250
    answers = await answer_to(env, "member@acme.io", 2)
    assert len(answers) == 2
    for answer in answers:
        assert answer["body"].startswith("Nothing was decided. Reply with 'approve'")
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"


async def test_only_a_reviewer_of_the_cards_organization_decides(env: Env) -> None:
    org, worker = await setup(env)
    other, other_worker = await setup(env, "other")
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    foreign = reply_address(await card_mail(env, await escalated(env, other, other_worker, "o1")))
    before = await item_audit(env.app, item_id)
    for sender, envelope, address in (
        ("viewer@acme.io", None, to),  # a Viewer may not review
        ("stranger@example.com", None, to),  # no user
        ("member@other.io", None, to),  # a reviewer, of another organization
        ("member@acme.io", "stranger@example.com", to),  # the envelope sender is no one
        ("member@acme.io", None, foreign),  # the token of another organization's card
    ):
        assert await reply(env, address, "approve", sender=sender, envelope=envelope) == 250
        [*_, told] = await answer_to(env, sender, 1)
        assert told["body"].strip() == "You cannot review in this organization."
        env.sink.messages.clear()
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    assert await item_audit(env.app, item_id) == before


async def sessions_of(env: Env, address: str) -> int:
    """How many sessions mail to the routed ``address`` started (one per turn here)."""
    async with env.app.db.read() as conn:
        count = await conn.scalar(
            sa.select(sa.func.count()).where(t.sessions.c.key.like(f"email:{address}:%"))
        )
    return int(count or 0)


async def test_a_reply_also_sent_to_a_routed_address_is_taken_by_both(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    ask = "ask@lg.example"
    await make_route(env.app, org, worker["id"], "email", {"address": ask, "sender": ANN})
    await make_route(env.app, org, worker["id"], "email", {"address": ask, "sender": ZOE})

    async def send(sender: str, envelope: str) -> int:
        message = EmailMessage()
        message["From"] = sender
        message["To"] = f"{to}, {ask}"
        message["Subject"] = "Re: card"
        message.set_content("approve")
        try:
            await aiosmtplib.send(
                message,
                sender=envelope,
                recipients=[to, ask],
                hostname="127.0.0.1",
                port=env.port,
                timeout=5,
            )
        except aiosmtplib.SMTPResponseException as exc:
            return exc.code
        return 250

    # The route allows the envelope sender but not the From (a Viewer): the route takes
    # nothing, the card reply is refused in words, and the mail is still taken (250),
    # the part not taken said in the log (it was dropped without a line).
    with caplog.at_level(logging.WARNING, logger="bots.email"):
        assert await send("viewer@acme.io", ZOE) == 250
    dropped = [r.getMessage() for r in caplog.records if "not its part" in r.getMessage()]
    assert dropped == [f"email: took a mail but not its part to {ask}: email.sender"]
    [told] = await answer_to(env, "viewer@acme.io")
    assert told["body"].strip() == "You cannot review in this organization."
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    # A reviewer allowed on the route: the card is decided and the mail starts a turn.
    assert await send(ANN, ANN) == 250
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")
    assert await sessions_of(env, ask) == 1


async def test_a_recipient_whose_part_is_refused_does_not_bounce_the_parts_taken(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A mail's one answer at DATA covers every recipient. A routed recipient whose part
    is refused for good (its agent deactivated since the route was made: agent.inactive)
    was a 554 for the whole mail: coming first, the other routed recipient never got its
    part (lost, though its route takes it); coming after a card reply that decided, it
    bounced a mail whose decision stood and was answered. Now the parts taken stand, the
    mail is 250, and the refused part is a WARNING naming the recipient and the rule."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    retired = await make_agent(env.app, org, "retired", active=False)
    gone, ask = "old@lg.example", "ask@lg.example"
    await make_route(env.app, org, retired["id"], "email", {"address": gone})
    await make_route(env.app, org, worker["id"], "email", {"address": ask})

    said: list[str] = []

    async def send(recipients: list[str], message_id: str) -> int:
        message = EmailMessage()
        message["From"] = ANN
        message["To"] = ", ".join(recipients)
        message["Subject"] = "Re: card"
        message["Message-ID"] = message_id
        message.set_content("approve")
        try:
            await aiosmtplib.send(
                message, recipients=recipients, hostname="127.0.0.1", port=env.port, timeout=5
            )
        except aiosmtplib.SMTPResponseException as exc:
            said.append(exc.message)
            return exc.code
        return 250

    assert await send([gone], "<alone.1@mail.acme.io>") == 554  # nothing else to take
    assert said == ["5.6.0 Message could not be processed (agent.inactive)"]  # names its rule
    with caplog.at_level(logging.WARNING, logger="bots.email"):
        assert await send([gone, ask], "<both.2@mail.acme.io>") == 250
        assert await sessions_of(env, ask) == 1
        assert await send([to, gone], "<card.3@mail.acme.io>") == 250
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")
    [answer] = await answer_rows(env)
    assert answer.text.startswith("Your decision was recorded: Approved by member@acme.io")
    refused = [r.getMessage() for r in caplog.records if "not its part" in r.getMessage()]
    assert refused == [f"email: took a mail but not its part to {gone}: agent.inactive"] * 2


@pytest.fixture
async def env_faults(
    migrated_url: str, sink: SmtpSink, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Env, SqliteFaults | PgFaults]]:
    """:func:`env` with a statement-fault injector made before it opens the database."""
    faults = injector(migrated_url, monkeypatch)
    async for made in _env(migrated_url, sink):
        yield made, faults


@pytest.fixture
async def env_expiring_faults(
    migrated_url: str, sink: SmtpSink, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Env, SqliteFaults | PgFaults]]:
    """:func:`env_expiring` with a statement-fault injector, as :func:`env_faults`."""
    faults = injector(migrated_url, monkeypatch)
    async for made in _env(migrated_url, sink, review={"expire_after": "1h"}):
        yield made, faults


#: What a decision on an escalated api item with a card mail not sent yet counts, as
#: ``(name, labels)``: the card's end, the reveal's send, the item's moves, an expiry.
DECISION_COUNTS: dict[str, tuple[str, dict[str, str]]] = {
    "card cancelled": ("leadgate_deliveries_total", {"channel": "email", "outcome": "cancelled"}),
    "reveal sent": ("leadgate_deliveries_total", {"channel": "api", "outcome": "sent"}),
    **{
        f"{src}->{dst}": (
            "leadgate_work_item_transitions_total",
            {"from_status": src, "to_status": dst},
        )
        for src, dst in (
            ("awaitingHuman", "approved"),
            ("approved", "completed"),
            ("awaitingHuman", "cancelled"),
            ("awaitingHuman", "rejected"),
        )
    },
    "expired": ("leadgate_review_expiries_total", {}),
}


def decision_counts() -> dict[str, float]:
    """:data:`DECISION_COUNTS` now."""
    return {key: counted(name, **labels) for key, (name, labels) in DECISION_COUNTS.items()}


def gained(before: dict[str, float]) -> dict[str, float]:
    """What :func:`decision_counts` gained since ``before`` (the keys that changed)."""
    now = decision_counts()
    return {key: now[key] - before[key] for key in now if now[key] != before[key]}


@pytest.mark.parametrize("decision", ["approve", "cancel"])
async def test_a_decision_whose_commit_failed_counts_nothing_until_it_commits(
    env_faults: tuple[Env, SqliteFaults | PgFaults], decision: str
) -> None:
    """A decision whose transaction meets a database fault at its ``COMMIT`` rolls back
    whole (a 503): nothing it would have counted is counted (the item's moves, the
    reveal, the card mail it ends). They stood before, counted inside the transaction,
    and the decision made again counted them twice."""
    env, faults = env_faults
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    assert (await email_card_row(env, item_id)).status == "pending"
    before = decision_counts()
    faults.arm_on("UPDATE review_episodes", then="COMMIT")
    with pytest.raises(Unavailable):
        await env.app.reviews.decide(org.principal, item_id, decision, surface="api")
    faults.disarm()
    assert faults.fired is not None and "COMMIT" in faults.fired
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    assert (await email_card_row(env, item_id)).status == "pending"
    assert gained(before) == {}

    await env.app.reviews.decide(org.principal, item_id, decision, surface="api")
    assert (await email_card_row(env, item_id)).status == "cancelled"
    expected = {
        "approve": {
            "card cancelled": 1,
            "reveal sent": 1,
            "awaitingHuman->approved": 1,
            "approved->completed": 1,
        },
        "cancel": {"card cancelled": 1, "awaitingHuman->cancelled": 1},
    }
    assert gained(before) == expected[decision]


async def test_an_expiry_whose_commit_failed_is_counted_once_when_it_commits(
    env_expiring_faults: tuple[Env, SqliteFaults | PgFaults],
) -> None:
    """The SLA runner's expiry meets a database fault at its ``COMMIT``: nothing is
    counted; the next pass expires the item, counted once (the expiry and the item's
    move were counted by both passes)."""
    env, faults = env_expiring_faults
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    assert isinstance(env.app.clock, FakeClock)
    env.app.clock.advance(3_600_000 + 1)
    before = decision_counts()
    faults.arm_on("UPDATE work_items", then="COMMIT")
    with pytest.raises(Unavailable):
        await drain(env.app.sla_runner)
    faults.disarm()
    assert faults.fired is not None and "COMMIT" in faults.fired
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    assert gained(before) == {}

    await drain(env.app.sla_runner)
    assert (await item_row(env.app, item_id))["status"] == "rejected"
    assert gained(before) == {"card cancelled": 1, "awaitingHuman->rejected": 1, "expired": 1}


async def test_a_reply_retried_after_its_routed_part_met_a_451_is_not_answered_twice(
    env_faults: tuple[Env, SqliteFaults | PgFaults],
) -> None:
    """One mail to the card and to a routed address: the card is decided (and its answer
    committed) before the routed part meets a database fault at recording and the mail
    is answered 451. The sending server's retry of the same mail (same Message-ID) is
    known: nothing more is decided or answered, and the routed part is taken as new. A
    different mail to the card is still told it was decided already."""
    env, faults = env_faults
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    ask = "ask@lg.example"
    await make_route(env.app, org, worker["id"], "email", {"address": ask, "sender": ANN})
    message = EmailMessage()
    message["From"] = ANN
    message["To"] = f"{to}, {ask}"
    message["Subject"] = "Re: card"
    message["Message-ID"] = "<retried.1@mail.acme.io>"
    message.set_content("approve")

    async def send() -> int:
        try:
            await aiosmtplib.send(
                message, recipients=[to, ask], hostname="127.0.0.1", port=env.port, timeout=5
            )
        except aiosmtplib.SMTPResponseException as exc:
            return exc.code
        return 250

    faults.arm_on("INTO sessions")  # the routed part's new session: its recording fails
    assert await send() == 451
    faults.disarm()
    assert faults.fired is not None
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")
    [answer] = await answer_rows(env)
    assert answer.text.startswith("Your decision was recorded: Approved by member@acme.io")

    assert await send() == 250  # the sending server's retry: the same mail
    assert [a.text for a in await answer_rows(env)] == [answer.text]
    assert await sessions_of(env, ask) == 1
    actions = [a["action"] for a in await item_audit(env.app, item_id)]
    assert actions.count("approve") == 1

    del message["Message-ID"]
    message["Message-ID"] = "<another.2@mail.acme.io>"
    assert await send() == 250
    first, again = await answer_rows(env)
    assert first.text == answer.text
    assert again.text.startswith("Already approved by member@acme.io (email)")
    # Mailed: the answers (and the worker's replies to the routed part, threaded too).
    await drain(env.app.relay)
    mailed = [m["body"].strip() for m in await answer_to(env, ANN)]
    assert sorted(b for b in mailed if not b.startswith("Echo:")) == [again.text, answer.text]


async def test_a_reply_to_a_card_of_an_earlier_wait_is_out_of_date(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    old = reply_address(await card_mail(env, item_id))
    await env.app.reviews.decide(org.principal, item_id, "return", "again", surface="api")
    await drain(RevisionRunner(env.app.turns))
    await drain(env.app.lead_runner)
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    new = reply_address(await card_mail(env, item_id))
    assert new != old
    assert await reply(env, old, "approve") == 250
    [told] = await answer_to(env, "member@acme.io")
    assert told["body"].startswith("This card is out of date")
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    assert await reply(env, new, "approve") == 250
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")


async def test_confirm_and_retry_a_delivery_unknown_card(env: Env) -> None:
    org, worker = await setup(env)
    env.slack.script = [Uncertain("read timeout after the request was written")] * 2
    items = []
    for thread in ("1700.1", "1700.2"):
        await env.app.turns.run(slack_trigger(org, worker, "post it #complete", thread))
        await drain(env.app.lead_runner)
        await drain(env.app.relay)  # the post times out: deliveryUnknown, a card mailed
        queue = (await env.app.reviews.queue(org.principal))["items"]
        items = [i["id"] for i in queue]
    assert len(items) == 2
    confirmed, retried = items
    to_confirm = reply_address(await card_mail(env, confirmed))
    to_retry = reply_address(await card_mail(env, retried))
    card = await card_mail(env, confirmed)
    assert "'confirm'" in card["body"] and "'retry'" in card["body"]

    assert await reply(env, to_confirm, "approve") == 250  # not what this card offers
    assert (await item_row(env.app, confirmed))["status"] == "approved"
    assert await reply(env, to_confirm, "Confirm") == 250
    assert (await item_row(env.app, confirmed))["status"] == "completed"
    audit = next(
        a for a in await item_audit(env.app, confirmed) if a["action"] == "deliveryConfirmed"
    )
    assert (audit["surface"], audit["identity"]) == ("email", "email:member@acme.io")

    sent = len(env.slack.calls)
    assert await reply(env, to_retry, "retry") == 250
    await drain(env.app.relay)
    assert len(env.slack.calls) == sent + 1  # posted again, and this time it lands
    assert (await item_row(env.app, retried))["status"] == "completed"


async def test_the_database_down_at_data_is_451_and_nothing_changes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    lost = await escalated(env, org, worker, "s2")
    to = reply_address(await card_mail(env, item_id))
    to_lost = reply_address(await card_mail(env, lost))
    before = await item_audit(env.app, item_id)
    db = env.app.db

    async def data_while(address: str, down: list[tuple[str, DownFor]]) -> int:
        """RCPT while the database is up, then DATA with ``down`` in place."""
        message = EmailMessage()
        message["From"] = "member@acme.io"
        message["To"] = address
        message["Subject"] = "Re: card"
        message.set_content("approve")
        async with aiosmtplib.SMTP(hostname="127.0.0.1", port=env.port, timeout=5) as smtp:
            await smtp.mail("member@acme.io")
            await smtp.rcpt(address)
            with monkeypatch.context() as patch:
                for name, fake in down:
                    patch.setattr(db, name, fake)
                try:
                    await smtp.data(message.as_bytes())
                except aiosmtplib.SMTPDataError as exc:
                    return exc.code
        return 250

    # The card's lookup fails; then the decision's transaction: each time 451, nothing
    # decided, and no answer written or mailed (the sending server retries).
    assert await data_while(to, [("read", DownFor(db.read, 1, after_commit=False))]) == 451
    assert await data_while(to, [("tx", DownFor(db.tx, 1, after_commit=False))]) == 451
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"
    assert await item_audit(env.app, item_id) == before
    assert await answer_rows(env) == []
    await drain(env.app.relay)
    assert not [m for m in env.sink.messages if m["in_reply_to"]]
    # The retry decides.
    assert await reply(env, to, "approve") == 250
    assert (await item_row(env.app, item_id))["status"] in ("approved", "completed")
    [answer] = await answer_to(env, "member@acme.io")
    assert answer["body"].startswith("Your decision was recorded: Approved")

    # Committed, but the connection was lost at COMMIT (in doubt): 451. The answer
    # committed with the decision is mailed (the relay is woken as by a commit), and the
    # sending server's retry of the same mail (the same bytes: the same Message-ID) is
    # known as taken, and answered no second time. (A SQLite COMMIT is never in doubt;
    # on SQLite this runs the same answer to a fault and the same dedupe of the retry,
    # which do not depend on the backend.)
    env.sink.messages.clear()
    lost_commit = DownFor(db.tx, 1, after_commit=True, sqlite_too=True)
    assert await data_while(to_lost, [("tx", lost_commit)]) == 451
    assert (await item_row(env.app, lost))["status"] in ("approved", "completed")
    assert await data_while(to_lost, []) == 250
    [answer] = await answer_to(env, "member@acme.io")
    assert answer["body"].startswith("Your decision was recorded: Approved by member@acme.io")
    actions = [a["action"] for a in await item_audit(env.app, lost)]
    assert actions.count("approve") == 1


async def answer_rows(env: Env) -> list[Any]:
    """The outbox rows of answers to reviewers' mails, oldest first."""
    d = t.deliveries.c
    async with env.app.db.read() as conn:
        return list(
            (
                await conn.execute(
                    sa.select(
                        d.id,
                        d.work_item_id,
                        d.channel,
                        d.status,
                        d.address,
                        d.text,
                        d.error,
                        d.next_attempt_at,
                    )
                    .where(d.kind == "answer")
                    .order_by(d.created_at, d.id)
                )
            ).all()
        )


async def test_the_answer_is_an_outbox_row_committed_with_the_decision(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    assert await reply(env, to, "approve", subject="Re: the card") == 250
    # Before the 250, with the decision: queued, nothing mailed yet (no relay pass).
    [row] = await answer_rows(env)
    assert (row.work_item_id, row.channel, row.status) == (item_id, "email", "pending")
    assert row.address["to"] == ANN and row.address["subject"] == "Re: the card"
    assert row.text.startswith("Your decision was recorded: Approved by member@acme.io")
    assert not [m for m in env.sink.messages if m["in_reply_to"]]
    [answer] = await answer_to(env, ANN)
    assert answer["in_reply_to"] == row.address["in_reply_to"]
    assert answer["body"].startswith("Your decision was recorded: Approved")
    assert [r.status for r in await answer_rows(env)] == ["sent"]


@pytest.mark.parametrize("said", ["approve", "looks fine to me"])
async def test_an_answer_the_mail_server_refuses_is_sent_on_a_later_relay_pass(
    env: Env, said: str
) -> None:
    """A decision's answer, and one written on its own (nothing was decided)."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    env.sink.fail_next("tempfail")  # the answer's first send: 451 after its content
    assert await reply(env, to, said) == 250
    await drain(env.app.relay)
    assert not [m for m in env.sink.messages if m["in_reply_to"]]
    [row] = await answer_rows(env)
    assert row.status == "pending" and "451" in row.error
    # Due again once its backoff has passed (the relay's clock), not before.
    clock = env.app.clock
    assert isinstance(clock, FakeClock)
    clock.advance(row.next_attempt_at - clock.now_ms())
    [answer] = await answer_to(env, ANN)
    expected = "Your decision was recorded: Approved" if said == "approve" else "Nothing was"
    assert answer["body"].startswith(expected)
    assert [r.status for r in await answer_rows(env)] == ["sent"]


async def test_cancelling_the_item_leaves_an_answer_on_its_way_be(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    env.sink.fail_next("tempfail")
    assert await reply(env, to, "looks fine to me") == 250
    await drain(env.app.relay)
    await env.app.reviews.decide(org.principal, item_id, "cancel", surface="api")
    [row] = await answer_rows(env)
    assert row.status == "pending"  # what it says was so when it was written
    clock = env.app.clock
    assert isinstance(clock, FakeClock)
    clock.advance(row.next_attempt_at - clock.now_ms())
    [answer] = await answer_to(env, ANN)
    assert answer["body"].startswith("Nothing was decided.")


async def test_a_reply_to_a_cancelled_item_is_told_why_it_was_cancelled(env: Env) -> None:
    """A card mail answered after the item was cancelled with a reason: the answer said
    who cancelled it, never why (a reject's reason it gave). The reason is quoted under
    the line, each of its lines (it ran on after a colon, its second line as if the
    answer's own), as the cards show it."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    reason = "a duplicate of the Q3 ticket\nsee the plan"
    await env.app.reviews.decide(org.principal, item_id, "cancel", reason, surface="api")
    assert await reply(env, to, "approve") == 250
    [told] = await answer_to(env, ANN)
    line, _, rest = told["body"].partition("\n")
    assert line.startswith("Already cancelled by API key"), told["body"]
    assert "(api) at " in line and line.endswith("."), told["body"]
    assert rest.startswith("> a duplicate of the Q3 ticket\n> see the plan"), told["body"]
    assert (await item_row(env.app, item_id))["status"] == "cancelled"


async def test_an_answer_whose_send_is_uncertain_is_delivery_unknown(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    env.sink.fail_next("drop")  # the whole answer written, then the connection lost
    assert await reply(env, to, "approve") == 250
    await drain(env.app.relay)
    [row] = await answer_rows(env)
    assert row.status == "deliveryUnknown"
    listed = await env.app.reviews.uncertain(org.principal)
    assert [(d["id"], d["kind"]) for d in listed["deliveries"]] == [(row.id, "answer")]


async def test_unknown_tokens_are_refused_at_rcpt_and_the_token_is_kept_hashed(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    to = reply_address(await card_mail(env, item_id))
    match = REPLY_TO.fullmatch(to)
    assert match is not None
    token = match.group(1)
    for address in (
        f"review+{'0' * 32}@reviews.example.com",  # no such card
        "review+not-a-token@reviews.example.com",
        f"review+{token}x@reviews.example.com",
    ):
        assert await reply(env, address, "approve") == 550
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"

    # No row holds the token: the card's row keeps its hash, and the sent card mail's
    # outbox row no longer carries its Reply-To.
    async with env.app.db.read() as conn:
        hashes = (await conn.execute(sa.select(t.review_cards.c.reply_token_hash))).scalars()
        assert token_hash(token) in set(hashes)
    assert not await rows_holding(env, token)


async def rows_holding(env: Env, needle: str | re.Pattern[str]) -> list[str]:
    """Every row of every table (as text) in which ``needle`` occurs."""
    async with env.app.db.read() as conn:
        rows = [
            repr(tuple(row))
            for table in t.metadata.sorted_tables
            for row in (await conn.execute(sa.select(table))).all()
        ]
    if isinstance(needle, str):
        return [r for r in rows if needle in r]
    return [r for r in rows if needle.search(r)]


#: A card reply address with its plain token, wherever it is kept.
PLAIN_TOKEN = re.compile(r"review\+[0-9a-f]{32}@")


async def email_card_row(env: Env, item_id: str) -> Any:
    """The outbox row of ``item_id``'s (one) email card mail."""
    d = t.deliveries.c
    async with env.app.db.read() as conn:
        return (
            await conn.execute(
                sa.select(d.id, d.status, d.address).where(
                    d.work_item_id == item_id, d.kind == "card", d.channel == "email"
                )
            )
        ).one()


async def uncertain_card(env: Env, org: Org, worker: dict[str, Any]) -> tuple[str, str]:
    """An escalated item whose card mail was maybe sent (the relay wrote the whole mail,
    then the connection dropped): its row is deliveryUnknown and still holds the Reply-To,
    which a retry needs. The item's id and the card's delivery id."""
    item_id = await escalated(env, org, worker, "s1")
    env.sink.fail_next("drop")
    await drain(env.app.relay)
    card = await email_card_row(env, item_id)
    assert card.status == "deliveryUnknown"
    assert PLAIN_TOKEN.search(card.address["reply_to"])
    return item_id, str(card.id)


@pytest.mark.parametrize("decision", ["approve", "cancel"])
async def test_a_card_mail_not_sent_yet_loses_its_token_when_the_item_is_decided(
    env: Env, decision: str
) -> None:
    """Ended ``cancelled`` by the decision (a cancel cancels the item's unsent
    deliveries first), and counted so, once (it was not counted at all)."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    assert await rows_holding(env, PLAIN_TOKEN)  # the card mail's row, until it ends
    before = deliveries_counted("email", "cancelled")
    await env.app.reviews.decide(org.principal, item_id, decision, surface="api")
    assert (await email_card_row(env, item_id)).status == "cancelled"
    assert not await rows_holding(env, PLAIN_TOKEN)
    assert deliveries_counted("email", "cancelled") - before == 1


async def test_a_card_mail_refused_for_good_loses_its_token(env: Env) -> None:
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    env.sink.fail_next("reject")  # 554 after the content: never sent
    await drain(env.app.relay)
    assert (await email_card_row(env, item_id)).status == "failed"
    assert not await rows_holding(env, PLAIN_TOKEN)


@pytest.mark.parametrize("then", ["confirm", "retry-sent", "retry-refused"])
async def test_an_uncertain_card_mail_loses_its_token_when_its_row_ends(
    env: Env, then: str
) -> None:
    """Confirmed by an operator (``leadgate delivery confirm`` and the operator API are
    this call), or retried and then sent or refused for good."""
    org, worker = await setup(env)
    item_id, card_id = await uncertain_card(env, org, worker)
    action, _, after = then.partition("-")
    await env.app.reviews.recover(org.principal, card_id, action, surface="api")
    if after == "refused":
        env.sink.fail_next("reject")
    await drain(env.app.relay)
    expected = {"confirm": "sent", "retry-sent": "sent", "retry-refused": "failed"}[then]
    assert (await email_card_row(env, item_id)).status == expected
    assert not await rows_holding(env, PLAIN_TOKEN)


@pytest.mark.parametrize("decision", ["approve", "reject", "cancel"])
async def test_an_uncertain_card_mail_ends_with_its_token_when_the_item_is_decided(
    env: Env, decision: str
) -> None:
    """It cannot be edited nor answered any more, and sent again it would offer a
    decision already made: cancelled, its Reply-To dropped. Counted once, as its send
    ended (``deliveryUnknown``), not again as ``cancelled`` when the decision ends it
    (one delivery was two ends in ``leadgate_deliveries_total``)."""
    org, worker = await setup(env)
    unknown = deliveries_counted("email", "deliveryUnknown")
    item_id, _ = await uncertain_card(env, org, worker)
    assert deliveries_counted("email", "deliveryUnknown") - unknown == 1
    reason = "not this" if decision == "reject" else None
    before = deliveries_counted("email", "cancelled")
    await env.app.reviews.decide(org.principal, item_id, decision, reason, surface="api")
    assert (await email_card_row(env, item_id)).status == "cancelled"
    assert not await rows_holding(env, PLAIN_TOKEN)
    assert deliveries_counted("email", "cancelled") == before
    assert deliveries_counted("email", "deliveryUnknown") - unknown == 1


async def test_an_uncertain_card_mail_ends_with_its_token_when_its_delivery_is_confirmed_by_email(
    env: Env,
) -> None:
    """The card of a Slack answer whose post was uncertain reached the reviewer, but its
    own send was uncertain too; the reviewer's ``confirm`` settles the item and ends the
    card mail's row."""
    org, worker = await setup(env)
    env.slack.script = [Uncertain("read timeout after the request was written")]
    await env.app.turns.run(slack_trigger(org, worker, "post it #complete", "1700.1"))
    await drain(env.app.lead_runner)
    env.sink.fail_next("drop")  # the card mail: written whole, then the connection lost
    await drain(env.app.relay)
    [item_id] = [i["id"] for i in (await env.app.reviews.queue(org.principal))["items"]]
    assert (await email_card_row(env, item_id)).status == "deliveryUnknown"
    [attempt] = [a for a in env.sink.attempts if a.get("reply_to")]
    assert await reply(env, reply_address(attempt), "confirm") == 250
    assert (await item_row(env.app, item_id))["status"] == "completed"
    assert (await email_card_row(env, item_id)).status == "cancelled"
    assert not await rows_holding(env, PLAIN_TOKEN)


async def test_an_uncertain_card_mail_ends_with_its_token_when_the_item_expires(
    env_expiring: Env,
) -> None:
    env = env_expiring
    org, worker = await setup(env)
    item_id, _ = await uncertain_card(env, org, worker)
    assert isinstance(env.app.clock, FakeClock)
    env.app.clock.advance(3_600_000 + 1)
    await drain(env.app.sla_runner)
    assert (await item_row(env.app, item_id))["status"] == "rejected"
    assert (await email_card_row(env, item_id)).status == "cancelled"
    assert not await rows_holding(env, PLAIN_TOKEN)


@pytest.mark.parametrize("send", ["drop", "tempfail", "reject", "ok"])
async def test_a_card_mail_being_sent_when_the_item_is_decided_ends_with_its_token(
    env: Env, send: str
) -> None:
    """The relay is sending the card mail (the mail server has read it and not answered
    yet) when the item is approved through the API: the decision leaves that row to its
    send, and however the send ends (maybe sent, refused for now, refused for good,
    sent) the row ends with its Reply-To. Neither maybe sent nor refused for now, it
    is not left for an operator to settle, nor sent again; a reply to the mail is told
    the item is decided and decides nothing."""
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")

    async def decide_meanwhile(record: dict[str, Any]) -> None:
        if record["reply_to"]:  # the card mail (an answer has none)
            env.sink.on_data = None
            await env.app.reviews.decide(org.principal, item_id, "approve", surface="api")

    env.sink.on_data = decide_meanwhile
    if send != "ok":
        env.sink.fail_next(send)
    await drain(env.app.relay)
    assert env.sink.on_data is None  # the decision was made while the mail was in flight
    assert (await item_row(env.app, item_id))["status"] == "completed"
    expected = {"drop": "cancelled", "tempfail": "cancelled", "reject": "failed", "ok": "sent"}
    assert (await email_card_row(env, item_id)).status == expected[send]
    assert not await rows_holding(env, PLAIN_TOKEN)
    assert (await env.app.reviews.uncertain(org.principal))["deliveries"] == []
    clock = env.app.clock
    assert isinstance(clock, FakeClock)
    clock.advance(3_600_000)  # a refused-for-now send would be due again by now
    await drain(env.app.relay)
    [attempt] = [a for a in env.sink.attempts if a["reply_to"]]

    assert await reply(env, reply_address(attempt), "reject\nnot this") == 250
    [told] = await answer_to(env, ANN)
    assert told["body"].startswith("Already approved by API key"), told["body"]
    assert (await item_row(env.app, item_id))["status"] == "completed"
    actions = [a["action"] for a in await item_audit(env.app, item_id)]
    assert (actions.count("approve"), actions.count("reject")) == (1, 0)


@pytest.fixture
async def env_pg(migrated_pg: str, sink: SmtpSink) -> AsyncIterator[Env]:
    """:func:`env` on PostgreSQL alone."""
    async for made in _env(migrated_pg, sink):
        yield made


async def test_a_card_mail_whose_uncertain_send_commits_with_a_decision_still_ends(
    env_pg: Env,
) -> None:
    """PostgreSQL: the decision has closed the card's wait (not committed yet, the card
    read as being sent) when the relay commits the card mail's uncertain send. The relay
    waits for the decision's commit and then finds the wait closed: the row ends
    ``cancelled``, its token dropped (reading the wait unlocked, the relay saw it open and
    left the row ``deliveryUnknown``, token and all, and the decision never saw it)."""
    env = env_pg
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    inside, release = asyncio.Event(), asyncio.Event()
    decisions: list[asyncio.Task[Any]] = []

    async def hold(conn: Any) -> None:
        inside.set()
        await release.wait()

    async def decide_meanwhile(record: dict[str, Any]) -> None:
        env.sink.on_data = None
        decisions.append(
            asyncio.create_task(
                env.app.reviews.decide(org.principal, item_id, "approve", surface="api", then=hold)
            )
        )
        await inside.wait()  # the wait is closed, the decision not committed

    env.sink.on_data = decide_meanwhile
    env.sink.fail_next("drop")
    relay = asyncio.create_task(drain(env.app.relay))
    await inside.wait()

    async def relay_waits_or_committed() -> bool:
        async with env.app.db.read() as conn:
            waiting = await conn.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        return bool(waiting) or (await email_card_row(env, item_id)).status != "sending"

    # The relay's outcome commit waits for the decision's (a lock), or has committed.
    await eventually(relay_waits_or_committed, within=10.0)
    assert not decisions[0].done()
    release.set()
    await asyncio.gather(relay, *decisions)
    assert (await item_row(env.app, item_id))["status"] == "completed"
    assert (await email_card_row(env, item_id)).status == "cancelled"
    assert not await rows_holding(env, PLAIN_TOKEN)


async def test_without_the_setting_cards_have_no_reply_to_and_plus_addresses_are_refused(
    env_off: Env,
) -> None:
    env = env_off
    org, worker = await setup(env)
    item_id = await escalated(env, org, worker, "s1")
    card = await card_mail(env, item_id)
    assert card["reply_to"] is None
    assert "To decide by email" not in card["body"]
    async with env.app.db.read() as conn:
        hashes = (await conn.execute(sa.select(t.review_cards.c.reply_token_hash))).scalars()
        assert set(hashes) == {None}
    assert await reply(env, f"review+{'a' * 32}@reviews.example.com", "approve") == 550
    assert (await item_row(env.app, item_id))["status"] == "awaitingHuman"


async def test_another_organization_s_mail_with_the_same_message_id_takes_nothing_away(
    env: Env,
) -> None:
    """Two organizations route the same address, each for its own senders. A mail of
    the second one carrying the Message-ID of the first one's mail (quoted, made up, or
    a sender's copy sent on) was its de-duplication key too: the first organization's
    mail, arriving after it, was taken (250) as a duplicate and started nothing: lost.
    Each sender's mail is its own now."""
    ask = "ask@lg.example"
    globex = "mallory@globex.io"
    acme, acme_worker = await setup(env)
    other, other_worker = await setup(env, "globex")
    await make_route(env.app, acme, acme_worker["id"], "email", {"address": ask, "sender": ANN})
    await make_route(
        env.app, other, other_worker["id"], "email", {"address": ask, "sender": globex}
    )

    async def send(sender: str) -> None:
        message = EmailMessage()
        message["From"] = sender
        message["To"] = ask
        message["Subject"] = "Invoice"
        message["Message-ID"] = "<q4-invoice@acme.io>"
        message.set_content(f"A question from {sender}")
        await aiosmtplib.send(
            message, sender=sender, recipients=[ask], hostname="127.0.0.1", port=env.port
        )

    await send(globex)
    await send(ANN)
    async with env.app.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.inbound_events.c.org_id, t.inbound_events.c.content).where(
                    t.inbound_events.c.content.like("A question from %")
                )
            )
        ).all()
    assert sorted((row.org_id, row.content) for row in rows) == sorted(
        [(other.id, f"A question from {globex}"), (acme.id, f"A question from {ANN}")]
    )
    assert await sessions_of(env, ask) == 2
