"""Concurrent one-statement writes of one kind, sent to PostgreSQL as one statement.

On PostgreSQL a short write costs mostly what any statement costs, whatever it writes:
the send that wakes a backend, the protocol work on both sides, the executor's start and
the commit (session 26: 20 us in the client and 35 us in the backend for a one-row
INSERT, against 3 and 5 us per row when 16 rows go in one ``unnest`` statement). A
:class:`Grouped` lets callers that each write one item await their own write while the
items that arrive together go in one statement:

* A call that finds fewer than ``in_flight`` writes running runs its item alone at once
  (``run_alone``): an idle service waits for nothing.
* Otherwise the item queues. When a running write ends, the queued items (up to
  ``most``) go together (``run_many``), in a task of their own, so that no caller's
  cancellation can strand the others; a queued call that was cancelled is left out.
* ``run_many`` is one statement, atomic: every item is written or none is. It returns one
  result per item, in order, or an exception *instance* for an item it did not write
  (a session that does not exist, say): that caller gets the exception raised.
* When ``run_many`` raises a database fault (:func:`leadgate.database.faults.unavailable`),
  every item's caller gets it: the outcome is in doubt, as it is for a single write.
  Any other error belongs to the statement's input, and nothing was written: the items
  are then written alone, concurrently, so that an item the database refuses fails only
  its own caller.

Hand-rolled because no library offers it: asyncpg's ``executemany`` runs one statement
per item (only the round trips are saved, not the per-statement work) and returns no
rows.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from leadgate.database.faults import unavailable

T = TypeVar("T")
R = TypeVar("R")

#: Items one grouped statement writes at most (its arrays' length).
MOST = 64


class Grouped(Generic[T, R]):
    """Writes of one kind, grouped while ``in_flight`` of them run (see the module
    docstring)."""

    def __init__(
        self,
        run_alone: Callable[[T], Awaitable[R]],
        run_many: Callable[[Sequence[T]], Awaitable[Sequence[R | Exception]]],
        *,
        in_flight: int = 1,
        most: int = MOST,
    ) -> None:
        if in_flight < 1 or most < 2:
            raise ValueError("Grouped needs in_flight >= 1 and most >= 2")
        self._run_alone = run_alone
        self._run_many = run_many
        self._in_flight = in_flight
        self._most = most
        self._running = 0
        self._queue: deque[tuple[T, asyncio.Future[R]]] = deque()
        # Strong references: the event loop keeps only weak ones to tasks.
        self._tasks: set[asyncio.Task[None]] = set()
        #: Statements run (a refused group adds one per item, each then run alone) and
        #: items taken (each once): how well writes group, for tests and debugging.
        self.statements = 0
        self.items = 0

    async def __call__(self, item: T) -> R:
        """Write ``item``; returns what its write returned, or raises its error."""
        if self._running < self._in_flight and not self._queue:
            self._running += 1
            try:
                self.statements += 1
                self.items += 1
                return await self._run_alone(item)
            finally:
                self._done()
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        return await future

    def _done(self) -> None:
        self._running -= 1
        batch: list[tuple[T, asyncio.Future[R]]] = []
        while self._queue and len(batch) < self._most:
            queued = self._queue.popleft()
            if not queued[1].cancelled():
                batch.append(queued)
        if batch:
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._write(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            self.statements += 1
            self.items += len(batch)
            if len(batch) == 1:
                outcomes: Sequence[R | Exception] = [await _outcome(self._run_alone, batch[0][0])]
            else:
                try:
                    outcomes = await self._run_many([item for item, _ in batch])
                except Exception as exc:
                    if unavailable(exc) is not None:
                        raise
                    # Nothing was written (the statement is atomic and the database
                    # answered): each item alone, so that only a refused one fails.
                    self.statements += len(batch)
                    outcomes = await asyncio.gather(
                        *(_outcome(self._run_alone, item) for item, _ in batch)
                    )
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    if isinstance(exc, Exception):
                        future.set_exception(exc)
                    else:
                        future.cancel()
            if not isinstance(exc, Exception):
                raise
        finally:
            self._done()


async def _outcome(run: Callable[[T], Awaitable[R]], item: T) -> R | Exception:
    try:
        return await run(item)
    except Exception as exc:
        return exc
