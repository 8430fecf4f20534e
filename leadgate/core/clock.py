"""Injectable time and id sources.

Everything that reads the time or makes an id takes one of these, so tests move time
forward by hand (the 20-minute review lease, the 7-day abandonment) instead of sleeping.
Times are integer milliseconds since the epoch: portable between SQLite and PostgreSQL
and cheap to compare inside fenced ``UPDATE ... WHERE`` clauses.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from datetime import UTC, datetime
from typing import Protocol, overload

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS


class Clock(Protocol):
    """Source of the current time in epoch milliseconds."""

    def now_ms(self) -> int: ...


class SystemClock:
    """The wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class FakeClock:
    """A clock that moves only when told to (for tests)."""

    def __init__(self, start_ms: int = 1_780_000_000_000) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self._now += ms


class IdFactory(Protocol):
    """Makes unique, url-safe ids with a readable prefix (``wi_...``)."""

    def new(self, prefix: str) -> str: ...


class RandomIds:
    """Time-ordered random ids: prefix, 16 hex digits of nanoseconds, 40 random bits.

    Sorting by id therefore follows creation order (transcripts rely on it when two
    rows share a millisecond). The random bits come from ``os.urandom`` in 4 KiB batches:
    a turn makes several ids, and one system call each was measurable.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._random = b""
        self._pos = 0

    def new(self, prefix: str) -> str:
        with self._lock:
            pos = self._pos
            if pos + 5 > len(self._random):
                self._random, pos = os.urandom(4095), 0
            self._pos = pos + 5
            bits = self._random[pos : pos + 5]
        return f"{prefix}_{time.time_ns():016x}{bits.hex()}"


class SequentialIds:
    """Predictable ids for tests: ``wi_000001``..."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def new(self, prefix: str) -> str:
        return f"{prefix}_{next(self._counter):06d}"


@overload
def iso(ms: int) -> str: ...
@overload
def iso(ms: None) -> None: ...
@overload
def iso(ms: int | None) -> str | None: ...
def iso(ms: int | None) -> str | None:
    """Render epoch milliseconds as an ISO 8601 UTC timestamp (``None`` passes)."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")
