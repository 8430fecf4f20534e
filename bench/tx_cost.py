"""The CPU of ``Database.tx`` itself on SQLite, in process.

::

    .venv/bin/python -m bench.tx_cost [--tasks 16] [--n 2000] [--rounds 3]

``--tasks`` concurrent tasks each run ``--n`` write transactions of one cheap statement
(an UPDATE that matches no row), so what is measured is the transaction's machinery: the
writer queue, group commit, savepoints, the commit and the after-commit hand-off. Prints
microseconds of process CPU per transaction and transactions per second, min / median /
max over the rounds.

To compare two builds, run it in both, alternating (the VM's speed drifts):
``git worktree add /tmp/base REV``, then ``cd /tmp/base && <this venv>/bin/python -m
bench.tx_cost`` (copy this file there if REV predates it). Run it *from* the other tree:
with ``-m`` the working directory comes first on ``sys.path``, so ``PYTHONPATH`` alone
would time this checkout again.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.database.db import Database, upgrade

#: matches no row: the statement costs next to nothing beside the transaction around it
NO_ROW = (
    t.organizations.update()
    .where(t.organizations.c.id == sa.bindparam("p_id"))
    .values(name=sa.bindparam("p_name"))
)


async def run(tasks: int, n: int, rounds: int) -> None:
    """Print the figures of ``rounds`` rounds of ``tasks`` x ``n`` transactions."""
    url = f"sqlite+aiosqlite:///{Path(tempfile.mkdtemp(prefix='leadgate-tx-')) / 'tx.db'}"
    await asyncio.to_thread(upgrade, url)
    db = Database(url)

    async def writer(k: int) -> None:
        for i in range(n):
            async with db.tx() as conn:
                await conn.execute(NO_ROW, {"p_id": f"none{k}", "p_name": f"n{i}"})

    cpu: list[float] = []
    rate: list[float] = []
    try:
        await writer(0)  # the connection opened and the plan compiled before measuring
        for _ in range(rounds):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(writer(k) for k in range(tasks)))
            cpu1, wall1 = time.process_time(), time.perf_counter()
            cpu.append((cpu1 - cpu0) / (tasks * n) * 1e6)
            rate.append(tasks * n / (wall1 - wall0))
    finally:
        await db.close()
    print(
        f"{tasks} tasks x {n} transactions: "
        f"{min(cpu):.1f} / {statistics.median(cpu):.1f} / {max(cpu):.1f} us of CPU per "
        f"transaction, {min(rate):.0f} / {statistics.median(rate):.0f} / {max(rate):.0f} "
        "per s (min / median / max)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.tasks, args.n, args.rounds))


if __name__ == "__main__":
    main()
