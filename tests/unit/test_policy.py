"""Organization output policy (SPEC 3 Decision): ordered ``{pattern, action}`` rules on
ungated replies; block replaces the whole reply, redact replaces matches."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.errors import NotFound, ValidationError
from leadgate.core.runners import drain
from leadgate.core.types import Gated, Reply
from leadgate.database import schema as t
from leadgate.domain import policy
from leadgate.domain.policy import BLOCK_NOTICE, REDACTED, Rule, compile_rule, screen
from leadgate.turns.messages import visible_transcript
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.stack import Stack

# ------------------------------------------------------------------------- pure


def rules(*pairs: tuple[str, str]) -> list[Rule]:
    return [compile_rule(pattern, action) for pattern, action in pairs]


def test_block_replaces_the_whole_reply() -> None:
    assert screen("the secret is 42", rules(("secret", "block"))) == BLOCK_NOTICE
    assert screen("nothing to see", rules(("secret", "block"))) == "nothing to see"
    assert BLOCK_NOTICE and "secret" not in BLOCK_NOTICE


def test_redact_replaces_every_match() -> None:
    out = screen("pin 1234, card 5678 9012", rules((r"\d{4}", "redact")))
    assert out == f"pin {REDACTED}, card {REDACTED} {REDACTED}"
    assert REDACTED == "[redacted]"


def test_rules_apply_in_order() -> None:
    # redact first: the block no longer matches
    assert screen("my dog", rules(("dog", "redact"), ("dog", "block"))) == "my [redacted]"
    # block first: blocked
    assert screen("my dog", rules(("dog", "block"), ("dog", "redact"))) == BLOCK_NOTICE
    # a later rule sees the earlier rule's output
    assert (
        screen("my cat", rules(("cat", "redact"), (re.escape(REDACTED), "block"))) == BLOCK_NOTICE
    )
    assert screen("a-b", rules(("a", "redact"), ("b", "redact"))) == "[redacted]-[redacted]"
    assert screen("unchanged", []) == "unchanged"


@pytest.mark.parametrize(
    ("pattern", "action", "rule"),
    [
        ("(", "redact", "policy.pattern"),
        ("[a-", "block", "policy.pattern"),
        ("a**", "redact", "policy.pattern"),
        ("(?P<x>a)(?P=y)", "redact", "policy.pattern"),
        ("", "block", "policy.pattern"),
        ("x" * 2001, "block", "policy.pattern"),
        # What RE2 gives up for linear time: lookaround, backreferences.
        ("(?=secret)", "redact", "policy.pattern"),
        ("(?<!x)y", "block", "policy.pattern"),
        (r"(a)\1", "redact", "policy.pattern"),
        ("a{1001}", "redact", "policy.pattern"),
        # Matching the empty text: it would redact between every two characters.
        ("(?i)", "redact", "policy.pattern"),
        ("x*", "block", "policy.pattern"),
        ("ok", "delete", "policy.action"),
        ("ok", "BLOCK", "policy.action"),
        ("ok", "", "policy.action"),
    ],
)
def test_compile_rule_rejects_bad_rules_with_a_validation_error(
    pattern: str, action: str, rule: str
) -> None:
    with pytest.raises(ValidationError) as info:
        compile_rule(pattern, action)
    assert info.value.rule == rule


def test_a_pattern_that_would_backtrack_runs_in_linear_time() -> None:
    # Python's re takes about 2**40 steps for this (the event loop held for days); RE2
    # answers at once. A regression shows as this test's timeout, not as a timing.
    text = "a" * 40 + "c"
    assert screen(text, rules(("(a+)+b", "block"), ("(x+x+)+y", "redact"))) == text
    deep = "(" * 700 + "deep" + ")" * 700  # re ran out of recursion compiling this
    assert screen("in deep water", rules((deep, "redact"))) == "in [redacted] water"


def test_a_stored_rule_that_no_longer_compiles_blocks_every_reply() -> None:
    # (a rule added before patterns ran on RE2, with a lookahead, say)
    assert screen("anything", [policy._UNUSABLE]) == BLOCK_NOTICE
    assert screen("", [policy._UNUSABLE]) == BLOCK_NOTICE


# ----------------------------------------------------------------- on the turn path


async def add(stack: Stack, org: Org, pattern: str, action: str) -> policy.RuleView:
    async with stack.db.tx() as conn:
        return await policy.add_rule(conn, stack.clock, stack.ids, org.id, pattern, action)


async def test_policy_screens_plain_replies_in_order_per_organization(stack: Stack) -> None:
    redacting = await make_org(stack, "redacting")
    blocking = await make_org(stack, "blocking")
    ordered = await make_org(stack, "ordered")
    free = await make_org(stack, "free")

    assert (await add(stack, redacting, r"\d{4}", "redact"))["position"] == 1
    assert (await add(stack, redacting, "never-matches", "block"))["position"] == 2
    await add(stack, blocking, "forbidden", "block")
    await add(stack, ordered, "cat", "redact")
    await add(stack, ordered, re.escape(REDACTED), "block")

    # Invalid rules are rejected when they are added, and nothing is written.
    async with stack.db.read() as conn:
        before = await conn.scalar(sa.select(sa.func.count()).select_from(t.policy_rules))
    for pattern, action in (("(", "redact"), ("(?=x)", "block"), ("ok", "erase")):
        with pytest.raises(ValidationError):
            await add(stack, free, pattern, action)
    async with stack.db.read() as conn:
        after = await conn.scalar(sa.select(sa.func.count()).select_from(t.policy_rules))
    assert after == before == 5

    names = iter(range(100))

    async def reply(org: Org, text: str) -> Any:
        agent = await make_agent(stack, org, f"agent-{next(names)}")
        deltas: list[str] = []

        async def on_delta(piece: str) -> None:
            deltas.append(piece)

        out = await stack.turns.run(api_trigger(org, agent, text), on_delta=on_delta)
        async with stack.db.read() as conn:
            stored = await conn.scalar(
                sa.select(t.messages.c.content)
                .where(t.messages.c.org_id == org.id, t.messages.c.role == "assistant")
                .order_by(t.messages.c.created_at.desc(), t.messages.c.id.desc())
                .limit(1)
            )
        return out, deltas, stored

    out, deltas, stored = await reply(redacting, "pin 1234 and 5678")
    assert out == Reply("Echo: pin [redacted] and [redacted]")
    assert stored == "Echo: pin [redacted] and [redacted]"
    # With rules in force nothing streams live: the text is delivered whole once screened.
    assert deltas == []

    out, deltas, stored = await reply(blocking, "say forbidden things at length")
    assert out == Reply(BLOCK_NOTICE)
    assert stored == BLOCK_NOTICE
    assert deltas == []

    out, _, _ = await reply(ordered, "my cat")
    assert out == Reply(BLOCK_NOTICE)

    # An organization without rules is untouched, and its plain reply streams live.
    out, deltas, stored = await reply(free, "pin 1234, forbidden cat")
    assert out == Reply("Echo: pin 1234, forbidden cat", streamed=True)
    assert "".join(deltas) == "Echo: pin 1234, forbidden cat"
    assert stored == "Echo: pin 1234, forbidden cat"


async def test_policy_is_not_applied_to_gated_text(stack: Stack) -> None:
    org = await make_org(stack)
    await add(stack, org, "Echo", "block")
    await add(stack, org, "secret", "redact")
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")

    out = await stack.turns.run(api_trigger(org, worker, "the secret plan #complete"))
    assert isinstance(out, Gated)
    async with stack.db.read() as conn:
        item = (
            await conn.execute(sa.select(t.work_items).where(t.work_items.c.id == out.work_item_id))
        ).one()
        gated = await conn.scalar(
            sa.select(t.messages.c.content).where(t.messages.c.id == item.gated_message_id)
        )
    assert item.snapshot == "Echo: the secret plan #complete"
    assert gated == "Echo: the secret plan #complete"

    # The lead reviews the unscreened text; once approved it is revealed as it was.
    await drain(stack.lead_runner)
    await drain(stack.relay)
    async with stack.db.read() as conn:
        shown = await visible_transcript(conn, org.id, item.session_id)
    assert [r["content"] for r in shown if r["role"] == "assistant"] == [
        "Echo: the secret plan #complete"
    ]

    # An ungated turn of the same worker is screened.
    again = await stack.turns.run(api_trigger(org, worker, "another secret"))
    assert again == Reply(BLOCK_NOTICE)


async def test_rules_are_listed_and_a_removed_rule_no_longer_applies(stack: Stack) -> None:
    org = await make_org(stack)
    other = await make_org(stack, "other")
    worker = await make_agent(stack, org, "worker")
    kept = await add(stack, org, "secret", "redact")
    dropped = await add(stack, org, "plan", "block")
    assert await stack.turns.run(api_trigger(org, worker, "the secret plan")) == Reply(BLOCK_NOTICE)
    async with stack.db.read() as conn:
        listed = await policy.list_rules(conn, org.id)
    assert [(r["id"], r["position"], r["action"]) for r in listed] == [
        (kept["id"], 1, "redact"),
        (dropped["id"], 2, "block"),
    ]
    async with stack.db.tx() as conn:
        with pytest.raises(NotFound) as missing:
            await policy.remove_rule(conn, other.id, dropped["id"])  # not its organization's
        assert missing.value.rule == "policy.not_found"
        assert (await policy.remove_rule(conn, org.id, dropped["id"]))["removed"] is True
    out = await stack.turns.run(api_trigger(org, worker, "the secret plan", "s2"))
    assert out == Reply("Echo: the [redacted] plan")


async def test_a_stored_rule_re2_cannot_run_blocks_until_removed(stack: Stack) -> None:
    # Added before patterns ran on RE2 (Python's re took lookarounds).
    org = await make_org(stack)
    worker = await make_agent(stack, org, "worker")
    async with stack.db.tx() as conn:
        await conn.execute(
            t.policy_rules.insert().values(
                id="pol_legacy",
                org_id=org.id,
                position=1,
                pattern="secret(?= plan)",
                action="redact",
                created_at=stack.clock.now_ms(),
            )
        )
    assert await stack.turns.run(api_trigger(org, worker, "hello")) == Reply(BLOCK_NOTICE)
    async with stack.db.tx() as conn:
        await policy.remove_rule(conn, org.id, "pol_legacy")
    out = await stack.turns.run(api_trigger(org, worker, "hello", "s2"))
    assert isinstance(out, Reply) and out.text == "Echo: hello"
