"""Operator reads at size on PostgreSQL: the insights and one item's review detail.

Starts a throwaway PostgreSQL (``tests.pg``), seeds one organization with ``--items``
decided work items (a submission and a lead verdict each, in the audit trail),
``--deliveries`` gating deliveries spread over ``--days-seeded`` days, and one item with
``--item-rows`` deliveries and as many audit rows (an item returned and re-sent many
times), then times the reads an operator's console makes and prints each one's min/median/max
over ``--rounds`` calls (after one warm-up) in milliseconds::

    .venv/bin/python -m bench.operator_reads
    .venv/bin/python -m bench.operator_reads --deliveries 100000 --item-rows 20000

Figures, not a test: compare two builds by running this from each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from leadgate.core.clock import DAY_MS

ORG = "org_bench"
BIG = "wi_big"
NOW_MS = 1_800_000_000_000


def _seed_sql(items: int, deliveries: int, item_rows: int, days: int) -> str:
    """One organization's rows, written by the server itself (generate_series)."""
    span = days * DAY_MS
    item_cols = (
        "id, org_id, agent_id, session_id, lead_agent_id, status, completion_policy,"
        " max_revision_rounds, revision, extra_allowance, task_context, lease_expiries,"
        " last_activity_at, created_at, updated_at"
    )
    delivery_cols = (
        "id, org_id, work_item_id, kind, action, channel, address, text, status, attempts,"
        " next_attempt_at, created_at, updated_at"
    )
    audit_cols = "id, org_id, work_item_id, actor, action, from_status, to_status, created_at"
    return f"""
INSERT INTO work_items ({item_cols})
SELECT 'wi_' || i, '{ORG}', 'ag_w', 'ses_' || i, 'ag_l', 'completed', 'lead', 3, 0, 0,
  'task', 0, t, t, t
FROM (SELECT i, {NOW_MS} - (i::bigint * {span} / {items}) AS t
      FROM generate_series(1, {items}) AS i) AS s;
INSERT INTO work_items ({item_cols})
VALUES ('{BIG}', '{ORG}', 'ag_w', 'ses_big', 'ag_l', 'completed', 'lead', 3, 0, 0, 'task', 0,
  {NOW_MS}, {NOW_MS - span}, {NOW_MS});
INSERT INTO audit ({audit_cols})
SELECT 'aud_s' || i, '{ORG}', 'wi_' || i, 'agent:ag_w', 'completeTask', 'inProgress',
  'reviewQueued', {NOW_MS} - (i::bigint * {span} / {items}) - 1000 - (i * 7919) % 600000
FROM generate_series(1, {items}) AS i;
INSERT INTO audit ({audit_cols})
SELECT 'aud_v' || i, '{ORG}', 'wi_' || i, 'lead:ag_l', 'approve', 'reviewing', 'approved',
  {NOW_MS} - (i::bigint * {span} / {items})
FROM generate_series(1, {items}) AS i;
INSERT INTO deliveries ({delivery_cols})
SELECT 'dlv_' || lpad(i::text, 9, '0'), '{ORG}', 'wi_' || (1 + i % {items}), 'gating', 'post',
  'slack', '{{}}', repeat('x', 400), CASE WHEN i % 50 = 0 THEN 'failed' ELSE 'sent' END, 1,
  t, t, t
FROM (SELECT i, {NOW_MS} - (i::bigint * {span} / {deliveries}) AS t
      FROM generate_series(1, {deliveries}) AS i) AS s;
INSERT INTO deliveries ({delivery_cols})
SELECT 'dlv_big' || lpad(i::text, 9, '0'), '{ORG}', '{BIG}', 'reply', 'post', 'slack', '{{}}',
  repeat('x', 400), CASE WHEN i % 100 = 0 THEN 'deliveryUnknown' ELSE 'sent' END, 1,
  t, t, t
FROM (SELECT i, {NOW_MS - span} + i::bigint * 1000 AS t
      FROM generate_series(1, {item_rows}) AS i) AS s;
INSERT INTO audit ({audit_cols})
SELECT 'aud_big' || lpad(i::text, 9, '0'), '{ORG}', '{BIG}',
  CASE WHEN i % 3 = 0 THEN 'lead:ag_l' ELSE 'agent:ag_w' END,
  CASE WHEN i % 3 = 0 THEN 'changesRequested' ELSE 'completeTask' END,
  'reviewing', 'inProgress', {NOW_MS - span} + i::bigint * 1000
FROM generate_series(1, {item_rows}) AS i;
ANALYZE;
"""


async def _timed_ms(rounds: int, call: Callable[[], Awaitable[object]]) -> str:
    """``call``'s min/median/max over ``rounds`` calls after one warm-up, in ms."""
    await call()  # warm: the plan and the pages
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        await call()
        times.append((time.perf_counter() - began) * 1000)
    return f"{min(times):.1f}/{statistics.median(times):.1f}/{max(times):.1f} ms"


async def measure(args: argparse.Namespace) -> None:
    """Seed, time each read, print its min/median/max."""
    from leadgate.database.db import Database, upgrade
    from leadgate.review import insights, labels, queue
    from outbox import store
    from tests.pg import start_postgres

    server = await asyncio.to_thread(start_postgres)
    try:
        name = f"bench_reads_{int(time.time())}"
        url = server.create_database(name)
        await asyncio.to_thread(upgrade, url)
        began = time.perf_counter()
        sql = _seed_sql(args.items, args.deliveries, args.item_rows, args.days_seeded)
        await asyncio.to_thread(server.psql, sql, database=name, timeout=600)
        print(
            f"seeded {args.items} items, {args.deliveries} deliveries, one item with "
            f"{args.item_rows} deliveries and audit rows, in {time.perf_counter() - began:.0f} s",
            flush=True,
        )
        db = Database(url)
        try:
            for days in (30, 365):

                async def one_insights(days: int = days) -> object:
                    async with db.read() as conn:
                        return await insights.insights(conn, ORG, now_ms=NOW_MS, days=days)

                async def count_deliveries(days: int = days) -> object:
                    since = (NOW_MS // DAY_MS - (days - 1)) * DAY_MS
                    async with db.read() as conn:
                        return (await conn.execute(insights.delivery_counts(ORG, since))).all()

                ms = await _timed_ms(args.rounds, one_insights)
                print(f"insights, {days} days: {ms}", flush=True)
                ms = await _timed_ms(args.rounds, count_deliveries)
                print(f"  of which its deliveries count: {ms}", flush=True)

            async def one_detail() -> object:
                async with db.read() as conn:
                    return await queue.detail(conn, ORG, BIG)

            async def detail_deliveries() -> object:
                async with db.read() as conn:
                    return await store.for_detail(conn, BIG, queue.DETAIL_LIST_MAX)

            async def detail_audit() -> object:
                async with db.read() as conn:
                    return await labels.audit_with_actors(
                        conn,
                        ORG,
                        BIG,
                        statement=queue._AUDIT_NEWEST,
                        newest=queue.DETAIL_LIST_MAX + 1,
                    )

            print(f"review detail: {await _timed_ms(args.rounds, one_detail)}")
            ms = await _timed_ms(args.rounds, detail_deliveries)
            print(f"  of which its deliveries (for_detail): {ms}", flush=True)
            ms = await _timed_ms(args.rounds, detail_audit)
            print(f"  of which its newest audit rows: {ms}", flush=True)
        finally:
            await db.close()
    finally:
        server.stop()


def main() -> None:
    """Parse the sizes and run."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--item-rows", type=int, default=20_000)
    parser.add_argument("--days-seeded", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
