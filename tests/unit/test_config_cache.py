"""The intake's cache of agents and policy rules (leadgate/domain/config_cache.py): used
again only while nothing they are read from can have changed, whoever changed it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from leadgate.core.types import Reply
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.domain import agents, policy
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.stack import Stack, build_stack


@pytest.fixture
async def stack(migrated_url: str) -> AsyncIterator[Stack]:
    built = build_stack(migrated_url)
    yield built
    await built.stop()


async def turn(stack: Stack, org: Org, text: str) -> object:
    return await stack.turns.run(api_trigger(org, {"id": "plain"}, text))


async def test_a_second_turn_reads_neither_agent_nor_rules_on_sqlite(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    cache = stack.turns.intake.config
    assert await turn(stack, org, "one") == Reply("Echo: one")
    reads = cache.reads
    assert await turn(stack, org, "two") == Reply("Echo: two")
    # PostgreSQL has no token: other replicas write without telling, so it reads.
    assert cache.reads == (reads + 2 if stack.db.is_postgres else reads)


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
    assert await turn(stack, org, "a secret") == Reply("Echo: a [redacted]")
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await conn.execute(
                sa.update(t.agents).where(t.agents.c.org_id == org.id).values(active=False)
            )
    finally:
        await other.close()
    with pytest.raises(Exception, match="inactive"):
        await turn(stack, org, "deactivated")
