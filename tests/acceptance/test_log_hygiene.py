"""Secrets and message text stay out of the log, and secrets out of the database, in the
real ``leadgate serve`` process at ``[log] level = "DEBUG"``.

One service per configuration drives every surface once, with a distinctive marker in
every secret (API keys, the console password and session cookie, the Slack signing
secret and bot token, a Slack click's response_url, the Discord bot token and interaction
token, the model provider's key, a model gateway's password in its base_url, the metrics
token, the outbound SMTP relay's password, which its stand-in asks for with ``AUTH``,
the Teams app password, which the SDK trades for a token at
:mod:`tests.standins.microsoft_login`) and in every piece of message text (REST
plain, streamed and gated; an MCP tool call; Slack, Discord, Teams and email messages; a
model's answer and a provider's error; a reviewer's reason and feedback). Then
everything the process wrote is searched for the markers, and every text column of
every table of ``leadgate.database.schema`` for the secret ones. With ``include_content = true`` the
libraries' DEBUG payload lines show message text: the check can see what it looks for.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import pytest
import sqlalchemy as sa

from leadgate.database import schema as t
from tests.acceptance.channel_kit import (
    FAST_RUNNERS,
    MAIL_PLAIN,
    SLACK_WORK,
    Operator,
    Standin,
    admin_batch,
    channel_template,
    get_json,
    http,
    prepared_service,
    standins,
    wait_until,
)
from tests.acceptance.test_channels_discord import (
    SIGNING_KEY,
    ask_payload,
    gateway_message,
    post_interaction,
    snowflake,
)
from tests.acceptance.test_channels_discord import ops as discord_ops
from tests.acceptance.test_channels_email import mail, replies_to
from tests.acceptance.test_channels_email import send as send_mail
from tests.acceptance.test_channels_slack import event_body, new_ts, signed, thread_posts
from tests.acceptance.test_channels_teams import new_conversation, sent_to
from tests.acceptance.test_channels_teams import post as post_teams
from tests.acceptance.test_mcp import mcp_session, only_text
from tests.acceptance.test_mcp import send as mcp_send
from tests.acceptance.test_review_chat import (
    REVIEW_SLACK,
    TEAM,
    calls,
    interaction,
    slack_card,
    slack_post,
    submit,
)
from tests.service_proc import DemoTemplate, ServiceProcess, free_port

RUN = uuid.uuid4().hex[:10]


def marker(name: str) -> str:
    """A string nothing but this test writes: ``zq<name><run>``."""
    return f"zq{name}{RUN}"


# Secrets the configuration and the clients hold.
SLACK_SECRET = marker("slacksigning")
SLACK_TOKEN = f"xoxb-{marker('slackbot')}"
DISCORD_TOKEN = marker("discordbot")
INTERACTION_TOKEN = marker("interaction")
RESPONSE_URL = marker("responseurl")  # the path of a Slack click's response_url
#: response_urls the service cannot post to (a port out of range, a scheme not HTTP):
#: the library's error quotes the URL it was given.
BAD_RESPONSE_URLS = (
    f"http://127.0.0.1:99999/{marker('badport')}",
    f"ftp://127.0.0.1/{marker('badscheme')}",
)
MODEL_KEY = f"sk-{marker('modelkey')}"
GATEWAY_PASSWORD = marker("gatewaypassword")  # a model's base_url with a user and password
METRICS_TOKEN = marker("metricstoken")
TEAMS_APP_ID = "00000000-0000-0000-0000-00000000a11d"
TEAMS_PASSWORD = marker("teamspassword")  # traded for a token at Microsoft's login stand-in
TEAMS_ACCESS_TOKEN = marker("teamsaccess")  # what the stand-in gives for it
SMTP_USER = "leadgate-relay"
SMTP_PASSWORD = marker("smtppassword")  # the outbound relay's AUTH password
PASSWORD = marker("consolepassword")
WRONG_PASSWORD = marker("wrongpassword")
WRONG_KEY = f"lg.key_0000000000000000.{marker('wrongkey')}"
USER = "ops@leadgate.test"
SLACK_USER = "U0REVIEWER"

#: Message text, one marker per surface and piece.
TEXT = {
    name: marker(name)
    for name in (
        "restplain",
        "reststream",
        "restgated",
        "mcp",
        "slackplain",
        "slackgated",
        "discordask",
        "discordgateway",
        "teams",
        "mailsubject",
        "mailbody",
        "modelquestion",
        "providererror",
        "approveditem",
        "rejecteditem",
        "rejectreason",
        "slackreviewed",
        "slackreason",
        "returneditem",
        "returnfeedback",
    )
}

#: Where a secret is stored in plain text by design: a Discord interaction's token is what
#: edits its deferred answer (valid 15 minutes), so the reply's address carries it.
STORED_BY_DESIGN = {INTERACTION_TOKEN: {"bindings.address", "deliveries.address"}}


@dataclass
class Ran:
    """What one run left behind: its log, its database and the secrets it was given."""

    log: str
    database: Path
    secrets: dict[str, str]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Standin]]:
    """The platforms' stand-ins, shared by both runs."""
    log_dir = tmp_path_factory.mktemp("standins")
    items = {
        "slack": Standin("slack_api", "--token", SLACK_TOKEN, log_dir=log_dir),
        "discord": Standin(
            "discord_api",
            "--token",
            DISCORD_TOKEN,
            "--application-id",
            "1100000000000000001",
            log_dir=log_dir,
        ),
        "teams": Standin("connector", log_dir=log_dir),
        # login.microsoftonline.com and login.botframework.com, behind a CONNECT proxy
        "login": Standin(
            "microsoft_login",
            "--http-port",
            "0",
            "--app-id",
            TEAMS_APP_ID,
            "--app-password",
            TEAMS_PASSWORD,
            "--access-token",
            TEAMS_ACCESS_TOKEN,
            "--ca-file",
            str(log_dir / "microsoft-login-ca.pem"),
            log_dir=log_dir,
        ),
        "smtp": Standin(
            "smtp", "--http-port", "0", "--login", f"{SMTP_USER}:{SMTP_PASSWORD}", log_dir=log_dir
        ),
        # No key required: the gateway model's basic auth (its base_url's user and
        # password) replaces the bearer key.
        "model": Standin("model_server", log_dir=log_dir),
    }
    with standins(*items.values()):
        yield items


def chat(
    proc: ServiceProcess, key: str, model: str, text: str, *, stream: bool = False
) -> tuple[int, bytes]:
    """``POST /v1/chat/completions`` with ``key``, in a session of its own."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": f"s-{uuid.uuid4().hex[:12]}"}
    return http("POST", f"{proc.url}/v1/chat/completions", json_body=body, headers=headers)


def console_login(proc: ServiceProcess, password: str) -> tuple[int, str]:
    """``POST /console/login``; the status and the session cookie's value ("" if none)."""
    request = urllib.request.Request(
        f"{proc.url}/console/login",
        data=json.dumps({"email": USER, "password": password}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            cookie = str(resp.headers["Set-Cookie"])
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    return 200, cookie.split(";", 1)[0].split("=", 1)[1]


def slack_send(proc: ServiceProcess, channel: str, text: str) -> str:
    """A signed Slack message event in a new thread; returns the thread's ts."""
    ts = new_ts()
    body = event_body(channel, text, ts)
    status, _ = http(
        "POST",
        f"{proc.url}/slack/events",
        data=body.encode(),
        headers=signed(body, secret=SLACK_SECRET),
    )
    assert status == 200
    return ts


def drive(proc: ServiceProcess, rig: dict[str, Standin], key: str) -> dict[str, str]:
    """Every surface once, with markers; returns the secrets made while driving."""
    assert proc.demo is not None
    demo_key = proc.demo.key
    # REST: plain, streamed, gated (the script lead approves), the openai model, a
    # provider error quoting the request, a key that does not exist.
    assert chat(proc, key, "plain", TEXT["restplain"])[0] == 200
    status, raw = chat(proc, key, "plain", TEXT["reststream"], stream=True)
    assert status == 200 and raw.rstrip().endswith(b"[DONE]")
    assert chat(proc, key, "worker", f"{TEXT['restgated']} #complete")[0] == 409
    status, raw = chat(proc, key, "gpt", TEXT["modelquestion"])
    assert status == 200 and TEXT["modelquestion"].encode() in raw
    rig["model"].control("push", {"kind": "error", "status": 400, "message": TEXT["providererror"]})
    assert chat(proc, key, "gpt", TEXT["modelquestion"])[0] == 502
    assert chat(proc, key, "gw", TEXT["modelquestion"])[0] == 200
    assert chat(proc, WRONG_KEY, "plain", TEXT["restplain"])[0] == 401

    # MCP: a tool call through the official client.
    async def mcp() -> str:
        async with mcp_session(proc, key) as session:
            return only_text(await mcp_send(session, "plain", TEXT["mcp"]))

    assert TEXT["mcp"] in asyncio.run(mcp())

    # Slack: a plain message and a gated one, signed with the signing secret.
    plain_ts = slack_send(proc, "C0PLAIN", TEXT["slackplain"])
    gated_ts = slack_send(proc, SLACK_WORK, f"{TEXT['slackgated']} #complete")

    # Discord: a slash command with a marker interaction token, and a gateway message.
    wait_until(
        lambda: get_json(f"{rig['discord'].url}/_standin/gateway")["ready"] >= 1,
        what="the service's gateway session",
    )
    payload = ask_payload(snowflake(), TEXT["discordask"], guild_id="800000000000000001")
    payload["token"] = INTERACTION_TOKEN
    assert post_interaction(proc, payload, SIGNING_KEY) == (200, {"type": 5})
    gateway_channel = snowflake()
    gateway_message(rig["discord"], gateway_channel, TEXT["discordgateway"], guild_id="1")

    # Teams with an app id: the activity carries a channel token; the reply, a token the
    # SDK got for the app password. And email.
    conversation = new_conversation()
    channel_token = rig["login"].control("channel_token", {"service_url": rig["teams"].url})
    status, _ = post_teams(
        proc,
        rig["teams"],
        TEXT["teams"],
        conversation=conversation,
        tenant="tenant-other",
        token=channel_token["token"],
    )
    assert status in (200, 202)
    letter: EmailMessage = mail(MAIL_PLAIN, TEXT["mailsubject"], TEXT["mailbody"])
    send_mail(proc, letter)

    # Operator API: an approval, a rejection with a reason, a return with feedback, on
    # items the script lead escalated; the approval through the console's session.
    ids: dict[str, str] = {}
    for name in ("approveditem", "rejecteditem", "returneditem"):
        assert chat(proc, demo_key, "worker", f"{TEXT[name]} #complete #escalate")[0] == 409
    for name in ("approveditem", "rejecteditem", "returneditem"):
        # An Operator skips the items it saw without its marker: one per marker.
        ids[name] = Operator(proc).wait_item(TEXT[name], "awaitingHuman")["id"]
    assert console_login(proc, WRONG_PASSWORD)[0] == 401
    status, cookie = console_login(proc, PASSWORD)
    assert status == 200 and cookie
    status, raw = http(
        "POST",
        f"{proc.url}/operator/reviews/{ids['approveditem']}/approve",
        json_body={},
        headers={"Cookie": f"leadgate_session={cookie}", "X-Leadgate-Console": "1"},
    )
    assert status == 200, raw
    op = Operator(proc)
    op.decide(ids["rejecteditem"], "reject", {"reason": TEXT["rejectreason"]})
    op.decide(ids["returneditem"], "return", {"feedback": TEXT["returnfeedback"]})

    # A Slack review card: a reject click (its response_url a secret), the modal, a reason.
    slack_send(proc, SLACK_WORK, f"{TEXT['slackreviewed']} #complete #escalate")
    card = slack_card(rig["slack"], TEXT["slackreviewed"])
    click = interaction(rig["slack"], card, "reject", SLACK_USER, RESPONSE_URL)
    assert slack_post(proc, click, form=True, secret=SLACK_SECRET)[0] == 200
    [opened] = wait_until(
        lambda: calls(rig["slack"], "views.open", trigger_id=f"trigger-{RESPONSE_URL}"),
        what="the reject modal",
    )
    status, answer = submit(
        proc, opened["view"], SLACK_USER, TEXT["slackreason"], secret=SLACK_SECRET
    )
    assert (status, answer) == (200, None)
    # Clicks by someone not linked, answered through a response_url that cannot be used.
    for url in BAD_RESPONSE_URLS:
        click = interaction(rig["slack"], card, "approve", "U0STRANGER", "stranger")
        payload = json.loads(parse_qs(click)["payload"][0])
        payload["response_url"] = url
        stranger = urlencode({"payload": json.dumps(payload)})
        assert slack_post(proc, stranger, form=True, secret=SLACK_SECRET)[0] == 200

    # /metrics with its token, and with a wrong one.
    assert (
        http("GET", f"{proc.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})[0]
        == 200
    )
    assert (
        http("GET", f"{proc.url}/metrics", headers={"Authorization": f"Bearer {WRONG_KEY}"})[0]
        == 401
    )

    # Everything reached its end: posts, replies, the approved and the revised items.
    Operator(proc).wait_item(TEXT["restgated"], "completed")
    Operator(proc).wait_item(TEXT["slackreviewed"], "rejected")
    op.wait_item(TEXT["approveditem"], "completed")
    wait_until(lambda: thread_posts(rig["slack"], "C0PLAIN", plain_ts), what="the Slack reply")
    wait_until(lambda: thread_posts(rig["slack"], SLACK_WORK, gated_ts), what="the gated post")
    wait_until(
        lambda: discord_ops(rig["discord"], "edit_original", token=INTERACTION_TOKEN),
        what="the Discord edit",
    )
    wait_until(
        lambda: discord_ops(rig["discord"], "create_message", channel_id=gateway_channel),
        what="the Discord reply",
    )
    [reply] = wait_until(lambda: sent_to(rig["teams"], conversation), what="the Teams reply")
    assert reply["authorization"] == f"Bearer {TEAMS_ACCESS_TOKEN}"
    assert {"client_id": TEAMS_APP_ID, "ok": True} in rig["login"].records("grants")
    wait_until(lambda: replies_to(rig["smtp"], str(letter["Message-ID"])), what="the mail reply")
    # (the relay took the reply only after AUTH with the password)
    assert [a for a in rig["smtp"].records("auths") if a["user"] == SMTP_USER and a["ok"]]
    wait_until(
        lambda: (
            (d := op.detail(ids["returneditem"]))["revision"] == 1
            and d["status"] == "awaitingHuman"
        ),
        what="the revision",
    )
    # The secret part of a key: its id (``lg.<id>.``) is no secret.
    return {"the demo key": demo_key.rsplit(".", 1)[1], "the console session": cookie}


def run_service(
    include_content: bool,
    demo_template: DemoTemplate,
    workdir: Path,
    rig: dict[str, Standin],
) -> Ran:
    """A service at DEBUG, driven once and stopped (exit 0)."""
    for name in ("slack", "discord", "model"):  # the other run's records, its cards
        rig[name].control("reset")
    template = channel_template(demo_template, lambda: workdir / "routes")
    proc = prepared_service(
        template,
        workdir / "svc",
        # The Bot Framework SDK reaches Microsoft's login services through requests:
        # here, the stand-in's proxy and CA (the stand-ins on 127.0.0.1 go direct).
        env={
            "HTTPS_PROXY": rig["login"].url,
            "REQUESTS_CA_BUNDLE": str(rig["login"].log_path.parent / "microsoft-login-ca.pem"),
            "NO_PROXY": "127.0.0.1,localhost",
        },
        config={
            **FAST_RUNNERS,
            "log": {"level": "DEBUG", "include_content": include_content},
            "server": {"metrics_token": METRICS_TOKEN},
            "models": {
                "standin": {
                    "provider": "openai",
                    "base_url": f"{rig['model'].url}/v1",
                    "api_key": MODEL_KEY,
                    "model": "m",
                },
                "gateway": {
                    "provider": "openai",
                    "base_url": f"http://gw:{GATEWAY_PASSWORD}@127.0.0.1:{rig['model'].port}/v1",
                    "model": "m",
                },
            },
            "slack": {
                "signing_secret": SLACK_SECRET,
                "bot_token": SLACK_TOKEN,
                "api_url": f"{rig['slack'].url}/api/",
            },
            "discord": {
                "public_key": SIGNING_KEY.verify_key.encode().hex(),
                "bot_token": DISCORD_TOKEN,
                "application_id": "1100000000000000001",
                "api_url": f"{rig['discord'].url}/api/v10",
                "gateway_url": f"ws://127.0.0.1:{rig['discord'].port}/gateway",
            },
            "teams": {"app_id": TEAMS_APP_ID, "app_password": TEAMS_PASSWORD},
            "email": {
                "listen_host": "127.0.0.1",
                "listen_port": free_port(),
                "smtp_host": "127.0.0.1",
                "smtp_port": rig["smtp"].port,
                "smtp_username": SMTP_USER,
                "smtp_password": SMTP_PASSWORD,
            },
        },
    )
    *_, made_key = admin_batch(
        proc,
        [
            [
                "user",
                "create",
                "--org",
                "demo",
                "--email",
                USER,
                "--role",
                "admin",
                "--password",
                PASSWORD,
            ],
            ["agent", "create", "--org", "demo", "--name", "gpt", "--model", "standin"],
            ["agent", "create", "--org", "demo", "--name", "gw", "--model", "gateway"],
            ["user", "link", "--org", "demo", "--email", USER, "--slack", f"{TEAM}:{SLACK_USER}"],
            [
                "notify",
                "add",
                "--org",
                "demo",
                "--channel",
                "slack",
                "--to",
                f"{TEAM}:{REVIEW_SLACK}",
            ],
            ["key", "create", "--org", "demo", "--scope", "agent:trigger"],
        ],
    )
    cli_key = str(made_key["apiKey"])
    proc.start()
    try:
        made = drive(proc, rig, cli_key)
    except BaseException:
        print(proc.log_tail(150))
        raise
    finally:
        proc.stop()
    assert proc.sqlite_file is not None
    secrets = {
        "the Slack signing secret": SLACK_SECRET,
        "the Slack bot token": SLACK_TOKEN,
        "the Discord bot token": DISCORD_TOKEN,
        "the Discord interaction token": INTERACTION_TOKEN,
        "a Slack click's response_url": RESPONSE_URL,
        **{f"a response_url: {url}": url.rsplit("/", 1)[1] for url in BAD_RESPONSE_URLS},
        "the model provider's key": MODEL_KEY,
        "a model gateway's password": GATEWAY_PASSWORD,
        "the metrics token": METRICS_TOKEN,
        "the SMTP relay's password": SMTP_PASSWORD,
        "the Teams app password": TEAMS_PASSWORD,
        "the console password": PASSWORD,
        "a wrong console password": WRONG_PASSWORD,
        "a wrong API key": WRONG_KEY.rsplit(".", 1)[1],
        "the key from `leadgate key create`": cli_key.rsplit(".", 1)[1],
        **made,
    }
    return Ran(proc.log_text(), proc.sqlite_file, secrets)


@pytest.fixture(scope="module")
def quiet(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, rig: dict[str, Standin]
) -> Ran:
    """The run with ``include_content = false`` (the default)."""
    return run_service(False, demo_template, tmp_path_factory.mktemp("quiet"), rig)


@pytest.fixture(scope="module")
def loud(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, rig: dict[str, Standin]
) -> Ran:
    """The run with ``include_content = true``."""
    return run_service(True, demo_template, tmp_path_factory.mktemp("loud"), rig)


def found_in(text: str, markers: dict[str, str]) -> list[str]:
    return [name for name, value in markers.items() if value in text]


def test_the_log_holds_no_secret_and_no_message_text(quiet: Ran) -> None:
    assert found_in(quiet.log, quiet.secrets) == []
    assert found_in(quiet.log, TEXT) == []
    assert "Traceback" not in quiet.log


def text_columns(database: Path) -> dict[str, str]:
    """Every text, JSON or binary column of every table of the schema: ``table.column``
    and every row's value of it, as text, one after the other."""
    engine = sa.create_engine(f"sqlite:///{database}")
    found: dict[str, str] = {}
    try:
        with engine.connect() as conn:
            for table in t.metadata.sorted_tables:
                for column in table.columns:
                    if isinstance(column.type, sa.String | sa.LargeBinary | sa.JSON):
                        values = conn.scalars(sa.select(sa.cast(column, sa.Text)))
                        found[f"{table.name}.{column.name}"] = "\n".join(v or "" for v in values)
    finally:
        engine.dispose()
    return found


def test_the_database_holds_no_secret_in_plain_text(quiet: Ran) -> None:
    # Every table is searched: none the migrations made is missing from the schema.
    with sqlite3.connect(quiet.database) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables - set(t.metadata.tables) <= {"alembic_version", "sqlite_sequence"}
    columns = text_columns(quiet.database)

    def stored(value: str) -> set[str]:
        return {place for place, text in columns.items() if value in text}

    for name, value in quiet.secrets.items():
        assert stored(value) <= STORED_BY_DESIGN.get(value, set()), name
    # Message text is stored (the transcript, the task context, the decisions' texts):
    # the search finds what is there.
    assert {"messages.content", "audit.text"} <= stored(TEXT["rejectreason"]) | stored(TEXT["mcp"])


def test_with_include_content_message_text_reaches_the_log(loud: Ran) -> None:
    """The libraries' DEBUG lines, let through: request and response payloads."""
    assert "[debug" in loud.log
    shown = found_in(loud.log, TEXT)
    # The MCP transport's SSE chunks, slack_sdk's and discord.py's request bodies,
    # aiosmtpd's DATA lines. (REST, Teams and the model provider's text do not show even
    # so: their libraries log no payloads.)
    assert {"mcp", "slackplain", "slackgated", "discordgateway", "mailbody"} <= set(shown), shown
    # And the tokens in the URLs they call (a Discord interaction's webhook, a Slack
    # click's response_url); never a key, a password, a bot token or a signing secret.
    in_urls = {"the Discord interaction token", "a Slack click's response_url"}
    in_urls |= {f"a response_url: {url}" for url in BAD_RESPONSE_URLS}
    assert set(found_in(loud.log, loud.secrets)) <= in_urls
    assert "Traceback" not in loud.log
