"""Microsoft Teams through the real service: activities in, Bot Connector out.

One ``leadgate serve`` process for the module in the local no-auth mode
(``[teams] enabled = true``, empty app id). Activities are POSTed to ``/api/messages``
with ``serviceUrl`` = the Connector stand-in (a subprocess), which is where the Bot
Framework SDK posts replies and proactive messages. Sessions are per conversation, so
each test takes a fresh one. One more service, with an app id configured, checks that
an unverifiable token gets 401 and runs no turn.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.channel_kit import (
    FAST_RUNNERS,
    TEAMS_SILENT,
    TEAMS_WORK_TENANT,
    Operator,
    Standin,
    channel_template,
    http,
    prepared_service,
    stays,
    total_turns,
    turn_counts,
    wait_until,
)
from tests.service_proc import DemoTemplate, ServiceProcess
from tests.standins.connector import message_activity

OTHER_TENANT = "tenant-other"  # no route of its own: `plain`


@pytest.fixture(scope="module")
def connector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    with Standin("connector", log_dir=tmp_path_factory.mktemp("connector")) as s:
        yield s


@pytest.fixture(scope="module")
def routes_template(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory
) -> DemoTemplate:
    return channel_template(demo_template, lambda: tmp_path_factory.mktemp("routes"))


@pytest.fixture(scope="module")
def svc(
    routes_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    connector: Standin,
) -> Iterator[ServiceProcess]:
    proc = prepared_service(
        routes_template,
        tmp_path_factory.mktemp("svc-teams"),
        config={**FAST_RUNNERS, "teams": {"enabled": True}},
    )
    with service_guard(proc.start()):
        yield proc


# ---------------------------------------------------------------------------- helpers


def new_conversation() -> str:
    return f"19:{uuid.uuid4().hex[:16]}@thread.tacv2"


def post(
    svc: ServiceProcess,
    connector: Standin,
    text: str,
    *,
    conversation: str,
    tenant: str,
    token: str | None = None,
) -> tuple[int, dict[str, Any]]:
    activity = message_activity(
        service_url=connector.url,
        text=text,
        conversation_id=conversation,
        tenant_id=tenant,
        mention_bot=True,
    )
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    status, _ = http("POST", f"{svc.url}/api/messages", json_body=activity, headers=headers)
    return status, activity


def sent_to(connector: Standin, conversation: str) -> list[dict[str, Any]]:
    return [a for a in connector.records("activities") if a["conversation_id"] == conversation]


def requests_to(connector: Standin, conversation: str) -> list[dict[str, Any]]:
    return [a for a in connector.records("requests") if a["conversation_id"] == conversation]


# ---------------------------------------------------------------------------- tests


def test_plain_reply_answers_the_triggering_activity(
    svc: ServiceProcess, connector: Standin
) -> None:
    conversation = new_conversation()
    status, activity = post(
        svc, connector, "hello teams", conversation=conversation, tenant=OTHER_TENANT
    )
    assert status in (200, 202)

    posts = wait_until(lambda: sent_to(connector, conversation), what="the reply")
    assert len(posts) == 1
    assert posts[0]["reply_to_id"] == activity["id"]
    assert posts[0]["activity"]["text"] == "Echo: hello teams"  # the bot mention is removed
    assert posts[0]["activity"]["type"] == "message"
    stays(lambda: len(sent_to(connector, conversation)) == 1, what="exactly one reply")


def test_completed_turn_is_posted_proactively_after_approval(
    svc: ServiceProcess, connector: Standin
) -> None:
    op = Operator(svc)
    conversation = new_conversation()
    marker = uuid.uuid4().hex[:10]
    text = f"summarise the incident {marker} #complete"
    status, _ = post(svc, connector, text, conversation=conversation, tenant=TEAMS_WORK_TENANT)
    assert status in (200, 202)

    detail = op.wait_item(marker, "completed")
    posts = sent_to(connector, conversation)
    assert [p["activity"]["text"] for p in posts] == [f"Echo: {text}"]
    # Proactive: a new message in the conversation, not a reply to an activity.
    assert posts[0]["reply_to_id"] is None
    assert posts[0]["path"].endswith("/activities")
    assert [(d["action"], d["status"], d["channel"]) for d in detail["deliveries"]] == [
        ("post", "sent", "teams")
    ]
    stays(lambda: len(sent_to(connector, conversation)) == 1, what="exactly one post")


def test_escalated_item_waits_for_a_human_then_posts_once(
    svc: ServiceProcess, connector: Standin
) -> None:
    op = Operator(svc)
    conversation = new_conversation()
    marker = uuid.uuid4().hex[:10]
    text = f"rotate the keys {marker} #complete #escalate"
    post(svc, connector, text, conversation=conversation, tenant=TEAMS_WORK_TENANT)

    item = op.wait_item(marker, "awaitingHuman")
    stays(lambda: not requests_to(connector, conversation), what="nothing posted")

    op.decide(item["id"], "approve")
    posts = wait_until(lambda: sent_to(connector, conversation), what="the approved post")
    assert [p["activity"]["text"] for p in posts] == [f"Echo: {text}"]
    op.wait_item(marker, "completed")
    stays(lambda: len(sent_to(connector, conversation)) == 1, what="exactly one post")


def test_message_while_under_review_is_busy(svc: ServiceProcess, connector: Standin) -> None:
    op = Operator(svc)
    conversation = new_conversation()
    marker = uuid.uuid4().hex[:10]
    post(
        svc,
        connector,
        f"hold {marker} #complete #escalate",
        conversation=conversation,
        tenant=TEAMS_WORK_TENANT,
    )
    item = op.wait_item(marker, "awaitingHuman")

    before = turn_counts(svc)
    post(svc, connector, f"{marker}-again", conversation=conversation, tenant=TEAMS_WORK_TENANT)
    wait_until(
        lambda: turn_counts(svc).get("busy", 0) == before.get("busy", 0) + 1, what="busy turn"
    )
    after = turn_counts(svc)
    assert {k: v for k, v in after.items() if k != "busy"} == {
        k: v for k, v in before.items() if k != "busy"
    }, "a busy message must run no turn"
    stays(lambda: not requests_to(connector, conversation), what="nothing posted")
    detail = op.detail(item["id"])
    assert detail["status"] == "awaitingHuman"
    assert f"{marker}-again" not in detail["taskContext"]
    op.decide(item["id"], "cancel")


def test_silent_route_posts_nothing(svc: ServiceProcess, connector: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    plain_before = turn_counts(svc).get("plain", 0)
    post(svc, connector, f"quiet {marker}", conversation=TEAMS_SILENT, tenant=TEAMS_WORK_TENANT)
    wait_until(lambda: turn_counts(svc).get("plain", 0) >= plain_before + 1, what="plain turn")
    post(svc, connector, "finish #complete", conversation=TEAMS_SILENT, tenant=TEAMS_WORK_TENANT)
    item = op.wait_item(marker, "completed")
    assert [(d["action"], d["status"]) for d in item["deliveries"]] == [("silent", "sent")]
    assert item["id"] in [r["id"] for r in op.activity()]
    stays(lambda: not requests_to(connector, TEAMS_SILENT), what="nothing posted")


def test_with_an_app_id_an_unverifiable_token_gets_401_and_runs_no_turn(
    routes_template: DemoTemplate, tmp_path: Path, connector: Standin
) -> None:
    proc = prepared_service(
        routes_template,
        tmp_path / "svc-teams-auth",
        config={
            **FAST_RUNNERS,
            "teams": {
                "app_id": "00000000-0000-0000-0000-00000000a11d",
                "app_password": "not-a-real-password",
            },
        },
    )
    with proc.start():
        before = total_turns(proc)
        conversation = new_conversation()
        status, _ = post(
            proc,
            connector,
            "forged",
            conversation=conversation,
            tenant=OTHER_TENANT,
            token="garbage.not-a.jwt",
        )
        assert status == 401
        status, _ = post(
            proc, connector, "no token", conversation=conversation, tenant=OTHER_TENANT
        )
        assert status == 401
        stays(
            lambda: total_turns(proc) == before and not requests_to(connector, conversation),
            what="no turn and no post",
        )
