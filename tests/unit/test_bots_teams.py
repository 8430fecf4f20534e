"""Inbound half of the Teams adapter: real aiohttp app, real botbuilder SDK, fake core."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from aiohttp import web
from yarl import URL

from bots.teams import TeamsAdapter, create, sdk_config
from leadgate.core.config import Settings, TeamsSettings
from leadgate.core.errors import ConfigError
from leadgate.core.types import BindingKind, RouteMatch
from tests.fakes import FakeCore, mount_adapter
from tests.standins.botframework_keys import BotFrameworkKeys, rsa_key
from tests.standins.connector import message_activity, post_activity

APP_ID = "11111111-2222-3333-4444-555555555555"
SERVICE_URL = "http://127.0.0.1:9/teams/"

RouteFn = Callable[[str, Mapping[str, str]], RouteMatch | None]


def _route_all(channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
    return RouteMatch(route_id="route-1", org_id="org-1", agent_id="agent-1", silent=False)


class Server:
    def __init__(self, adapter: TeamsAdapter, core: FakeCore, url: str) -> None:
        self.adapter = adapter
        self.core = core
        self.url = url


async def _serve(adapter: TeamsAdapter, core: FakeCore) -> AsyncIterator[Server]:
    app = web.Application()
    mount_adapter(app, adapter)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        yield Server(adapter, core, f"http://127.0.0.1:{port}/api/messages")
    finally:
        await runner.cleanup()


@pytest.fixture
async def open_bot() -> AsyncIterator[Server]:
    """No-auth mode (empty app id and password)."""
    core = FakeCore(_route_all)
    async for server in _serve(TeamsAdapter(TeamsSettings(enabled=True), core), core):
        yield server


@pytest.fixture
async def secured_bot() -> AsyncIterator[Server]:
    """App id configured: Bot Framework JWTs required."""
    core = FakeCore(_route_all)
    settings = TeamsSettings(app_id=APP_ID, app_password="secret")
    async for server in _serve(TeamsAdapter(settings, core, auth_timeout_s=0.3), core):
        yield server


class DnsGuard:
    """Records host names looked up; fails every non-loopback look-up at once."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.hosts: list[str] = []
        self.delay_s = delay_s


@pytest.fixture
def dns_guard(monkeypatch: pytest.MonkeyPatch) -> DnsGuard:
    guard = DnsGuard()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in ("127.0.0.1", "localhost", "::1", None):
            guard.hosts.append(str(host))
            time.sleep(guard.delay_s)
            raise socket.gaierror(socket.EAI_NONAME, "blocked by the test: no internet")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return guard


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


# A well-formed, unsigned JWT whose issuer is one the SDK trusts: validating it needs the
# Bot Framework signing keys, which the SDK fetches from login.botframework.com.
FORGED_JWT = (
    _b64({"alg": "RS256", "typ": "JWT", "kid": "k1"})
    + "."
    + _b64({"iss": "https://api.botframework.com", "aud": APP_ID, "serviceurl": SERVICE_URL})
    + ".c2lnbmF0dXJl"
)


async def test_message_becomes_one_trigger(open_bot: Server) -> None:
    activity = message_activity(
        service_url=SERVICE_URL,
        text="please summarise the report",
        activity_id="1700000000001",
        conversation_id="19:abc@thread.tacv2;messageid=1700000000001",
        tenant_id="tenant-9",
        mention_bot=True,
    )
    status, _ = await post_activity(open_bot.url, activity)
    assert status == 202
    await open_bot.core.drain()

    assert open_bot.core.lookups == [
        (
            "teams",
            {"tenant": "tenant-9", "conversation": "19:abc@thread.tacv2;messageid=1700000000001"},
        )
    ]
    [trigger] = open_bot.core.triggers
    assert trigger.org_id == "org-1" and trigger.agent_id == "agent-1"
    assert trigger.text == "please summarise the report"
    assert trigger.session_key == "teams:tenant-9:19:abc@thread.tacv2;messageid=1700000000001"
    assert (
        trigger.external_event_id
        == "teams:tenant-9:19:abc@thread.tacv2;messageid=1700000000001:1700000000001"
    )
    assert trigger.binding.kind is BindingKind.teams
    assert trigger.binding.route_id == "route-1" and trigger.binding.silent is False
    address = trigger.binding.address
    assert address["activity_id"] == "1700000000001"
    reference = address["reference"]
    assert reference["activityId"] == "1700000000001"
    assert reference["serviceUrl"] == SERVICE_URL
    assert reference["channelId"] == "msteams"
    assert reference["conversation"]["id"] == "19:abc@thread.tacv2;messageid=1700000000001"
    assert reference["bot"]["id"] == "28:leadgate-bot"
    assert reference["user"]["id"] == "29:user-1"
    json.dumps(address)  # JSON-able as stored on the binding


async def test_a_message_id_is_one_message_only_within_its_conversation(open_bot: Server) -> None:
    # Teams message ids are millisecond timestamps: two conversations (or tenants) posting
    # in the same millisecond send the same id, and a retry sends its own id again.
    same_id = "1700000000123"
    for tenant, conversation in [("t-1", "19:a@thread"), ("t-2", "19:a@thread"), ("t-1", "19:b")]:
        activity = message_activity(
            service_url=SERVICE_URL,
            text="hi",
            activity_id=same_id,
            tenant_id=tenant,
            conversation_id=conversation,
        )
        assert (await post_activity(open_bot.url, activity))[0] == 202
    retry = message_activity(
        service_url=SERVICE_URL,
        text="hi",
        activity_id=same_id,
        tenant_id="t-1",
        conversation_id="19:a@thread",
    )
    assert (await post_activity(open_bot.url, retry))[0] == 202
    await open_bot.core.drain()
    ids = [t.external_event_id for t in open_bot.core.triggers]
    assert len(ids) == 4 and len(set(ids)) == 3 and ids[0] == ids[3]


async def test_long_conversation_ids_give_bounded_keys(open_bot: Server) -> None:
    conversation = "19:" + "x" * 1000 + "@thread.tacv2"
    for conv in (conversation, conversation + "y"):
        activity = message_activity(service_url=SERVICE_URL, text="hi", conversation_id=conv)
        assert (await post_activity(open_bot.url, activity))[0] == 202
    await open_bot.core.drain()
    first, second = open_bot.core.triggers
    assert first.external_event_id is not None
    assert len(first.session_key) <= 500 and len(first.external_event_id) <= 300
    assert first.session_key != second.session_key


async def test_only_the_bots_own_mention_is_stripped(open_bot: Server) -> None:
    activity = message_activity(
        service_url=SERVICE_URL, text="ask <at>Bob (QA)</at> about it", mention_bot=True
    )
    activity["entities"].append(
        {
            "type": "mention",
            "mentioned": {"id": "29:bob", "name": "Bob (QA)"},
            "text": "<at>Bob (QA)</at>",
        }
    )
    assert (await post_activity(open_bot.url, activity))[0] == 202
    await open_bot.core.drain()
    assert [t.text for t in open_bot.core.triggers] == ["ask Bob (QA) about it"]


async def test_bot_name_with_regex_characters(open_bot: Server) -> None:
    activity = message_activity(
        service_url=SERVICE_URL, text="hi there", bot_name="Lead+Gate (beta)*", mention_bot=True
    )
    assert (await post_activity(open_bot.url, activity))[0] == 202
    await open_bot.core.drain()
    assert [t.text for t in open_bot.core.triggers] == ["hi there"]


async def test_unrouted_conversation_runs_no_turn() -> None:
    core = FakeCore(routes=lambda channel, attrs: None)
    async for server in _serve(TeamsAdapter(TeamsSettings(enabled=True), core), core):
        status, _ = await post_activity(
            server.url, message_activity(service_url=SERVICE_URL, text="hi")
        )
        assert status == 202
        await core.drain()
        assert len(core.route_queries) == 1
        assert core.triggers == []


async def test_silent_route_gives_a_silent_binding() -> None:
    core = FakeCore(routes=lambda c, a: RouteMatch("route-s", "org-1", "agent-1", silent=True))
    async for server in _serve(TeamsAdapter(TeamsSettings(enabled=True), core), core):
        await post_activity(server.url, message_activity(service_url=SERVICE_URL, text="hi"))
        await core.drain()
        [trigger] = core.triggers
        assert trigger.binding.silent is True and trigger.binding.route_id == "route-s"


async def test_ack_does_not_wait_for_the_turn(open_bot: Server) -> None:
    open_bot.core.gate.clear()  # the turn never finishes until released
    started = time.monotonic()
    status, _ = await post_activity(
        open_bot.url, message_activity(service_url=SERVICE_URL, text="x")
    )
    assert status == 202
    assert time.monotonic() - started < 1.0
    open_bot.core.gate.set()
    await open_bot.core.drain()
    assert len(open_bot.core.triggers) == 1


async def test_non_message_activities_and_empty_text_run_no_turn(open_bot: Server) -> None:
    update = message_activity(service_url=SERVICE_URL, text="")
    update["type"] = "conversationUpdate"
    assert (await post_activity(open_bot.url, update))[0] == 202
    only_mention = message_activity(service_url=SERVICE_URL, text="", mention_bot=True)
    assert (await post_activity(open_bot.url, only_mention))[0] == 202
    await open_bot.core.drain()
    assert open_bot.core.lookups == [] and open_bot.core.triggers == []


async def test_an_invoke_no_handler_takes_is_400_not_501(open_bot: Server) -> None:
    for name in ("composeExtension/query", None):
        invoke = message_activity(service_url=SERVICE_URL, text="")
        invoke["type"] = "invoke"
        invoke.pop("text", None)
        if name is not None:
            invoke["name"] = name
        status, body = await post_activity(open_bot.url, invoke)
        assert status == 400, (name, body)
        assert json.loads(body)["error"]["rule"] == "teams.invoke"
    await open_bot.core.drain()
    assert open_bot.core.triggers == []


async def test_malformed_requests(open_bot: Server) -> None:
    """Each refusal is in the error envelope naming its rule (they were bare text)."""
    from aiohttp import ClientSession

    async with ClientSession() as session:
        async with session.post(
            open_bot.url, data="hello", headers={"Content-Type": "text/plain"}
        ) as r:
            assert r.status == 415
            assert (await r.json())["error"]["rule"] == "teams.content_type"
        async with session.post(
            open_bot.url, data="{", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["rule"] == "body.json"
        for activity in ({"text": "no type"}, {"type": ""}):
            async with session.post(open_bot.url, json=activity) as r:
                assert r.status == 400, activity
                assert (await r.json())["error"]["rule"] == "teams.activity", activity
    assert open_bot.core.triggers == []


def _reshaped(**fields: Any) -> dict[str, Any]:
    """A message activity with ``fields`` replaced (``None``: left out)."""
    activity = message_activity(service_url=SERVICE_URL, text="hello")
    for key, value in fields.items():
        if value is None:
            activity.pop(key)
        else:
            activity[key] = value
    return activity


@pytest.mark.parametrize(
    "activity",
    [
        {"type": 7},
        _reshaped(type=7),
        _reshaped(type=["message"]),
        _reshaped(text=5),
        _reshaped(id=12),
        _reshaped(serviceUrl=None),
        _reshaped(serviceUrl=7),
        _reshaped(serviceUrl="ftp://127.0.0.1/"),
        _reshaped(serviceUrl="not a url"),
        _reshaped(channelId=None),
        _reshaped(channelId=["msteams"]),
        _reshaped(**{"from": None}),
        _reshaped(**{"from": {"id": 29}}),
        _reshaped(conversation=None),
        _reshaped(conversation={"id": 7}),
        _reshaped(conversation={"id": {"a": 1}}),
        _reshaped(recipient={"id": 28}),
        _reshaped(replyToId=1),
    ],
)
async def test_an_activity_of_the_wrong_shape_is_400(
    open_bot: Server, activity: dict[str, Any]
) -> None:
    """msrest turns a number, list or object in a string field into its text, so the
    shape is checked before the SDK sees it: ``{"type": 7}`` was a ``"7"`` activity
    answered 202, ``{"conversation": {"id": 7}}`` a turn in conversation ``"7"``, and a
    message without ``serviceUrl`` ran a turn whose reply had nowhere to go."""
    status, body = await post_activity(open_bot.url, activity)
    assert status == 400, (activity, body)
    assert json.loads(body)["error"]["rule"] == "teams.activity"
    await open_bot.core.drain()
    assert open_bot.core.lookups == [] and open_bot.core.triggers == []


async def test_an_activity_of_a_type_leadgate_does_not_know_is_ignored(open_bot: Server) -> None:
    """The schema asks a bot to ignore a type it does not understand (A2014): 202, no
    turn. Without a recipient (only an activity sent to one recipient names it) a
    message is taken in."""
    assert (await post_activity(open_bot.url, _reshaped(type="somethingNew")))[0] == 202
    assert (await post_activity(open_bot.url, _reshaped(recipient=None)))[0] == 202
    await open_bot.core.drain()
    assert len(open_bot.core.triggers) == 1


async def test_no_auth_mode_warns_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    core = FakeCore(_route_all)
    with caplog.at_level(logging.WARNING, logger="bots.teams"):
        async for _server in _serve(TeamsAdapter(TeamsSettings(enabled=True), core), core):
            pass
    assert any("unauthenticated" in r.getMessage() for r in caplog.records)


async def test_missing_token_is_401_without_network(
    secured_bot: Server, dns_guard: DnsGuard
) -> None:
    activity = message_activity(service_url=SERVICE_URL, text="hi")
    status, body = await post_activity(secured_bot.url, activity)
    assert status == 401
    assert json.loads(body)["error"]["rule"] == "teams.token"
    await secured_bot.core.drain()
    assert secured_bot.core.triggers == [] and secured_bot.core.route_queries == []
    assert dns_guard.hosts == []


@pytest.mark.parametrize("token", ["garbage", "a.b.c", ""])
async def test_garbage_token_is_401_without_network(
    secured_bot: Server, dns_guard: DnsGuard, token: str
) -> None:
    activity = message_activity(service_url=SERVICE_URL, text="hi")
    status, _ = await post_activity(secured_bot.url, activity, token=token)
    assert status == 401
    await secured_bot.core.drain()
    assert secured_bot.core.triggers == []
    assert dns_guard.hosts == []  # rejected before any key fetch


@pytest.mark.parametrize("token", [None, "", "garbage", "a.b.c", FORGED_JWT])
async def test_without_a_bearer_jwt_the_body_is_not_read(
    secured_bot: Server, dns_guard: DnsGuard, token: str | None
) -> None:
    from aiohttp import ClientSession

    # Not JSON, not even the right content type: a 400 or 415 would mean it was read.
    headers = {"Content-Type": "text/plain"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        ClientSession() as session,
        session.post(secured_bot.url, data="{", headers=headers) as r,
    ):
        status = r.status
    assert status == 401
    assert secured_bot.core.triggers == []
    # Only a readable token makes the SDK look for its signing key (offline: refused).
    assert dns_guard.hosts == ([] if token != FORGED_JWT else ["login.botframework.com"])


async def test_a_token_of_non_ascii_bytes_is_401(secured_bot: Server) -> None:
    # Raw bytes on the wire: aiohttp's client would not send a byte that is not UTF-8.
    url = URL(secured_bot.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(
        b"POST " + url.raw_path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer \xff\xfe.e30.x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    assert status_line.split()[1] == b"401"
    assert secured_bot.core.triggers == []


async def test_forged_token_is_401_and_fails_fast(secured_bot: Server, dns_guard: DnsGuard) -> None:
    # Checking this token's signature makes the SDK fetch the OpenID metadata; offline
    # that fails, and the request is refused.
    started = time.monotonic()
    status, _ = await post_activity(
        secured_bot.url, message_activity(service_url=SERVICE_URL, text="hi"), token=FORGED_JWT
    )
    assert status == 401
    assert time.monotonic() - started < 1.0
    assert "login.botframework.com" in dns_guard.hosts
    assert secured_bot.core.triggers == []


async def test_slow_key_fetch_times_out_without_blocking_the_loop(
    secured_bot: Server, dns_guard: DnsGuard
) -> None:
    # The SDK fetches signing keys with a blocking requests.get; it runs off the loop and
    # is bounded by auth_timeout_s (0.3 s here).
    dns_guard.delay_s = 1.0
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.ensure_future(ticker())
    started = time.monotonic()
    status, _ = await post_activity(
        secured_bot.url, message_activity(service_url=SERVICE_URL, text="hi"), token=FORGED_JWT
    )
    elapsed = time.monotonic() - started
    task.cancel()
    assert status == 401
    assert elapsed < 0.9
    assert ticks >= 5  # the event loop kept running meanwhile
    assert secured_bot.core.triggers == []


async def _signed_bot(
    monkeypatch: pytest.MonkeyPatch, keys: BotFrameworkKeys
) -> AsyncIterator[Server]:
    """A secured bot whose SDK fetches its signing keys from ``keys`` (on 127.0.0.1)."""
    from botframework.connector.auth import ChannelValidation, JwtTokenExtractor

    await keys.start()
    monkeypatch.setattr(ChannelValidation, "open_id_metadata_endpoint", keys.metadata_url)
    # The SDK caches metadata per URL for a day: a later test on the same port must not
    # be handed this test's key.
    monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
    # Should anything ask for the Connector's access token, msal's request to
    # Microsoft's login goes to a port nobody listens on.
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    core = FakeCore(_route_all)
    settings = TeamsSettings(app_id=APP_ID, app_password="secret")
    try:
        async for server in _serve(TeamsAdapter(settings, core, auth_timeout_s=5.0), core):
            yield server
    finally:
        await keys.close()


@pytest.fixture
def keys() -> BotFrameworkKeys:
    return BotFrameworkKeys()


@pytest.fixture
async def signed_bot(
    monkeypatch: pytest.MonkeyPatch, keys: BotFrameworkKeys
) -> AsyncIterator[Server]:
    async for server in _signed_bot(monkeypatch, keys):
        yield server


async def test_a_token_the_connector_signed_runs_the_turn(
    signed_bot: Server, keys: BotFrameworkKeys
) -> None:
    token = keys.token(app_id=APP_ID, service_url=SERVICE_URL)
    activity = message_activity(service_url=SERVICE_URL, text="hi", activity_id="1700000000009")
    status, _ = await post_activity(signed_bot.url, activity, token=token)
    assert status == 202
    await signed_bot.core.drain()
    [trigger] = signed_bot.core.triggers
    assert trigger.external_event_id == "teams:tenant-1:19:general@thread.tacv2:1700000000009"


@pytest.mark.parametrize(
    "claims",
    [
        {"key": "forged"},  # signed by another key under the same kid
        {"lifetime_s": -900},  # expired beyond the SDK's 5 minutes of tolerance
        {"app_id": "99999999-2222-3333-4444-555555555555"},  # for another bot
        {"issuer": "https://sts.windows.net/evil/"},
    ],
)
async def test_the_token_is_verified_before_the_body_is_read(
    signed_bot: Server, keys: BotFrameworkKeys, claims: dict[str, Any]
) -> None:
    from aiohttp import ClientSession

    arguments: dict[str, Any] = {"app_id": APP_ID, "service_url": SERVICE_URL}
    arguments.update(claims)
    if arguments.pop("key", None) == "forged":
        arguments["key"] = rsa_key()
    good = keys.token(app_id=APP_ID, service_url=SERVICE_URL)
    bad = keys.token(**arguments)
    statuses = []
    async with ClientSession() as session:
        for token in (good, bad):
            # Not JSON, not even the right content type: a 415 means the body was read.
            headers = {"Content-Type": "text/plain", "Authorization": f"Bearer {token}"}
            async with session.post(signed_bot.url, data="{", headers=headers) as r:
                statuses.append(r.status)
    assert statuses == [415, 401]
    assert signed_bot.core.triggers == []


async def test_a_token_issued_for_another_service_url_is_401(
    signed_bot: Server, keys: BotFrameworkKeys
) -> None:
    # A valid token replayed with an activity that names another connector to answer.
    token = keys.token(app_id=APP_ID, service_url="http://127.0.0.1:9/other/")
    status, body = await post_activity(
        signed_bot.url, message_activity(service_url=SERVICE_URL, text="hi"), token=token
    )
    assert status == 401
    assert json.loads(body)["error"]["rule"] == "teams.token"
    await signed_bot.core.drain()
    assert signed_bot.core.triggers == [] and signed_bot.core.route_queries == []


async def test_a_key_not_endorsed_for_the_activitys_channel_is_401(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = BotFrameworkKeys(endorsements=("webchat",))
    async for bot in _signed_bot(monkeypatch, keys):
        token = keys.token(app_id=APP_ID, service_url=SERVICE_URL)
        activity = message_activity(service_url=SERVICE_URL, text="hi")  # channelId msteams
        status, _ = await post_activity(bot.url, activity, token=token)
        assert status == 401
        await bot.core.drain()
        assert bot.core.triggers == []


def test_create_is_off_unless_enabled_or_app_id() -> None:
    core = FakeCore.__new__(FakeCore)
    assert create(Settings(), core) is None
    assert isinstance(create(Settings(teams=TeamsSettings(enabled=True)), core), TeamsAdapter)
    adapter = create(Settings(teams=TeamsSettings(app_id=APP_ID, app_password="pw")), core)
    assert isinstance(adapter, TeamsAdapter) and adapter.auth_enabled
    assert adapter.channel.name == "teams" and adapter.channel.max_chars == 26_000


def test_sdk_config_tenancy() -> None:
    multi = sdk_config(TeamsSettings(app_id=APP_ID, app_password="pw"))
    assert (multi.APP_ID, multi.APP_PASSWORD, multi.APP_TYPE) == (APP_ID, "pw", "MultiTenant")
    single = sdk_config(TeamsSettings(app_id=APP_ID, app_password="pw", app_tenant_id="t-1"))
    assert (single.APP_TYPE, single.APP_TENANTID) == ("SingleTenant", "t-1")
    with pytest.raises(ConfigError):
        sdk_config(TeamsSettings(app_id=APP_ID, app_tenant_id="t-1"))
