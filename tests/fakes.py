"""Fakes of the core's small ports, shared by the adapter tests (not mocks: they keep
the state a test asserts on)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from bots.base import Adapter
from leadgate.core.errors import Unavailable
from leadgate.core.types import Inbound, Outcome, Recorded, Reply, Routed, RouteMatch, Trigger

RouteFn = Callable[[str, Mapping[str, str]], RouteMatch | None]


class FakeCore:
    """:class:`bots.base.Core` that records what an adapter asks of it.

    ``routes`` is a list of ``(match, route)`` pairs (exact match on the given keys, first
    wins) or a function ``(channel, attrs) -> route``. ``submit`` (the turn) records the
    trigger, waits for ``gate`` (set by default) and ``submit_delay_s``, and answers
    ``outcome``.
    """

    def __init__(
        self,
        routes: list[tuple[dict[str, str], RouteMatch]] | RouteFn | None = None,
        *,
        outcome: Outcome | None = None,
        submit_delay_s: float = 0.0,
    ) -> None:
        self.routes = routes if routes is not None else []
        self.outcome: Outcome = outcome if outcome is not None else Reply("fine")
        self.submit_delay_s = submit_delay_s
        self.lookups: list[tuple[str, dict[str, str]]] = []
        self.triggers: list[Trigger] = []
        self.submitted = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()
        self.tasks: list[asyncio.Task[object]] = []
        self.recorded: list[Inbound] = []

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        self.lookups.append((channel, dict(attrs)))
        if callable(self.routes):
            return self.routes(channel, attrs)
        for match, route in self.routes:
            if all(attrs.get(k) == v for k, v in match.items()):
                return route
        return None

    async def submit(self, trigger: Trigger) -> Outcome:
        self.triggers.append(trigger)
        self.submitted.set()
        await self.gate.wait()
        await asyncio.sleep(self.submit_delay_s)
        return self.outcome

    async def take_inbound(self, inbound: Inbound) -> Routed | None:
        recorded = await self.record_inbound(inbound)
        return None if recorded is None else await self.run_recorded(recorded)

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        """Route (the fake's "record"); the trigger is submitted by run_recorded."""
        route = await self.resolve_route(inbound.channel.value, inbound.route_attrs)
        if route is None:
            return None
        self.recorded.append(inbound)
        return Recorded(route, turn=inbound.trigger(route))

    async def run_recorded(self, recorded: Recorded) -> Routed | None:
        return Routed(await self.submit(recorded.turn), recorded.route)

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        async def run() -> object:
            return await coro

        self.tasks.append(asyncio.create_task(run(), name=name))

    async def drain(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=5)

    @property
    def route_queries(self) -> list[dict[str, str]]:
        """The attributes of every route look-up, in order."""
        return [attrs for _, attrs in self.lookups]


def mount_adapter(app: web.Application, adapter: Adapter) -> None:
    """Mount ``adapter`` on ``app`` the way the composition root does: its routes, its
    lifespan for the app's lifetime, and its channel closed at the end."""
    adapter.mount(app)

    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        async with adapter.lifespan():
            yield
        await adapter.channel.close()

    app.cleanup_ctx.append(ctx)


class DownFor:
    """``Database.read``/``tx`` replaced for the next ``n`` calls: the call's own work
    runs (or not, ``before``) and then the database is "gone" (Unavailable)."""

    def __init__(self, real: Callable[[], Any], n: int, *, after_commit: bool) -> None:
        self.real, self.n, self.after_commit = real, n, after_commit

    def __call__(self) -> Any:
        if self.n == 0:
            return self.real()
        self.n -= 1
        real, after = self.real, self.after_commit

        class _Ctx:
            async def __aenter__(self) -> Any:
                if not after:
                    raise Unavailable("database down", rule="service.unavailable")
                self.inner = real()
                return await self.inner.__aenter__()

            async def __aexit__(self, *exc: Any) -> None:
                await self.inner.__aexit__(*exc)
                if exc[0] is None:  # committed, but the caller is told otherwise
                    raise Unavailable("connection lost at COMMIT", rule="service.unavailable")

        return _Ctx()


class DownAloneFor:
    """``Database.write_alone`` replaced for the next ``n`` calls, as :class:`DownFor`:
    the statement runs (or not, ``before``) and then the database is "gone"."""

    def __init__(self, real: Callable[..., Any], n: int, *, after_commit: bool) -> None:
        self.real, self.n, self.after_commit = real, n, after_commit

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.n == 0:
            return await self.real(*args, **kwargs)
        self.n -= 1
        if not self.after_commit:
            raise Unavailable("database down", rule="service.unavailable")
        await self.real(*args, **kwargs)
        raise Unavailable("connection lost at COMMIT", rule="service.unavailable")


def lose_the_next_commit(monkeypatch: Any, db: Any, *, alone: bool) -> None:
    """The next write of ``db`` commits and its caller is told the connection dropped at
    COMMIT (Unavailable): the next ``write_alone`` statement when ``alone`` (a write
    PostgreSQL runs as one statement), else the next ``tx``."""
    if alone:
        monkeypatch.setattr(db, "write_alone", DownAloneFor(db.write_alone, 1, after_commit=True))
    else:
        monkeypatch.setattr(db, "tx", DownFor(db.tx, 1, after_commit=True))
