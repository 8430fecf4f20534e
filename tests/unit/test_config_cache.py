"""The intake's cache of agents and policy rules (leadgate/domain/config_cache.py): used
again only while nothing they are read from can have changed, whoever changed it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import leadgate.database
from leadgate.core.errors import NotFound
from leadgate.core.types import Reply
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.database.pg import (
    CHANGES_CHANNEL,
    NOTIFYING_TABLES,
    SENDER_SETTING,
    TableChanges,
)
from leadgate.database.plans import PlanCache
from leadgate.domain import agents, policy
from leadgate.domain.config_cache import TABLES
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.stack import Stack, build_stack


@pytest.fixture
def stack(listening_stack: Stack) -> Stack:
    return listening_stack


async def turn(stack: Stack, org: Org, text: str) -> object:
    return await stack.turns.run(api_trigger(org, {"id": "plain"}, text))


async def test_a_second_turn_reads_neither_agent_nor_rules(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    cache = stack.turns.intake.config
    assert await turn(stack, org, "one") == Reply("Echo: one")
    reads = cache.reads
    with stack.db.record_statements() as statements:
        assert await turn(stack, org, "two") == Reply("Echo: two")
    assert cache.reads == reads
    assert not [sql for sql in statements if "FROM agents" in sql or "policy_rules" in sql]


async def refused(stack: Stack, org: Org, text: str) -> str:
    """The rule of the turn's refusal for an unknown model."""
    with pytest.raises(NotFound, match="no agent 'plain' in this organization") as caught:
        await turn(stack, org, text)
    return caught.value.rule


async def test_a_model_found_missing_is_refused_without_a_statement_until_it_exists(
    stack: Stack,
) -> None:
    """A client naming a model its organization lacks is answered from what the last
    lookup found, before the writer (SQLite) or a connection (PostgreSQL) is taken."""
    org = await make_org(stack)
    other = await make_org(stack, name="other")
    await make_agent(stack, other, "plain")
    cache = stack.turns.intake.config
    assert await refused(stack, org, "one") == "agent.not_found"
    reads, uses = cache.reads, stack.db.connection_uses
    with stack.db.record_statements() as statements:
        assert await refused(stack, org, "two") == "agent.not_found"
        assert await refused(stack, org, "three") == "agent.not_found"
    # No BEGIN IMMEDIATE, no SELECT: on SQLite only the token's PRAGMA data_version.
    assert [sql for sql in statements if sql != "PRAGMA data_version"] == []
    assert cache.reads == reads
    assert stack.db.connection_uses == uses  # PostgreSQL: no connection taken
    # The miss is this organization's: another one's agent of that name is found.
    assert await turn(stack, other, "theirs") == Reply("Echo: theirs")
    await make_agent(stack, org, "plain")  # a write to agents here: looked up again
    assert await turn(stack, org, "four") == Reply("Echo: four")


async def test_a_model_found_missing_is_found_once_another_connection_adds_it(
    stack: Stack, migrated_url: str
) -> None:
    """The CLI (another process) creates the agent a client has been asking for."""
    org = await make_org(stack)
    assert await refused(stack, org, "one") == "agent.not_found"
    assert await refused(stack, org, "two") == "agent.not_found"
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await agents.save_agent(
                conn, stack.clock, stack.ids, org.id, name="plain", model="script"
            )
    finally:
        await other.close()
    await stack.heard_of("agents")
    assert await turn(stack, org, "three") == Reply("Echo: three")


async def test_postgres_reads_them_every_turn_while_it_hears_of_no_change(
    migrated_pg: str,
) -> None:
    """Without a LISTEN connection (or while it is down) another replica's change would
    go unnoticed: nothing is kept."""
    stack = build_stack(migrated_pg)
    try:
        org = await make_org(stack)
        await make_agent(stack, org, "plain")
        cache = stack.turns.intake.config
        assert await turn(stack, org, "one") == Reply("Echo: one")
        reads = cache.reads
        assert await turn(stack, org, "two") == Reply("Echo: two")
        assert cache.reads == reads + 2
        changes = stack.db.table_changes
        assert changes is not None
        changes.connected()
        assert await turn(stack, org, "three") == Reply("Echo: three")
        assert await turn(stack, org, "four") == Reply("Echo: four")
        assert cache.reads == reads + 4  # read once more, then kept
        changes.lost()
        assert await turn(stack, org, "five") == Reply("Echo: five")
        assert cache.reads == reads + 6
    finally:
        await stack.stop()


def test_the_migration_notifies_on_the_channel_and_tables_the_process_listens_to() -> None:
    versions = Path(leadgate.database.__file__).parent / "migrations" / "versions"
    spec = importlib.util.spec_from_file_location(
        "m0010", versions / "0010_config_change_notify.py"
    )
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.CHANNEL == CHANGES_CHANNEL
    assert migration.SENDER == SENDER_SETTING
    spec = importlib.util.spec_from_file_location("m0012", versions / "0012_routes_notify.py")
    assert spec is not None and spec.loader is not None
    routes_migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(routes_migration)
    assert routes_migration.FUNCTION == migration.FUNCTION
    assert frozenset(migration.TABLES) == frozenset(TABLES)
    assert frozenset(migration.TABLES + routes_migration.TABLES) == NOTIFYING_TABLES


def test_a_notification_of_its_own_write_is_not_counted_twice() -> None:
    changes = TableChanges("mine")
    changes.connected()
    token = changes.token(TABLES)
    assert token is not None
    changes.notified("agents mine")  # counted when its transaction ended
    assert changes.token(TABLES) == token
    changes.notified("agents other")
    changes.notified("policy_rules ")  # no tag: psql, a migration
    after = changes.token(TABLES)
    assert after != token
    changes.notified("something else")  # unknown: everything is read again
    assert changes.token(TABLES) != after
    assert changes.token(["messages"]) is None  # no trigger tells of it
    changes.lost()
    assert changes.token(TABLES) is None


def test_text_writes_count_for_the_tables_they_name() -> None:
    changes = TableChanges()
    # The service's PostgreSQL dialect (asyncpg's; its constructor is untyped, the URL's
    # get_dialect is not).
    plans = PlanCache(make_url("postgresql+asyncpg://").get_dialect()())

    def tracked(statement: sa.Executable, **params: object) -> frozenset[str]:
        return changes.tracked(plans.plan(statement, frozenset(params))[0])

    assert tracked(sa.text("UPDATE agents SET active = false")) == {"agents"}
    assert tracked(sa.text("WITH m AS (INSERT INTO messages VALUES (1)) SELECT 1")) == set()
    assert tracked(sa.text("DELETE FROM policy_rules; TRUNCATE presets")) == {
        "policy_rules",
        "presets",
    }
    assert tracked(sa.text("VACUUM")) == NOTIFYING_TABLES  # names nothing: anything
    assert tracked(sa.select(t.agents.c.id)) == set()
    assert tracked(t.presets.delete()) == {"presets"}
    assert tracked(t.messages.delete()) == set()


async def test_a_change_made_here_is_seen_by_the_next_turn(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    await turn(stack, org, "warm")
    async with stack.db.tx() as conn:
        await policy.add_rule(conn, stack.clock, stack.ids, org.id, "secret", "redact")
    assert await turn(stack, org, "a secret") == Reply("Echo: a [redacted]")
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.org_id == org.id).values(active=False)
        )
    with pytest.raises(Exception, match="inactive"):
        await turn(stack, org, "deactivated")
    async with stack.db.tx() as conn:
        await conn.execute(t.agents.update().where(t.agents.c.org_id == org.id).values(active=True))
    assert await turn(stack, org, "back") == Reply("Echo: back")
    async with stack.db.tx() as conn:  # the slug goes with the name
        await agents.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref="plain", name="renamed"
        )
    with pytest.raises(Exception, match="no agent 'plain'"):
        await turn(stack, org, "by the old slug")


async def test_a_change_rolled_back_is_not_kept(stack: Stack) -> None:
    """A rule read inside a transaction that is then rolled back (another group-commit
    member's savepoint, here a failing transaction) is not used afterwards."""
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    await turn(stack, org, "warm")
    cache = stack.turns.intake.config
    with pytest.raises(RuntimeError, match="undone"):
        async with stack.db.tx() as conn:
            await policy.add_rule(conn, stack.clock, stack.ids, org.id, "secret", "block")
            assert [r.action for r in await cache.rules(conn, org.id)] == ["block"]
            raise RuntimeError("undone")
    assert await turn(stack, org, "a secret") == Reply("Echo: a secret")


async def test_a_change_committed_by_another_connection_is_seen(
    stack: Stack, migrated_url: str
) -> None:
    """The CLI (another process) writes through its own connection: its commit changes
    what the service's next intake reads."""
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    await turn(stack, org, "warm")
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await policy.add_rule(conn, stack.clock, stack.ids, org.id, "secret", "redact")
    finally:
        await other.close()
    await stack.heard_of("policy_rules")
    assert await turn(stack, org, "a secret") == Reply("Echo: a [redacted]")
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await conn.execute(
                sa.update(t.agents).where(t.agents.c.org_id == org.id).values(active=False)
            )
    finally:
        await other.close()
    await stack.heard_of("agents")
    with pytest.raises(Exception, match="inactive"):
        await turn(stack, org, "deactivated")
