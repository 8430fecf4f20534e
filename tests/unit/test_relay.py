"""The outbox relay against a scripted fake channel, on SQLite and on PostgreSQL.

Covers every row of SPEC 6's delivery table (through the real turn path and lead
runner), the four outcome classes, backoff, bounded attempts, send-lease expiry,
message splitting, idempotency keys, operator recovery at the store level, the batched
pipeline and the in-process wake-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from binding.bindings import deactivate_session
from engine import schema as t
from engine import workitems
from engine.clock import FakeClock
from engine.config import Settings
from engine.errors import TransitionError
from engine.runners import drain
from engine.service import Service
from engine.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from outbox import relay as relay_mod
from outbox.channel import Permanent, Retry, Sent, Uncertain
from outbox.relay import SEND_LEASE_MS, Relay, split_text
from outbox.store import DeliveryStatus, enqueue_reply, for_item, recover
from review import decisions, queue
from tests.helpers import Org, make_agent, make_org
from tests.outbox_support import MigratedTemplates, ScriptedChannel, delivery_counts, seed_items

SLACK_ADDRESS = {"team": "T1", "channel": "C1", "thread_ts": "1700000000.000100"}

# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplates:
    return MigratedTemplates(tmp_path_factory.mktemp("outbox-templates"))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, templates: MigratedTemplates, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        yield templates.sqlite_url(tmp_path / "t.db")
        return
    yield templates.pg_url(request.getfixturevalue("postgres_server"))


@pytest.fixture
def channel() -> ScriptedChannel:
    return ScriptedChannel("slack")


@pytest.fixture
async def svc(url: str, channel: ScriptedChannel) -> AsyncIterator[Service]:
    settings = Settings.model_validate(
        {"database": {"url": url}, "runners": {"poll_interval_s": 30}}
    )
    service = Service(
        settings, clock=FakeClock(), channels={"slack": channel}, enable_adapters=False
    )
    yield service
    await service.stop()


def relay_for(svc: Service, **kwargs: Any) -> Relay:
    kwargs.setdefault("rand", lambda: 0.0)
    return Relay(svc.db, svc.clock, svc.ids, svc.channels, **kwargs)


def fake_clock(svc: Service) -> FakeClock:
    assert isinstance(svc.clock, FakeClock)
    return svc.clock


async def delivery(svc: Service, delivery_id: str) -> dict[str, Any]:
    async with svc.db.read() as conn:
        row = (
            await conn.execute(sa.select(t.deliveries).where(t.deliveries.c.id == delivery_id))
        ).first()
    assert row is not None
    return dict(row._mapping)


async def item(svc: Service, item_id: str) -> dict[str, Any]:
    async with svc.db.read() as conn:
        return await workitems.get(conn, item_id)


async def audit_actions(svc: Service, item_id: str) -> list[str]:
    async with svc.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit.c.action)
                .where(t.audit.c.work_item_id == item_id)
                .order_by(t.audit.c.created_at, t.audit.c.id)
            )
        ).all()
    return [r.action for r in rows]


async def actionable_ids(svc: Service, org_id: str) -> list[str]:
    async with svc.db.read() as conn:
        page = await queue.actionable(conn, org_id)
    return [i["id"] for i in page["items"]]


async def seed_one(svc: Service, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """One approved item with its pending gating delivery: (item id, delivery row)."""
    seeded = await seed_items(svc.db, svc.clock, svc.ids, 1, **kwargs)
    return seeded.items[0]["id"], seeded.deliveries[0]


# ------------------------------------------------- SPEC 6 table, through the real path


async def gated_item(
    svc: Service, org: Org, binding: BindingSpec, text: str = "write it #complete"
) -> str:
    await make_agent(svc, org, "lead")
    worker = await make_agent(svc, org, "worker", lead="lead")
    out = await svc.turns.run(
        Trigger(org_id=org.id, agent_id=worker["id"], session_key="s1", text=text, binding=binding)
    )
    assert isinstance(out, Gated)
    return str(out.work_item_id)


async def test_api_binding_reveals_without_a_channel_call(
    svc: Service, channel: ScriptedChannel
) -> None:
    org = await make_org(svc)
    item_id = await gated_item(svc, org, BindingSpec(BindingKind.api))
    await drain(svc.lead_runner)
    row = await item(svc, item_id)
    async with svc.db.read() as conn:
        gated = await conn.scalar(
            sa.select(t.messages.c.lead_gated).where(t.messages.c.id == row["gated_message_id"])
        )
    assert row["status"] == "approved" and gated is True
    assert await drain(svc.relay) >= 1
    row = await item(svc, item_id)
    async with svc.db.read() as conn:
        gated = await conn.scalar(
            sa.select(t.messages.c.lead_gated).where(t.messages.c.id == row["gated_message_id"])
        )
        (dlv,) = await for_item(conn, item_id)
    assert gated is False
    assert row["status"] == "completed"
    assert (dlv["action"], dlv["status"]) == ("reveal", "sent")
    assert channel.calls == []
    assert "delivered" in await audit_actions(svc, item_id)


async def test_channel_binding_posts_the_snapshot_into_the_thread(
    svc: Service, channel: ScriptedChannel
) -> None:
    org = await make_org(svc)
    item_id = await gated_item(svc, org, BindingSpec(BindingKind.slack, address=SLACK_ADDRESS))
    await drain(svc.lead_runner)
    await drain(svc.relay)
    assert [(m.text, m.address, m.kind) for m in channel.calls] == [
        ("Echo: write it #complete", SLACK_ADDRESS, "gating")
    ]
    async with svc.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert (dlv["status"], dlv["external_id"], dlv["attempts"]) == ("sent", "ext-1", 1)
    assert channel.calls[0].idempotency_key == dlv["id"]
    assert (await item(svc, item_id))["status"] == "completed"


async def test_empty_snapshot_posts_the_summary(svc: Service, channel: ScriptedChannel) -> None:
    org = await make_org(svc)
    binding = BindingSpec(BindingKind.slack, address=SLACK_ADDRESS)
    item_id = await gated_item(svc, org, binding, text="#escalate do it #complete")
    await drain(svc.lead_runner)
    async with svc.db.tx() as conn:
        await conn.execute(
            t.work_items.update().where(t.work_items.c.id == item_id).values(snapshot="")
        )
        row = await workitems.get(conn, item_id)
        assert row["status"] == "awaitingHuman"
        await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
    await drain(svc.relay)
    assert channel.texts() == ["Summary: #escalate do it"]
    assert (await item(svc, item_id))["status"] == "completed"


@pytest.mark.parametrize(
    ("binding", "action"),
    [
        (BindingSpec(BindingKind.slack, address=SLACK_ADDRESS, silent=True), "silent"),
        (BindingSpec(BindingKind.scheduled), "scheduled"),
    ],
    ids=["silent", "scheduled"],
)
async def test_silent_and_scheduled_post_nothing_and_complete(
    svc: Service, channel: ScriptedChannel, binding: BindingSpec, action: str
) -> None:
    org = await make_org(svc)
    item_id = await gated_item(svc, org, binding)
    await drain(svc.lead_runner)
    await drain(svc.relay)
    async with svc.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert (dlv["action"], dlv["status"]) == (action, "sent")
    assert channel.calls == []
    assert (await item(svc, item_id))["status"] == "completed"


async def test_flow_continuation_is_never_picked_up(svc: Service, channel: ScriptedChannel) -> None:
    org = await make_org(svc)
    item_id = await gated_item(svc, org, BindingSpec(BindingKind.flow))
    await drain(svc.lead_runner)
    assert await svc.relay.run_once() is False
    fake_clock(svc).advance(SEND_LEASE_MS * 10)
    await drain(svc.relay)
    async with svc.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert (dlv["action"], dlv["status"], dlv["attempts"]) == ("continuation", "continuation", 0)
    assert channel.calls == []
    assert (await item(svc, item_id))["status"] == "approved"


async def test_no_active_binding_fails_delivery_and_item(
    svc: Service, channel: ScriptedChannel
) -> None:
    org = await make_org(svc)
    binding = BindingSpec(BindingKind.slack, address=SLACK_ADDRESS)
    item_id = await gated_item(svc, org, binding, text="#escalate do it #complete")
    await drain(svc.lead_runner)
    async with svc.db.tx() as conn:
        row = await workitems.get(conn, item_id)
        await deactivate_session(conn, row["session_id"])
        await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
    await drain(svc.relay)
    async with svc.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert dlv["status"] == "failed" and "no active binding" in dlv["error"]
    assert (await item(svc, item_id))["status"] == "failed"
    assert channel.calls == []
    assert "deliveryFailed" in await audit_actions(svc, item_id)


async def test_plain_channel_reply_rides_the_outbox(svc: Service, channel: ScriptedChannel) -> None:
    org = await make_org(svc)
    agent = await make_agent(svc, org, "plain")
    out = await svc.turns.run(
        Trigger(
            org_id=org.id,
            agent_id=agent["id"],
            session_key="s1",
            text="hello",
            binding=BindingSpec(BindingKind.slack, address=SLACK_ADDRESS),
        )
    )
    assert out == Reply("Echo: hello")
    await drain(svc.relay)
    assert [(m.text, m.kind) for m in channel.calls] == [("Echo: hello", "reply")]


# -------------------------------------------------------------------- outcome classes


async def test_success_commits_delivery_and_item_in_one_transaction(
    svc: Service, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    item_id, dlv = await seed_one(svc)
    relay = relay_for(svc)

    async def broken(*args: Any, **kwargs: Any) -> list[str]:
        raise RuntimeError("database went away mid-commit")

    # The item's move fails: the delivery's move to sent is rolled back with it.
    monkeypatch.setattr(workitems, "transition_many", broken)
    monkeypatch.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
    await relay.run_once()
    assert (await delivery(svc, dlv["id"]))["status"] == "sending"
    assert (await item(svc, item_id))["status"] == "approved"
    monkeypatch.undo()
    # The row is still leased: nothing is claimed (and nothing posted) a second time.
    assert await relay.run_once() is False
    assert len(channel.calls) == 1


async def test_retry_honours_retry_after_and_keeps_the_idempotency_key(
    svc: Service, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(svc)
    clock = fake_clock(svc)
    channel.script = [Retry("HTTP 429 ratelimited", delay_s=30), Retry("HTTP 503"), Sent("ts-9")]
    relay = relay_for(svc, rand=lambda: 1.0)
    t0 = clock.now_ms()
    await drain(relay)
    row = await delivery(svc, dlv["id"])
    assert (row["status"], row["attempts"], row["error"]) == ("pending", 1, "HTTP 429 ratelimited")
    assert row["next_attempt_at"] == t0 + 30_000  # Retry-After beats the 1 s backoff
    assert (await item(svc, item_id))["status"] == "approved"
    clock.advance(29_999)
    assert await relay.run_once() is False
    clock.advance(1)
    await drain(relay)
    row = await delivery(svc, dlv["id"])
    # Second attempt: no Retry-After, backoff 2 s * (0.5 + 0.5 * rand=1.0).
    assert (row["status"], row["attempts"]) == ("pending", 2)
    assert row["next_attempt_at"] == clock.now_ms() + 2_000
    clock.advance(2_000)
    await drain(relay)
    row = await delivery(svc, dlv["id"])
    assert (row["status"], row["external_id"], row["error"]) == ("sent", "ts-9", None)
    assert (await item(svc, item_id))["status"] == "completed"
    assert {m.idempotency_key for m in channel.calls} == {dlv["id"]}
    assert len(channel.calls) == 3


async def test_backoff_is_exponential_with_injectable_jitter(svc: Service) -> None:
    jitter = iter([0.0, 1.0, 0.5, 0.25])
    relay = relay_for(svc, rand=lambda: next(jitter))
    assert relay.backoff_s(1, None) == 0.5  # 1 s * (0.5 + 0)
    assert relay.backoff_s(2, None) == 2.0  # 2 s * (0.5 + 0.5)
    assert relay.backoff_s(3, None) == 3.0  # 4 s * 0.75
    assert relay.backoff_s(4, 100.0) == 100.0  # Retry-After wins
    capped = relay_for(svc, rand=lambda: 1.0)
    assert capped.backoff_s(30, None) == relay_mod.BACKOFF_CAP_S


async def test_attempts_are_bounded_then_delivery_and_item_fail(
    svc: Service, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(svc)
    clock = fake_clock(svc)
    channel.script = [Retry("HTTP 500")] * 10
    relay = relay_for(svc, max_attempts=3)
    for _ in range(5):
        await drain(relay)
        clock.advance(600_000)
    row = await delivery(svc, dlv["id"])
    assert row["status"] == "failed" and row["attempts"] == 3
    assert row["error"] == "gave up after 3 attempts: HTTP 500"
    assert len(channel.calls) == 3
    assert (await item(svc, item_id))["status"] == "failed"


async def test_permanent_fails_with_the_error_recorded(
    svc: Service, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(svc)
    channel.script = [Permanent("slack: HTTP 200 channel_not_found")]
    await drain(relay_for(svc))
    row = await delivery(svc, dlv["id"])
    assert (row["status"], row["error"]) == ("failed", "slack: HTTP 200 channel_not_found")
    wi = await item(svc, item_id)
    assert wi["status"] == "failed"
    assert "deliveryFailed" in await audit_actions(svc, item_id)
    fake_clock(svc).advance(3_600_000)
    await drain(relay_for(svc))
    assert len(channel.calls) == 1


@pytest.mark.parametrize(
    "answer",
    [Uncertain("slack: no answer before the timeout"), ConnectionResetError("adapter bug")],
    ids=["uncertain", "adapter-raises"],
)
async def test_uncertain_is_delivery_unknown_and_never_retried(
    svc: Service, channel: ScriptedChannel, answer: Any
) -> None:
    item_id, dlv = await seed_one(svc)
    org_id = (await item(svc, item_id))["org_id"]
    channel.script = [answer]
    await drain(relay_for(svc))
    row = await delivery(svc, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"]
    assert (await item(svc, item_id))["status"] == "approved"
    assert await actionable_ids(svc, org_id) == [item_id]
    assert "deliveryUnknown" in await audit_actions(svc, item_id)
    for _ in range(3):
        fake_clock(svc).advance(SEND_LEASE_MS * 2)
        await drain(relay_for(svc))
    assert len(channel.calls) == 1


async def test_expired_send_lease_posts_unknown_internal_pending(
    svc: Service, channel: ScriptedChannel
) -> None:
    post_item, post = await seed_one(svc)
    reveal_item, reveal = await seed_one(svc, kind=BindingKind.api)
    org_id = (await item(svc, post_item))["org_id"]
    crashed = relay_for(svc)  # claims, then "dies" before sending or committing
    claimed = await crashed.claim()
    assert {r["id"] for r in claimed} == {post["id"], reveal["id"]}
    clock = fake_clock(svc)
    survivor = relay_for(svc)
    clock.advance(SEND_LEASE_MS)  # not yet expired (strictly past the lease)
    assert await survivor.expire_send_leases() == 0
    clock.advance(1)
    await drain(survivor)
    row = await delivery(svc, post["id"])
    assert row["status"] == "deliveryUnknown" and "send lease expired" in row["error"]
    assert (await item(svc, post_item))["status"] == "approved"
    assert await actionable_ids(svc, org_id) == [post_item]
    # The internal action is idempotent: back to pending, then done.
    assert (await delivery(svc, reveal["id"]))["status"] == "sent"
    assert (await item(svc, reveal_item))["status"] == "completed"
    assert channel.calls == []  # the expired post is never re-sent
    # The crashed relay's late commit is fenced off by its lost lease.
    await crashed.complete([relay_mod._Done(r, Sent("late")) for r in claimed])
    assert (await delivery(svc, post["id"]))["status"] == "deliveryUnknown"


async def test_long_messages_are_split_in_order_with_nothing_dropped(svc: Service) -> None:
    small = ScriptedChannel("slack", max_chars=100)
    svc.channels["slack"] = small
    words = [f"word{i:03d}" for i in range(120)]
    text = " ".join(words[:60]) + "\n" + " ".join(words[60:])
    item_id, dlv = await seed_one(svc, text=lambda _: text)
    await drain(relay_for(svc))
    parts = small.texts()
    assert len(parts) > 8 and all(len(p) <= 100 for p in parts)
    assert " ".join(" ".join(parts).split()) == " ".join(words)
    assert [m.idempotency_key for m in small.calls] == [dlv["id"]] + [
        f"{dlv['id']}.{i}" for i in range(1, len(parts))
    ]
    assert (await item(svc, item_id))["status"] == "completed"


async def test_a_failed_later_part_is_uncertain_not_resent(svc: Service) -> None:
    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a"), Retry("HTTP 429", 1)])
    svc.channels["slack"] = small
    _, dlv = await seed_one(svc, text=lambda _: "x" * 250)
    await drain(relay_for(svc))
    row = await delivery(svc, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"].startswith("part 2 of 3")
    fake_clock(svc).advance(60_000)
    await drain(relay_for(svc))
    assert len(small.calls) == 2


def test_split_text_edges() -> None:
    assert split_text("short", 100) == ["short"]
    assert split_text("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]
    assert "".join(split_text("x" * 40_001, 40_000)) == "x" * 40_001
    text = ("a" * 60 + " ") * 5
    parts = split_text(text, 100)
    assert all(len(p) <= 100 for p in parts)
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")


# ----------------------------------------------------------------- operator recovery


async def unknown_delivery(svc: Service, channel: ScriptedChannel) -> tuple[str, dict[str, Any]]:
    item_id, dlv = await seed_one(svc)
    channel.script = [Uncertain("timeout after writing")]
    await drain(relay_for(svc))
    row = await delivery(svc, dlv["id"])
    assert row["status"] == "deliveryUnknown"
    return item_id, row


async def test_recover_confirm_completes_the_item(svc: Service, channel: ScriptedChannel) -> None:
    item_id, row = await unknown_delivery(svc, channel)
    async with svc.db.tx() as conn:
        await recover(conn, svc.clock, svc.ids, row, action="confirm", actor="user:op")
    assert (await delivery(svc, row["id"]))["status"] == "sent"
    assert (await item(svc, item_id))["status"] == "completed"
    assert "deliveryConfirmed" in await audit_actions(svc, item_id)
    with pytest.raises(TransitionError):
        async with svc.db.tx() as conn:
            await recover(conn, svc.clock, svc.ids, row, action="retry", actor="user:op")
    await drain(relay_for(svc))
    assert len(channel.calls) == 1


async def test_recover_retry_posts_once_more(svc: Service, channel: ScriptedChannel) -> None:
    item_id, row = await unknown_delivery(svc, channel)
    async with svc.db.tx() as conn:
        await recover(conn, svc.clock, svc.ids, row, action="retry", actor="user:op")
    assert (await delivery(svc, row["id"]))["status"] == "pending"
    await drain(relay_for(svc))
    await drain(relay_for(svc))
    final = await delivery(svc, row["id"])
    assert (final["status"], final["attempts"]) == ("sent", 2)
    assert (await item(svc, item_id))["status"] == "completed"
    assert [m.idempotency_key for m in channel.calls] == [row["id"], row["id"]]
    assert "deliveryRetried" in await audit_actions(svc, item_id)


# ------------------------------------------------------------------------- pipeline


async def test_pipeline_drains_many_with_bounded_concurrency_and_grouped_commits(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = ScriptedChannel("slack", delay_s=0.002)
    svc.channels["slack"] = slow
    seeded = await seed_items(svc.db, svc.clock, svc.ids, 300)
    replies = []
    async with svc.db.tx() as conn:
        for i in range(20):
            binding = {
                "id": f"bnd_reply{i}",
                "kind": "slack",
                "silent": False,
                "address": SLACK_ADDRESS,
            }
            replies.append(
                await enqueue_reply(
                    conn, svc.clock, svc.ids, org_id=seeded.org_id, binding=binding, text=f"r{i}"
                )
            )
    relay = relay_for(svc, batch=50, concurrency=8)
    commits: list[int] = []
    original = relay._complete_in

    async def counting(conn: Any, done: list[Any], now: int) -> None:
        commits.append(len(done))
        await original(conn, done, now)

    monkeypatch.setattr(relay, "_complete_in", counting)
    assert await drain(relay) >= 1
    assert slow.max_in_flight <= 8
    assert sorted(slow.texts()) == sorted(
        [f"approved output #{i}" for i in range(300)] + [f"r{i}" for i in range(20)]
    )
    assert sum(commits) == 320 and len(commits) < 320
    async with svc.db.read() as conn:
        statuses: dict[str, int] = dict(
            (
                await conn.execute(
                    sa.select(t.work_items.c.status, sa.func.count()).group_by(
                        t.work_items.c.status
                    )
                )
            ).all()
        )
        sent = await conn.scalar(
            sa.select(sa.func.count()).where(t.deliveries.c.status == DeliveryStatus.sent.value)
        )
        audits = await conn.scalar(
            sa.select(sa.func.count()).where(t.audit.c.action == "delivered")
        )
    assert statuses == {"completed": 300}
    assert sent == 320 and audits == 300


async def test_a_claim_takes_at_most_its_limit(svc: Service) -> None:
    # On PostgreSQL, UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)
    # may evaluate the subquery repeatedly and claim everything: it must not.
    await seed_items(svc.db, svc.clock, svc.ids, 40)
    relay = relay_for(svc)
    first = await relay.claim(10)
    second = await relay.claim(10)
    assert len(first) == 10 and len(second) == 10
    assert not {r["id"] for r in first} & {r["id"] for r in second}
    assert len({r["lease_token"] for r in first}) == 1
    assert (await delivery_counts(svc.db)) == {"pending": 20, "sending": 20}


async def test_run_once_is_false_when_idle(svc: Service) -> None:
    assert await relay_for(svc).run_once() is False


async def test_in_process_wake_delivers_without_waiting_for_the_poll(
    svc: Service, channel: ScriptedChannel
) -> None:
    seeded = await seed_items(svc.db, svc.clock, svc.ids, 1, status="awaitingHuman")
    posted = asyncio.Event()

    def mark(_: Any) -> Sent:
        posted.set()
        return Sent("x")

    channel.script = [mark]
    svc.start_runners()  # poll interval 30 s: only a wake-up can be this fast
    await asyncio.sleep(0.2)  # let the loops go idle
    async with svc.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[0]["id"])
        await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
    started = time.perf_counter()
    await asyncio.wait_for(posted.wait(), timeout=5)
    assert time.perf_counter() - started < 0.1


def test_relay_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        Relay(None, None, None, {}, send_lease_ms=0)  # type: ignore[arg-type]


# ------------------------------------------------------------------ local hand-off


async def test_running_service_hands_approvals_to_its_relay_without_a_claim(
    svc: Service, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = await seed_items(svc.db, svc.clock, svc.ids, 3, status="awaitingHuman")
    claims: list[int] = []
    original = svc.relay._claim_in

    async def counting(conn: Any, limit: int) -> list[dict[str, Any]]:
        rows = await original(conn, limit)
        claims.append(len(rows))
        return rows

    monkeypatch.setattr(svc.relay, "_claim_in", counting)
    posted = asyncio.Event()

    def mark(_: Any) -> Sent:
        if len(channel.calls) == 2:
            posted.set()
        return Sent("ts")

    channel.script = [mark, mark]
    svc.start_runners()
    await asyncio.sleep(0.2)
    async with svc.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[0]["id"])
        await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
        async with svc.db.read() as peek:  # not visible (nor handed over) before commit
            assert await for_item(peek, row["id"]) == []
    # A transaction that rolls back hands nothing over and posts nothing.
    with pytest.raises(RuntimeError):
        async with svc.db.tx() as conn:
            row = await workitems.get(conn, seeded.items[1]["id"])
            await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
            raise RuntimeError("rolled back")
    async with svc.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[2]["id"])
        await decisions.human_approve(conn, svc.clock, svc.ids, row, "user:test")
    await asyncio.wait_for(posted.wait(), timeout=5)
    for _ in range(100):
        if (await item(svc, seeded.items[2]["id"]))["status"] == "completed":
            break
        await asyncio.sleep(0.02)
    assert [m.text for m in channel.calls] == [
        seeded.items[0]["snapshot"],
        seeded.items[2]["snapshot"],
    ]
    async with svc.db.read() as conn:
        first = (await for_item(conn, seeded.items[0]["id"]))[0]
        assert await for_item(conn, seeded.items[1]["id"]) == []
    assert (first["status"], first["attempts"], first["lease_token"]) == ("sent", 1, None)
    assert (await item(svc, seeded.items[0]["id"]))["status"] == "completed"
    assert (await item(svc, seeded.items[1]["id"]))["status"] == "awaitingHuman"
    assert all(n == 0 for n in claims), claims  # never needed a claim


async def test_handed_over_rows_not_started_go_back_to_pending_at_shutdown(
    svc: Service, channel: ScriptedChannel
) -> None:
    from outbox.store import HANDOFF_TOPIC, set_local_relay

    relay = relay_for(svc)
    seeded = await seed_items(svc.db, svc.clock, svc.ids, 1, with_deliveries=False)
    svc.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    set_local_relay(svc.db.engine, relay)
    try:
        async with svc.db.tx() as conn:
            from outbox.store import enqueue_gating

            values = await enqueue_gating(conn, svc.clock, svc.ids, seeded.items[0])
    finally:
        set_local_relay(svc.db.engine, None)
        svc.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
    row = await delivery(svc, values["id"])
    assert (row["status"], row["lease_token"], row["attempts"]) == (
        "sending",
        relay.handoff_token,
        1,
    )
    assert [r["id"] for r in relay._handed] == [values["id"]]
    assert await relay.release_handoffs() == 1
    row = await delivery(svc, values["id"])
    assert (row["status"], row["lease_token"], row["attempts"]) == ("pending", None, 0)
    await drain(relay_for(svc))
    assert len(channel.calls) == 1
    assert (await delivery(svc, values["id"]))["status"] == "sent"


async def test_a_poked_relay_claims_and_an_idle_one_does_not_spin(
    svc: Service, channel: ScriptedChannel
) -> None:
    relay = svc.relay  # the service pokes it on every committed enqueue
    assert relay.poked_on_enqueue
    assert await relay.run_once() is False  # nothing due: one empty claim
    await seed_items(svc.db, svc.clock, svc.ids, 1)  # bulk insert: no poke
    assert await relay.run_once() is False  # found nothing a moment ago, not poked
    fake_clock(svc).advance(relay_mod.CLAIM_RECHECK_MS)
    assert await relay.run_once() is True  # periodic re-check finds it
    async with svc.db.tx() as conn:
        await enqueue_reply(
            conn,
            svc.clock,
            svc.ids,
            org_id="org_x",
            binding={"id": "bnd_x", "kind": "slack", "silent": False, "address": {}},
            text="poked",
        )
    assert await relay.run_once() is True  # the enqueue poked it
    assert channel.texts()[-1] == "poked"
    # Its own retries are claimed as soon as they are due, without waiting for the
    # periodic re-check.
    relay.rand = lambda: 0.0  # backoff 0.5 s; Retry-After 0.6 s wins
    channel.script = [Retry("HTTP 503", delay_s=0.6)]
    await seed_items(svc.db, svc.clock, svc.ids, 1, text=lambda _: "retried")
    fake_clock(svc).advance(relay_mod.CLAIM_RECHECK_MS)
    await drain(relay)
    assert channel.texts()[-1] == "retried"
    fake_clock(svc).advance(600)
    await drain(relay)
    assert channel.texts()[-2:] == ["retried", "retried"]
