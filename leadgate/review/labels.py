"""Human words for operators: who an audit actor is, who asked, where an approval goes.

The console and the CLI show these instead of raw ids (``user:usr_…`` becomes the user's
name and email, ``lead:agt_…`` the lead agent's name). Reads only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.database.plans import AnyRow
from leadgate.domain.rows import Binding
from outbox.store import action_for

AU = t.audit.c

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


def _names_join(table: sa.Table, prefix: str) -> sa.ColumnElement[bool]:
    """``table``'s row of the audit row's ``<prefix><id>`` actor, in the caller's
    organization (an id of another organization stays a bare id). The id is compared
    to a substring of the actor so that both backends look it up by primary key."""
    c = table.c
    return sa.and_(
        sa.func.substr(AU.actor, 1, len(prefix)) == prefix,
        c.id == sa.func.substr(AU.actor, len(prefix) + 1),
        c.org_id == sa.bindparam("p_org"),
    )


_AUDIT_COLUMNS = len(t.audit.c)
#: The actor names :func:`named_audit` answers after the audit row's own columns.
_NAMES = (t.users.c.id, t.users.c.name, t.users.c.email, t.agents.c.name, t.api_keys.c.name)


def _with_names(audit: sa.FromClause) -> sa.Join:
    """``audit`` (the audit table, or a join holding it) with the user, lead agent and
    API key its rows' actors name joined in (:data:`_NAMES`)."""
    return (
        audit.outerjoin(t.users, _names_join(t.users, "user:"))
        .outerjoin(t.agents, _names_join(t.agents, "lead:"))
        .outerjoin(t.api_keys, _names_join(t.api_keys, "key:"))
    )


def named_audit(
    where: sa.ColumnElement[bool] | None = None,
    *,
    newest: bool = False,
    extra: Sequence[sa.Label[Any]] = (),
) -> sa.Select[Any]:
    """An item's audit (``p_item``), oldest first, with the names of its user, lead agent
    and API key actors joined in (one statement where it was three). ``where`` narrows
    the rows; ``newest`` takes only the ``p_limit`` newest (still answered oldest first
    by :func:`audit_with_actors`); ``extra`` columns (labelled) follow the names, each
    evaluated over every row ``where`` keeps, before ``newest`` leaves any out (a window
    function sees the older rows too). Built once per use at import: the plan cache
    keys on the statement object."""
    if newest:
        return _newest_named(where, extra)
    stmt = (
        sa.select(t.audit, *_NAMES, *extra)
        .select_from(_with_names(t.audit))
        .where(AU.work_item_id == sa.bindparam("p_item"))
    )
    if where is not None:
        stmt = stmt.where(where)
    return stmt.order_by(AU.created_at, AU.id)


def _newest_named(
    where: sa.ColumnElement[bool] | None, extra: Sequence[sa.Label[Any]]
) -> sa.Select[Any]:
    """:func:`named_audit`'s ``newest``: the ``p_limit`` newest rows picked by their
    narrow columns (``extra`` evaluated there, over every row ``where`` keeps), then the
    whole rows and their names joined to those alone. Picked and named whole, every row
    of the item was sorted with its text and looked up three times (an item with 20,000
    audit rows: bench.operator_reads)."""
    picked = sa.select(AU.id, *extra).where(AU.work_item_id == sa.bindparam("p_item"))
    if where is not None:
        picked = picked.where(where)
    kept = (
        picked.order_by(AU.created_at.desc(), AU.id.desc())
        .limit(sa.bindparam("p_limit"))
        .subquery("newest")
    )
    return (
        sa.select(t.audit, *_NAMES, *(kept.c[e.name] for e in extra))
        .select_from(_with_names(kept.join(t.audit, AU.id == kept.c.id)))
        .order_by(AU.created_at.desc(), AU.id.desc())
    )


_AUDIT_NAMED = named_audit()


async def audit_with_actors(
    conn: Conn,
    org_id: str,
    item_id: str,
    *,
    statement: sa.Select[Any] = _AUDIT_NAMED,
    newest: int | None = None,
) -> tuple[Sequence[AnyRow], dict[str, Actor]]:
    """The item's audit rows, oldest first, and each ``kind:id`` actor of them with its
    display name (users, lead agents and keys confined to ``org_id``). ``statement`` is
    one of :func:`named_audit`; ``newest`` its ``p_limit`` when it takes the newest."""
    params: dict[str, object] = {"p_item": item_id, "p_org": org_id}
    if newest is not None:
        params["p_limit"] = newest
    found = (await conn.execute(statement, params)).all()
    rows = list(reversed(found)) if newest is not None else found
    users: dict[str, tuple[str | None, str]] = {}
    agents: dict[str, str] = {}
    keys: dict[str, str | None] = {}
    actors: dict[str, Actor] = {}
    n = _AUDIT_COLUMNS
    for row in rows:
        actor = row.actor
        if actor in actors:
            continue
        kind, _, ident = actor.partition(":")
        user_id, user_name, user_email, agent_name, key_name = row[n : n + 5]
        if user_id is not None:
            users[ident] = (user_name, user_email)
        if agent_name is not None:
            agents[ident] = agent_name
        if key_name is not None:
            keys[ident] = key_name
        actors[actor] = _actor(kind, ident, users, agents, keys)
    return rows, actors


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


class DestinationView(TypedDict):
    """Where an approval of an item will go: the channel, the delivery action, the
    conversation and thread as the binding's address names them (``None`` where it
    names none), and the whole in words."""

    channel: str
    action: str
    silent: bool
    conversation: Any
    thread: Any
    description: str


def destination(binding: Binding | None) -> DestinationView:
    """Where an approval of the item will go (the session's active binding, SPEC 6)."""
    action, channel = action_for(binding)
    addr: dict[str, Any] = binding.address if binding is not None else {}
    out: DestinationView = {
        "channel": channel,
        "action": action,
        "silent": bool(binding.silent) if binding is not None else False,
        "conversation": None,
        "thread": None,
        "description": "",
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


def delivery_target(channel: str | None, address: Any) -> str:
    """Where a delivery was being posted, in a few words: the channel and conversation an
    operator checks before confirming an uncertain delivery or sending it again."""
    addr = _obj(address)
    name = channel_name(channel)
    if channel == "slack":
        where = f"{name} channel {addr.get('channel') or '?'}"
        if addr.get("team"):
            where += f" (team {addr['team']})"
        return where + (f", thread {addr['thread_ts']}" if addr.get("thread_ts") else "")
    if channel == "discord":
        where = f"{name} channel {addr.get('channel_id') or '?'}"
        return where + (f" (guild {addr['guild_id']})" if addr.get("guild_id") else "")
    if channel == "teams":
        conversation = _obj(_obj(addr.get("reference")).get("conversation")).get("id")
        return f"{name} conversation {conversation}" if conversation else f"{name} conversation"
    if channel == "email":
        return f"email to {addr['to']}" if addr.get("to") else "email"
    return name


def _describe(action: str, channel: str, d: DestinationView) -> str:
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
