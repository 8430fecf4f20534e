"""One run of the relay's claim / send / commit pipeline, as a small state machine.

The pipeline keeps at most one database "turn" in flight: a single transaction that
commits every outcome finished since the previous turn and, when the pipeline wants
more, claims the next batch (on PostgreSQL each its own statement). Sends run meanwhile
(up to the relay's concurrency, with up to half a batch, and at most one round of sends,
queued behind; a claim takes at most about two rounds, so that replicas share a backlog
evenly). Each pass of :meth:`Pump.run` is these named steps:

1. :meth:`~Pump.start_handed`: start rows this process handed over (no claim needed);
2. :meth:`~Pump.start_turn`: when idle, commit finished outcomes and/or claim more;
3. :meth:`~Pump.wait`: sleep until a send or the turn finishes (or outcomes have
   lingered long enough to be committed);
4. :meth:`~Pump.finish_turn`: take the turn's claimed rows and start sending them.

It stops when nothing is in flight, nothing waits to be committed and no claim is
wanted. Completions are collected by done-callbacks and signalled through one event:
O(1) per finished send, where ``asyncio.wait()`` over every task in flight would
re-register a callback on each of them at every wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from leadgate.domain.rows import Delivery
from outbox.outcomes import Done

#: How long a finished send's outcome may wait to be committed with others.
COMMIT_LINGER_S = 0.010


class Pumped(Protocol):
    """What the pump needs from its relay."""

    batch: int
    concurrency: int
    max_rows_per_run: int

    def take_handed(self) -> list[Delivery]:
        """Rows handed over by this process since the last call."""
        ...

    def take_poke(self) -> bool:
        """Whether the relay was poked since the last call (and clear it)."""
        ...

    def set_active(self, count: int) -> None:
        """How many sends are in flight (for the hand-off's room check)."""
        ...

    def claimed_none(self) -> None:
        """A claim found nothing due."""
        ...

    async def deliver(self, row: Delivery) -> Done:
        """Send one row; never raises."""
        ...

    async def turn(self, group: list[Done], limit: int) -> list[Delivery]:
        """Commit ``group`` and claim up to ``limit`` rows in one transaction."""
        ...


class Pump:
    """One run of the pipeline; :meth:`run` returns the number of rows taken."""

    def __init__(self, relay: Pumped, *, claim: bool) -> None:
        self.relay = relay
        self.sending: set[asyncio.Task[Done]] = set()
        self.finished: list[Done] = []
        self.turn: asyncio.Task[list[Delivery]] | None = None
        self.turn_limit = 0
        self.more = claim  # due rows may be waiting for a claim
        self.claimed = 0
        # Rows queued behind the sends: enough to cover a claim's latency, and never more
        # than one round of sends (rows held here wait while other replicas may be idle:
        # with 4 replicas of concurrency 8 and batches of 100, the last batches of a
        # backlog left two replicas posting 100 rows more than the other two).
        queued = max(1, min(relay.batch // 2, relay.concurrency))
        self.high_water = relay.concurrency + queued
        #: the most one claim takes: what the sends can start within about two rounds
        self.claim_max = min(relay.batch, relay.concurrency + self.high_water)
        self.failure: BaseException | None = None
        self.progress = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.oldest = 0.0  # loop time at which the oldest uncommitted outcome finished

    @property
    def backlog(self) -> bool:
        """Whether rows were left due when the run ended (the runner loop goes on)."""
        return self.more and self.failure is None

    def wake(self) -> None:
        """Something happened outside the pump (a hand-over, a poke)."""
        self.progress.set()

    async def run(self) -> int:
        """Run until nothing is in flight or wanted; raises a claim failure at the end."""
        try:
            while True:
                self.start_handed()
                if self.turn is None:
                    self.start_turn()
                if self.turn is None and not self.sending and not self.finished:
                    break
                await self.wait()
                self.finish_turn()
        except BaseException:
            # Cancelled (shutdown): rows still in flight keep their send lease; its expiry
            # makes posts deliveryUnknown, never a second post.
            for task in (*self.sending, self.turn):
                if task is not None:
                    task.cancel()
            raise
        finally:
            self.relay.set_active(0)
        if self.failure is not None:
            raise self.failure
        return self.claimed

    def start_handed(self) -> None:
        """Start sending what this process handed over (within the run's row budget)."""
        if self.claimed >= self.relay.max_rows_per_run:
            return
        handed = self.relay.take_handed()
        self.claimed += len(handed)
        for row in handed:
            self._start(row)

    def start_turn(self) -> None:
        """Start a database turn when there is something to claim or to commit."""
        if self.relay.take_poke():
            self.more = True
        relay = self.relay
        want = (
            self.more
            and self.failure is None
            and self.claimed < relay.max_rows_per_run
            and len(self.sending) < self.high_water
        )
        # Outcomes linger a little to be committed in larger groups (the post already
        # happened; only its bookkeeping waits): fewer writer turns leave the database
        # to approvals.
        commit_now = bool(self.finished) and (
            want
            or len(self.finished) >= max(1, relay.batch // 4)
            or self.loop.time() - self.oldest >= COMMIT_LINGER_S
        )
        if not (want or commit_now):
            return
        self.turn_limit = min(self.claim_max, relay.max_rows_per_run - self.claimed) if want else 0
        group, self.finished = self.finished, []
        self.turn = asyncio.create_task(relay.turn(group, self.turn_limit))
        self.turn.add_done_callback(lambda _: self.progress.set())

    async def wait(self) -> None:
        """Until a send or the turn finishes, or lingering outcomes are due a commit."""
        if self.turn is None and self.finished:
            linger = self.oldest + COMMIT_LINGER_S - self.loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), timeout=max(0.0, linger))
        else:
            await self.progress.wait()
        self.progress.clear()

    def finish_turn(self) -> None:
        """Take a finished turn's claimed rows (a failed claim ends the run later)."""
        if self.turn is None or not self.turn.done():
            return
        task, self.turn = self.turn, None
        try:
            rows = task.result()
        except Exception as exc:
            # Claiming failed (outcomes were committed apart, see Relay.turn): finish
            # what is in flight, then report.
            self.failure = exc
            return
        if not self.turn_limit:
            return
        self.claimed += len(rows)
        self.more = len(rows) >= self.turn_limit
        if not rows:
            self.relay.claimed_none()
        for row in rows:
            self._start(row)

    def _start(self, row: Delivery) -> None:
        send = asyncio.create_task(self.relay.deliver(row))
        self.sending.add(send)
        self.relay.set_active(len(self.sending))
        send.add_done_callback(self._send_done)

    def _send_done(self, task: asyncio.Task[Done]) -> None:
        self.sending.discard(task)
        self.relay.set_active(len(self.sending))
        if not task.cancelled():
            if not self.finished:
                self.oldest = self.loop.time()
            self.finished.append(task.result())  # deliver never raises
        self.progress.set()
