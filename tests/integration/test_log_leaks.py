"""What a failure logs, captured at DEBUG from every logger: never the message text it
met (what a requester, a worker or a reviewer wrote: here an answer quoting the
request) nor a secret. A database driver's error quotes the statement's values
(PostgreSQL's ``DETAIL: Failing row contains (...)``), a platform's refusal can quote
what was posted, and a traceback carries each error's text on its last line."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import aiosmtplib
import discord.http
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import make_mocked_request
from botbuilder.schema import Activity
from nacl.signing import SigningKey

from bots.discord import DiscordChannel, configure_endpoints
from bots.email import EmailChannel
from bots.teams import TeamsAdapter, parse_message
from leadgate.cli.main import main
from leadgate.core.auth import Scope
from leadgate.core.config import DiscordSettings, EmailSettings, TeamsSettings
from leadgate.core.errors import ModelError, log_failure
from leadgate.core.logs import ContentFilter
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.database.db import Database, upgrade
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta
from leadgate.web.common import error_answer
from outbox.channel import OutboundMessage, Permanent, SendOutcome, stored_error
from outbox.relay import Relay
from tests.fakes import FakeCore
from tests.helpers import eventually, fake_clock, make_agent, make_key, make_org
from tests.integration.test_chat_review_faults import approve_click, serving, slack_click
from tests.integration.test_chat_reviews import escalated, setup
from tests.outbox_support import ScriptedChannel, seed_items
from tests.serving import served_app
from tests.stack import build_stack
from tests.standins.connector import ConnectorStandin, message_activity
from tests.standins.discord_api import DiscordApiStandin
from tests.standins.slack_api import SlackApiStandin
from tests.standins.smtp import SmtpSink
from tests.unit.test_bots_email import ALICE, BOT, _allow, _listen

#: The text a person wrote, which the failures below meet.
MARKER = "MARKER-what-the-person-wrote"


def record_texts(record: logging.LogRecord) -> Iterable[str]:
    """Everything of ``record`` a handler can write: its message, arguments, cached
    traceback text and its traceback formatted."""
    yield str(record.msg)
    yield record.getMessage()
    yield repr(record.args)
    if record.exc_text:
        yield record.exc_text
    if record.exc_info:
        yield "".join(traceback.format_exception(*record.exc_info))
    if record.stack_info:
        yield record.stack_info


def leaking(records: Iterable[logging.LogRecord], *secrets: str) -> list[str]:
    """The records (logger and message) the service would write (``[log]
    include_content = false``: a library's DEBUG lines are dropped) holding any of
    ``secrets``. The stand-ins' own lines (aiosmtpd's ``mail.log``) are not the
    service's."""
    shown = ContentFilter()
    return [
        f"{r.name}: {r.getMessage()}"
        for r in records
        if shown.filter(r)
        and not r.name.startswith("mail.log")
        and any(secret in text for text in record_texts(r) for secret in secrets)
    ]


class EchoingRefusal:
    """A model provider refusing the request with its own words, which quote the
    request (as a real provider's 400 may): the caller gets them, the log never."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        raise ModelError(
            "the model provider refused the request",
            rule="model.bad_request",
            detail=f": invalid request: {request.messages[-1].content!r}",
        )
        yield TextDelta("never")  # pragma: no cover - makes this an async generator


async def refuse_answers_quoting_them(db: Database) -> None:
    """Make the database refuse to store an answer holding :data:`MARKER` under its key
    (a constraint of the operator's own, as a trigger; no wait ends it). PostgreSQL's
    error says why as its own constraints do, quoting the row in its ``DETAIL`` (its
    CHECK constraints cut each value there at 64 bytes); SQLite's ``RAISE`` takes no
    more than a fixed text."""
    if db.is_postgres:
        ddl = [
            "CREATE FUNCTION refuse_answer() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'answer refused' USING ERRCODE = 'check_violation', "
            "DETAIL = 'Failing answer: ' || NEW.response::text; END $$",
            "CREATE TRIGGER refuse_answer BEFORE UPDATE ON idempotency_keys FOR EACH ROW "
            f"WHEN (NEW.response::text LIKE '%{MARKER}%') EXECUTE FUNCTION refuse_answer()",
        ]
    else:
        ddl = [
            "CREATE TRIGGER refuse_answer BEFORE UPDATE OF response ON idempotency_keys "
            f"WHEN NEW.response LIKE '%{MARKER}%' BEGIN SELECT RAISE(ABORT, 'answer refused'); END"
        ]
    async with db.tx() as conn:
        for statement in ddl:
            await conn.execute(sa.text(statement))


async def test_an_answer_the_database_refuses_to_store_is_never_logged(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Storing a keyed request's answer (a model's refusal quoting the message) under its
    Idempotency-Key fails with an error that is no database fault: a constraint
    violation. On PostgreSQL the driver's error quotes the row (``DETAIL: Failing row
    contains (..., {"status": 502, ... MARKER ...}, ...)``), and the REST route's
    WARNING carried it in its traceback. It names the error's type and SQLSTATE now; the
    answer is held, tried again, and given up with one ERROR (no driver text either)."""
    caplog.set_level(logging.DEBUG)
    async with served_app(migrated_url, providers={"refusing": EchoingRefusal()}) as (
        service,
        client,
    ):
        org = await make_org(service)
        await make_agent(service, org, "worker", model="refusing")
        key = await make_key(service, org, Scope.trigger)
        await refuse_answers_quoting_them(service.db)
        body = {"model": "worker", "messages": [{"role": "user", "content": f"hi {MARKER}"}]}
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "k-refused"}
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        # The client gets the answer, the provider's words and all.
        assert resp.status == 502 and MARKER in await resp.text()
        [warning] = [r for r in caplog.records if "under its Idempotency-Key" in r.getMessage()]
        assert "IntegrityError" in warning.getMessage() or warning.exc_info is not None
        # The watch's look stores it again 1 s on, and gives it up.
        fake_clock(service).advance(1_000)
        await service.idempotency.run_once()
        assert [r for r in caplog.records if "is given up" in r.getMessage()]
    assert leaking(caplog.records, MARKER) == []


async def test_a_bug_s_database_error_is_logged_without_the_values_it_quotes(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug's database error (here a message stored without its role: a NOT NULL
    violation) met by a request (the 500 answer's ERROR) and by work with no caller
    (:func:`log_failure`: runners, background tasks): PostgreSQL's ``DETAIL: Failing
    row contains (..., MARKER, ...)`` was in both tracebacks. Each is an ERROR with the
    frames and the error's type and SQLSTATE (SQLite's error name), not its text."""
    db = Database(migrated_url)
    row = {"id": "m_1", "org_id": "o_1", "session_id": "s_1", "content": MARKER}
    try:
        with pytest.raises(sa.exc.IntegrityError) as raised:
            async with db.tx() as conn:
                await conn.execute(sa.insert(t.messages).values(**row, created_at=1))
    finally:
        await db.close()
    caplog.set_level(logging.DEBUG)
    log_failure(logging.getLogger("leadgate.runners"), raised.value, "a runner's pass failed")
    try:
        raise raised.value
    except sa.exc.IntegrityError as exc:
        answer = error_answer(make_mocked_request("POST", "/v1/chat/completions"), exc)
    assert answer.status == 500
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info for r in errors)
    for record in errors:
        [text] = traceback.format_exception(*record.exc_info)[-1:]  # type: ignore[misc]
        assert "IntegrityError" in text and ("23502" in text or "NOTNULL" in text), text
    assert leaking(caplog.records, MARKER) == []


async def stalled_delivery(
    migrated_url: str,
    send: Callable[[OutboundMessage], Awaitable[SendOutcome]],
    refuse: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> sa.Row[Any]:
    """One approved answer carrying :data:`MARKER`, sent by ``send`` once ``refuse`` made
    its platform refuse it for now quoting its text, by a relay that calls a delivery
    stalled after one attempt (its WARNING is what logged the platform's words), every
    record captured from DEBUG: the delivery's row."""
    channel = ScriptedChannel("slack", script=[send])
    stack = build_stack(migrated_url, channels={"slack": channel})
    try:
        seeded = await seed_items(
            stack.db, stack.clock, stack.ids, 1, text=lambda i: f"{MARKER} is the answer"
        )
        refuse()
        caplog.set_level(logging.DEBUG)
        relay = Relay(
            stack.db, stack.clock, stack.ids, stack.channels, rand=lambda: 0.0, stalled_after=1
        )
        await drain(relay)
        async with stack.db.read() as conn:
            return (
                await conn.execute(
                    sa.select(t.deliveries).where(t.deliveries.c.id == seeded.deliveries[0]["id"])
                )
            ).one()
    finally:
        await stack.stop()


async def test_a_relay_s_refusal_quoting_the_message_is_stored_but_never_logged(
    migrated_url: str, sink: SmtpSink, caplog: pytest.LogCaptureFixture
) -> None:
    """An SMTP relay refuses the approved answer for now, its reply quoting the content
    (``451 4.7.1 ... <the answer's first line>``), as content filters do. The delivery's
    error keeps what the relay said (its operators see it), but the relay's WARNING of a
    stalled delivery logged that error whole, and with it the answer's text: it names
    the refusal and its code now."""
    email = EmailChannel(
        EmailSettings(smtp_host="127.0.0.1", smtp_port=sink.port),
        timeout_s=5,
        local_hostname="leadgate.test",
    )

    async def by_email(message: OutboundMessage) -> SendOutcome:
        address = {"to": "alice@example.com", "from": "bot@leadgate.example", "subject": "Re"}
        return await email.send(dataclasses.replace(message, address=address))

    row = await stalled_delivery(
        migrated_url, by_email, lambda: sink.fail_next("tempfail_quoting"), caplog
    )
    assert row.status == "pending" and "451" in row.error and MARKER in row.error, row
    assert [r for r in caplog.records if "still not posted" in r.getMessage()]
    assert leaking(caplog.records, MARKER) == []


async def test_discord_s_refusal_quoting_the_post_is_stored_but_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Discord answers a post 400 ``Invalid Form Body``, its field error quoting the value
    it refused (the post's text). The delivery's error keeps Discord's words (its
    operators see them); the WARNING of a post that never will be made quoted them,
    and the relay's stalled WARNING of a retried one did too. They name the status and
    Discord's code now."""
    caplog.set_level(logging.DEBUG)
    base = discord.http.Route.BASE  # (configure_endpoints sets it for the process)
    async with DiscordApiStandin(token="bot-token", application_id="9000") as standin:
        settings = DiscordSettings(bot_token="bot-token", api_url=standin.api_url)
        configure_endpoints(settings)
        channel = DiscordChannel(settings, timeout_s=5)
        try:
            standin.queue("invalid_form_echo")
            message = OutboundMessage(
                delivery_id="d1",
                idempotency_key="d1",
                address={"channel_id": "700000000000000001"},
                text=f"{MARKER} is the answer",
            )
            outcome = await channel.send(message)
        finally:
            await channel.close()
            discord.http.Route.BASE = base
    assert isinstance(outcome, Permanent) and MARKER in stored_error(outcome), outcome
    assert "HTTP 400 code 50035" in outcome.error
    assert [r for r in caplog.records if "never will be" in r.getMessage()]
    assert leaking(caplog.records, MARKER) == []


async def run_command(tmp_path: Path, url: str, *argv: str) -> int:
    """Run ``leadgate <argv>`` in process on the database at ``url`` (``[log] level =
    "DEBUG"``): ``main`` sets logging up as a command does, its handler writing to the
    captured stderr; the test's capture handler is put back after. Its exit code."""
    config = tmp_path / "leadgate.toml"
    config.write_text(f'[database]\nurl = "{url}"\n[log]\nlevel = "DEBUG"\n', encoding="utf-8")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return await asyncio.to_thread(main, ["--config", str(config), *argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


async def test_a_database_url_s_password_never_reaches_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[database] url`` holds a password and the server cannot be reached: the service
    answers a request 503 and ``/healthz`` says so, and a command fails; what they log
    (at DEBUG, libraries' lines included: SQLAlchemy's pool, asyncpg) and what the
    command prints name the error and the URL without the password."""
    secret = "PW-" + MARKER
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+asyncpg://leadgate:{secret}@127.0.0.1:{port}/leadgate"
    caplog.set_level(logging.DEBUG)
    async with served_app(url) as (_, client):
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer lg.k1.secret"},
        )
        assert answer.status == 503, await answer.text()
        assert (await client.get("/healthz")).status == 503
    code = await run_command(tmp_path, url, "org", "list")
    out, err = capsys.readouterr()
    assert code != 0 and "leadgate:***@127.0.0.1" in err, err
    assert secret not in out + err
    assert leaking(caplog.records, secret) == []


async def test_the_connector_s_refusal_quoting_the_post_is_stored_but_never_logged(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The Bot Connector answers a post 503, its error message quoting the activity's
    text: a retry, and once the delivery is stalled the relay's WARNING logged its error,
    the Connector's words and the answer's text with them. It names the status now; the
    delivery's error keeps the words."""
    connector = ConnectorStandin()
    await connector.start()
    adapter = TeamsAdapter(TeamsSettings(enabled=True), FakeCore(), send_timeout_s=5)
    activity = Activity().deserialize(
        message_activity(service_url=connector.url, text="hi", activity_id="1700000000001")
    )
    inbound = parse_message(activity)
    assert inbound is not None

    async def by_teams(message: OutboundMessage) -> SendOutcome:
        return await adapter.channel.send(dataclasses.replace(message, address=inbound.address))

    try:
        row = await stalled_delivery(
            migrated_url, by_teams, lambda: connector.fail_next("503_quoting"), caplog
        )
    finally:
        await adapter.channel.close()
        await connector.close()
    assert row.status == "pending" and "HTTP 503" in row.error and MARKER in row.error, row
    assert [r for r in caplog.records if "still not posted" in r.getMessage()]
    assert leaking(caplog.records, MARKER) == []


async def test_a_command_s_unexpected_database_error_is_printed_without_its_text(
    migrated_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A command meets a database error nothing expects (here the operator's own trigger
    refusing an organization, its message and ``DETAIL`` quoting the name, as
    PostgreSQL's own constraints quote a row): exit 1 with one line on stderr, which for
    ``serve`` is the service's log. It printed the driver's text whole (``{exc}``); it
    names the error's types and SQLSTATE now, and the rule."""
    db = Database(migrated_url)
    try:
        async with db.tx() as conn:
            if db.is_postgres:
                await conn.execute(
                    sa.text(
                        "CREATE FUNCTION refuse_org() RETURNS trigger LANGUAGE plpgsql AS $$ "
                        "BEGIN RAISE EXCEPTION 'refused %', NEW.name USING "
                        "DETAIL = 'Failing name: ' || NEW.name; END $$"
                    )
                )
                await conn.execute(
                    sa.text(
                        "CREATE TRIGGER refuse_org BEFORE INSERT ON organizations "
                        "FOR EACH ROW EXECUTE FUNCTION refuse_org()"
                    )
                )
            else:
                await conn.execute(
                    sa.text(
                        "CREATE TRIGGER refuse_org BEFORE INSERT ON organizations "
                        "BEGIN SELECT RAISE(ABORT, 'refused'); END"
                    )
                )
    finally:
        await db.close()
    caplog.set_level(logging.DEBUG)
    code = await run_command(tmp_path, migrated_url, "org", "create", MARKER)
    out, err = capsys.readouterr()
    assert code == 1 and out == "", err
    line = err.rstrip().splitlines()[-1]  # (the lines above: the DEBUG traceback)
    assert line.startswith("leadgate: error: ") and line.endswith("[internal]"), err
    assert "P0001" in line if migrated_url.startswith("postgresql") else "SQLITE_CONSTRAINT" in line
    assert MARKER not in err
    assert leaking(caplog.records, MARKER) == []


async def test_the_migration_engine_hides_statement_parameters(db_url: str) -> None:
    """``db upgrade`` runs Alembic on an engine of its own (``migrations/env.py``), which
    did not hide a statement's parameters as the service's engine does: a data migration
    that failed would have put the values it bound (message text) into the error that
    ``db upgrade`` prints and logs. Every engine the upgrade connects with hides them."""
    engines: list[sa.Engine] = []

    def connected(conn: sa.Connection) -> None:
        engines.append(conn.engine)

    sa.event.listen(sa.Engine, "engine_connect", connected)
    try:
        await asyncio.to_thread(upgrade, db_url)
    finally:
        sa.event.remove(sa.Engine, "engine_connect", connected)
    assert engines and all(engine.hide_parameters for engine in engines), engines


#: Mails the email package cannot take apart, and the error it meets: each error's
#: traceback quotes the header it choked on (a ``HeaderParseError`` "... but found
#: '<the rest of the header>'" under the ``IndexError`` raised while handling it).
MALFORMED_MAILS = {
    # message_from_bytes reads it; the Message-ID's parser fails: 554, "unparseable".
    "unparseable message": (
        f"Message-ID: <(;;=]\t>x {MARKER}\r\n\r\nthe text\r\n",
        (554, "5.6.0 Message could not be parsed (email.parse)"),
    ),
    # A part's Content-Disposition fails when the body is looked for: no text, 550.
    "could not walk the MIME structure": (
        "Message-ID: <m1@client.example>\r\n"
        "Content-Type: multipart/mixed; boundary=b\r\n\r\n"
        f"--b\r\nContent-Disposition: )[{MARKER};x*\r\n\r\nthe text\r\n--b--\r\n",
        (550, "5.6.0 Message has no text body (email.body)"),
    ),
}


@pytest.mark.parametrize("logged", list(MALFORMED_MAILS))
async def test_a_mail_the_email_package_cannot_read_is_logged_without_its_text(
    logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A malformed mail sent to the real listener: the email package's error quotes the
    header it could not parse, and its traceback was logged ("unparseable message" at
    WARNING, "could not walk the MIME structure" at INFO). The line names the error's
    type and where it was raised now; the sender gets the same answer as before."""
    mail, answer = MALFORMED_MAILS[logged]
    raw = f"From: {ALICE}\r\nTo: {BOT}\r\nSubject: hi\r\n{mail}".encode()
    caplog.set_level(logging.DEBUG)
    async for listener in _listen(FakeCore(_allow(ALICE))):
        with pytest.raises(aiosmtplib.SMTPDataError) as refused:
            await listener.send(raw)
        assert (refused.value.code, refused.value.message) == answer
        assert listener.core.triggers == []
    [line] = [r for r in caplog.records if logged in r.getMessage()]
    assert "IndexError at " in line.getMessage() and line.exc_info is None, line.getMessage()
    assert leaking(caplog.records, MARKER) == []


async def test_slack_s_refusal_of_the_reason_form_is_logged_by_its_code(
    migrated_url: str,
    key: SigningKey,
    slack_api: SlackApiStandin,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Reject click whose reason form Slack refuses to open: Slack's answer names what
    is wrong with the view, quoting it (``response_metadata.messages``), and the WARNING
    logged the SlackApiError's repr, Slack's whole answer in it. It names the status and
    Slack's error code now; the reviewer is told to try again, as before. (The form
    holds ids, no message text: a blocks post quoted so would carry a card's text.)"""
    slack_api.set_channel_mode("views.open", "invalid_arguments_echo")
    caplog.set_level(logging.DEBUG)
    async with serving(migrated_url, key, slack_api) as (app, server):
        org, worker = await setup(app)
        item_id = await escalated(app, org, worker, "s1")
        click = approve_click(slack_api, item_id, "form")
        click["actions"][0]["action_id"] = "reject"
        assert (await slack_click(server, click))[0] == 200
        await eventually(lambda: [c for c in slack_api.calls if c["method"] == "response_url"])
    [told] = [c for c in slack_api.calls if c["method"] == "response_url"]
    assert "try again" in told["text"]
    [line] = [r for r in caplog.records if "could not open the reject modal" in r.getMessage()]
    assert "HTTP 200 invalid_arguments" in line.getMessage(), line.getMessage()
    # (what the view sent holds, and Slack quoted)
    assert leaking(caplog.records, "private_metadata") == []
