"""``python -m bench``: every benchmark side by side in one run, one table of ratios.

::

    .venv/bin/python -m bench [--rounds 3] [--duration 4] [--parts rest,lifecycle,...]

Each row is a ratio (or a latency) measured side by side in this run, with its minimum,
median and maximum over ``--rounds`` rounds, its target, and the command that measures
it alone. The header names the machine's cores, its load and how late it wakes an
idle sleeper (:func:`sleep_overshoot`), before and after. The
physical limits of the same run (the bare endpoint, direct posting) are the
denominators of the ratios. ``docs/performance.md`` explains each row and what bounds it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_outbox, bench_rest, lifecycle  # noqa: E402

PARTS = ("rest", "lifecycle", "approve", "outbox", "latency", "pg-rest", "pg-lifecycle", "pg-relay")


@dataclass
class Row:
    """One figure of the table."""

    name: str
    values: list[float]
    target: str
    ok: Callable[[float], bool]
    command: str
    unit: str = ""
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        vals = [v for v in self.values if not math.isnan(v)]
        if not vals:
            return f"| {self.name} | n/a | {self.target} | not measured | `{self.command}` |"
        lo, med, hi = min(vals), statistics.median(vals), max(vals)
        verdict = "OK" if all(self.ok(v) for v in vals) else "MISSED"
        figure = f"{lo:.3g} / {med:.3g} / {hi:.3g}{self.unit}"
        return f"| {self.name} | {figure} | {self.target} | {verdict} | `{self.command}` |"


def rest_args(args: argparse.Namespace, *, postgres: bool) -> argparse.Namespace:
    return argparse.Namespace(
        duration=args.duration,
        requests=None,
        concurrency=16,
        warmup=1.0,
        rounds=args.rounds,
        only=["bare", "plain"],
        profile=None,
        keep=False,
        postgres=postgres,
    )


def outbox_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        n=3000,
        rounds=args.rounds,
        batch=100,
        concurrency=64,
        pg_latency_ms=20,
        rate=200,
        latency_n=1000,
        approve_via="decisions",
    )


def life_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        duration=args.duration,
        slices=args.slices,
        concurrency=16,
        rounds=args.rounds,
        rate=200,
        approve_n=1000,
        pg_latency_ms=20,
    )


async def run(args: argparse.Namespace) -> list[Row]:
    parts = set(args.parts.split(","))
    rows: list[Row] = []
    m = "python -m bench --parts"
    if "rest" in parts:
        print("rest (SQLite): bare vs plain, alternating", flush=True)
        _, ratios = await bench_rest.measure(rest_args(args, postgres=False))
        rows.append(
            Row(
                "plain turn / bare aiohttp endpoint, SQLite, 16 clients",
                ratios,
                ">= 0.30 every round",
                lambda v: v >= 0.30,
                f"{m} rest",
            )
        )
    figures = lifecycle.Figures()
    life_parts = {p for p in ("lifecycle", "approve") if p in parts}
    if life_parts:
        print("lifecycles (SQLite): plain turns vs gated lifecycles, interleaved", flush=True)
        await lifecycle.sqlite_parts(
            life_args(args), figures, {"sqlite" if p == "lifecycle" else p for p in life_parts}
        )
    if "lifecycle" in parts:
        rounds = figures.rounds
        rows += [
            Row(
                "gated lifecycles/s / plain turns/s, SQLite, REST, api binding",
                [r.rest_lps / r.plain_rps for r in rounds],
                ">= 0.30",
                lambda v: v >= 0.30,
                f"{m} lifecycle",
            ),
            Row(
                "the same with a Slack binding (ends in a post to the stand-in)",
                [r.slack_lps / r.plain_rps for r in rounds],
                ">= 0.25",
                lambda v: v >= 0.25,
                f"{m} lifecycle",
            ),
            Row(
                "service CPU per gated lifecycle / per plain turn",
                [r.rest_cpu_ms / r.plain_cpu_ms for r in rounds],
                "<= 3x",
                lambda v: v <= 3.0,
                f"{m} lifecycle",
                unit="x",
            ),
            Row(
                "peak RSS of leadgate serve during the lifecycle bench",
                [figures.peak_rss_mb],
                "<= 200 MB",
                lambda v: v <= 200,
                f"{m} lifecycle",
                unit=" MB",
            ),
        ]
    if "approve" in parts:
        rows.append(
            Row(
                "POST /operator/reviews/{id}/approve at 200/s open loop: p99",
                [figures.approve_p99_ms],
                "<= 20 ms",
                lambda v: v <= 20,
                f"{m} approve",
                unit=" ms",
            )
        )
    with tempfile.TemporaryDirectory(prefix="leadgate-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if "outbox" in parts:
            print("outbox (SQLite): relay vs direct posting, alternating", flush=True)
            rows.append(
                Row(
                    "relay / direct slack_sdk posting, SQLite, 3,000 deliveries",
                    await relay_vs_direct(outbox_args(args), tmp),
                    ">= 0.90",
                    lambda v: v >= 0.90,
                    f"{m} outbox",
                )
            )
        if "latency" in parts:
            print("latency: approval commit -> stand-in receipt at 200/s", flush=True)
            p99s = []
            for _ in range(args.rounds):
                lines, p99 = await bench_outbox.latency_run(outbox_args(args), tmp, "decisions")
                print("\n".join(lines), flush=True)
                p99s.append(p99)
            rows.append(
                Row(
                    "approval commit -> stand-in receipt p99 at 200/s",
                    p99s,
                    "<= 5 ms",
                    lambda v: v <= 5,
                    f"{m} latency",
                    unit=" ms",
                )
            )
    if "pg-rest" in parts:
        print("rest (PostgreSQL): bare vs plain, alternating", flush=True)
        _, ratios = await bench_rest.measure(rest_args(args, postgres=True))
        rows.append(
            Row(
                "plain turn / bare, PostgreSQL",
                ratios,
                ">= 0.15",
                lambda v: v >= 0.15,
                f"{m} pg-rest",
            )
        )
    if "pg-lifecycle" in parts:
        print("lifecycles (PostgreSQL, stand-in +20 ms): 1 all vs 1 api + 2 workers", flush=True)
        await lifecycle.pg_part(life_args(args), figures)
        rows.append(
            Row(
                "gated lifecycles/s, PostgreSQL, 1 api + 2 workers / 1 all-in-one",
                [s / o for o, s in zip(figures.pg_one, figures.pg_split, strict=False)],
                ">= 1.8",
                lambda v: v >= 1.8,
                f"{m} pg-lifecycle",
                unit="x",
            )
        )
    if "pg-relay" in parts:
        print("relay (PostgreSQL, stand-in +20 ms): 1 vs 4 replicas", flush=True)
        rows.append(
            Row(
                "relay on PostgreSQL, 4 replicas / 1 replica",
                await pg_replicas(args),
                ">= 3.2x",
                lambda v: v >= 3.2,
                f"{m} pg-relay",
                unit="x",
            )
        )
    return rows


async def relay_vs_direct(args: argparse.Namespace, tmp: Path) -> list[float]:
    standin = bench_outbox.Standin()
    ratios = []
    try:
        for r in range(args.rounds):
            rate, deliveries = await bench_outbox.relay_rate_sqlite(
                standin, tmp, args.n, r, args.batch, args.concurrency
            )
            direct = await bench_outbox.direct_rate(standin, deliveries, args.concurrency)
            print(f"   round {r}: relay {rate:.0f}/s, direct {direct:.0f}/s", flush=True)
            ratios.append(rate / direct)
    finally:
        standin.stop()
    return ratios


async def pg_replicas(args: argparse.Namespace) -> list[float]:
    from tests.pg import start_postgres

    server = await asyncio.to_thread(start_postgres)
    standin = bench_outbox.Standin(latency_ms=20)
    ratios = []
    try:
        for r in range(args.rounds):
            one = await bench_outbox.pg_drain(server, standin, 3000, 1, f"r1_{r}", 8, 100)
            four = await bench_outbox.pg_drain(server, standin, 3000, 4, f"r4_{r}", 8, 100)
            print(f"   round {r}: 1 replica {one:.0f}/s, 4 replicas {four:.0f}/s", flush=True)
            ratios.append(four / one)
    finally:
        standin.stop()
        server.stop()
    return ratios


def sleep_overshoot(seconds: float = 2.0, step_s: float = 0.001) -> str:
    """How late this machine wakes an idle process that sleeps 1 ms (p50 / p99 / max
    over ``seconds``): the scheduling noise under every latency row. A VM whose idle
    sleeps wake milliseconds late cannot show a p99 of a few milliseconds for anything
    that crosses processes, whatever the service does."""
    late: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        time.sleep(step_s)
        late.append((time.perf_counter() - began - step_s) * 1000)
    late.sort()
    p99 = late[min(len(late) - 1, int(len(late) * 0.99))]
    return (
        f"an idle 1 ms sleep wakes late by p50 {late[len(late) // 2]:.2f}, "
        f"p99 {p99:.2f}, max {late[-1]:.2f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per scenario")
    parser.add_argument(
        "--slices",
        type=int,
        default=3,
        help="lifecycle rounds: plain, REST and Slack phases interleaved in this many slices",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    before = os.getloadavg()
    print(
        f"leadgate bench: {os.cpu_count()} CPUs, load average {before[0]:.2f} "
        f"{before[1]:.2f} {before[2]:.2f}; {args.rounds} rounds",
        flush=True,
    )
    jitter = sleep_overshoot()
    print(f"scheduling: {jitter}", flush=True)
    rows = asyncio.run(run(args))
    after = os.getloadavg()
    print()
    print(f"{os.cpu_count()} CPUs; load average before {before[0]:.2f}, after {after[0]:.2f}")
    print(f"scheduling before: {jitter}; after: {sleep_overshoot()}")
    print("| figure | min / median / max | target | | command |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
