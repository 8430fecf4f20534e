"""Discord, outbound: discord.py's REST client posting approved output and replies.

:class:`DiscordChannel` posts through discord.py's HTTP client. Channel posts carry a
nonce derived from the delivery's idempotency key with ``enforce_nonce``, so Discord
itself drops a repeat inside its de-duplication window; a slash command's reply fills
(or, when there is nothing to show, deletes) the interaction's deferred response.

discord.py keeps its REST base and gateway URL in class attributes
(``discord.http.Route.BASE``, ``DiscordWebSocket.DEFAULT_GATEWAY``);
:func:`configure_endpoints` sets them once from the settings, which is how tests point
the real SDK at a stand-in.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
import logging
import math
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import discord
import discord.gateway
import discord.http
import yarl
from discord.webhook.async_ import async_context as _webhook_adapter

from bots import discord_review
from bots.base import quoted_page
from leadgate.core.config import DiscordSettings
from leadgate.core.logs import raised_at
from outbox.channel import OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain

log = logging.getLogger(__name__)


# Discord accepts a nonce of at most 25 characters.
_NONCE_LEN = 25
# A model's text must never ping @everyone/roles; a reply may ping its author.
_ALLOWED_MENTIONS = discord.AllowedMentions(
    everyone=False, users=False, roles=False, replied_user=True
)
_WEBHOOK_ALLOWED_MENTIONS: dict[str, Any] = {"parse": []}
# Interaction tokens live 15 minutes; remembering a few thousand is plenty.
_MAX_TRACKED_INTERACTIONS = 4096
# The owner of an interaction's @original once it was deleted (no delivery's key).
_DELETED = ""


def nonce_for(idempotency_key: str) -> str:
    """A stable Discord nonce (<= 25 characters) for one delivery."""
    return hashlib.sha256(idempotency_key.encode()).hexdigest()[:_NONCE_LEN]


def quiet_voice_warning() -> None:
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
    #: A write answered 2xx with a body that is not Discord's JSON (a captive portal's or
    #: a proxy's page): its status, and its quote (quoted_page) once discord.py reads it.
    foreign_status: int | None = None
    foreign_body: str = ""
    #: A 429's ``Retry-After`` header (seconds), when the last write was answered so.
    retry_after_s: float | None = None

    def refused_unposted(self) -> bool:
        """Whether the last write was answered 429 or 5xx (nothing posted: Discord and
        any proxy on the way answer so before doing anything) and nothing else is out."""
        status = self.last_status
        return (
            status is not None
            and (status == 429 or status >= 500)
            and not (self.posted or self.in_flight or self.lost_after_write)
        )


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
            status = wire.last_status = params.response.status
            wire.retry_after_s = (
                _seconds(params.response.headers.get("Retry-After")) if status == 429 else None
            )
            if 200 <= status < 300:
                if status == 204 or _is_discord_json(params.response.headers):
                    wire.posted = True
                else:
                    wire.foreign_status = status

    async def on_chunk(
        session: aiohttp.ClientSession,
        ctx: SimpleNamespace,
        params: aiohttp.TraceResponseChunkReceivedParams,
    ) -> None:
        # discord.py reads a body whole, so its one "chunk" is the page itself.
        wire = _WIRE.get()
        if wire is not None and wire.foreign_status is not None and not wire.foreign_body:
            wire.foreign_body = quoted_page(params.chunk)

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
    trace.on_response_chunk_received.append(on_chunk)
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
      relay's next chunk, known by its key whatever this process remembers) becomes a
      follow-up instead of overwriting the first, as does a reply whose deferred
      response was deleted (:meth:`end_unanswered`; Discord's 404 Unknown Message).
      Once the interaction's token has expired (Discord keeps it 15 minutes), the
      reply is posted in the channel as below when a bot token is set.
    * otherwise (approved output, gateway replies): ``POST /channels/{id}/messages`` as
      the bot, with ``nonce`` + ``enforce_nonce`` and a reply reference when the address
      has a ``message_id``. Without a bot token, an interaction's follow-up webhook is
      the only way left (valid for the token's 15 minutes).

    Every send is bounded by ``timeout_s``, including discord.py's own retries of 5xx
    answers and short rate limits, or by what is left of its delivery's send deadline
    (the message's ``within_s``) when that is less.
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
                quiet_voice_warning()
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
                try:
                    await self._client.login(self._token)
                except aiohttp.ClientError:
                    raise  # aiohttp's InvalidURL is a ValueError too: mapped by the caller
                except (TypeError, KeyError, ValueError, AttributeError) as exc:
                    # discord.py hands a body that is not JSON on as text, and building
                    # the bot's user from it fails: a 2xx answer that is not Discord's.
                    raise _NotConfigured(
                        f"discord: login was answered with something that is not Discord's "
                        f"API ({type(exc).__name__}); {_CHECK_API_URL}"
                    ) from exc
                self._logged_in = True
            return self._client

    # -- Channel protocol ----------------------------------------------------------------

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post one message; every platform error is mapped, never raised."""
        return await self._guarded(lambda: self._send(message), message.budget_s(self._timeout_s))

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """Edit the card posted as message ``external_id`` (``PATCH
        /channels/{channel}/messages/{id}``; a decided card loses its buttons). An edit
        is idempotent: an answer that never came is a Retry."""
        outcome = await self._guarded(lambda: self._edit(message, external_id))
        if isinstance(outcome, Uncertain):
            return Retry(outcome.error, said=outcome.said)
        return outcome

    async def _edit(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        channel_id = _snowflake(message.address.get("channel_id"))
        message_id = _snowflake(external_id)
        if channel_id is None or message_id is None or message.card is None:
            raise _NotConfigured("discord: card update without a channel, message or card")
        client = await self._logged_in_client()
        target = client.get_partial_messageable(channel_id).get_partial_message(message_id)
        card = message.card
        await target.edit(
            content=discord_review.content(card),
            view=None if card.outcome is not None else discord_review.view(card),
            allowed_mentions=_ALLOWED_MENTIONS,
        )
        return Sent(external_id)

    async def _guarded(
        self, work: Callable[[], Awaitable[SendOutcome]], timeout_s: float | None = None
    ) -> SendOutcome:
        """Run one send or edit under the deadline (``timeout_s``, by default the
        channel's; a send's is less when its delivery has less left), mapping every
        failure."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        wire = _Wire()
        reset = _WIRE.set(wire)
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await work()
            # discord.py hands a body that is not JSON on as text: the webhook calls
            # return it as if it were the message.
            return _not_discords_answer(wire) if wire.foreign_status else outcome
        except _NotConfigured as exc:
            return _permanent(str(exc))
        except discord.LoginFailure as exc:
            return _permanent(f"discord: bot token rejected: {exc}")
        except discord.RateLimited as exc:
            return Retry(f"discord: rate limited: {exc}", delay_s=exc.retry_after)
        except discord.HTTPException as exc:
            return _map_http_error(exc)
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as exc:
            # Raised before any connection: the URL itself cannot be used, and will not
            # become usable by waiting (a port out of range, a scheme that is not HTTP).
            return _permanent(f"discord: {described(exc)}")
        except TimeoutError:
            return _on_deadline(wire, timeout_s)
        except aiohttp.ClientConnectorError as exc:
            # No connection was made, so nothing was written.
            return Retry(f"discord: cannot connect: {exc}")  # (host and port, no path)
        except (aiohttp.ClientError, OSError) as exc:
            if wire.written or wire.lost_after_write:
                return Uncertain(f"discord: connection lost after sending: {described(exc)}")
            return Retry(f"discord: connection failed before sending: {described(exc)}")
        except Exception as exc:  # an SDK surprise must not crash the relay
            if wire.foreign_status:
                # Building a Message from a page's text fails: no bug, not Discord.
                return _not_discords_answer(wire)
            if wire.refused_unposted():
                # discord.py failed reading a refusal (a 429 with Via whose JSON has no
                # retry_after: a proxy limiting on its own): nothing was posted.
                return Retry(
                    f"discord: HTTP {wire.last_status} that discord.py could not read "
                    f"({type(exc).__name__}); not posted",
                    delay_s=wire.retry_after_s,
                )
            # Not log.exception: the traceback's last line is the error's text, which may
            # quote the webhook URL (interaction token and all).
            log.error("discord: unexpected error while sending: %s", described(exc, where=True))
            return Uncertain(f"discord: unexpected error: {described(exc)}")
        finally:
            _WIRE.reset(reset)

    async def _send(self, message: OutboundMessage) -> SendOutcome:
        address = message.address
        token = _str(address.get("interaction_token"))
        app_id = _snowflake(address.get("application_id"))
        channel_id = _snowflake(address.get("channel_id"))
        if message.kind == "reply" and token and app_id:
            try:
                return await self._answer_interaction(message, app_id, token)
            except discord.HTTPException as exc:
                if not (_token_expired(exc) and channel_id is not None and self._token):
                    raise
            # The interaction's token lived its 15 minutes (a slow turn, retries through
            # an outage): posted in the channel instead, as approved output is, rather
            # than lost for good.
            log.info("discord: an /ask's token has expired; its reply goes to the channel")
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
        text = message.text
        extra: dict[str, Any] = {}
        if message.card is not None:
            # A review card: its text cut to Discord's 2,000 characters, and its buttons.
            text = discord_review.content(message.card)
            extra["view"] = discord_review.view(message.card)
        # discord.py sends the nonce with enforce_nonce=true (http.handle_message_parameters).
        sent = await target.send(
            text,
            nonce=nonce_for(message.idempotency_key),
            # None is the implementation's default; only the overload stubs omit it.
            reference=reference,  # type: ignore[arg-type]
            allowed_mentions=_ALLOWED_MENTIONS,
            **extra,
        )
        return Sent(str(sent.id))

    async def _answer_interaction(
        self, message: OutboundMessage, app_id: int, token: str
    ) -> SendOutcome:
        """A reply through the interaction: its first part fills @original, a later one
        follows up."""
        owner = self._original_owner.get(token)
        # A delivery's later part (its key is not the delivery's own) follows up even
        # when no owner is remembered: after a restart, or on another replica, it
        # overwrote the first part in @original, which was then lost.
        first_part = message.idempotency_key == message.delivery_id
        if first_part and (owner is None or owner == message.idempotency_key):
            self._remember_owner(token, message.idempotency_key)
            try:
                return await self._edit_original(app_id, token, message.text)
            except discord.NotFound as exc:
                if not (_from_discord(exc) and exc.code == _UNKNOWN_MESSAGE):
                    raise
            # @original was deleted (an /ask left to the recovery runner, ended by
            # another process): the reply follows up instead of being lost.
        return await self._follow_up(app_id, token, message.text)

    async def end_unanswered(self, application_id: str, token: str) -> bool:
        """Delete an interaction's deferred response unless a reply of this process has
        taken it (:meth:`delete_original`): an ``/ask`` whose turn was left to the
        recovery runner may be answered before this runs. Once deleted here, a reply
        that comes later follows up."""
        if token in self._original_owner:
            return False
        self._remember_owner(token, _DELETED)
        return await self.delete_original(application_id, token)

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
        """``POST /webhooks/{app}/{token}?wait=true``, once. Not discord.py's webhook
        call: it sends again after a 5xx, and a follow-up carries no nonce, so one that
        Discord had made before its edge answered 502 or 504 was posted twice."""
        url = f"{discord.http.Route.BASE}/webhooks/{app_id}/{urllib.parse.quote(token, safe='')}"
        payload = {"content": text, "allowed_mentions": _WEBHOOK_ALLOWED_MENTIONS}
        session = self._webhook_session()
        async with session.post(url, params={"wait": "true"}, json=payload) as response:
            data = await discord.http.json_or_text(response)
            status = response.status
            if 200 <= status < 300:
                return Sent(_message_id(data))
            if status >= 500 and status != 503:
                # (503: not taken in, as for Teams; 500, 502, 504 may come after it was.)
                return Uncertain(
                    f"discord: HTTP {status} to a follow-up, which carries no nonce: it "
                    "may have been posted"
                )
            raise discord.HTTPException(response, data)

    async def delete_original(self, application_id: str, token: str) -> bool:
        """Delete an interaction's deferred response (best effort; True when gone). A
        DELETE answered 2xx with a page that is not Discord's (a captive portal's, a
        proxy's) is not known to have deleted anything, as a send so answered is not
        known posted: False, with a WARNING line. The caller (a gated or busy ``/ask``)
        tries once and goes on whatever the answer: the line is all that follows."""
        app_id = _snowflake(application_id)
        if app_id is None or not token:
            return False
        wire = _Wire()
        reset = _WIRE.set(wire)
        try:
            async with asyncio.timeout(self._timeout_s):
                await _webhook_adapter.get().delete_original_interaction_response(
                    app_id, token, session=self._webhook_session()
                )
        except discord.NotFound:
            return True
        except Exception as exc:
            log.warning("discord: could not delete the deferred response: %s", described(exc))
            return False
        finally:
            _WIRE.reset(reset)
        if wire.foreign_status:
            log.warning(
                "discord: could not delete the deferred response: HTTP %s that is not "
                "Discord's answer (%s): it may or may not be gone; %s and any proxy on the way",
                wire.foreign_status,
                wire.foreign_body or "empty body",
                _CHECK_API_URL,
            )
            return False
        return True

    async def close(self) -> None:
        """Close discord.py's HTTP session and the webhook session (idempotent)."""
        client, self._client = self._client, None
        self._logged_in = False
        if client is not None and not client.is_closed():
            await client.close()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


#: An interaction webhook's path: ``/webhooks/{application_id}/{interaction token}``.
_WEBHOOK_TOKEN = re.compile(r"(/webhooks/[^/\s]+/)[^/\s'\"<>)?]+")


def described(exc: BaseException, *, where: bool = False) -> str:
    """``exc`` for a delivery's error and the log, without an interaction's token: an
    interaction is answered at ``{api_url}/webhooks/{application}/{token}``, and
    aiohttp's errors quote the URL they were given (a misconfigured ``[discord]
    api_url``: ``InvalidUrlClientError``, ``NonHttpUrlClientError``). A URL that cannot
    be used says so without it; any other text loses the token of a webhook path in
    it. ``where``: with the innermost frame's file and line (for a bug's ERROR line,
    which carries no traceback)."""
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        text = f"{type(exc).__name__}: not an http(s) URL (check [discord] api_url)"
    else:
        text = _WEBHOOK_TOKEN.sub(r"\1<token>", repr(exc))
    if where and exc.__traceback__ is not None:
        text = f"{text} at {raised_at(exc)}"
    return text


def _not_discords_answer(wire: _Wire) -> Uncertain:
    """A write answered 2xx by something that is not Discord's API: whatever stands in
    between (a captive portal, a proxy) may have passed the request on, or not."""
    error = (
        f"discord: HTTP {wire.foreign_status} that is not Discord's answer "
        f"({wire.foreign_body or 'empty body'}): the post may or may not have reached "
        f"Discord; {_CHECK_API_URL} and any proxy on the way"
    )
    log.warning("%s", error)
    return Uncertain(error)


def _on_deadline(wire: _Wire, timeout_s: float) -> SendOutcome:
    if wire.foreign_status:
        return _not_discords_answer(wire)
    if wire.posted:
        # A write was answered 2xx before the deadline cut the rest short.
        return Sent(None)
    if (wire.in_flight and wire.written) or wire.lost_after_write:
        return Uncertain(f"discord: no answer within {timeout_s:g}s; the post may have landed")
    # Nothing of ours was on the wire: every attempt so far was answered without
    # posting (5xx, rate limit) or never left (connecting, waiting on a bucket).
    status = f" (last answer HTTP {wire.last_status})" if wire.last_status else ""
    # (discord.py's webhook calls sleep out a 429's retry_after however long: the next
    # attempt waits for it instead of meeting the same 429 again.)
    return Retry(f"discord: not sent within {timeout_s:g}s{status}", delay_s=wire.retry_after_s)


_CHECK_API_URL = "check [discord] api_url"
#: Discord's JSON error code for a channel that does not exist (or the bot cannot see).
_UNKNOWN_CHANNEL = 10003
#: Discord's JSON error codes for a channel the bot may not see or post in.
_MISSING_ACCESS = 50001
_MISSING_PERMISSIONS = 50013
#: Discord's JSON error code for a message it does not have (a deleted @original).
_UNKNOWN_MESSAGE = 10008
#: Discord's JSON error codes for an interaction token it no longer takes.
_UNKNOWN_WEBHOOK = 10015
_INVALID_WEBHOOK_TOKEN = 50027


def _permanent(error: str, said: str = "") -> Permanent:
    # The relay stores the error on the delivery but logs no line for a delivery that
    # failed for good; an operator reading the log must see why Discord posts fail (not
    # what Discord said, which may quote the post: it is stored with the error).
    log.warning("discord: not posted, and never will be: %s", error)
    return Permanent(error, said=said)


def _is_discord_json(headers: Mapping[str, str]) -> bool:
    """Whether an answer's body is Discord's JSON: discord.py reads a body as JSON only
    when its content type is exactly ``application/json``, as Discord sends it; anything
    else arrives as text."""
    return headers.get("Content-Type") == "application/json"


def _from_discord(exc: discord.HTTPException) -> bool:
    """Whether the error answer is Discord's own: a JSON body (anything else arrives as
    text, with code 0)."""
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    return _is_discord_json(headers)


def _map_http_error(exc: discord.HTTPException) -> SendOutcome:
    what = f"discord: HTTP {exc.status} code {exc.code}"
    # Discord's error text (a 400's "Invalid Form Body" names the fields and may quote
    # their values, the post's text among them): stored with the error, never logged.
    said = exc.text
    if exc.status == 429:
        return Retry(what, delay_s=_retry_after(exc), said=said)
    if exc.status == 408:
        # The request was not read in full in time (by Discord's edge or a proxy on the
        # way), so not carried out: as Slack's and Teams' channels take it.
        return Retry(what, delay_s=_retry_after(exc), said=said)
    if exc.status >= 500:
        # An answer from Discord (after discord.py's own retries, all with the same
        # nonce): not created. Retrying later with the same nonce is safe. A body that is
        # not JSON is no sign of a wrong URL here: Discord's edge answers its 5xx in HTML.
        return Retry(what, said=said)
    if not _from_discord(exc):
        # Discord answers every 4xx with a JSON error; a 404 page from a web server that
        # is not Discord's API (or a path without /api/v10) never will.
        body = quoted_page(exc.text)
        return _permanent(
            f"discord: HTTP {exc.status} without a Discord error ({body or 'empty body'}): "
            f"the server is not Discord's API; {_CHECK_API_URL}"
        )
    if exc.status == 404 and exc.code == _UNKNOWN_CHANNEL:
        return _permanent(
            f"{what} (the channel was deleted, or the bot cannot see it; "
            "check the binding's or notify target's channel id)",
            said,
        )
    if exc.status == 403 and exc.code in (_MISSING_ACCESS, _MISSING_PERMISSIONS):
        return _permanent(
            f"{what} (the bot cannot see the channel, or lacks a permission there: View "
            "Channel, Send Messages, Send Messages in Threads, Read Message History for a "
            "reply; check the bot's role in that channel)",
            said,
        )
    if _token_expired(exc):
        return _permanent(
            f"{what} (the /ask interaction's token has expired: Discord keeps it 15 "
            "minutes; with [discord] bot_token its reply is posted in the channel instead)",
            said,
        )
    if exc.status == 404 and exc.code == 0:
        # Discord's answer for a route it does not have: a channel that does not exist
        # is 10003 above, so this is the URL (e.g. an API version Discord dropped).
        return _permanent(f"{what} (Discord has no such route; {_CHECK_API_URL})", said)
    # 400 (bad body, too long), 401 (token), 403 (missing access): the same request
    # will never succeed.
    return _permanent(what, said)


def _token_expired(exc: discord.HTTPException) -> bool:
    """Whether Discord refused an interaction's webhook call because its token is no
    longer valid (it lives 15 minutes): 401 Invalid Webhook Token, or 404 Unknown
    Webhook."""
    return _from_discord(exc) and (exc.status, exc.code) in (
        (401, _INVALID_WEBHOOK_TOKEN),
        (404, _UNKNOWN_WEBHOOK),
    )


def _retry_after(exc: discord.HTTPException) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    return _seconds(headers.get("Retry-After"))


def _seconds(value: Any) -> float | None:
    """A ``Retry-After`` header's seconds (``None``: absent or not a number)."""
    try:
        seconds = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


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
