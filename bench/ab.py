"""Two builds of the service side by side: is a change faster, or is it the VM?

::

    .venv/bin/python -m bench.ab --base REV [--slices 8] [--seconds 1.0]
    .venv/bin/python -m bench.ab --control   # this tree against itself: the noise floor

Runs this working tree's ``leadgate serve`` and ``REV``'s (exported with ``git
archive`` to a temporary directory) at the same time, each with its own SQLite file and
the same Slack stand-in, and alternates short slices of plain turns, REST lifecycles and
Slack lifecycles between them (in ABBA order), so a slow spell of a shared VM lands on
both. Prints, for each side, rates, service CPU per plain turn and per REST lifecycle
(``/proc``), and the same ratios as ``python -m bench``.

Two identical services differ by several percent on a busy 2-core VM (which one shares
a core with the client, warm caches): run ``--control`` first and read a difference
smaller than the control's as no difference.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.bench_outbox import Standin  # noqa: E402
from bench.lifecycle import Service, Tally, plain_slice, rest_slice, slack_slice  # noqa: E402


def export(rev: str, into: Path) -> Path:
    """``rev`` of this repository as plain files under ``into`` (no git metadata)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="leadgate-ab-"))
    base = ROOT if args.control else export(args.base, tmp / "base")
    label = "this tree (control)" if args.control else args.base
    standin = Standin()
    sides: dict[str, Service] = {}
    try:
        for name, tree in (("head", ROOT), ("base", base)):
            sides[name] = Service(tmp / name, standin, root=tree)
            sides[name].proc.start()
        tallies = {name: {k: Tally() for k in ("plain", "rest", "slack")} for name in sides}
        # CPU per plain turn and per REST lifecycle of each slice, by side: slice k of
        # both sides ran back to back, so their ratio is the change under one VM spell.
        per_slice: dict[str, dict[str, list[float]]] = {
            name: {"plain": [], "rest": []} for name in sides
        }
        opts = types.SimpleNamespace(concurrency=args.concurrency, duration=args.seconds)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            for name, svc in sides.items():  # warm-up: plans, caches, connections
                await plain_slice(http, svc, opts, f"warm-{name}", args.seconds)
                await rest_slice(http, svc, opts, f"warm-{name}", args.seconds)
            for k in range(args.slices):
                for name in ("head", "base") if k % 4 in (0, 3) else ("base", "head"):
                    svc, tally = sides[name], tallies[name]
                    tag = f"{name}{k}"
                    for kind, run_slice in (("plain", plain_slice), ("rest", rest_slice)):
                        n, elapsed, cpu_s = await run_slice(http, svc, opts, tag, args.seconds)
                        tally[kind].add(n, elapsed, cpu_s)
                        per_slice[name][kind].append(cpu_s / n * 1000 if n else math.nan)
                    events = f"{svc.proc.url}/slack/events"
                    tally["slack"].add(
                        *await slack_slice(http, events, standin, opts, tag, args.seconds)
                    )
    finally:
        for svc in sides.values():
            svc.proc.stop()
        standin.stop()
    print(f"bench.ab: head = this working tree, base = {label}; {args.slices} slices each")
    for name, t in tallies.items():
        plain, rest, slack = t["plain"], t["rest"], t["slack"]
        print(
            f"  {name}: plain {plain.rate:.0f}/s ({plain.cpu_ms:.3f} ms CPU), REST lifecycles "
            f"{rest.rate:.0f}/s ({rest.cpu_ms:.3f} ms CPU, {rest.cpu_ms / plain.cpu_ms:.2f}x), "
            f"Slack lifecycles {slack.rate:.0f}/s; REST / plain {rest.rate / plain.rate:.3f}, "
            f"Slack / plain {slack.rate / plain.rate:.3f}"
        )
    head, base_t = tallies["head"], tallies["base"]
    for kind in ("plain", "rest"):
        change = head[kind].cpu_ms / base_t[kind].cpu_ms - 1
        low, mid, high = paired_spread(per_slice["head"][kind], per_slice["base"][kind])
        print(
            f"  CPU per {kind}: head vs base {change:+.1%} "
            f"(slice by slice: min {low:+.1%}, median {mid:+.1%}, max {high:+.1%})"
        )


def paired_spread(head: list[float], base: list[float]) -> tuple[float, float, float]:
    """Min, median and max over slices of ``head[k] / base[k] - 1``: each pair ran back
    to back, so the spread is how far one VM spell moved a single comparison (a change
    whose median sits inside a control run's spread is no change).

    A pair where either side completed nothing (NaN) is left out: NaN has no place in a
    sorted list, and would put the median anywhere. With no pair left, all three are NaN.
    """
    changes = sorted(
        h / b - 1
        for h, b in zip(head, base, strict=True)
        if not (math.isnan(h) or math.isnan(b)) and b > 0
    )
    if not changes:
        return math.nan, math.nan, math.nan
    return changes[0], statistics.median(changes), changes[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="the revision to compare with (e.g. HEAD~1)")
    which.add_argument("--control", action="store_true", help="this tree against itself")
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
