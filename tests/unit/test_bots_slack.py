"""Slack inbound: real Bolt behind a real aiohttp server, requests signed for real."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bots import base as bots_base
from bots import slack, slack_review
from leadgate.core.config import Settings, SlackSettings
from leadgate.core.types import BindingKind, Conversations, RouteMatch
from tests.fakes import FakeCore, mount_adapter
from tests.standins.slack_api import signed_headers

SECRET = "slack-signing-secret"
TEAM = "T0001"
CHANNEL = "C0001"


ROUTE = RouteMatch(route_id="r1", org_id="o1", agent_id="a1", silent=False)


@pytest.fixture
def core() -> FakeCore:
    return FakeCore(routes=[({"team": TEAM}, ROUTE)])


@pytest.fixture
async def server(core: FakeCore) -> AsyncIterator[TestServer]:
    settings = Settings(slack=SlackSettings(signing_secret=SECRET, bot_token="xoxb-x"))
    adapter = slack.create(settings, core)
    assert adapter is not None
    app = web.Application()
    mount_adapter(app, adapter)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    yield srv
    await srv.close()


def event_body(event: dict[str, Any], *, event_id: str = "Ev1") -> str:
    return json.dumps(
        {
            "token": "legacy",
            "team_id": TEAM,
            "api_app_id": "A1",
            "type": "event_callback",
            "event_id": event_id,
            "event_time": int(time.time()),
            "event": event,
        }
    )


def message(
    text: str = "hello there", ts: str = "1700000000.000100", **extra: Any
) -> dict[str, Any]:
    return {
        "type": "message",
        "channel": CHANNEL,
        "user": "U1",
        "text": text,
        "ts": ts,
        "channel_type": "channel",
        **extra,
    }


async def post(
    srv: TestServer, body: str, *, secret: str = SECRET, retry_num: int | None = None
) -> tuple[int, str]:
    headers = signed_headers(secret, body, retry_num=retry_num)
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.make_url("/slack/events"), data=body, headers=headers) as r:
            return r.status, await r.text()


def test_off_without_signing_secret() -> None:
    assert slack.create(Settings(), FakeCore()) is None


async def test_url_verification(server: TestServer, core: FakeCore) -> None:
    body = json.dumps({"token": "t", "challenge": "c-123", "type": "url_verification"})
    status, text = await post(server, body)
    assert status == 200
    assert json.loads(text) == {"challenge": "c-123"}
    assert core.tasks == []


async def test_message_becomes_one_trigger(server: TestServer, core: FakeCore) -> None:
    status, _ = await post(server, event_body(message("hello there")))
    assert status == 200
    await core.drain()
    assert core.lookups == [("slack", {"team": TEAM, "channel": CHANNEL})]
    [trigger] = core.triggers
    assert trigger.org_id == "o1" and trigger.agent_id == "a1"
    assert trigger.text == "hello there"
    assert trigger.session_key == f"slack:{TEAM}:{CHANNEL}:1700000000.000100"
    assert trigger.external_event_id == f"slack:{TEAM}:{CHANNEL}:1700000000.000100"
    assert trigger.binding.kind is BindingKind.slack
    assert trigger.binding.address == {
        "team": TEAM,
        "channel": CHANNEL,
        "thread_ts": "1700000000.000100",
    }
    assert trigger.binding.silent is False
    assert trigger.binding.route_id == "r1"
    assert trigger.internal is False


async def test_thread_reply_joins_the_thread_session(server: TestServer, core: FakeCore) -> None:
    event = message("more", ts="1700000000.000200", thread_ts="1700000000.000100")
    await post(server, event_body(event))
    await core.drain()
    [trigger] = core.triggers
    assert trigger.session_key == f"slack:{TEAM}:{CHANNEL}:1700000000.000100"
    assert trigger.binding.address["thread_ts"] == "1700000000.000100"
    # The message's own ts identifies the event, not the thread's.
    assert trigger.external_event_id == f"slack:{TEAM}:{CHANNEL}:1700000000.000200"


async def test_retry_and_mention_pair_share_the_event_id(
    server: TestServer, core: FakeCore
) -> None:
    ts = "1700000000.000300"
    await post(server, event_body(message("<@UBOT> do it", ts=ts), event_id="Ev1"))
    await post(server, event_body(message("<@UBOT> do it", ts=ts), event_id="Ev1"), retry_num=1)
    mention = {"type": "app_mention", "channel": CHANNEL, "user": "U1", "text": "<@UBOT> do it"}
    await post(server, event_body({**mention, "ts": ts}, event_id="Ev2"))
    await core.drain()
    assert len(core.triggers) == 3
    assert {t.external_event_id for t in core.triggers} == {f"slack:{TEAM}:{CHANNEL}:{ts}"}
    # The leading bot mention is addressing, not content.
    assert {t.text for t in core.triggers} == {"do it"}


async def test_bad_signature_is_401_and_runs_nothing(server: TestServer, core: FakeCore) -> None:
    """A forged, stale or unsigned request is 401 in the error envelope naming
    ``slack.signature`` (it was a bare ``{"error": "invalid request"}``)."""
    status, text = await post(server, event_body(message()), secret="wrong-secret")
    assert status == 401
    assert json.loads(text)["error"]["rule"] == "slack.signature"
    body = event_body(message())
    headers = signed_headers(SECRET, body, timestamp=int(time.time()) - 3600)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/slack/events"), data=body, headers=headers) as r:
            assert r.status == 401
            assert (await r.json())["error"]["rule"] == "slack.signature"
        async with session.post(server.make_url("/slack/events"), data=body) as r:
            assert r.status == 401
            assert (await r.json())["error"]["rule"] == "slack.signature"
    assert core.tasks == [] and core.triggers == []


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        # json.dumps writes the lone surrogate as the escape \ud800, as a client would.
        (event_body(message("half a pair: \ud800")), "body.surrogate"),
        (event_body(message(nested=json.loads("[" * 70 + "]" * 70))), "body.depth"),
    ],
    ids=["lone-surrogate-escape", "too-deep"],
)
async def test_signed_bodies_are_checked_before_bolt_reads_them(
    server: TestServer, core: FakeCore, body: str, rule: str
) -> None:
    status, text = await post(server, body)
    assert status == 400 and json.loads(text)["error"]["rule"] == rule
    await core.drain()
    assert core.tasks == [] and core.triggers == [] and core.lookups == []


@pytest.mark.parametrize(
    "event",
    [
        message(bot_id="B1"),
        message(subtype="bot_message", bot_id="B1", username="other-bot"),
        message(subtype="message_changed"),
        message(subtype="message_deleted"),
        message(subtype="channel_join"),
        message(text=""),
        message(text="<@UBOT>"),
        {k: v for k, v in message().items() if k != "text"},
    ],
    ids=["bot_id", "bot_message", "changed", "deleted", "join", "empty", "mention-only", "no-text"],
)
async def test_ignored_messages(server: TestServer, core: FakeCore, event: dict[str, Any]) -> None:
    status, _ = await post(server, event_body(event))
    assert status == 200
    await core.drain()
    assert core.triggers == [] and core.lookups == []


async def test_no_route_runs_no_turn(server: TestServer, core: FakeCore) -> None:
    core.routes = []
    status, _ = await post(server, event_body(message()))
    assert status == 200
    await core.drain()
    assert core.lookups == [("slack", {"team": TEAM, "channel": CHANNEL})]
    assert core.triggers == []


async def test_silent_route_makes_a_silent_binding(server: TestServer, core: FakeCore) -> None:
    core.routes = [({"channel": CHANNEL}, RouteMatch("r9", "o1", "a1", silent=True))]
    await post(server, event_body(message()))
    await core.drain()
    [trigger] = core.triggers
    assert trigger.binding.silent is True and trigger.binding.route_id == "r9"


async def test_other_events_are_acknowledged(server: TestServer, core: FakeCore) -> None:
    event = {"type": "reaction_added", "user": "U1", "reaction": "+1", "event_ts": "1.1"}
    status, _ = await post(server, event_body(event))
    # 200, not Bolt's 404 for unhandled requests, or Slack would retry it.
    assert status == 200
    assert core.tasks == []


async def test_ack_does_not_wait_for_the_turn(server: TestServer, core: FakeCore) -> None:
    core.submit_delay_s = 2.0
    started = time.monotonic()
    status, _ = await post(server, event_body(message()))
    assert status == 200
    assert time.monotonic() - started < 1.0
    for task in core.tasks:
        task.cancel()
    await asyncio.gather(*core.tasks, return_exceptions=True)


def test_parse_event_prefers_body_team() -> None:
    post = slack.parse_event({"team_id": "T9"}, message("hi", team="T_OTHER"))
    assert post is not None and post.team == "T9"
    assert slack.parse_event({}, message("hi")) is None


def interactive(payload: dict[str, Any]) -> str:
    return "payload=" + urllib.parse.quote(json.dumps(payload))


@pytest.mark.parametrize(
    "payload",
    [
        {"type": "block_actions", "team": {"id": TEAM}, "user": {"id": "U1"}, "actions": []},
        {"type": "block_actions", "team": {"id": TEAM}, "actions": ["approve"]},
        {"type": "block_actions", "team": {"id": TEAM}, "actions": {"action_id": "approve"}},
        {"type": "view_submission", "team": {"id": TEAM}, "view": {"callback_id": "lg_reject"}},
        {"type": "view_submission", "team": {"id": TEAM}, "view": "lg_reject"},
    ],
    ids=["no-actions", "action-string", "actions-object", "view-without-type", "view-string"],
)
async def test_signed_clicks_of_a_shape_slack_never_sends_are_400(
    server: TestServer, core: FakeCore, payload: dict[str, Any]
) -> None:
    # Bolt indexes the first action and reads the view's type before any listener runs:
    # these were 500s with a traceback.
    body = interactive(payload)
    headers = {
        **signed_headers(SECRET, body),
        "Content-Type": "application/x-www-form-urlencoded",
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/slack/events"), data=body, headers=headers) as r:
            status, text = r.status, await r.text()
    assert status == 400 and json.loads(text)["error"]["rule"] == "slack.shape"


@pytest.mark.parametrize(
    ("body", "identity"),
    [
        ({"user": "U1", "team": {"id": TEAM}}, f"{TEAM}:"),
        ({"user": {"id": ["U1"], "team_id": 5}, "team": "x"}, ":"),
        ({"user": {"id": "U1", "team_id": TEAM}}, f"{TEAM}:U1"),
    ],
)
def test_a_clickers_identity_reads_odd_types_as_absent(body: dict[str, Any], identity: str) -> None:
    assert slack_review.identity_of(body) == identity


def test_catch_up_targets_are_the_channels_of_sessions_and_routes() -> None:
    known = Conversations(
        0,
        {
            # Two threads of one channel: the newest ts taken in lately is the channel's.
            "slack:T1:C1:100.000001": ("slack:T1:C1:100.000001", "slack:T1:C1:300.000001"),
            "slack:T1:C1:200.000001": ("slack:T1:C1:200.000001",),
            # Nothing taken in lately: read from the window's start, and its threads in
            # the slots the threads that moved leave, started last first.
            "slack:T1:C2:50.000001": (),
            "slack:T1:C2:60.000001": (),
            # Not a session key of the live path's shape.
            "slack:T1:C3": ("slack:T1:C3:1.0",),
        },
        ({"team": "T1", "channel": "C1"}, {"channel": "C4"}, {"team": "T2"}),
    )
    targets = slack.catch_up_targets(known, "T0")
    assert sorted(targets, key=lambda t: t.channel) == [
        slack.CatchUpTarget(
            "T1",
            "C1",
            Decimal("300.000001"),
            # Each thread with the newest taken in there.
            (("100.000001", Decimal("300.000001")), ("200.000001", Decimal("200.000001"))),
        ),
        slack.CatchUpTarget("T1", "C2", None, (), quiet=("60.000001", "50.000001")),
        # A route naming no workspace: the bot's own.
        slack.CatchUpTarget("T0", "C4", None, ()),
    ]


def test_a_catch_up_reads_from_a_channel_s_read_point_and_a_retry_never_from_its_newest() -> None:
    """A channel whose point is not read through starts there; one without, from the
    newest taken in there less a minute, but not on a retry after a database fault: a
    live message taken in since the first try may be that newest, and those missed
    before it were skipped. One read through starts from the later of the two."""
    known = Conversations(
        100_000,
        {
            "slack:T1:C1:100.000001": ("slack:T1:C1:900.000001",),
            "slack:T1:C2:100.000001": ("slack:T1:C2:950.000001",),
            "slack:T1:C3:100.000001": ("slack:T1:C3:950.000001",),
        },
        (),
        2_000_000,
        {"T1:C1": 500_000, "T1:C3": 500_000},
        frozenset({"T1:C3"}),
    )
    targets = sorted(slack.catch_up_targets(known, "T0"), key=lambda t: t.channel)
    pointed, fresh, through = targets
    assert (pointed.point, pointed.conversation, fresh.point) == (500_000, "T1:C1", None)
    assert (pointed.read_through, through.read_through) == (False, True)
    assert pointed.start_point(known.since_ms) == 500_000
    assert fresh.start_point(known.since_ms) == 950_000 - bots_base.CATCH_UP_OVERLAP_MS
    assert fresh.start_point(950_000) == 950_000  # never before the window
    assert through.start_point(known.since_ms) == 950_000 - bots_base.CATCH_UP_OVERLAP_MS
    again = sorted(slack.catch_up_targets(known, "T0", again=True), key=lambda t: t.channel)
    assert [t.newest for t in again] == [None, None, None]
    assert [t.start_point(known.since_ms) for t in again] == [500_000, known.since_ms, 500_000]


async def test_a_catch_up_is_told_it_is_a_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bots_base, "CATCH_UP_RETRY_FIRST_S", 0.001)
    tries: list[bool] = []

    async def catch_up(again: bool) -> bool:
        tries.append(again)
        return len(tries) == 3  # stopped by a database fault twice

    await bots_base.catch_up_until_done(catch_up, asyncio.Event(), channel="slack")
    assert tries == [False, True, True]


def test_a_ts_is_read_as_slack_writes_it() -> None:
    assert slack.ts_at(1_780_000_000_123) == "1780000000.123000"
    assert slack._mentions("hi <@U1|bot> there", "U1") and slack._mentions("<@U1>", "U1")
    assert not slack._mentions("<@U12>", "U1") and not slack._mentions(None, "U1")
