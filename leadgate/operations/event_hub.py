"""Waking the readers of session event logs: SSE streams, MCP subscriptions, Studio.

Readers never receive events from here, only a wake-up: they read the durable log
themselves (:mod:`leadgate.domain.session_events`) from their last position, so a
missed or repeated wake-up can cost a query, never an event. That keeps every
per-connection buffer bounded by what the reader itself fetched.

Wake-ups come from the after-commit topic of this process's transactions
(:meth:`EventHub.committed`) and, on PostgreSQL, from ``LISTEN`` on the log's NOTIFY
channel (:meth:`EventHub.notified`, on the process's one listener connection: see
:func:`outbox.store.listen_all`), so a stream on one replica hears writes on every other.
After a (re)connection of that listener every reader is woken once, as a notification
may have been missed while it was down; SSE streams also re-read on their heartbeat, which
covers writes of other processes on SQLite (the admin CLI) as well.

On PostgreSQL writers NOTIFY a session's events only while the session is *watched*
(``sessions.watched_until``, see :mod:`leadgate.domain.session_events`): a reader calls
:meth:`EventHub.keep_notified` before its first read of the log, which returns once the
session's mark is committed, and the hub renews the marks of every session read here
(SSE waiters and the sessions of each :meth:`EventHub.watch` source) every
:data:`~leadgate.domain.session_events.WATCH_RENEW_S` (:meth:`EventHub.renew_forever`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from leadgate.core.errors import log_failure
from leadgate.core.logs import loggable
from leadgate.domain.session_events import WATCH_RENEW_S

log = logging.getLogger("leadgate.events")

#: Callback of :meth:`EventHub.watch`: ``(session_id, has_message)``.
Watcher = Callable[[str, bool], None]
#: Marks sessions watched, committed when it returns (PostgreSQL:
#: :func:`leadgate.domain.session_events.mark_watched`).
Mark = Callable[[Sequence[str]], Awaitable[None]]
#: Sessions per renewal statement at most.
RENEW_CHUNK = 1000


class Waiter:
    """One reader's wake-up flag for one session."""

    __slots__ = ("event", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.event = asyncio.Event()


class EventHub:
    """Per-process registry of readers waiting for sessions' events."""

    def __init__(
        self,
        mark: Mark | None = None,
        *,
        renew_s: float = WATCH_RENEW_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._waiters: dict[str, set[Waiter]] = {}
        self._watchers: list[Watcher] = []
        self._sources: list[Callable[[], Iterable[str]]] = []
        #: Set when the process shuts down: readers end their streams.
        self.closing = asyncio.Event()
        #: marks sessions watched (PostgreSQL); None where nothing NOTIFYs (SQLite)
        self.mark = mark
        self.renew_s = renew_s
        self._monotonic = monotonic
        # session id -> (when its mark was asked for, the mark): readers of one session
        # arriving together wait for the same statement.
        self._marks: dict[str, tuple[float, asyncio.Future[None]]] = {}

    async def keep_notified(self, session_id: str) -> None:
        """Make sure every replica's writes to ``session_id`` are NOTIFYed (PostgreSQL;
        nothing to do elsewhere): returns once its mark is committed, so a reader that
        reads the log after this call misses no wake-up. A mark younger than
        :attr:`renew_s` is trusted (it holds four times as long). Database errors
        propagate (the reader answers 503); the next call tries again."""
        if self.mark is None:
            return
        now = self._monotonic()
        known = self._marks.get(session_id)
        if known is None or now - known[0] >= self.renew_s or _failed(known[1]):
            future = asyncio.ensure_future(self.mark([session_id]))
            known = self._marks[session_id] = (now, future)
        await asyncio.shield(known[1])

    async def renew(self) -> None:
        """Renew the marks of every session read here (waiters and watch sources), and
        forget the marks of sessions nobody here reads any more (theirs run out)."""
        if self.mark is None:
            return
        read = set(self._waiters)
        for source in self._sources:
            read.update(source())
        for gone in set(self._marks) - read:
            del self._marks[gone]
        sessions = sorted(read)
        now = self._monotonic()
        for start in range(0, len(sessions), RENEW_CHUNK):
            chunk = sessions[start : start + RENEW_CHUNK]
            future = asyncio.ensure_future(self.mark(chunk))
            for session_id in chunk:
                self._marks[session_id] = (now, future)
            await future

    async def renew_forever(self, stop: asyncio.Event) -> None:
        """:meth:`renew` every :attr:`renew_s` until ``stop`` (a failed renewal is
        logged; the next one catches up, and meanwhile streams re-read on heartbeat)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.renew_s)
                return
            except TimeoutError:
                pass
            try:
                await self.renew()
            except Exception as exc:
                log_failure(log, exc, "renewing watched sessions failed")

    def subscribe(self, session_id: str) -> Waiter:
        """A waiter woken whenever ``session_id`` has new events (:meth:`unsubscribe`
        it when done)."""
        waiter = Waiter(session_id)
        self._waiters.setdefault(session_id, set()).add(waiter)
        return waiter

    def unsubscribe(self, waiter: Waiter) -> None:
        """Forget ``waiter`` (idempotent)."""
        waiters = self._waiters.get(waiter.session_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.session_id]

    def watch(
        self, watcher: Watcher, sessions: Callable[[], Iterable[str]] | None = None
    ) -> Callable[[], None]:
        """Call ``watcher(session_id, has_message)`` on every wake-up (MCP resource
        subscriptions); ``sessions`` says which sessions it reads now (their marks are
        renewed; call :meth:`keep_notified` when one is added). Returns the function
        that stops it."""
        self._watchers.append(watcher)
        if sessions is not None:
            self._sources.append(sessions)

        def stop() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            if sessions is not None and sessions in self._sources:
                self._sources.remove(sessions)

        return stop

    @property
    def readers(self) -> int:
        """Waiting readers (all sessions)."""
        return sum(len(w) for w in self._waiters.values())

    def wake(self, session_id: str, has_message: bool) -> None:
        """``session_id`` has new events."""
        for waiter in self._waiters.get(session_id, ()):
            waiter.event.set()
        for watcher in list(self._watchers):
            try:
                watcher(session_id, has_message)
            except Exception as exc:  # one broken watcher must not stop the others
                log.error("session event watcher failed", exc_info=loggable(exc))

    def wake_all(self) -> None:
        """Wake every reader (a notification may have been missed)."""
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.event.set()

    def committed(self, payloads: list[Any]) -> None:
        """After-commit listener of :data:`leadgate.domain.session_events.TOPIC`."""
        for session_id, has_message in payloads:
            self.wake(session_id, has_message)

    def notified(self, payload: str) -> None:
        """A NOTIFY payload (``"<session_id> <m|r>"``) from any replica."""
        session_id, _, kind = payload.partition(" ")
        if session_id:
            self.wake(session_id, kind == "m")

    def close(self) -> None:
        """Shutting down: every waiting reader wakes up and ends."""
        self.closing.set()
        self.wake_all()


def _failed(future: asyncio.Future[None]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
