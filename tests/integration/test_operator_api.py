"""The operator JSON API (SPEC 5) over real HTTP on 127.0.0.1: the actionable queue and
its cursor, the review detail, human decisions, delivery recovery, authentication by key
scope and console role, organization isolation, and GETs that never change state."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from leadgate.app import App
from leadgate.core.auth import Scope
from leadgate.core.clock import MINUTE_MS, FakeClock, iso
from leadgate.core.config import Settings
from leadgate.core.limits import REASON_LIMIT
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, upgrade
from leadgate.domain import orgs, workitems
from leadgate.review import decisions
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import OutboundMessage, Retry, SendOutcome, Uncertain
from outbox.store import (
    CARD_DECIDED_ERROR,
    IN_FLIGHT_AFTER_LAPSE_MS,
    SEND_LEASE_MS,
    get_delivery,
)
from tests.helpers import (
    Org,
    api_trigger,
    blocked_on_a_lock,
    deliveries_counted,
    held_open,
    make_agent,
    make_key,
    make_org,
)
from tests.review_support import add_destination

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
CSRF = {"X-Leadgate-Console": "1"}
PASSWORD = "correct horse battery"
#: PASSWORD's argon2 hash, made once (users are created with a hash).
HASHED = orgs.hash_password(PASSWORD)
_TEMPLATE: list[Path] = []


class TimeoutChannel:
    """A Slack stand-in whose sends time out after the request was written."""

    name = "slack"
    max_chars = 4_000

    def __init__(self) -> None:
        self.sent: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> SendOutcome:
        self.sent.append(message)
        return Uncertain("read timeout after the request was written")

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        # An edit is idempotent: its timeout is one to retry.
        return Retry("read timeout after the request was written")

    async def close(self) -> None:
        return None


@pytest.fixture
def migrated_url(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """conftest's migrated database, but SQLite files are copies of one migrated template."""
    if not db_url.startswith("sqlite"):
        upgrade(db_url)
        return db_url
    if not _TEMPLATE:
        path = tmp_path_factory.mktemp("template") / "t.db"
        upgrade(f"sqlite+aiosqlite:///{path}")
        _TEMPLATE.append(path)
    shutil.copyfile(_TEMPLATE[0], db_url.removeprefix("sqlite+aiosqlite:///"))
    return db_url


@dataclass
class Env:
    service: App
    client: TestClient[web.Request, web.Application]
    org: Org
    worker: dict[str, Any]
    slack: TimeoutChannel

    @property
    def owner(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.org.key}"}

    @property
    def clock(self) -> FakeClock:
        assert isinstance(self.service.clock, FakeClock)
        return self.service.clock

    async def turn(self, text: str, session: str, *, slack: bool = False) -> str:
        binding = (
            BindingSpec(BindingKind.slack, {"team": "T1", "channel": "C1", "thread_ts": "1.1"})
            if slack
            else BindingSpec(BindingKind.api)
        )
        out = await self.service.turns.run(
            Trigger(self.org.id, self.worker["id"], session, f"{text} #complete", binding)
        )
        assert isinstance(out, Gated) and out.work_item_id
        return out.work_item_id

    async def escalated(self, session: str) -> str:
        item_id = await self.turn("hard #escalate", session)
        await drain(self.service.lead_runner)
        return item_id

    async def row(self, item_id: str) -> dict[str, Any]:
        async with self.service.db.read() as conn:
            found = (
                await conn.execute(sa.select(t.work_items).where(t.work_items.c.id == item_id))
            ).one()
        return dict(found._mapping)

    async def snapshot(self) -> tuple[Any, ...]:
        """Every row a request could change."""
        async with self.service.db.read() as conn:
            out = []
            for table in (t.work_items, t.deliveries, t.audit, t.messages):
                rows = (await conn.execute(sa.select(table).order_by(table.c.id))).all()
                out.append([tuple(r) for r in rows])
        return tuple(out)

    async def session_cookie(self, role: str, email: str) -> dict[str, str]:
        async with self.service.db.tx() as conn:
            await orgs.create_user(
                conn, self.clock, self.service.ids, self.org.id, email, role, HASHED
            )
            token = await orgs.login(conn, self.clock, self.service.ids, email, PASSWORD, 3_600_000)
        assert token
        return {"Cookie": f"leadgate_session={token}"}


@pytest.fixture
async def env(migrated_url: str) -> AsyncIterator[Env]:
    settings = Settings.model_validate({"database": {"url": migrated_url}})
    slack = TimeoutChannel()
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels={"slack": slack})
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "worker", lead="lead")
    client = TestClient(TestServer(service.web_app(), host="127.0.0.1"))
    await client.start_server()
    try:
        yield Env(service, client, org, worker, slack)
    finally:
        await client.close()
        await service.stop()


async def get_json(env: Env, path: str, headers: dict[str, str] | None = None) -> Any:
    resp = await env.client.get(path, headers=env.owner if headers is None else headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def post(
    env: Env, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    resp = await env.client.post(path, json=body, headers=env.owner if headers is None else headers)
    return resp.status, await resp.json()


# ------------------------------------------------------------------------- the queue


async def test_the_queue_lists_only_actionable_items(env: Env) -> None:
    awaiting = await env.escalated("a")
    unknown = await env.turn("post it", "unknown", slack=True)
    await drain(env.service.lead_runner)
    await drain(env.service.relay)  # the Slack send times out: deliveryUnknown
    assert len(env.slack.sent) == 1
    completed = await env.turn("done", "completed")
    await drain(env.service.lead_runner)
    await drain(env.service.relay)
    # Approved on a Slack thread, its post not yet sent (an api item would be completed
    # by its approval: the reveal sends nothing).
    approved = await env.turn("ok", "approved", slack=True)
    await drain(env.service.lead_runner)  # approved, delivery pending
    reviewing = await env.turn("check", "reviewing")
    assert getattr(await env.service.lead_runner.claim(), "id", None) == reviewing
    queued = await env.turn("wait", "queued")
    await env.service.turns.run(api_trigger(env.org, env.worker, "working", "progress"))
    statuses = {
        item_id: (await env.row(item_id))["status"]
        for item_id in (awaiting, unknown, completed, approved, reviewing, queued)
    }
    assert statuses == {
        awaiting: "awaitingHuman",
        unknown: "approved",
        completed: "completed",
        approved: "approved",
        reviewing: "reviewing",
        queued: "reviewQueued",
    }

    page = await get_json(env, "/operator/reviews")
    assert page["next"] is None
    assert {i["id"] for i in page["items"]} == {awaiting, unknown}
    by_id = {i["id"]: i for i in page["items"]}
    assert by_id[awaiting]["status"] == "awaitingHuman"
    assert by_id[unknown]["status"] == "approved"
    for item in page["items"]:
        assert item["agent"] == {"id": env.worker["id"], "name": "worker"}
        assert item["revision"] == 0
        assert item["updatedAt"] == iso((await env.row(item["id"]))["updated_at"])

    # The uncertain delivery, as a human sees and resolves it.
    detail = await get_json(env, f"/operator/reviews/{unknown}")
    [dlv] = detail["deliveries"]
    assert (dlv["status"], dlv["channel"], dlv["attempts"]) == ("deliveryUnknown", "slack", 1)
    assert "timeout" in dlv["error"]
    # Where it was going in words, and when (the detail named the channel only).
    assert dlv["to"] == "Slack channel C1 (team T1), thread 1.1"
    row = await env.row(unknown)
    assert dlv["createdAt"] <= dlv["updatedAt"] and dlv["nextAttemptAt"] is None
    assert dlv["createdAt"] >= iso(row["created_at"])
    status, body = await post(env, f"/operator/deliveries/{dlv['id']}/retry")
    assert status == 200
    assert body["deliveries"][0]["status"] == "pending"
    assert body["deliveries"][0]["nextAttemptAt"]  # when the relay tries it again
    status, body = await post(env, f"/operator/deliveries/{dlv['id']}/retry")
    assert status == 409  # no longer deliveryUnknown: nothing happens twice
    await drain(env.service.relay)  # times out again
    status, body = await post(env, f"/operator/deliveries/{dlv['id']}/confirm")
    assert (status, body["status"]) == (200, "completed")
    assert body["deliveries"][0]["status"] == "sent"
    assert [a["action"] for a in body["audit"]][-2:] == ["deliveryConfirmed", "deliveryConfirmed"]
    page = await get_json(env, "/operator/reviews")
    # The Slack post of ``approved`` timed out in that relay pass too: uncertain, listed.
    assert {i["id"] for i in page["items"]} == {awaiting, approved}


async def test_every_uncertain_delivery_is_listed_plain_replies_included(env: Env) -> None:
    gated = await env.turn("post it", "unknown", slack=True)
    await drain(env.service.lead_runner)
    plain = await make_agent(env.service, env.org, "plain")
    binding = BindingSpec(BindingKind.slack, {"team": "T1", "channel": "C2", "thread_ts": "2.2"})
    await env.service.turns.run(Trigger(env.org.id, plain["id"], "p", "hello", binding))
    await drain(env.service.relay)  # both sends time out: deliveryUnknown
    assert len(env.slack.sent) == 2
    page = await get_json(env, "/operator/deliveries")
    assert page["next"] is None
    by_item = {d["workItemId"]: d for d in page["deliveries"]}
    assert set(by_item) == {gated, None}  # the plain reply has no work item: only here
    assert (by_item[None]["kind"], by_item[None]["channel"]) == ("reply", "slack")
    assert by_item[None]["address"]["channel"] == "C2"
    assert "text" not in by_item[None] and "timeout" in by_item[None]["error"]
    other = await make_org(env.service, "other")  # another organization sees none of them
    theirs = await get_json(env, "/operator/deliveries", {"Authorization": f"Bearer {other.key}"})
    assert theirs == {"deliveries": [], "next": None}
    first = await get_json(env, "/operator/deliveries?limit=1")
    assert len(first["deliveries"]) == 1 and first["next"]
    rest = await get_json(env, f"/operator/deliveries?limit=1&cursor={first['next']}")
    assert {first["deliveries"][0]["id"], rest["deliveries"][0]["id"]} == {
        d["id"] for d in page["deliveries"]
    }
    # Confirming the plain reply takes it off the list.
    status, _ = await post(env, f"/operator/deliveries/{by_item[None]['id']}/confirm")
    assert status == 200, _
    page = await get_json(env, "/operator/deliveries")
    assert [d["workItemId"] for d in page["deliveries"]] == [gated]


async def uncertain_card(env: Env, session: str) -> tuple[str, dict[str, Any]]:
    """An escalated item whose review card's post (to the org's Slack review channel)
    timed out: the item and its ``deliveryUnknown`` card, as the detail shows it."""
    item_id = await env.escalated(session)
    await drain(env.service.relay)  # the card's post times out
    detail = await get_json(env, f"/operator/reviews/{item_id}")
    [card] = [d for d in detail["deliveries"] if d["kind"] == "card"]
    assert card["status"] == "deliveryUnknown"
    return item_id, card


async def retry_ends_cancelled(env: Env, card_id: str) -> Any:
    """Retry of review card ``card_id``, whose wait is closed: answered 200, the card
    ended ``cancelled`` (never posted) and not counted again (its send was counted
    ``deliveryUnknown`` as it ended); the answer."""
    cancelled = deliveries_counted("slack", "cancelled")
    unknown = deliveries_counted("slack", "deliveryUnknown")
    status, body = await post(env, f"/operator/deliveries/{card_id}/retry")
    assert status == 200, body
    assert body["delivery"] == {
        "id": card_id,
        "kind": "card",
        "status": "cancelled",
        "error": CARD_DECIDED_ERROR,
    }
    assert deliveries_counted("slack", "cancelled") == cancelled
    assert deliveries_counted("slack", "deliveryUnknown") == unknown
    return body


async def retry_posts_only(env: Env, card_id: str) -> None:
    """Retry of review card ``card_id``, whose wait is open: ``pending`` again, and the
    relay posts it and no other card."""
    posts = len(env.slack.sent)
    status, body = await post(env, f"/operator/deliveries/{card_id}/retry")
    assert status == 200, body
    assert (body["delivery"]["status"], body["delivery"]["kind"]) == ("pending", "card")
    await drain(env.service.relay)
    assert [m.delivery_id for m in env.slack.sent[posts:]] == [card_id]


async def test_a_retried_card_whose_item_was_decided_is_cancelled_not_posted(env: Env) -> None:
    """Retry of a review card whose post was uncertain puts it back ``pending`` while
    its item waits. Once the item is decided, Retry ends it ``cancelled`` instead (as
    the decision cancels a card not sent yet), and the answer says so and why: put
    back, the relay posted it after the decision, buttons and all."""
    await add_destination(env.service, env.org.id, "slack", "C0R")
    decided, decided_card = await uncertain_card(env, "decided")
    _, waiting_card = await uncertain_card(env, "waiting")
    status, _ = await post(env, f"/operator/reviews/{decided}/approve")
    assert status == 200

    body = await retry_ends_cancelled(env, decided_card["id"])
    cancelled = deliveries_counted("slack", "cancelled")
    assert "item was decided" in CARD_DECIDED_ERROR
    [shown] = [d for d in body["deliveries"] if d["id"] == decided_card["id"]]
    assert (shown["status"], shown["error"]) == ("cancelled", CARD_DECIDED_ERROR)
    audited = body["audit"][-1]
    assert (audited["action"], audited["deliveryId"], audited["text"]) == (
        "deliveryRetried",
        decided_card["id"],
        CARD_DECIDED_ERROR,
    )
    status, again = await post(env, f"/operator/deliveries/{decided_card['id']}/retry")
    assert (status, again["error"]["rule"]) == (409, "delivery.status")
    assert deliveries_counted("slack", "cancelled") == cancelled  # not counted again

    # The waiting item's card is retried as before: posted again, never the decided one.
    await retry_posts_only(env, waiting_card["id"])
    page = await get_json(env, "/operator/deliveries")
    assert decided_card["id"] not in {d["id"] for d in page["deliveries"]}


async def test_a_retried_card_of_an_earlier_wait_is_cancelled_not_posted(env: Env) -> None:
    """The item was escalated (its card's post uncertain), returned by an operator, and
    escalated again (a second wait, whose card's post is uncertain too). Retry of the
    first wait's card ends it ``cancelled``: the return closed its wait, and posted now
    it would offer a decision on a wait that is over (a click on it is out of date),
    though its item waits again. The second wait's card is retried as before."""
    await add_destination(env.service, env.org.id, "slack", "C0R")
    item_id, first = await uncertain_card(env, "s1")
    status, body = await post(env, f"/operator/reviews/{item_id}/return", {"feedback": "More."})
    assert (status, body["status"]) == (200, "inProgress"), body
    assert await drain(RevisionRunner(env.service.turns)) == 1
    await drain(env.service.lead_runner)  # escalated again: the second wait
    await drain(env.service.relay)  # its card's post times out too
    detail = await get_json(env, f"/operator/reviews/{item_id}")
    assert detail["status"] == "awaitingHuman"
    cards = {d["id"]: d["status"] for d in detail["deliveries"] if d["kind"] == "card"}
    [second] = [card_id for card_id in cards if card_id != first["id"]]
    assert cards == {first["id"]: "deliveryUnknown", second: "deliveryUnknown"}

    body = await retry_ends_cancelled(env, first["id"])
    assert body["status"] == "awaitingHuman"  # the item still waits, in its second wait
    # The second wait's card is retried as before: posted again, never the first's.
    await retry_posts_only(env, second)


async def test_a_card_retried_while_its_decision_commits_waits_for_the_decision(
    env: Env,
) -> None:
    """The decision has closed the card's wait, not committed yet (it leaves a chat card
    whose post was uncertain as it is), when an operator retries the card. The retry
    waits for the decision (PostgreSQL: the wait's row, locked first; SQLite: the one
    writer) and then finds the wait closed: ``cancelled``. Reading the wait unlocked,
    it found it open and put the card back ``pending``, to be posted after the decision."""
    await add_destination(env.service, env.org.id, "slack", "C0R")
    item_id, card = await uncertain_card(env, "s1")
    service = env.service

    async def decide(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, service.outbox, item, "approve", "user:x")

    async with held_open(service.db, decide):
        retry = asyncio.create_task(post(env, f"/operator/deliveries/{card['id']}/retry"))
        await blocked_on_a_lock(service.db, retry)
    status, body = await retry
    assert status == 200, body
    assert body["delivery"]["status"] == "cancelled"
    posts = len(env.slack.sent)
    await drain(service.relay)
    assert [m.delivery_id for m in env.slack.sent[posts:]] == []


async def uncertain_post(env: Env, session: str) -> tuple[str, str]:
    """An approved item whose Slack post timed out: the item and its ``deliveryUnknown``
    gating delivery's id."""
    item_id = await env.turn("post it", session, slack=True)
    await drain(env.service.lead_runner)
    await drain(env.service.relay)  # the Slack send times out: deliveryUnknown
    [dlv] = (await get_json(env, f"/operator/reviews/{item_id}"))["deliveries"]
    assert dlv["status"] == "deliveryUnknown"
    return item_id, dlv["id"]


async def test_a_retry_racing_a_cancel_never_posts_the_cancelled_answer(env: Env) -> None:
    """An operator retries an uncertain post while another cancels its item. A cancel
    cancels the item's unsent deliveries one status at a time (``pending``, then
    ``deliveryUnknown``); on PostgreSQL the Retry, holding the delivery uncommitted
    (``pending`` again) as the cancel's second update met it, was missed by both: the
    cancel answered 200, the delivery stayed ``pending``, and the relay posted the
    answer of the cancelled item. Now the Retry takes the item's row first: the cancel
    waits for it and cancels the retried post. A Retry that comes second waits for the
    cancel and gets a 409 ``delivery.status`` naming it."""
    item_id, dlv_id = await uncertain_post(env, "retried first")
    service = env.service

    async def retry(conn: Conn) -> None:
        delivery = await get_delivery(conn, dlv_id, env.org.id)
        await decisions.recover_delivery(conn, service.outbox, delivery, "retry", "user:first")

    async with held_open(service.db, retry):
        cancel = asyncio.create_task(post(env, f"/operator/reviews/{item_id}/cancel"))
        await blocked_on_a_lock(service.db, cancel)
    status, body = await cancel
    assert (status, body["status"]) == (200, "cancelled"), body
    assert [d["status"] for d in body["deliveries"]] == ["cancelled"]
    posts = len(env.slack.sent)
    await drain(service.relay)
    assert len(env.slack.sent) == posts

    item_id, dlv_id = await uncertain_post(env, "cancelled first")
    posts = len(env.slack.sent)

    async def cancel_item(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, service.outbox, item, "cancel", "user:first", surface="slack")

    async with held_open(service.db, cancel_item):
        late = asyncio.create_task(post(env, f"/operator/deliveries/{dlv_id}/retry"))
        await blocked_on_a_lock(service.db, late)
    status, body = await late
    assert (status, body["error"]["rule"]) == (409, "delivery.status"), body
    assert re.fullmatch(
        f"delivery {dlv_id} is cancelled, not deliveryUnknown: cancel of its work item by "
        r"user:first \(slack\) at \d{4}-\S+; only an uncertain delivery can be confirmed or "
        "retried",
        body["error"]["message"],
    ), body
    await drain(service.relay)
    assert len(env.slack.sent) == posts


async def test_a_confirm_that_loses_to_another_names_the_status_now_and_who(env: Env) -> None:
    """Two operators confirm one uncertain delivery at once: the first, from Slack, has
    not committed when the second's request reads the delivery (still deliveryUnknown on
    PostgreSQL; SQLite's one writer queues the second after the first), and the second's
    fenced update then matches nothing. Its 409 names the status the delivery has now
    and who moved it there; it said "is deliveryUnknown, not deliveryUnknown", the
    status read before the first committed."""
    item_id = await env.turn("post it", "unknown", slack=True)
    await drain(env.service.lead_runner)
    await drain(env.service.relay)  # the Slack send times out: deliveryUnknown
    [dlv] = (await get_json(env, f"/operator/reviews/{item_id}"))["deliveries"]
    assert dlv["status"] == "deliveryUnknown"
    service = env.service

    async def first(conn: Conn) -> None:
        stale = await get_delivery(conn, dlv["id"], env.org.id)
        await decisions.recover_delivery(
            conn, service.outbox, stale, "confirm", "user:first", surface="slack"
        )

    async with held_open(service.db, first):
        second = asyncio.create_task(post(env, f"/operator/deliveries/{dlv['id']}/confirm"))
        await blocked_on_a_lock(service.db, second)
    status, body = await second
    assert (status, body["error"]["rule"]) == (409, "delivery.status")
    assert re.fullmatch(
        f"delivery {dlv['id']} is sent, not deliveryUnknown: deliveryConfirmed by user:first"
        r" \(slack\) at \d{4}-\S+; only an uncertain delivery can be confirmed or retried",
        body["error"]["message"],
    ), body
    assert (await env.row(item_id))["status"] == "completed"
    actions = [a["action"] for a in (await get_json(env, f"/operator/reviews/{item_id}"))["audit"]]
    assert actions.count("deliveryConfirmed") == 2  # the delivery's and the item's, once


async def test_a_recovery_of_the_send_read_never_acts_on_a_later_send(env: Env) -> None:
    """Confirm and Retry may name the send the operator checked (``attempts``; the
    console sends the one it shows). A Retry whose answer was lost (the connection
    dropped) and clicked again after the relay had sent it again, uncertain again, sent
    it a third time; now it is a 409 ``delivery.attempts`` and nothing changes, and so
    is a Confirm of the first send's arrival. The send read is recovered as before."""
    item_id = await env.turn("post it", "attempts", slack=True)
    await drain(env.service.lead_runner)
    await drain(env.service.relay)  # the Slack send times out: deliveryUnknown
    [listed] = (await get_json(env, "/operator/deliveries"))["deliveries"]
    read = listed["attempts"]
    assert read == 1
    path = f"/operator/deliveries/{listed['id']}"
    status, _ = await post(env, f"{path}/retry", {"attempts": read})
    assert status == 200
    await drain(env.service.relay)  # sent again, uncertain again
    assert len(env.slack.sent) == 2
    [again] = (await get_json(env, "/operator/deliveries"))["deliveries"]
    assert again["attempts"] == read + 1

    before = await env.snapshot()
    for action in ("retry", "confirm"):
        status, body = await post(env, f"{path}/{action}", {"attempts": read})
        assert (status, body["error"]["rule"]) == (409, "delivery.attempts"), body
        assert f"since attempt {read} was read (attempt {read + 1})" in body["error"]["message"]
    # 2**63: past any count a database holds (it was compared in the query: a 500).
    for bad in ("1", -1, True, 1.5, 2**63):
        status, body = await post(env, f"{path}/retry", {"attempts": bad})
        assert (status, body["error"]["rule"]) == (400, "delivery.attempts"), bad
    assert await env.snapshot() == before
    await drain(env.service.relay)
    assert len(env.slack.sent) == 2

    status, body = await post(env, f"{path}/confirm", {"attempts": read + 1})
    assert (status, body["id"], body["status"]) == (200, item_id, "completed")


async def test_a_retry_while_a_lapsed_send_may_still_post_is_a_409_with_retry_after(
    env: Env,
) -> None:
    """A send lease lapsed (its relay stalled mid-send) and the expiry made the post
    deliveryUnknown: a Retry then put it back ``pending`` while the stalled send could
    still post it (posted twice). Now it is a 409 ``delivery.in_flight`` with
    ``Retry-After`` (the seconds of the send's deadline left) and nothing changes; once
    they have passed, the Retry is taken."""
    item_id = await env.turn("post it", "in-flight", slack=True)
    await drain(env.service.lead_runner)
    [dlv] = (await get_json(env, f"/operator/reviews/{item_id}"))["deliveries"]
    if dlv["status"] == "pending":  # (not handed over to the service's relay)
        assert len(await env.service.relay.claim()) == 1
    env.clock.advance(SEND_LEASE_MS + 1)
    assert await env.service.relay.expire_send_leases() == 1
    path = f"/operator/deliveries/{dlv['id']}/retry"
    before = await env.snapshot()
    resp = await env.client.post(path, headers=env.owner)
    body = await resp.json()
    assert (resp.status, body["error"]["rule"]) == (409, "delivery.in_flight"), body
    assert resp.headers["Retry-After"] == "60"
    assert "retry in 60 s" in body["error"]["message"]
    assert await env.snapshot() == before
    env.clock.advance(IN_FLIGHT_AFTER_LAPSE_MS)
    status, body = await post(env, path)
    assert status == 200, body
    [dlv] = body["deliveries"]
    assert dlv["status"] == "pending"


@SQLITE_ONLY
async def test_the_queue_pages_with_a_cursor(env: Env) -> None:
    made = []
    for n in range(5):
        made.append(await env.escalated(f"s{n}"))
        env.clock.advance(1)
    seen: list[str] = []
    path = "/operator/reviews?limit=2"
    pages = 0
    while True:
        page = await get_json(env, path)
        pages += 1
        assert len(page["items"]) <= 2
        seen += [i["id"] for i in page["items"]]
        if page["next"] is None:
            break
        path = f"/operator/reviews?limit=2&cursor={page['next']}"
    assert pages == 3
    assert seen == made  # oldest first, no gaps, no repeats
    exact = await get_json(env, "/operator/reviews?limit=5")
    assert exact["next"] is None and len(exact["items"]) == 5
    for bad in ("limit=0", "limit=201", "limit=x", "cursor=not-a-cursor"):
        resp = await env.client.get(f"/operator/reviews?{bad}", headers=env.owner)
        assert resp.status == 400, bad
        assert "error" in await resp.json()


# ------------------------------------------------------------------------ the detail


@SQLITE_ONLY
async def test_the_detail_has_everything_a_reviewer_needs(env: Env) -> None:
    item_id = await env.turn("write the memo #revise", "a")
    await drain(env.service.lead_runner)
    await drain(RevisionRunner(env.service.turns))
    await drain(env.service.lead_runner)
    body = await get_json(env, f"/operator/reviews/{item_id}")
    for key in ("id", "status", "revision", "completionPolicy", "taskContext", "summary"):
        assert key in body
    assert body["id"] == item_id
    assert body["status"] == "completed"  # the approval revealed it (api binding)
    assert body["revision"] == 1
    assert body["completionPolicy"] == "requestHumanApproval"
    assert body["taskContext"] == "write the memo #revise #complete"
    assert body["summary"] == "Revised: Please revise."
    assert body["snapshot"] == "Revised: Please revise."
    [dlv] = body["deliveries"]
    assert {"id", "status", "channel", "attempts", "error"} <= set(dlv)
    assert (dlv["status"], dlv["channel"], dlv["attempts"], dlv["error"]) == (
        "sent",
        "api",
        1,
        None,
    )
    assert [a["action"] for a in body["audit"]] == [
        "create",
        "completeTask",
        "claim",
        "changesRequested",
        "completeTask",
        "claim",
        "approve",
        "delivered",
    ]
    for entry in body["audit"]:
        assert {"actor", "action", "text", "at"} <= set(entry)
        assert entry["at"] == iso(env.clock.now_ms())
    assert body["audit"][3]["text"] == "Please revise."
    missing = await env.client.get("/operator/reviews/wi_nope", headers=env.owner)
    assert missing.status == 404


# ---------------------------------------------------------------------- decisions


async def test_decisions_answer_the_updated_detail(env: Env) -> None:
    key = await make_key(env.service, env.org, Scope.review)
    headers = {"Authorization": f"Bearer {key}"}
    key_id = key.split(".")[1]

    item = await env.escalated("approve")
    status, body = await post(env, f"/operator/reviews/{item}/approve", headers=headers)
    assert status == 200
    # The api binding's reveal sends nothing: the approval's transaction completed it.
    assert body["status"] == "completed"
    assert [d["status"] for d in body["deliveries"]] == ["sent"]
    approve, delivered = body["audit"][-2:]
    assert (approve["actor"], approve["action"]) == (f"key:{key_id}", "approve")
    assert (delivered["actor"], delivered["action"]) == ("system:outbox", "delivered")
    # The decision's surface is audited beside the actor: a bearer key is the API.
    assert (approve["surface"], approve["identity"]) == ("api", None)
    assert await drain(env.service.relay) == 0

    # Racing reviewers: exactly one approval wins, one delivery is written.
    item = await env.escalated("race")
    answers = await asyncio.gather(
        *(post(env, f"/operator/reviews/{item}/approve", headers=headers) for _ in range(4))
    )
    assert sorted(status for status, _ in answers) == [200, 409, 409, 409]
    detail = await get_json(env, f"/operator/reviews/{item}")
    assert len(detail["deliveries"]) == 1
    assert [a["action"] for a in detail["audit"]].count("approve") == 1

    item = await env.escalated("reject")
    status, body = await post(
        env, f"/operator/reviews/{item}/reject", {"reason": "Off topic."}, headers
    )
    assert (status, body["status"], body["deliveries"]) == (200, "rejected", [])
    assert (body["audit"][-1]["action"], body["audit"][-1]["text"]) == ("reject", "Off topic.")

    item = await env.escalated("return")
    status, body = await post(
        env, f"/operator/reviews/{item}/return", {"feedback": "Cite sources."}, headers
    )
    assert (status, body["status"], body["revision"], body["extraAllowance"]) == (
        200,
        "inProgress",
        1,
        1,
    )
    assert (body["audit"][-1]["action"], body["audit"][-1]["text"]) == ("return", "Cite sources.")
    assert await drain(RevisionRunner(env.service.turns)) == 1
    detail = await get_json(env, f"/operator/reviews/{item}")
    assert (detail["status"], detail["snapshot"]) == ("reviewQueued", "Revised: Cite sources.")

    # Cancel works from any live status (here: under review) and never from a final one.
    claimed = await env.service.lead_runner.claim()
    assert claimed is not None and claimed.id == item
    status, body = await post(env, f"/operator/reviews/{item}/cancel", headers=headers)
    assert (status, body["status"]) == (200, "cancelled")
    assert (body["audit"][-1]["action"], body["audit"][-1]["from"]) == ("cancel", "reviewing")
    await env.service.lead_runner.review(claimed)  # its verdict is dropped
    before = await env.snapshot()
    for action in ("cancel", "approve"):
        status, body = await post(env, f"/operator/reviews/{item}/{action}", headers=headers)
        assert status == 409
        assert body["error"]["code"] == "invalid_transition"
    assert await env.snapshot() == before


@SQLITE_ONLY
async def test_a_cancel_may_say_why_and_its_audit_entry_keeps_it(env: Env) -> None:
    """An operator says why they cancel (``{"reason": ...}``, optional): it was a 400
    ``decision.unknown_field``. The reason is checked as a reject's (text, at most 2,000
    characters: 400 ``decision.reason``, nothing changes) and kept in the cancel's audit
    entry, which the review detail shows; none, or an empty one, is a cancel without."""
    item = await env.escalated("a")
    other = await env.escalated("b")
    before = await env.snapshot()
    for bad in ("x" * (REASON_LIMIT + 1), 7, ["why"]):
        status, answer = await post(env, f"/operator/reviews/{item}/cancel", {"reason": bad})
        assert (status, answer["error"]["rule"]) == (400, "decision.reason"), answer
    assert await env.snapshot() == before
    why = "x" * (REASON_LIMIT - 13) + " wrong thread"  # at the limit
    status, body = await post(env, f"/operator/reviews/{item}/cancel", {"reason": why})
    assert (status, body["status"]) == (200, "cancelled")
    assert (body["audit"][-1]["action"], body["audit"][-1]["text"]) == ("cancel", why)
    detail = await get_json(env, f"/operator/reviews/{item}")
    assert detail["audit"][-1]["text"] == why
    status, body = await post(env, f"/operator/reviews/{other}/cancel", {"reason": ""})
    assert (status, body["audit"][-1]["action"], body["audit"][-1]["text"]) == (
        200,
        "cancel",
        None,
    )


@SQLITE_ONLY
async def test_a_body_field_its_route_does_not_take_is_400_naming_it(env: Env) -> None:
    """A decision's or recovery's body naming a field its route does not take is a 400
    naming the field and what the route takes, and nothing changes: ignored, a misspelt
    fence (``revison``) let a decision act on whatever the item had become, a reason
    sent with an approve was dropped without a word, and so was a ``feedback`` sent
    with a reject beside its reason."""
    item = await env.escalated("a")
    _, dlv = await uncertain_post(env, "b")
    before = await env.snapshot()
    cases: list[tuple[str, str, str, dict[str, Any], str]] = [
        ("reviews", item, "approve", {"revison": 0}, "revision"),
        ("reviews", item, "approve", {"reason": "looks wrong"}, "revision"),
        ("reviews", item, "cancel", {"feedback": "x", "revision": 0}, "reason, revision"),
        ("reviews", item, "reject", {"reason": "no", "feedback": "x"}, "reason, revision"),
        ("reviews", item, "return", {"reason": "wrong field"}, "feedback, revision"),
        ("deliveries", dlv, "retry", {"attempt": 1}, "attempts"),
        ("deliveries", dlv, "confirm", {"attempts": 1, "revision": 0}, "attempts"),
    ]
    for kind, id_, action, body, takes in cases:
        status, answer = await post(env, f"/operator/{kind}/{id_}/{action}", body)
        rule = "decision.unknown_field" if kind == "reviews" else "delivery.unknown_field"
        assert (status, answer["error"]["rule"]) == (400, rule), (action, body, answer)
        unknown = ", ".join(sorted(set(body) - set(takes.split(", "))))
        assert answer["error"]["message"] == (
            f"unknown fields: {unknown} (this request takes {takes})"
        )
    assert await env.snapshot() == before
    status, body = await post(env, f"/operator/reviews/{item}/reject", {"reason": "no"})
    assert (status, body["status"]) == (200, "rejected")


@SQLITE_ONLY
async def test_decision_texts_are_checked(env: Env) -> None:
    item = await env.escalated("a")
    before = await env.snapshot()
    cases = [
        ("reject", None),
        ("reject", {}),
        ("reject", {"reason": ""}),
        ("reject", {"reason": "r" * 2_001}),
        ("reject", {"reason": 7}),
        ("return", {"feedback": ""}),
        ("return", {"feedback": "f" * 10_001}),
    ]
    for action, body in cases:
        status, answer = await post(env, f"/operator/reviews/{item}/{action}", body)
        assert status == 400, (action, body)
        assert answer["error"]["rule"] in ("decision.reason", "decision.feedback")
    resp = await env.client.post(
        f"/operator/reviews/{item}/reject", data=b"{not json", headers=env.owner
    )
    assert resp.status == 400
    assert await env.snapshot() == before

    status, body = await post(env, f"/operator/reviews/{item}/reject", {"reason": "r" * 2_000})
    assert (status, body["status"], body["audit"][-1]["text"]) == (200, "rejected", "r" * 2_000)
    item = await env.escalated("b")
    status, body = await post(env, f"/operator/reviews/{item}/return", {"feedback": "f" * 10_000})
    assert (status, body["status"], body["audit"][-1]["text"]) == (200, "inProgress", "f" * 10_000)


async def test_a_reject_or_return_sent_empty_after_another_decided_hears_who_decided(
    env: Env,
) -> None:
    """Two reviewers at once: one approves, the other's Reject or Return form goes out
    empty (or too long). That one is told the item was decided, by whom (409
    ``workItem.status``, as with a valid text, and as a chat card's click is told): it
    was told 400 "reason is required", and then, giving one, that the item was decided.
    On an item still waiting the text is checked first, as before (the test above)."""
    item = await env.escalated("a")
    status, _ = await post(env, f"/operator/reviews/{item}/approve")
    assert status == 200
    before = await env.snapshot()
    for action, body in (
        ("reject", None),
        ("reject", {"reason": ""}),
        ("reject", {"reason": "r" * 2_001}),
        ("return", {"feedback": ""}),
        ("return", {"feedback": "f" * 10_001}),
    ):
        status, answer = await post(env, f"/operator/reviews/{item}/{action}", body)
        assert (status, answer["error"]["rule"]) == (409, "workItem.status"), (action, body)
        assert "not awaitingHuman: approve by key:" in answer["error"]["message"]
    assert await env.snapshot() == before


async def test_a_decision_on_the_revision_read_never_decides_a_later_one(env: Env) -> None:
    """A decision names the revision its decider read (the console sends the one its page
    shows): an item returned and escalated again since is at another revision, another
    wait, and a page left open on the first (a dialog, a dropped event stream) approved
    the second, which nobody had read. Now that is a 409 ``decision.revision`` and
    nothing changes; the revision read decides as before, and none is needed."""
    item = await env.escalated("stale")
    read = (await get_json(env, f"/operator/reviews/{item}"))["revision"]
    status, _ = await post(env, f"/operator/reviews/{item}/return", {"feedback": "#escalate"})
    assert status == 200
    assert await drain(RevisionRunner(env.service.turns)) == 1
    await drain(env.service.lead_runner)
    now = await get_json(env, f"/operator/reviews/{item}")
    assert (now["status"], now["revision"]) == ("awaitingHuman", read + 1)

    before = await env.snapshot()
    for action, payload in (
        ("approve", {}),
        ("reject", {"reason": "no"}),
        ("return", {"feedback": "again"}),
        ("cancel", {}),
    ):
        status, answer = await post(
            env, f"/operator/reviews/{item}/{action}", {**payload, "revision": read}
        )
        assert status == 409, (action, answer)
        assert answer["error"]["rule"] == "decision.revision"
        assert (
            f"at revision {read + 1} (awaitingHuman) now, not {read}" in answer["error"]["message"]
        )
    for bad in ("1", -1, True, 1.5, [1], 2**63):
        status, answer = await post(env, f"/operator/reviews/{item}/approve", {"revision": bad})
        assert (status, answer["error"]["rule"]) == (400, "decision.revision"), bad
    assert await env.snapshot() == before

    status, body = await post(
        env, f"/operator/reviews/{item}/approve", {"revision": now["revision"]}
    )
    assert (status, body["status"]) == (200, "completed")


@SQLITE_ONLY
async def test_a_decision_from_the_wrong_status_is_409_and_changes_nothing(env: Env) -> None:
    completed = await env.turn("done", "completed")
    await drain(env.service.lead_runner)
    await drain(env.service.relay)
    rejected = await env.escalated("rejected")
    assert (await post(env, f"/operator/reviews/{rejected}/reject", {"reason": "no"}))[0] == 200
    approved = await env.turn("ok", "approved", slack=True)  # its post not yet sent
    await drain(env.service.lead_runner)
    reviewing = await env.turn("check", "reviewing")
    assert getattr(await env.service.lead_runner.claim(), "id", None) == reviewing
    queued = await env.turn("wait", "queued")
    await env.service.turns.run(api_trigger(env.org, env.worker, "working", "progress"))
    activity = await get_json(env, "/operator/activity")
    in_progress = next(i["id"] for i in activity["items"] if i["status"] == "inProgress")
    status, body = await post(env, f"/operator/reviews/{in_progress}/cancel")
    assert (status, body["status"]) == (200, "cancelled")
    await env.service.turns.run(api_trigger(env.org, env.worker, "again", "progress"))
    activity = await get_json(env, "/operator/activity")
    in_progress = next(i["id"] for i in activity["items"] if i["status"] == "inProgress")
    items = {
        "completed": completed,
        "rejected": rejected,
        "approved": approved,
        "reviewing": reviewing,
        "reviewQueued": queued,
        "inProgress": in_progress,
        "cancelled": body["id"],
    }
    for status_name, item in items.items():
        assert (await env.row(item))["status"] == status_name

    before = await env.snapshot()
    for status_name, item in items.items():
        for action, payload in (
            ("approve", None),
            ("reject", {"reason": "no"}),
            ("return", {"feedback": "again"}),
        ):
            status, answer = await post(env, f"/operator/reviews/{item}/{action}", payload)
            assert status == 409, (status_name, action)
            assert answer["error"]["code"] == "invalid_transition"
        if status_name in ("completed", "rejected", "cancelled"):
            status, _ = await post(env, f"/operator/reviews/{item}/cancel")
            assert status == 409, status_name
    assert await env.snapshot() == before


# ----------------------------------------------------------------------------- auth


@SQLITE_ONLY
async def test_keys_need_the_review_scope(env: Env) -> None:
    item = await env.escalated("a")
    trigger_only = await make_key(env.service, env.org, Scope.trigger)
    updater = await make_key(env.service, env.org, Scope.trigger, Scope.update)
    review_only = await make_key(env.service, env.org, Scope.review)
    requests = [
        ("GET", "/operator/reviews"),
        ("GET", f"/operator/reviews/{item}"),
        ("GET", "/operator/activity"),
        ("POST", f"/operator/reviews/{item}/cancel"),
    ]
    before = await env.snapshot()
    for method, path in requests:
        for headers, expected in (
            ({}, 401),
            ({"Authorization": "Bearer lg.key_nope.secret"}, 401),
            ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
            ({"Authorization": f"Bearer {trigger_only}"}, 403),
            ({"Authorization": f"Bearer {updater}"}, 403),
        ):
            resp = await env.client.request(method, path, headers=headers)
            assert resp.status == expected, (method, path, headers)
            error = (await resp.json())["error"]
            if expected == 403:
                assert "agent:review" in error["message"]
    assert await env.snapshot() == before
    review = {"Authorization": f"Bearer {review_only}"}
    assert (await get_json(env, "/operator/reviews", review))["items"][0]["id"] == item
    assert (await get_json(env, f"/operator/reviews/{item}", review))["id"] == item
    status, body = await post(env, f"/operator/reviews/{item}/approve", headers=review)
    assert (status, body["status"]) == (200, "completed")


@SQLITE_ONLY
async def test_console_roles_and_the_csrf_header(env: Env) -> None:
    item = await env.escalated("a")
    viewer = await env.session_cookie("Viewer", "viewer@example.com")
    member = await env.session_cookie("Member", "member@example.com")
    before = await env.snapshot()
    for path in ("/operator/reviews", f"/operator/reviews/{item}"):
        resp = await env.client.get(path, headers=viewer)
        assert resp.status == 403
    status, _ = await post(env, f"/operator/reviews/{item}/approve", headers={**viewer, **CSRF})
    assert status == 403
    assert [i["id"] for i in (await get_json(env, "/operator/reviews", member))["items"]] == [item]
    # A cookie-authenticated write without the console header is refused (CSRF).
    status, body = await post(env, f"/operator/reviews/{item}/approve", headers=member)
    assert status == 401
    assert body["error"]["rule"] == "csrf"
    assert await env.snapshot() == before
    status, body = await post(env, f"/operator/reviews/{item}/approve", headers={**member, **CSRF})
    assert (status, body["status"]) == (200, "completed")
    user_id = body["audit"][-2]["actor"]
    assert user_id.startswith("user:usr_")
    # Sessions expire.
    env.clock.advance(3_600_000 + 1)
    resp = await env.client.get("/operator/reviews", headers=member)
    assert resp.status == 401


@SQLITE_ONLY
async def test_another_organizations_items_are_not_found(env: Env) -> None:
    item = await env.escalated("a")
    unknown = await env.turn("post", "u", slack=True)
    await drain(env.service.lead_runner)
    await drain(env.service.relay)
    other = await make_org(env.service, "other")
    headers = {"Authorization": f"Bearer {other.key}"}
    before = await env.snapshot()
    assert (await get_json(env, "/operator/reviews", headers))["items"] == []
    assert (await get_json(env, "/operator/activity", headers))["items"] == []
    resp = await env.client.get(f"/operator/reviews/{item}", headers=headers)
    assert resp.status == 404
    for action, body in (
        ("approve", None),
        ("cancel", None),
        ("reject", {"reason": "x"}),
        ("return", {"feedback": "x"}),
    ):
        status, _ = await post(env, f"/operator/reviews/{item}/{action}", body, headers)
        assert status == 404, action
    dlv = (await get_json(env, f"/operator/reviews/{unknown}"))["deliveries"][0]
    for action in ("confirm", "retry"):
        status, _ = await post(env, f"/operator/deliveries/{dlv['id']}/{action}", headers=headers)
        assert status == 404
    assert await env.snapshot() == before


# ---------------------------------------------------------------------- safe GETs


@SQLITE_ONLY
async def test_gets_never_change_state(env: Env) -> None:
    awaiting = await env.escalated("a")
    second = await env.escalated("d")
    reviewing = await env.turn("slow", "b")
    assert getattr(await env.service.lead_runner.claim(), "id", None) == reviewing
    approved = await env.turn("ok", "c")
    await drain(env.service.lead_runner)
    # The lease has expired, but nobody ran the runner: a GET must not expire it.
    env.clock.advance(20 * MINUTE_MS + 1)
    before = await env.snapshot()
    await get_json(env, "/operator/reviews")
    page = await get_json(env, "/operator/reviews?limit=1")
    assert page["next"] is not None
    await get_json(env, f"/operator/reviews?limit=1&cursor={page['next']}")
    await get_json(env, "/operator/activity")
    for item in (awaiting, second, reviewing, approved):
        await get_json(env, f"/operator/reviews/{item}")
    assert await env.snapshot() == before
    assert (await env.row(reviewing))["status"] == "reviewing"
    # Agent Activity links to the detail and never carries the reviewed text.
    activity = await get_json(env, "/operator/activity")
    assert {i["id"] for i in activity["items"]} == {awaiting, second, reviewing, approved}
    for entry in activity["items"]:
        assert entry["detail"] == f"/operator/reviews/{entry['id']}"
        assert "snapshot" not in entry and "summary" not in entry
        assert "Echo:" not in str(entry)
