"""The channels' route lookup, in process: read every time against ``RouteCache``.

::

    .venv/bin/python -m bench.route_lookup [--n 2000] [--rounds 5]

Each lookup follows a write transaction's commit, as under load, so the uncached read
starts on a reader connection whose page cache the commit emptied. Prints microseconds
per lookup, min/median/max over the rounds, the two ways alternating in every round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from binding import routes
from leadgate.core.types import RouteMatch
from leadgate.database import schema as t
from leadgate.database.db import upgrade
from tests.helpers import make_agent, make_org, make_route
from tests.stack import build_stack

ATTRS = {"team": "T1", "channel": "C1"}


async def run(n: int, rounds: int) -> None:
    url = f"sqlite+aiosqlite:///{Path(tempfile.mkdtemp(prefix='leadgate-routes-')) / 'r.db'}"
    await asyncio.to_thread(upgrade, url)
    stack = build_stack(url)
    try:
        org = await make_org(stack)
        agent = await make_agent(stack, org, "plain")
        await make_route(stack, org, str(agent["id"]), "slack")
        cache = routes.RouteCache(stack.db)

        async def every_time() -> RouteMatch | None:
            async with stack.db.read() as conn:
                return await routes.resolve(conn, "slack", ATTRS)

        async def kept() -> RouteMatch | None:
            return await cache.resolve("slack", ATTRS)

        async def commit() -> None:  # writes a row no route depends on
            async with stack.db.tx() as conn:
                await conn.execute(
                    t.sessions.update().where(t.sessions.c.id == "none").values(event_seq=1)
                )

        ways: dict[str, Callable[[], Awaitable[RouteMatch | None]]] = {
            "read every time": every_time,
            "RouteCache": kept,
        }
        figures: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, lookup in ways.items():
                spent = 0.0
                for _ in range(n):
                    await commit()
                    started = time.perf_counter()
                    if await lookup() is None:
                        raise SystemExit("bench: the route was not found")
                    spent += time.perf_counter() - started
                figures[name].append(spent / n * 1e6)
        for name, xs in figures.items():
            print(
                f"{name:16s} {min(xs):6.1f} / {statistics.median(xs):6.1f} / {max(xs):6.1f}"
                " us per lookup (min / median / max)"
            )
        print(f"RouteCache read the routes {cache.reads} time(s) in {n * rounds} lookups")
    finally:
        await stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="lookups per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.n, args.rounds))


if __name__ == "__main__":
    main()
