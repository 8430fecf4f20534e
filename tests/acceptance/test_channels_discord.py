"""Discord through the real service: signed interactions and the gateway in, REST out.

One ``leadgate serve`` process for the module, pointed at the Discord stand-in (REST v10
and a gateway websocket, in a subprocess) with ``api_url``, ``gateway_url`` and a bot
token. Interactions are signed with a PyNaCl ``SigningKey`` whose public key is the
configured ``public_key``. Sessions are per channel, so each test takes a fresh one.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from nacl.signing import SigningKey

from tests.acceptance.channel_kit import (
    DISCORD_SILENT,
    DISCORD_WORK_GUILD,
    FAST_RUNNERS,
    Operator,
    Standin,
    channel_template,
    get_json,
    http,
    prepared_service,
    stays,
    total_turns,
    turn_counts,
    wait_until,
)
from tests.service_proc import DemoTemplate, ServiceProcess

TOKEN = "discord-acceptance-bot-token"
APP_ID = "1100000000000000001"  # the stand-in's application id
OTHER_GUILD = "800000000000000001"  # no route of its own: `plain`
SIGNING_KEY = SigningKey.generate()

_ids = itertools.count(1)


def snowflake() -> str:
    return str(((int(time.time() * 1000) - 1_420_070_400_000) << 22) | (next(_ids) + 4096))


@pytest.fixture(scope="module")
def discord_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    log_dir = tmp_path_factory.mktemp("discord")
    with Standin("discord_api", "--token", TOKEN, "--application-id", APP_ID, log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    discord_api: Standin,
) -> Iterator[ServiceProcess]:
    template = channel_template(demo_template, lambda: tmp_path_factory.mktemp("routes"))
    proc = prepared_service(
        template,
        tmp_path_factory.mktemp("svc-discord"),
        config={
            **FAST_RUNNERS,
            "discord": {
                "public_key": SIGNING_KEY.verify_key.encode().hex(),
                "bot_token": TOKEN,
                "application_id": APP_ID,
                "api_url": f"{discord_api.url}/api/v10",
                "gateway_url": f"ws://127.0.0.1:{discord_api.port}/gateway",
            },
        },
    )
    with service_guard(proc.start()):
        wait_until(
            lambda: get_json(f"{discord_api.url}/_standin/gateway")["ready"] >= 1,
            what="the service's gateway session",
        )
        yield proc


# ---------------------------------------------------------------------------- helpers


def sign(body: bytes, key: SigningKey = SIGNING_KEY) -> dict[str, str]:
    timestamp = str(int(time.time()))
    return {
        "Content-Type": "application/json",
        "X-Signature-Ed25519": key.sign(timestamp.encode() + body).signature.hex(),
        "X-Signature-Timestamp": timestamp,
    }


def ask_payload(channel_id: str, text: str, *, guild_id: str) -> dict[str, Any]:
    return {
        "type": 2,
        "id": snowflake(),
        "application_id": APP_ID,
        "token": f"itok-{uuid.uuid4().hex}",
        "version": 1,
        "guild_id": guild_id,
        "channel_id": channel_id,
        "channel": {"id": channel_id, "type": 0},
        "member": {"user": {"id": "1100000000000000100", "username": "someone"}},
        "data": {
            "id": "1200000000000000001",
            "name": "ask",
            "type": 1,
            "options": [{"name": "message", "type": 3, "value": text}],
        },
    }


def post_interaction(
    svc: ServiceProcess, payload: dict[str, Any], key: SigningKey = SIGNING_KEY
) -> tuple[int, Any]:
    body = json.dumps(payload).encode()
    status, raw = http(
        "POST", f"{svc.url}/discord/interactions", data=body, headers=sign(body, key)
    )
    return status, (json.loads(raw) if raw.startswith(b"{") else raw)


def ask(svc: ServiceProcess, channel_id: str, text: str, *, guild_id: str) -> str:
    """Run ``/ask message:<text>``; asserts the deferred ack; returns the token."""
    payload = ask_payload(channel_id, text, guild_id=guild_id)
    status, answer = post_interaction(svc, payload)
    assert (status, answer) == (200, {"type": 5})
    return str(payload["token"])


def gateway_message(dc: Standin, channel_id: str, text: str, *, guild_id: str) -> str:
    message = dc.control(
        "gateway/message_create",
        {"channel_id": channel_id, "guild_id": guild_id, "content": text},
    )
    return str(message["id"])


def ops(dc: Standin, op: str, **where: Any) -> list[dict[str, Any]]:
    return [
        p
        for p in dc.records("posts")
        if p["op"] == op and all(p.get(k) == v for k, v in where.items())
    ]


def token_ops(dc: Standin, token: str) -> list[str]:
    return [p["op"] for p in dc.records("posts") if p.get("token") == token]


# ---------------------------------------------------------------------------- tests


def test_interaction_plain_reply_fills_the_deferred_response(
    svc: ServiceProcess, discord_api: Standin
) -> None:
    channel = snowflake()
    token = ask(svc, channel, "hello from a slash command", guild_id=OTHER_GUILD)

    edits = wait_until(lambda: ops(discord_api, "edit_original", token=token), what="the edit")
    assert [e["content"] for e in edits] == ["Echo: hello from a slash command"]
    stays(lambda: token_ops(discord_api, token) == ["edit_original"], what="one edit only")
    assert not ops(discord_api, "create_message", channel_id=channel)


def test_gateway_message_is_answered_as_a_reply(svc: ServiceProcess, discord_api: Standin) -> None:
    channel = snowflake()
    message_id = gateway_message(discord_api, channel, "hi over the gateway", guild_id=OTHER_GUILD)

    posts = wait_until(
        lambda: ops(discord_api, "create_message", channel_id=channel), what="the reply"
    )
    assert [p["content"] for p in posts] == ["Echo: hi over the gateway"]
    assert str(posts[0]["message_reference"]["message_id"]) == message_id
    assert posts[0]["enforce_nonce"] is True
    stays(
        lambda: len(ops(discord_api, "create_message", channel_id=channel)) == 1,
        what="exactly one reply",
    )


def test_interaction_completed_turn_is_posted_to_the_channel_after_approval(
    svc: ServiceProcess, discord_api: Standin
) -> None:
    op = Operator(svc)
    channel = snowflake()
    marker = uuid.uuid4().hex[:10]
    text = f"build it {marker} #complete"
    token = ask(svc, channel, text, guild_id=DISCORD_WORK_GUILD)

    detail = op.wait_item(marker, "completed")
    posts = ops(discord_api, "create_message", channel_id=channel)
    assert [p["content"] for p in posts] == [f"Echo: {text}"]
    assert posts[0]["message_reference"] is None  # a message from the bot, not a reply
    # The deferred "thinking..." response was removed, never filled.
    assert token_ops(discord_api, token) == ["delete_original"]
    assert [(d["action"], d["status"]) for d in detail["deliveries"]] == [("post", "sent")]
    stays(
        lambda: len(ops(discord_api, "create_message", channel_id=channel)) == 1,
        what="exactly one post",
    )


def test_escalated_gateway_turn_waits_for_a_human_then_posts_once(
    svc: ServiceProcess, discord_api: Standin
) -> None:
    op = Operator(svc)
    channel = snowflake()
    marker = uuid.uuid4().hex[:10]
    text = f"ship to prod {marker} #complete #escalate"
    message_id = gateway_message(discord_api, channel, text, guild_id=DISCORD_WORK_GUILD)

    item = op.wait_item(marker, "awaitingHuman")
    stays(lambda: not ops(discord_api, "create_message", channel_id=channel), what="no post")

    op.decide(item["id"], "approve")
    posts = wait_until(
        lambda: ops(discord_api, "create_message", channel_id=channel), what="the approved post"
    )
    assert [p["content"] for p in posts] == [f"Echo: {text}"]
    assert str(posts[0]["message_reference"]["message_id"]) == message_id
    op.wait_item(marker, "completed")
    stays(
        lambda: len(ops(discord_api, "create_message", channel_id=channel)) == 1,
        what="exactly one post",
    )


def test_messages_while_under_review_are_busy(svc: ServiceProcess, discord_api: Standin) -> None:
    op = Operator(svc)
    channel = snowflake()
    marker = uuid.uuid4().hex[:10]
    first = ask(svc, channel, f"hold {marker} #complete #escalate", guild_id=DISCORD_WORK_GUILD)
    item = op.wait_item(marker, "awaitingHuman")
    wait_until(lambda: token_ops(discord_api, first) == ["delete_original"], what="deferral gone")

    before = turn_counts(svc)
    token = ask(svc, channel, f"{marker}-again via slash", guild_id=DISCORD_WORK_GUILD)
    gateway_message(
        discord_api, channel, f"{marker}-again via gateway", guild_id=DISCORD_WORK_GUILD
    )
    wait_until(
        lambda: turn_counts(svc).get("busy", 0) == before.get("busy", 0) + 2,
        what="two busy turns",
    )
    after = turn_counts(svc)
    assert {k: v for k, v in after.items() if k != "busy"} == {
        k: v for k, v in before.items() if k != "busy"
    }, "a busy message must run no turn"
    # No lingering "thinking..." for the busy interaction, and nothing visible.
    wait_until(lambda: token_ops(discord_api, token) == ["delete_original"], what="deferral gone")
    stays(
        lambda: (
            not ops(discord_api, "create_message", channel_id=channel)
            and token_ops(discord_api, token) == ["delete_original"]
        ),
        what="nothing posted",
    )
    detail = op.detail(item["id"])
    assert detail["status"] == "awaitingHuman"
    assert f"{marker}-again" not in detail["taskContext"]
    op.decide(item["id"], "cancel")


def test_silent_route_posts_nothing(svc: ServiceProcess, discord_api: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    plain_before = turn_counts(svc).get("plain", 0)
    # The worker without #complete: a plain turn, whose reply a silent route drops.
    token = ask(svc, DISCORD_SILENT, f"quiet {marker}", guild_id=DISCORD_WORK_GUILD)
    wait_until(lambda: turn_counts(svc).get("plain", 0) >= plain_before + 1, what="plain turn")
    wait_until(lambda: token_ops(discord_api, token) == ["delete_original"], what="deferral gone")
    # Approved output on the silent route: completed, not posted.
    token2 = ask(svc, DISCORD_SILENT, "finish #complete", guild_id=DISCORD_WORK_GUILD)
    item = op.wait_item(marker, "completed")
    assert [(d["action"], d["status"]) for d in item["deliveries"]] == [("silent", "sent")]
    assert item["id"] in [r["id"] for r in op.activity()]
    stays(
        lambda: (
            not ops(discord_api, "create_message", channel_id=DISCORD_SILENT)
            and token_ops(discord_api, token2) == ["delete_original"]
        ),
        what="nothing posted on a silent route",
    )


def test_bad_signature_is_rejected_and_runs_no_turn(
    svc: ServiceProcess, discord_api: Standin
) -> None:
    before = total_turns(svc)
    channel = snowflake()
    payload = ask_payload(channel, "forged", guild_id=OTHER_GUILD)
    status, _ = post_interaction(svc, payload, key=SigningKey.generate())
    assert status == 401
    # A signature of another body does not verify either; nor does no signature.
    body = json.dumps(payload).encode()
    headers = sign(b"{}")
    assert http("POST", f"{svc.url}/discord/interactions", data=body, headers=headers)[0] == 401
    assert (
        http(
            "POST",
            f"{svc.url}/discord/interactions",
            data=body,
            headers={"Content-Type": "application/json"},
        )[0]
        == 401
    )
    # A correctly signed PING is answered (the endpoint works).
    assert post_interaction(svc, {"type": 1, "id": snowflake(), "application_id": APP_ID}) == (
        200,
        {"type": 1},
    )
    stays(
        lambda: total_turns(svc) == before and not token_ops(discord_api, payload["token"]),
        what="no turn and no post",
    )


def test_gateway_messages_from_bots_run_no_turn(svc: ServiceProcess, discord_api: Standin) -> None:
    before = total_turns(svc)
    channel = snowflake()
    discord_api.control(
        "gateway/message_create",
        {"channel_id": channel, "guild_id": OTHER_GUILD, "content": "beep", "author_bot": True},
    )
    stays(
        lambda: (
            total_turns(svc) == before
            and not ops(discord_api, "create_message", channel_id=channel)
        ),
        what="no turn and no post",
    )
