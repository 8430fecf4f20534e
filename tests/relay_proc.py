"""A relay-only process: the real relay code, nothing else (crash, replica, bench).

::

    python -m tests.relay_proc --db URL --slack-url URL [--token T] [--lease-ms N]
        [--batch N] [--concurrency N] [--timeout-s S] [--poll-s S]

Builds :class:`leadgate.database.db.Database`, :class:`bots.slack.SlackChannel` (one shared
``AsyncWebClient``) and :class:`outbox.relay.Relay`, and drives the relay with
:func:`leadgate.core.runners.run_loop`, woken by PostgreSQL ``LISTEN``
(:func:`outbox.store.listen`) on PostgreSQL and by its poll on SQLite (the in-process
wake-up cannot cross processes). Prints ``READY`` once it listens, and on SIGTERM or
SIGINT finishes the work in hand and prints ``STATS {"sent": n, ...}`` (this process's
successful posts) before exiting 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections import Counter
from typing import Any

from bots.slack import SlackChannel
from leadgate.core.clock import RandomIds, SystemClock
from leadgate.core.config import SlackSettings
from leadgate.core.runners import run_loop
from leadgate.database.db import Database
from outbox.channel import OutboundMessage, SendOutcome
from outbox.relay import Relay
from outbox.store import listen


class CountingChannel:
    """Wraps a channel and counts its outcomes by class."""

    def __init__(self, inner: SlackChannel) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_chars = inner.max_chars
        self.outcomes: Counter[str] = Counter()

    async def send(self, message: OutboundMessage) -> SendOutcome:
        outcome = await self.inner.send(message)
        self.outcomes[type(outcome).__name__.lower()] += 1
        return outcome

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        outcome = await self.inner.update(message, external_id)
        self.outcomes[type(outcome).__name__.lower()] += 1
        return outcome

    async def close(self) -> None:
        await self.inner.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    db = Database(args.db, pool_size=4)
    channel = CountingChannel(
        SlackChannel(
            SlackSettings(signing_secret="unused", bot_token=args.token, api_url=args.slack_url),
            timeout_s=args.timeout_s,
        )
    )
    relay = Relay(
        db,
        SystemClock(),
        RandomIds(),
        {"slack": channel},
        batch=args.batch,
        concurrency=args.concurrency,
        send_lease_ms=args.lease_ms,
    )
    stop = asyncio.Event()
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listening = asyncio.Event()
    tasks = []
    if db.is_postgres:
        # Every enqueue NOTIFYs: claims can be demand-driven (see Relay.poke).
        relay.poked_on_enqueue = True

        def due() -> None:
            relay.poke()
            wake.set()

        tasks.append(asyncio.create_task(listen(args.db, due, stop, ready=listening.set)))
        await asyncio.wait_for(listening.wait(), timeout=30)
    print("READY", flush=True)
    tasks.append(asyncio.create_task(run_loop(relay, wake=wake, stop=stop, poll_s=args.poll_s)))
    await asyncio.gather(*tasks)
    await channel.close()
    await db.close()
    return dict(channel.outcomes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="run the outbox relay alone")
    parser.add_argument("--db", required=True, help="SQLAlchemy database URL")
    parser.add_argument("--slack-url", required=True, help="Slack Web API base URL")
    parser.add_argument("--token", default="xoxb-standin")
    parser.add_argument("--lease-ms", type=int, default=120_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--poll-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="relay_proc %(levelname)s %(message)s")
    stats = asyncio.run(main_async(args))
    print("STATS " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
