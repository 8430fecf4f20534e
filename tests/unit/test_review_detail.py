"""The review detail (``leadgate.review.queue.detail``): where an approval goes and who
each audit actor is, read in four statements (the item with its names and
destination, its newest deliveries, its newest audit and its verdicts with their
actors' names)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from binding.bindings import deactivate_session
from leadgate.core.clock import iso
from leadgate.core.errors import NotFound
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import orgs, workitems
from leadgate.review import decisions, queue
from leadgate.review.queue import detail
from tests.helpers import make_org
from tests.review_support import reply_rows
from tests.stack import Stack
from tests.unit.test_decisions import escalated, setup, slack_run


async def unbind(stack: Stack, item_id: str) -> None:
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        assert await deactivate_session(conn, item.session_id) == 1


async def test_an_approved_item_goes_where_its_approval_sent_it(stack: Stack) -> None:
    """Once approved, the destination is the binding the gating delivery was resolved
    to, though the session has since lost it; before, the session's active binding."""
    org, worker = await setup(stack)
    approved = await slack_run(stack, org, worker, "post it #complete", "7.7")
    await drain(stack.lead_runner)  # approved; its post waits for the relay
    waiting = await escalated(stack, org, worker, "waiting")
    await unbind(stack, approved)
    await unbind(stack, waiting)
    async with stack.db.read() as conn:
        sent = await detail(conn, org.id, approved)
        held = await detail(conn, org.id, waiting)
    assert sent["status"] == "approved"
    assert (sent["destination"]["channel"], sent["destination"]["thread"]) == ("slack", "7.7")
    assert sent["channel"] == "slack"
    assert held["status"] == "awaitingHuman"
    assert held["destination"]["channel"] == "none"
    assert held["destination"]["description"].startswith("The session has no active binding")
    assert held["channel"] == "api"


async def test_each_actor_is_named_within_the_organization(stack: Stack) -> None:
    org, worker = await setup(stack)
    other = await make_org(stack, "other")
    users = {}
    async with stack.db.tx() as conn:
        for label, org_id, name, email in (
            ("named", org.id, "Alice", "alice@acme.io"),
            ("plain", org.id, None, "bob@acme.io"),
            ("other", other.id, "Carol", "carol@other.io"),
        ):
            made = await orgs.create_user(
                conn,
                stack.clock,
                stack.ids,
                org_id,
                email,
                "Member",
                orgs.hash_password("password1"),
                name=name,
            )
            users[label] = f"user:{made['id']}"
    users["gone"] = "user:usr_gone"
    names = {}
    for label, actor in users.items():
        item_id = await escalated(stack, org, worker, label)
        async with stack.db.tx() as conn:
            item = await workitems.get(conn, item_id)
            await decisions.human_reject(conn, stack.clock, stack.ids, item, actor, "no")
            audit = (await detail(conn, org.id, item_id))["audit"]
        names[label] = next((a["actorName"], a["actorEmail"]) for a in audit if a["actor"] == actor)
        lead = next(a for a in audit if a["actor"].startswith("lead:"))
        assert lead["actorName"] == "lead agent lead"
        assert {a["actorName"] for a in audit if a["actor"] == "system:intake"} == {
            "leadgate (intake)"
        }
    bare = {label: actor.removeprefix("user:") for label, actor in users.items()}
    assert names == {
        "named": ("Alice", "alice@acme.io"),
        "plain": ("bob@acme.io", "bob@acme.io"),
        # Another organization's user, and one deleted: a bare id, nothing of theirs.
        "other": (f"deleted user {bare['other']}", None),
        "gone": ("deleted user usr_gone", None),
    }
    key_item = await escalated(stack, org, worker, "by-key")
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, key_item)
        await decisions.human_reject(conn, stack.clock, stack.ids, item, org.principal.actor, "no")
        audit = (await detail(conn, org.id, key_item))["audit"]
        key_name = await conn.scalar(
            sa.select(t.api_keys.c.name).where(t.api_keys.c.id == org.principal.key_id)
        )
    assert audit[-1]["actorName"] == f"API key {key_name} ({org.principal.key_id})"
    assert audit[-1]["actorKind"] == "key"


async def test_another_organizations_item_is_not_found(stack: Stack) -> None:
    org, worker = await setup(stack)
    other = await make_org(stack, "other")
    item_id = await escalated(stack, org, worker, "mine")
    async with stack.db.read() as conn:
        with pytest.raises(NotFound) as err:
            await detail(conn, other.id, item_id)
    assert err.value.rule == "workItem.not_found"


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
async def test_the_detail_lists_the_newest_audit_and_deliveries_and_says_when_cut(
    stack: Stack,
) -> None:
    """An item returned many times grows its audit and deliveries without bound: the
    detail lists the newest ``DETAIL_LIST_MAX`` of each (oldest first) and says older
    ones exist, while its verdicts and reason still come from every verdict."""
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "long")
    now = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        before = (await detail(conn, org.id, item_id))["audit"]
        await conn.execute(
            sa.insert(t.audit),
            [
                {
                    "id": f"aud_note{i}",
                    "org_id": org.id,
                    "work_item_id": item_id,
                    "actor": "system:outbox",
                    "action": "note",
                    "created_at": now + i,
                }
                for i in range(4)
            ],
        )
        await conn.execute(
            sa.insert(t.deliveries),
            reply_rows(org.id, item_id, ["sent"] * 4, now, "dlv_note"),
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "DETAIL_LIST_MAX", 3)
        async with stack.db.read() as conn:
            cut = await detail(conn, org.id, item_id)
        mp.setattr(queue, "DETAIL_LIST_MAX", 4)
        async with stack.db.read() as conn:
            whole = await detail(conn, org.id, item_id)
    assert [a["at"] for a in cut["audit"]] == [iso(now + i) for i in (1, 2, 3)]
    assert [d["id"] for d in cut["deliveries"]] == ["dlv_note1", "dlv_note2", "dlv_note3"]
    assert (cut["auditTruncated"], cut["deliveriesTruncated"]) == (True, True)
    # The lead's escalation is older than the rows listed: still a verdict and the reason.
    assert [r["verdict"] for r in cut["reviews"]] == ["escalated"]
    assert cut["reviews"][0]["actorName"] == "lead agent lead"
    assert cut["reason"] == "escalated"
    assert len(before) > 0
    assert whole["deliveriesTruncated"] is False
    assert len(whole["deliveries"]) == 4
    assert whole["auditTruncated"] is True
    async with stack.db.read() as conn:
        full = await detail(conn, org.id, item_id)
    assert full["audit"] == [*before, *[a for a in full["audit"] if a["action"] == "note"]]
    assert (full["auditTruncated"], full["deliveriesTruncated"]) == (False, False)


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
async def test_the_detail_lists_every_unsettled_delivery_whatever_its_age(stack: Stack) -> None:
    """An uncertain delivery (or one still pending or sending) older than the newest
    ``DETAIL_LIST_MAX`` stays in the detail, where the operator confirms or retries it;
    the unsettled ones are capped too (their oldest), and each cut is said."""
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "many posts")
    now = stack.clock.now_ms()
    statuses = ["deliveryUnknown", "sending", *["sent"] * 250]
    async with stack.db.tx() as conn:
        await conn.execute(
            sa.insert(t.deliveries),
            reply_rows(org.id, item_id, statuses, now, "dlv_many"),
        )
        listed = await detail(conn, org.id, item_id)
    ids = [d["id"] for d in listed["deliveries"]]
    assert ids == ["dlv_many0", "dlv_many1", *[f"dlv_many{i}" for i in range(52, 252)]]
    assert [d["status"] for d in listed["deliveries"][:2]] == ["deliveryUnknown", "sending"]
    assert listed["deliveriesTruncated"] is True
    assert listed["unsettledDeliveriesTruncated"] is False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "DETAIL_LIST_MAX", 1)
        async with stack.db.read() as conn:
            cut = await detail(conn, org.id, item_id)
    # The oldest unsettled one and the newest one: at most twice the cap.
    assert [d["id"] for d in cut["deliveries"]] == ["dlv_many0", "dlv_many251"]
    assert (cut["deliveriesTruncated"], cut["unsettledDeliveriesTruncated"]) == (True, True)


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
async def test_the_detail_lists_the_newest_verdicts_numbered_from_the_first(
    stack: Stack,
) -> None:
    """An item with thousands of verdicts answered them all: the detail lists the newest
    ``DETAIL_LIST_MAX`` (oldest first) and says older ones exist, each numbered with the
    revision it was given on, counted over every verdict, not over those listed."""
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "sent back often")
    now = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        await conn.execute(
            sa.insert(t.audit),
            [
                {
                    "id": f"aud_ret{i:03}",
                    "org_id": org.id,
                    "work_item_id": item_id,
                    "actor": "user:usr_gone",
                    "action": "return",
                    "from_status": "awaitingHuman",
                    "to_status": "inProgress",
                    "text": f"again {i}",
                    "created_at": now + i,
                }
                for i in range(250)
            ],
        )
        cut = await detail(conn, org.id, item_id)
    # The lead's escalation (revision 0) and 250 returns, each starting the next.
    assert len(cut["reviews"]) == 200
    assert [r["revision"] for r in cut["reviews"]] == list(range(50, 250))
    assert [r["feedback"] for r in cut["reviews"]][:1] == ["again 50"]
    assert {r["actorName"] for r in cut["reviews"]} == {"deleted user usr_gone"}
    assert cut["reviewsTruncated"] is True
    assert cut["auditTruncated"] is True
    assert cut["reason"] == "escalated"  # the escalation older than anything listed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "DETAIL_LIST_MAX", 300)
        async with stack.db.read() as conn:
            whole = await detail(conn, org.id, item_id)
    assert whole["auditTruncated"] is False
    assert whole["reviewsTruncated"] is False
    assert [r["revision"] for r in whole["reviews"]] == [0, *range(250)]
    assert [r["verdict"] for r in whole["reviews"]][:2] == ["escalated", "returned"]
