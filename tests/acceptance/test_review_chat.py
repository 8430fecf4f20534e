"""Review cards and chat decisions through the real service (issue 13, "Show").

One ``leadgate serve`` process for the module with Slack, Teams (local no-auth mode) and
Discord on, each pointed at its stand-in (subprocesses); the real SDKs talk to them. The
demo organization has review destinations on all three (``leadgate notify add``; the
Teams conversation is learned from a ``conversationUpdate`` first, as an operator would
do it) and two console users linked on every platform (``leadgate user link``): a
Member, who may decide, and a Viewer, who may not. Interactions are signed for real
(Slack signing secret, Discord Ed25519).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from http.cookiejar import CookieJar
from typing import Any
from urllib.parse import urlencode

import pytest
from nacl.signing import SigningKey
from slack_sdk.signature import SignatureVerifier

from tests.acceptance.channel_kit import (
    DISCORD_WORK_GUILD,
    FAST_RUNNERS,
    SLACK_WORK,
    TEAMS_WORK_TENANT,
    Operator,
    Standin,
    admin_batch,
    channel_template,
    get_json,
    http,
    prepared_service,
    stays,
    wait_until,
)
from tests.service_proc import AdminError, DemoTemplate, ServiceProcess
from tests.standins.connector import invoke_activity, message_activity

SECRET = "review-signing-secret"
TOKEN = "xoxb-review"
TEAM = "T0ACCEPT"
REVIEW_SLACK = "C0REVIEW"
DISCORD_TOKEN = "discord-review-bot-token"
DISCORD_APP = "1100000000000000001"
REVIEW_DISCORD = "920000000000000001"
REVIEW_TEAMS = "19:reviews@thread.tacv2"
KEY = SigningKey.generate()

MEMBER = {
    "email": "member@demo.io",
    "slack": "U0MEMBER",
    "teams": "0000aaaa-0000-0000-0000-00000000a001",
    "discord": "1300000000000000001",
}
VIEWER = {
    "email": "viewer@demo.io",
    "slack": "U0VIEWER",
    "teams": "0000aaaa-0000-0000-0000-00000000a002",
    "discord": "1300000000000000002",
}
PASSWORD = "review-password-1"
FORBIDDEN = "You cannot review in this organization."

_seq = itertools.count(1)


def new_ts() -> str:
    return f"{int(time.time())}.{next(_seq):06d}"


def snowflake() -> str:
    return str(((int(time.time() * 1000) - 1_420_070_400_000) << 22) | (next(_seq) + 8192))


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def slack_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    with Standin("slack_api", "--token", TOKEN, log_dir=tmp_path_factory.mktemp("slack")) as s:
        yield s


@pytest.fixture(scope="module")
def connector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    with Standin("connector", log_dir=tmp_path_factory.mktemp("connector")) as s:
        yield s


@pytest.fixture(scope="module")
def discord_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    log_dir = tmp_path_factory.mktemp("discord")
    args = ("--token", DISCORD_TOKEN, "--application-id", DISCORD_APP)
    with Standin("discord_api", *args, log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    slack_api: Standin,
    connector: Standin,
    discord_api: Standin,
) -> Iterator[ServiceProcess]:
    template = channel_template(demo_template, lambda: tmp_path_factory.mktemp("routes"))
    org = template.demo.org
    admin: list[list[str]] = []
    for person, role in ((MEMBER, "Member"), (VIEWER, "Viewer")):
        email = person["email"]
        admin.append(
            [
                "user",
                "create",
                "--org",
                org,
                "--email",
                email,
                "--role",
                role,
                "--password",
                PASSWORD,
            ]
        )
        admin += [
            [
                "user",
                "link",
                "--org",
                org,
                "--email",
                email,
                "--slack",
                f"{TEAM}:{person['slack']}",
            ],
            ["user", "link", "--org", org, "--email", email, "--teams", person["teams"]],
            ["user", "link", "--org", org, "--email", email, "--discord", person["discord"]],
        ]
    admin += [
        ["notify", "add", "--org", org, "--channel", "slack", "--to", f"{TEAM}:{REVIEW_SLACK}"],
        ["notify", "add", "--org", org, "--channel", "discord", "--to", REVIEW_DISCORD],
    ]
    proc = prepared_service(
        template,
        tmp_path_factory.mktemp("svc-review"),
        admin=admin,
        config={
            **FAST_RUNNERS,
            "slack": {
                "signing_secret": SECRET,
                "bot_token": TOKEN,
                "api_url": f"{slack_api.url}/api/",
            },
            "teams": {"enabled": True},
            "discord": {
                "public_key": KEY.verify_key.encode().hex(),
                "bot_token": DISCORD_TOKEN,
                "application_id": DISCORD_APP,
                "api_url": f"{discord_api.url}/api/v10",
                "gateway_url": f"ws://127.0.0.1:{discord_api.port}/gateway",
            },
        },
    )
    with service_guard(proc.start()):
        # Teams: the operator adds the app to the review channel (a conversationUpdate);
        # leadgate learns the conversation, and `notify add` can then name it by its id.
        update = message_activity(
            service_url=connector.url, text="", conversation_id=REVIEW_TEAMS, tenant_id="t-rev"
        )
        update.update(type="conversationUpdate", membersAdded=[{"id": "28:leadgate-bot"}])
        status, _ = http("POST", f"{proc.url}/api/messages", json_body=update)
        assert status in (200, 201, 202)

        def teams_destination() -> bool:
            try:
                args = ["notify", "add", "--org", org, "--channel", "teams", "--to", REVIEW_TEAMS]
                admin_batch(proc, [args])
            except AdminError as exc:
                assert exc.rule == "notify.teams_unknown_conversation", exc
                return False
            return True

        wait_until(teams_destination, interval=0.3, what="the Teams review conversation")
        wait_until(
            lambda: get_json(f"{discord_api.url}/_standin/gateway")["ready"] >= 1,
            what="the service's gateway session",
        )
        yield proc


# -------------------------------------------------------------------------- Slack


def slack_event(channel: str, text: str, ts: str) -> str:
    event = {"type": "message", "channel": channel, "user": "U0ASKER", "text": text, "ts": ts}
    return json.dumps(
        {
            "team_id": TEAM,
            "api_app_id": "A0LEADGATE",
            "event": event,
            "type": "event_callback",
            "event_id": f"Ev{uuid.uuid4().hex[:12].upper()}",
            "event_time": int(time.time()),
        }
    )


def signed(body: str, content_type: str, secret: str = SECRET) -> dict[str, str]:
    timestamp = str(int(time.time()))
    signature = SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body)
    assert signature is not None
    return {
        "Content-Type": content_type,
        "X-Slack-Request-Timestamp": timestamp,
        "X-Slack-Signature": signature,
    }


def slack_post(
    svc: ServiceProcess, body: str, *, form: bool, secret: str = SECRET
) -> tuple[int, bytes]:
    kind = "application/x-www-form-urlencoded" if form else "application/json"
    return http(
        "POST", f"{svc.url}/slack/events", data=body.encode(), headers=signed(body, kind, secret)
    )


def escalate_in_slack(svc: ServiceProcess, marker: str) -> str:
    """Ask the reviewed worker something its lead escalates; returns the thread ts."""
    ts = new_ts()
    status, _ = slack_post(
        svc, slack_event(SLACK_WORK, f"decide {marker} #escalate #complete", ts), form=False
    )
    assert status == 200
    return ts


def waiting_in_slack(
    svc: ServiceProcess, slack_api: Standin
) -> tuple[Operator, str, dict[str, Any], str]:
    """An item escalated from Slack: (operator, its marker, its Slack card, its id)."""
    marker = uuid.uuid4().hex[:10]
    escalate_in_slack(svc, marker)
    card = slack_card(slack_api, marker)
    return Operator(svc), marker, card, buttons(card)["approve"]["value"]


def slack_card(slack_api: Standin, marker: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        for post in slack_api.records("posts"):
            if post["channel"] == REVIEW_SLACK and post.get("blocks") and marker in post["text"]:
                return post
        return None

    return wait_until(find, what=f"the Slack review card for {marker}")


def buttons(card: dict[str, Any]) -> dict[str, dict[str, Any]]:
    actions = next(b for b in card["blocks"] if b["type"] == "actions")
    return {e["action_id"]: {**e, "block_id": actions["block_id"]} for e in actions["elements"]}


def interaction(
    slack_api: Standin, card: dict[str, Any], action_id: str, user: str, name: str
) -> str:
    button = buttons(card)[action_id]
    payload = {
        "type": "block_actions",
        "team": {"id": TEAM, "domain": "accept"},
        "user": {"id": user, "username": user.lower(), "team_id": TEAM},
        "api_app_id": "A0LEADGATE",
        "token": "legacy-token",
        "trigger_id": f"trigger-{name}",
        "container": {"type": "message", "message_ts": card["ts"], "channel_id": REVIEW_SLACK},
        "channel": {"id": REVIEW_SLACK, "name": "reviews"},
        "message": {"type": "message", "ts": card["ts"], "text": card["text"]},
        "response_url": f"{slack_api.url}/response/{name}",
        "actions": [
            {
                "type": "button",
                "action_id": action_id,
                "block_id": button["block_id"],
                "value": button["value"],
                "action_ts": str(time.time()),
            }
        ],
    }
    return urlencode({"payload": json.dumps(payload)})


def click(
    svc: ServiceProcess, slack_api: Standin, card: dict[str, Any], action: str, user: str
) -> str:
    """A signed block_actions click; asserts the 200 ack; returns the response_url name."""
    name = uuid.uuid4().hex[:10]
    status, body = slack_post(svc, interaction(slack_api, card, action, user, name), form=True)
    assert status == 200, body
    return name


def submit(
    svc: ServiceProcess, view: dict[str, Any], user: str, text: str, *, secret: str = SECRET
) -> tuple[int, Any]:
    block = next(b for b in view["blocks"] if b["type"] == "input")
    payload = {
        "type": "view_submission",
        "team": {"id": TEAM, "domain": "accept"},
        "user": {"id": user, "username": user.lower(), "team_id": TEAM},
        "api_app_id": "A0LEADGATE",
        "token": "legacy-token",
        "trigger_id": "trigger-submit",
        "view": {
            "id": "V0001",
            "type": "modal",
            "callback_id": view["callback_id"],
            "private_metadata": view["private_metadata"],
            "state": {
                "values": {
                    block["block_id"]: {
                        block["element"]["action_id"]: {"type": "plain_text_input", "value": text}
                    }
                }
            },
            "hash": "h1",
        },
        "response_urls": [],
    }
    status, raw = slack_post(
        svc, urlencode({"payload": json.dumps(payload)}), form=True, secret=secret
    )
    return status, (json.loads(raw) if raw else None)


def calls(slack_api: Standin, method: str, **match: Any) -> list[dict[str, Any]]:
    return [
        c
        for c in slack_api.records("calls")
        if c["method"] == method and all(c.get(k) == v for k, v in match.items())
    ]


def thread_posts(slack_api: Standin, channel: str, thread: str) -> list[dict[str, Any]]:
    return [
        p
        for p in slack_api.records("posts")
        if p["channel"] == channel and p["thread_ts"] == thread
    ]


def block_text(blocks: list[dict[str, Any]]) -> str:
    """The sections' texts, a section of fields (the facts) as its fields' texts, and
    a ``rich_text`` block (the outcome) as its text elements' texts, a line each of its
    section and quote."""
    texts: list[str] = []
    for b in blocks:
        if b["type"] == "section":
            texts += [b["text"]["text"]] if b.get("text") else [f["text"] for f in b["fields"]]
        elif b["type"] == "rich_text":
            texts += [
                "".join(e.get("text", "") for e in part["elements"]) for part in b["elements"]
            ]
    return "\n".join(texts)


def audit_of(op: Operator, item_id: str, action: str) -> list[dict[str, Any]]:
    return [a for a in op.detail(item_id)["audit"] if a["action"] == action]


# -------------------------------------------------------------------- Slack tests


def test_escalated_slack_turn_posts_cards_and_a_member_approves_from_slack(
    svc: ServiceProcess, slack_api: Standin, connector: Standin, discord_api: Standin
) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    thread = escalate_in_slack(svc, marker)
    card = slack_card(slack_api, marker)
    item_id = buttons(card)["approve"]["value"]
    assert {k: v["value"] for k, v in buttons(card).items()} == {
        "approve": item_id,
        "reject": item_id,
        "return": item_id,
    }
    assert card["unfurl_links"] is False and card["unfurl_media"] is False
    facts = block_text(card["blocks"])
    assert "*Agent*\nworker" in facts and "The lead escalated it: Needs a human." in facts
    assert f"Slack channel {SLACK_WORK} in {TEAM}, thread {thread}" in facts
    assert f"/console/#/review/{item_id}|Open in the leadgate console>" in json.dumps(
        card["blocks"]
    )
    # Every destination got exactly one card: Teams and Discord too.
    [teams_card] = wait_until(lambda: teams_cards(connector, marker), what="the Teams card")
    [discord_card] = wait_until(lambda: discord_cards(discord_api, marker), what="the Discord card")
    assert op.detail(item_id)["status"] == "awaitingHuman"
    assert not thread_posts(slack_api, SLACK_WORK, thread)  # nothing visible yet

    name = click(svc, slack_api, card, "approve", MEMBER["slack"])

    op.wait_item(marker, "completed")
    answer = wait_until(lambda: thread_posts(slack_api, SLACK_WORK, thread), what="the answer")
    assert [p["text"] for p in answer] == [f"Echo: decide {marker} #escalate #complete"]
    updated = wait_until(
        lambda: calls(slack_api, "chat.update", channel=REVIEW_SLACK, ts=card["ts"]),
        what="the Slack card update",
    )
    assert len(updated) == 1
    assert not any(b["type"] == "actions" for b in updated[0]["blocks"])
    assert "Approved by member@demo.io (slack)" in block_text(updated[0]["blocks"])
    # One decision, shown everywhere: the Teams card is replaced, the Discord card edited.
    wait_until(lambda: teams_updates(connector, teams_card["id"]), what="the Teams card update")
    edit = wait_until(
        lambda: discord_edits(discord_api, discord_card["id"]), what="the Discord edit"
    )
    assert "**Approved** by member@demo.io (slack)" in edit[0]["content"]
    assert edit[0]["components"] == [] or all(
        c.get("style") == 5 for row in edit[0]["components"] for c in row["components"]
    )
    [approval] = audit_of(op, item_id, "approve")
    assert (approval["surface"], approval["identity"]) == (
        "slack",
        f"slack:{TEAM}:{MEMBER['slack']}",
    )
    assert not calls(slack_api, "response_url", name=name)  # the decider is not nagged
    stays(lambda: len(thread_posts(slack_api, SLACK_WORK, thread)) == 1, what="one answer")


def test_unlinked_and_viewer_clicks_change_nothing(svc: ServiceProcess, slack_api: Standin) -> None:
    op, _, card, item_id = waiting_in_slack(svc, slack_api)
    before = op.detail(item_id)["audit"]
    names = [
        click(svc, slack_api, card, "approve", "U0STRANGER"),
        click(svc, slack_api, card, "approve", VIEWER["slack"]),
        click(svc, slack_api, card, "reject", VIEWER["slack"]),
    ]
    for name in names:
        [told] = wait_until(partial(calls, slack_api, "response_url", name=name), what="the answer")
        assert (told["text"], told["response_type"], told["replace_original"]) == (
            FORBIDDEN,
            "ephemeral",
            False,
        )
        assert told["authorization"] is None
    assert not calls(slack_api, "views.open", trigger_id=f"trigger-{names[2]}")
    detail = op.detail(item_id)
    assert detail["status"] == "awaitingHuman" and detail["audit"] == before
    assert not calls(slack_api, "chat.update", ts=card["ts"])


def test_two_concurrent_approve_clicks_make_one_decision(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    op, marker, card, item_id = waiting_in_slack(svc, slack_api)
    bodies = [
        interaction(slack_api, card, "approve", MEMBER["slack"], f"race-{marker}-{i}")
        for i in range(2)
    ]
    statuses: list[int] = []
    start = threading.Barrier(2)

    def go(body: str) -> None:
        start.wait()
        statuses.append(slack_post(svc, body, form=True)[0])

    threads = [threading.Thread(target=go, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200, 200]
    told = wait_until(
        lambda: [
            c
            for c in slack_api.records("calls")
            if c.get("name", "").startswith(f"race-{marker}")
            and c.get("response_type") == "ephemeral"
        ],
        what="the second clicker's answer",
    )
    assert len(told) == 1
    assert told[0]["text"].startswith("Already approved by member@demo.io (slack) at ")
    # Before that line, the second clicker's card was shown decided in place.
    [shown] = [
        c
        for c in slack_api.records("calls")
        if c.get("name") == told[0]["name"] and c.get("replace_original") is True
    ]
    assert not any(b["type"] == "actions" for b in shown["blocks"])
    op.wait_item(marker, "completed")
    assert len(audit_of(op, item_id, "approve")) == 1
    # The card's update is a delivery of its own, which may land after the item is
    # completed (a slow VM showed it): wait for it, then check no second one follows.
    wait_until(lambda: calls(slack_api, "chat.update", ts=card["ts"]), what="the card update")
    stays(lambda: len(calls(slack_api, "chat.update", ts=card["ts"])) == 1, what="one card update")


def test_reject_through_the_modal_records_the_reason(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    op, marker, card, item_id = waiting_in_slack(svc, slack_api)
    name = click(svc, slack_api, card, "reject", MEMBER["slack"])
    [opened] = wait_until(
        lambda: calls(slack_api, "views.open", trigger_id=f"trigger-{name}"), what="the modal"
    )
    view = opened["view"]
    assert view["callback_id"] == "lg_reject" and opened["team_id"] == TEAM
    assert op.detail(item_id)["status"] == "awaitingHuman"

    status, answer = submit(svc, view, MEMBER["slack"], "   ")
    assert status == 200
    assert answer == {"response_action": "errors", "errors": {"reason_b": "reason is required"}}
    status, answer = submit(svc, view, MEMBER["slack"], "The numbers are made up.")
    assert (status, answer) == (200, None)

    detail = op.wait_item(marker, "rejected")
    [rejection] = audit_of(op, item_id, "reject")
    assert rejection["text"] == "The numbers are made up."
    assert (rejection["surface"], rejection["identity"]) == (
        "slack",
        f"slack:{TEAM}:{MEMBER['slack']}",
    )
    assert detail["status"] == "rejected"
    [updated] = wait_until(
        lambda: calls(slack_api, "chat.update", ts=card["ts"]), what="card update"
    )
    assert "Rejected by member@demo.io (slack)" in block_text(updated["blocks"])
    assert "\nThe numbers are made up." in block_text(updated["blocks"])
    # A modal submitted after the decision is told so (the view is replaced).
    status, late = submit(svc, view, MEMBER["slack"], "again")
    assert status == 200 and late["response_action"] == "update"
    assert "Already rejected by member@demo.io (slack)" in json.dumps(late["view"])


def test_a_console_approval_updates_the_slack_card(svc: ServiceProcess, slack_api: Standin) -> None:
    _, _, card, item_id = waiting_in_slack(svc, slack_api)
    cookie = _session_cookie(svc)
    status, raw = http(
        "POST",
        f"{svc.url}/operator/reviews/{item_id}/approve",
        json_body={},
        headers={"Cookie": cookie, "X-Leadgate-Console": "1"},
    )
    assert status == 200, raw
    [updated] = wait_until(
        lambda: calls(slack_api, "chat.update", ts=card["ts"]), what="card update"
    )
    assert "Approved by member@demo.io (console)" in block_text(updated["blocks"])
    assert not any(b["type"] == "actions" for b in updated["blocks"])
    # A late click on the updated card answers with that outcome, and changes nothing.
    name = click(svc, slack_api, card, "approve", MEMBER["slack"])

    def answered() -> list[dict[str, Any]]:
        found = calls(slack_api, "response_url", name=name)
        return found if len(found) >= 2 else []

    [shown, told] = wait_until(answered, what="the answer")
    # The clicked card is shown decided in place (whether or not the outbox's edit has
    # landed yet), then the clicker is told who decided.
    assert shown["replace_original"] is True
    assert "Approved by member@demo.io (console)" in block_text(shown["blocks"])
    assert told["response_type"] == "ephemeral"
    assert told["text"].startswith("Already approved by member@demo.io (console) at ")


def _session_cookie(svc: ServiceProcess) -> str:
    """Log in to the console as the Member; the session cookie header."""
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    request = urllib.request.Request(
        f"{svc.url}/console/login",
        data=json.dumps({"email": MEMBER["email"], "password": PASSWORD}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with opener.open(request, timeout=10) as resp:
        assert resp.status == 200
    return "; ".join(f"{c.name}={c.value}" for c in jar)


def test_a_forged_signature_is_401_and_no_get_decides(
    svc: ServiceProcess, slack_api: Standin
) -> None:
    op, _, card, item_id = waiting_in_slack(svc, slack_api)
    body = interaction(slack_api, card, "approve", MEMBER["slack"], "forged")
    status, _ = slack_post(svc, body, form=True, secret="not-the-secret")
    assert status == 401
    # GETs decide nothing: the events endpoint has no GET, the console link is a page.
    assert http("GET", f"{svc.url}/slack/events?payload=x")[0] == 405
    link = next(e for b in card["blocks"] if b["type"] == "context" for e in b["elements"])
    url = link["text"].split("|")[0].lstrip("<")
    status, page = http("GET", url.replace("http://127.0.0.1:8080", svc.url))
    assert status == 200 and b"<html" in page.lower()
    stays(lambda: op.detail(item_id)["status"] == "awaitingHuman", what="still waiting")
    assert not calls(slack_api, "response_url", name="forged")


# -------------------------------------------------------------------------- Teams


def teams_cards(connector: Standin, marker: str) -> list[dict[str, Any]]:
    found = []
    for record in connector.records("activities"):
        activity = record["activity"]
        if record["conversation_id"] != REVIEW_TEAMS or not activity.get("attachments"):
            continue
        if marker in json.dumps(activity["attachments"]):
            found.append(record)
    return found


def teams_updates(connector: Standin, activity_id: str) -> list[dict[str, Any]]:
    return [u for u in connector.records("updates") if u["reply_to_id"] == activity_id]


def escalate_in_teams(svc: ServiceProcess, connector: Standin, marker: str) -> str:
    conversation = f"19:{uuid.uuid4().hex[:16]}@thread.tacv2"
    activity = message_activity(
        service_url=connector.url,
        text=f"decide {marker} #escalate #complete",
        conversation_id=conversation,
        tenant_id=TEAMS_WORK_TENANT,
        mention_bot=True,
    )
    status, _ = http("POST", f"{svc.url}/api/messages", json_body=activity)
    assert status in (200, 202)
    return conversation


def invoke(
    svc: ServiceProcess,
    connector: Standin,
    card: dict[str, Any],
    verb: str,
    aad: str,
    **inputs: str,
) -> tuple[int, Any]:
    content = card["activity"]["attachments"][0]["content"]
    actions = {
        a.get("verb") or a["card"]["actions"][0]["verb"]: a
        for a in content["actions"]
        if a["type"] != "Action.OpenUrl"
    }
    action = actions[verb]
    data = dict(action.get("data") or action["card"]["actions"][0]["data"])
    data.update(inputs)
    activity = invoke_activity(
        service_url=connector.url,
        verb=verb,
        data=data,
        reply_to_id=card["id"],
        conversation_id=REVIEW_TEAMS,
        aad_object_id=aad,
    )
    status, raw = http("POST", f"{svc.url}/api/messages", json_body=activity)
    return status, json.loads(raw) if raw else None


def test_teams_card_approve_and_reject(svc: ServiceProcess, connector: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    conversation = escalate_in_teams(svc, connector, marker)
    card = wait_until(lambda: teams_cards(connector, marker), what="the Teams card")[0]
    content = card["activity"]["attachments"][0]
    assert content["contentType"] == "application/vnd.microsoft.card.adaptive"
    assert content["content"]["actions"][0]["type"] == "Action.Execute"

    status, answer = invoke(svc, connector, card, "approve", VIEWER["teams"])
    assert (status, answer) == (
        200,
        {
            "statusCode": 200,
            "type": "application/vnd.microsoft.activity.message",
            "value": FORBIDDEN,
        },
    )
    status, answer = invoke(svc, connector, card, "approve", MEMBER["teams"])
    assert status == 200 and answer["type"] == "application/vnd.microsoft.card.adaptive"
    assert "Approved by member@demo.io (teams)" in json.dumps(answer["value"])
    assert not any(a["type"] == "Action.Execute" for a in answer["value"]["actions"])
    detail = op.wait_item(marker, "completed")
    posted = [a for a in connector.records("activities") if a["conversation_id"] == conversation]
    assert [p["activity"]["text"] for p in posted] == [f"Echo: decide {marker} #escalate #complete"]
    wait_until(lambda: teams_updates(connector, card["id"]), what="the card replaced in place")
    [approval] = audit_of(op, detail["id"], "approve")
    assert (approval["surface"], approval["identity"]) == ("teams", f"teams:{MEMBER['teams']}")

    marker = uuid.uuid4().hex[:10]
    escalate_in_teams(svc, connector, marker)
    card = wait_until(lambda: teams_cards(connector, marker), what="the second Teams card")[0]
    status, answer = invoke(svc, connector, card, "reject", MEMBER["teams"], reason="")
    assert status == 200 and answer["value"] == "reason is required"
    status, answer = invoke(svc, connector, card, "reject", MEMBER["teams"], reason="Wrong tone.")
    assert status == 200 and "Rejected by member@demo.io (teams)" in json.dumps(answer["value"])
    detail = op.wait_item(marker, "rejected")
    assert audit_of(op, detail["id"], "reject")[0]["text"] == "Wrong tone."


# ------------------------------------------------------------------------ Discord


def discord_cards(discord_api: Standin, marker: str) -> list[dict[str, Any]]:
    return [
        p
        for p in discord_api.records("posts")
        if p["op"] == "create_message"
        and p["channel_id"] == REVIEW_DISCORD
        and marker in p["content"]
    ]


def discord_edits(discord_api: Standin, message_id: str) -> list[dict[str, Any]]:
    return [
        p
        for p in discord_api.records("posts")
        if p["op"] == "edit_message" and p["message_id"] == message_id
    ]


def sign(body: bytes, key: SigningKey = KEY) -> dict[str, str]:
    timestamp = str(int(time.time()))
    return {
        "Content-Type": "application/json",
        "X-Signature-Ed25519": key.sign(timestamp.encode() + body).signature.hex(),
        "X-Signature-Timestamp": timestamp,
    }


def discord_interaction(
    svc: ServiceProcess, payload: dict[str, Any], key: SigningKey = KEY
) -> tuple[int, Any]:
    body = json.dumps(payload).encode()
    status, raw = http(
        "POST", f"{svc.url}/discord/interactions", data=body, headers=sign(body, key)
    )
    return status, json.loads(raw) if raw.startswith(b"{") else raw


def component(card: dict[str, Any], label: str, user: str) -> dict[str, Any]:
    button = next(c for row in card["components"] for c in row["components"] if c["label"] == label)
    return {
        "type": 3,
        "id": snowflake(),
        "application_id": DISCORD_APP,
        "token": f"itok-{uuid.uuid4().hex}",
        "version": 1,
        "guild_id": "930000000000000001",
        "channel_id": REVIEW_DISCORD,
        "member": {"user": {"id": user, "username": "reviewer"}, "roles": [], "flags": 0},
        "message": {"id": card["id"], "channel_id": REVIEW_DISCORD, "content": card["content"]},
        "data": {"custom_id": button["custom_id"], "component_type": 2},
    }


def test_discord_card_approve_and_reject(svc: ServiceProcess, discord_api: Standin) -> None:
    op = Operator(svc)
    marker = uuid.uuid4().hex[:10]
    channel = snowflake()
    ask = {
        "type": 2,
        "id": snowflake(),
        "application_id": DISCORD_APP,
        "token": f"itok-{uuid.uuid4().hex}",
        "version": 1,
        "guild_id": DISCORD_WORK_GUILD,
        "channel_id": channel,
        "member": {"user": {"id": "1100000000000000100", "username": "asker"}},
        "data": {
            "name": "ask",
            "type": 1,
            "options": [
                {"name": "message", "type": 3, "value": f"decide {marker} #escalate #complete"}
            ],
        },
    }
    assert discord_interaction(svc, ask) == (200, {"type": 5})
    card = wait_until(lambda: discord_cards(discord_api, marker), what="the Discord card")[0]
    assert len(card["content"]) <= 2000
    labels = [c["label"] for row in card["components"] for c in row["components"]]
    assert labels == ["Approve", "Reject", "Return to worker", "Open in the console"]
    # Each button names the card's own delivery, within Discord's 100 characters.
    custom_ids = [c["custom_id"] for row in card["components"] for c in row["components"][:3]]
    assert [x.split(":")[1] for x in custom_ids] == ["approve", "reject", "return"]
    assert all(x.split(":")[3].startswith("c=dlv_") and len(x) <= 100 for x in custom_ids)

    forged = discord_interaction(
        svc, component(card, "Approve", MEMBER["discord"]), SigningKey.generate()
    )
    assert forged[0] == 401
    status, answer = discord_interaction(svc, component(card, "Approve", VIEWER["discord"]))
    assert (status, answer["type"], answer["data"]["content"], answer["data"]["flags"]) == (
        200,
        4,
        FORBIDDEN,
        64,
    )
    status, answer = discord_interaction(svc, component(card, "Approve", MEMBER["discord"]))
    assert status == 200 and answer["type"] == 7
    assert "**Approved** by member@demo.io (discord)" in answer["data"]["content"]
    detail = op.wait_item(marker, "completed")
    answers = [
        p
        for p in discord_api.records("posts")
        if p["op"] == "create_message" and p["channel_id"] == channel
    ]
    assert [p["content"] for p in answers] == [f"Echo: decide {marker} #escalate #complete"]
    wait_until(lambda: discord_edits(discord_api, card["id"]), what="the card edited by the outbox")
    [approval] = audit_of(op, detail["id"], "approve")
    assert (approval["surface"], approval["identity"]) == (
        "discord",
        f"discord:{MEMBER['discord']}",
    )

    marker = uuid.uuid4().hex[:10]
    ask.update(id=snowflake(), token=f"itok-{uuid.uuid4().hex}", channel_id=snowflake())
    ask["data"]["options"][0]["value"] = f"decide {marker} #escalate #complete"  # type: ignore[index]
    assert discord_interaction(svc, ask) == (200, {"type": 5})
    card = wait_until(lambda: discord_cards(discord_api, marker), what="the second card")[0]
    status, modal = discord_interaction(svc, component(card, "Reject", MEMBER["discord"]))
    assert status == 200 and modal["type"] == 9
    field = modal["data"]["components"][0]["components"][0]
    assert (field["custom_id"], field["max_length"]) == ("reason", 2000)
    # The form carries the card on to its submission.
    [reject] = [c["custom_id"] for r in card["components"] for c in r["components"][1:2]]
    assert modal["data"]["custom_id"] == reject.replace(":reject:", ":reject_modal:", 1)
    submitted = {
        **component(card, "Reject", MEMBER["discord"]),
        "type": 5,
        "data": {
            "custom_id": modal["data"]["custom_id"],
            "components": [
                {
                    "type": 1,
                    "components": [{"type": 4, "custom_id": "reason", "value": "Off topic."}],
                }
            ],
        },
    }
    status, answer = discord_interaction(svc, submitted)
    assert status == 200 and answer["type"] == 7
    detail = op.wait_item(marker, "rejected")
    assert audit_of(op, detail["id"], "reject")[0]["text"] == "Off topic."
