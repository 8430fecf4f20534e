"""Hypothesis over the channel endpoints, with valid signatures (and without).

Slack (signed with the signing secret), Discord interactions (signed with the
application's Ed25519 key) and Teams (local no-auth mode): arbitrary JSON, wrong types in
the fields the adapters and SDKs read, deep nesting, bodies that are not JSON at all, the
probe's known 500s. Every answer is below 500 and carries no traceback; a refused
request (4xx) writes nothing; the service logs no crash. On SQLite and on PostgreSQL,
where text cannot hold a NUL and ids have column lengths (session 31's probes found 500s
there that SQLite never showed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import pytest
import requests
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.conftest import SESSION, SETTINGS, SLACK_SECRET, Fuzzed

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(["x\x00y", "\ud800", "#complete", "a" * 100_001])
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=10,
)


def encode(value: Any) -> bytes:
    # Lone surrogates must reach the service as JSON escapes (the probe's "x\ud800").
    return json.dumps(value).encode()


def send(svc: Fuzzed, path: str, body: bytes, headers: dict[str, str]) -> requests.Response:
    before = svc.quiet_fingerprint()
    response = SESSION.post(f"{svc.proc.url}{path}", data=body, headers=headers, timeout=20)
    assert response.status_code < 500, (path, body[:300], response.status_code, response.text)
    assert "Traceback" not in response.text
    if 400 <= response.status_code < 500:
        assert svc.fingerprint() == before, (path, body[:300])
    return response


def slack_headers(
    body: bytes, *, form: bool = False, timestamp: str | None = None
) -> dict[str, str]:
    ts = timestamp or str(int(time.time()))
    # Signed over the raw bytes as Slack does (slack_sdk's helper only signs UTF-8).
    digest = hmac.new(SLACK_SECRET.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256)
    sig = "v0=" + digest.hexdigest()
    return {
        "Content-Type": "application/x-www-form-urlencoded" if form else "application/json",
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": sig,
    }


def slack_event(event: Any, **top: Any) -> dict[str, Any]:
    return {"type": "event_callback", "team_id": "TFUZZ", "event_id": "Ev1", "event": event, **top}


event_fields = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "app_mention"]) | values,
        "channel": st.text(max_size=10) | values,
        "ts": st.text(max_size=10) | values,
        "thread_ts": values,
        "text": st.text(max_size=40) | values,
        "subtype": values,
        "user": values,
        "team": values,
        "bot_id": values,
    },
)


@SETTINGS
@given(body=st.one_of(values.map(encode), event_fields.map(lambda e: encode(slack_event(e)))))
@example(body=b"not json at all")
@example(body=b"[1, 2, 3]")
@example(body=b"\xff\xfe\xfd")
@example(body=b"[" * 3000 + b"]" * 3000)
@example(
    body=encode(slack_event({"type": "message", "channel": "C1", "ts": "1.1", "text": "x\x00"}))
)
@example(
    body=encode(
        slack_event({"type": "message", "channel": "C1", "ts": "1.2", "text": "a" * 100_001})
    )
)
@example(
    body=encode(slack_event({"type": "message", "channel": "C1", "ts": "1.3", "text": "x\ud800"}))
)
@example(body=encode({"type": "event_callback", "event": [1], "team": 5}))
@example(body=encode({"type": "block_actions", "team": 7, "user": [], "channel": 1.5}))
def test_signed_slack_bodies(each_backend: Fuzzed, body: bytes) -> None:
    send(each_backend, "/slack/events", body, slack_headers(body))


@SETTINGS
@given(payload=st.text(max_size=60) | values.map(lambda v: json.dumps(v)))
@example(payload="{not json")
@example(payload="[" * 3000)
def test_signed_slack_interaction_forms(each_backend: Fuzzed, payload: str) -> None:
    from urllib.parse import quote

    body = f"payload={quote(payload)}".encode()
    send(each_backend, "/slack/events", body, slack_headers(body, form=True))


@pytest.mark.parametrize("timestamp", ["abc", "", "1e9", "99999999999999999999", "12a"])
def test_slack_bad_timestamps_are_401s(each_backend: Fuzzed, timestamp: str) -> None:
    body = encode(slack_event({"type": "message", "channel": "C1", "ts": "9.9", "text": "hi"}))
    headers = slack_headers(body, timestamp=timestamp or None)
    headers["X-Slack-Request-Timestamp"] = timestamp
    response = send(each_backend, "/slack/events", body, headers)
    assert response.status_code == 401


def discord_headers(svc: Fuzzed, body: bytes, ts: str | None = None) -> dict[str, str]:
    stamp = ts or str(int(time.time()))
    return {
        "Content-Type": "application/json",
        "X-Signature-Ed25519": svc.discord_key.sign(stamp.encode() + body).signature.hex(),
        "X-Signature-Timestamp": stamp,
    }


ask_fields = st.fixed_dictionaries(
    {"type": st.just(2) | values},
    optional={
        "id": st.text(max_size=12) | values,
        "application_id": values,
        "token": values,
        "channel_id": values,
        "channel": values,
        "guild_id": values,
        "data": values
        | st.fixed_dictionaries(
            {"name": st.just("ask") | values},
            optional={
                "options": values
                | st.lists(
                    st.fixed_dictionaries({"name": st.just("message") | values, "value": values}),
                    max_size=2,
                )
            },
        ),
    },
)


def ask(**fields: Any) -> dict[str, Any]:
    """An APPLICATION_COMMAND interaction with ``fields`` set (or replaced)."""
    return {"type": 2, "id": "1", "application_id": "2", "token": "t", **fields}


@SETTINGS
@given(payload=values | ask_fields)
@example(payload=ask(channel_id="3", data={"name": "ask", "options": "a string"}))
@example(
    payload=ask(channel="x", data={"name": "ask", "options": [{"name": "message", "value": "hi"}]})
)
@example(
    payload=ask(
        id="9",
        channel_id="3",
        data={"name": "ask", "options": [{"name": "message", "value": "x\x00"}]},
    )
)
@example(payload={"type": 1})
def test_signed_discord_interactions(each_backend: Fuzzed, payload: Any) -> None:
    body = encode(payload)
    send(each_backend, "/discord/interactions", body, discord_headers(each_backend, body))


def test_discord_deep_nesting_and_stale_signatures(each_backend: Fuzzed) -> None:
    deep = b"[" * 3000 + b"]" * 3000
    assert (
        send(
            each_backend, "/discord/interactions", deep, discord_headers(each_backend, deep)
        ).status_code
        == 400
    )
    ping = encode({"type": 1})
    stale = str(int(time.time()) - 3600)  # signed an hour ago: a replay
    assert (
        send(
            each_backend, "/discord/interactions", ping, discord_headers(each_backend, ping, stale)
        ).status_code
        == 401
    )
    assert send(
        each_backend, "/discord/interactions", ping, discord_headers(each_backend, ping)
    ).json() == {"type": 1}


activity_fields = st.fixed_dictionaries(
    {"type": st.just("message") | values},
    optional={
        "id": st.text(max_size=10) | values,
        "text": st.text(max_size=40) | values,
        "serviceUrl": st.just("http://127.0.0.1:9/") | values,
        "channelId": values,
        "conversation": values | st.fixed_dictionaries({"id": st.text(max_size=10) | values}),
        "from": values,
        "recipient": values,
        "entities": values,
        "channelData": values,
    },
)


@SETTINGS
@given(activity=values | activity_fields)
@example(
    activity={
        "type": "message",
        "id": "a1",
        "text": "x\x00",
        "serviceUrl": "http://127.0.0.1:9/",
        "conversation": {"id": "c1"},
    }
)
@example(activity={"type": "message", "id": "a2", "text": 5, "conversation": {"id": 7}})
def test_teams_activities(each_backend: Fuzzed, activity: Any) -> None:
    send(each_backend, "/api/messages", encode(activity), {"Content-Type": "application/json"})


def test_oversized_bodies_are_413_everywhere(each_backend: Fuzzed) -> None:
    big = b'{"a": "' + b"x" * (2 * 1_048_576) + b'"}'
    for path in (
        "/v1/chat/completions",
        "/mcp",
        "/api/messages",
        "/slack/events",
        "/discord/interactions",
        "/console/login",
        "/operator/reviews/x/approve",
    ):
        response = SESSION.post(
            f"{each_backend.proc.url}{path}",
            data=big,
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {each_backend.key}",
            },
            timeout=20,
        )
        assert response.status_code == 413, (path, response.status_code, response.text[:200])


def test_no_crash_in_the_log(each_backend: Fuzzed) -> None:
    assert each_backend.log_problems() == []
