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
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

from leadgate.core.errors import DatabaseDamaged, Unavailable
from leadgate.core.logs import Tally, loggable

log = logging.getLogger("leadgate.runners")

#: Every runner's passes that met a damaged database: one ERROR line a minute at
#: most across them all (each of a dozen loops logged a traceback per pass).
DAMAGED = Tally(
    log,
    "%d runner pass(es) met a damaged database (the latest: %s): %s; retrying",
    every_s=60.0,
    level=logging.ERROR,
)


def after_lapse(lapse: int | None) -> int | None:
    """When a lease the last pass saw lapsing at ``lapse`` (ms) can be taken: once the
    clock is past it (the claims compare with ``<``), never earlier, so a loop that
    sleeps toward it never spins. None for None."""
    return None if lapse is None else lapse + 1


#: PostgreSQL: how soon a runner whose claim took nothing while its work was there, row
#: locked by another transaction, claims again (the lead review, the relay, the revision
#: dispatcher and the flow resumer). No commit may come to wake it: a fenced move that
#: lost its race for a row keeps the row lock to the end of its transaction (PostgreSQL's
#: row locks outlive a failed recheck of ``WHERE``), and no wake-up follows that end.
LOCKED_RECHECK_MS = 50

#: PostgreSQL: the longest a runner leaves work whose row another transaction held
#: before it tries that work again (the flow resumer's continuations, the SLA runner's
#: episodes). The wait starts at :data:`LOCKED_RECHECK_MS` and doubles at each try that
#: meets the row held again, up to this: a long transaction holding the row costs a try
#: (a few statements) a second, and the work is done within a second of its end.
LEFT_AT_MOST_MS = 1_000


class Left(NamedTuple):
    """Work a runner left because another transaction held its row: when it is tried
    again (``due``, the runner's clock, ms) and how long it waited for that (``gap``)."""

    due: int
    gap: int


def leave(before: Left | None, now: int) -> Left:
    """Work whose row was held at ``now`` is left: :data:`LOCKED_RECHECK_MS` the first
    time (``before`` None), else twice as long as ``before`` waited, up to
    :data:`LEFT_AT_MOST_MS`."""
    gap = LOCKED_RECHECK_MS if before is None else min(2 * before.gap, LEFT_AT_MOST_MS)
    return Left(now + gap, gap)


def seconds_until(now_ms: int, *dues: int | None) -> float | None:
    """What a runner's ``due_in_s`` answers: seconds from ``now_ms`` to the soonest of
    ``dues`` (ms; None: nothing due that way), 0 when one has come, None when none is
    due (the loop then sleeps the poll)."""
    soonest = min((due for due in dues if due is not None), default=None)
    return None if soonest is None else max(0.0, (soonest - now_ms) / 1000)


class Runner(Protocol):
    """One kind of background work."""

    name: str

    async def run_once(self) -> bool:
        """Do one unit (or batch) of work; True when there was any."""
        ...


T = TypeVar("T")

#: The most tokens one :class:`LostClaims` watches. Only a fault in doubt adds one, and a
#: runner's passes stop at their first failed look, so a watch stays small even through
#: an outage; but the keyed requests of an API (Idempotency) each add one whose claim
#: was in doubt, however many there are. Past this many, the token whose lease lapses
#: soonest is dropped (its lease expiry takes its rows back; logged, counted).
MAX_WATCHED = 10_000

#: Tokens a full watch dropped: one WARNING a minute at most across every watch.
DROPPED = Tally(
    log,
    "%d claim(s) in doubt no longer looked for (the watch of %s is full, %d tokens): "
    "their rows wait for their lease to lapse",
    every_s=60.0,
)


class Lost(NamedTuple, Generic[T]):
    """A lease token :class:`LostClaims` watches."""

    #: the claim's lease token (or the id of a row written claimed under a token the
    #: runner shares among its rows: the relay's hand-off), or whatever names and fences
    #: its give-back (an Idempotency-Key claim's key and owner)
    token: T
    #: when it is looked for next (the runner's clock, ms)
    due: int
    #: how long after that look the one after it comes
    gap: int
    #: when the claim's lease would lapse, had it landed: the watch ends there
    lapses: int


class LostClaims(Generic[T]):
    """Lease tokens of claims whose write met a database fault in doubt and that were
    not found landed. One may land all the same after the look that found nothing: the
    server can still apply a statement (or a ``COMMIT``) whose connection the runner
    already took for lost, after a read or a release on a fresh connection raced it, and
    the rows would then sit under a token nobody holds until its lease lapsed. So each
    token is looked for again :attr:`first_ms` after, then at gaps that double up to
    :attr:`max_gap_ms`, until the claim's lease would have lapsed (the runner's lease
    expiry takes such rows from there). The runner gives back whatever holds a token it
    finds, fenced by that token. Only a fault adds a token: a claim that answered costs
    nothing here. Shared by a runner's loops: :meth:`take_due` hands each token to one,
    which gives it back (:meth:`not_found`, :meth:`put_back`) unless it found it, also
    when its look ends in an exception (cancellation too). At most ``limit`` tokens
    (:data:`MAX_WATCHED`) are watched, kept in order of their next look: a pass with
    nothing due reads one entry. ``on_watch`` is called when a token is added
    (:meth:`watch`): the runner that looks for them may be asleep. ``keep``: the tokens
    a full watch never drops, as what only the watch holds would be lost with them (an
    Idempotency-Key answer to store): their caller asks :meth:`has_room` before it
    watches one, which counts those out for a look as well, so that one coming back
    (:meth:`put_back`) always finds a token it may drop in a full watch, and the watch
    stays within its limit; a kept token done with after its look (stored, or given
    up) is said so (:meth:`done`), or it kept its room."""

    def __init__(
        self,
        first_ms: int = 1_000,
        max_gap_ms: int = 60_000,
        *,
        name: str = "a runner",
        limit: int = MAX_WATCHED,
        on_watch: Callable[[], None] = lambda: None,
        keep: Callable[[T], bool] = lambda token: False,
    ) -> None:
        self.first_ms = first_ms
        self.max_gap_ms = max_gap_ms
        self.name = name
        self.limit = limit
        self.on_watch = on_watch
        self.keep = keep
        #: tokens dropped because the watch was full
        self.dropped = 0
        #: the tokens ``keep`` holds, watched or out for a look (:meth:`has_room`)
        self.kept = 0
        #: a heap by next look; the sequence number keeps tokens (of any type) apart
        self._lost: list[tuple[int, int, Lost[T]]] = []
        self._seq = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._lost)

    def __len__(self) -> int:
        return len(self._lost)

    def __iter__(self) -> Iterator[Lost[T]]:
        """The tokens watched, in no order (those taken for a look not among them)."""
        return (entry[2] for entry in self._lost)

    def watch(self, token: T, *, due: int, lapses: int, wake: bool = True) -> None:
        """Look for ``token`` at ``due`` (then as the class says), until ``lapses``.
        ``wake`` false: not ``on_watch`` (the caller is a pass of the runner that looks,
        whose loop weighs :meth:`next_due` once the pass ends; woken, it ran a pass more,
        one read, for nothing)."""
        if self.keep(token):
            self.kept += 1
        self._add(Lost(token, due, self.first_ms, lapses))
        if wake:
            self.on_watch()

    def take_due(self, now: int) -> list[Lost[T]]:
        """The tokens due for a look at ``now``, taken out: each goes back by
        :meth:`not_found` or :meth:`put_back`, or is done with (found; one ``keep``
        holds: :meth:`done`)."""
        due: list[Lost[T]] = []
        while self._lost and self._lost[0][0] <= now:
            due.append(heapq.heappop(self._lost)[2])
        return due

    def not_found(self, lost: Lost[T], now: int) -> None:
        """``lost`` was looked for at ``now`` and not found: look again one gap on, at
        twice the gap after (capped), unless its lease would have lapsed by then."""
        if now + lost.gap <= lost.lapses:
            gap = min(2 * lost.gap, self.max_gap_ms)
            self._add(lost._replace(due=now + lost.gap, gap=gap))
        else:
            self.done(lost)

    def done(self, lost: Lost[T]) -> None:
        """``lost``, taken for a look, leaves the watch (found, or given up): a token
        ``keep`` holds no longer takes room (:meth:`has_room`). Nothing for another."""
        if self.keep(lost.token):
            self.kept -= 1

    def put_back(self, lost: Sequence[Lost[T]]) -> None:
        """Tokens taken for a look that failed (the database away) or never came (an
        exception before it): due as before."""
        for each in lost:
            self._add(each)

    def next_due(self) -> int | None:
        """When the next look is due (None: no token watched)."""
        return self._lost[0][0] if self._lost else None

    def has_room(self) -> bool:
        """Whether a token ``keep`` holds can be watched now: fewer than ``limit`` are,
        counting those out for a look (a full watch then holds a token it may drop for
        it, also when those come back). Counting only those in hand, an answer watched
        while another was out for a look took the watch past its limit when that one
        came back."""
        return self.kept < self.limit

    def _add(self, lost: Lost[T]) -> None:
        if len(self._lost) >= self.limit:
            # Full (a long outage under load): the token whose lease lapses soonest goes,
            # this one or a watched one; its lease expiry takes its rows back. Never one
            # ``keep`` holds: only the watch has what it stands for.
            droppable = [i for i in range(len(self._lost)) if not self.keep(self._lost[i][2].token)]
            index = min(droppable, key=lambda i: self._lost[i][2].lapses, default=None)
            if not self.keep(lost.token) and (
                index is None or self._lost[index][2].lapses >= lost.lapses
            ):
                self._dropped()
                return
            if index is not None:
                self._dropped()
                self._lost[index] = self._lost[-1]
                self._lost.pop()
                heapq.heapify(self._lost)
        heapq.heappush(self._lost, (lost.due, next(self._seq), lost))

    def _dropped(self) -> None:
        self.dropped += 1
        DROPPED.add(self.name, len(self._lost))


async def drain(runner: Runner, *, max_rounds: int = 10_000) -> int:
    """Burst mode: repeat ``run_once`` until it finds nothing; returns the rounds worked."""
    worked = 0
    while worked < max_rounds and await runner.run_once():
        worked += 1
    return worked


async def _back_off(
    seconds: float, stop: asyncio.Event, sleep: Callable[[float], Awaitable[None]]
) -> None:
    """Wait ``seconds`` by ``sleep``, or until ``stop`` is set if that is sooner."""
    if stop.is_set():
        return
    waiters = [asyncio.ensure_future(sleep(seconds)), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def run_loop(
    runner: Runner,
    *,
    wake: asyncio.Event,
    stop: asyncio.Event,
    poll_s: float,
    due_s: Callable[[], float | None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Run ``runner`` until ``stop`` is set; never dies on an error (logs and backs off).

    Between passes that found nothing it sleeps until ``wake`` is set, or for ``poll_s``,
    or (``due_s``) for as long as the runner says its next known work is away, when that
    is sooner: work that falls due with time (a retry after a 429's ``Retry-After``) is
    done when due, as no commit is there to wake the runner then. The back-off after a
    failed pass waits by ``sleep`` (tests: no real wait), and setting ``stop`` cuts it
    short."""
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
            await _back_off(min(5.0, 0.25 * 2**failures), stop, sleep)
        except DatabaseDamaged as exc:
            # Only restoring the file ends it: back off as far as for a bug, but say
            # what it is (naming the file) without a traceback, and stop at once when
            # asked (the operator stops the service to restore the file).
            failures += 1
            DAMAGED.add(runner.name, exc.detail)
            busy = False
            await _back_off(min(30.0, 0.5 * 2**failures), stop, sleep)
        except Exception as exc:
            failures += 1
            log.error(
                "runner %s failed (%d in a row)", runner.name, failures, exc_info=loggable(exc)
            )
            busy = False
            # Nor this one (up to 30 s): it held a stopping service's shutdown for its
            # SHUTDOWN_WAIT_S, the runner then left running.
            await _back_off(min(30.0, 0.5 * 2**failures), stop, sleep)
        if busy:
            continue
        timeout = poll_s
        due = None if due_s is None else due_s()
        if due is not None:
            timeout = max(0.0, min(poll_s, due))
        # (asyncio.wait returns at its timeout: nothing to catch.)
        waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
