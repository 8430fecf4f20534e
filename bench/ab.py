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
        opts = types.SimpleNamespace(concurrency=args.concurrency, duration=args.seconds)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            for name, svc in sides.items():  # warm-up: plans, caches, connections
                await plain_slice(http, svc, opts, f"warm-{name}", args.seconds)
                await rest_slice(http, svc, opts, f"warm-{name}", args.seconds)
            for k in range(args.slices):
                for name in ("head", "base") if k % 4 in (0, 3) else ("base", "head"):
                    svc, tally = sides[name], tallies[name]
                    tag = f"{name}{k}"
                    tally["plain"].add(*await plain_slice(http, svc, opts, tag, args.seconds))
                    tally["rest"].add(*await rest_slice(http, svc, opts, tag, args.seconds))
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
        print(f"  CPU per {kind}: head vs base {change:+.1%}")


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
