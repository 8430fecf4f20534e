"""The channels' route lookup kept between messages (binding/routes.py RouteCache): used
again only while no write to the routes can have been committed since, whoever wrote."""

from __future__ import annotations

import pytest

from binding import routes
from leadgate.core.types import RouteMatch
from leadgate.database.db import Database
from tests.helpers import Org, make_agent, make_org, make_route
from tests.stack import Stack, build_stack

ATTRS = {"team": "T1", "channel": "C1"}


@pytest.fixture
def stack(listening_stack: Stack) -> Stack:
    return listening_stack


async def setup(stack: Stack) -> tuple[Org, str, str]:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    return org, str(agent["id"]), await make_route(stack, org, str(agent["id"]), "slack")


async def test_a_second_lookup_runs_no_statement(stack: Stack) -> None:
    _, _, route_id = await setup(stack)
    cache = routes.RouteCache(stack.db)
    first = await cache.resolve("slack", ATTRS)
    assert isinstance(first, RouteMatch) and first.route_id == route_id
    with stack.db.record_statements() as statements:
        assert await cache.resolve("slack", {"team": "T2", "channel": "C9"}) == first
    assert cache.reads == 1
    assert not [sql for sql in statements if "routes" in sql]
    assert await cache.resolve("discord", {"guild": "G"}) is None  # kept per channel
    assert cache.reads == 2


async def test_postgres_reads_every_time_while_it_hears_of_no_change(migrated_pg: str) -> None:
    """Without a LISTEN connection (or while it is down) another replica's change would
    go unnoticed: nothing is kept."""
    stack = build_stack(migrated_pg)
    try:
        await setup(stack)
        cache = routes.RouteCache(stack.db)
        for _ in range(2):
            assert await cache.resolve("slack", ATTRS) is not None
        assert cache.reads == 2
        changes = stack.db.table_changes
        assert changes is not None
        changes.connected()
        for _ in range(2):
            assert await cache.resolve("slack", ATTRS) is not None
        assert cache.reads == 3  # read once more, then kept
        changes.lost()
        assert await cache.resolve("slack", ATTRS) is not None
        assert cache.reads == 4
    finally:
        await stack.stop()


async def test_a_route_changed_here_is_seen_by_the_next_lookup(stack: Stack) -> None:
    org, agent_id, route_id = await setup(stack)
    cache = routes.RouteCache(stack.db)
    assert (await cache.resolve("slack", ATTRS) or RouteMatch("", "", "", False)).route_id == (
        route_id
    )
    narrower = await make_route(stack, org, agent_id, "slack", {"channel": "C1"})
    assert (await cache.resolve("slack", ATTRS) or RouteMatch("", "", "", False)).route_id == (
        narrower
    )
    async with stack.db.tx() as conn:
        await routes.disable_route(conn, org.id, narrower)
        await routes.disable_route(conn, org.id, route_id)
    assert await cache.resolve("slack", ATTRS) is None


async def test_a_write_not_yet_committed_is_not_kept_past_its_commit(stack: Stack) -> None:
    """A lookup while the writer's transaction is open reads the committed routes (a
    reader's snapshot); what it keeps must not outlive that transaction's commit."""
    org, _, route_id = await setup(stack)
    cache = routes.RouteCache(stack.db)
    async with stack.db.tx() as conn:
        await routes.disable_route(conn, org.id, route_id)
        during = await cache.resolve("slack", ATTRS)
        assert during is not None and during.route_id == route_id
    assert await cache.resolve("slack", ATTRS) is None


async def test_a_rolled_back_write_leaves_the_routes_as_they_were(stack: Stack) -> None:
    org, _, route_id = await setup(stack)
    cache = routes.RouteCache(stack.db)
    with pytest.raises(RuntimeError, match="undone"):
        async with stack.db.tx() as conn:
            await routes.disable_route(conn, org.id, route_id)
            raise RuntimeError("undone")
    found = await cache.resolve("slack", ATTRS)
    assert found is not None and found.route_id == route_id


async def test_a_change_committed_by_another_connection_is_seen(
    stack: Stack, migrated_url: str
) -> None:
    """``leadgate route disable`` runs in another process, on its own connection."""
    org, _, route_id = await setup(stack)
    cache = routes.RouteCache(stack.db)
    assert await cache.resolve("slack", ATTRS) is not None
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await routes.disable_route(conn, org.id, route_id)
    finally:
        await other.close()
    await stack.heard_of("routes")
    assert await cache.resolve("slack", ATTRS) is None


async def test_no_token_before_the_writer_opens_or_after_it_closed(migrated_url: str) -> None:
    """SQLite; on PostgreSQL none without a LISTEN connection."""
    db = Database(migrated_url)
    assert db.committed_token(routes.TABLES) is None  # nothing opened yet
    async with db.tx():
        pass
    assert (db.committed_token(routes.TABLES) is not None) == migrated_url.startswith("sqlite")
    await db.close()
    assert db.committed_token(routes.TABLES) is None


async def test_the_most_specific_route_wins_and_the_oldest_on_a_tie(stack: Stack) -> None:
    """SPEC: "the most specific route wins" (most match keys; the oldest on a tie, as the
    README says), whether the routes were read or kept."""
    org, agent_id, catch_all = await setup(stack)
    by_team = await make_route(stack, org, agent_id, "slack", {"team": "T1"})
    await make_route(stack, org, agent_id, "slack", {"channel": "C1"})  # a tie, younger
    cache = routes.RouteCache(stack.db)
    tie = await cache.resolve("slack", ATTRS)
    assert tie is not None and tie.route_id == by_team
    both = await make_route(stack, org, agent_id, "slack", {"team": "T1", "channel": "C1"})
    for _ in range(2):  # read, then kept
        assert [
            (found.route_id if found else None)
            for found in [
                await cache.resolve("slack", ATTRS),
                await cache.resolve("slack", {"team": "T1", "channel": "C2"}),
                await cache.resolve("slack", {"team": "T9", "channel": "C9"}),
            ]
        ] == [both, by_team, catch_all]
    assert cache.reads == 2  # once before the new route, once after


async def test_a_thread_answers_as_its_parent_channel_unless_a_route_names_the_thread(
    stack: Stack,
) -> None:
    """A Discord thread's trigger carries its parent channel (``parent``): a route naming
    the parent answers there, above one naming the guild only; a route naming the thread
    itself wins whatever its keys; a route naming another channel does not match."""
    org = await make_org(stack)
    agent_id = str((await make_agent(stack, org, "plain"))["id"])
    by_guild = await make_route(stack, org, agent_id, "discord", {"guild": "G"})
    by_parent = await make_route(stack, org, agent_id, "discord", {"guild": "G", "channel": "P"})
    await make_route(stack, org, agent_id, "discord", {"guild": "G", "channel": "Q"})
    by_thread = await make_route(stack, org, agent_id, "discord", {"channel": "T"})
    cache = routes.RouteCache(stack.db)

    async def route_of(attrs: dict[str, str]) -> str | None:
        found = await cache.resolve("discord", attrs)
        return found.route_id if found else None

    assert await route_of({"guild": "G", "channel": "U", "parent": "P"}) == by_parent
    assert await route_of({"guild": "G", "channel": "T", "parent": "P"}) == by_thread
    assert await route_of({"guild": "G", "channel": "U", "parent": "R"}) == by_guild
    assert await route_of({"guild": "H", "channel": "U", "parent": "P"}) is None
    # (Not a thread: "parent" means nothing on a channel without parents.)
    await make_route(stack, org, agent_id, "slack", {"channel": "P"})
    assert await cache.resolve("slack", {"team": "T1", "channel": "U", "parent": "P"}) is None


def test_an_email_route_takes_its_domain_in_either_idna_form() -> None:
    """``bücher.example`` and its IDNA form ``xn--bcher-kva.example`` are one domain (and
    case does not count); the local part is compared as it is, not encoded."""
    for want in ("*@bücher.example", "*@XN--BCHER-KVA.example", "ann@Bücher.example"):
        for got in ("ann@bücher.example", "Ann@xn--bcher-kva.example", "ann@BÜCHER.EXAMPLE"):
            assert routes.matches("email", {"sender": want}, {"sender": got}), (want, got)
    assert not routes.matches(
        "email", {"sender": "bob@bücher.example"}, {"sender": "ann@bücher.example"}
    )
    assert routes.fold_address("jürgen@Exämple.de") == "jürgen@xn--exmple-cua.de"
    assert routes.fold_address("a@b..ü") == "a@b..ü"  # no IDNA form: compared as written


def test_an_email_domain_is_folded_as_idna_2008_reads_it() -> None:
    """``straße.example`` is ``xn--strae-oqa.example`` under IDNA 2008 / UTS 46, as mail
    systems convert it (IDNA 2003, the standard library's codec, made it
    ``strasse.example``: another domain, whose route took the mail and whose session it
    joined); a full-width letter is mapped; a domain IDNA 2008 refuses (a symbol IDNA
    2003 took, a label over 63 characters) is compared as written."""
    assert routes.fold_address("ann@Straße.example") == "ann@xn--strae-oqa.example"
    assert routes.fold_address("ann@ＢÜCHER.example") == "ann@xn--bcher-kva.example"
    assert not routes.matches(
        "email", {"sender": "*@strasse.example"}, {"sender": "ann@straße.example"}
    )
    assert routes.matches(
        "email", {"sender": "*@xn--strae-oqa.example"}, {"sender": "ann@straße.example"}
    )
    assert routes.fold_address("ann@☃.example") == "ann@☃.example"
    long = f"ann@{'a' * 70}ü.example"
    assert routes.fold_address(long) == long
