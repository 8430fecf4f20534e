"""The composition root: builds every part of one leadgate process and owns its lifecycle.

:class:`App` wires configuration, the database, model providers, the turn path, the
outbox, the runners, the operations layer, the channel adapters and the HTTP surfaces
together. It is the only module that knows all of them; everything below receives what
it needs at construction (callables to wake runners, narrow Protocols for surfaces).

Lifecycle: :meth:`App.web_app` builds the aiohttp application with **one**
``cleanup_ctx`` (:meth:`App.lifecycle`) that starts the channel listeners, the MCP
session manager and (on request) the runners, and at the end stops them in reverse
order and closes channels, providers and the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import sqlalchemy as sa
from aiohttp import web

from bots import discord, email, slack, teams
from bots.base import Adapter
from leadgate.core.auth import Principal
from leadgate.core.clock import Clock, IdFactory, RandomIds, SystemClock
from leadgate.core.config import Settings
from leadgate.core.metrics import METRICS
from leadgate.core.runners import Runner, run_loop
from leadgate.core.tasks import Background
from leadgate.core.types import Outcome
from leadgate.database.db import Database
from leadgate.domain.workitems import Sweeper
from leadgate.flows.runs import FlowResumer, FlowService
from leadgate.operations.access import Access
from leadgate.operations.agents import Agents
from leadgate.operations.messages import Messages
from leadgate.operations.reviews import Reviews
from leadgate.review.runner import LeadRunner
from leadgate.runners.revisions import RevisionRunner
from leadgate.runners.schedules import ScheduleRunner
from leadgate.turns.path import TurnService
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.registry import ProviderRegistry, build_providers
from leadgate.web import agents_api, console, openai_api, operator_api
from leadgate.web.common import error_middleware
from leadgate.web.mcp import McpLifecycle, mount_mcp
from outbox.channel import Channel
from outbox.relay import Relay
from outbox.store import HANDOFF_TOPIC, OUTBOX_TOPIC, Outbox
from outbox.store import listen as outbox_listen

log = logging.getLogger("leadgate.app")

ADAPTER_MODULES = (slack, discord, teams, email)
#: How long shutdown waits for background work (turns in flight) before cancelling it.
SHUTDOWN_WAIT_S = 10.0


@dataclass
class _Loop:
    """One runner, the event that wakes it, and how many loops run it."""

    runner: Runner
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    loops: int = 1


class App:
    """Everything one leadgate process runs (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        ids: IdFactory | None = None,
        providers: dict[str, Provider] | None = None,
        channels: dict[str, Channel] | None = None,
        enable_adapters: bool = True,
    ) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        self.db = Database(settings.database.url, pool_size=settings.database.pool_size)
        self.providers = ProviderRegistry(providers or build_providers(settings))
        self.background = Background()
        self.outbox = Outbox(self.clock, self.ids)
        self._build_runners(channels or {}, enable_adapters)
        self.access = Access(self.db, self.clock, self.ids)
        self.reviews = Reviews(self.db, self.clock, self.ids, self.outbox, on_decided=self.wake_all)
        self.agents = Agents(self.db, self.clock, self.ids, self.providers.names)
        self._stop = asyncio.Event()
        self._stopped = False
        self._runner_tasks: set[asyncio.Task[None]] = set()
        self._mcp: McpLifecycle | None = None

    def _build_runners(self, channels: dict[str, Channel], enable_adapters: bool) -> None:
        """The turn path, the adapters and the runners, wired by wake callables."""
        r = self.settings.runners
        review_wake, self._relay_wake, revision_wake = (asyncio.Event() for _ in range(3))
        self.turns = TurnService(
            self.db,
            self.clock,
            self.ids,
            self.providers,
            self.outbox,
            on_review_queued=review_wake.set,
            on_delivery_queued=self._outbox_due,
        )
        self.messages = Messages(self.db, self.turns, self.background)
        self.adapters: list[Adapter] = []
        if enable_adapters:
            for module in ADAPTER_MODULES:
                adapter = module.create(self.settings, self.messages)
                if adapter is not None:
                    self.adapters.append(adapter)
        self.channels: dict[str, Channel] = {a.channel.name: a.channel for a in self.adapters}
        self.channels.update(channels)
        self.relay = Relay(
            self.db,
            self.clock,
            self.ids,
            self.channels,
            batch=r.relay_batch,
            concurrency=r.relay_concurrency,
            max_attempts=r.delivery_max_attempts,
        )
        # Every committed enqueue (lead or human approval, plain reply, operator retry)
        # wakes this process's relay at once; other replicas hear PostgreSQL NOTIFY.
        self.db.on_commit(OUTBOX_TOPIC, self._outbox_due)
        self.relay.poked_on_enqueue = True

        def after_verdict() -> None:
            self._relay_wake.set()
            revision_wake.set()

        self.lead_runner = LeadRunner(
            self.db, self.clock, self.ids, self.providers, self.outbox, on_verdict=after_verdict
        )
        self.flows = FlowService(self.db, self.clock, self.ids, self.turns)
        self.loops = [
            # Lead reviews wait on the model: several loops run; claims are fenced, so
            # they never review one item twice.
            _Loop(self.lead_runner, review_wake, r.review_concurrency),
            _Loop(self.relay, self._relay_wake),
            _Loop(RevisionRunner(self.turns), revision_wake),
            _Loop(Sweeper(self.db, self.clock, self.ids)),
            _Loop(ScheduleRunner(self.db, self.clock, self.turns)),
            _Loop(FlowResumer(self.flows)),
        ]

    @property
    def model_names(self) -> frozenset[str]:
        """Configured model names (agents must name one)."""
        return self.providers.names

    # ------------------------------------------------------------------ wake-ups

    def _outbox_due(self) -> None:
        """A delivery became due (committed here, or NOTIFY from another replica)."""
        self.relay.poke()
        self._relay_wake.set()

    def _outbox_handoff(self, rows: list[dict[str, Any]]) -> None:
        """Deliveries committed here, already claimed for our relay."""
        self.relay.accept(rows)
        self._relay_wake.set()

    def wake_all(self) -> None:
        """Wake every runner (after a human decision or a delivery recovery)."""
        for loop in self.loops:
            loop.wake.set()

    # ----------------------------------------------------------------- runners

    def start_runners(self) -> None:
        """Start every background runner loop (and the PostgreSQL listener)."""
        poll = self.settings.runners.poll_interval_s
        # Deliveries enqueued in this process go straight to this process's relay
        # (already claimed, handed over after commit): no claim round trip.
        self.db.on_commit_payloads(HANDOFF_TOPIC, self._outbox_handoff)
        self.outbox.attach(self.relay)
        for loop in self.loops:
            for index in range(loop.loops):
                task = asyncio.get_running_loop().create_task(
                    run_loop(loop.runner, wake=loop.wake, stop=self._stop, poll_s=poll),
                    name=f"{loop.runner.name}-{index}",
                )
                self._runner_tasks.add(task)
                task.add_done_callback(self._runner_tasks.discard)
        if self.db.is_postgres:
            self.background.spawn(
                outbox_listen(self.settings.database.url, self._outbox_due, self._stop),
                name="pg-listen",
            )

    async def stop(self) -> None:
        """Stop runners, wait for background work, close channels, providers, database
        (idempotent: the app's cleanup and a test's teardown may both call it)."""
        if self._stopped:
            return
        self._stopped = True
        self.outbox.attach(None)
        self._stop.set()
        if self._runner_tasks:
            await asyncio.wait(list(self._runner_tasks), timeout=SHUTDOWN_WAIT_S)
        await self.background.wait(SHUTDOWN_WAIT_S)
        self.db.off_commit_payloads(HANDOFF_TOPIC, self._outbox_handoff)
        try:
            await self.relay.release_handoffs()
        except Exception:
            log.exception("releasing handed-over deliveries failed (their leases will expire)")
        for channel in self.channels.values():
            try:
                await channel.close()
            except Exception:
                log.exception("closing channel %s failed", channel.name)
        await self.providers.close()
        await self.db.close()

    # ------------------------------------------------------------- HTTP surfaces

    def web_app(self, role: str = "all", *, run_runners: bool = False) -> web.Application:
        """The aiohttp application. ``role`` ``worker`` serves only health and metrics;
        ``run_runners`` starts the background runners with the app (``leadgate serve``)."""
        app = web.Application(
            middlewares=[error_middleware], client_max_size=self.settings.server.max_body_bytes
        )
        app.router.add_get("/healthz", self._healthz(role))
        app.router.add_get("/metrics", _metrics)
        surfaces = role != "worker"
        if surfaces:
            self._mount_surfaces(app)
        app.cleanup_ctx.append(self._lifecycle(surfaces=surfaces, run_runners=run_runners))
        app.on_shutdown.append(self._on_shutdown)
        return app

    def _mount_surfaces(self, app: web.Application) -> None:
        lookup = self.access.principal
        openai_api.setup(app, authenticate_with=lookup, chat=self.messages, ids=self.ids)
        agents_api.setup(app, authenticate_with=lookup, agents=self.agents)
        operator_api.setup(app, authenticate_with=lookup, reviews=self.reviews)
        console.setup(
            app, access=self.access, clock=self.clock, public_url=self.settings.server.public_url
        )
        self._mcp = mount_mcp(
            app,
            authenticate=self.access.key_principal,
            send_message=self._mcp_send,
            allowed_hosts=self._mcp_hosts(),
        )
        for adapter in self.adapters:
            adapter.mount(app)

    async def _mcp_send(
        self, principal: Principal, agent: str, message: str, session: str | None
    ) -> Outcome:
        return await self.messages.send(principal, agent, message, session=session)

    def _mcp_hosts(self) -> list[str]:
        server = self.settings.server
        public = urlparse(server.public_url)
        hosts = {public.netloc, f"127.0.0.1:{server.port}", f"localhost:{server.port}"}
        hosts |= {"127.0.0.1:*", "localhost:*"}
        return sorted(h for h in hosts if h)

    def _healthz(self, role: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def healthz(_: web.Request) -> web.Response:
            async with self.db.read() as conn:
                await conn.execute(sa.text("SELECT 1"))
            return web.json_response({"status": "ok", "role": role})

        return healthz

    def _lifecycle(
        self, *, surfaces: bool, run_runners: bool
    ) -> Callable[[web.Application], AsyncIterator[None]]:
        """The app's one ``cleanup_ctx``: start what serves and runs, stop it all after."""

        async def ctx(_app: web.Application) -> AsyncIterator[None]:
            async with contextlib.AsyncExitStack() as stack:
                # Last in, first out: stop() (runners, channels, database) runs last.
                stack.push_async_callback(self.stop)
                if surfaces:
                    if self._mcp is not None:
                        await stack.enter_async_context(self._mcp.run())
                    for adapter in self.adapters:
                        await stack.enter_async_context(adapter.lifespan())
                if run_runners:
                    self.start_runners()
                yield

        return ctx

    async def _on_shutdown(self, _app: web.Application) -> None:
        # Standalone MCP GET streams never end by themselves; releasing them lets
        # aiohttp's graceful shutdown finish instead of waiting for its timeout.
        if self._mcp is not None:
            self._mcp.release_streams()


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=METRICS.render(), content_type="text/plain")
