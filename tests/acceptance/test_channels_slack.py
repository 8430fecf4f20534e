"""Slack through the real service: signed Events API in, ``chat.postMessage`` out.

One ``leadgate serve`` process for the module, its ``[slack] api_url`` pointing at the
Slack Web API stand-in (a subprocess). Events are signed with slack_sdk's
``SignatureVerifier``; each test uses a thread of its own (a new ``ts``), which is a
session of its own.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slack_sdk.signature import SignatureVerifier
from sqlalchemy.engine import make_url

from tests.acceptance.channel_kit import (
    FAST_RUNNERS,
    SLACK_SILENT,
    SLACK_WORK,
    Operator,
    Standin,
    admin_batch,
    channel_template,
    http,
    logs_on_failure,
    prepared_service,
    stays,
    total_turns,
    turn_counts,
    wait_until,
)
from tests.pg import PostgresServer
from tests.service_proc import Demo, DemoTemplate, ServiceProcess

SECRET = "slack-signing-secret"
TOKEN = "xoxb-acceptance"
TEAM = "T0ACCEPT"
C_PLAIN = "C0PLAIN"  # any channel without a route of its own goes to `plain`
C_WORK = SLACK_WORK  # `worker` (reviewed by `lead`)
C_SILENT = SLACK_SILENT  # `worker`, silent route

_ts = itertools.count(1)


def new_ts() -> str:
    return f"{int(time.time())}.{next(_ts):06d}"


@pytest.fixture(scope="module")
def slack_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    with Standin("slack_api", "--token", TOKEN, log_dir=tmp_path_factory.mktemp("slack")) as s:
        yield s


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    slack_api: Standin,
) -> Iterator[ServiceProcess]:
    template = channel_template(demo_template, lambda: tmp_path_factory.mktemp("routes"))
    proc = prepared_service(
        template,
        tmp_path_factory.mktemp("svc-slack"),
        config={
            **FAST_RUNNERS,
            "slack": {
                "signing_secret": SECRET,
                "bot_token": TOKEN,
                "api_url": f"{slack_api.url}/api/",
            },
        },
    )
    with service_guard(proc.start()):
        yield proc


# ---------------------------------------------------------------------------- helpers


def event_body(
    channel: str,
    text: str,
    ts: str,
    *,
    thread_ts: str | None = None,
    kind: str = "message",
    event_id: str | None = None,
) -> str:
    event: dict[str, Any] = {
        "type": kind,
        "channel": channel,
        "user": "U0HUMAN",
        "text": text,
        "ts": ts,
        "event_ts": ts,
        "channel_type": "channel",
    }
    if thread_ts:
        event["thread_ts"] = thread_ts
    return json.dumps(
        {
            "token": "legacy-verification-token",
            "team_id": TEAM,
            "api_app_id": "A0LEADGATE",
            "event": event,
            "type": "event_callback",
            "event_id": event_id or f"Ev{uuid.uuid4().hex[:12].upper()}",
            "event_time": int(time.time()),
        }
    )


def signed(body: str, *, secret: str = SECRET, retry_num: int | None = None) -> dict[str, str]:
    timestamp = str(int(time.time()))
    signature = SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body)
    assert signature is not None
    headers = {
        "Content-Type": "application/json",
        "X-Slack-Request-Timestamp": timestamp,
        "X-Slack-Signature": signature,
    }
    if retry_num is not None:
        headers["X-Slack-Retry-Num"] = str(retry_num)
        headers["X-Slack-Retry-Reason"] = "http_timeout"
    return headers


def deliver(svc: ServiceProcess, body: str, headers: dict[str, str]) -> int:
    status, _ = http("POST", f"{svc.url}/slack/events", data=body.encode(), headers=headers)
    return status


def send(svc: ServiceProcess, channel: str, text: str, ts: str, **kw: Any) -> None:
    body = event_body(channel, text, ts, **kw)
    assert deliver(svc, body, signed(body)) == 200


def thread_posts(slack_api: Standin, channel: str, thread: str) -> list[dict[str, Any]]:
    return [
        p
        for p in slack_api.records("posts")
        if p["channel"] == channel and p["thread_ts"] == thread
    ]


def channel_posts(slack_api: Standin, channel: str) -> list[dict[str, Any]]:
    return [p for p in slack_api.records("posts") if p["channel"] == channel]


# ---------------------------------------------------------------------------- tests


def test_plain_reply_is_posted_once_in_the_thread(svc: ServiceProcess, slack_api: Standin) -> None:
    ts = new_ts()
    text = f"hello plain {uuid.uuid4().hex[:8]}"
    send(svc, C_PLAIN, text, ts)

    posts = wait_until(lambda: thread_posts(slack_api, C_PLAIN, ts), what="the plain reply")
    assert [p["text"] for p in posts] == [f"Echo: {text}"]
    stays(lambda: len(thread_posts(slack_api, C_PLAIN, ts)) == 1, what="exactly one post")

    # A follow-up inside the thread is answered in the same thread.
    ts2 = new_ts()
    send(svc, C_PLAIN, "and again", ts2, thread_ts=ts)
    wait_until(lambda: len(thread_posts(slack_api, C_PLAIN, ts)) == 2, what="second reply")
    assert thread_posts(slack_api, C_PLAIN, ts)[1]["text"] == "Echo: and again"
    assert not thread_posts(slack_api, C_PLAIN, ts2)


def test_completed_turn_is_posted_once_after_lead_approval(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    text = f"write the report {marker} #complete"
    ts = new_ts()
    send(svc, C_WORK, text, ts)

    # The script lead approves in the background; the relay then posts the snapshot.
    detail = op.wait_item(marker, "completed")
    posts = thread_posts(slack_api, C_WORK, ts)
    assert [p["text"] for p in posts] == [f"Echo: {text}"]
    assert detail["snapshot"] == f"Echo: {text}"
    assert [(d["action"], d["status"], d["channel"]) for d in detail["deliveries"]] == [
        ("post", "sent", "slack")
    ]
    # Approved by the lead (not a human), and only then delivered.
    trail = [(a["action"], a["to"], a["actor"]) for a in detail["audit"] if a["to"]]
    assert [t[:2] for t in trail[-2:]] == [("approve", "approved"), ("delivered", "completed")]
    assert trail[-2][2].startswith("lead:"), trail
    stays(lambda: len(thread_posts(slack_api, C_WORK, ts)) == 1, what="exactly one post")


def test_escalated_item_waits_for_a_human_then_posts_once(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    text = f"risky change {marker} #complete #escalate"
    ts = new_ts()
    send(svc, C_WORK, text, ts)

    item = op.wait_item(marker, "awaitingHuman")
    assert item["id"] in [r["id"] for r in op.reviews()]
    stays(lambda: not thread_posts(slack_api, C_WORK, ts), what="nothing posted while waiting")

    decided = op.decide(item["id"], "approve")
    assert decided["status"] in ("approved", "completed")
    posts = wait_until(lambda: thread_posts(slack_api, C_WORK, ts), what="the approved post")
    assert [p["text"] for p in posts] == [f"Echo: {text}"]
    op.wait_item(marker, "completed")
    stays(lambda: len(thread_posts(slack_api, C_WORK, ts)) == 1, what="exactly one post")


def test_message_while_under_review_is_busy(svc: ServiceProcess, slack_api: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    ts = new_ts()
    send(svc, C_WORK, f"hold this {marker} #complete #escalate", ts)
    item = op.wait_item(marker, "awaitingHuman")

    before = turn_counts(svc)
    send(svc, C_WORK, f"are you done yet {marker}-again", new_ts(), thread_ts=ts)
    wait_until(
        lambda: turn_counts(svc).get("busy", 0) == before.get("busy", 0) + 1,
        what="the busy turn counter",
    )
    after = turn_counts(svc)
    assert {k: v for k, v in after.items() if k != "busy"} == {
        k: v for k, v in before.items() if k != "busy"
    }, "a busy message must run no turn"
    stays(lambda: not thread_posts(slack_api, C_WORK, ts), what="nothing posted")
    detail = op.detail(item["id"])
    assert detail["status"] == "awaitingHuman"
    assert f"{marker}-again" not in detail["taskContext"]
    # Clean up: the item leaves the queue.
    op.decide(item["id"], "cancel")


def test_silent_route_posts_nothing(svc: ServiceProcess, slack_api: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    ts = new_ts()
    # Without #complete the worker's turn is a plain turn: its reply is not posted.
    plain_before = turn_counts(svc).get("plain", 0)
    send(svc, C_SILENT, f"quiet hello {marker}", ts)
    wait_until(lambda: turn_counts(svc).get("plain", 0) >= plain_before + 1, what="the plain turn")
    # Approved output on a silent route is not posted either; the item still completes.
    send(svc, C_SILENT, "now finish it #complete", new_ts(), thread_ts=ts)
    item = op.wait_item(marker, "completed")
    assert [(d["action"], d["status"]) for d in item["deliveries"]] == [("silent", "sent")]
    # Found through Agent Activity, which links to the detail.
    row = next(r for r in op.activity() if r["id"] == item["id"])
    assert row["status"] == "completed"
    assert row["detail"] == f"/operator/reviews/{item['id']}"
    stays(lambda: not channel_posts(slack_api, C_SILENT), what="nothing posted on a silent route")


def test_bad_signature_is_rejected_and_runs_no_turn(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    before = total_turns(svc)
    ts = new_ts()
    body = event_body(C_PLAIN, "forged", ts)
    assert deliver(svc, body, signed(body, secret="not-the-secret")) == 401
    # A valid signature over a different body does not verify either.
    other = event_body(C_PLAIN, "forged too", ts)
    assert deliver(svc, other, signed(body)) == 401
    # No signature at all.
    assert deliver(svc, body, {"Content-Type": "application/json"}) == 401
    stays(
        lambda: total_turns(svc) == before and not thread_posts(slack_api, C_PLAIN, ts),
        what="no turn and no post",
    )


def test_slack_retry_runs_no_second_turn(svc: ServiceProcess, slack_api: Standin) -> None:
    ts = new_ts()
    body = event_body(C_PLAIN, "only once please", ts, event_id="EvRETRY0001")
    before = turn_counts(svc)
    assert deliver(svc, body, signed(body)) == 200
    wait_until(lambda: thread_posts(slack_api, C_PLAIN, ts), what="the reply")
    # Slack retries the same event (same event_id) ...
    assert deliver(svc, body, signed(body, retry_num=1)) == 200
    assert deliver(svc, body, signed(body, retry_num=2)) == 200
    # ... and sends an app_mention twin of the same message with another event_id.
    twin = event_body(C_PLAIN, "<@U0BOT> only once please", ts, kind="app_mention")
    assert deliver(svc, twin, signed(twin)) == 200

    wait_until(
        lambda: turn_counts(svc).get("duplicate", 0) >= before.get("duplicate", 0) + 3,
        what="three duplicates",
    )
    after = turn_counts(svc)
    assert after.get("plain", 0) == before.get("plain", 0) + 1
    stays(lambda: len(thread_posts(slack_api, C_PLAIN, ts)) == 1, what="exactly one post")
    assert thread_posts(slack_api, C_PLAIN, ts)[0]["text"] == "Echo: only once please"


# ------------------------------------------------------ split roles on PostgreSQL


def test_split_api_and_worker_processes_post_channel_replies(
    pg_url: str, postgres_server: PostgresServer, tmp_path: Path, slack_api: Standin
) -> None:
    """``--role api`` takes the event in and runs the turn; ``--role worker`` runs the
    lead review and the relay, which must be able to post to Slack."""
    config = {
        **FAST_RUNNERS,
        "slack": {"signing_secret": SECRET, "bot_token": TOKEN, "api_url": f"{slack_api.url}/api/"},
    }
    api = ServiceProcess(tmp_path / "api", database_url=pg_url, config=config)
    _, demo_out, _ = admin_batch(
        api,
        [
            ["db", "upgrade"],
            ["demo", "--name", "demo"],
            ["route", "add", "--org", "demo", "--agent", "worker", "--channel", "slack"],
        ],
    )
    api.demo = Demo.from_cli(demo_out)
    worker = ServiceProcess(tmp_path / "worker", database_url=pg_url, config=config)
    with api.start(role="api"), worker.start(role="worker"), logs_on_failure(api, worker):
        ts = new_ts()
        send(api, "C0SPLIT", "plain across roles", ts)
        posts = wait_until(lambda: thread_posts(slack_api, "C0SPLIT", ts), what="the reply")
        assert [p["text"] for p in posts] == ["Echo: plain across roles"]
        # Both registered, as their roles: the api process records channel turns under
        # its id, which another process takes back at once if it dies (unregistered,
        # they waited out a 15-minute lease).
        database = make_url(pg_url).database
        assert database
        roles = postgres_server.psql("SELECT role FROM processes ORDER BY role", database=database)
        assert roles.split() == ["api", "worker"]

        ts2 = new_ts()
        send(api, "C0SPLIT", "gated across roles #complete", ts2)
        posts = wait_until(
            lambda: thread_posts(slack_api, "C0SPLIT", ts2), what="the approved post"
        )
        assert [p["text"] for p in posts] == ["Echo: gated across roles #complete"]
        Operator(api).wait_item("gated across roles", "completed")
        stays(
            lambda: (
                len(thread_posts(slack_api, "C0SPLIT", ts)) == 1
                and len(thread_posts(slack_api, "C0SPLIT", ts2)) == 1
            ),
            what="exactly one post each",
        )


def test_url_verification_and_bot_messages_run_no_turn(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    before = total_turns(svc)
    challenge = json.dumps({"token": "legacy", "challenge": "c-123", "type": "url_verification"})
    status, raw = http(
        "POST", f"{svc.url}/slack/events", data=challenge.encode(), headers=signed(challenge)
    )
    assert status == 200 and b"c-123" in raw
    # Our own post coming back as an event (and any other bot's) is not a request.
    ts = new_ts()
    body = json.loads(event_body(C_PLAIN, "Echo: something", ts))
    body["event"].update(subtype="bot_message", bot_id="B0STANDIN")
    raw_body = json.dumps(body)
    assert deliver(svc, raw_body, signed(raw_body)) == 200
    stays(
        lambda: total_turns(svc) == before and not thread_posts(slack_api, C_PLAIN, ts),
        what="no turn and no post",
    )
