"""Organization output policy: ordered ``{pattern, action}`` rules on ungated replies."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn

BLOCK_NOTICE = "This reply was withheld by your organization's output policy."
REDACTED = "[redacted]"


@dataclass(frozen=True)
class Rule:
    """One rule: ``block`` replaces the whole reply, ``redact`` replaces matches."""

    pattern: re.Pattern[str]
    action: str


def compile_rule(pattern: str, action: str) -> Rule:
    """Validate a rule (regex syntax, action name)."""
    if action not in ("block", "redact"):
        raise ValidationError("policy action must be block or redact", rule="policy.action")
    if not pattern or len(pattern) > 2000:
        raise ValidationError("policy pattern must be 1..2,000 characters", rule="policy.pattern")
    try:
        return Rule(re.compile(pattern), action)
    except (re.error, OverflowError, RecursionError) as exc:
        # re raises OverflowError for huge repeat counts and RecursionError for deep
        # nesting; both are bad patterns, not crashes.
        raise ValidationError(
            f"policy pattern is not a valid regular expression: {exc}", rule="policy.pattern"
        ) from None


def screen(text: str, rules: list[Rule]) -> str:
    """Apply rules in order: the first matching ``block`` wins over everything after it."""
    for rule in rules:
        if rule.action == "block":
            if rule.pattern.search(text):
                return BLOCK_NOTICE
        else:
            text = rule.pattern.sub(REDACTED, text)
    return text


# Built once: every turn loads the rules.
_RULES = (
    sa.select(t.policy_rules.c.pattern, t.policy_rules.c.action)
    .where(t.policy_rules.c.org_id == sa.bindparam("p_org_id"))
    .order_by(t.policy_rules.c.position)
)


async def load_rules(conn: Conn, org_id: str) -> list[Rule]:
    """The organization's rules in order."""
    rows = (await conn.execute(_RULES, {"p_org_id": org_id})).all()
    return [compile_rule(r.pattern, r.action) for r in rows]


async def add_rule(
    conn: Conn, clock: Clock, ids: IdFactory, org_id: str, pattern: str, action: str
) -> dict[str, Any]:
    """Append a rule to the organization's policy."""
    compile_rule(pattern, action)
    position = (
        await conn.scalar(
            sa.select(sa.func.coalesce(sa.func.max(t.policy_rules.c.position), 0)).where(
                t.policy_rules.c.org_id == org_id
            )
        )
        or 0
    ) + 1
    rule_id = ids.new("pol")
    await conn.execute(
        t.policy_rules.insert().values(
            id=rule_id,
            org_id=org_id,
            position=position,
            pattern=pattern,
            action=action,
            created_at=clock.now_ms(),
        )
    )
    return {"id": rule_id, "position": position, "pattern": pattern, "action": action}
