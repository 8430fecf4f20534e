"""Background tasks that belong to the process: tracked, logged, awaited on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any

from leadgate.core.errors import log_failure

log = logging.getLogger("leadgate.tasks")


class Background:
    """Spawns tasks whose failures are logged and which :meth:`wait` awaits (bounded)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background."""

        async def wrapper() -> None:
            try:
                await coro
            except Exception as exc:
                log_failure(log, exc, "background task %s failed", name)

        self.track(asyncio.get_running_loop().create_task(wrapper(), name=name))

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` until it ends (and await it in :meth:`wait`)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every task, then cancel what is left."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=seconds)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    def __len__(self) -> int:
        return len(self._tasks)


@contextlib.asynccontextmanager
async def alongside(coro: Coroutine[Any, Any, None], *, name: str) -> AsyncIterator[None]:
    """Run ``coro`` (say, a lease's renewals) while the body runs; cancel it, and wait
    for it to end, when the body ends, however it ends."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
