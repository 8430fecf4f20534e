"""Instructions per plain turn and per lifecycle, counted: a cut of 1% shows as 1%.

::

    .venv/bin/python -m bench.instructions [--base REV] [--scenario plain,rest,slack]

CPU time on a shared 2-core VM moves by tens of percent between slices (``bench.ab
--control``), so a change worth a few percent cannot be read from it. Here the
turn path runs in process (``tests/stack.py``: the turn path, the lead runner and the
relay on one SQLite file, 16 sessions at a time as in the benches, no HTTP) under
``valgrind --tool=callgrind``, which counts the instructions executed: the same build
counts the same within about half a percent, whatever the machine is doing.
Each scenario runs twice, with ``--small`` and ``--large`` units, and the difference
divided by the units is the count per unit (start-up and warm-up cancel out).
``--base REV`` counts ``REV`` the same way (exported with ``git archive``) and prints
the change; ``--repeats`` runs each count more than once to show its spread. The same
code counted in the working tree and in an exported copy has differed by up to 0.2%
(``--base HEAD`` on a clean tree: plain 932,814 -> 934,260; another time a REST
lifecycle matched to 0.01%): read a change that small as none. Since session 46 the
child freezes what its imports and set-up made (``gc.freeze()``, as ``leadgate serve``
does) before it counts: without that, a change to which modules are imported moved
the count through the collector's full passes (making three imports lazy read as
+0.9% on a plain turn and +2.2% on a Slack lifecycle; frozen, +0.0% and -0.1%).

What it does not count: the HTTP request (aiohttp, the OpenAI envelope, Slack's
signed request through slack-bolt), the kernel (system calls, such as the WAL's
writes), and waiting. It is a tool for comparing builds of the turn path, not a
figure of the service: ``python -m bench`` is that. Needs ``valgrind`` (Debian:
``apt-get install valgrind``); a count takes 10-40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("plain", "rest", "slack")
CLIENTS = 16


async def _child(scenario: str, units: int, template: Path) -> None:
    """Run ``units`` of ``scenario`` in process (after a warm-up) on a copy of
    ``template``. Imports the tree on ``sys.path`` (the one being counted)."""
    from leadgate.core.runners import drain
    from tests.helpers import api_trigger, make_agent, make_org, slack_trigger
    from tests.outbox_support import ScriptedChannel
    from tests.stack import build_stack

    workdir = Path(tempfile.mkdtemp(prefix="leadgate-instr-"))
    try:
        shutil.copyfile(template, workdir / "t.db")
        channel = ScriptedChannel("slack")
        stack = build_stack(f"sqlite+aiosqlite:///{workdir}/t.db", channels={"slack": channel})
        # Wired as the service wires it (tests/unit/test_lifecycle_cost.py).
        stack.turns.on_review_queued = stack.lead_runner.poke
        stack.lead_runner.poked_on_enqueue = True
        org = await make_org(stack)
        await make_agent(stack, org, "worker-lead")
        worker = await make_agent(stack, org, "worker", lead="worker-lead")
        plain = await make_agent(stack, org, "plain")

        async def client(c: int, n: int, tag: str) -> None:
            for i in range(n):
                if scenario == "plain":
                    await stack.turns.run(api_trigger(org, plain, "hello", session=f"p{c}"))
                    continue
                if scenario == "rest":
                    trigger = api_trigger(org, worker, "do it #complete", session=f"g{tag}-{c}-{i}")
                else:
                    trigger = slack_trigger(org, worker, "do it #complete", f"{tag}{c}.{i}")
                await stack.turns.run(trigger)
                await drain(stack.lead_runner)
                if scenario == "slack":
                    await drain(stack.relay)

        # As `leadgate serve` does once it is built (leadgate/cli/main.py): what the
        # imports and the setup made stays out of the collector's passes. Without it the
        # count followed how many objects the imports left (an import made lazy changed
        # how often the full passes ran, by up to 2% of a lifecycle).
        gc.freeze()
        await asyncio.gather(*(client(c, 2, "w") for c in range(CLIENTS)))
        await asyncio.gather(*(client(c, units // CLIENTS, "m") for c in range(CLIENTS)))
        await stack.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _count(tree: Path, scenario: str, units: int, template: Path) -> int:
    """Instructions of one child run on ``tree`` (callgrind's ``I refs``)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    # The script by path: its directory (this tree's bench/) comes first on sys.path,
    # then PYTHONPATH, so ``leadgate`` and ``tests`` are the counted tree's.
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            scenario,
            str(units),
            str(template),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"counting {scenario} on {tree} failed:\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def per_unit(tree: Path, scenario: str, small: int, large: int, template: Path) -> float:
    """Instructions per unit of ``scenario`` on ``tree``: (large - small) / units (the two
    runs side by side: valgrind runs one thread)."""
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(_count, tree, scenario, large, template)
        little = _count(tree, scenario, small, template)
        return (big.result() - little) / (large - small)


def _template(tree: Path, into: Path) -> Path:
    """A database migrated by ``tree``'s migrations (each side its own schema)."""
    path = into / "template.db"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from leadgate.database.db import upgrade; upgrade(sys.argv[1])",
            f"sqlite+aiosqlite:///{path}",
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
        capture_output=True,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--base", help="also count this revision and print the change")
    parser.add_argument("--scenario", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--small", type=int, default=96, help="units of the short run")
    parser.add_argument("--large", type=int, default=480, help="units of the long run")
    parser.add_argument("--repeats", type=int, default=1, help="counts per tree")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        scenario, units, template = args.child
        asyncio.run(_child(scenario, int(units), Path(template)))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.instructions needs valgrind (apt-get install valgrind)")
    from bench.ab import export

    tmp = Path(tempfile.mkdtemp(prefix="leadgate-instr-"))
    try:
        trees = {"this tree": ROOT}
        if args.base:
            trees[args.base] = export(args.base, tmp / "base")
        templates: dict[str, Path] = {}
        for name, tree in trees.items():
            (tmp / str(len(templates))).mkdir()
            templates[name] = _template(tree, tmp / str(len(templates)))
        print(
            f"instructions per unit (callgrind, in process, {CLIENTS} sessions at a time; "
            f"({args.large} - {args.small} units) / {args.large - args.small})",
            flush=True,
        )
        for scenario in args.scenario.split(","):
            counts: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(args.repeats):
                for name, tree in trees.items():  # alternate, though counts do not drift
                    counts[name].append(
                        per_unit(tree, scenario, args.small, args.large, templates[name])
                    )
            line = [f"{scenario:6}"]
            for name, values in counts.items():
                spread = f" ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else ""
                line.append(f"{name}: {statistics.median(values):,.0f}{spread}")
            if args.base:
                head, base = (statistics.median(v) for v in counts.values())
                line.append(f"change {head / base - 1:+.1%}")
            print("   ".join(line), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
