"""Routes: which agent answers which channel address (``leadgate route add``).

Match keys per channel (SPEC 12): slack ``team``, ``channel``; discord ``guild``,
``channel``; teams ``tenant``, ``conversation``; email ``address`` and ``sender``
(an address or ``*@domain``; compared lower-case, domains in IDNA form, see
:func:`fold_address`). A route without keys matches every trigger of its
channel; the most specific match (most keys) wins, the oldest on a tie.

A Discord thread is its own channel (its own id) under a parent channel: its trigger
carries ``parent`` too (:data:`PARENT`), and a route naming the parent as its ``channel``
answers there as well, as in the parent, unless a route names the thread itself (that
one wins, however few keys the parent's has).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import idna
import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import NotFound, ValidationError, quoted
from leadgate.core.kept import Kept
from leadgate.core.types import ROUTE_PARENT as PARENT
from leadgate.core.types import RouteMatch
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database

MATCH_KEYS: dict[str, frozenset[str]] = {
    "slack": frozenset({"team", "channel"}),
    "discord": frozenset({"guild", "channel"}),
    "teams": frozenset({"tenant", "conversation"}),
    "email": frozenset({"address", "sender"}),
}
#: Per channel, the match key a route may name a trigger's parent conversation under
#: (:data:`PARENT`: a Discord thread's parent channel).
PARENT_KEY: dict[str, str] = {"discord": "channel"}


@functools.lru_cache(maxsize=4096)
def fold_address(address: str) -> str:
    """An email address (or a route's ``*@domain``) as one correspondent is compared:
    lower-case, its domain in IDNA's ASCII form (``user@bücher.example`` and
    ``user@xn--bcher-kva.example`` are one address). The local part is not converted:
    IDNA is for domain names alone. A domain IDNA refuses (an empty label, a symbol
    such as ``☃``, say) is compared as written.

    IDNA 2008 with UTS 46's mapping, as mail systems convert domains now: the standard
    library's codec is IDNA 2003, which maps ``straße.example`` to ``strasse.example``,
    another domain (``xn--strae-oqa.example``) under IDNA 2008."""
    folded = address.strip().lower()
    local, at, domain = folded.rpartition("@")
    if not at or domain.isascii():
        return folded
    try:
        ace = idna.encode(domain, uts46=True).decode("ascii")
    except UnicodeError:  # idna.IDNAError is one
        return folded
    return f"{local}@{ace.lower()}"


def parse_match(channel: str, pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings into a match dict, checking keys for the channel."""
    if channel not in MATCH_KEYS:
        raise ValidationError(
            "channel must be slack, discord, teams or email", rule="route.channel"
        )
    match: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise ValidationError(f"match {pair!r} is not KEY=VALUE", rule="route.match")
        if key not in MATCH_KEYS[channel]:
            allowed = ", ".join(sorted(MATCH_KEYS[channel]))
            raise ValidationError(
                f"{channel} routes match on {allowed}, not {key!r}", rule="route.match"
            )
        if key in match:
            # One value per key: a second one used to replace the first without a word.
            raise ValidationError(f"match key {key!r} given twice", rule="route.match")
        match[key] = value.lower() if channel == "email" else value
    return match


def matches(channel: str, match: Mapping[str, str], attrs: Mapping[str, str]) -> bool:
    """Whether every key of ``match`` fits ``attrs`` (a thread's channel key fits its
    parent's too, see :data:`PARENT`)."""
    for key, want in match.items():
        got = attrs.get(key, "")
        if got != want and key == PARENT_KEY.get(channel) and attrs.get(PARENT) == want:
            continue
        if channel == "email":
            # Both sides folded: a route written with bücher.example takes mail from
            # xn--bcher-kva.example (and the other way round).
            got, want = fold_address(got), fold_address(want)
            if key == "sender" and want.startswith("*@"):
                if not got.endswith(want[1:]):
                    return False
                continue
        if got != want:
            return False
    return True


class NewRouteView(TypedDict):
    """A new route: the channel keys it matches (none: every trigger of the channel)."""

    id: str
    agentId: str
    channel: str
    match: dict[str, str]
    silent: bool


class RouteView(NewRouteView):
    """A route as stored: active, or disabled (``leadgate route disable``)."""

    active: bool


async def add_route(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    agent_id: str,
    channel: str,
    match: dict[str, str],
    silent: bool,
) -> NewRouteView:
    """Store a route."""
    route_id = ids.new("rte")
    await conn.execute(
        t.routes.insert().values(
            id=route_id,
            org_id=org_id,
            agent_id=agent_id,
            channel=channel,
            match=match,
            silent=silent,
            active=True,
            created_at=clock.now_ms(),
        )
    )
    return {
        "id": route_id,
        "agentId": agent_id,
        "channel": channel,
        "match": match,
        "silent": silent,
    }


#: The tables :class:`RouteCache` reads.
TABLES = ("routes",)
#: Built once (the plan cache keys on the statement object): every inbound event runs it.
_ACTIVE_ROUTES = (
    sa.select(t.routes)
    .where(t.routes.c.channel == sa.bindparam("p_channel"), t.routes.c.active)
    .order_by(t.routes.c.created_at, t.routes.c.id)
)


async def resolve(conn: Conn, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
    """The most specific active route of ``channel`` matching ``attrs``."""
    return best_route(await active_routes(conn, channel), channel, attrs)


async def active_routes(conn: Conn, channel: str) -> tuple[Any, ...]:
    """The active routes of ``channel``, oldest first."""
    return tuple((await conn.execute(_ACTIVE_ROUTES, {"p_channel": channel})).all())


def best_route(rows: Sequence[Any], channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
    """The most specific of ``rows`` (active routes of ``channel``, oldest first)
    matching ``attrs``: one naming a thread itself first (:data:`PARENT`), then most
    keys, the oldest on a tie."""
    best: Any = None
    best_rank = (False, -1)
    for row in rows:
        if not matches(channel, row.match, attrs):
            continue
        rank = (_names_thread(channel, row.match, attrs), len(row.match))
        if rank > best_rank:
            best, best_rank = row, rank
    if best is None:
        return None
    return RouteMatch(
        route_id=best.id,
        org_id=best.org_id,
        agent_id=best.agent_id,
        silent=bool(best.silent),
        created_at=int(best.created_at),
    )


def _names_thread(channel: str, match: Mapping[str, str], attrs: Mapping[str, str]) -> bool:
    """Whether ``match`` names the thread ``attrs`` is in itself (not its parent)."""
    key = PARENT_KEY.get(channel)
    return key is not None and PARENT in attrs and match.get(key) == attrs.get(key)


class RouteCache:
    """Each channel's active routes, read again only when a write to ``routes`` may
    have been committed since (:meth:`Database.committed_token`). On SQLite: this
    process's committed writes and ``PRAGMA data_version`` for every other writer, such
    as the CLI's ``leadgate route disable``. On PostgreSQL: :class:`TableChanges`, fed
    by the table's trigger (migration 0012) through the process's LISTEN connection; a
    change another replica commits is used from the moment its notification arrives.

    Every inbound channel message resolves its route before the platform is answered,
    and the routes change a few times a day: the read was about 3% of a Slack
    lifecycle's CPU on SQLite (a read transaction on a reader connection whose page
    cache the last commit emptied) and a round trip on PostgreSQL. Where no token can
    be had (PostgreSQL while it does not listen) every lookup reads.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        # by channel: there are four, so the bound never starts it over
        self._kept: Kept[str, tuple[Any, ...]] = Kept(max_entries=64)
        self.reads = 0  # lookups that ran the statement (tests)

    async def resolve(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """:func:`resolve` in a read transaction, or from what was kept under an equal
        token."""
        return best_route(await self.active(channel), channel, attrs)

    async def active(self, channel: str) -> tuple[Any, ...]:
        """:func:`active_routes`, read again only when the routes may have changed."""
        token = self.db.committed_token(TABLES)
        rows = self._kept.get(token, channel)
        if rows is None:
            self.reads += 1
            async with self.db.read() as conn:
                rows = await active_routes(conn, channel)
            self._kept.put(token, channel, rows)
        return rows


def _route_view(row: Any) -> RouteView:
    return {
        "id": row.id,
        "agentId": row.agent_id,
        "channel": row.channel,
        "match": row.match,
        "silent": bool(row.silent),
        "active": bool(row.active),
    }


async def list_routes(conn: Conn, org_id: str) -> list[RouteView]:
    """The organization's routes, oldest first."""
    rows = (
        await conn.execute(
            sa.select(t.routes).where(t.routes.c.org_id == org_id).order_by(t.routes.c.created_at)
        )
    ).all()
    return [_route_view(r) for r in rows]


async def disable_route(conn: Conn, org_id: str, route_id: str) -> RouteView:
    """Deactivate a route: its channel triggers no longer reach the agent."""
    row = (
        await conn.execute(
            t.routes.update()
            .where(t.routes.c.id == route_id, t.routes.c.org_id == org_id)
            .values(active=False)
            .returning(*t.routes.c)
        )
    ).first()
    if row is None:
        raise NotFound(f"no route {quoted(route_id)} in this organization", rule="route.not_found")
    return _route_view(row)
