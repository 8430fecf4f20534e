"""The relay with the real SlackChannel (slack-sdk) against the Slack Web API stand-in,
and operator recovery through the HTTP routes, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer

from bots.slack import SlackChannel
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings, SlackSettings
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import workitems
from leadgate.review import queue
from outbox.relay import Relay
from outbox.store import SEND_DEADLINE_S
from tests.helpers import Org, fake_clock, make_agent, make_org
from tests.outbox_support import MigratedTemplates, seed_items
from tests.standins.slack_api import SlackApiStandin

TOKEN = "xoxb-outbox-test"


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplates:
    return MigratedTemplates(tmp_path_factory.mktemp("outbox-slack-templates"))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, templates: MigratedTemplates, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return templates.sqlite_url(tmp_path / "t.db")
    return templates.pg_url(request.getfixturevalue("postgres_server"))


@pytest.fixture
async def slack() -> AsyncIterator[SlackApiStandin]:
    async with SlackApiStandin(token=TOKEN) as standin:
        yield standin


def slack_channel(standin: SlackApiStandin, timeout_s: float = 10.0) -> SlackChannel:
    return SlackChannel(
        SlackSettings(signing_secret="s", bot_token=TOKEN, api_url=standin.api_url),
        timeout_s=timeout_s,
    )


@pytest.fixture
async def svc(url: str, slack: SlackApiStandin) -> AsyncIterator[App]:
    settings = Settings.model_validate({"database": {"url": url}})
    service = App(
        settings,
        clock=FakeClock(),
        channels={"slack": slack_channel(slack)},
        enable_adapters=False,
    )
    yield service
    await service.stop()


@pytest.fixture
async def org(svc: App) -> Org:
    return await make_org(svc)


async def seed(svc: App, org: Org, n: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    lead = await make_agent(svc, org, "lead")
    worker = await make_agent(svc, org, "worker", lead="lead")
    seeded = await seed_items(
        svc.db, svc.clock, svc.ids, n, org=(org.id, worker["id"], lead["id"]), **kwargs
    )
    return seeded.deliveries


def relay(svc: App) -> Relay:
    return Relay(svc.db, svc.clock, svc.ids, svc.channels, rand=lambda: 0.0)


async def row_of(svc: App, delivery_id: str) -> dict[str, Any]:
    async with svc.db.read() as conn:
        found = (
            await conn.execute(sa.select(t.deliveries).where(t.deliveries.c.id == delivery_id))
        ).first()
    assert found is not None
    return dict(found._mapping)


async def item_status(svc: App, item_id: str) -> str:
    async with svc.db.read() as conn:
        return str((await workitems.get(conn, item_id)).status)


def clock(svc: App) -> FakeClock:
    return fake_clock(svc)


# ---------------------------------------------------------------------- outcomes


async def test_success_posts_into_the_thread(svc: App, org: Org, slack: SlackApiStandin) -> None:
    (dlv,) = await seed(svc, org)
    await drain(relay(svc))
    assert slack.posts == [
        {
            "channel": dlv["address"]["channel"],
            "text": dlv["text"],
            "thread_ts": dlv["address"]["thread_ts"],
            "ts": slack.posts[0]["ts"],
        }
    ]
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["external_id"]) == ("sent", slack.posts[0]["ts"])
    assert await item_status(svc, dlv["work_item_id"]) == "completed"


async def test_429_is_retried_after_retry_after(svc: App, org: Org, slack: SlackApiStandin) -> None:
    (dlv,) = await seed(svc, org)
    slack.queue("ratelimited:7")
    now = clock(svc).now_ms()
    await drain(relay(svc))
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["next_attempt_at"]) == ("pending", now + 7_000)
    assert "429" in row["error"] and slack.posts == []
    clock(svc).advance(6_999)
    await drain(relay(svc))
    assert len(slack.requests) == 1
    clock(svc).advance(1)
    await drain(relay(svc))
    assert [p["text"] for p in slack.posts] == [dlv["text"]]
    assert (await row_of(svc, dlv["id"]))["status"] == "sent"
    assert await item_status(svc, dlv["work_item_id"]) == "completed"


async def test_500_is_retried_with_backoff(svc: App, org: Org, slack: SlackApiStandin) -> None:
    (dlv,) = await seed(svc, org)
    slack.queue("500", "503")
    now = clock(svc).now_ms()
    await drain(relay(svc))
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["next_attempt_at"]) == ("pending", now + 500)
    clock(svc).advance(500)
    await drain(relay(svc))
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["attempts"]) == ("pending", 2)
    assert row["next_attempt_at"] == clock(svc).now_ms() + 1_000
    clock(svc).advance(1_000)
    await drain(relay(svc))
    assert len(slack.posts) == 1 and len(slack.requests) == 3
    assert (await row_of(svc, dlv["id"]))["status"] == "sent"


async def test_channel_not_found_fails_delivery_and_item(
    svc: App, org: Org, slack: SlackApiStandin
) -> None:
    (dlv,) = await seed(svc, org)
    slack.set_channel_mode(dlv["address"]["channel"], "channel_not_found")
    await drain(relay(svc))
    row = await row_of(svc, dlv["id"])
    assert row["status"] == "failed" and "channel_not_found" in row["error"]
    assert await item_status(svc, dlv["work_item_id"]) == "failed"
    clock(svc).advance(3_600_000)
    await drain(relay(svc))
    assert len(slack.requests) == 1


@pytest.mark.parametrize("mode", ["hang", "reset"])
async def test_uncertain_sends_are_delivery_unknown_and_never_reposted(
    svc: App, org: Org, slack: SlackApiStandin, mode: str
) -> None:
    svc.channels["slack"] = slack_channel(slack, timeout_s=0.3)
    (dlv,) = await seed(svc, org)
    slack.queue(mode)
    await drain(relay(svc))
    row = await row_of(svc, dlv["id"])
    assert row["status"] == "deliveryUnknown", row
    assert await item_status(svc, dlv["work_item_id"]) == "approved"
    async with svc.db.read() as conn:
        page = await queue.actionable(conn, org.id)
    assert [(i["id"], i["reason"]) for i in page["items"]] == [
        (dlv["work_item_id"], "deliveryUnknown")
    ]
    for _ in range(2):
        clock(svc).advance(600_000)
        await drain(relay(svc))
    assert len(slack.requests) == 1 and slack.posts == []
    await svc.channels["slack"].close()


async def test_long_message_is_split_at_slack_limit(
    svc: App, org: Org, slack: SlackApiStandin
) -> None:
    words = [f"w{i:05d}" for i in range(15_000)]  # 104,999 characters
    text = " ".join(words)
    (dlv,) = await seed(svc, org, text=lambda _: text)
    await drain(relay(svc))
    parts = [p["text"] for p in slack.posts]
    assert len(parts) == 3 and all(len(p) <= 40_000 for p in parts)
    assert " ".join(parts).split() == words
    assert {p["thread_ts"] for p in slack.posts} == {dlv["address"]["thread_ts"]}
    assert (await row_of(svc, dlv["id"]))["external_id"] == slack.posts[0]["ts"]


async def test_a_long_message_has_one_send_deadline_for_all_its_parts(
    svc: App, org: Org, slack: SlackApiStandin
) -> None:
    """Each part of a long message had a whole send of its own (30 s each on Slack):
    three slow parts kept the delivery past its 2-minute send lease, which took it back as
    deliveryUnknown. Now the parts share the delivery's send deadline: a part that could
    not end within what is left is not sent (a retry, nothing written), and the next
    attempt posts the rest, not the parts already posted."""
    words = [f"w{i:05d}" for i in range(15_000)]  # three parts
    (dlv,) = await seed(svc, org, text=lambda _: " ".join(words))

    async def slow_first_post(record: dict[str, Any]) -> None:
        # The first part took all but 5 s of the deadline; a post may take 10 s.
        slack.on_post = None
        clock(svc).advance(int((SEND_DEADLINE_S - 5) * 1000))

    slack.on_post = slow_first_post
    await drain(relay(svc))
    assert len(slack.requests) == 1 and len(slack.posts) == 1
    row = await row_of(svc, dlv["id"])
    assert row["status"] == "pending" and row["address"]["parts_posted"] == 1
    assert row["error"] == (
        "part 2 of 3: slack: 5 s left of the delivery's send deadline, less than the 10 s "
        "a post may take; nothing was sent"
    )
    clock(svc).advance(60_000)
    await drain(relay(svc))
    parts = [p["text"] for p in slack.posts]
    assert len(parts) == 3 and " ".join(parts).split() == words
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["external_id"]) == ("sent", slack.posts[0]["ts"])
    assert await item_status(svc, dlv["work_item_id"]) == "completed"


# ------------------------------------------------------------- operator recovery


@pytest.fixture
async def http(svc: App) -> AsyncIterator[TestClient[Any, Any]]:
    server = TestServer(svc.web_app(), host="127.0.0.1")
    async with TestClient(server) as client:
        yield client


async def unknown(svc: App, org: Org, slack: SlackApiStandin) -> dict[str, Any]:
    (dlv,) = await seed(svc, org)
    slack.queue("reset")
    await drain(relay(svc))
    assert (await row_of(svc, dlv["id"]))["status"] == "deliveryUnknown"
    return dlv


async def audit_of(svc: App, item_id: str) -> list[tuple[str, str]]:
    async with svc.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit.c.actor, t.audit.c.action)
                .where(t.audit.c.work_item_id == item_id)
                .order_by(t.audit.c.created_at, t.audit.c.id)
            )
        ).all()
    return [(r.actor, r.action) for r in rows]


async def test_confirm_completes_and_is_audited(
    svc: App, org: Org, slack: SlackApiStandin, http: TestClient[Any, Any]
) -> None:
    dlv = await unknown(svc, org, slack)
    auth = {"Authorization": f"Bearer {org.key}"}
    resp = await http.post(f"/operator/deliveries/{dlv['id']}/confirm", headers=auth)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["status"] == "completed"
    assert [d["status"] for d in body["deliveries"]] == ["sent"]
    assert any(a["action"] == "deliveryConfirmed" for a in body["audit"])
    actors = {actor for actor, action in await audit_of(svc, dlv["work_item_id"])}
    assert any(a.startswith("key:") or a.startswith("user:") for a in actors), actors
    again = await http.post(f"/operator/deliveries/{dlv['id']}/retry", headers=auth)
    assert again.status == 409
    await drain(relay(svc))
    assert slack.posts == []


async def test_retry_posts_exactly_once_more_and_is_audited(
    svc: App, org: Org, slack: SlackApiStandin, http: TestClient[Any, Any]
) -> None:
    dlv = await unknown(svc, org, slack)
    auth = {"Authorization": f"Bearer {org.key}"}
    resp = await http.post(f"/operator/deliveries/{dlv['id']}/retry", headers=auth)
    assert resp.status == 200, await resp.text()
    assert (await row_of(svc, dlv["id"]))["status"] == "pending"
    await drain(relay(svc))
    await drain(relay(svc))
    assert [p["text"] for p in slack.posts] == [dlv["text"]]
    row = await row_of(svc, dlv["id"])
    assert (row["status"], row["attempts"]) == ("sent", 2)
    assert await item_status(svc, dlv["work_item_id"]) == "completed"
    actions = [action for _, action in await audit_of(svc, dlv["work_item_id"])]
    assert actions[-3:] == ["deliveryUnknown", "deliveryRetried", "delivered"]


@pytest.mark.parametrize("action", ["confirm", "retry"])
async def test_double_click_one_wins_the_other_409(
    svc: App,
    org: Org,
    slack: SlackApiStandin,
    http: TestClient[Any, Any],
    action: str,
) -> None:
    dlv = await unknown(svc, org, slack)
    auth = {"Authorization": f"Bearer {org.key}"}
    path = f"/operator/deliveries/{dlv['id']}/{action}"
    first, second = await asyncio.gather(
        http.post(path, headers=auth), http.post(path, headers=auth)
    )
    assert sorted([first.status, second.status]) == [200, 409]
    loser = first if first.status == 409 else second
    assert (await loser.json())["error"]["code"] == "invalid_transition"
    await drain(relay(svc))
    expected = 0 if action == "confirm" else 1
    assert len(slack.posts) == expected
    async with svc.db.read() as conn:
        recoveries = await conn.scalar(
            sa.select(sa.func.count()).where(
                t.audit.c.delivery_id == dlv["id"],
                t.audit.c.action.in_(["deliveryConfirmed", "deliveryRetried"]),
            )
        )
        completions = await conn.scalar(
            sa.select(sa.func.count()).where(
                t.audit.c.work_item_id == dlv["work_item_id"], t.audit.c.to_status == "completed"
            )
        )
    assert (recoveries, completions) == (1, 1)


async def test_recovery_needs_delivery_unknown_and_the_right_org(
    svc: App, org: Org, slack: SlackApiStandin, http: TestClient[Any, Any]
) -> None:
    (dlv,) = await seed(svc, org)
    auth = {"Authorization": f"Bearer {org.key}"}
    pending = await http.post(f"/operator/deliveries/{dlv['id']}/confirm", headers=auth)
    assert pending.status == 409
    await drain(relay(svc))
    for action in ("confirm", "retry"):
        sent = await http.post(f"/operator/deliveries/{dlv['id']}/{action}", headers=auth)
        assert sent.status == 409
    other = await make_org(svc, "other")
    foreign = await http.post(
        f"/operator/deliveries/{dlv['id']}/confirm",
        headers={"Authorization": f"Bearer {other.key}"},
    )
    assert foreign.status == 404
    assert len(slack.posts) == 1
