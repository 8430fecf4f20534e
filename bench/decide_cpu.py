"""A person's approval through ``Reviews.decide``, in process: CPU per decision.

::

    .venv/bin/python -m bench.decide_cpu [--n 400] [--rounds 3]

The operator API's, the console's and the CLI's path without HTTP: the fenced move, the
api binding's reveal (done in the approval's transaction), the review episode (opened at
escalation, as the app's notifier does), and the detail the response returns, on an
SQLite file with the script model. Each round escalates ``n`` items (and a few to warm
the caches), then approves them one after another and prints the process's CPU per
approval (``time.process_time``). To compare with another commit, run it in that
commit's tree (``git archive REV | tar -x -C DIR``, then ``PYTHONPATH=DIR`` from
``DIR``) alternating with this one: a shared VM's speed moves between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from leadgate.core.config import ReviewSettings
from leadgate.core.runners import drain
from leadgate.core.types import Gated
from leadgate.database.db import upgrade
from leadgate.operations.reviews import Reviews
from leadgate.review.cards import ReviewNotifier
from tests.helpers import api_trigger, make_agent, make_org
from tests.stack import build_stack

WARM = 20


async def one_round(url: str, n: int) -> float:
    """CPU milliseconds per approval over ``n`` approvals on a fresh database."""
    stack = build_stack(url)
    try:
        notifier = ReviewNotifier(
            stack.clock,
            stack.ids,
            stack.outbox,
            public_url="https://leadgate.example",
            defaults=ReviewSettings(),
        )
        stack.outbox.on_review_needed(notifier.open)
        org = await make_org(stack)
        await make_agent(stack, org, "lead")
        worker = await make_agent(stack, org, "worker", lead="lead")
        items: list[str] = []
        for i in range(n + WARM):
            trigger = api_trigger(org, worker, f"hard {i} #escalate #complete", session=f"s{i}")
            out = await stack.turns.run(trigger)
            assert isinstance(out, Gated) and out.work_item_id
            items.append(out.work_item_id)
        await drain(stack.lead_runner)
        reviews = Reviews(stack.db, stack.clock, stack.ids, stack.outbox)
        for item_id in items[:WARM]:  # plans and caches, as in a running service
            await reviews.decide(org.principal, item_id, "approve")
        started = time.process_time()
        for item_id in items[WARM:]:
            detail = await reviews.decide(org.principal, item_id, "approve")
            assert detail["status"] == "completed"
        return (time.process_time() - started) / n * 1000
    finally:
        await stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = []
    for k in range(args.rounds):
        url = f"sqlite+aiosqlite:///{Path(tempfile.mkdtemp(prefix='leadgate-decide-')) / 'd.db'}"
        upgrade(url)  # outside the event loop (Alembic runs its own)
        figures.append(asyncio.run(one_round(url, args.n)))
        print(f"   round {k}: {figures[-1]:.3f} ms of CPU per approval", flush=True)
    print(
        f"Reviews.decide approve, {args.n} per round: "
        f"{min(figures):.3f} / {statistics.median(figures):.3f} / {max(figures):.3f} ms "
        "of CPU per approval (min / median / max)"
    )


if __name__ == "__main__":
    main()
