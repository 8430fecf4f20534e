"""Console login guard: attempts per address and per account, and password-check slots.

Why each piece (an unauthenticated login flood must not stall the service):

* **Counted before the password check.** :meth:`LoginGuard.admit` checks both windows and
  counts the attempt in one step with no await in between, so a concurrent flood cannot
  slip past the limit while earlier attempts are still being checked: an attempt in
  flight counts. A correct password gives its slot back afterwards (only failures keep
  counting); every attempt past the limit is refused, the right password included.
* **Both keys.** Per client address (one source trying many accounts) and per account
  (many sources trying one account: the account is then locked for the window, which is
  the price of stopping the guessing).
* **A correct Retry-After.** The seconds until the window has room again for *both*
  keys, not a constant.
* **Bounded password checks.** argon2 costs tens of milliseconds of CPU and memory by
  design. At most :data:`CHECK_SLOTS` run at once (in worker threads, never on the event
  loop, never inside a database transaction); at most :data:`CHECK_QUEUE` more wait, and
  anything beyond is answered 503 at once instead of queueing without bound.

Memory is bounded: at most :data:`MAX_KEYS` addresses and accounts are remembered.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from leadgate.core.clock import Clock
from leadgate.core.errors import RateLimited, Unavailable

LOGIN_LIMIT = 10
LOGIN_WINDOW_MS = 60_000
CHECK_SLOTS = 1
CHECK_QUEUE = 16
MAX_KEYS = 10_000


@dataclass(frozen=True)
class Ticket:
    """One admitted attempt (its place in both windows)."""

    address: str
    account: str
    at_ms: int


class LoginGuard:
    """See the module docstring."""

    def __init__(
        self,
        clock: Clock,
        *,
        limit: int = LOGIN_LIMIT,
        window_ms: int = LOGIN_WINDOW_MS,
        slots: int = CHECK_SLOTS,
        queue: int = CHECK_QUEUE,
    ) -> None:
        self.clock = clock
        self.limit = limit
        self.window_ms = window_ms
        self._windows: collections.OrderedDict[str, collections.deque[int]] = (
            collections.OrderedDict()
        )
        self._slots = asyncio.Semaphore(slots)
        self._queue = queue
        self._waiting = 0

    def _recent(self, key: str, now: int) -> collections.deque[int]:
        times = self._windows.get(key)
        if times is None:
            times = self._windows[key] = collections.deque()
            while len(self._windows) > MAX_KEYS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        horizon = now - self.window_ms
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def _wait_s(self, times: collections.deque[int], now: int) -> int:
        if len(times) < self.limit:
            return 0
        # The attempt that must leave the window before there is room for one more.
        freed_at = times[len(times) - self.limit] + self.window_ms
        return max(1, -(-(freed_at - now) // 1000))

    def admit(self, address: str, email: str) -> Ticket:
        """Count one attempt for ``address`` and ``email`` or raise :class:`RateLimited`
        (its ``retry_after_s`` says when both have room again)."""
        now = self.clock.now_ms()
        account = "acct:" + email.strip().lower()[:320]
        by_address = self._recent("addr:" + address, now)
        by_account = self._recent(account, now)
        wait = max(self._wait_s(by_address, now), self._wait_s(by_account, now))
        if wait:
            raise RateLimited(
                f"too many login attempts; try again in {wait} seconds",
                rule="console.login_rate",
                retry_after_s=wait,
            )
        by_address.append(now)
        by_account.append(now)
        return Ticket("addr:" + address, account, now)

    def succeeded(self, ticket: Ticket) -> None:
        """A correct password: its attempt no longer counts against either key."""
        for key in (ticket.address, ticket.account):
            times = self._windows.get(key)
            if times is not None:
                try:
                    times.remove(ticket.at_ms)
                except ValueError:
                    pass

    @asynccontextmanager
    async def check_slot(self) -> AsyncIterator[None]:
        """A slot for one password check (503 at once when too many are waiting)."""
        if self._slots.locked() and self._waiting >= self._queue:
            raise Unavailable(
                "too many logins are being checked; try again in a moment",
                rule="console.login_busy",
                retry_after_s=1,
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()
