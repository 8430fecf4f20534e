"""Where the service's SQLite time goes: per statement, per commit, per WAL frame.

::

    .venv/bin/python -m bench.sqlite_costs [--scenario slack|rest|plain|relay] [--duration 4]

Starts ``leadgate serve`` on SQLite under :mod:`bench.sqltrace` and drives one of the
lifecycle bench's scenarios (``bench.lifecycle``: Slack lifecycles ending in a post to the
stand-in, REST lifecycles, or plain REST turns; 16 clients) for ``--duration`` seconds;
or (``relay``) drains ``--n`` approved deliveries to the Slack stand-in with the relay in
this process, as ``bench.bench_outbox`` does. Then prints:

1. each statement: calls per operation, microseconds per call and per operation (time in
   ``InlineConnection.run``/``run_many``/``commit``: SQLite plus the plan's argument and
   row handling around it), highest first, and their sum against the service's CPU per
   operation;
2. the WAL, copied in the middle of the run: commits, frames per commit (each frame is
   two ``pwrite64`` calls when it commits), and the frames by B-tree (table or index,
   named by SQLite's ``dbstat``). A commit writes each page it changed once, so each
   B-tree a group of transactions touches costs about one frame per commit.

Figures and what they showed are in docs/performance-history.md (session 11: "where the
SQLite time goes").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import sqlite3
import struct
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

from bench.bench_outbox import Standin
from bench.bench_rest import cpu_seconds
from bench.lifecycle import Service, plain_slice, rest_slice, slack_slice

_WAL_HEADER = struct.Struct(">8I")
_FRAME_HEADER = struct.Struct(">4I")


def wal_commits(wal: bytes) -> tuple[int, list[list[int]]]:
    """The page size and, for each commit in a WAL file's current generation, the page
    numbers of its frames (https://www.sqlite.org/fileformat2.html#walformat)."""
    if len(wal) < _WAL_HEADER.size:
        return 0, []
    _magic, _version, page_size, _seq, salt1, salt2, _c1, _c2 = _WAL_HEADER.unpack_from(wal)
    commits: list[list[int]] = []
    pending: list[int] = []
    offset = _WAL_HEADER.size
    while offset + 24 + page_size <= len(wal):
        page, db_size, s1, s2 = _FRAME_HEADER.unpack_from(wal, offset)
        if (s1, s2) != (salt1, salt2):
            break  # a frame of an earlier generation: the current one ends here
        pending.append(page)
        if db_size:  # a commit frame
            commits.append(pending)
            pending = []
        offset += 24 + page_size
    return page_size, commits


def btree_names(db: Path) -> dict[int, str]:
    """Page number -> the table or index it belongs to (``dbstat``)."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT name, pageno FROM dbstat")
        return {int(page): str(name) for name, page in rows}
    finally:
        conn.close()


async def _drive(svc: Service, standin: Standin, scenario: str, seconds: float) -> int:
    args = SimpleNamespace(concurrency=16)
    async with aiohttp.ClientSession() as http:
        events = f"{svc.proc.url}/slack/events"
        if scenario == "slack":
            n, _ = await slack_slice(http, events, standin, args, f"c{time.time_ns()}", seconds)
        elif scenario == "rest":
            n, _, _ = await rest_slice(http, svc, args, f"c{time.time_ns()}", seconds)
        else:
            n, _, _ = await plain_slice(http, svc, args, f"c{time.time_ns()}", seconds)
        return n


async def run(scenario: str, duration: float) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="leadgate-sqlite-costs-"))
    standin = Standin()
    stats_file = workdir / "statements.json"
    svc = Service(workdir / "service", standin)
    svc.proc.serve_python_args = ("-m", "bench.sqltrace", "-o", str(stats_file))
    db = svc.proc.sqlite_file
    assert db is not None
    try:
        svc.proc.start()
        ops = await _drive(svc, standin, scenario, 1.0)  # warm-up: counted, not timed
        cpu0 = cpu_seconds(svc.proc.pid)
        first = await _drive(svc, standin, scenario, duration / 2)
        snapshot = workdir / "snapshot"
        snapshot.mkdir()
        shutil.copyfile(db, snapshot / "db")  # the WAL last: its frames need their base
        shutil.copyfile(f"{db}-wal", snapshot / "db-wal")
        second = await _drive(svc, standin, scenario, duration / 2)
        cpu_ms = (cpu_seconds(svc.proc.pid) - cpu0) / (first + second) * 1000
        ops += first + second
    finally:
        svc.proc.stop()
        standin.stop()
    stats: dict[str, list[float]] = json.loads(stats_file.read_text())
    report(f"scenario {scenario}: {ops} operations; service CPU {cpu_ms:.3f} ms", ops, stats)
    report_wal(snapshot)
    shutil.rmtree(workdir, ignore_errors=True)


async def run_relay(n: int) -> None:
    """The relay in this process draining ``n`` approved deliveries (seeding not timed)."""
    from bench.bench_outbox import fresh_sqlite, slack_channel
    from bench.sqltrace import install
    from leadgate.core.clock import RandomIds, SystemClock
    from leadgate.core.runners import drain
    from leadgate.database.db import Database
    from outbox.relay import Relay
    from tests.outbox_support import seed_items

    workdir = Path(tempfile.mkdtemp(prefix="leadgate-sqlite-costs-"))
    standin = Standin()
    stats: dict[str, list[float]] = {}
    install(stats)
    url = await fresh_sqlite(workdir, "relay.db")
    db = Database(url)
    clock, ids = SystemClock(), RandomIds()
    channel = slack_channel(standin.api_url)
    snapshot = workdir / "snapshot"
    try:
        await seed_items(db, clock, ids, n, text=lambda i: f"costs #{i}")
        path = workdir / "relay.db"
        conn = sqlite3.connect(path)
        try:  # the seeding's frames out of the WAL: what the copy holds is the drain's
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
        stats.clear()
        relay = Relay(db, clock, ids, {"slack": channel}, batch=100, concurrency=64)

        async def timed_drain() -> float:
            await drain(relay)
            return time.perf_counter()

        started, cpu0 = time.perf_counter(), time.process_time()
        drained = asyncio.create_task(timed_drain())
        await asyncio.sleep(0.3)  # into the drain, then copy the WAL as it stands
        copy_cpu0 = time.process_time()
        snapshot.mkdir()
        shutil.copyfile(path, snapshot / "db")
        shutil.copyfile(f"{path}-wal", snapshot / "db-wal")
        copy_cpu = time.process_time() - copy_cpu0
        elapsed = await drained - started  # not the sleep, if the drain ended first
        cpu_s = time.process_time() - cpu0 - copy_cpu
    finally:
        await channel.close()
        await db.close()
        standin.stop()
    report(
        f"scenario relay: {n} deliveries at {n / elapsed:.0f}/s; "
        f"this process's CPU {cpu_s / n * 1000:.3f} ms",
        n,
        stats,
    )
    report_wal(snapshot)
    shutil.rmtree(workdir, ignore_errors=True)


def report(title: str, ops: int, stats: dict[str, list[float]]) -> None:
    """Statements by their time, per operation."""
    print(f"{title} per operation")
    print(f"{'calls/op':>8} {'us/call':>8} {'us/op':>7}  statement")
    total = 0.0
    for name, (calls, seconds) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        per_op = seconds / ops * 1e6
        total += per_op
        if calls / ops >= 0.05 or per_op >= 1.0:  # batched statements: rare, not cheap
            print(f"{calls / ops:8.2f} {seconds / calls * 1e6:8.1f} {per_op:7.1f}  {name[:90]}")
    print(f"{'':8} {'':8} {total:7.1f}  in all")


def report_wal(snapshot: Path) -> None:
    """Commits and frames of the WAL copied into ``snapshot``, frames by B-tree."""
    page_size, commits = wal_commits((snapshot / "db-wal").read_bytes())
    frames = [page for commit in commits for page in commit]
    if not commits:
        print("WAL: no complete commit in the copy (a checkpoint had just restarted it)")
        return
    names = btree_names(snapshot / "db")
    by_tree = collections.Counter(names.get(page, "(page not in the copy)") for page in frames)
    print(
        f"\nWAL copy: {len(commits)} commits, {len(frames)} frames of {page_size} bytes, "
        f"{len(frames) / len(commits):.1f} frames per commit; frames by B-tree:"
    )
    for name, count in by_tree.most_common():
        print(f"{count / len(commits):8.2f} per commit  {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("slack", "rest", "plain", "relay"), default="slack")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured")
    parser.add_argument("--n", type=int, default=3000, help="relay: deliveries")
    args: Any = parser.parse_args(argv)
    if args.scenario == "relay":
        asyncio.run(run_relay(args.n))
    else:
        asyncio.run(run(args.scenario, args.duration))


if __name__ == "__main__":
    main()
