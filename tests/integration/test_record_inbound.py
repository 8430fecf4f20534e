"""The channels' shared step through the real composition root: recorded before the
answer, run after; rule-breaking messages answered with a notice; unstorable ids 400."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from leadgate.app import App
from leadgate.core.errors import ModelError, Unavailable, ValidationError
from leadgate.core.types import BindingKind, Inbound
from leadgate.database import schema as t
from tests.fakes import DownFor
from tests.helpers import make_agent, make_org, make_route


def mail(text: str, message_id: str = "<m1@example.com>", **address: str) -> Inbound:
    return Inbound(
        channel=BindingKind.email,
        route_attrs={"address": "plain@leadgate.test", "sender": "ann@example.com"},
        session_key=f"email:plain@leadgate.test:{message_id}",
        text=text,
        address={"to": "ann@example.com", "subject": "Re: hi", **address},
        external_event_id=f"email:plain@leadgate.test:{message_id}",
    )


async def setup_route(service: App) -> None:
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    await make_route(service, org, plain["id"], "email")


async def rows(service: App, table: sa.Table) -> list[dict[str, object]]:
    async with service.db.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(sa.select(table))).all()]


async def test_recorded_before_the_turn_runs(service: App) -> None:
    await setup_route(service)
    recorded = await service.messages.record_inbound(mail("hello"))
    assert recorded is not None and recorded.turn is not None
    # Durable now: the message and its run are stored, though no turn has run yet.
    assert [m["content"] for m in await rows(service, t.messages)] == ["hello"]
    assert len(await rows(service, t.turn_runs)) == 1
    routed = await service.messages.run_recorded(recorded)
    assert routed is not None
    assert await rows(service, t.turn_runs) == []
    replies = [d["text"] for d in await rows(service, t.deliveries)]
    assert replies == ["Echo: hello"]


async def test_a_failed_turn_whose_run_cannot_be_closed_raises_the_fault(service: App) -> None:
    """A channel turn fails (the model's error: the script model's ``#fail``) and
    closing its run, which queues the failure notice in the same transaction, meets a
    database fault: no notice is queued and the run is left to the recovery runner. The
    turn raises that fault, from the model's error: an adapter's failed hook
    (:func:`bots.base.accept`) sees the run left to recovery, and Discord ends an
    /ask's deferred response as for a turn stopped on a fault. It raised the model's
    error, and "thinking..." stayed until recovery answered it (for good when gated)."""
    await setup_route(service)
    recorded = await service.messages.record_inbound(mail("hello #fail"))
    assert recorded is not None and recorded.turn is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.db, "tx", DownFor(service.db.tx, 1, after_commit=False))
        with pytest.raises(Unavailable) as raised:
            await service.messages.run_recorded(recorded)
    assert isinstance(raised.value.__cause__, ModelError)
    assert len(await rows(service, t.turn_runs)) == 1  # (left to the recovery runner)
    assert await rows(service, t.deliveries) == []


@pytest.mark.parametrize(
    ("text", "says", "rule"),
    [
        ("x" * 100_001, "100,000 characters", "message.too_long"),
        ("a\x00b", "NUL", "message.invalid"),
        ("a\ud800b", "surrogate", "message.invalid"),
        (" \n", "empty", "message.empty"),
    ],
)
async def test_rule_breaking_mail_gets_a_notice_once(
    service: App, text: str, says: str, rule: str
) -> None:
    """The notice says why and names the rule, as every refusal does (it kept the
    text alone: "Your message was not processed: the message ... characters.")."""
    await setup_route(service)
    first = await service.messages.record_inbound(mail(text))
    assert first is not None and first.rejected is not None
    assert says in first.rejected.message and first.rejected.rule == rule
    again = await service.messages.record_inbound(mail(text))  # the sender retries
    assert again is not None and again.rejected is not None
    notices = [str(d["text"]) for d in await rows(service, t.deliveries)]
    assert len(notices) == 1 and says in notices[0], notices
    assert notices[0].startswith("Your message was not processed: ")
    assert notices[0].endswith(f" [{rule}]."), notices
    events = await rows(service, t.inbound_events)
    assert [e["outcome"] for e in events] == ["rejectedInvalid"]
    assert "\x00" not in str(events[0]["content"])
    assert await rows(service, t.messages) == []  # no turn, no transcript row


async def test_unstorable_identifiers_are_refused_with_nothing_stored(service: App) -> None:
    await setup_route(service)
    with pytest.raises(ValidationError):
        await service.messages.record_inbound(mail("hi", message_id="<a\x00b@x>"))
    with pytest.raises(ValidationError):
        await service.messages.record_inbound(mail("hi", subject="\ud800"))
    assert await rows(service, t.sessions) == []


async def test_the_next_message_finds_its_route_without_a_statement(service: App) -> None:
    """Every channel message resolves its route before the platform is answered; the
    routes are kept until a write to them is committed (RouteCache). On PostgreSQL only
    while the process LISTENs, which this fixture (no background loops) does not."""
    await setup_route(service)
    assert await service.messages.record_inbound(mail("one", "<r1@example.com>")) is not None
    with service.db.record_statements() as statements:
        assert await service.messages.record_inbound(mail("two", "<r2@example.com>")) is not None
    route_reads = [sql for sql in statements if "FROM routes" in sql]
    assert len(route_reads) == (0 if service.db.is_sqlite else 1)
    async with service.db.tx() as conn:
        await conn.execute(sa.update(t.routes).values(active=False))
    assert await service.messages.record_inbound(mail("three", "<r3@example.com>")) is None
