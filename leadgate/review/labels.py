"""Human words for operators: who an audit actor is, who asked, where an approval goes.

The console and the CLI show these instead of raw ids (``user:usr_…`` becomes the user's
name and email, ``lead:agt_…`` the lead agent's name). Reads only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain.rows import Binding
from outbox.store import action_for

_CHANNEL_NAMES = {
    "api": "API",
    "studio": "Studio",
    "slack": "Slack",
    "discord": "Discord",
    "teams": "Teams",
    "email": "Email",
    "scheduled": "Schedule",
    "flow": "ActionFlow",
    "none": "no binding",
}


class Actor(NamedTuple):
    """An audit actor as an operator reads it."""

    kind: str  # user | key | lead | cli | system
    name: str
    email: str | None


async def resolve_actors(conn: Conn, org_id: str, actors: Iterable[str]) -> dict[str, Actor]:
    """Each ``kind:id`` actor of ``actors`` with its display name (one query per kind,
    confined to ``org_id``: an id of another organization stays a bare id)."""
    wanted: dict[str, set[str]] = {}
    for actor in set(actors):
        kind, _, ident = actor.partition(":")
        wanted.setdefault(kind, set()).add(ident)
    users: dict[str, tuple[str | None, str]] = {}
    if wanted.get("user"):
        rows = await conn.execute(_USERS, {"p_org": org_id, "p_ids": sorted(wanted["user"])})
        users = {r.id: (r.name, r.email) for r in rows}
    agents: dict[str, str] = {}
    if wanted.get("lead"):
        rows = await conn.execute(_AGENTS, {"p_org": org_id, "p_ids": sorted(wanted["lead"])})
        agents = {r.id: r.name for r in rows}
    keys: dict[str, str | None] = {}
    if wanted.get("key"):
        rows = await conn.execute(_KEYS, {"p_org": org_id, "p_ids": sorted(wanted["key"])})
        keys = {r.id: r.name for r in rows}
    out: dict[str, Actor] = {}
    for kind, idents in wanted.items():
        for ident in idents:
            out[f"{kind}:{ident}"] = _actor(kind, ident, users, agents, keys)
    return out


def _actor(
    kind: str,
    ident: str,
    users: dict[str, tuple[str | None, str]],
    agents: dict[str, str],
    keys: dict[str, str | None],
) -> Actor:
    if kind == "user":
        if ident in users:
            name, email = users[ident]
            return Actor("user", name or email, email)
        return Actor("user", f"deleted user {ident}", None)
    if kind == "lead":
        return Actor("lead", f"lead agent {agents.get(ident, ident)}", None)
    if kind == "key":
        label = keys.get(ident)
        return Actor("key", f"API key {label} ({ident})" if label else f"API key {ident}", None)
    if kind == "cli":
        return Actor("cli", f"{ident} (command line)", None)
    return Actor("system", f"leadgate ({ident})" if ident else kind, None)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def requester(kind: str | None, address: Any, session_key: str | None) -> str:
    """Who (or what) sent the work, in a few words, from the item's binding and session."""
    addr = _obj(address)
    key = session_key or ""
    if kind in ("api", "studio"):
        if key.startswith("h:"):
            return f"session {key[2:]}"
        if key.startswith("u:"):
            return f"user {key[2:]}"
        if key.startswith("default:"):
            return f"default session of {key[len('default:') :]}"
        return f"session {key}" if key else "API caller"
    if kind == "slack":
        return f"Slack channel {addr.get('channel', '?')} (team {addr.get('team', '?')})"
    if kind == "discord":
        return f"Discord channel {addr.get('channel_id', '?')}"
    if kind == "teams":
        user = _obj(_obj(addr.get("reference")).get("user"))
        who = user.get("name") or user.get("id")
        return f"Teams user {who}" if who else "Teams conversation"
    if kind == "email":
        return str(addr.get("to") or "email sender")
    if kind == "scheduled":
        return "a schedule"
    if kind == "flow":
        return "an ActionFlow run"
    return "unknown"


def channel_name(kind: str | None) -> str:
    """The channel's display name."""
    return _CHANNEL_NAMES.get(kind or "none", kind or "none")


def destination(binding: Binding | None) -> dict[str, Any]:
    """Where an approval of the item will go (the session's active binding, SPEC 6)."""
    action, channel = action_for(binding)
    addr: dict[str, Any] = binding.address if binding is not None else {}
    out: dict[str, Any] = {
        "channel": channel,
        "action": action,
        "silent": bool(binding.silent) if binding is not None else False,
        "conversation": None,
        "thread": None,
    }
    if binding is None:
        out["description"] = (
            "The session has no active binding: an approval cannot be delivered and the "
            "delivery will fail."
        )
        return out
    if channel == "slack":
        out["conversation"] = addr.get("channel")
        out["thread"] = addr.get("thread_ts")
    elif channel == "discord":
        out["conversation"] = addr.get("channel_id")
        out["thread"] = addr.get("message_id")
    elif channel == "teams":
        out["conversation"] = _obj(_obj(addr.get("reference")).get("conversation")).get("id")
        out["thread"] = addr.get("activity_id")
    elif channel == "email":
        out["conversation"] = addr.get("to")
        out["thread"] = addr.get("subject")
    out["description"] = _describe(action, channel, out)
    return out


def _describe(action: str, channel: str, d: dict[str, Any]) -> str:
    name = channel_name(channel)
    if action == "silent":
        return f"Silent {name} binding: nothing is posted; the item completes."
    if action == "reveal":
        return f"{name}: the stored answer is revealed in the session transcript."
    if action == "scheduled":
        return "Scheduled run: marked sent without a channel message."
    if action == "continuation":
        return "ActionFlow: the flow resumes after the agent node (no message is posted)."
    where = f" {d['conversation']}" if d["conversation"] else ""
    if channel == "email":
        return f"Email reply to{where}" + (f" ({d['thread']})" if d["thread"] else "") + "."
    thread = f", in thread {d['thread']}" if d["thread"] else ""
    return f"Posts the approved text to {name}{where}{thread}."


def _names_of(table: sa.Table, *columns: str) -> sa.Select[Any]:
    """Names of ``table``'s rows of one organization, by a list of ids (built once)."""
    c = table.c
    return sa.select(c.id, *(c[n] for n in columns)).where(
        c.org_id == sa.bindparam("p_org"), c.id.in_(sa.bindparam("p_ids", expanding=True))
    )


_USERS = _names_of(t.users, "name", "email")
_AGENTS = _names_of(t.agents, "name")
_KEYS = _names_of(t.api_keys, "name")
