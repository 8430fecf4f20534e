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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("leadgate.events")

#: Callback of :meth:`EventHub.watch`: ``(session_id, has_message)``.
Watcher = Callable[[str, bool], None]


class Waiter:
    """One reader's wake-up flag for one session."""

    __slots__ = ("event", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.event = asyncio.Event()


class EventHub:
    """Per-process registry of readers waiting for sessions' events."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[Waiter]] = {}
        self._watchers: list[Watcher] = []
        #: Set when the process shuts down: readers end their streams.
        self.closing = asyncio.Event()

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

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call ``watcher(session_id, has_message)`` on every wake-up (MCP resource
        subscriptions); returns the function that stops it."""
        self._watchers.append(watcher)

        def stop() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

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
            except Exception:  # one broken watcher must not stop the others
                log.exception("session event watcher failed")

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
