"""Organization output policy: ordered ``{pattern, action}`` rules on ungated replies.

Patterns run on RE2 (google-re2), not Python's ``re``: a reply is text a requester steers
(the worker echoes and quotes them), and ``re`` backtracks, so ``(a+)+b`` over 25
characters held the event loop for 5.6 s, doubling with each one more. RE2 matches in
time linear in the text, whatever the pattern; what it gives up (lookaround,
backreferences) is refused when a rule is added (``policy.pattern``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, TypedDict

import re2
import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import NotFound, ValidationError, quoted
from leadgate.database import schema as t
from leadgate.database.db import Conn

log = logging.getLogger("leadgate.policy")

BLOCK_NOTICE = "This reply was withheld by your organization's output policy."
REDACTED = "[redacted]"
PATTERN_LIMIT = 2_000


@dataclass(frozen=True)
class Rule:
    """One rule: ``block`` replaces the whole reply, ``redact`` replaces matches."""

    pattern: Any  # a compiled RE2 pattern (``re2._Regexp``: the package ships no types)
    action: str


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our 400, not a line on stderr
    return options


_OPTIONS = _options()


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    # Every turn of an organization with rules loads them: compile each pattern once.
    return re2.compile(pattern, _OPTIONS)


def compile_rule(pattern: str, action: str) -> Rule:
    """Validate a rule: the action's name, and a pattern RE2 runs that cannot match
    the empty text (it would redact between every two characters, or block every
    reply)."""
    if action not in ("block", "redact"):
        raise ValidationError("policy action must be block or redact", rule="policy.action")
    if not pattern or len(pattern) > PATTERN_LIMIT:
        raise ValidationError("policy pattern must be 1..2,000 characters", rule="policy.pattern")
    try:
        compiled = _compiled(pattern)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else b"not valid"
        why = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)
        raise ValidationError(
            f"policy pattern is not a regular expression RE2 runs ({why}; lookaround and "
            "backreferences are not supported)",
            rule="policy.pattern",
        ) from None
    if compiled.search("") is not None:
        raise ValidationError(
            "policy pattern matches the empty text, so it would match every reply",
            rule="policy.pattern",
        )
    return Rule(compiled, action)


def screen(text: str, rules: list[Rule]) -> str:
    """Apply rules in order: the first matching ``block`` wins over everything after it."""
    for rule in rules:
        if rule.action == "block":
            if rule.pattern.search(text):
                return BLOCK_NOTICE
        else:
            text = rule.pattern.sub(REDACTED, text)
    return text


#: A stored rule that no longer compiles (added before patterns ran on RE2, with a
#: lookaround, say): it blocks every reply until it is removed, since a policy that
#: silently stopped applying would let through what it was written to stop.
_UNUSABLE = Rule(_compiled("(?s).+|^$"), "block")


# Built once: every turn loads the rules.
_RULES = (
    sa.select(t.policy_rules.c.id, t.policy_rules.c.pattern, t.policy_rules.c.action)
    .where(t.policy_rules.c.org_id == sa.bindparam("p_org_id"))
    .order_by(t.policy_rules.c.position)
)


async def load_rules(conn: Conn, org_id: str) -> list[Rule]:
    """The organization's rules in order (one that no longer compiles blocks)."""
    rows = (await conn.execute(_RULES, {"p_org_id": org_id})).all()
    rules = []
    for r in rows:
        try:
            rules.append(compile_rule(r.pattern, r.action))
        except ValidationError as exc:
            log.warning(
                "output policy rule %s of %s cannot run (%s): every reply is blocked until "
                "it is removed (leadgate policy remove)",
                r.id,
                org_id,
                exc.message,
            )
            rules.append(_UNUSABLE)
    return rules


class RuleView(TypedDict):
    """An output policy rule as stored (``position``: where it applies, from 1)."""

    id: str
    position: int
    pattern: str
    action: str


class RemovedRuleView(TypedDict):
    """An output policy rule just deleted."""

    id: str
    removed: bool


async def list_rules(conn: Conn, org_id: str) -> list[RuleView]:
    """The organization's rules in order, as stored."""
    p = t.policy_rules.c
    rows = await conn.execute(
        sa.select(p.id, p.position, p.pattern, p.action)
        .where(p.org_id == org_id)
        .order_by(p.position)
    )
    return [
        {"id": r.id, "position": r.position, "pattern": r.pattern, "action": r.action} for r in rows
    ]


async def remove_rule(conn: Conn, org_id: str, rule_id: str) -> RemovedRuleView:
    """Delete one rule of the organization (404 ``policy.not_found`` otherwise); the
    next turn no longer applies it."""
    p = t.policy_rules.c
    result = await conn.execute(t.policy_rules.delete().where(p.org_id == org_id, p.id == rule_id))
    if not result.rowcount:
        raise NotFound(
            f"no policy rule {quoted(rule_id)} in this organization", rule="policy.not_found"
        )
    return {"id": rule_id, "removed": True}


async def add_rule(
    conn: Conn, clock: Clock, ids: IdFactory, org_id: str, pattern: str, action: str
) -> RuleView:
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
