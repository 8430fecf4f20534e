"""Discord: HTTP interactions and the gateway in, discord.py's REST client out.

Inbound, two ways:

* ``POST /discord/interactions`` (when ``[discord] public_key`` is set): the Ed25519
  signature is checked with PyNaCl on the raw body, and the signed timestamp must be
  within :data:`FRESHNESS_S` of the adapter's clock (401 and no turn otherwise: a body
  signed an hour ago is refused); the body then goes through the one decoding path
  (400). PING is answered, and the slash command ``ask`` (one string option
  ``message``) is **recorded** first (:func:`bots.base.accept`, well inside Discord's 3
  seconds) and then answered with a deferred response (type 5) while the turn runs in
  the background. A plain turn's reply reaches the user when the outbox edits that
  deferred response; for a gated, busy, silent turn (or a reply of whitespace only) the
  deferred response is deleted, so no "thinking..." state lingers and nothing is
  visible; so is one left to the recovery runner, at once or when its turn stopped on a
  database fault (its reply, if any, follows up). A
  message that breaks a message rule, or that no route answers, or that is refused
  (its worker deactivated or deleted), gets an ephemeral answer saying so, naming the
  rule (a 4xx is only Discord's "This interaction failed": it is kept for what is no
  valid interaction, a bad signature 401 and a malformed body 400). A replayed
  interaction (the same interaction id) is a duplicate: it is answered ephemerally and
  never touches the earlier reply.
* the gateway (when ``bot_token`` is set): a discord.py :class:`discord.Client` with the
  message-content intent; a human message becomes a trigger answered as a reply to it.
  A thread is a channel of its own (its session, its replies) that a route naming its
  parent channel answers too, unless one names the thread (:func:`binding.routes.best_route`).
  Discord delivers a gateway message once, to the sessions connected then: at each READY
  (the start, and a reconnect that could not resume) :meth:`DiscordAdapter.catch_up`
  reads back, over REST, the messages of every known channel posted after its read point
  (where the last catch-up that read it through started; within ``[discord]
  catch_up_s``) and takes each in the same way; the
  intake's de-duplication by message id answers one that came both ways once, and one
  the bot already replied to (but for the "may or may not have been taken in" notice)
  is left alone.

Outbound: :class:`DiscordChannel` posts through discord.py's HTTP client. Channel posts
carry a nonce derived from the delivery's idempotency key with ``enforce_nonce``, so
Discord itself drops a repeat inside its de-duplication window.

discord.py keeps its REST base and gateway URL in class attributes
(``discord.http.Route.BASE``, ``DiscordWebSocket.DEFAULT_GATEWAY``); :func:`create` sets
them once from the settings, which is how tests point the real SDK at a stand-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import discord
import discord.gateway
import discord.http
from aiohttp import web
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from bots import discord_review
from bots.base import (
    CATCH_UP_OVERLAP_MS,
    DATABASE_FAULTS,
    IN_DOUBT,
    Core,
    accept,
    answering_errors,
    catch_up_start,
    catch_up_until_done,
    known_conversations,
    not_taken_in,
    store_read_points,
    tell_not_taken_in,
)
from bots.discord_out import (
    DiscordChannel,
    configure_endpoints,
    nonce_for,
    quiet_voice_warning,
)
from bots.review_base import ChatReviewBackend
from leadgate.core.bodies import read_body
from leadgate.core.clock import Clock, SystemClock
from leadgate.core.config import Settings
from leadgate.core.decoding import json_object
from leadgate.core.errors import AuthError, ConfigError, LeadgateError, ValidationError
from leadgate.core.kept import Kept
from leadgate.core.logs import loggable
from leadgate.core.types import (
    DISCORD_MESSAGE_EVENT,
    ROUTE_PARENT,
    BindingKind,
    Busy,
    Conversations,
    Duplicate,
    Inbound,
    Recorded,
    Reply,
    Routed,
    not_processed,
)

__all__ = ["DiscordAdapter", "DiscordChannel", "configure_endpoints", "create", "nonce_for"]

log = logging.getLogger(__name__)

INTERACTIONS_PATH = "/discord/interactions"
#: How far a signed interaction timestamp may be from our clock (replay window).
FRESHNESS_S = 300
#: Discord wants the interaction answered within 3 s: recording must end well before.
RECORD_DEADLINE_S = 2.5
#: How long to wait before deleting a deferred answer decided while recording.
_DEFERRED_SETTLE_S = 1.0
#: The wait before identifying again after a session that cannot resume: discord.py's own
#: default, which keeps a reconnecting bot inside Discord's identify rate limit (one per
#: 5 s per bucket). A module value so tests of a second READY need not wait it out.
IDENTIFY_PAUSE_S = 5.0
ASK_COMMAND = "ask"
ASK_OPTION = "message"

# Interaction and callback types (Discord API v10).
_PING = 1
_APPLICATION_COMMAND = 2
_PONG = 1
_DEFERRED_CHANNEL_MESSAGE = 5  # (a message only its person sees: discord_review.ephemeral)

# Gateway connection: shutdown bound, and the backoff while Discord cannot be reached.
_GATEWAY_CLOSE_TIMEOUT_S = 10.0
_GATEWAY_FIRST_RETRY_S = 2.0
_GATEWAY_MAX_RETRY_S = 60.0

#: Catch-up reads at most this many pages (100 messages each) per channel and READY.
CATCH_UP_PAGES = 10
#: ... and, besides the channels it knows, at most this many active threads of each
#: (those with the latest message first) that it does not know.
CATCH_UP_THREADS = 20
#: ... and at most this many of the threads of each channel a route names that were
#: archived within ``catch_up_s`` (the latest archived first: one request).
CATCH_UP_ARCHIVED = 20
#: How long one look-up of whether a channel is a thread may take (Discord not answering).
THREAD_LOOKUP_S = 5.0
#: The waits before a live message's look-up is made again, after one that timed out or
#: failed on the network, a 5xx or a 429 (nothing is kept of a failed one): a message in
#: a thread whose parent alone a route names was routed as its own channel's at the
#: first failure, and nothing answered it. Only after the last is it so routed.
THREAD_LOOKUP_RETRY_S = (2.0, 8.0, 30.0)
#: How many channels' parents (or that they have none) are kept: past it, learnt again.
_PARENTS_KEPT = 10_000
#: At most this many channels' parents are being learnt at once, each look-up shared by
#: the channel's messages meanwhile (beyond it, a message looks up on its own).
_LOOKUPS_SHARED = 1_000
#: A thread's parent never changes: what is learnt is kept under this one token.
_FOREVER = True
#: Discord's channel types of threads (announcement, public, private).
_THREAD_TYPES = (10, 11, 12)
#: Discord's JSON error code for a channel it does not have.
_UNKNOWN_CHANNEL = 10003
#: ... and for an action on a channel of a type without it (the threads of a thread).
_NOT_THIS_TYPE = 50024
_MESSAGE_EVENT = DISCORD_MESSAGE_EVENT
_SESSION_PREFIX = "discord:"


# -- inbound -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AskCommand:
    """One ``/ask message:...`` interaction."""

    interaction_id: str
    application_id: str
    token: str
    guild_id: str | None
    channel_id: str
    text: str

    @property
    def guild(self) -> str:
        """Guild id, ``@me`` for a direct message (Discord's own name for it)."""
        return self.guild_id or "@me"


@dataclass(frozen=True)
class GatewayPost:
    """One human message seen on the gateway."""

    message_id: str
    guild_id: str | None
    channel_id: str
    text: str
    #: the parent channel of the thread it was posted in (``None``: not in a thread)
    parent_id: str | None = None

    @property
    def guild(self) -> str:
        """Guild id, ``@me`` for a direct message."""
        return self.guild_id or "@me"


def _ident(value: Any) -> str | None:
    """A snowflake or token as Discord sends it (a string, or a number), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and value else None


def parse_ask(payload: Mapping[str, Any]) -> AskCommand | None:
    """The ``ask`` command of an APPLICATION_COMMAND interaction, else ``None`` (also for
    fields of the wrong JSON type: a verified body is still not trusted for its shape)."""
    data = payload.get("data")
    if payload.get("type") != _APPLICATION_COMMAND or not isinstance(data, dict):
        return None
    if data.get("name") != ASK_COMMAND:
        return None
    text = ""
    options = data.get("options")
    for option in options if isinstance(options, list) else []:
        if (
            isinstance(option, dict)
            and option.get("name") == ASK_OPTION
            and isinstance(option.get("value"), str)
        ):
            text = option["value"].strip()
    channel = payload.get("channel")
    channel_id = _ident(payload.get("channel_id")) or (
        _ident(channel.get("id")) if isinstance(channel, dict) else None
    )
    interaction_id = _ident(payload.get("id"))
    application_id = _ident(payload.get("application_id"))
    token = _ident(payload.get("token"))
    if not (text and channel_id and interaction_id and application_id and token):
        return None
    guild_id = _ident(payload.get("guild_id"))
    return AskCommand(
        interaction_id=str(interaction_id),
        application_id=str(application_id),
        token=str(token),
        guild_id=str(guild_id) if guild_id else None,
        channel_id=str(channel_id),
        text=text,
    )


def _strip_mention(text: str, bot_id: int | None) -> str:
    if bot_id is None:
        return text.strip()
    return re.sub(rf"^\s*<@!?{bot_id}>[\s,:]*", "", text).strip()


def parse_message(
    message: discord.Message, bot_user_id: int | None, parent_id: int | None = None
) -> GatewayPost | None:
    """A :class:`GatewayPost` for a human's message, ``None`` for bots and the bot itself
    (``parent_id``: the thread's parent channel, when it was posted in a thread)."""
    if message.author.bot or message.webhook_id is not None:
        return None
    if bot_user_id is not None and message.author.id == bot_user_id:
        return None
    if message.type not in (discord.MessageType.default, discord.MessageType.reply):
        return None
    text = _strip_mention(message.content or "", bot_user_id)
    if not text:
        return None
    guild_id: int | None = message.guild.id if message.guild is not None else None
    if guild_id is None:
        # A guild the client has not cached arrives as a PartialMessageable with guild_id.
        guild_id = getattr(message.channel, "guild_id", None)
    return GatewayPost(
        message_id=str(message.id),
        guild_id=str(guild_id) if guild_id else None,
        channel_id=str(message.channel.id),
        text=text,
        parent_id=str(parent_id) if parent_id else None,
    )


class _GatewayClient(discord.Client):
    """A gateway client that hands every message to one callback, and each READY to
    another."""

    def __init__(
        self,
        on_post: Callable[[discord.Message], None],
        on_ready: Callable[[], None],
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._on_post = on_post
        self._on_ready = on_ready

    async def on_message(self, message: discord.Message) -> None:
        """Called by discord.py for each MESSAGE_CREATE."""
        self._on_post(message)

    async def on_ready(self) -> None:
        """Called by discord.py for each READY (not for a RESUMED session)."""
        self._on_ready()

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        """Called by discord.py before each IDENTIFY: the first at once, each later one
        :data:`IDENTIFY_PAUSE_S` on (as discord.py's default)."""
        if not initial:
            await asyncio.sleep(IDENTIFY_PAUSE_S)


@dataclass(frozen=True)
class CatchUpTarget:
    """A channel to read back at READY: its guild (``None``: a direct message; unknown
    when only a route names the channel, see ``guild_known``), the newest message id
    taken in there lately and the read point stored (``point``: where its catch-up
    starts, epoch ms; ``None``: none yet)."""

    channel_id: int
    guild_id: int | None
    guild_known: bool
    newest: int | None
    point: int | None = None
    #: the thread's parent channel, when it is known to be a thread
    parent: int | None = None

    #: the point was stored by a catch-up that read the channel through
    read_through: bool = False

    def start_point(self, since_ms: int) -> int:
        """Where the catch-up of this channel starts (epoch ms, the route's bound
        aside): :func:`bots.base.catch_up_start`."""
        newest = None if self.newest is None else _made_ms(self.newest)
        return catch_up_start(self.point, self.read_through, newest, since_ms)


def catch_up_targets(known: Conversations, *, again: bool = False) -> list[CatchUpTarget]:
    """The channels to catch up: every Discord session (its key ``discord:GUILD:CHANNEL``)
    that took in a gateway message, with the newest recorded in it lately, every
    channel a route names that has none, and every other channel whose read point is
    not read through and, less :data:`CATCH_UP_OVERLAP_MS` (a kept message's point is
    stored that much before it), within the window, or was written within it (a later
    kept message's), each with its read point. ``again`` (a retry
    after a database fault): no channel has a newest (a live message taken in since the
    first try may be it)."""
    targets: dict[int, CatchUpTarget] = {}
    for key, event_ids in known.sessions.items():
        _, _, rest = key.partition(_SESSION_PREFIX)
        guild, _, channel = rest.partition(":")
        if not channel.isdigit() or not (guild.isdigit() or guild == "@me"):
            continue
        ids = [
            int(e[len(_MESSAGE_EVENT) :])
            for e in event_ids
            if e.startswith(_MESSAGE_EVENT) and e[len(_MESSAGE_EVENT) :].isdigit()
        ]
        newest = max(ids, default=None)
        earlier = targets.get(int(channel))
        if earlier is not None and earlier.newest is not None:
            newest = earlier.newest if newest is None else max(newest, earlier.newest)
        guild_id = int(guild) if guild.isdigit() else None
        targets[int(channel)] = CatchUpTarget(int(channel), guild_id, True, newest)
    for match in known.routes:
        channel = match.get("channel", "")
        if channel.isdigit() and int(channel) not in targets:
            guild = match.get("guild", "")
            guild_id = int(guild) if guild.isdigit() else None
            known_guild = guild.isdigit() or guild == "@me"
            targets[int(channel)] = CatchUpTarget(int(channel), guild_id, known_guild, None)
    for channel, point in known.points.items():
        # A point not read through within the window, of a channel neither a session nor
        # a route names: a live message kept for the read-back (its thread's parent
        # untold, :meth:`DiscordAdapter._keep_for_read_back`), or a thread of a listing
        # whose read failed. Its guild (and parent) learnt first, as a route's channel's.
        # A kept message's point is stored CATCH_UP_OVERLAP_MS before it: the message is
        # within the window when its point is within that much more of it, or when the
        # point was written within it (a later kept message leaves an earlier one's point
        # where it is: by the point alone, a READY past the earlier one's window left the
        # channel out, and the later message was lost).
        fresh = max(point + CATCH_UP_OVERLAP_MS, known.written_at.get(channel, 0))
        fresh = fresh >= known.since_ms
        fresh = fresh and channel not in known.read_through
        if fresh and channel.isdigit() and int(channel) not in targets:
            targets[int(channel)] = CatchUpTarget(int(channel), None, False, None)
    return [
        dataclasses.replace(
            target,
            newest=None if again else target.newest,
            point=point,
            read_through=str(target.channel_id) in known.read_through,
        )
        for target in targets.values()
        for point in (known.points.get(str(target.channel_id)),)
    ]


def replied_to(messages: list[discord.Message], bot_id: int | None) -> set[int]:
    """The ids of the messages the bot (user ``bot_id``) replied to among ``messages``
    (its own messages' ``message_reference``): answered, or told they could not be taken
    in. A reply that is only the "may or may not have been taken in" notice
    (:data:`bots.base.IN_DOUBT`) does not count: it promised the answer once the service
    is back. (Discord keeps no nonce with a message, so the notice is told by its text;
    only the bot's own messages are looked at.)"""
    if bot_id is None:
        return set()
    found: set[int] = set()
    for message in messages:
        reference = message.reference
        if message.author.id != bot_id or reference is None or reference.message_id is None:
            continue
        if not (message.content or "").startswith(IN_DOUBT):
            found.add(reference.message_id)
    return found


def _gone(exc: BaseException) -> bool:
    """Whether a read failed because Discord no longer has the channel (404, Unknown
    Channel)."""
    return isinstance(exc, discord.NotFound) and exc.code == _UNKNOWN_CHANNEL


def _route_names(known: Conversations, channel_id: int) -> bool:
    """Whether an active route names the channel ``channel_id`` (its operator is told
    when it is gone)."""
    return any(match.get("channel") == str(channel_id) for match in known.routes)


def thread_parent(channel: Mapping[str, Any]) -> int | None:
    """The parent channel of a channel object Discord served, when it is a thread."""
    parent = _ident(channel.get("parent_id"))
    if channel.get("type") in _THREAD_TYPES and parent is not None and parent.isdigit():
        return int(parent)
    return None


def _made_ms(snowflake: int) -> int:
    """When the Discord id ``snowflake`` was made (epoch ms)."""
    return (snowflake >> 22) + discord.utils.DISCORD_EPOCH


def snowflake_at(ms: int) -> int:
    """The smallest Discord id made at or after epoch millisecond ``ms``."""
    return max(ms - discord.utils.DISCORD_EPOCH, 0) << 22


def _ephemeral(text: str) -> web.Response:
    return web.json_response(discord_review.ephemeral(text))


class DiscordAdapter:
    """Discord inbound (interactions endpoint, gateway) and outbound (:class:`DiscordChannel`)."""

    def __init__(
        self,
        settings: Settings,
        core: Core,
        *,
        channel: DiscordChannel | None = None,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._settings = settings.discord
        self._core = core
        self._clock = clock or SystemClock()
        #: the wait before a busy ``/ask``'s deferred response is deleted (tests make it
        #: instant)
        self._sleep = sleep
        self.channel: DiscordChannel = channel or DiscordChannel(settings.discord)
        public_key = settings.discord.public_key.strip()
        try:
            self._verify_key = VerifyKey(bytes.fromhex(public_key)) if public_key else None
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                "[discord] public_key must be the application's public key: 64 hex characters",
                rule="config.invalid",
            ) from exc
        self.gateway: _GatewayClient | None = None
        self._stopping = asyncio.Event()
        #: the running (or last) catch-up, for tests to wait on
        self.catching_up: asyncio.Task[None] | None = None
        #: a READY that came while a catch-up ran: it runs once more when that one ends
        self._ready_again = False
        self._reviews: ChatReviewBackend | None = None
        #: channel id -> its parent when it is a thread, 0 when it is none
        self._parents: Kept[int, int] = Kept(max_entries=_PARENTS_KEPT)
        #: channel id -> the look-up of its parent under way, which its messages await
        self._looking_up: dict[int, asyncio.Task[tuple[bool, int | None]]] = {}
        #: channel id -> the end of the record of its latest live message, which the
        #: next one awaits (:meth:`take_message`); gone once that record ends
        self._recording: dict[int, asyncio.Future[None]] = {}

    def enable_reviews(self, backend: ChatReviewBackend) -> None:
        """Review cards' buttons and modals on the interactions endpoint (verified like
        every interaction)."""
        self._reviews = backend

    # -- interactions ------------------------------------------------------------------------

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """Whether ``body`` carries a valid Ed25519 signature of the application's key,
        made within :data:`FRESHNESS_S` of now (the timestamp is part of what is signed)."""
        if self._verify_key is None:
            return False
        signature = headers.get("X-Signature-Ed25519", "")
        timestamp = headers.get("X-Signature-Timestamp", "")
        if not signature or not timestamp or not signature.isascii():
            return False
        if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) < 16):
            return False
        if abs(self._clock.now_ms() // 1000 - int(timestamp)) > FRESHNESS_S:
            return False
        try:
            self._verify_key.verify(timestamp.encode() + body, bytes.fromhex(signature))
        except (BadSignatureError, ValueError, TypeError):
            return False
        return True

    async def handle_interaction(self, request: web.Request) -> web.Response:
        """``POST /discord/interactions``."""
        body = await read_body(request)
        if not self.verify(request.headers, body):
            # (Discord itself checks the endpoint with a bad signature and wants a 401.)
            raise AuthError(
                "the request carries no valid Discord signature (X-Signature-Ed25519 of "
                "the application's public key, made within the last 5 minutes)",
                rule="discord.signature",
            )
        payload = json_object(body, allow_nul=True)
        kind = payload.get("type")
        if kind == _PING:
            return web.json_response({"type": _PONG})
        if kind == _APPLICATION_COMMAND:
            ask = parse_ask(payload)
            if ask is None:
                return _ephemeral(f"Use /{ASK_COMMAND} with a {ASK_OPTION}.")
            return await self._take_ask(ask)
        if self._reviews is not None and discord_review.is_review(payload):
            return web.json_response(await discord_review.handle(payload, self._reviews))
        raise ValidationError(
            f"this interaction is not one leadgate answers (only PING, /{ASK_COMMAND} "
            "and the review cards' buttons and forms)",
            rule="discord.interaction",
        )

    async def _take_ask(self, ask: AskCommand) -> web.Response:
        """Record the ask, then answer: deferred while the turn runs, or ephemeral."""
        inbound = _inbound(
            ask.guild,
            ask.channel_id,
            ask.text,
            {
                "channel_id": ask.channel_id,
                "application_id": ask.application_id,
                "interaction_token": ask.token,
                "guild_id": ask.guild_id,
            },
            f"discord:interaction:{ask.interaction_id}",
        )

        async def after(routed: Routed | None) -> None:
            # Only a plain reply with text on a non-silent binding fills the deferred
            # response. A duplicate (a replayed interaction) never touches the earlier
            # reply.
            if routed is not None and isinstance(routed.outcome, Duplicate):
                return
            if routed is None or isinstance(routed.outcome, Busy):
                # Known while recording, so this runs as the deferred answer leaves:
                # let Discord have it first, or the delete finds nothing and the
                # "thinking..." state would stay.
                await self._sleep(_DEFERRED_SETTLE_S)
            if routed is None:
                # Left to the recovery runner (this process runs too many turns): its
                # outcome is never seen here, and a gated one would leave "thinking..."
                # for good. Ended now, as a gated /ask's; a reply that comes later is a
                # follow-up (unless a reply has filled it by now: it stays).
                await self.channel.end_unanswered(ask.application_id, ask.token)
            elif not (_shows_text(routed.outcome) and not routed.route.silent):
                await self.channel.delete_original(ask.application_id, ask.token)

        async def failed(recorded: Recorded, exc: Exception) -> None:
            # A failed turn's notice fills the deferred response, but a silent route
            # posts none: "thinking..." stayed until Discord said the app did not respond.
            if recorded.route.silent:
                await self.channel.delete_original(ask.application_id, ask.token)
            elif isinstance(exc, DATABASE_FAULTS):
                # Stopped on a database fault: no notice could be queued, and the turn is
                # left to the recovery runner, whose outcome is never seen here (a gated
                # one kept "thinking..." for good). Ended now, as an /ask left to it at
                # once; its reply, if any, follows up (or goes to the channel once the
                # token's 15 minutes are over).
                await self._sleep(_DEFERRED_SETTLE_S)
                await self.channel.end_unanswered(ask.application_id, ask.token)

        try:
            recorded = await accept(
                self._core,
                inbound,
                name=f"discord-turn:interaction:{ask.interaction_id}",
                deadline_s=RECORD_DEADLINE_S,
                notice=False,
                then=after,
                failed=failed,
            )
        except DATABASE_FAULTS as exc:
            # Discord never sends an interaction again: a 503 was only its "This
            # interaction failed", and the person was never told to ask again.
            log.warning("discord: could not record an /ask (%s)", exc.rule)
            return _ephemeral(not_taken_in(exc))
        except LeadgateError as exc:
            # Refused (its worker deactivated or deleted, an identifier that cannot be
            # stored): Discord shows a 4xx only as "This interaction failed", and the
            # person never saw why. Told so, naming the rule, as a message rule's is.
            log.info("discord: an /ask was refused (%s)", exc.rule)
            return _ephemeral(not_processed(exc))
        if recorded is None:
            return _ephemeral("Nobody answers /ask in this channel.")
        if recorded.rejected is not None:
            return _ephemeral(not_processed(recorded.rejected))
        if isinstance(recorded.outcome, Duplicate):
            return _ephemeral("This request was already received.")
        # Deferred: Discord shows "thinking..." until the outbox edits the response
        # (plain turn) or ``after`` deletes it (nothing to show).
        return web.json_response({"type": _DEFERRED_CHANNEL_MESSAGE})

    # -- gateway -----------------------------------------------------------------------------

    def take_message(self, message: discord.Message) -> None:
        """Spawn the turn for one gateway message (ignores bots and the bot itself)."""
        if self._post_of(message) is None:
            return
        # A Reply is queued in the outbox; nothing else is ever shown. The gateway has no
        # answer to wait for: learn the thread's parent, record and run in the background.
        # Each message of a channel is recorded once the one before it (as the gateway
        # delivered them) was: their tasks, each with its own look-up, wait or not, and
        # on PostgreSQL two intakes begun in order commit in either order, so a person's
        # two quick messages reached the session the wrong way round (the second answered
        # without the first, or the first then Busy). Their order is taken here, where
        # the gateway hands them over one at a time.
        channel_id = message.channel.id
        before = self._recording.get(channel_id)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._recording[channel_id] = mine
        self._core.spawn(
            self._take_live(message, before, mine), name=f"discord-record:message:{message.id}"
        )

    async def _take_live(
        self,
        message: discord.Message,
        before: asyncio.Future[None] | None,
        mine: asyncio.Future[None],
    ) -> None:
        """Learn the channel's parent, wait for ``before`` (the record of the channel's
        previous message), record the message, then end ``mine`` (whatever happened)."""
        try:
            learnt, parent = await self._live_parent(message)
            if before is not None:
                await asyncio.wait((before,))
            taken = self._post_of(message, parent)
            if taken is None:
                return
            recorded = await self._take_post(*taken)
            if recorded is None and not learnt:
                await self._keep_for_read_back(message.id, message.channel.id)
        finally:
            mine.set_result(None)
            if self._recording.get(message.channel.id) is mine:
                del self._recording[message.channel.id]

    async def _keep_for_read_back(self, message_id: int, channel_id: int) -> None:
        """Store a read point for the channel ``channel_id`` of a live message (``message_id``)
        that no route took in, Discord never telling whether it is a thread (whose parent
        a route may name): the next READY's read-back reads the channel
        (:func:`catch_up_targets`), learns its parent as it does a route's channel's, and
        answers the message as live, once (a duplicate of the intake, when it was taken
        in meanwhile). Not held in memory until then: the gateway may stay up for hours.
        A WARNING says which; with the read-back off (``catch_up_s`` 0), or the database
        away, it is lost, and the WARNING says that instead."""
        why = "the read-back is off"
        if self._settings.catch_up_s > 0:
            start = _made_ms(message_id) - CATCH_UP_OVERLAP_MS
            try:
                # (kept: an earlier kept message of the channel, not read back yet, keeps
                # the point where it is)
                await self._core.advance_read_points(
                    BindingKind.discord, {str(channel_id): start}, kept=True
                )
            except DATABASE_FAULTS as exc:
                why = f"the database is unavailable ({exc.rule})"
            else:
                why = ""
        if why:
            log.warning(
                "discord: message %s in channel %s was not taken in: no route names the "
                "channel, Discord did not tell whether it is a thread (whose parent a route "
                "may name), and it is not kept for the next READY's read-back: %s",
                message_id,
                channel_id,
                why,
            )
            return
        log.warning(
            "discord: message %s in channel %s was not taken in yet: no route names the "
            "channel, and Discord did not tell whether it is a thread (whose parent a "
            "route may name); the next READY's read-back reads it",
            message_id,
            channel_id,
        )

    async def _live_parent(self, message: discord.Message) -> tuple[bool, int | None]:
        """Whether it is known if the channel of a live message is a thread, and its
        parent channel when it is one (else None). discord.py knows it for a thread it
        has cached; a channel it has not (a :class:`discord.PartialMessageable`) is
        looked up (:meth:`_parent_of`), again after each of :data:`THREAD_LOOKUP_RETRY_S`
        while Discord does not tell (a timeout, the network, a 5xx or a 429; not on
        shutdown), and one it never tells about is routed as its own channel's."""
        channel = message.channel
        if isinstance(channel, discord.Thread):
            # (Cached, maybe since an earlier message of it began its look-up: it is
            # recorded after that one all the same, :meth:`take_message`.)
            return True, channel.parent_id
        client = self.gateway
        if (
            client is None
            or not isinstance(channel, discord.PartialMessageable)
            or channel.guild_id is None
        ):
            return True, None  # a direct message, or a channel discord.py knows is no thread
        # One look-up per channel, awaited by each message of it meanwhile: a second
        # message whose own look-up told at once was recorded before the first, still
        # waiting to ask again, and the person's messages reached the session out of order.
        # (Tasks wake in the order they awaited: the order the messages came.)
        shared = self._looking_up.get(channel.id)
        if shared is None:
            if len(self._looking_up) >= _LOOKUPS_SHARED:
                return await self._look_up_parent(client, channel.id)
            shared = asyncio.ensure_future(self._look_up_parent(client, channel.id))
            self._looking_up[channel.id] = shared
            shared.add_done_callback(lambda _: self._looking_up.pop(channel.id, None))
        # (shielded: a message's task cancelled leaves the others' look-up running; the
        # gateway's stop cancels it, and then the channel is untold, as after the last try)
        try:
            return await asyncio.shield(shared)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if shared.cancelled() and (current is None or not current.cancelling()):
                return False, None
            raise

    async def _look_up_parent(
        self, client: _GatewayClient, channel_id: int
    ) -> tuple[bool, int | None]:
        """:meth:`_live_parent`'s look-up of the channel ``channel_id``, asked again after
        each of :data:`THREAD_LOOKUP_RETRY_S` while Discord does not tell."""
        waits = iter(THREAD_LOOKUP_RETRY_S)
        while True:
            try:
                async with asyncio.timeout(THREAD_LOOKUP_S):
                    return True, await self._parent_of(client, channel_id)
            except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                # (A 4xx other than 429 is Discord's answer: asked again, the same.)
                told = isinstance(exc, discord.HTTPException) and _answered(exc.status)
                wait = None if told or self._stopping.is_set() else next(waits, None)
                if wait is None:
                    log.warning(
                        "discord: could not learn whether channel %s is a thread (%s); its "
                        "message is routed as the channel's own",
                        channel_id,
                        _rest_error(exc),
                    )
                    return False, None
                log.info(
                    "discord: could not learn whether channel %s is a thread (%s); asking "
                    "again in %gs",
                    channel_id,
                    _rest_error(exc),
                    wait,
                )
            await self._wait_unless_stopping(wait)

    async def _wait_unless_stopping(self, seconds: float) -> None:
        """Wait ``seconds`` on the adapter's sleep, less when the gateway is stopping."""
        sleeping = asyncio.ensure_future(self._sleep(seconds))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((sleeping, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            stopping.cancel()

    async def _parent_of(self, client: _GatewayClient, channel_id: int) -> int | None:
        """The parent of the channel ``channel_id`` when it is a thread, else None: ``GET
        /channels/{id}`` once per channel (a thread's parent never changes; a listing of
        threads tells too, :meth:`_learn_parents`). Raises what the request raises."""
        kept = self._parents.get(_FOREVER, channel_id)
        if kept is None:
            kept = thread_parent(await client.http.get_channel(channel_id)) or 0
            self._parents.put(_FOREVER, channel_id, kept)
        return kept or None

    def _learn_parents(self, threads: list[Any]) -> list[tuple[int, int, Mapping[str, Any]]]:
        """The threads of a listing Discord served (thread id, parent, the thread), each
        parent kept (:meth:`_parent_of`); entries of another shape are passed over."""
        found: list[tuple[int, int, Mapping[str, Any]]] = []
        for thread in threads:
            if not isinstance(thread, dict):
                continue
            thread_id, parent = _ident(thread.get("id")), thread_parent(thread)
            if thread_id is None or not thread_id.isdigit() or parent is None:
                continue
            self._parents.put(_FOREVER, int(thread_id), parent)
            found.append((int(thread_id), parent, thread))
        return found

    def _post_of(
        self, message: discord.Message, parent: int | None = None
    ) -> tuple[Inbound, GatewayPost] | None:
        """The inbound of a human's message (``None`` for bots and the bot itself), in
        the thread under ``parent`` when it is one."""
        client = self.gateway
        bot_id = client.user.id if client is not None and client.user is not None else None
        post = parse_message(message, bot_id, parent)
        if post is None:
            return None
        inbound = _inbound(
            post.guild,
            post.channel_id,
            post.text,
            {
                "channel_id": post.channel_id,
                "message_id": post.message_id,
                "guild_id": post.guild_id,
            },
            f"{_MESSAGE_EVENT}{post.message_id}",
            parent=post.parent_id,
        )
        return inbound, post

    async def _take_post(self, inbound: Inbound, post: GatewayPost) -> Recorded | None:
        """Record one gateway message (None: no route took it, or the database could
        not); when the database cannot take it, tell its author in a reply (the gateway
        delivers a message once: it was lost without a word, and the failure logged with
        the driver's traceback)."""
        try:
            return await accept(self._core, inbound, name=f"discord-turn:message:{post.message_id}")
        except DATABASE_FAULTS as exc:
            log.warning("discord: could not record a gateway message (%s)", exc.rule)
            key = f"intake-fault:{post.message_id}"
            await tell_not_taken_in(self.channel, inbound, exc, key=key)
            return None

    # -- catch-up ---------------------------------------------------------------------------

    def ready(self) -> None:
        """At each gateway READY: catch up in the background (the gateway's event loop
        and the service's startup never wait for it). A READY while a catch-up runs
        (a quick reconnect) runs one more once it ends."""
        if self._settings.catch_up_s <= 0:
            return
        if self.catching_up is not None and not self.catching_up.done():
            self._ready_again = True
            return
        self.catching_up = asyncio.create_task(self._catch_up_runs(), name="discord-catch-up")

    async def _catch_up_runs(self) -> None:
        self._ready_again = True
        while self._ready_again and not self._stopping.is_set():
            self._ready_again = False
            await catch_up_until_done(self.catch_up, self._stopping, channel="discord")

    async def catch_up(self, again: bool = False) -> bool:
        """Read back and take in, oldest first, the messages of every known channel
        posted after its read point (where the last catch-up that read it through
        started, less a minute, or the newest message taken in there since, less a
        minute, when later; for a channel without one, the newest message taken in
        there, less a minute; stored as its point before anything is read), within
        ``[discord] catch_up_s`` and not before the route answering there was made, but
        not one the bot already replied to (:func:`replied_to`); and so the new threads of
        those channels (:meth:`_new_threads`) and the threads archived lately of those a
        route names (:meth:`_archived_threads`). A channel read through
        moves its point to this catch-up's start. A channel Discord would not read (a
        REST error) logs a WARNING and is read from the same point at the next READY.
        False when a database fault stopped it (tried again shortly, ``again``:
        :func:`bots.base.catch_up_until_done`); True otherwise."""
        client = self.gateway
        if client is None:
            return True
        known = await known_conversations(
            self._core,
            BindingKind.discord,
            key_prefix=_SESSION_PREFIX,
            window_s=self._settings.catch_up_s,
        )
        if known is None:
            return False
        targets = await self._learn_guilds(client, catch_up_targets(known, again=again))
        try:
            targets += await self._new_threads(client, targets, known)
            targets += await self._archived_threads(client, targets, known)
        except DATABASE_FAULTS as exc:
            log.warning("discord: catch-up stopped, the database is unavailable (%s)", exc.rule)
            return False
        starts = {str(t.channel_id): t.start_point(known.since_ms) for t in targets}
        if not await store_read_points(self._core, BindingKind.discord, starts):
            return False
        for target in targets:
            if self._stopping.is_set():
                return True
            try:
                await self._catch_up_channel(client, target, known)
            except DATABASE_FAULTS as exc:
                log.warning("discord: catch-up stopped, the database is unavailable (%s)", exc.rule)
                return False
            except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                if _gone(exc) and not _route_names(known, target.channel_id):
                    # Deleted since (a thread, often): its sessions stay, and a WARNING
                    # at every READY would say nothing anyone can act on.
                    log.info("discord: channel %s is gone; not caught up", target.channel_id)
                    continue
                log.warning(
                    "discord: could not read channel %s's messages to catch up (%s); "
                    "tried again at the next READY",
                    target.channel_id,
                    _rest_error(exc),
                )
        return True

    async def _learn_guilds(
        self, client: _GatewayClient, targets: list[CatchUpTarget]
    ) -> list[CatchUpTarget]:
        """``targets``, each channel a route names without its guild (or kept for the
        read-back by its point alone, :func:`catch_up_targets`) given its guild (``GET
        /channels/{id}``, once per such channel and READY; a thread's parent kept):
        its new and archived threads are then read as a guild channel's. One Discord
        does not tell about is left as it was (its read fetches it again and says why)."""
        learnt: list[CatchUpTarget] = []
        for target in targets:
            if target.guild_known or self._stopping.is_set():
                learnt.append(target)
                continue
            try:
                channel = await client.http.get_channel(target.channel_id)
            except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError):
                learnt.append(target)
                continue
            self._parents.put(_FOREVER, target.channel_id, thread_parent(channel) or 0)
            guild = _ident(channel.get("guild_id"))
            guild_id = int(guild) if guild is not None and guild.isdigit() else None
            learnt.append(dataclasses.replace(target, guild_id=guild_id, guild_known=True))
        return learnt

    async def _new_threads(
        self, client: _GatewayClient, targets: list[CatchUpTarget], known: Conversations
    ) -> list[CatchUpTarget]:
        """The active threads (``GET /guilds/{id}/threads/active``, once per guild) of the
        guild channels in ``targets`` that are not among them, with a message within the
        window and a route answering there, as the live path's would (a route naming the
        guild, not the thread's channel): a thread started while the service was down
        has no session, and its messages were never read. At most
        :data:`CATCH_UP_THREADS` per channel, those with the latest message first."""
        parents: dict[int, set[int]] = {}
        for target in targets:
            if target.guild_id is not None and target.guild_known:
                parents.setdefault(target.guild_id, set()).add(target.channel_id)
        have = {target.channel_id for target in targets}
        found: list[CatchUpTarget] = []
        for guild_id, channels in parents.items():
            if self._stopping.is_set():
                break
            try:
                active = await client.http.get_active_threads(guild_id)
            except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning(
                    "discord: could not read guild %s's active threads to catch up (%s); "
                    "tried again at the next READY",
                    guild_id,
                    _rest_error(exc),
                )
                continue
            by_parent: dict[int, list[tuple[int, int]]] = {}
            for thread_id, parent, thread in self._learn_parents(active.get("threads", [])):
                last = _recent_message(thread, known.since_ms)
                if parent in channels and thread_id not in have and last is not None:
                    by_parent.setdefault(parent, []).append((last, thread_id))
            for parent, threads in by_parent.items():
                if len(threads) > CATCH_UP_THREADS:
                    log.warning(
                        "discord: catch-up of channel %s reads the latest %d of its %d new threads",
                        parent,
                        CATCH_UP_THREADS,
                        len(threads),
                    )
                for _, thread_id in sorted(threads, reverse=True)[:CATCH_UP_THREADS]:
                    attrs = _route_attrs(str(guild_id), str(thread_id), str(parent))
                    if await self._core.resolve_route(BindingKind.discord.value, attrs) is None:
                        continue  # not answered live either
                    point = known.points.get(str(thread_id))
                    found.append(CatchUpTarget(thread_id, guild_id, True, None, point, parent))
        return found

    async def _archived_threads(
        self, client: _GatewayClient, targets: list[CatchUpTarget], known: Conversations
    ) -> list[CatchUpTarget]:
        """The public threads archived within the window (``GET
        /channels/{id}/threads/archived/public``: one request, at most
        :data:`CATCH_UP_ARCHIVED`, the latest archived first), and the private ones the
        bot joined (``GET /channels/{id}/users/@me/threads/archived/private``: one
        request, at most as many, the latest made first) of each guild channel in
        ``targets`` (one a route names, or one a guild-wide route reaches: a channel that
        took in messages) that is not known to be a thread, those not among ``targets``,
        with a message within the window and a route answering there. Discord archives a
        thread after an hour to a week without messages: one whose messages came while
        the service was down, then went quiet, is in no listing of active threads."""
        have = {target.channel_id for target in targets}
        found: list[CatchUpTarget] = []
        for target in targets:
            if self._stopping.is_set():
                break
            in_guild = target.guild_id is not None or not target.guild_known
            a_thread = target.parent is not None or self._parents.get(_FOREVER, target.channel_id)
            if not in_guild or a_thread:
                continue
            for kind, listing in (
                ("archived", client.http.get_public_archived_threads),
                ("joined private archived", client.http.get_joined_private_archived_threads),
            ):
                try:
                    page = await listing(target.channel_id, limit=CATCH_UP_ARCHIVED)
                except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                    if isinstance(exc, discord.HTTPException) and exc.code == _NOT_THIS_TYPE:
                        break  # the route names a thread (or a voice channel): no threads
                    log.warning(
                        "discord: could not read channel %s's %s threads to catch up (%s); "
                        "tried again at the next READY",
                        target.channel_id,
                        kind,
                        _rest_error(exc),
                    )
                    continue
                for thread_id, guild in self._archived_recently(page, target.channel_id, known):
                    if thread_id in have:
                        continue
                    attrs = _route_attrs(guild, str(thread_id), str(target.channel_id))
                    if await self._core.resolve_route(BindingKind.discord.value, attrs) is None:
                        continue
                    have.add(thread_id)
                    point = known.points.get(str(thread_id))
                    found.append(
                        CatchUpTarget(thread_id, int(guild), True, None, point, target.channel_id)
                    )
        return found

    def _archived_recently(
        self, page: Mapping[str, Any], channel_id: int, known: Conversations
    ) -> list[tuple[int, str]]:
        """The threads (id, guild) of one listing of ``channel_id``'s archived threads
        (``page``) archived within the window with a message within it too (a WARNING
        when every one listed was and Discord has more: the older are not read)."""
        listed = self._learn_parents(page.get("threads", []))
        recent = [
            (thread_id, thread)
            for thread_id, parent, thread in listed
            if parent == channel_id and _archived_since(thread, known.since_ms)
        ]
        if page.get("has_more") is True and recent and len(recent) == len(listed):
            log.warning(
                "discord: catch-up of channel %s reads the latest %d of its archived threads only",
                channel_id,
                len(recent),
            )
        found: list[tuple[int, str]] = []
        for thread_id, thread in recent:
            guild = _ident(thread.get("guild_id"))
            if _recent_message(thread, known.since_ms) is None:
                continue
            if guild is not None and guild.isdigit():
                found.append((thread_id, guild))
        return found

    async def _catch_up_channel(
        self, client: _GatewayClient, target: CatchUpTarget, known: Conversations
    ) -> None:
        channel: discord.abc.Messageable
        guild_id = target.guild_id
        # A channel a route names is answered by that route: its parent, when a listing of
        # threads told it, only ranks a route naming the thread first, as live.
        parent = target.parent or self._parents.get(_FOREVER, target.channel_id) or None
        routed = _route_names(known, target.channel_id)
        if target.guild_known:
            channel = client.get_partial_messageable(target.channel_id, guild_id=guild_id)
            if parent is None and guild_id is not None and not routed:
                # A session's channel may be a thread, which its parent's route answers
                # as it did live.
                parent = await self._parent_of(client, target.channel_id)
        else:
            # Only a route names it, without its guild: the live path's session key and
            # route keys carry the guild, so learn it from Discord.
            fetched = await client.fetch_channel(target.channel_id)
            if not isinstance(fetched, discord.abc.Messageable):
                return
            channel = fetched
            guild = getattr(fetched, "guild", None)
            guild_id = guild.id if guild is not None else None
            if parent is None and isinstance(fetched, discord.Thread):
                # (a channel kept for the read-back, whose guild was not learnt first)
                parent = fetched.parent_id
        attrs = _route_attrs(
            str(guild_id) if guild_id else "@me",
            str(target.channel_id),
            str(parent) if parent else None,
        )
        route = await self._core.resolve_route(BindingKind.discord.value, attrs)
        if route is None:
            return
        # (the point stored before anything was read)
        point = target.start_point(known.since_ms)
        after = snowflake_at(max(known.since_ms, route.created_at, point))
        limit = CATCH_UP_PAGES * 100
        # Every page first: the bot's replies come after the messages they answer, and a
        # message it already replied to (its intake record lost, or the person told it
        # could not be taken in, who may have sent it again) is not answered again.
        # Newest first, as Slack's: past the limit the oldest are dropped, not the newest
        # (the next READY starts from the newest taken in, a live one by then, and those
        # between would never be read).
        read: list[discord.Message] = []
        history = channel.history(limit=limit, after=discord.Object(after), oldest_first=False)
        async for message in history:
            if self._stopping.is_set():
                return
            read.append(message)
        read.reverse()
        answered = replied_to(read, client.user.id if client.user is not None else None)
        for message in read:
            if self._stopping.is_set():
                return
            if message.id in answered:
                log.info("discord: catch-up leaves message %s, already replied to", message.id)
                continue
            taken = self._post_of(message, parent)
            if taken is None:
                continue
            try:
                # Not _take_post: a database fault stops the catch-up (tried again
                # shortly, _catch_up_runs), and no author of an old message is told "could
                # not be taken in, send it again" (each remaining one was, in turn).
                await accept(self._core, taken[0], name=f"discord-turn:message:{message.id}")
            except DATABASE_FAULTS:
                raise
            except LeadgateError as exc:
                # As a live message's would (logged as its task ends): the next is read on.
                log.warning(
                    "discord: catch-up could not take message %s in (%s)", message.id, exc.rule
                )
        if len(read) >= limit:
            log.warning(
                "discord: catch-up of channel %s read its latest %d messages only; older "
                "ones are not answered",
                target.channel_id,
                len(read),
            )
        # Read through: every message posted before this catch-up started was read (the
        # minute less for clocks apart, as for the newest taken in).
        await self._core.advance_read_points(
            BindingKind.discord,
            {str(target.channel_id): known.read_at_ms - CATCH_UP_OVERLAP_MS},
            read_through=True,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """The gateway connection, when a bot token is set."""
        if not self._settings.bot_token.strip():
            yield
            return
        async with self._gateway():
            yield

    @contextlib.asynccontextmanager
    async def _gateway(self) -> AsyncIterator[None]:
        intents = discord.Intents.default()
        intents.message_content = True
        quiet_voice_warning()
        client = _GatewayClient(self.take_message, self.ready, intents=intents)
        self.gateway = client
        self._stopping = asyncio.Event()
        task = asyncio.create_task(self._run_gateway(client), name="discord-gateway")
        try:
            yield
        finally:
            self._stopping.set()
            await client.close()
            # A shared look-up may be inside its request (up to THREAD_LOOKUP_S): cut
            # short, its messages routed as after the last try (and kept for the read-back).
            looking_up = list(self._looking_up.values())
            for lookup in looking_up:
                lookup.cancel()
            await asyncio.gather(*looking_up, return_exceptions=True)
            # (Closing the client ends a catch-up's reads; one taking a message in ends
            # that first.)
            for running in (task, self.catching_up):
                if running is None:
                    continue
                try:
                    async with asyncio.timeout(_GATEWAY_CLOSE_TIMEOUT_S):
                        await running
                except TimeoutError:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
            self.gateway = None

    async def _run_gateway(self, client: _GatewayClient) -> None:
        # In the background: the service starts even while Discord is unreachable. Once
        # connected, discord.py reconnects by itself; until then (login failing on the
        # network or a 5xx) this loop tries again with a capped backoff.
        token = self._settings.bot_token.strip()
        delay = _GATEWAY_FIRST_RETRY_S
        while not self._stopping.is_set():
            try:
                await client.start(token, reconnect=True)
                return  # closed on shutdown
            except discord.LoginFailure:
                log.error("discord: the bot token was rejected; gateway messages are off")
                return
            except (OSError, aiohttp.ClientError, discord.GatewayNotFound) as exc:
                log.warning("discord: gateway unreachable (%r); retrying in %.0fs", exc, delay)
            except discord.HTTPException as exc:
                if _answered(exc.status):
                    log.error("discord: gateway login failed: %s; gateway messages are off", exc)
                    return
                log.warning("discord: gateway login failed (%s); retrying in %.0fs", exc, delay)
            except Exception as exc:
                log.error(
                    "discord: the gateway connection ended with an error", exc_info=loggable(exc)
                )
                return
            # start() logs in afresh on the next try; drop this try's HTTP session.
            await client.http.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            delay = min(delay * 2, _GATEWAY_MAX_RETRY_S)

    # -- Adapter protocol --------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        """Add the interactions route (with a public key)."""
        if self._verify_key is not None:
            app.router.add_post(INTERACTIONS_PATH, answering_errors(self.handle_interaction))


def _answered(status: int) -> bool:
    """Whether Discord's HTTP ``status`` is its answer, the same if asked again (a 4xx
    other than 429), not a failure to answer (a 5xx, a 429)."""
    return status < 500 and status != 429


def _rest_error(exc: BaseException) -> str:
    """A REST failure in a few words (Discord's status and message, or the error)."""
    if isinstance(exc, discord.HTTPException):
        return f"{exc.status} {exc.text or exc.__class__.__name__}"
    return repr(exc)


def _recent_message(thread: Mapping[str, Any], since_ms: int) -> int | None:
    """The id of a listed thread's last message when it was posted at or after
    ``since_ms``, else None."""
    last = _ident(thread.get("last_message_id"))
    if last is None or not last.isdigit() or _made_ms(int(last)) < since_ms:
        return None
    return int(last)


def _archived_since(thread: Mapping[str, Any], since_ms: int) -> bool:
    """Whether a listed thread was archived at or after ``since_ms``."""
    metadata = thread.get("thread_metadata")
    stamp = metadata.get("archive_timestamp") if isinstance(metadata, dict) else None
    if not isinstance(stamp, str):
        return False
    try:
        archived = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        return False
    return archived.timestamp() * 1000 >= since_ms


def _shows_text(outcome: object) -> bool:
    """Whether a turn's outcome posts anything: a reply with more than whitespace (one
    with none is no post on any channel, see :meth:`outbox.relay.Relay.deliver`)."""
    return isinstance(outcome, Reply) and bool(outcome.text.strip())


def _route_attrs(guild: str, channel_id: str, parent: str | None = None) -> dict[str, str]:
    """The route keys of a message in ``guild``/``channel_id`` (a thread under ``parent``:
    a route naming the parent answers there, unless one names the thread)."""
    attrs = {"guild": guild, "channel": channel_id}
    if parent is not None:
        attrs[ROUTE_PARENT] = parent
    return attrs


def _inbound(
    guild: str,
    channel_id: str,
    text: str,
    address: dict[str, Any],
    event_id: str,
    *,
    parent: str | None = None,
) -> Inbound:
    """A message in ``guild``/``channel_id``: one session per channel (a thread is its
    own, replied to in the thread)."""
    return Inbound(
        channel=BindingKind.discord,
        route_attrs=_route_attrs(guild, channel_id, parent),
        session_key=f"discord:{guild}:{channel_id}",
        text=text,
        address=address,
        external_event_id=event_id,
    )


def create(settings: Settings, core: Core) -> DiscordAdapter | None:
    """The Discord adapter, or ``None`` when neither ``public_key`` nor ``bot_token`` is set."""
    if not settings.discord.on:
        return None
    configure_endpoints(settings.discord)
    return DiscordAdapter(settings, core)
