"""A small framework for background runners (lead review, relay, sweeper, revisions).

A runner has ``run_once() -> bool`` (claim with a lease, do the work, commit fenced;
True when it did something). :func:`run_loop` repeats it, sleeping on a wake event with
a slow poll as the safety net; :func:`drain` is burst mode: run until there is nothing
left to do and return (tests, ``leadgate`` one-shot commands).

Runners are woken through callables handed over at construction: whoever makes work
for a runner gets the ``set`` of that runner's wake event (the composition root,
:mod:`leadgate.app`, wires them), never a name to look up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from leadgate.core.errors import DatabaseDamaged, Unavailable
from leadgate.core.logs import Tally

log = logging.getLogger("leadgate.runners")

#: Every runner's passes that met a damaged database: one ERROR line a minute at
#: most across them all (each of a dozen loops logged a traceback per pass).
DAMAGED = Tally(
    log,
    "%d runner pass(es) met a damaged database (the latest: %s): %s; retrying",
    every_s=60.0,
    level=logging.ERROR,
)


class Runner(Protocol):
    """One kind of background work."""

    name: str

    async def run_once(self) -> bool:
        """Do one unit (or batch) of work; True when there was any."""
        ...


class Lost(NamedTuple):
    """A lease token :class:`LostClaims` watches."""

    #: the claim's lease token (or the id of a row written claimed under a token the
    #: runner shares among its rows: the relay's hand-off)
    token: str
    #: when it is looked for next (the runner's clock, ms)
    due: int
    #: how long after that look the one after it comes
    gap: int
    #: when the claim's lease would lapse, had it landed: the watch ends there
    lapses: int


class LostClaims:
    """Lease tokens of claims whose write met a database fault in doubt and that were
    not found landed. One may land all the same after the look that found nothing: the
    server can still apply a statement (or a ``COMMIT``) whose connection the runner
    already took for lost, after a read or a release on a fresh connection raced it, and
    the rows would then sit under a token nobody holds until its lease lapsed. So each
    token is looked for again :attr:`first_ms` after, then at gaps that double up to
    :attr:`max_gap_ms`, until the claim's lease would have lapsed (the runner's lease
    expiry takes such rows from there). The runner gives back whatever holds a token it
    finds, fenced by that token. Only a fault adds a token: a claim that answered costs
    nothing here. Shared by a runner's loops: :meth:`take_due` hands each token to one."""

    def __init__(self, first_ms: int = 1_000, max_gap_ms: int = 60_000) -> None:
        self.first_ms = first_ms
        self.max_gap_ms = max_gap_ms
        self._lost: list[Lost] = []

    def __bool__(self) -> bool:
        return bool(self._lost)

    def watch(self, token: str, *, due: int, lapses: int) -> None:
        """Look for ``token`` at ``due`` (then as the class says), until ``lapses``."""
        self._lost.append(Lost(token, due, self.first_ms, lapses))

    def take_due(self, now: int) -> list[Lost]:
        """The tokens due for a look at ``now``, taken out: each goes back by
        :meth:`not_found` or :meth:`put_back`, or is done with (found)."""
        due = [lost for lost in self._lost if lost.due <= now]
        if due:
            self._lost = [lost for lost in self._lost if lost.due > now]
        return due

    def not_found(self, lost: Lost, now: int) -> None:
        """``lost`` was looked for at ``now`` and not found: look again one gap on, at
        twice the gap after (capped), unless its lease would have lapsed by then."""
        if now + lost.gap <= lost.lapses:
            gap = min(2 * lost.gap, self.max_gap_ms)
            self._lost.append(lost._replace(due=now + lost.gap, gap=gap))

    def put_back(self, lost: Sequence[Lost]) -> None:
        """Tokens taken for a look that failed (the database away): due as before."""
        self._lost.extend(lost)

    def next_due(self) -> int | None:
        """When the next look is due (None: no token watched)."""
        return min((lost.due for lost in self._lost), default=None)


async def drain(runner: Runner, *, max_rounds: int = 10_000) -> int:
    """Burst mode: repeat ``run_once`` until it finds nothing; returns the rounds worked."""
    worked = 0
    while worked < max_rounds and await runner.run_once():
        worked += 1
    return worked


async def run_loop(
    runner: Runner,
    *,
    wake: asyncio.Event,
    stop: asyncio.Event,
    poll_s: float,
    due_s: Callable[[], float | None] | None = None,
) -> None:
    """Run ``runner`` until ``stop`` is set; never dies on an error (logs and backs off).

    Between passes that found nothing it sleeps until ``wake`` is set, or for ``poll_s``,
    or (``due_s``) for as long as the runner says its next known work is away, when that
    is sooner: work that falls due with time (a retry after a 429's ``Retry-After``) is
    done when due, as no commit is there to wake the runner then."""
    failures = 0
    while not stop.is_set():
        # Clear before working, not after: a wake that arrives while run_once runs (after
        # its last claim found nothing) must not be lost until the next poll.
        wake.clear()
        try:
            busy = await runner.run_once()
            failures = 0
        except Unavailable as exc:
            # The database is busy, full or down: back off (capped low, so the runner
            # resumes within seconds of the fault's end) and say so without a traceback.
            failures += 1
            log.warning(
                "runner %s: database unavailable (%s: %s); retrying",
                runner.name,
                exc.rule,
                exc.detail,
            )
            busy = False
            # Stopping does not wait out the back-off.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(5.0, 0.25 * 2**failures))
        except DatabaseDamaged as exc:
            # Only restoring the file ends it: back off as far as for a bug, but say
            # what it is (naming the file) without a traceback, and stop at once when
            # asked (the operator stops the service to restore the file).
            failures += 1
            DAMAGED.add(runner.name, exc.detail)
            busy = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(30.0, 0.5 * 2**failures))
        except Exception:
            failures += 1
            log.exception("runner %s failed (%d in a row)", runner.name, failures)
            busy = False
            await asyncio.sleep(min(30.0, 0.5 * 2**failures))
        if busy:
            continue
        timeout = poll_s
        due = None if due_s is None else due_s()
        if due is not None:
            timeout = max(0.0, min(poll_s, due))
        with contextlib.suppress(TimeoutError):
            waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
