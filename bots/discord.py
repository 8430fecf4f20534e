"""Discord: HTTP interactions and the gateway in, discord.py's REST client out.

Inbound, two ways:

* ``POST /discord/interactions`` (when ``[discord] public_key`` is set): the Ed25519
  signature is checked with PyNaCl (401 and no turn when it fails), PING is answered,
  and the slash command ``ask`` (one string option ``message``) is answered at once with
  a deferred response (type 5, well inside Discord's 3 seconds) while the turn runs in
  the background. A plain turn's reply reaches the user when the outbox edits that
  deferred response; for a gated, busy, duplicate, silent or unrouted turn the deferred
  response is deleted, so no "thinking..." state lingers and nothing is visible.
* the gateway (when ``bot_token`` is set): a discord.py :class:`discord.Client` with the
  message-content intent; a human message becomes a trigger answered as a reply to it.

Outbound: :class:`DiscordChannel` posts through discord.py's HTTP client. Channel posts
carry a nonce derived from the delivery's idempotency key with ``enforce_nonce``, so
Discord itself drops a repeat inside its de-duplication window.

discord.py keeps its REST base and gateway URL in class attributes
(``discord.http.Route.BASE``, ``DiscordWebSocket.DEFAULT_GATEWAY``); :func:`create` sets
them once from the settings, which is how tests point the real SDK at a stand-in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import discord
import discord.gateway
import discord.http
import yarl
from aiohttp import web
from discord.webhook.async_ import async_context as _webhook_adapter
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from bots.base import Core
from engine.config import DiscordSettings, Settings
from engine.errors import ConfigError
from engine.types import BindingKind, BindingSpec, Reply, Trigger
from outbox.channel import OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain

log = logging.getLogger(__name__)

INTERACTIONS_PATH = "/discord/interactions"
ASK_COMMAND = "ask"
ASK_OPTION = "message"

# Interaction and callback types (Discord API v10).
_PING = 1
_APPLICATION_COMMAND = 2
_PONG = 1
_CHANNEL_MESSAGE = 4
_DEFERRED_CHANNEL_MESSAGE = 5
_EPHEMERAL = 1 << 6

# Discord accepts a nonce of at most 25 characters.
_NONCE_LEN = 25
# A model's text must never ping @everyone/roles; a reply may ping its author.
_ALLOWED_MENTIONS = discord.AllowedMentions(
    everyone=False, users=False, roles=False, replied_user=True
)
_WEBHOOK_ALLOWED_MENTIONS: dict[str, Any] = {"parse": []}
# Interaction tokens live 15 minutes; remembering a few thousand is plenty.
_MAX_TRACKED_INTERACTIONS = 4096
# Gateway connection: shutdown bound, and the backoff while Discord cannot be reached.
_GATEWAY_CLOSE_TIMEOUT_S = 10.0
_GATEWAY_FIRST_RETRY_S = 2.0
_GATEWAY_MAX_RETRY_S = 60.0


def nonce_for(idempotency_key: str) -> str:
    """A stable Discord nonce (<= 25 characters) for one delivery."""
    return hashlib.sha256(idempotency_key.encode()).hexdigest()[:_NONCE_LEN]


def _quiet_voice_warning() -> None:
    # discord.py warns once per process that voice is unsupported; leadgate never uses
    # voice, so the warning is only noise in the service's log.
    discord.VoiceClient.warn_dave = False


def configure_endpoints(settings: DiscordSettings) -> None:
    """Point discord.py's class-level REST base (and gateway URL, if set) at ``settings``.

    Both are process-wide in discord.py, so this is done once, at :func:`create` time.
    """
    discord.http.Route.BASE = settings.api_url.rstrip("/")
    if settings.gateway_url:
        discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(settings.gateway_url)


# -- what a send's HTTP requests did -------------------------------------------------------


@dataclass
class _Wire:
    """What the write requests of one send did, as seen by aiohttp's tracing.

    discord.py retries 5xx answers and short rate limits by itself, re-sending the same
    request; the send as a whole is bounded by one deadline. When that deadline strikes,
    this record says whether a write was out on the wire (maybe posted: Uncertain),
    answered with 2xx (posted), or whether every attempt was answered without posting
    and we were merely waiting for the next one (Retry).
    """

    in_flight: bool = False
    written: bool = False
    lost_after_write: bool = False
    posted: bool = False
    last_status: int | None = None


_WIRE: contextvars.ContextVar[_Wire | None] = contextvars.ContextVar(
    "leadgate_discord_wire", default=None
)


def _is_write(method: str) -> bool:
    # Login and lookups are GETs; only writes can post something.
    return method.upper() not in ("GET", "HEAD", "OPTIONS")


def _trace_config() -> aiohttp.TraceConfig:
    """Trace callbacks run in the task that makes the request, so a ContextVar set in
    :meth:`DiscordChannel.send` tells which send a request belongs to."""

    async def on_start(
        session: aiohttp.ClientSession,
        ctx: SimpleNamespace,
        params: aiohttp.TraceRequestStartParams,
    ) -> None:
        wire = _WIRE.get()
        if wire is not None and _is_write(params.method):
            wire.in_flight, wire.written = True, False

    async def on_headers_sent(
        session: aiohttp.ClientSession,
        ctx: SimpleNamespace,
        params: aiohttp.TraceRequestHeadersSentParams,
    ) -> None:
        wire = _WIRE.get()
        if wire is not None and _is_write(params.method):
            wire.written = True

    async def on_end(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams
    ) -> None:
        wire = _WIRE.get()
        if wire is not None and _is_write(params.method):
            wire.in_flight = False
            wire.last_status = params.response.status
            if 200 <= params.response.status < 300:
                wire.posted = True

    async def on_exception(
        session: aiohttp.ClientSession,
        ctx: SimpleNamespace,
        params: aiohttp.TraceRequestExceptionParams,
    ) -> None:
        wire = _WIRE.get()
        if wire is not None and _is_write(params.method):
            if wire.written:
                wire.lost_after_write = True
            wire.in_flight = False

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    trace.on_request_headers_sent.append(on_headers_sent)
    trace.on_request_end.append(on_end)
    trace.on_request_exception.append(on_exception)
    return trace


class _NotConfigured(Exception):
    """The address or the settings make this send impossible (never retried)."""


# -- outbound ------------------------------------------------------------------------------


class DiscordChannel:
    """Outbound Discord through discord.py.

    * ``kind == "reply"`` with an interaction token: edit the deferred original response
      (``PATCH /webhooks/{app}/{token}/messages/@original``); an edit is idempotent. A
      further message with a different idempotency key for the same interaction (the
      relay's next chunk) becomes a follow-up instead of overwriting the first.
    * otherwise (approved output, gateway replies): ``POST /channels/{id}/messages`` as
      the bot, with ``nonce`` + ``enforce_nonce`` and a reply reference when the address
      has a ``message_id``. Without a bot token, an interaction's follow-up webhook is
      the only way left (valid for the token's 15 minutes).

    Every send is bounded by ``timeout_s``, including discord.py's own retries of 5xx
    answers and short rate limits.
    """

    name = "discord"
    max_chars = 2000

    def __init__(self, settings: DiscordSettings, *, timeout_s: float = 20.0) -> None:
        self._token = settings.bot_token.strip()
        self._timeout_s = timeout_s
        self._trace = _trace_config()
        self._client: discord.Client | None = None
        self._logged_in = False
        self._login_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        # interaction token -> idempotency key of the message that owns @original
        self._original_owner: collections.OrderedDict[str, str] = collections.OrderedDict()

    # -- plumbing ------------------------------------------------------------------------

    def _webhook_session(self) -> aiohttp.ClientSession:
        # Interaction webhooks need no bot token, so they get a session of their own.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(trace_configs=[self._trace])
        return self._session

    async def _logged_in_client(self) -> discord.Client:
        if not self._token:
            raise _NotConfigured("discord: no bot token to post to a channel")
        async with self._login_lock:
            if self._client is None or self._client.is_closed():
                _quiet_voice_warning()
                self._client = discord.Client(
                    # No gateway connection is made; default intents only keep
                    # discord.py from warning about a disabled guilds intent.
                    intents=discord.Intents.default(),
                    http_trace=self._trace,
                    # The smallest value discord.py allows: a longer rate limit is
                    # raised (RateLimited) and becomes a Retry with its delay instead
                    # of a sleep inside the send.
                    max_ratelimit_timeout=30.0,
                )
                self._logged_in = False
            if not self._logged_in:
                # GET /users/@me and /oauth2/applications/@me: nothing is posted.
                await self._client.login(self._token)
                self._logged_in = True
            return self._client

    # -- Channel protocol ----------------------------------------------------------------

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post one message; every platform error is mapped, never raised."""
        wire = _Wire()
        reset = _WIRE.set(wire)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._send(message)
        except _NotConfigured as exc:
            return Permanent(str(exc))
        except discord.LoginFailure as exc:
            return Permanent(f"discord: bot token rejected: {exc}")
        except discord.RateLimited as exc:
            return Retry(f"discord: rate limited: {exc}", delay_s=exc.retry_after)
        except discord.HTTPException as exc:
            return _map_http_error(exc)
        except TimeoutError:
            return _on_deadline(wire, self._timeout_s)
        except aiohttp.ClientConnectorError as exc:
            # No connection was made, so nothing was written.
            return Retry(f"discord: cannot connect: {exc}")
        except (aiohttp.ClientError, OSError) as exc:
            if wire.written or wire.lost_after_write:
                return Uncertain(f"discord: connection lost after sending: {exc!r}")
            return Retry(f"discord: connection failed before sending: {exc!r}")
        except Exception as exc:  # an SDK surprise must not crash the relay
            log.exception("discord: unexpected error while sending")
            return Uncertain(f"discord: unexpected error: {exc!r}")
        finally:
            _WIRE.reset(reset)

    async def _send(self, message: OutboundMessage) -> SendOutcome:
        address = message.address
        token = _str(address.get("interaction_token"))
        app_id = _snowflake(address.get("application_id"))
        if message.kind == "reply" and token and app_id:
            owner = self._original_owner.get(token)
            if owner is None or owner == message.idempotency_key:
                self._remember_owner(token, message.idempotency_key)
                return await self._edit_original(app_id, token, message.text)
            return await self._follow_up(app_id, token, message.text)
        channel_id = _snowflake(address.get("channel_id"))
        if channel_id is None:
            if token and app_id:
                return await self._follow_up(app_id, token, message.text)
            raise _NotConfigured("discord: binding address has no channel_id")
        if not self._token and token and app_id:
            return await self._follow_up(app_id, token, message.text)
        client = await self._logged_in_client()
        guild_id = _snowflake(address.get("guild_id"))
        reference: discord.MessageReference | None = None
        message_id = _snowflake(address.get("message_id"))
        if message_id is not None:
            reference = discord.MessageReference(
                message_id=message_id,
                channel_id=channel_id,
                guild_id=guild_id,
                # The triggering message may be gone by approval time: post anyway.
                fail_if_not_exists=False,
            )
        target = client.get_partial_messageable(channel_id, guild_id=guild_id)
        # discord.py sends the nonce with enforce_nonce=true (http.handle_message_parameters).
        sent = await target.send(
            message.text,
            nonce=nonce_for(message.idempotency_key),
            # None is the implementation's default; only the overload stubs omit it.
            reference=reference,  # type: ignore[arg-type]
            allowed_mentions=_ALLOWED_MENTIONS,
        )
        return Sent(str(sent.id))

    def _remember_owner(self, token: str, key: str) -> None:
        self._original_owner[token] = key
        self._original_owner.move_to_end(token)
        while len(self._original_owner) > _MAX_TRACKED_INTERACTIONS:
            self._original_owner.popitem(last=False)

    async def _edit_original(self, app_id: int, token: str, text: str) -> SendOutcome:
        data = await _webhook_adapter.get().edit_original_interaction_response(
            app_id,
            token,
            session=self._webhook_session(),
            payload={"content": text, "allowed_mentions": _WEBHOOK_ALLOWED_MENTIONS},
        )
        return Sent(_message_id(data))

    async def _follow_up(self, app_id: int, token: str, text: str) -> SendOutcome:
        data = await _webhook_adapter.get().execute_webhook(
            app_id,
            token,
            session=self._webhook_session(),
            payload={"content": text, "allowed_mentions": _WEBHOOK_ALLOWED_MENTIONS},
            wait=True,
        )
        return Sent(_message_id(data))

    async def delete_original(self, application_id: str, token: str) -> bool:
        """Delete an interaction's deferred response (best effort; True when gone)."""
        app_id = _snowflake(application_id)
        if app_id is None or not token:
            return False
        try:
            async with asyncio.timeout(self._timeout_s):
                await _webhook_adapter.get().delete_original_interaction_response(
                    app_id, token, session=self._webhook_session()
                )
            return True
        except discord.NotFound:
            return True
        except Exception as exc:
            log.warning("discord: could not delete the deferred response: %r", exc)
            return False

    async def close(self) -> None:
        """Close discord.py's HTTP session and the webhook session (idempotent)."""
        client, self._client = self._client, None
        self._logged_in = False
        if client is not None and not client.is_closed():
            await client.close()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


def _on_deadline(wire: _Wire, timeout_s: float) -> SendOutcome:
    if wire.posted:
        # A write was answered 2xx before the deadline cut the rest short.
        return Sent(None)
    if (wire.in_flight and wire.written) or wire.lost_after_write:
        return Uncertain(f"discord: no answer within {timeout_s:g}s; the post may have landed")
    # Nothing of ours was on the wire: every attempt so far was answered without
    # posting (5xx, rate limit) or never left (connecting, waiting on a bucket).
    status = f" (last answer HTTP {wire.last_status})" if wire.last_status else ""
    return Retry(f"discord: not sent within {timeout_s:g}s{status}")


def _map_http_error(exc: discord.HTTPException) -> SendOutcome:
    what = f"discord: HTTP {exc.status} code {exc.code}: {exc.text}".rstrip(": ")
    if exc.status == 429:
        return Retry(what, delay_s=_retry_after(exc))
    if exc.status >= 500:
        # An answer from Discord (after discord.py's own retries, all with the same
        # nonce): not created. Retrying later with the same nonce is safe.
        return Retry(what)
    # 400 (bad body, too long), 401 (token), 403 (missing access), 404 (unknown channel,
    # expired interaction): the same request will never succeed.
    return Permanent(what)


def _retry_after(exc: discord.HTTPException) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _message_id(data: Any) -> str | None:
    if isinstance(data, Mapping) and data.get("id") is not None:
        return str(data["id"])
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _snowflake(value: Any) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


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

    @property
    def guild(self) -> str:
        """Guild id, ``@me`` for a direct message."""
        return self.guild_id or "@me"


def parse_ask(payload: Mapping[str, Any]) -> AskCommand | None:
    """The ``ask`` command of an APPLICATION_COMMAND interaction, else ``None``."""
    data = payload.get("data") or {}
    if payload.get("type") != _APPLICATION_COMMAND or data.get("name") != ASK_COMMAND:
        return None
    text = ""
    for option in data.get("options") or []:
        if option.get("name") == ASK_OPTION and isinstance(option.get("value"), str):
            text = option["value"].strip()
    channel_id = payload.get("channel_id") or (payload.get("channel") or {}).get("id")
    interaction_id = payload.get("id")
    application_id = payload.get("application_id")
    token = payload.get("token")
    if not (text and channel_id and interaction_id and application_id and token):
        return None
    guild_id = payload.get("guild_id")
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


def parse_message(message: discord.Message, bot_user_id: int | None) -> GatewayPost | None:
    """A :class:`GatewayPost` for a human's message, ``None`` for bots and the bot itself."""
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
    )


class _GatewayClient(discord.Client):
    """A gateway client that hands every message to one callback."""

    def __init__(self, on_post: Callable[[discord.Message], None], **options: Any) -> None:
        super().__init__(**options)
        self._on_post = on_post

    async def on_message(self, message: discord.Message) -> None:
        """Called by discord.py for each MESSAGE_CREATE."""
        self._on_post(message)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class DiscordAdapter:
    """Discord inbound (interactions endpoint, gateway) and outbound (:class:`DiscordChannel`)."""

    def __init__(
        self, settings: Settings, core: Core, *, channel: DiscordChannel | None = None
    ) -> None:
        self._settings = settings.discord
        self._core = core
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

    # -- interactions ------------------------------------------------------------------------

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """Whether ``body`` carries a valid Ed25519 signature of the application's key."""
        if self._verify_key is None:
            return False
        signature = headers.get("X-Signature-Ed25519", "")
        timestamp = headers.get("X-Signature-Timestamp", "")
        if not signature or not timestamp:
            return False
        try:
            self._verify_key.verify(timestamp.encode() + body, bytes.fromhex(signature))
        except (BadSignatureError, ValueError, TypeError):
            return False
        return True

    async def handle_interaction(self, request: web.Request) -> web.Response:
        """``POST /discord/interactions``."""
        body = await request.read()
        if not self.verify(request.headers, body):
            return _error(401, "invalid request signature")
        try:
            payload = json.loads(body)
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(payload, dict):
            return _error(400, "body is not a JSON object")
        kind = payload.get("type")
        if kind == _PING:
            return web.json_response({"type": _PONG})
        if kind == _APPLICATION_COMMAND:
            ask = parse_ask(payload)
            if ask is None:
                return web.json_response(
                    {
                        "type": _CHANNEL_MESSAGE,
                        "data": {
                            "content": f"Use /{ASK_COMMAND} with a {ASK_OPTION}.",
                            "flags": _EPHEMERAL,
                        },
                    }
                )
            self._core.spawn(
                self._run_ask(ask), name=f"discord-turn:interaction:{ask.interaction_id}"
            )
            # Deferred: Discord shows "thinking..." until the outbox edits the response
            # (plain turn) or _run_ask deletes it (nothing to show).
            return web.json_response({"type": _DEFERRED_CHANNEL_MESSAGE})
        return _error(400, f"unsupported interaction type {kind!r}")

    async def _run_ask(self, ask: AskCommand) -> None:
        visible = False
        try:
            routed = await self._routed_trigger(
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
            if routed is None:
                return
            trigger, silent = routed
            outcome = await self._core.submit(trigger)
            # Only a plain reply on a non-silent binding fills the deferred response.
            visible = isinstance(outcome, Reply) and not silent
        finally:
            if not visible:
                await self.channel.delete_original(ask.application_id, ask.token)

    # -- gateway -----------------------------------------------------------------------------

    def take_message(self, message: discord.Message) -> None:
        """Spawn the turn for one gateway message (ignores bots and the bot itself)."""
        client = self.gateway
        bot_id = client.user.id if client is not None and client.user is not None else None
        post = parse_message(message, bot_id)
        if post is None:
            return
        self._core.spawn(self._run_post(post), name=f"discord-turn:message:{post.message_id}")

    async def _run_post(self, post: GatewayPost) -> None:
        routed = await self._routed_trigger(
            post.guild,
            post.channel_id,
            post.text,
            {
                "channel_id": post.channel_id,
                "message_id": post.message_id,
                "guild_id": post.guild_id,
            },
            f"discord:message:{post.message_id}",
        )
        if routed is not None:
            # A Reply is already queued in the outbox; nothing else is ever shown.
            await self._core.submit(routed[0])

    async def _routed_trigger(
        self, guild: str, channel_id: str, text: str, address: dict[str, Any], event_id: str
    ) -> tuple[Trigger, bool] | None:
        """The Trigger for a message in ``guild``/``channel_id`` and whether its route is
        silent; ``None`` (logged) when no route answers there."""
        route = await self._core.resolve_route(
            BindingKind.discord.value, {"guild": guild, "channel": channel_id}
        )
        if route is None:
            log.info("discord: no route for guild=%s channel=%s", guild, channel_id)
            return None
        trigger = Trigger(
            org_id=route.org_id,
            agent_id=route.agent_id,
            session_key=f"discord:{guild}:{channel_id}",
            text=text,
            binding=BindingSpec(
                kind=BindingKind.discord,
                address=address,
                silent=route.silent,
                route_id=route.route_id,
            ),
            external_event_id=event_id,
        )
        return trigger, route.silent

    async def _gateway_lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        intents = discord.Intents.default()
        intents.message_content = True
        _quiet_voice_warning()
        client = _GatewayClient(self.take_message, intents=intents)
        self.gateway = client
        self._stopping = asyncio.Event()
        task = asyncio.create_task(self._run_gateway(client), name="discord-gateway")
        try:
            yield
        finally:
            self._stopping.set()
            await client.close()
            try:
                async with asyncio.timeout(_GATEWAY_CLOSE_TIMEOUT_S):
                    await task
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
                if exc.status < 500 and exc.status != 429:
                    log.error("discord: gateway login failed: %s; gateway messages are off", exc)
                    return
                log.warning("discord: gateway login failed (%s); retrying in %.0fs", exc, delay)
            except Exception:
                log.exception("discord: the gateway connection ended with an error")
                return
            # start() logs in afresh on the next try; drop this try's HTTP session.
            await client.http.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            delay = min(delay * 2, _GATEWAY_MAX_RETRY_S)

    # -- Adapter protocol --------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        """Add the interactions route (with a public key) and the gateway (with a token)."""
        if self._verify_key is not None:
            app.router.add_post(INTERACTIONS_PATH, self.handle_interaction)
        if self._settings.bot_token.strip():
            app.cleanup_ctx.append(self._gateway_lifecycle)
        app.cleanup_ctx.append(self._channel_lifecycle)

    async def _channel_lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        yield
        # close() is idempotent, so the relay closing the channel too is harmless.
        await self.channel.close()


def create(settings: Settings, core: Core) -> DiscordAdapter | None:
    """The Discord adapter, or ``None`` when neither ``public_key`` nor ``bot_token`` is set."""
    if not settings.discord.public_key.strip() and not settings.discord.bot_token.strip():
        return None
    configure_endpoints(settings.discord)
    return DiscordAdapter(settings, core)
