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
import functools
import hmac
import importlib
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import sqlalchemy as sa
from aiohttp import web

from bots.base import Adapter, Core
from leadgate.core.bodies import BODY_TIMEOUT_KEY
from leadgate.core.clock import Clock, IdFactory, RandomIds, SystemClock
from leadgate.core.config import Settings
from leadgate.core.decoding import bearer_token
from leadgate.core.errors import DatabaseDamaged, LeadgateError
from leadgate.core.logs import Tally, loggable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import Runner, run_loop
from leadgate.core.tasks import Background
from leadgate.database.db import Database
from leadgate.database.faults import unavailable
from leadgate.database.pg import CHANGES_CHANNEL
from leadgate.domain import workitems
from leadgate.domain.processes import Liveness
from leadgate.domain.session_events import NOTIFY_CHANNEL as SESSION_EVENTS_CHANNEL
from leadgate.domain.session_events import TOPIC as SESSION_EVENTS_TOPIC
from leadgate.domain.session_events import mark_watched
from leadgate.domain.wakes import CHANNEL as WAKES_CHANNEL
from leadgate.domain.wakes import TOPIC as WAKES_TOPIC
from leadgate.domain.wakes import Wake, parse_due
from leadgate.domain.wakes import parse as parse_wake
from leadgate.domain.workitems import Sweeper
from leadgate.flows.recovery import FlowRecovery
from leadgate.flows.runs import FlowResumer, FlowService
from leadgate.operations.access import Access
from leadgate.operations.agents import Agents
from leadgate.operations.chat_reviews import ChatReviews
from leadgate.operations.event_hub import EventHub
from leadgate.operations.idempotency import Idempotency
from leadgate.operations.messages import Messages
from leadgate.operations.oversight import Oversight
from leadgate.operations.reviews import Reviews
from leadgate.operations.transcripts import Transcripts
from leadgate.review.cards import TIMERS_TOPIC, ReviewNotifier
from leadgate.review.decisions import Verdict, ended_by_flow
from leadgate.review.runner import LeadRunner
from leadgate.review.sla import SlaRunner
from leadgate.runners.recovery import TurnRecovery
from leadgate.runners.revisions import RevisionRunner
from leadgate.runners.schedules import SCHEDULE_LOOPS, ScheduleRunner
from leadgate.turns.path import TurnService
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.registry import ProviderRegistry, build_providers
from leadgate.web import (
    agents_api,
    console,
    openai_api,
    openapi,
    operator_api,
    operator_events,
    sessions_api,
    studio,
)
from leadgate.web.common import (
    DAMAGED_ANSWERS,
    INFLIGHT,
    UNAVAILABLE_ANSWERS,
    ClientAddress,
    DamagedAnswers,
    Inflight,
    StreamSlots,
    UnavailableAnswers,
    error_middleware,
    error_response,
    inflight_middleware,
    stamp_response,
)
from leadgate.web.sessions_api import StreamSettings
from outbox.channel import Channel
from outbox.relay import Relay
from outbox.store import HANDOFF_TOPIC, OUTBOX_TOPIC, Handoff, Outbox, listen_all
from outbox.store import NOTIFY_CHANNEL as OUTBOX_CHANNEL

if TYPE_CHECKING:
    from leadgate.web.mcp import McpLifecycle

log = logging.getLogger("leadgate.app")

#: The channel adapters, each with the switch of its config section. A module is imported
#: only when its channel is on: the platform SDKs (botbuilder, discord.py, slack-bolt,
#: aiosmtpd) cost startup time and memory a deployment without that channel never uses.
ADAPTER_MODULES: tuple[tuple[str, Callable[[Settings], bool]], ...] = (
    ("bots.slack", lambda s: s.slack.on),
    ("bots.discord", lambda s: s.discord.on),
    ("bots.teams", lambda s: s.teams.on),
    ("bots.email", lambda s: s.email.on),
)


def create_adapters(settings: Settings, core: Core) -> list[Adapter]:
    """The adapters of the channels ``settings`` turns on, their modules imported here."""
    adapters: list[Adapter] = []
    for name, on in ADAPTER_MODULES:
        if not on(settings):
            continue
        create: Callable[[Settings, Core], Adapter | None] = importlib.import_module(name).create
        adapter = create(settings, core)
        if adapter is not None:
            adapters.append(adapter)
    return adapters


#: How often ``/healthz`` may look again at a damaged database it reports (ms):
#: :meth:`leadgate.database.db.Database.recheck_damage`, which reads the whole SQLite
#: file, so not at every poll.
DAMAGE_RECHECK_MS = 30_000

#: How long shutdown waits for background work (turns in flight) before cancelling it.
SHUTDOWN_WAIT_S = 10.0


@dataclass
class _Loop:
    """One runner, the event that wakes it, and how many loops run it."""

    runner: Runner
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    loops: int = 1
    #: how long until the runner's next known work falls due (see run_loop's ``due_s``)
    due_s: Callable[[], float | None] | None = None


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
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        settle_doubt: bool = False,
    ) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        # settle_doubt (see Database.settle_doubt): for a process that runs no runners
        # (``leadgate flow run``): no look of theirs would make good a write in doubt.
        self.db = Database(
            settings.database.url,
            pool_size=settings.database.pool_size,
            busy_timeout_s=settings.database.busy_timeout_s,
            settle_doubt=settle_doubt,
        )
        # This process's row in `processes`: the owner named on every lease it takes, so
        # that another process takes its leases back at once when it is known dead.
        self.liveness = Liveness(
            self.db,
            self.clock,
            self.ids,
            dead_after_ms=int(settings.runners.dead_after_s * 1000),
        )
        #: ``/healthz``'s re-check of a damaged database: when it may run next (clock
        #: ms), and whether one runs now.
        self._damage_recheck_at = 0
        self._damage_rechecking = False
        self._beats_damaged = Tally(
            log,
            "%d heartbeat(s) met a damaged database: %s; retrying at each beat",
            every_s=60.0,
            level=logging.ERROR,
        )
        self._beats_failed = Tally(
            log, "%d heartbeat(s) failed: %s; retrying at each beat", every_s=60.0
        )
        self.providers = ProviderRegistry(providers or build_providers(settings))
        self.background = Background()
        self.outbox = Outbox(self.clock, self.ids)
        # Review cards are written in the transaction that makes an item wait for a human.
        self.notifier = ReviewNotifier(
            self.clock,
            self.ids,
            self.outbox,
            public_url=settings.server.public_url,
            defaults=settings.review,
            reply_address=settings.email.review_reply_address,
        )
        self.outbox.on_review_needed(self.notifier.open)
        self._build_runners(channels or {}, enable_adapters, sleep)
        self.access = Access(self.db, self.clock, self.ids)
        # A decision wakes the runner it gives work to at its commit (on every replica):
        # a return the revision dispatcher, an approval of a flow item or the end of a
        # flow node's item the flow resumer (leadgate.domain.wakes), a delivery the relay
        # (outbox.store). A delivery's recovery gives work to the relay alone: a retry's
        # row due again, the card edits a confirm queues.
        self.reviews = Reviews(self.db, self.clock, self.ids, self.outbox)
        self._wire_chat_reviews()
        self.agents = Agents(self.db, self.clock, self.ids, self.providers.names)
        self.oversight = Oversight(self.db, self.clock)

        # Session reads (transcripts, review-status events, MCP resources, Studio): the
        # hub wakes their readers after every commit here, and on PostgreSQL after every
        # NOTIFY of another replica (started with the surfaces).
        self.transcripts = Transcripts(self.db, self.clock, self.ids)
        # On PostgreSQL other replicas NOTIFY a session's events only while a reader here
        # keeps it marked watched (session_events.mark_watched).
        self.event_hub = EventHub(
            functools.partial(mark_watched, self.db) if self.db.is_postgres else None
        )
        self.db.on_commit_payloads(SESSION_EVENTS_TOPIC, self.event_hub.committed)
        self.idempotency = Idempotency(self.db, self.clock, self.ids)
        # Its claims in doubt are given back by a loop of their own in every process that
        # serves the REST API (_lifecycle), woken when one is watched.
        self._idempotency_wake = asyncio.Event()
        self.idempotency.wake = self._idempotency_wake.set
        # A rerun of a keyed REST turn (its process died) stores its answer under the key.
        self.turns.keyed_answer = self.idempotency.store_recovered
        self._stop = asyncio.Event()
        self._stopped = False
        self._runner_tasks: set[asyncio.Task[None]] = set()
        self._mcp: McpLifecycle | None = None

    def _build_runners(
        self,
        channels: dict[str, Channel],
        enable_adapters: bool,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        """The turn path, the adapters and the runners, wired by wake callables."""
        r = self.settings.runners
        review_wake, self._relay_wake, revision_wake = (asyncio.Event() for _ in range(3))
        self._review_wake = review_wake
        owner = self.liveness.owner
        self.turns = TurnService(
            self.db,
            self.clock,
            self.ids,
            self.providers,
            self.outbox,
            on_review_queued=self._review_due,
            on_delivery_queued=self._outbox_due,
            owner=owner,
            maybe_reaped=self.liveness.maybe_reaped,
            sleep=sleep,
        )
        # Each heartbeat names the oldest plain turn in flight: a gone process's search
        # reaches back to it (a turn longer than the run lease was missed).
        self.liveness.turns_since = self.turns.turns_since
        # The heartbeat renews the leases of the runs this process's turns are running.
        self.liveness.renewals.append(self.turns.renew_runs)
        self.messages = Messages(self.db, self.turns, self.background)
        self.adapters = create_adapters(self.settings, self.messages) if enable_adapters else []
        self.channels: dict[str, Channel] = {a.channel.name: a.channel for a in self.adapters}
        self.channels.update(channels)
        self.relay = Relay(
            self.db,
            self.clock,
            self.ids,
            self.channels,
            batch=r.relay_batch,
            concurrency=r.relay_concurrency,
            stalled_after=r.delivery_max_attempts,
            review_needed=self.outbox.review_needed,
            owner=owner,
        )
        # Every committed enqueue (lead or human approval, plain reply, operator retry)
        # wakes this process's relay at once; other replicas hear PostgreSQL NOTIFY.
        self.db.on_commit(OUTBOX_TOPIC, self._outbox_due)
        self.relay.poked_on_enqueue = True

        def after_verdict(verdict: Verdict) -> None:
            # An approval's delivery wakes the relay itself (hand-off or after-commit hook).
            if verdict == Verdict.changesRequested:
                revision_wake.set()

        self.lead_runner = LeadRunner(
            self.db,
            self.clock,
            self.ids,
            self.providers,
            self.outbox,
            on_verdict=after_verdict,
            owner=owner,
        )
        # Every submission committed here pokes the lead runner, so its idle passes
        # skip the claim while the queue is known empty (other replicas' submissions
        # arrive by NOTIFY on PostgreSQL; anything else by the recheck and the poll).
        self.lead_runner.poked_on_enqueue = True
        self.lead_runner.wake = review_wake.set
        self.flows = FlowService(self.db, self.clock, self.ids, self.turns)
        outbox = self.outbox
        self.flows.item_ended = lambda conn, item_id: ended_by_flow(conn, outbox, item_id)
        flow_wake, recovery_wake, flow_recovery_wake, schedule_wake = (
            asyncio.Event() for _ in range(4)
        )

        def leases_freed() -> None:
            # Every runner that takes a dead holder's lease back (domain.processes).
            self.lead_runner.leases_freed()
            self.relay.leases_freed()
            turn_recovery.gone_found()
            for wake in (
                review_wake,
                self._relay_wake,
                revision_wake,
                recovery_wake,
                flow_recovery_wake,
            ):
                wake.set()

        # What each kind of leadgate.domain.wakes work wakes: committed here (the
        # TOPIC's payloads) or on another replica (NOTIFY, see _wake_notified).
        self._wakes: dict[Wake, Callable[[], None]] = {
            Wake.revision: revision_wake.set,
            Wake.flow: flow_wake.set,
            Wake.leases: leases_freed,
            Wake.schedule: schedule_wake.set,
        }
        self.db.on_commit_payloads(WAKES_TOPIC, self._woken)
        schedules = ScheduleRunner(self.db, self.clock, self.turns)
        flow_recovery = FlowRecovery(self.flows)
        # A run the resumer inserted by a commit in doubt wakes it: it looks for it.
        self.flows.recovery_due = flow_recovery_wake.set
        turn_recovery = TurnRecovery(self.turns)
        # A run orphaned or watched by a turn (not by the recovery's own passes) wakes
        # it: its sleep is toward the earliest run lease, or the poll.
        self.turns.recovery_due = recovery_wake.set
        # An api process runs no runners, but its own orphans and watched runs are
        # known to it alone (_lifecycle starts this loop there instead).
        self._own_recovery = TurnRecovery(self.turns, own_only=True)
        self._recovery_wake = recovery_wake
        revisions = RevisionRunner(self.turns)
        resumer = FlowResumer(self.flows)
        sweeper = Sweeper(self.db, self.clock, self.ids)
        self.loops = [
            # Lead reviews wait on the model: several loops run; claims are fenced, so
            # they never review one item twice. A review lease lapses with time (its
            # holder alive but stalled): the loops sleep no longer than until it does.
            _Loop(
                self.lead_runner,
                review_wake,
                r.review_concurrency,
                due_s=self.lead_runner.due_in_s,
            ),
            # A retry after a short Retry-After, and a send lease that lapses, are due
            # with time: the loop sleeps no longer than until the sooner.
            _Loop(self.relay, self._relay_wake, due_s=self.relay.due_in_s),
            # A revision lease lapses with time (its dispatcher stalled): the loop
            # sleeps no longer than until the earliest does.
            _Loop(revisions, revision_wake, due_s=revisions.due_in_s),
            # An item becomes abandonable with time (a week idle): the loop sleeps no
            # longer than until the oldest known one does, or LOCKED_RECHECK_MS when a
            # pass skipped idle items another transaction held.
            _Loop(sweeper, due_s=sweeper.due_in_s),
            # A firing is due with time: the loop sleeps no longer than until the next;
            # an added schedule (whose first firing may be sooner) wakes it at commit.
            # Several loops (SCHEDULE_LOOPS): one slow or blocked turn holds up no other
            # due schedule; each pass takes a schedule no other pass is firing.
            _Loop(schedules, schedule_wake, SCHEDULE_LOOPS, due_s=schedules.due_in_s),
            # Approvals wake the resumer; a pass whose pick met the settled
            # continuation row-locked looks again soon (due_in_s).
            _Loop(resumer, flow_wake, due_s=resumer.due_in_s),
            # Flow runs whose executor stopped mid-run: a reap of its process wakes this
            # loop; a lease lapses with time, and the loop sleeps no longer than until
            # the earliest does.
            _Loop(flow_recovery, flow_recovery_wake, due_s=flow_recovery.due_in_s),
            # Recorded turns whose process died (a reap wakes this loop) or stalled: a
            # run lease lapses with time, and the loop sleeps no longer than until then.
            _Loop(turn_recovery, recovery_wake, due_s=turn_recovery.due_in_s),
        ]

    def _wire_chat_reviews(self) -> None:
        """Chat decisions on the adapters that offer them (Slack, Teams, Discord), and
        the SLA runner (reminders, escalation, expiry)."""
        self.chat_reviews = ChatReviews(self.db, self.clock, self.reviews)
        for adapter in self.adapters:
            enable = getattr(adapter, "enable_reviews", None)
            if enable is not None:
                enable(self.chat_reviews)
        self.sla_runner = SlaRunner(self.db, self.clock, self.ids, self.outbox, self.notifier)
        # Reminders, escalations and expiries are due with time: the loop sleeps no
        # longer than until the next (or LOCKED_RECHECK_MS when an expiry's item was
        # row-locked); an episode opened here with a sooner timer wakes it.
        sla = _Loop(self.sla_runner, due_s=self.sla_runner.due_in_s)
        self.sla_runner.wake = sla.wake.set
        # An episode opened on another replica: NOTIFY with its timer (_wake_notified).
        self._wakes[Wake.sla] = sla.wake.set
        self.db.on_commit_payloads(TIMERS_TOPIC, self.sla_runner.timers_opened)
        self.loops.append(sla)

    @property
    def model_names(self) -> frozenset[str]:
        """Configured model names (agents must name one)."""
        return self.providers.names

    # ------------------------------------------------------------------ wake-ups

    def _review_due(self) -> None:
        """An item waits for its lead (a submission committed here, or NOTIFY from any
        replica's)."""
        self.lead_runner.poke()
        self._review_wake.set()

    def _review_notified(self, sender: str) -> None:
        """``NOTIFY leadgate_reviews`` from any replica (the payload names the sender's
        Database): this process's own submissions poked the lead runner at commit, and a
        second poke would start a claim that finds nothing."""
        if sender != self.db.notify_tag:
            self._review_due()

    def _outbox_due(self) -> None:
        """A delivery became due (committed here, or NOTIFY from another replica)."""
        self.relay.poke()
        self._relay_wake.set()

    def _outbox_handoff(self, rows: list[Handoff]) -> None:
        """Deliveries committed here, already claimed for our relay."""
        self.relay.accept(rows)
        self._relay_wake.set()

    def _outbox_doubt(self, rows: list[Handoff]) -> None:
        """Deliveries claimed for our relay by a write that may not have committed."""
        self.relay.in_doubt(rows)
        self._relay_wake.set()

    def _woken(self, kinds: list[Wake]) -> None:
        """Work of ``kinds`` committed in this process (leadgate.domain.wakes)."""
        for kind in kinds:
            self._wakes[kind]()

    def _wake_notified(self, payload: str) -> None:
        """``NOTIFY leadgate_wakes`` from any replica: this process's own commits woke
        its runners at commit already."""
        parsed = parse_wake(payload)
        if parsed is None or parsed[1] == self.db.notify_tag:
            return
        due = parse_due(payload) if parsed[0] is Wake.sla else None
        if due is not None:
            # Weighed as an episode opened here is: a wake only when sooner.
            self.sla_runner.timers_opened([due])
        else:
            self._wakes[parsed[0]]()

    def _wake_all(self) -> None:
        """The LISTEN connection is (re)connected: what was sent while it was down is
        looked for once."""
        for wake in self._wakes.values():
            wake()

    # ----------------------------------------------------------------- runners

    async def start_liveness(self, role: str | None = None) -> None:
        """Register this process in ``processes`` (as ``role``) and keep its heartbeat.
        Every role does: an api replica records channel turns under its id, and only a
        registered owner's leases are taken back at once when it dies (an unregistered
        one's waited out their 15-minute lease)."""
        if self.liveness.id is not None:
            return
        if role is not None:
            self.liveness.role = role
        await self.liveness.register()
        self.background.spawn(self._heartbeat(), name="heartbeat")

    async def start_runners(self, *, listen: bool = True) -> None:
        """Register this process (:meth:`start_liveness`), then start every background
        runner loop and (PostgreSQL, unless ``listen`` is false: the caller listens for
        them, see :meth:`_listen`) the listener of the outbox and review channels."""
        await self.start_liveness()
        # Deliveries enqueued in this process go straight to this process's relay
        # (already claimed, handed over after commit): no claim round trip.
        self.db.on_commit_payloads(HANDOFF_TOPIC, self._outbox_handoff)
        self.db.on_doubt_payloads(HANDOFF_TOPIC, self._outbox_doubt)
        self.outbox.attach(self.relay)
        for loop in self.loops:
            for index in range(loop.loops):
                task = asyncio.get_running_loop().create_task(
                    self._run_loop(loop.runner, loop.wake, loop.due_s),
                    name=f"{loop.runner.name}-{index}",
                )
                self._runner_tasks.add(task)
                task.add_done_callback(self._runner_tasks.discard)
        if listen:
            self._listen(runners=True, surfaces=False)

    def _start_own_recovery(self) -> None:
        """The turn recovery of an ``api`` process, which runs no runners: it reruns
        (or closes) only the runs this process left to recovery, which only it knows
        (:attr:`TurnService.orphans <leadgate.turns.path.TurnService.orphans>`, its
        watched tokens: a turn stopped on a database fault, an intake in doubt, a keyed
        retry that failed before its turn, a channel turn it was too busy to run). No
        worker replica could take them before their 15-minute lease lapsed, and then it
        closed them as a live owner's stalled turns, their messages never answered.
        Lapsed leases and dead processes' runs stay the worker replicas' work."""
        self.background.spawn(
            self._run_loop(self._own_recovery, self._recovery_wake, self._own_recovery.due_in_s),
            name="turn-recovery-own",
        )

    def _run_loop(
        self, runner: Runner, wake: asyncio.Event, due_s: Callable[[], float | None] | None
    ) -> Coroutine[Any, Any, None]:
        """``runner``'s loop in this process: woken by ``wake``, looking at the poll and
        when ``due_s`` says, until the app stops."""
        return run_loop(
            runner,
            wake=wake,
            stop=self._stop,
            poll_s=self.settings.runners.poll_interval_s,
            due_s=due_s,
        )

    def _listen(self, *, runners: bool, surfaces: bool) -> None:
        """PostgreSQL: one LISTEN connection for every channel this process needs (see
        :func:`outbox.store.listen_all` for why one): deliveries due, items queued for
        review and the rarer runners' work (runners; submissions, returns and flow
        approvals on API replicas, reaps anywhere, reach the runners of worker replicas
        now, not at their next poll; see leadgate.domain.wakes), session events
        (surfaces: event streams here hear writes of every replica), and changes of
        agents, presets and policy rules (either: what lets the intake keep them between
        turns)."""
        if not self.db.is_postgres:
            return
        channels: dict[str, Callable[[str], None]] = {}
        on_connect: list[Callable[[], None]] = []
        if runners:
            channels[OUTBOX_CHANNEL] = lambda _payload: self._outbox_due()
            channels[workitems.REVIEW_CHANNEL] = self._review_notified
            channels[WAKES_CHANNEL] = self._wake_notified
            on_connect += [self._outbox_due, self._review_due, self._wake_all]
        on_lost: list[Callable[[], None]] = []
        if surfaces:
            channels[SESSION_EVENTS_CHANNEL] = self.event_hub.notified
            on_connect.append(self.event_hub.wake_all)
            self.background.spawn(self.event_hub.renew_forever(self._stop), name="watched-sessions")
        changes = self.db.table_changes
        if channels and changes is not None:
            # Agents, presets and policy rules changed by any writer: the intake's cache
            # of them is used only while this connection is up (TableChanges).
            channels[CHANGES_CHANNEL] = changes.notified
            on_connect.append(changes.connected)
            on_lost.append(changes.lost)
        if channels:
            self.background.spawn(
                listen_all(
                    self.settings.database.url,
                    channels,
                    self._stop,
                    on_connect=on_connect,
                    on_lost=on_lost,
                ),
                name="pg-listen",
            )

    async def _heartbeat(self) -> None:
        """Refresh this process's heartbeat and reap dead processes until stopped
        (:meth:`beat_once` at each beat)."""
        every = self.settings.runners.heartbeat_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=every)
            if self._stop.is_set():
                return
            await self.beat_once()

    async def beat_once(self) -> None:
        """One beat: refresh this process's heartbeat and reap dead processes. A failure
        is retried at the next beat and logged as one line a minute at most, saying what
        it was: a damaged database (ERROR, naming the file or database) or another
        failure (WARNING: what the database said when it was unavailable). It was a
        WARNING every beat saying what clients are told (``the service cannot store this
        request right now``; for a damaged file, to restore "it", not which)."""
        try:
            await self.liveness.beat()
            await self.liveness.reap()
        except DatabaseDamaged as exc:
            self._beats_damaged.add(exc.detail)
        except Exception as exc:
            self._beats_failed.add(_what_failed(exc))

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
        self.db.off_doubt_payloads(HANDOFF_TOPIC, self._outbox_doubt)
        try:
            await self.relay.release_doubted()
            await self.relay.release_handoffs()
        except Exception as exc:
            log.error(
                "releasing handed-over deliveries failed (their leases will expire)",
                exc_info=loggable(exc),
            )
        await self._record_owed_at_stop()
        try:
            await self.liveness.unregister()
        except Exception:
            log.warning("could not unregister this process (its leases lapse by themselves)")
        for channel in self.channels.values():
            try:
                await channel.close()
            except Exception as exc:
                log.error("closing channel %s failed", channel.name, exc_info=loggable(exc))
        await self.providers.close()
        await self.db.close()

    async def _record_owed_at_stop(self) -> None:
        """Record the runs this process still owes (plain turns stopped on a database
        fault: :attr:`TurnService.owed <leadgate.turns.path.TurnService.owed>`), before
        the process unregisters: a recorded run whose owner is gone is rerun by a worker's
        turn recovery. Kept in memory alone, they were dropped without a word. When the
        database is still away, one WARNING names how many messages stay unanswered. So
        does one for the intakes in doubt this process still looked for (its last look
        found nothing): a message the database applies after the stop is answered by
        nobody."""
        if not self.turns.owed and not self.turns.owed_lost:
            return
        try:
            await self.turns.record_owed(every_look=True)
        except Exception as exc:
            log.warning(
                "stopping with %d owed turn(s) not recorded (%s): their messages stay unanswered",
                len(self.turns.owed) + len(self.turns.owed_lost),
                _what_failed(exc),
            )
            return
        if self.turns.owed_lost:
            log.warning(
                "stopping with %d intake(s) in doubt not found taken in: a message the "
                "database applies after this stop stays unanswered",
                len(self.turns.owed_lost),
            )

    # ------------------------------------------------------------- HTTP surfaces

    def web_app(
        self, role: str = "all", *, run_runners: bool = False, register: bool = False
    ) -> web.Application:
        """The aiohttp application. ``role`` ``worker`` serves only health and metrics;
        ``run_runners`` starts the background runners with the app; ``register`` (and
        ``run_runners``) registers the process as ``role`` (``leadgate serve``, every
        role: see :meth:`start_liveness`)."""
        inflight = Inflight(self.settings.server.max_inflight)
        app = web.Application(
            middlewares=[error_middleware, inflight_middleware(inflight)],
            client_max_size=self.settings.server.max_body_bytes,
        )
        app[INFLIGHT] = inflight
        app[UNAVAILABLE_ANSWERS] = UnavailableAnswers()
        app[DAMAGED_ANSWERS] = DamagedAnswers()
        app.on_response_prepare.append(stamp_response)
        app[BODY_TIMEOUT_KEY] = self.settings.server.body_timeout_s
        app.router.add_get("/healthz", self._healthz(role))
        if not self.settings.server.metrics_host:
            app.router.add_get("/metrics", self.metrics_handler())
        surfaces = role != "worker"
        if surfaces:
            self._mount_surfaces(app)
        app.cleanup_ctx.append(
            self._lifecycle(
                role=role,
                surfaces=surfaces,
                run_runners=run_runners,
                register=register or run_runners,
            )
        )
        app.on_shutdown.append(self._on_shutdown)
        return app

    def _mount_surfaces(self, app: web.Application) -> None:
        lookup = self.access.principal
        openai_api.setup(
            app,
            authenticate_with=lookup,
            chat=self.messages,
            ids=self.ids,
            clock=self.clock,
            models=self.agents,
            idempotency=self.idempotency,
        )
        api = self.settings.api
        streams = StreamSettings(
            heartbeat_s=api.events_heartbeat_s,
            write_timeout_s=api.events_write_timeout_s,
            reauth_s=api.events_reauth_s,
            slots=StreamSlots(api.events_max_streams),
        )
        sessions_api.setup(
            app,
            authenticate_with=lookup,
            reads=self.transcripts,
            hub=self.event_hub,
            settings=streams,
        )
        studio.setup(
            app,
            authenticate_with=lookup,
            chat=self.messages,
            agents=self.agents,
            reads=self.transcripts,
            hub=self.event_hub,
            settings=streams,
        )
        agents_api.setup(app, authenticate_with=lookup, agents=self.agents)
        operator_api.setup(
            app, authenticate_with=lookup, reviews=self.reviews, insights=self.oversight
        )
        operator_events.setup(
            app,
            authenticate_with=lookup,
            feed=self.oversight,
            reauth_s=self.settings.api.events_reauth_s,
        )
        console.setup(
            app,
            access=self.access,
            clock=self.clock,
            public_url=self.settings.server.public_url,
            client_address=ClientAddress(self.settings.server.trusted_proxies),
        )
        # Imported here: the MCP SDK's types take most of a second to import, and a
        # worker process (role worker) never mounts the server.
        from leadgate.web.mcp import mount_mcp

        self._mcp = mount_mcp(
            app,
            authenticate=self.access.key_principal,
            send_message=lambda who, agent, text, session: self.messages.send(
                who, agent, text, session=session
            ),
            allowed_hosts=self._mcp_hosts(),
            transcripts=self.transcripts,
            readable=self.transcripts.readable,
            watch=self.event_hub.watch,
            keep_notified=self.event_hub.keep_notified,
            version=package_version(),
            session_idle_s=api.mcp_session_idle_s,
            max_sessions=api.mcp_max_sessions,
            reauth_s=api.events_reauth_s,
        )
        for adapter in self.adapters:
            adapter.mount(app)
        openapi.setup(app, public_url=self.settings.server.public_url)

    def _mcp_hosts(self) -> list[str]:
        server = self.settings.server
        public = urlparse(server.public_url)
        hosts = {public.netloc, f"127.0.0.1:{server.port}", f"localhost:{server.port}"}
        hosts |= {"127.0.0.1:*", "localhost:*"}
        return sorted(h for h in hosts if h)

    def _healthz(self, role: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def healthz(_: web.Request) -> web.Response:
            if self.db.damaged is not None:
                # Once met, damage is reported until a re-check finds it repaired:
                # ``SELECT 1`` reads no table's pages, and another statement succeeding
                # proves nothing of the pages it did not read. The re-check (SQLite: a
                # quick_check of the file; PostgreSQL: each statement that met it, run
                # again and rolled back) costs more than ``SELECT 1``, so it runs at
                # most every DAMAGE_RECHECK_MS and one at a time; polls meanwhile get
                # the last verdict. (Only a restart ended the 500, repaired or not.)
                now = self.clock.now_ms()
                if now >= self._damage_recheck_at and not self._damage_rechecking:
                    self._damage_recheck_at = now + DAMAGE_RECHECK_MS
                    self._damage_rechecking = True
                    try:
                        await self.db.recheck_damage()
                    finally:
                        self._damage_rechecking = False
                damaged = self.db.damaged
                if damaged is not None:
                    raise DatabaseDamaged(damaged)
            async with self.db.read() as conn:
                await conn.execute(sa.text("SELECT 1"))
            return web.json_response({"status": "ok", "role": role})

        return healthz

    def _lifecycle(
        self, *, role: str, surfaces: bool, run_runners: bool, register: bool
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
                    # The client's retry of a keyed request whose claim landed in doubt
                    # may reach another replica: this process gives the claim back when
                    # its look is due, not at its next keyed request (an idle pass reads
                    # nothing).
                    self.background.spawn(
                        self._run_loop(
                            self.idempotency, self._idempotency_wake, self.idempotency.due_in_s
                        ),
                        name="idempotency-give-back",
                    )
                if register:
                    await self.start_liveness(role)
                if run_runners:
                    await self.start_runners(listen=False)
                elif role == "api":
                    self._start_own_recovery()
                self._listen(runners=run_runners, surfaces=surfaces)
                yield

        return ctx

    async def _on_shutdown(self, _app: web.Application) -> None:
        # Standalone MCP GET streams never end by themselves; releasing them lets
        # aiohttp's graceful shutdown finish instead of waiting for its timeout.
        if self._mcp is not None:
            self._mcp.release_streams()
        self.event_hub.close()  # review-status event streams end too

    def metrics_handler(self) -> Callable[[web.Request], Awaitable[web.Response]]:
        """``GET /metrics``: counters across every organization, so not for everyone.

        With ``[server] metrics_token`` it needs that bearer token (401 otherwise). With
        ``metrics_host`` it is served only on that separate listener (``metrics_app``).
        Without either it is open only while the service listens on a loopback address.
        """
        server = self.settings.server
        token = server.metrics_token
        loopback = server.host in ("127.0.0.1", "::1", "localhost") or bool(server.metrics_host)

        async def metrics(request: web.Request) -> web.Response:
            if token:
                given = bearer_token(request) or ""
                if not hmac.compare_digest(given.encode(), token.encode()):
                    resp = error_response(
                        request, 401, "metrics need the token", "unauthorized", "metrics.token"
                    )
                    resp.headers["WWW-Authenticate"] = "Bearer"
                    return resp
            elif not loopback:
                return error_response(
                    request,
                    403,
                    "set [server] metrics_token or metrics_host to read metrics",
                    "forbidden",
                    "metrics.exposed",
                )
            return web.Response(body=METRICS.render(), content_type="text/plain")

        return metrics

    def metrics_app(self) -> web.Application:
        """The separate ``/metrics`` listener's application (``[server] metrics_host``)."""
        app = web.Application(middlewares=[error_middleware], client_max_size=1024)
        app[UNAVAILABLE_ANSWERS] = UnavailableAnswers()
        app.on_response_prepare.append(stamp_response)
        app.router.add_get("/metrics", self.metrics_handler())
        return app


def _what_failed(exc: Exception) -> str:
    """What a background step's failure was, for a log line without a traceback: what
    the database said when it was unavailable, a refusal's message and rule, else the
    error itself."""
    fault = unavailable(exc)
    if fault is not None:
        return f"the database is unavailable ({fault.detail or fault.message})"
    if isinstance(exc, LeadgateError):
        return f"{exc.message} [{exc.rule}]"
    return f"{type(exc).__name__}: {exc}"[:500]


def package_version() -> str:
    """The installed leadgate version (MCP ``serverInfo.version``)."""
    try:
        return importlib.metadata.version("leadgate")
    except importlib.metadata.PackageNotFoundError:  # running from a bare checkout
        return "0+unknown"
