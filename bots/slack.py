"""Slack: Events API in (slack-bolt), ``chat.postMessage`` out (slack-sdk).

Inbound: the signature is checked first, on the raw body, with slack_sdk's
``SignatureVerifier`` (a bad or missing signature or a non-numeric timestamp: 401, the
body is never parsed); the body is then decoded through :mod:`leadgate.core.decoding`
(JSON, or a form whose ``payload`` is JSON; 400 for anything else, for a shape Bolt
cannot read, or for identifiers that cannot be stored) and handed to a slack-bolt
:class:`AsyncApp`, which answers ``url_verification`` and turns ``message`` /
``app_mention`` events into a :class:`leadgate.core.types.Inbound`. The listener
**records** the message (:func:`bots.base.accept`) before Bolt answers 200, within
Slack's 3 seconds (past 2.5 s, or with the database unavailable: 503, and Slack
redelivers, three times over five minutes; on its last try the person is told in the
thread instead); the turn runs in the background and its reply travels through the outbox.

Each thread is one session (``slack:{team}:{channel}:{thread_ts or ts}``) and replies go
into that thread. The external event id is built from the *message* (team, channel,
ts), not from Slack's ``event_id``: a retried delivery (``X-Slack-Retry-Num``) and the
``app_mention`` + ``message`` pair Slack sends for one post then share one id, and the
core's de-duplication runs a single turn for all of them.

Slack drops an event after its third retry (about five minutes): at each start
:meth:`SlackAdapter.catch_up` reads back, with ``conversations.history`` (and
``conversations.replies`` for the threads that moved, then for those it answered
before, in the slots left), the messages of every known
channel posted after its read point (where the last catch-up that read it through
started; within ``[slack] catch_up_s``) and
takes each in as a live one; the intake's de-duplication by that same id answers a
message that came both ways once, and one the bot told "could not be taken in" (its
notice names it: :data:`REPLY_EVENT`) is left alone.

Outbound: :class:`SlackChannel` posts with one shared ``AsyncWebClient`` and maps every
failure onto the outcome classes of SPEC 6. ``chat.postMessage`` has no idempotency key,
so anything that may have reached Slack without an answer is :class:`Uncertain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import urllib.request
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import aiohttp
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response
from slack_bolt.async_app import AsyncApp
from slack_bolt.authorization import AuthorizeResult
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.errors import SlackApiError, SlackClientError, SlackRequestError
from slack_sdk.http_retry.builtin_async_handlers import AsyncRateLimitErrorRetryHandler
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from bots import slack_review
from bots.base import (
    CATCH_UP_OVERLAP_MS,
    DATABASE_FAULTS,
    NOT_TAKEN_IN,
    Core,
    accept,
    answering_errors,
    catch_up_start,
    catch_up_until_done,
    known_conversations,
    quoted_page,
    store_read_points,
    tell_not_taken_in,
)
from bots.review_base import ChatReviewBackend
from leadgate.core.bodies import read_body
from leadgate.core.config import Settings, SlackSettings
from leadgate.core.decoding import decode_text, json_object
from leadgate.core.errors import (
    AuthError,
    DatabaseDamaged,
    LeadgateError,
    Unavailable,
    ValidationError,
)
from leadgate.core.logs import loggable
from leadgate.core.types import BindingKind, Conversations, Inbound
from outbox.channel import (
    OutboundMessage,
    Permanent,
    Retry,
    SendOutcome,
    Sent,
    Uncertain,
    too_little_left,
)

log = logging.getLogger(__name__)

EVENTS_PATH = "/slack/events"
#: Slack gives up on a request after 3 s; recording must be done well before.
RECORD_DEADLINE_S = 2.5

# Keys Bolt reads as an object or an id string (slack_bolt.request.internals): any other
# JSON type there makes Bolt itself fail, so such a body is a 400 before it gets there.
_OBJECT_OR_ID = (
    "team",
    "user",
    "channel",
    "enterprise",
    "view",
    "container",
    "message",
    "previous_message",
    "item",
    "assistant_thread",
    "function_data",
)
# Event fields Bolt's matchers compare or hash (a list there fails inside Bolt).
_EVENT_STRINGS = ("subtype", "channel_type", "text", "ts", "thread_ts", "bot_id", "event_ts")
# Set per request: what the listener could not do (answered by the route, not by Bolt).
_FAILURE: contextvars.ContextVar[list[LeadgateError] | None] = contextvars.ContextVar(
    "leadgate_slack_failure", default=None
)
# Set per request: whether it is Slack's last delivery of the event. Slack retries an
# event it got no 2xx for three times (at once, after a minute, after five minutes,
# ``X-Slack-Retry-Num`` 1..3), then drops it.
_LAST_TRY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "leadgate_slack_last_try", default=False
)
LAST_RETRY_NUM = "3"
# Set per Web API call: the quote (bots.base.quoted_page) of an answer slack_sdk could
# not read as JSON (it drops such a body), for the error and the WARNING line.
_PAGE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "leadgate_slack_page", default=None
)
# How many recent "could not be taken in" replies a process remembers, so that the
# ``app_mention`` + ``message`` pair of one post (two events, each with its own last try,
# both about five minutes after the post) is answered once. Bounded: the pair's last tries
# arrive within moments of each other, and a key is only ever told once anyway.
TOLD_KEEP = 1024

#: A catch-up reads at most this many pages (200 messages each) of a channel's history,
#: and of each thread's replies.
CATCH_UP_PAGES = 5
CATCH_UP_PAGE_SIZE = 200
#: ... and the replies of at most this many threads per channel (those that moved last
#: first: by their ``latest_reply``, else the newest message taken in there; then those
#: that took in messages before the window alone, started last first).
CATCH_UP_THREADS = 20
#: The Slack message metadata (``event_type``) of a reply the adapter posts itself, the
#: "could not be taken in" notice on Slack's last try: its ``event_payload`` names the
#: message it answers (``message_ts``), so that a catch-up tells which message of a
#: thread was told, not every one before the notice. (The outbox's posts carry none:
#: what they answer was taken in, and the intake's de-duplication answers it once.)
REPLY_EVENT = "reply_to"
#: The key of a notice's address naming the message it answers (see :data:`REPLY_EVENT`).
ANSWERS = "answers"
#: How often a read Slack answers 429 is tried again (after its ``Retry-After``).
CATCH_UP_RATE_LIMIT_RETRIES = 3
_CATCH_UP_CLOSE_TIMEOUT_S = 10.0
_SESSION_PREFIX = "slack:"

# Message subtypes a person produces. Everything else (bot_message, message_changed,
# message_deleted, channel_join, ...) is either a bot or a change notice, never a new ask.
_HUMAN_SUBTYPES = frozenset({None, "thread_broadcast", "file_share", "me_message"})

# "<@U123> do this" addresses the bot; the mention is not part of the request.
_LEADING_MENTIONS = re.compile(r"^\s*(?:<@[UW][A-Z0-9]+(?:\|[^>]*)?>[\s,:]*)+")

# chat.postMessage errors that say "not posted, and retrying will not help".
# Unknown ok=false errors are treated the same way (see _map_api_error).
PERMANENT_ERRORS = frozenset(
    {
        "channel_not_found",
        "not_in_channel",
        "is_archived",
        "channel_is_archived",
        "msg_too_long",
        "no_text",
        "too_many_attachments",
        "invalid_auth",
        "not_authed",
        "token_revoked",
        "token_expired",
        "account_inactive",
        "missing_scope",
        "no_permission",
        "restricted_action",
        "restricted_action_read_only_channel",
        "restricted_action_thread_only_channel",
        "restricted_action_non_threadable_channel",
        "team_access_not_granted",
        "ekm_access_denied",
        "org_login_required",
        "invalid_arguments",
        "invalid_blocks",
        "invalid_thread_ts",
        "cannot_reply_to_message",
        "duplicate_channel_not_found",
        "messages_tab_disabled",
    }
)
# Answered, not posted, worth another try.
RETRYABLE_ERRORS = frozenset(
    {"ratelimited", "rate_limited", "service_unavailable", "request_timeout"}
)
# Slack documents these as "it's possible some aspect of the operation succeeded".
UNCERTAIN_ERRORS = frozenset({"internal_error", "fatal_error"})


@dataclass(frozen=True)
class SlackPost:
    """The parts of one human Slack message that a turn needs."""

    team: str
    channel: str
    ts: str
    thread_ts: str | None
    text: str

    @property
    def thread(self) -> str:
        """The thread this message belongs to (its own ts when it starts one)."""
        return self.thread_ts or self.ts

    @property
    def session_key(self) -> str:
        """One session per Slack thread."""
        return f"slack:{self.team}:{self.channel}:{self.thread}"

    @property
    def external_event_id(self) -> str:
        """Same for Slack's retries and for the app_mention/message pair of one post."""
        return f"slack:{self.team}:{self.channel}:{self.ts}"

    @property
    def route_attrs(self) -> dict[str, str]:
        """Match keys of a slack route."""
        return {"team": self.team, "channel": self.channel}

    @property
    def address(self) -> dict[str, Any]:
        """Where replies and approved output go: the message's thread."""
        return {"team": self.team, "channel": self.channel, "thread_ts": self.thread}

    def inbound(self) -> Inbound:
        """The channel-neutral message."""
        return Inbound(
            channel=BindingKind.slack,
            route_attrs=self.route_attrs,
            session_key=self.session_key,
            text=self.text,
            address=self.address,
            external_event_id=self.external_event_id,
        )


def parse_event(body: Mapping[str, Any], event: Mapping[str, Any]) -> SlackPost | None:
    """A :class:`SlackPost` for a human ``message``/``app_mention`` event, else ``None``.

    Bot messages (``bot_id``, subtype ``bot_message``), edits, deletions, joins and
    messages without text are ignored.
    """
    if event.get("type") not in ("message", "app_mention"):
        return None
    if event.get("bot_id") or event.get("bot_profile") or event.get("hidden"):
        return None
    if event.get("subtype") not in _HUMAN_SUBTYPES:
        return None
    team = body.get("team_id") or event.get("team")
    channel = event.get("channel")
    ts = event.get("ts")
    raw_text = event.get("text")
    if not (isinstance(team, str) and isinstance(channel, str) and isinstance(ts, str)):
        return None
    if not isinstance(raw_text, str):
        return None
    text = _LEADING_MENTIONS.sub("", raw_text).strip()
    if not text:
        return None
    thread_ts = event.get("thread_ts")
    return SlackPost(
        team=team,
        channel=channel,
        ts=ts,
        thread_ts=thread_ts if isinstance(thread_ts, str) and thread_ts else None,
        text=text,
    )


@dataclass(frozen=True)
class CatchUpTarget:
    """A channel to read back at start: its workspace, the newest message ts taken in
    there lately (``None``: none), the threads that took in messages lately (each with
    the newest ts taken in there: what moved last there, as far as the service saw), the
    read point stored (``point``: where its catch-up starts, epoch ms; ``None``: none
    yet; ``read_through``: stored by a catch-up that read the channel through) and the
    threads that took in messages before the window alone (``quiet``, newest first: a
    reply there is told by nothing the channel's history returns)."""

    team: str
    channel: str
    newest: Decimal | None
    threads: tuple[tuple[str, Decimal], ...]
    point: int | None = None
    read_through: bool = False
    quiet: tuple[str, ...] = ()

    @property
    def conversation(self) -> str:
        """The channel's key among the read points: ``TEAM:CHANNEL``."""
        return f"{self.team}:{self.channel}"

    def start_point(self, since_ms: int) -> int:
        """Where the catch-up of this channel starts (epoch ms, the route's bound
        aside): :func:`bots.base.catch_up_start`."""
        newest = None if self.newest is None else int(self.newest * 1000)
        return catch_up_start(self.point, self.read_through, newest, since_ms)


def _ts(value: object) -> Decimal | None:
    """A Slack ts (``"1700000000.000100"``) as a number, ``None`` when it is not one."""
    if not isinstance(value, str) or not value:
        return None
    try:
        number = Decimal(value)
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def ts_at(ms: int) -> str:
    """The Slack ts of epoch millisecond ``ms``."""
    return f"{ms // 1000}.{ms % 1000:03d}000"


def catch_up_targets(
    known: Conversations, team: str, *, again: bool = False
) -> list[CatchUpTarget]:
    """The channels to catch up: every Slack session (its key
    ``slack:TEAM:CHANNEL:THREAD``) that took in a message, with the newest recorded in
    its channel lately and its threads that took in one lately (each with the newest
    taken in there) or only before (``quiet``), and every channel a route
    names (in ``team`` when the route names none), each with its read point. ``again``
    (a retry after a database fault): no channel has a newest (a live message taken in
    since the first try may be it)."""
    newest: dict[tuple[str, str], Decimal | None] = {}
    threads: dict[tuple[str, str], dict[str, Decimal]] = {}
    quiet: dict[tuple[str, str], set[str]] = {}
    for key, event_ids in known.sessions.items():
        parts = key.split(":")
        if len(parts) != 4 or parts[0] != "slack" or not all(parts[1:]):
            continue
        where = (parts[1], parts[2])
        stamps = []
        for event_id in event_ids:
            event = event_id.split(":")
            stamp = _ts(event[3]) if len(event) == 4 and tuple(event[1:3]) == where else None
            if stamp is not None:
                stamps.append(stamp)
        found = [n for n in (newest.get(where), max(stamps, default=None)) if n is not None]
        newest[where] = max(found, default=None)
        threads.setdefault(where, {})
        if _ts(parts[3]) is None:
            continue
        if stamps:
            threads[where][parts[3]] = max(stamps)
        else:
            quiet.setdefault(where, set()).add(parts[3])
    for match in known.routes:
        channel = match.get("channel", "")
        if channel and ":" not in channel:
            newest.setdefault((match.get("team") or team, channel), None)
    return [
        CatchUpTarget(
            t,
            c,
            None if again else n,
            tuple(sorted(threads.get((t, c), {}).items())),
            point,
            f"{t}:{c}" in known.read_through,
            tuple(
                sorted(
                    quiet.get((t, c), set()) - threads.get((t, c), {}).keys(),
                    key=Decimal,
                    reverse=True,
                )
            ),
        )
        for (t, c), n in newest.items()
        for point in (known.points.get(f"{t}:{c}"),)
    ]


def _mentions(text: object, user_id: str) -> bool:
    """Whether ``text`` mentions the user ``user_id`` (``<@U123>``, ``<@U123|name>``)."""
    return (
        isinstance(text, str)
        and re.search(rf"<@{re.escape(user_id)}(?:\|[^>]*)?>", text) is not None
    )


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url``, chosen as aiohttp's ``trust_env``
    chooses it: the variable for the URL's scheme (``HTTPS_PROXY`` for ``https``,
    ``HTTP_PROXY`` for ``http``), none for a host that ``NO_PROXY`` lists.

    slack_sdk reads the proxy from the environment itself, but takes ``HTTPS_PROXY`` (else
    ``HTTP_PROXY``) for every URL and ignores ``NO_PROXY``: with a proxy set for another
    client (Teams' login), every Slack call went through it, even to a host ``NO_PROXY``
    lists. The client's ``proxy`` is set to this instead; it is read at each call.
    """
    parts = urlsplit(url)
    host = parts.hostname
    # urllib's matching, as aiohttp's (suffixes, "*", the port dropped).
    if not host or urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies().get(parts.scheme)


class SlackChannel:
    """Outbound Slack: ``chat.postMessage`` into the bound thread.

    One :class:`AsyncWebClient` and one aiohttp session serve every send. The SDK's
    default retry handlers are switched off: its connection-error handler would re-post
    after a reset, and a re-post of a message that may have landed is a double post
    (Slack has no idempotency key). Retries belong to the relay.

    A call's timeout bounds it whole, so a post is started only when its delivery has
    that long left of its send deadline (a later part of a long text: the message's
    ``within_s``); with less, nothing is sent (a Retry).
    """

    name = "slack"
    max_chars = 40_000

    def __init__(
        self,
        settings: SlackSettings,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(connect_timeout_s, timeout_s)
        )
        self.client = AsyncWebClient(
            token=settings.bot_token or None,
            base_url=settings.api_url,
            timeout=int(max(1, timeout_s)),
            retry_handlers=[],
        )
        self.client.proxy = env_proxy(self.client.base_url)
        self._session: aiohttp.ClientSession | None = None

    def _ensure_session(self) -> None:
        # aiohttp wants a running loop for its session, so it is made on the first send;
        # the session (not the SDK's per-call one) carries our timeouts.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, response_class=_KeepingPageStart
            )
            self.client.session = self._session

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post ``message.text`` to ``address.channel`` in thread ``address.thread_ts``
        (a review card as Block Kit when ``message.card`` is set)."""
        channel = message.address.get("channel")
        if not isinstance(channel, str) or not channel:
            return Permanent("slack: binding address has no channel")
        left_s = message.budget_s(self._timeout_s)
        if left_s < self._timeout_s:
            # The call's timeout bounds it whole, written or not: one cut shorter could
            # not tell a post never written from one that may have landed.
            return too_little_left("slack", left_s, self._timeout_s, "a post")
        thread_ts = message.address.get("thread_ts") or None
        extra: dict[str, Any] = {}
        answers = message.address.get(ANSWERS)
        if isinstance(answers, str) and answers:
            extra["metadata"] = {
                "event_type": REPLY_EVENT,
                "event_payload": {"message_ts": answers},
            }
        text = message.text
        if message.card is not None:
            # Links in a card are never unfurled: no preview fetch, and a GET decides
            # nothing anyway.
            text = slack_review.fallback_text(message.card)
            extra = {
                "blocks": slack_review.blocks(message.card),
                "unfurl_links": False,
                "unfurl_media": False,
            }
        outcome = await self._call(
            "chat.postMessage",
            lambda: self.client.chat_postMessage(
                channel=channel, text=text, thread_ts=thread_ts, **extra
            ),
        )
        if not isinstance(outcome, AsyncSlackResponse):
            return outcome
        ts = outcome.get("ts")
        return Sent(str(ts) if ts is not None else None)

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """``chat.update`` of the card posted as ``external_id`` (its ts). Editing again is
        harmless, so an answer that never came is a Retry."""
        channel = message.address.get("channel")
        if not isinstance(channel, str) or not channel or message.card is None:
            return Permanent("slack: card update without a channel or a card")
        card = message.card
        outcome = await self._call(
            "chat.update",
            lambda: self.client.chat_update(
                channel=channel,
                ts=external_id,
                text=slack_review.fallback_text(card),
                blocks=slack_review.blocks(card),
            ),
        )
        if isinstance(outcome, AsyncSlackResponse):
            return Sent(external_id)
        if isinstance(outcome, Uncertain):
            return Retry(outcome.error, said=outcome.said)
        return outcome

    async def _call(
        self, method: str, call: Callable[[], Awaitable[AsyncSlackResponse]]
    ) -> AsyncSlackResponse | SendOutcome:
        """One Web API call: its response, or the outcome its failure maps onto."""
        self._ensure_session()
        _PAGE.set(None)
        try:
            return await call()
        except SlackApiError as exc:
            return _map_api_error(exc, edit=method == "chat.update")
        except SlackRequestError as exc:
            # Raised by the SDK before anything is sent (bad arguments).
            return Permanent(f"slack: invalid request: {exc}")
        except aiohttp.ClientConnectorError as exc:
            # Refused, unreachable, DNS failure: no connection, so nothing was written.
            return Retry(f"slack: cannot connect: {exc}")
        except aiohttp.ConnectionTimeoutError as exc:
            # Timed out while connecting: the request was never written.
            return Retry(f"slack: connect timeout: {exc}")
        except TimeoutError:
            return Uncertain("slack: no answer before the timeout; the post may have landed")
        except (aiohttp.ClientError, OSError) as exc:
            # Server disconnect, reset, broken payload after the request was written.
            return Uncertain(f"slack: connection lost after sending: {exc!r}")
        except Exception as exc:  # an SDK bug must not crash the relay
            log.error("slack: unexpected error from %s", method, exc_info=loggable(exc))
            return Uncertain(f"slack: unexpected error: {exc!r}")

    async def close(self) -> None:
        """Close the shared HTTP session (idempotent)."""
        session, self._session = self._session, None
        self.client.session = None
        if session is not None and not session.closed:
            await session.close()


class _KeepingPageStart(aiohttp.ClientResponse):
    """aiohttp's response, keeping (in ``_PAGE``) the start of a body that is not JSON
    when slack_sdk asks for JSON: slack_sdk drops such a body (another content type), or
    keeps it only in its exception's message (JSON that does not parse)."""

    async def json(self, *args: Any, **kwargs: Any) -> Any:
        """The body as JSON (aiohttp's ``json``)."""
        try:
            return await super().json(*args, **kwargs)
        except (aiohttp.ContentTypeError, ValueError):
            # (aiohttp has read the whole body by then: this takes no more bytes)
            _PAGE.set(quoted_page(await self.read()))
            raise


def _page_start(response: Any) -> str:
    """What an answer that is not Slack's was: its content type and the start of its
    body, secret-looking parts left out."""
    headers = getattr(response, "headers", None) or {}
    content_type = headers.get("Content-Type") or "no content type"
    head = _PAGE.get()
    if head is None:
        data = getattr(response, "data", None)
        head = quoted_page(data) if isinstance(data, str) else ""
    return f"{content_type}: {head or 'empty body'}"


def _map_api_error(exc: SlackApiError, *, edit: bool = False) -> SendOutcome:
    response = exc.response
    # slack_sdk's own response, or (a body that claims JSON and is not) aiohttp's.
    status = int(getattr(response, "status_code", None) or getattr(response, "status", 0) or 0)
    data = getattr(response, "data", None)
    if 200 <= status < 300 and not (isinstance(data, dict) and "ok" in data):
        # Slack answers every call with JSON carrying "ok"; a 2xx without it is a page
        # from something in between (a captive portal, a proxy), which may have passed
        # the post on, or not. An edit's caller sends it again (harmless), and the
        # words say so.
        maybe = (
            "the card edit may or may not have reached Slack, and is sent again (editing "
            "twice shows what once does)"
            if edit
            else "the post may or may not have reached Slack"
        )
        error = (
            f"slack: HTTP {status} that is not Slack's answer ({_page_start(response)}): "
            f"{maybe}; check [slack] api_url and any proxy on the way"
        )
        log.warning("%s", error)
        return Uncertain(error)
    code = data.get("error") if isinstance(data, dict) else None
    what = f"slack: HTTP {status} {code or ''}".rstrip()
    if status in (408, 429) or code in ("ratelimited", "rate_limited"):
        # 408: the request was not read in full in time (by Slack's edge or a proxy on
        # the way), so not processed: as the Teams channel takes it.
        return Retry(what, delay_s=_retry_after(response))
    if code in UNCERTAIN_ERRORS:
        return Uncertain(what)
    if status >= 500:
        # A 5xx is an answer: Slack received the request and says the method did not
        # complete. chat.postMessage answers ok only once the message is stored, Slack
        # documents 500/502/503/504 as "not processed, try again", and slack-sdk's own
        # ServerErrorRetryHandler retries them. The one documented exception, an
        # ok=false "internal_error"/"fatal_error" body ("some aspect may have
        # succeeded"), is Uncertain above. A 5xx with no such body is a retry.
        return Retry(what, delay_s=_retry_after(response))
    if code in RETRYABLE_ERRORS:
        return Retry(what, delay_s=_retry_after(response))
    # Every other ok=false answer describes the request or the workspace (bad channel,
    # revoked token, archived, too long, ...): sending it again cannot succeed.
    return Permanent(what if code else f"{what} {exc}")


def _retry_after(response: Any) -> float | None:
    headers = getattr(response, "headers", None) or {}
    value = None
    for key in ("Retry-After", "retry-after"):
        if key in headers:
            value = headers[key]
            break
    if isinstance(value, list):
        value = value[0] if value else None
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


class SlackAdapter:
    """Slack inbound (``POST /slack/events``) and outbound (:class:`SlackChannel`)."""

    def __init__(self, settings: Settings, core: Core, *, channel: SlackChannel | None = None):
        self.channel: SlackChannel = channel or SlackChannel(settings.slack)
        self._core = core
        self._settings = settings.slack
        #: the running (or last) catch-up, for tests to wait on
        self.catching_up: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._verifier = SignatureVerifier(settings.slack.signing_secret)
        self._told: OrderedDict[str, asyncio.Future[SendOutcome]] = OrderedDict()
        bot_token = settings.slack.bot_token

        async def authorize(enterprise_id: str | None, team_id: str | None) -> AuthorizeResult:
            # A fixed bot token: no auth.test round trip per event or at startup.
            return AuthorizeResult(
                enterprise_id=enterprise_id, team_id=team_id, bot_token=bot_token or None
            )

        self.bolt = AsyncApp(
            signing_secret=settings.slack.signing_secret,
            authorize=authorize,
            # A tokenless client for Bolt itself: our listeners never call the Web API,
            # and anything Bolt might call goes to the configured base URL.
            client=_web_client(settings.slack.api_url),
            # The listener only spawns the turn, so running it before the response keeps
            # the ack fast and means the turn is registered before Slack sees the 200.
            process_before_response=True,
            # Bot messages are filtered in parse_event for every bot, not only ours.
            ignoring_self_events_enabled=False,
            # Bolt's own signature check stays on although handle() verified first: a
            # second guard should anything ever dispatch to Bolt another way (it costs
            # 6 us of Bolt's ~64 per event: docs/performance-history.md, session 27).
            # say/set_status/... for assistant threads: no listener of ours takes them,
            # and building them cost 5 us per event.
            attaching_conversation_kwargs_enabled=False,
            name="leadgate",
        )

        async def on_message(body: dict[str, Any], event: dict[str, Any]) -> None:
            try:
                await self.take(body, event)
            except LeadgateError as exc:
                failures = _FAILURE.get()
                if failures is None:
                    raise
                failures.append(exc)

        async def on_other(body: dict[str, Any]) -> None:
            # Acknowledge every other subscribed event so Slack does not retry it.
            return None

        self.bolt.event("message")(on_message)
        self.bolt.event("app_mention")(on_message)
        self.bolt.event(re.compile(".*"))(on_other)

    def enable_reviews(self, backend: ChatReviewBackend) -> None:
        """Review-card buttons and modals on the same endpoint (``block_actions``,
        ``view_submission``), verified by :meth:`handle` like every event."""
        slack_review.register(self.bolt, backend, self._core.spawn, proxy_for=env_proxy)

    async def take(self, body: Mapping[str, Any], event: Mapping[str, Any]) -> None:
        """Record one event's message, then run its turn in the background (no-op for
        events that are not a human ask)."""
        post = parse_event(body, event)
        if post is None:
            return
        inbound = post.inbound()
        try:
            # The outcome needs no action here: a Reply is already queued in the outbox,
            # and Gated/Busy/Duplicate post nothing.
            await accept(
                self._core,
                inbound,
                name=f"slack-turn:{post.external_event_id}",
                deadline_s=RECORD_DEADLINE_S,
            )
        except DATABASE_FAULTS as exc:
            # Slack's last try: after it the event is dropped, and the person's message
            # was lost without a word (a database down past the five minutes Slack's
            # retries span). Tell them in the thread, as on Discord and Teams.
            if not _LAST_TRY.get():
                raise
            log.warning("slack: could not record a message on Slack's last try (%s)", exc.rule)
            # The notice names the message it answers (REPLY_EVENT): a catch-up leaves that
            # one alone, and no other of its thread.
            told = replace(inbound, address={**inbound.address, ANSWERS: post.ts})
            if not await self._tell_once(told, exc):
                raise

    async def _tell_once(self, inbound: Inbound, exc: Unavailable | DatabaseDamaged) -> bool:
        """:func:`bots.base.tell_not_taken_in`, once per message in this process: the
        ``app_mention`` and ``message`` events of one post share its external event id,
        and ``chat.postMessage`` has no idempotency key to make a second reply the same
        post. A second event awaits the first one's reply and answers as it did.
        Whether the reply was posted (one that may have been is not posted again)."""
        key = f"intake-fault:{inbound.external_event_id}"
        telling = self._told.get(key)
        if telling is None:
            telling = asyncio.ensure_future(tell_not_taken_in(self.channel, inbound, exc, key=key))
            self._told[key] = telling
            telling.add_done_callback(lambda done: self._unless_posted(key, done))
            while len(self._told) > TOLD_KEEP:
                self._told.popitem(last=False)
        return isinstance(await asyncio.shield(telling), Sent)

    def _unless_posted(self, key: str, telling: asyncio.Future[SendOutcome]) -> None:
        """Forget a reply that was not posted (refused, or the telling failed): a later
        event of the same post may try again. One that may have been posted (uncertain:
        the answer was lost) is kept, so it is not posted twice."""
        maybe_posted = (
            not telling.cancelled()
            and telling.exception() is None
            and isinstance(telling.result(), Sent | Uncertain)
        )
        if not maybe_posted and self._told.get(key) is telling:
            del self._told[key]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``POST /slack/events``: verify, decode, then Bolt answers and dispatches."""
        raw = await read_body(request)
        timestamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        try:
            # The verifier reads the body as UTF-8: bytes that are not cannot be verified.
            text = decode_text(raw)
        except ValidationError:
            text = None
        if not (
            text is not None
            and timestamp.isascii()
            and timestamp.isdigit()
            and len(timestamp) < 16
            and signature.isascii()
            and self._verifier.is_valid(raw, timestamp, signature)
        ):
            raise AuthError(
                "the request carries no valid Slack signature (X-Slack-Signature of the "
                "app's signing secret, with an X-Slack-Request-Timestamp within 5 minutes "
                "of the service's clock)",
                rule="slack.signature",
            )
        _check_shape(_decode(raw, text, request.content_type))
        failures: list[LeadgateError] = []
        reset = _FAILURE.set(failures)
        last_try = _LAST_TRY.set(request.headers.get("X-Slack-Retry-Num") == LAST_RETRY_NUM)
        try:
            bolt_request = AsyncBoltRequest(
                body=text,
                query=request.query_string,
                headers={k: list(request.headers.getall(k)) for k in request.headers},
            )
            bolt_response = await self.bolt.async_dispatch(bolt_request)
        except Exception as exc:
            # A verified body of a shape Bolt cannot read (no listener of ours ran).
            log.info("slack: Bolt could not read a verified request: %s", type(exc).__name__)
            raise ValidationError(
                "the body is not a Slack request Bolt can read", rule="slack.shape"
            ) from None
        finally:
            _FAILURE.reset(reset)
            _LAST_TRY.reset(last_try)
        if failures:
            raise failures[0]
        return await to_aiohttp_response(bolt_response)

    def mount(self, app: web.Application) -> None:
        """Add ``POST /slack/events``."""
        app.router.add_post(EVENTS_PATH, answering_errors(self.handle))

    # -- catch-up ---------------------------------------------------------------------------

    def _reader(self) -> AsyncWebClient:
        """A client for the catch-up's reads: unlike a post, a read may be sent again, so
        a 429 is waited out (its ``Retry-After``) and tried again."""
        client = AsyncWebClient(
            token=self._settings.bot_token or None,
            base_url=self._settings.api_url,
            timeout=30,
            retry_handlers=[
                AsyncRateLimitErrorRetryHandler(max_retry_count=CATCH_UP_RATE_LIMIT_RETRIES)
            ],
        )
        client.proxy = env_proxy(client.base_url)
        return client

    async def _catch_up_run(self) -> None:
        await catch_up_until_done(self.catch_up, self._stopping, channel="slack")

    async def catch_up(self, again: bool = False) -> bool:
        """Read back and take in, oldest first, the messages of every known channel
        posted after its read point (where the last catch-up that read it through
        started, less a minute, or the newest message taken in there since, less a
        minute, when later; for a channel without one, the newest message taken in
        there, less a minute; stored as its point before anything is read), within
        ``[slack] catch_up_s`` and not before the route answering there was made: Slack
        drops an event after its third retry, and a message posted while the service
        was down was lost without a word. A channel read through moves its point to this
        catch-up's start. A channel Slack would not read logs a WARNING (read from the
        same point at the next start); the others are read on. False when a database
        fault stopped it (tried again shortly, ``again``:
        :func:`bots.base.catch_up_until_done`); True otherwise."""
        known = await known_conversations(
            self._core,
            BindingKind.slack,
            key_prefix=_SESSION_PREFIX,
            window_s=self._settings.catch_up_s,
        )
        if known is None:
            return False
        if not known.sessions and not any(r.get("channel") for r in known.routes):
            return True  # no Slack conversation known: nothing to ask Slack
        client = self._reader()
        try:
            # The bot's own user (its mentions, its replies) and workspace.
            who = await client.auth_test()
        except (SlackClientError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("slack: no catch-up, auth.test failed (%s)", _read_error(exc))
            return True
        me = (str(who.get("user_id") or ""), str(who.get("bot_id") or ""))
        targets = catch_up_targets(known, str(who.get("team_id") or ""), again=again)
        starts = {t.conversation: t.start_point(known.since_ms) for t in targets}
        if not await store_read_points(self._core, BindingKind.slack, starts):
            return False
        for target in targets:
            if self._stopping.is_set():
                return True
            try:
                await self._catch_up_channel(client, target, known, me)
            except DATABASE_FAULTS as exc:
                log.warning("slack: catch-up stopped, the database is unavailable (%s)", exc.rule)
                return False
            except (SlackClientError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                if _read_error(exc).endswith(" channel_not_found") and not any(
                    match.get("channel") == target.channel for match in known.routes
                ):
                    # Deleted since: its sessions stay, and a WARNING at every start would
                    # say nothing anyone can act on (one a route names still warns).
                    log.info("slack: channel %s is gone; not caught up", target.channel)
                    continue
                log.warning(
                    "slack: could not read channel %s's messages to catch up (%s); those "
                    "posted there while the service was down are read at the next start",
                    target.channel,
                    _read_error(exc),
                )
        return True

    async def _catch_up_channel(
        self,
        client: AsyncWebClient,
        target: CatchUpTarget,
        known: Conversations,
        me: tuple[str, str],
    ) -> None:
        attrs = {"team": target.team, "channel": target.channel}
        route = await self._core.resolve_route(BindingKind.slack.value, attrs)
        if route is None:
            return
        # (the point stored before anything was read)
        point = target.start_point(known.since_ms)
        after = ts_at(max(known.since_ms, route.created_at, point))
        oldest = Decimal(after)
        history, cut = await _read_pages(
            client.conversations_history, channel=target.channel, oldest=after
        )
        if cut:
            log.warning(
                "slack: catch-up of channel %s read its latest %d messages only; older "
                "ones are not answered",
                target.channel,
                len(history),
            )
        found: dict[str, dict[str, Any]] = {}
        # Parents the bot replied to, taken in only when their thread is read and no
        # notice of the bot's there told them they could not be taken in (told_in).
        told: dict[str, dict[str, Any]] = {}
        # Threads to read: those that took in a message lately, and those whose parent
        # was read and that were replied to since (conversations.history has parents
        # only, and the live path answers a reply in a thread too).
        # Each ranked by what moved last there: its latest_reply when Slack tells it (a
        # parent read), else the newest message taken in there. (Slack tells a thread's
        # latest_reply on its parent alone, which conversations.history returns only
        # when it was posted after the read point; asking each thread for it is the very
        # read CATCH_UP_THREADS bounds.)
        moved = dict(target.threads)
        for message in history:
            stamp = _ts(message.get("ts"))
            if stamp is None or stamp <= oldest:
                continue
            latest = _ts(message.get("latest_reply"))
            if latest is not None and latest > oldest:
                moved[str(message["ts"])] = max(latest, moved.get(str(message["ts"]), latest))
            # The bot replied in its thread (reply_users says who, not what): its thread,
            # read below as one that moved, tells whether it was told "could not be taken
            # in" (the person may have sent it again since).
            replied = message.get("reply_users")
            if isinstance(replied, list) and me[0] in replied:
                told[str(message["ts"])] = message
                moved.setdefault(str(message["ts"]), latest if latest is not None else stamp)
                continue
            found[str(message["ts"])] = message
        threads = sorted(moved, key=lambda t: moved[t], reverse=True)
        # The slots left go to the threads that took in messages before the window alone,
        # newest first: a reply there while the service was down shows nowhere in the
        # channel's history (its first message is older than the read point), and Slack
        # lists no thread that moved; only asking the thread itself finds it.
        threads += [t for t in target.quiet if t not in moved][
            : max(0, CATCH_UP_THREADS - len(threads))
        ]
        read_through = True
        if len(threads) > CATCH_UP_THREADS:
            log.warning(
                "slack: catch-up of channel %s reads the latest %d of its %d threads",
                target.channel,
                CATCH_UP_THREADS,
                len(threads),
            )
        for thread in threads[:CATCH_UP_THREADS]:
            if self._stopping.is_set():
                return
            try:
                replies, cut = await _read_pages(
                    client.conversations_replies,
                    channel=target.channel,
                    ts=thread,
                    oldest=after,
                    # The notices' metadata (REPLY_EVENT): which message each answers.
                    include_all_metadata=True,
                )
            except SlackApiError as exc:
                if _read_error(exc).endswith(" thread_not_found"):
                    continue  # its first message was deleted: the thread is gone
                # The channel's other messages read are still taken in, and its read
                # point stays (the next start reads its threads again).
                log.warning(
                    "slack: could not read the threads of channel %s to catch up (%s); "
                    "replies posted there while the service was down are read again at "
                    "the next start",
                    target.channel,
                    _read_error(exc),
                )
                read_through = False
                break
            if cut:
                # Read oldest first (Slack pages a thread no other way): the newest are
                # the ones left.
                log.warning(
                    "slack: catch-up of thread %s in channel %s read its first %d messages "
                    "only; later ones are not answered",
                    thread,
                    target.channel,
                    len(replies),
                )
            named, until = told_in(replies, me)
            for message in replies:
                ts = str(message.get("ts"))
                stamp = _ts(ts)
                if stamp is None or _own(message, me) or ts in named:
                    continue
                if until is not None and stamp < until:
                    continue
                if ts == thread:
                    if thread in told:
                        found[thread] = told[thread]
                    continue
                if stamp > oldest:
                    found.setdefault(ts, message)
        taken = 0
        for ts in sorted(found, key=Decimal):
            if self._stopping.is_set():
                return
            message = found[ts]
            post = parse_event({"team_id": target.team}, {**message, "channel": target.channel})
            if post is None or not self._would_answer(target.channel, message, me[0]):
                continue
            try:
                await accept(
                    self._core, post.inbound(), name=f"slack-turn:{post.external_event_id}"
                )
            except DATABASE_FAULTS:
                raise
            except LeadgateError as exc:
                # As a live message's would: the next is read on.
                log.warning("slack: catch-up could not take message %s in (%s)", ts, exc.rule)
                continue
            taken += 1
        if taken:
            log.info("slack: catch-up of channel %s took in %d messages", target.channel, taken)
        if read_through:
            # Every message posted before this catch-up started was read (the minute
            # less for clocks apart, as for the newest taken in).
            await self._core.advance_read_points(
                BindingKind.slack,
                {target.conversation: known.read_at_ms - CATCH_UP_OVERLAP_MS},
                read_through=True,
            )

    def _would_answer(self, channel: str, message: Mapping[str, Any], bot_user: str) -> bool:
        """Whether the live path would have been given ``message``: in a direct message
        every one; elsewhere, with ``catch_up_mentions_only``, one that mentions the bot
        (Slack's ``app_mention``)."""
        if not self._settings.catch_up_mentions_only or channel.startswith("D"):
            return True
        return _mentions(message.get("text"), bot_user)

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """The catch-up, in the background (the startup never waits for it), once per
        start; Slack needs no listener besides its HTTP route."""
        self._stopping = asyncio.Event()
        if self._settings.catch_up_s > 0 and self._settings.bot_token:
            self.catching_up = asyncio.create_task(self._catch_up_run(), name="slack-catch-up")
        try:
            yield
        finally:
            self._stopping.set()
            running = self.catching_up
            if running is not None:
                try:
                    async with asyncio.timeout(_CATCH_UP_CLOSE_TIMEOUT_S):
                        await running
                except TimeoutError:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running


def _own(message: Mapping[str, Any], me: tuple[str, str]) -> bool:
    """Whether ``message`` is the bot's (``me``: its user id and bot id)."""
    return message.get("user") == me[0] or bool(me[1] and message.get("bot_id") == me[1])


def told_in(replies: list[dict[str, Any]], me: tuple[str, str]) -> tuple[set[str], Decimal | None]:
    """Which messages of a thread (``replies``) the bot (``me``) told could not be taken
    in: the ts each of its notices names (:data:`REPLY_EVENT` metadata) and, for a notice
    posted before notices named one, the newest such notice's ts (every message before
    it counts as told: it cannot say which it answered). The in-doubt notice tells none
    (it promised the answer once the service is back), nor does any other post of the
    bot: what it answered was taken in, and the intake's de-duplication answers that
    once (a message posted while the service was down, before the bot's later answer to
    an earlier one, is answered)."""
    named: set[str] = set()
    until: Decimal | None = None
    for message in replies:
        text = message.get("text")
        if not _own(message, me) or not (isinstance(text, str) and text.startswith(NOT_TAKEN_IN)):
            continue
        meta = message.get("metadata")
        payload = meta.get("event_payload") if isinstance(meta, dict) else None
        answered = payload.get("message_ts") if isinstance(payload, dict) else None
        if isinstance(meta, dict) and meta.get("event_type") == REPLY_EVENT:
            if isinstance(answered, str):
                named.add(answered)
            continue
        stamp = _ts(message.get("ts"))
        if stamp is not None and (until is None or stamp > until):
            until = stamp
    return named, until


async def _read_pages(
    call: Callable[..., Awaitable[AsyncSlackResponse]], **params: str | bool
) -> tuple[list[dict[str, Any]], bool]:
    """The messages of up to :data:`CATCH_UP_PAGES` pages of a Web API read (by
    ``cursor``), and whether more were left."""
    messages: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(CATCH_UP_PAGES):
        page = await call(limit=CATCH_UP_PAGE_SIZE, cursor=cursor, **params)
        found = page.get("messages")
        if isinstance(found, list):
            messages.extend(m for m in found if isinstance(m, dict))
        meta = page.get("response_metadata")
        cursor = meta.get("next_cursor") if isinstance(meta, dict) else None
        if not page.get("has_more") or not cursor:
            return messages, False
    return messages, True


def _read_error(exc: BaseException) -> str:
    """A failed read in a few words: Slack's status and error code, or the error."""
    if isinstance(exc, SlackApiError):
        data = getattr(exc.response, "data", None)
        code = data.get("error") if isinstance(data, dict) else None
        status = getattr(exc.response, "status_code", 0)
        return f"HTTP {status} {code or ''}".rstrip()
    return repr(exc)


def _decode(raw: bytes, text: str, content_type: str) -> dict[str, Any]:
    """The body as Bolt will read it (``text``: ``raw`` as strict UTF-8): JSON, or a
    form whose ``payload`` is JSON."""
    if content_type == "application/json" or text.lstrip().startswith("{"):
        # From the bytes: decode_json then knows there can be no raw surrogate and skips
        # walking the document when no escape or bracket count calls for it (11 us of a
        # message event's 17 us there).
        return json_object(raw, allow_nul=True)
    try:
        form = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError:
        raise ValidationError("the body is not a form", rule="body.form") from None
    fields = dict(form)
    if "payload" in fields:
        return json_object(fields["payload"], allow_nul=True)
    return fields


def _check_shape(body: Mapping[str, Any]) -> None:
    """The fields Bolt reads must have the JSON types Slack sends (400 otherwise)."""

    def bad(where: str) -> ValidationError:
        return ValidationError(f"unexpected JSON type for {where}", rule="slack.shape")

    layers: list[Mapping[str, Any]] = [body]
    event = body.get("event")
    if event is not None:
        if not isinstance(event, dict):
            raise bad("event")
        layers.append(event)
    if event is not None:
        for key in _EVENT_STRINGS:
            if not isinstance(event.get(key, ""), str | None):
                raise bad(f"event.{key}")
    for layer in layers:
        if not isinstance(layer.get("type", ""), str):
            raise bad("type")
        for key in _OBJECT_OR_ID:
            value = layer.get(key)
            if value is not None and not isinstance(value, dict | str):
                raise bad(key)
        auths = layer.get("authorizations")
        if auths is not None and not (
            isinstance(auths, list) and all(isinstance(a, dict) for a in auths)
        ):
            raise bad("authorizations")
    # Interactive payloads (review cards): Bolt indexes the first action and reads the
    # view's type itself, before any listener of ours (a 500 from Bolt otherwise).
    actions = body.get("actions")
    if actions is not None and not (
        isinstance(actions, list) and all(isinstance(a, dict) for a in actions)
    ):
        raise bad("actions")
    if body.get("type") == "block_actions" and not actions:
        raise bad("actions")
    view = body.get("view")
    if view is not None and not (isinstance(view, dict) and isinstance(view.get("type"), str)):
        raise bad("view")


def _web_client(api_url: str) -> AsyncWebClient:
    """A tokenless client for Bolt, with the proxy :func:`env_proxy` picks."""
    client = AsyncWebClient(base_url=api_url, retry_handlers=[])
    client.proxy = env_proxy(client.base_url)
    return client


def create(settings: Settings, core: Core) -> SlackAdapter | None:
    """The Slack adapter, or ``None`` when ``[slack] signing_secret`` is unset."""
    if not settings.slack.on:
        return None
    return SlackAdapter(settings, core)
