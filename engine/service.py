"""The service: one process, one event loop, one database.

:class:`Service` wires configuration, database, providers, the turn path, runners and
channel adapters together, implements :class:`bots.base.Core` for the adapters and
builds the aiohttp application.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from typing import Any

from aiohttp import web

from binding import routes
from binding.schedules import ScheduleRunner
from bots.base import Adapter, RouteMatch
from engine import agents as agents_mod
from engine import orgs
from engine.auth import Principal
from engine.clock import Clock, IdFactory, RandomIds, SystemClock
from engine.config import Settings
from engine.db import Database
from engine.metrics import METRICS
from engine.providers.base import Provider
from engine.providers.script import ScriptProvider
from engine.runners import RevisionRunner, Runner, Sweeper, run_loop
from engine.turns import ProviderRegistry, TurnService
from engine.types import Outcome, Trigger
from flows.runs import FlowResumer, FlowService
from outbox.channel import Channel
from outbox.relay import Relay
from outbox.store import HANDOFF_TOPIC, OUTBOX_TOPIC, set_local_relay
from outbox.store import listen as outbox_listen
from review.runner import LeadRunner

log = logging.getLogger("leadgate.service")

#: How long a valid API key's principal is cached in process: a key revoked meanwhile is
#: refused at the latest this many seconds later (see Service.lookup_principal).
PRINCIPAL_TTL_S = 5.0
PRINCIPAL_CACHE_SIZE = 1024


def build_providers(settings: Settings) -> dict[str, Provider]:
    """One provider per ``[models.NAME]`` section."""
    providers: dict[str, Provider] = {}
    for name, model in settings.models.items():
        if model.provider == "script":
            providers[name] = ScriptProvider()
        else:
            from engine.providers.openai import OpenAIProvider

            providers[name] = OpenAIProvider(
                base_url=model.base_url,
                api_key=model.api_key,
                model=model.model,
                timeout_s=model.timeout_s,
            )
    return providers


class Service:
    """Everything one leadgate process runs."""

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
        self.wakes: dict[str, asyncio.Event] = {}
        self.turns = TurnService(
            self.db,
            self.clock,
            self.ids,
            self.providers,
            on_review_queued=lambda: self.wake("lead-review"),
            on_delivery_queued=lambda: self.wake("outbox-relay"),
        )
        self.adapters: list[Adapter] = []
        if enable_adapters:
            self.adapters = self._create_adapters()
        self.channels: dict[str, Channel] = {a.channel.name: a.channel for a in self.adapters}
        self.channels.update(channels or {})
        r = settings.runners
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
        self.lead_runner = LeadRunner(
            self.db,
            self.clock,
            self.ids,
            self.providers,
            on_verdict=self._after_verdict,
        )
        self.flows = FlowService(self.db, self.clock, self.ids, self.turns)
        self.runners: list[Runner] = [
            self.lead_runner,
            self.relay,
            RevisionRunner(self.turns),
            Sweeper(self.db, self.clock, self.ids),
            ScheduleRunner(self.db, self.clock, self.turns),
            FlowResumer(self.flows),
        ]
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        # SHA-256 of a raw API key -> (monotonic expiry, principal); see lookup_principal.
        self._principals: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()

    def _create_adapters(self) -> list[Adapter]:
        from bots import discord, email, slack, teams

        adapters = []
        for module in (slack, discord, teams, email):
            adapter = module.create(self.settings, self)
            if adapter is not None:
                adapters.append(adapter)
        return adapters

    @property
    def model_names(self) -> frozenset[str]:
        """Configured model names (agents must name one)."""
        return self.providers.names

    # ------------------------------------------------------------ bots.base.Core

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific route for an inbound channel trigger."""
        async with self.db.read() as conn:
            return await routes.resolve(conn, channel, attrs)

    async def submit(self, trigger: Trigger) -> Outcome:
        """Run a channel trigger on the shared wait path."""
        return await self.turns.run(trigger)

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Track a background task; failures are logged, shutdown waits for it."""

        async def wrapper() -> None:
            try:
                await coro
            except Exception:
                log.exception("background task %s failed", name)

        task = asyncio.get_running_loop().create_task(wrapper(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ helpers

    async def lookup_principal(self, token: str | None, session: str | None) -> Principal | None:
        """Principal of a bearer key or console session token.

        Valid API keys are cached in process for :data:`PRINCIPAL_TTL_S` seconds (at most
        :data:`PRINCIPAL_CACHE_SIZE` keys, by SHA-256 of the raw key: the key itself is
        never stored), so **a revoked key keeps working for up to that long** in a process
        that saw it just before. Unknown, malformed and revoked keys are not cached (each
        attempt is checked against the database), nor are console sessions (a logout
        takes effect at once).
        """
        if token:
            digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
            now = time.monotonic()
            hit = self._principals.get(digest)
            if hit is not None:
                if hit[0] > now:
                    return hit[1]
                del self._principals[digest]
            async with self.db.read() as conn:
                principal = await orgs.authenticate_key(conn, token)
            if principal is not None:
                self._principals[digest] = (now + PRINCIPAL_TTL_S, principal)
                while len(self._principals) > PRINCIPAL_CACHE_SIZE:
                    self._principals.popitem(last=False)  # the oldest entry
            return principal
        if session:
            async with self.db.read() as conn:
                return await orgs.authenticate_session(conn, self.clock, session)
        return None

    async def find_agent(self, org_id: str, ref: str) -> dict[str, Any]:
        """An agent of the organization by id, slug or name (404 otherwise)."""
        async with self.db.read() as conn:
            return await agents_mod.find_agent(conn, org_id, ref)

    def wake(self, name: str) -> None:
        """Wake one runner now instead of at its next poll."""
        self.wakes.setdefault(name, asyncio.Event()).set()

    def _after_verdict(self) -> None:
        self.wake("outbox-relay")
        self.wake("revision-dispatch")

    def wake_all(self) -> None:
        """Wake every runner (after an operator decision)."""
        for runner in self.runners:
            self.wake(runner.name)

    # ----------------------------------------------------------------- lifecycle

    def start_runners(self) -> None:
        """Start every background runner loop."""
        poll = self.settings.runners.poll_interval_s
        # Deliveries enqueued in this process go straight to this process's relay
        # (already claimed, handed over after commit): no claim round trip.
        self.db.on_commit_payloads(HANDOFF_TOPIC, self._outbox_handoff)
        set_local_relay(self.db.engine, self.relay)
        for runner in self.runners:
            wake = self.wakes.setdefault(runner.name, asyncio.Event())
            # Lead reviews wait on the model: run several loops; claims are fenced, so
            # they never review one item twice.
            loops = self.settings.runners.review_concurrency if runner is self.lead_runner else 1
            for index in range(loops):
                task = asyncio.get_running_loop().create_task(
                    run_loop(runner, wake=wake, stop=self._stop, poll_s=poll),
                    name=f"{runner.name}-{index}",
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self.db.is_postgres:
            self.spawn(self._listen(), name="pg-listen")

    async def _listen(self) -> None:
        """PostgreSQL LISTEN: other replicas' NOTIFY wakes our relay at once
        (reconnects when the connection drops)."""
        await outbox_listen(self.settings.database.url, self._outbox_due, self._stop)

    def _outbox_due(self) -> None:
        """A delivery became due (committed here, or NOTIFY from another replica)."""
        self.relay.poke()
        self.wake(self.relay.name)

    def _outbox_handoff(self, rows: list[Any]) -> None:
        """Deliveries committed here, already claimed for our relay."""
        self.relay.accept(rows)
        self.wake(self.relay.name)

    async def stop(self) -> None:
        """Stop runners, wait for background work, close channels and the database."""
        set_local_relay(self.db.engine, None)
        self._stop.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
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
        for name in self.providers.names:
            close = getattr(self.providers.get(name), "close", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing model provider %s failed", name)
        await self.db.close()

    def build_app(self, role: str = "all") -> web.Application:
        """The aiohttp application (``role`` worker serves only health and metrics)."""
        from web import agents_api, openai_api, operator_api
        from web.common import error_middleware

        app = web.Application(
            middlewares=[error_middleware], client_max_size=self.settings.server.max_body_bytes
        )

        async def healthz(_: web.Request) -> web.Response:
            async with self.db.read() as conn:
                await conn.exec_driver_sql("SELECT 1")
            return web.json_response({"status": "ok", "role": role})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=METRICS.render(), content_type="text/plain")

        app.router.add_get("/healthz", healthz)
        app.router.add_get("/metrics", metrics)
        if role == "worker":
            return app
        openai_api.setup(app, self)
        agents_api.setup(app, self)
        operator_api.setup(app, self)
        from web import console

        console.setup(app, self)
        self._mount_mcp(app)
        for adapter in self.adapters:
            adapter.mount(app)
        return app

    def _mount_mcp(self, app: web.Application) -> None:
        from urllib.parse import urlparse

        from engine.types import BindingKind, BindingSpec
        from web.mcp import mount_mcp

        async def authenticate(raw: str) -> Principal | None:
            return await self.lookup_principal(raw, None)

        async def send_message(
            principal: Principal, agent_ref: str, message: str, session: str | None
        ) -> Outcome:
            from engine.auth import Scope

            principal.require(Scope.trigger)
            key = f"h:{session}" if session else f"default:{principal.key_id}"
            # The agent is looked up (NotFound when unknown) inside the intake transaction.
            return await self.turns.run(
                Trigger(
                    org_id=principal.org_id,
                    agent_id=agent_ref,
                    session_key=key,
                    text=message,
                    binding=BindingSpec(BindingKind.api),
                )
            )

        server = self.settings.server
        public = urlparse(server.public_url)
        hosts = {public.netloc, f"127.0.0.1:{server.port}", f"localhost:{server.port}"}
        hosts |= {"127.0.0.1:*", "localhost:*"}
        mount_mcp(
            app,
            authenticate=authenticate,
            send_message=send_message,
            allowed_hosts=sorted(h for h in hosts if h),
        )
