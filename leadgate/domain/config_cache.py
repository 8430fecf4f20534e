"""What every intake reads of an organization's configuration, kept between transactions.

Each turn's intake reads its agent (with the lead its preset or own settings resolve to)
and the organization's policy rules: two statements, about a tenth of a plain turn on
SQLite, for rows that change a few times a day; the lead runner's claim reads the lead
agent of every item it reviews (:meth:`ConfigCache.agent`). :class:`ConfigCache` keeps
what it read (:class:`leadgate.core.kept.Kept`) with the connection's
:meth:`~leadgate.database.db.Conn.cache_token` over the tables the rows come from
(agents, presets, policy rules), and uses it again only under an equal token: on the
inline SQLite writer that means no other connection committed anything
(``PRAGMA data_version``: the CLI, another process), nothing was written to those tables through
this one and nothing was rolled back since. The token is taken inside the intake's write
transaction, beside which no other connection can commit. On PostgreSQL the token is
:class:`leadgate.database.pg.TableChanges`: the tables' triggers NOTIFY every replica
of each write (migration 0010), so a change another replica, the CLI or ``psql`` commits
is used from the moment its notification arrives (well under a millisecond on one host;
an intake already under way meanwhile may still use what was kept, as it would had it
started just before the commit). Without the process's LISTEN connection (or while it
reconnects) there is no token: every intake reads.

A miss is kept too (:meth:`ConfigCache.refuse_unknown`): a client that names a model its
organization does not have (a typo, a deleted agent) is answered 404 from what was kept
under the same token, before the intake takes SQLite's writer or a PostgreSQL connection;
it cost a place in a group commit and the agent's SELECT on each request (0.19-0.20 ms of
CPU on SQLite, 0.11-0.12 now; a plain turn costs ~0.45). Misses are kept apart from the
rows, so a client naming ever new models flushes only them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from leadgate.core.errors import NotFound
from leadgate.core.kept import Kept
from leadgate.database.db import Conn
from leadgate.domain import agents, policy
from leadgate.domain.agents import LeadConfig
from leadgate.domain.rows import Agent

if TYPE_CHECKING:
    from leadgate.database.pg import TableChanges

#: The tables the cached rows are read from.
TABLES = ("agents", "presets", "policy_rules")
#: Entries kept at most (then the cache starts over).
MAX_ENTRIES = 4096

K = TypeVar("K")
V = TypeVar("V")


class ConfigCache:
    """Agents with their lead, lead agents, and policy rules, by organization (see the
    module)."""

    def __init__(self) -> None:
        self._agents: Kept[tuple[str, str], tuple[Agent, LeadConfig | None]] = Kept(MAX_ENTRIES)
        self._rules: Kept[str, tuple[policy.Rule, ...]] = Kept(MAX_ENTRIES)
        self._plain: Kept[tuple[str, str], Agent] = Kept(MAX_ENTRIES)
        #: (organization, ref) pairs found to name no agent (the value is always True)
        self._missing: Kept[tuple[str, str], bool] = Kept(MAX_ENTRIES)
        self.reads = 0  # statements run for lookups (tests)

    def known(
        self, changes: TableChanges | None, org_id: str, ref: str
    ) -> tuple[Agent, LeadConfig | None, list[policy.Rule]] | None:
        """PostgreSQL: the agent with its lead and the rules, when both are kept under
        the token of ``changes`` (the pool's :class:`TableChanges`, no connection
        needed); None otherwise: then look them up through a connection. A plain
        PostgreSQL turn needs no connection for them at all (acquiring one and handing
        it back cost about 3% of the turn)."""
        token = None if changes is None else changes.token(TABLES)
        agent = self._agents.get(token, (org_id, ref))
        rules = self._rules.get(token, org_id)
        if agent is None or rules is None:
            return None
        return agent[0], agent[1], list(rules)

    def refuse_unknown(
        self, committed_token: Callable[[Sequence[str]], object | None], org_id: str, ref: str
    ) -> None:
        """Raise :func:`leadgate.domain.agents.unknown_agent` when ``ref`` was found to
        name no agent of ``org_id`` and nothing it is read from has changed since:
        ``committed_token`` is :meth:`leadgate.database.db.Database.committed_token`
        (no connection needed, equal to the token the miss was kept under while no write
        to :data:`TABLES` was committed in between). The token is asked for only when a
        miss is kept for the pair (on SQLite it costs a ``PRAGMA``)."""
        key = (org_id, ref)
        if key in self._missing and self._missing.get(committed_token(TABLES), key):
            raise agents.unknown_agent(ref)

    async def agent_and_lead(
        self, conn: Conn, org_id: str, ref: str
    ) -> tuple[Agent, LeadConfig | None]:
        """:func:`leadgate.domain.agents.find_agent_and_lead`, read again only when
        its tables may have changed; a miss (NotFound) is kept for
        :meth:`refuse_unknown` and raised again from it here."""
        key = (org_id, ref)
        token = conn.cache_token(TABLES)
        kept = self._agents.get(token, key)
        if kept is not None:
            return kept
        if self._missing.get(token, key):
            raise agents.unknown_agent(ref)
        self.reads += 1
        try:
            value = await agents.find_agent_and_lead(conn, org_id, ref)
        except NotFound:
            self._missing.put(token, key, True)  # the token taken before the read
            raise
        self._agents.put(token, key, value)
        return value

    async def rules(self, conn: Conn, org_id: str) -> list[policy.Rule]:
        """:func:`leadgate.domain.policy.load_rules`, read again only when they may have
        changed."""

        async def load() -> tuple[policy.Rule, ...]:
            return tuple(await policy.load_rules(conn, org_id))

        kept: tuple[policy.Rule, ...] = await self._through(self._rules, conn, org_id, load)
        return list(kept)

    def kept_agent(self, changes: TableChanges | None, org_id: str, ref: str) -> Agent | None:
        """PostgreSQL: the agent :meth:`agent` keeps under the token of ``changes`` (no
        connection needed), or None: then look it up through a connection."""
        token = None if changes is None else changes.token(TABLES)
        return self._plain.get(token, (org_id, ref))

    async def agent(self, conn: Conn, org_id: str, ref: str) -> Agent:
        """:func:`leadgate.domain.agents.find_agent` (not deleted; NotFound otherwise),
        read again only when its tables may have changed: the lead runner's claim reads
        the lead agent of every item it reviews."""
        return await self._through(
            self._plain, conn, (org_id, ref), lambda: agents.find_agent(conn, org_id, ref)
        )

    async def _through(
        self, store: Kept[K, V], conn: Conn, key: K, read: Callable[[], Awaitable[V]]
    ) -> V:
        """``store``'s value for ``key`` under ``conn``'s token of :data:`TABLES`, or
        ``read()``'s, then kept under that token (taken before the read: a change
        committed meanwhile gives the next lookup another token)."""
        token = conn.cache_token(TABLES)
        kept = store.get(token, key)
        if kept is not None:
            return kept
        self.reads += 1
        value = await read()
        store.put(token, key, value)
        return value
