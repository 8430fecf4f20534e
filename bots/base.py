"""The one small interface between a channel adapter and the core.

An adapter module (``bots/slack.py`` ...) has two thin halves:

* inbound: verify the platform's authenticity mechanism on the raw bytes, decode the
  body through :mod:`leadgate.core.decoding`, parse it into a neutral
  :class:`leadgate.core.types.Inbound` and hand it to :func:`accept`, the one step
  shared by every adapter: the message is **recorded durably before the platform is
  answered** (:meth:`Core.record_inbound`, one short transaction, within the platform's
  deadline), and its turn runs in the background (:meth:`Core.run_recorded`). A process
  that dies after the answer leaves a recorded run that another process (or this one
  after its restart) takes over;
* outbound: a :class:`outbox.channel.Channel` whose ``send`` maps SDK errors onto the
  outcome classes. Replies of plain turns and approved output both go through the outbox,
  so the inbound half never posts a turn's text itself.

Nothing outside ``bots/`` imports a channel SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from aiohttp import web

from leadgate.core.errors import DatabaseDamaged, IntakeInDoubt, LeadgateError, Unavailable
from leadgate.core.logs import loggable
from leadgate.core.types import BindingKind, Conversations, Inbound, Recorded, Routed, RouteMatch

# DATABASE_FAULTS: what an intake or a click meets when the database cannot be reached
# (or a recording outlived the platform's deadline): nothing may have been taken in.
from leadgate.database.faults import DATABASE_FAULTS as DATABASE_FAULTS
from outbox.channel import Channel, OutboundMessage, SendOutcome, Sent

log = logging.getLogger(__name__)


class Core(Protocol):
    """What an inbound adapter may ask of the core
    (:class:`leadgate.operations.messages.Messages`)."""

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        """Route ``inbound`` and take it in durably (await before answering the platform);
        ``None`` when no route answers. A message that breaks a message rule is
        recorded as rejected and (``notice``) answered with a reply saying why."""
        ...

    async def run_recorded(self, recorded: Recorded) -> Routed | None:
        """Run the recorded turn on the shared wait path (``None``: it was rejected). A
        plain reply is queued for posting; a failed turn queues a failure notice."""
        ...

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific route of ``channel`` whose match keys all equal ``attrs``.

        Match keys: slack ``team``, ``channel``; discord ``guild``, ``channel``; teams
        ``tenant``, ``conversation``; email ``address`` (recipient) and ``sender``
        (an allowed sender address or ``*@domain``). ``None``: nobody answers; the
        adapter runs no turn (email refuses the recipient at RCPT time).
        """
        ...

    async def event_session_key(self, external_event_id: str) -> str | None:
        """The key of the session the message taken in under ``external_event_id`` (an
        adapter's own event id) belongs to; None when none was. One indexed read: for a
        message whose conversation nothing else names (an email reply naming only the
        person's own earlier mail)."""
        ...

    async def email_reply_session_key(
        self, org_id: str, message_id: str, *, sent_to: str, sent_from: str
    ) -> str | None:
        """The key of the session of ``org_id`` whose email reply was sent under
        ``message_id`` (the Message-ID our mail went out with) to ``sent_to`` from
        ``sent_from``; None when none was. One indexed read: for an answer naming alone
        one of our replies whose Message-ID does not carry its thread."""
        ...

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background, tracked, logged on failure, awaited on shutdown."""
        ...

    async def conversations(
        self, channel: BindingKind, *, key_prefix: str, window_ms: int
    ) -> Conversations:
        """The sessions of ``channel`` (keys starting with ``key_prefix``) that ever took
        in a message of the kind a catch-up reads back (``channel``'s: Discord's gateway
        messages, Slack's events), each with those recorded in the last ``window_ms``, and
        the match keys of the channel's active routes: where a catch-up of the messages
        that reached no process starts (Discord's gateway at READY, Slack's Events API at
        start)."""
        ...

    async def advance_read_points(
        self,
        channel: BindingKind,
        points: Mapping[str, int],
        *,
        read_through: bool = False,
        kept: bool = False,
    ) -> None:
        """Store where the next catch-up of each conversation of ``channel`` starts
        (conversation -> epoch ms on the core's clock, as :attr:`Conversations.read_at_ms`),
        never moving a stored point back (a kept message's aside); ``read_through``: a
        catch-up read them through (else one is starting to read them:
        :attr:`Conversations.read_through`);
        ``kept``: a live message's, kept for the next read-back (a point not read
        through moves back to it, never forward past an earlier kept message)."""
        ...


class Adapter(Protocol):
    """One channel: its inbound HTTP routes/listeners and its outbound sender.

    Each adapter module exposes ``create(settings: leadgate.core.config.Settings, core:
    Core) -> Adapter | None`` returning ``None`` when the channel's secret is unset
    (channel off). The composition root (:mod:`leadgate.app`) mounts the routes, runs
    :meth:`lifespan` while the HTTP surfaces serve, and closes :attr:`channel` at the end.
    """

    @property
    def channel(self) -> Channel:
        """The outbound half, registered with the relay under ``channel.name``
        (read-only here, so an adapter may hold its own kind of channel)."""
        ...

    def mount(self, app: web.Application) -> None:
        """Add the inbound HTTP routes (if any) to ``app``."""
        ...

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        """Run the inbound listeners that are not HTTP routes (a gateway, SMTP) for the
        duration of the block."""
        ...


#: How much of an answer that is not the platform's a delivery's error quotes.
QUOTED_BODY_CHARS = 120
# How much of such an answer is read for the quote: whitespace collapses and a
# secret-looking run shrinks to one character, so the quote may reach further in.
_READ_CHARS = QUOTED_BODY_CHARS * 4
# Left out of a quoted page: anything shaped like a Slack token, and long opaque runs
# (a portal's session id in a login link), which may be someone's credentials.
_SECRET_LOOKING = re.compile(r"xox[a-z]-[A-Za-z0-9-]+|[A-Za-z0-9_+-]{24,}=*")
# A run at the end of what was read, when the page goes on: it may be the start of a
# longer one, too short to look secret here.
_CUT_RUN = re.compile(r"[A-Za-z0-9_+-]+=*$")


def quoted_page(body: bytes | str) -> str:
    """The start of ``body``, an answer that is not the platform's (a captive portal's
    or a proxy's page), as a delivery's error and its WARNING line quote it on every chat
    platform: whitespace collapsed, at most :data:`QUOTED_BODY_CHARS` characters, and
    secret-looking parts (a Slack-token-shaped string, a run of 24 or more letters,
    digits, ``_``, ``+`` or ``-``) left out as ``…``; empty for an empty body."""
    head = body[:_READ_CHARS]
    text = head.decode("utf-8", "replace") if isinstance(head, bytes) else head
    if len(body) > _READ_CHARS:
        text = _CUT_RUN.sub("…", text)
    return _SECRET_LOOKING.sub("…", " ".join(text.split()))[:QUOTED_BODY_CHARS]


#: How :func:`not_taken_in` begins for a message that met a database fault: nothing was
#: taken in, and the person is asked to send it again.
NOT_TAKEN_IN = "Your message could not be taken in:"
#: How :func:`not_taken_in` begins when the recording's commit is in doubt: its answer
#: may still come (a Discord or Slack catch-up answers a message whose only reply is this one).
IN_DOUBT = "Your message may or may not have been taken in:"


def not_taken_in(exc: Unavailable | DatabaseDamaged) -> str:
    """What a person is told when their message met a database fault (``exc``) on a
    channel that never delivers it again by itself: in words, with the rule, never the
    driver's message. (If the recording commits late after all, its answer still comes.)
    In doubt (:class:`~leadgate.core.errors.IntakeInDoubt`: the recording's commit may
    have landed, and reading it back failed), "could not be taken in" may be untrue,
    and its answer then comes from the turn's recovery once the service is back: it says
    so."""
    if isinstance(exc, IntakeInDoubt):
        return (
            f"{IN_DOUBT} the service became unavailable while taking it in ({exc.rule}). "
            "If it was, its answer comes once the service is back; if none comes, please "
            "send it again."
        )
    return (
        f"{NOT_TAKEN_IN} the service is unavailable right now ({exc.rule}). If no answer "
        "comes, please send it again in a moment."
    )


#: How far before the newest message taken in a channel, or its stored read point, a
#: catch-up (Discord's, Slack's) reads again: messages taken in concurrently may have
#: been cut by a crash around a later one that was recorded (what was recorded is a
#: duplicate, and answered no second time), and replicas' clocks differ.
CATCH_UP_OVERLAP_MS = 60_000
#: A catch-up stopped by a database fault is tried again this many seconds on, doubling
#: up to :data:`CATCH_UP_RETRY_MAX_S`, until it ends or its adapter stops.
CATCH_UP_RETRY_FIRST_S = 5.0
CATCH_UP_RETRY_MAX_S = 60.0


async def known_conversations(
    core: Core, channel: BindingKind, *, key_prefix: str, window_s: float
) -> Conversations | None:
    """Where ``channel``'s catch-up starts (:meth:`Core.conversations`, over the last
    ``window_s``), or None when the database is away (one WARNING: the catch-up is
    tried again, :func:`catch_up_until_done`)."""
    try:
        return await core.conversations(
            channel, key_prefix=key_prefix, window_ms=int(window_s * 1000)
        )
    except DATABASE_FAULTS as exc:
        log.warning("%s: no catch-up, the database is unavailable (%s)", channel.value, exc.rule)
        return None


def catch_up_start(
    point: int | None, read_through: bool, newest_ms: int | None, since_ms: int
) -> int:
    """Where a channel's catch-up starts (epoch ms, the route's bound aside), never
    before ``since_ms``: its stored ``point`` alone while the last catch-up that stored
    it has not read it through (a live message taken in since may be newer than those
    it missed); else no earlier than :data:`CATCH_UP_OVERLAP_MS` before the newest
    message taken in there (``newest_ms``): every message before it reached the
    service (or was read back), and the hour is not read again at each start."""
    if point is not None and not read_through:
        return max(since_ms, point)
    newest = since_ms if newest_ms is None else newest_ms - CATCH_UP_OVERLAP_MS
    return max(since_ms, point or since_ms, newest)


async def store_read_points(core: Core, channel: BindingKind, points: Mapping[str, int]) -> bool:
    """Store where the catch-ups of ``channel``'s channels start (``points``:
    :func:`catch_up_start`), before any is read, each marked not read through: one that
    fails (or a process that dies while it reads) is read from there again, though a
    live message taken in there since is newer. False when the database is away (one
    WARNING: the catch-up is tried again)."""
    try:
        await core.advance_read_points(channel, points)
    except DATABASE_FAULTS as exc:
        log.warning(
            "%s: catch-up stopped, the database is unavailable (%s)", channel.value, exc.rule
        )
        return False
    return True


async def catch_up_until_done(
    catch_up: Callable[[bool], Awaitable[bool]], stopping: asyncio.Event, *, channel: str
) -> None:
    """Run a channel's read-back of the messages that reached no process (``catch_up``:
    False when a database fault stopped it) until it ends or ``stopping`` is set: one
    stopped by a fault is tried again :data:`CATCH_UP_RETRY_FIRST_S` on, doubling, not at
    the next start or READY. ``catch_up`` is told whether it is such a retry: a channel
    then starts from its read point (or the window's start when it has none), not from
    the newest message taken in there, which a live message may be by now. Any other error
    ends it, logged (never the service's end)."""
    wait_s = CATCH_UP_RETRY_FIRST_S
    again = False
    while not stopping.is_set():
        try:
            if await catch_up(again):
                return
        except Exception as exc:
            if not stopping.is_set():  # (else the shutdown cut its reads)
                log.error("%s: the catch-up ended with an error", channel, exc_info=loggable(exc))
            return
        again = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), wait_s)
        wait_s = min(2 * wait_s, CATCH_UP_RETRY_MAX_S)


async def tell_not_taken_in(
    channel: Channel,
    inbound: Inbound,
    exc: Unavailable | DatabaseDamaged,
    *,
    key: str,
    within_s: float | None = None,
) -> SendOutcome:
    """Post :func:`not_taken_in` to ``inbound``'s conversation (a reply to it, where the
    channel replies), straight through ``channel``: not through the outbox, since the
    database is what failed. ``key`` (e.g. the platform's message id) makes a repeat the
    same post where the platform de-duplicates; ``within_s`` bounds the send below the
    channel's own bound (what is left of the platform's wait). The send's outcome
    (``Sent``: posted; ``Uncertain``: it may have been)."""
    outcome = await channel.send(
        OutboundMessage(
            delivery_id=key,
            idempotency_key=key,
            address=dict(inbound.address),
            text=not_taken_in(exc),
            kind="notice",
            within_s=within_s,
        )
    )
    if not isinstance(outcome, Sent):
        # (its error alone: what the platform said may quote the post)
        log.warning("%s: could not tell the author either: %s", channel.name, outcome.error)
    return outcome


AfterRun = Callable[[Routed | None], Awaitable[None]]
#: Called with a recorded message whose turn failed, and its error (before the failure
#: propagates): a database fault (:data:`DATABASE_FAULTS`) left the turn to the
#: recovery runner, with no failure notice queued (the turn's own, or the one its
#: failed run's closing met: that fault is the error then, from the turn's).
FailedRun = Callable[[Recorded, Exception], Awaitable[None]]


async def accept(
    core: Core,
    inbound: Inbound,
    *,
    name: str,
    deadline_s: float | None = None,
    notice: bool = True,
    then: AfterRun | None = None,
    failed: FailedRun | None = None,
) -> Recorded | None:
    """Record ``inbound`` (awaited: call before answering the platform), then run its turn
    in the background and hand the result to ``then`` (not called when the turn failed:
    ``failed`` is, with the recorded message and the error, and the failure is raised on; nor for a
    rejected message; ``None``: the turn was left to the recovery runner).

    ``deadline_s``: the platform's answer deadline minus a margin. When recording takes
    longer (the database is slow), this raises :class:`Unavailable` (Slack: answer 503,
    it redelivers; Discord, Teams: tell the person, see :func:`not_taken_in`) while the
    recording goes on: if it commits after all, its turn still runs, and a redelivery is
    a duplicate.
    """
    recording = asyncio.ensure_future(core.record_inbound(inbound, notice=notice))

    def run(recorded: Recorded | None) -> None:
        # (A rejected message runs nothing: ``then`` is never called with it, so its
        # ``None`` means a turn left to the recovery runner.)
        if recorded is not None and recorded.rejected is None:
            core.spawn(_run(core, recorded, then, failed), name=name)

    try:
        if deadline_s is None:
            recorded = await recording
        else:
            recorded = await asyncio.wait_for(asyncio.shield(recording), deadline_s)
    except TimeoutError:
        recording.add_done_callback(
            lambda task: (
                run(task.result()) if not task.cancelled() and not task.exception() else None
            )
        )
        raise Unavailable(
            "the message could not be recorded in time; it is safe to send it again",
            rule="inbound.deadline",
            retry_after_s=1,
        ) from None
    run(recorded)
    return recorded


async def _run(
    core: Core, recorded: Recorded, then: AfterRun | None, failed: FailedRun | None
) -> None:
    # A failing turn raises here (logged by spawn); the person already has a failure
    # notice queued (unless the route is silent), so ``then`` runs only after a turn
    # that ended normally.
    try:
        routed = await core.run_recorded(recorded)
    except Exception as exc:
        if failed is not None:
            await failed(recorded, exc)
        raise
    if then is not None:
        await then(routed)


def error_answer(exc: LeadgateError) -> web.Response:
    """A channel endpoint's JSON answer to a refused request (400, 413, 503 ...), the same
    with or without the service's error middleware (no traceback, Retry-After kept)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return web.json_response(
        {"error": {"message": exc.message, "code": exc.code, "rule": exc.rule}},
        status=exc.status,
        headers=headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def answering_errors(handler: Handler) -> Handler:
    """Wrap a channel route so a refused request gets :func:`error_answer`."""

    async def route(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except LeadgateError as exc:
            return error_answer(exc)

    return route
