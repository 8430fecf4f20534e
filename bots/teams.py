"""Microsoft Teams through the Bot Framework SDK (botbuilder ``CloudAdapter``).

Inbound: ``POST /api/messages``. With authentication on, the Bot Framework JWT is
verified before the body is read: a request whose ``Authorization`` is not a bearer JWT
(its header segment unreadable) is ``401`` at once, and then the SDK's
``ConfigurationBotFrameworkAuthentication`` checks the token's signature, issuer,
audience (our app id) and lifetime on its own (an activity without ``serviceUrl`` and
``channelId``: the SDK checks neither then), so a sender without a valid token never gets
its body parsed. The body is then read and decoded through the one decoding path (413
over the size limit, 400 for bad JSON), its shape checked (400 ``teams.activity``, see
:func:`check_activity`), and the SDK checks the token again against the
parsed activity: its ``serviceurl`` claim must name the activity's ``serviceUrl``, and its
signing key must be endorsed for the activity's ``channelId``. Then
a message activity becomes a
:class:`leadgate.core.types.Inbound` that is **recorded** (:func:`bots.base.accept`)
before the channel gets its ``202`` (Teams allows 15 s), and its turn runs in the
background. Outbound: :class:`TeamsChannel` rebuilds the stored conversation
reference and posts through ``CloudAdapter.continue_conversation``.

Authentication modes:

* ``app_id`` set: every request must carry a valid Bot Framework bearer token; a missing,
  malformed or unverifiable token is ``401`` and runs no turn. Outbound sends carry a
  token from the Microsoft identity platform, kept and shared by
  :mod:`bots.teams_token`, the replies the SDK posts while it handles an inbound
  activity included (its credentials wait for the shared token, never ask msal on the
  event loop).
* ``app_id`` and ``app_password`` empty (``[teams] enabled = true``): no authentication
  at all, inbound or outbound. For local testing only; a warning is logged at startup.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import functools
import logging
import re
import socket
import ssl
import threading
import time
import traceback
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
import requests
import requests.adapters
import urllib3
import urllib3.connection
import urllib3.exceptions
from aiohttp import web
from azure.core.exceptions import DeserializationError
from botbuilder.core import Bot, CardFactory, TurnContext, serializer_helper
from botbuilder.integration.aiohttp import (
    CloudAdapter,
    ConfigurationBotFrameworkAuthentication,
    ConfigurationServiceClientCredentialFactory,
)
from botbuilder.schema import (
    Activity,
    ActivityTypes,
    ConversationReference,
    ErrorResponseException,
)
from msrest.authentication import BasicTokenAuthentication
from msrest.exceptions import ClientRequestError, raise_with_traceback
from msrest.pipeline.async_abc import AsyncPipeline
from msrest.pipeline.async_requests import (
    AsyncPipelineRequestsHTTPSender,
    AsyncRequestsCredentialsPolicy,
)
from msrest.pipeline.universal import RawDeserializer
from msrest.universal_http import ClientRequest
from msrest.universal_http.async_requests import (
    AsyncRequestsClientResponse,
    AsyncRequestsHTTPSender,
)

from bots import teams_review
from bots.base import (
    DATABASE_FAULTS,
    Adapter,
    Core,
    accept,
    answering_errors,
    quoted_page,
    tell_not_taken_in,
)
from bots.review_base import ChatReviewBackend
from bots.teams_review import MAX_TEXT_BYTES, text_size
from bots.teams_token import (
    TOKEN_TIMEOUT_S,
    ConnectorTokens,
    HeldTokenCredentialsFactory,
    NoToken,
    TokenSource,
)
from leadgate.core.bodies import read_body
from leadgate.core.clock import Clock, SystemClock
from leadgate.core.config import Settings, TeamsSettings
from leadgate.core.decoding import bearer_token, json_object
from leadgate.core.errors import AuthError, ConfigError, ValidationError
from leadgate.core.limits import EVENT_ID_LIMIT, SESSION_KEY_LIMIT, bounded
from leadgate.core.types import BindingKind, Inbound
from outbox.channel import (
    Channel,
    OutboundMessage,
    Permanent,
    Retry,
    SendOutcome,
    Sent,
    Uncertain,
    too_little_left,
)
from outbox.store import SEND_DEADLINE_S

log = logging.getLogger(__name__)

CHANNEL = "teams"
#: Teams waits 15 s for the answer to an activity; recording ends well before.
RECORD_DEADLINE_S = 10.0
#: The reply telling a person their message was not taken in ends within
#: RECORD_DEADLINE_S + this of the activity's arrival (Teams waits 15 s for the answer):
#: all that recording left of it, this much at least...
REPLY_DEADLINE_S = 3.0
#: ...of which its request and answer get this once it is being written (the rest: a
#: free send thread, the access token, and the connection).
REPLY_TIMEOUT_S = 1.5
#: A message's recording still under way after this long is likely to end in a
#: database fault (a healthy one takes milliseconds): from then on the access token the
#: "not taken in" reply would need is fetched while recording goes on (when none is
#: held), so that a reply left with REPLY_DEADLINE_S does not start its fetch then.
TOKEN_AHEAD_AFTER_S = 2.0
#: The threads Teams sends (and the access token's requests) run on, at most.
SEND_THREADS = 16

_MENTION_TAG = re.compile(r"<at>(.*?)</at>", re.IGNORECASE | re.DOTALL)


class _UnsupportedContentType(ValidationError):
    """A body that is not JSON: 415, as the SDK's own ``process`` answers it."""

    status = 415


def _unauthorized() -> AuthError:
    return AuthError(
        "the request carries no valid Bot Framework token (Authorization: Bearer, "
        "issued for this bot, this serviceUrl and this channel)",
        rule="teams.token",
    )


def _not_an_activity(why: str = "an object with a type") -> ValidationError:
    return ValidationError(
        f"the body is not a Bot Framework activity ({why})",
        rule="teams.activity",
    )


#: String fields an activity may carry, checked when present (msrest turns a number or
#: a list there into its text: ``{"type": 7}`` was a ``"7"`` activity).
_STRING_FIELDS = ("id", "text", "replyToId", "name")
#: The accounts an activity names: objects, whose ``id`` is a string.
_ACCOUNT_FIELDS = ("from", "recipient", "conversation")


def check_activity(body: Mapping[str, Any]) -> None:
    """Refuse (400 ``teams.activity``) a body that is not shaped as the Bot Framework
    activity schema says a channel sends one, before the SDK reads it: msrest makes a
    number, a list or an object in a string field its text, so none of this could be
    told afterwards. ``type``, ``channelId`` and ``serviceUrl`` (an ``http(s)`` URL,
    where the replies go) are non-empty strings, ``from`` and ``conversation`` objects
    with a string ``id`` (the schema's A2010, A2020, A2300, A2060, A2080), and the other
    fields read here (``recipient`` too) are of their schema's JSON types when present
    (A2003). An activity
    of a type leadgate does not know is accepted and ignored (A2014)."""
    if not _text(body.get("type")):
        raise _not_an_activity()
    if not _text(body.get("channelId")):
        raise _not_an_activity("channelId must be a string")
    service_url = body.get("serviceUrl")
    if not isinstance(service_url, str) or not _web_url(service_url):
        raise _not_an_activity("serviceUrl must be an http or https URL")
    for field in _STRING_FIELDS:
        if body.get(field) is not None and not isinstance(body[field], str):
            raise _not_an_activity(f"{field} must be a string")
    for field in _ACCOUNT_FIELDS:
        account = body.get(field)
        if account is None and field == "recipient":
            continue  # (only an activity sent to one recipient names it: A2070)
        if not isinstance(account, dict) or not _text(account.get("id")):
            raise _not_an_activity(f"{field} must be an object with a string id")


def _text(value: Any) -> bool:
    """Whether ``value`` is a non-empty string."""
    return isinstance(value, str) and bool(value)


def _web_url(value: str) -> bool:
    """Whether ``value`` is an absolute ``http``/``https`` URL with a host."""
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


@dataclass(frozen=True)
class _SdkConfig:
    """The attribute names ``ConfigurationBotFrameworkAuthentication`` reads.

    They correspond to the Azure settings MicrosoftAppId, MicrosoftAppPassword,
    MicrosoftAppTenantId and MicrosoftAppType.
    """

    APP_ID: str
    APP_PASSWORD: str
    APP_TENANTID: str
    APP_TYPE: str


def sdk_config(teams: TeamsSettings) -> _SdkConfig:
    """The SDK's configuration object: SingleTenant when a tenant is set, else MultiTenant."""
    single = bool(teams.app_tenant_id)
    if single and not (teams.app_id and teams.app_password):
        raise ConfigError(
            "[teams] app_tenant_id needs app_id and app_password (SingleTenant app)",
            rule="config.teams",
        )
    return _SdkConfig(
        APP_ID=teams.app_id,
        APP_PASSWORD=teams.app_password,
        APP_TENANTID=teams.app_tenant_id,
        APP_TYPE="SingleTenant" if single else "MultiTenant",
    )


def _strip_bot_mention(activity: Activity) -> str:
    """The message text without the bot's own ``<at>...</at>`` mention.

    The SDK's ``remove_recipient_mention`` feeds the display name into ``re.sub`` as a
    pattern, which breaks on names with regex metacharacters; this removes the mention
    entity's text literally. Mentions of other people keep their display name.
    """
    text = activity.text or ""
    bot_id = activity.recipient.id if activity.recipient else None
    for entity in activity.entities or []:
        if (entity.type or "").lower() != "mention":
            continue
        props = getattr(entity, "additional_properties", None) or {}
        mentioned = props.get("mentioned") or {}
        mention_text = props.get("text")
        if bot_id and mentioned.get("id") == bot_id and mention_text:
            text = text.replace(mention_text, " ")
    return _MENTION_TAG.sub(r"\1", text).strip()


def _tenant_of(activity: Activity) -> str:
    # The SDK maps ConversationAccount.tenant_id to the JSON key "tenantID", while Teams
    # sends "tenantId": the reliable place is channelData.tenant.id.
    conversation = activity.conversation
    if conversation is not None and conversation.tenant_id:
        return str(conversation.tenant_id)
    channel_data = activity.channel_data
    if isinstance(channel_data, dict):
        tenant = channel_data.get("tenant")
        if isinstance(tenant, dict) and tenant.get("id"):
            return str(tenant["id"])
    return ""


def parse_message(activity: Activity) -> Inbound | None:
    """A message activity as a channel-neutral inbound message (None: nothing to run)."""
    if activity.type != ActivityTypes.message or activity.conversation is None:
        return None
    if not isinstance(activity.text, str) or not isinstance(activity.id, str):
        return None
    if not isinstance(activity.conversation.id, str):
        return None
    try:
        text = _strip_bot_mention(activity)
    except (TypeError, AttributeError):
        return None  # entities of the wrong JSON types: not a message we can read
    conversation_id = activity.conversation.id or ""
    if not text or not conversation_id or not activity.id:
        return None
    tenant = _tenant_of(activity)
    reference = TurnContext.get_conversation_reference(activity)
    if reference.conversation is not None and not reference.conversation.tenant_id:
        reference.conversation.tenant_id = tenant or None
    return Inbound(
        channel=BindingKind.teams,
        route_attrs={"tenant": tenant, "conversation": conversation_id},
        session_key=bounded(f"teams:{tenant}:{conversation_id}", SESSION_KEY_LIMIT),
        text=text,
        address={"reference": reference.serialize(), "activity_id": activity.id},
        # A message's id is unique only in its conversation (a millisecond timestamp):
        # two conversations posting in the same millisecond are two messages.
        external_event_id=bounded(
            f"teams:{tenant}:{conversation_id}:{activity.id}", EVENT_ID_LIMIT
        ),
    )


class TeamsBot(Bot):  # type: ignore[misc]
    """Turns message activities into triggers; never posts a turn's text itself.
    ``notices`` posts the one reply of its own (the "not taken in" notice)."""

    def __init__(self, core: Core, notices: TeamsChannel) -> None:
        self._core = core
        self._notices = notices

    async def on_turn(self, context: TurnContext) -> None:
        """Parse and record (before the 202); the turn runs in the background.

        When the database cannot take the message in, its author is told in a reply and
        the channel gets its 202: nothing documents that Teams sends a message again
        after a 5xx (the person saw a message that was simply never answered). Only when
        that reply is not known to be posted is the fault passed on (503). The reply
        has what recording left of Teams' wait.

        No access token is asked for here: a message held for Lead Review, a duplicate
        or a silent route's sends nothing, and the token is fetched by the first send
        that needs one (every message asked for one as it came, when none was held).
        Only a recording still under way after :data:`TOKEN_AHEAD_AFTER_S` starts the
        fetch: a reply sent after recording took its 10 s has 1.5 s before its request,
        too little to begin the fetch then."""
        inbound = parse_message(context.activity)
        if inbound is None:
            return
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await self._record(context, inbound)
        except DATABASE_FAULTS as exc:
            log.warning("teams: could not record a message (%s)", exc.rule)
            # Posted as the outbox's Teams sends are (their pool, the watch on their
            # connection, their outcomes), within REPLY_DEADLINE_S: the SDK's own
            # post (context.send_activity) went out on the loop's default executor,
            # whose thread a Connector that never answered held for msrest's timeout.
            left_s = RECORD_DEADLINE_S + REPLY_DEADLINE_S - (loop.time() - arrived)
            outcome = await tell_not_taken_in(
                self._notices,
                inbound,
                exc,
                key=inbound.external_event_id,
                within_s=max(left_s, REPLY_DEADLINE_S),
            )
            if not isinstance(outcome, Sent):
                raise exc from None

    async def _record(self, context: TurnContext, inbound: Inbound) -> None:
        """:func:`accept` ``inbound``, the access token's fetch started once recording
        has taken :data:`TOKEN_AHEAD_AFTER_S` (:meth:`on_turn`)."""
        ahead = asyncio.get_running_loop().call_later(
            TOKEN_AHEAD_AFTER_S, self._notices.fetch_token_ahead, context
        )
        try:
            await accept(
                self._core,
                inbound,
                name=f"teams-turn {inbound.external_event_id}",
                deadline_s=RECORD_DEADLINE_S,
            )
        finally:
            ahead.cancel()


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _in_handshake(exc: BaseException) -> bool:
    """Whether the TLS error in ``exc`` (requests' ``SSLError``, wrapping urllib3's,
    wrapping :mod:`ssl`'s) came from the handshake, certificate check included: before
    a byte of the request was written."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, ssl.SSLCertVerificationError):
            return True
        if isinstance(error, ssl.SSLError) and any(
            frame.name == "do_handshake" for frame in traceback.extract_tb(error.__traceback__)
        ):
            return True
        # (not __context__: an error met while handling another is not its cause)
        inner = [*error.args, error.__cause__, getattr(error, "reason", None)]
        stack.extend(e for e in inner if isinstance(e, BaseException))
    return False


_TUNNEL_REFUSED = re.compile(r"Tunnel connection failed: (\d{3}[^'\")]*)")


def _classify_transport_error(exc: BaseException, *, written: bool | None = None) -> SendOutcome:
    """Map a ``requests`` failure (msrest sends with requests) onto an outcome class.

    ``written`` (a post's, seen on its connection by :class:`_Watch`) decides when it is
    known: a request whose first byte was never written is a retry, whatever failed (a
    proxy that refused the tunnel, a connection lost before the request), and any
    failure after it is uncertain. urllib3 names both a proxy's refusal and a connection
    lost through a proxy after the request was sent ``ProxyError``, as http.client
    closes the connection on either, so the error's class cannot tell them apart.

    Otherwise (``written`` None) the error's class decides: connect-phase failures
    (refused, DNS, connect timeout, TLS handshake) happen before a byte of the request
    is written: retry. A read timeout, a connection dropped or a TLS error after the
    handshake (while waiting for the answer) means the connector may have posted:
    uncertain. (The access token's request is not classified here: any failure of it
    is a retry, see :mod:`bots.teams_token`.)
    """
    outcome = _classified_by_type(exc)
    if written is None:
        return outcome
    if written:
        if isinstance(outcome, Uncertain):
            return outcome
        return Uncertain(f"teams connector connection lost after the request was sent: {exc}")
    refused = _TUNNEL_REFUSED.search(str(exc))
    if refused is not None:
        # The proxy answered CONNECT with a refusal: no tunnel, nothing sent. A 407 too
        # is retried, not dropped: its credentials (HTTPS_PROXY) are fixed by an
        # operator, whom the stalled delivery's WARNING calls, and the output waits.
        return Retry(
            f"teams connector: the proxy refused the tunnel ({refused.group(1).strip()}): "
            "nothing was sent; check the proxy and its credentials (HTTPS_PROXY, NO_PROXY)"
        )
    if isinstance(outcome, Retry):
        return outcome
    return Retry(f"teams connector: connection lost before the request was written: {exc}")


def _classified_by_type(exc: BaseException) -> SendOutcome:
    """:func:`_classify_transport_error` by the error's class alone."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return Retry(f"teams connector connect timeout: {exc}")
    if isinstance(exc, requests.exceptions.ReadTimeout):
        return Uncertain(f"teams connector read timeout after the request was sent: {exc}")
    if isinstance(exc, requests.exceptions.SSLError):
        if _in_handshake(exc):
            return Retry(f"teams connector TLS error: {exc}")
        # After the handshake the request may have been written in full: a record that
        # does not decrypt while the answer is read (requests names it as it names a
        # handshake's failure) may follow a post the Connector took.
        return Uncertain(f"teams connector TLS error after the request was sent: {exc}")
    if isinstance(exc, requests.exceptions.ConnectionError):
        reason: Any = exc.args[0] if exc.args else None
        if isinstance(reason, urllib3.exceptions.MaxRetryError):
            reason = reason.reason
        if isinstance(
            reason,
            urllib3.exceptions.NewConnectionError | urllib3.exceptions.ConnectTimeoutError,
        ):
            return Retry(f"teams connector unreachable: {reason}")
        if isinstance(reason, urllib3.exceptions.ProxyError):
            # urllib3 names an error so only before the connection to the proxy is made
            # (refused, unreachable, its TLS): nothing was written.
            return Retry(f"teams connector: the proxy cannot be reached: {reason}")
        return Uncertain(f"teams connector connection lost after the request was sent: {exc}")
    return Uncertain(f"teams connector request failed: {exc}")


def _classify_status(exc: ErrorResponseException) -> SendOutcome:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    # The Connector's error message (msrest's text of it) may quote the activity posted:
    # stored with the error, never logged.
    return _by_status(status, f"teams connector HTTP {status}", response, said=str(exc))


def _by_status(status: int | None, detail: str, response: Any, *, said: str = "") -> SendOutcome:
    """The outcome of a Connector answer with HTTP ``status`` (not 2xx), ``detail`` its
    error text (``said``: the Connector's words, see ``outbox.channel``); ``response``
    holds its headers (``Retry-After``)."""
    if status in (408, 412, 429, 503):
        # Not processed: rate limited (429, and 412, which Microsoft's rate-limit
        # guidance for Teams bots says to retry with it), the request not read in time
        # (408), or the service refusing it (503). Known to be pre-write, so sent again
        # (Retry-After).
        return Retry(detail, _retry_after(getattr(response, "headers", None)), said=said)
    if status in (401, 403, 404):
        return Permanent(detail, said=said)
    if isinstance(status, int) and status >= 500:
        # 500, and a gateway's 502/504 in front of the Connector, may come after the
        # activity was stored; the Connector has no idempotency key, so sending again
        # could post twice. A person decides (SPEC 6: only pre-write 5xx are retried).
        return Uncertain(detail, said=said)
    return Permanent(detail, said=said)


def _not_the_connectors_answer(
    response: requests.Response, service_url: str, *, edit: bool
) -> SendOutcome:
    """An answer msrest could not read as the Connector's JSON (a captive portal's or a
    proxy's page): a 2xx may or may not have followed a post the Connector took, so it
    is uncertain, logged at WARNING as Discord's (``edit``: a card's edit, which its
    caller sends again, and the words say so); any other status means what it means
    from the Connector. Either way the error names what to check: the service URL comes
    with each of the conversation's activities, so only a proxy on the way is a setting
    (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``: requests reads them)."""
    status = response.status_code
    what = (
        f"{response.headers.get('Content-Type') or 'no content type'}: "
        f"{quoted_page(response.content) or 'empty body'}"
    )
    check = (
        f"check any proxy on the way to the conversation's service URL {service_url} "
        "(HTTPS_PROXY, HTTP_PROXY, NO_PROXY)"
    )
    if not 200 <= status < 300:
        return _by_status(
            status,
            f"teams: HTTP {status} that is not the Bot Connector's answer ({what}); {check}",
            response,
        )
    maybe = (
        "the card edit may or may not have reached Teams, and is sent again (editing twice "
        "shows what once does)"
        if edit
        else "the post may or may not have reached Teams"
    )
    error = (
        f"teams: HTTP {status} that is not the Bot Connector's answer ({what}): {maybe}; {check}"
    )
    log.warning("%s", error)
    return Uncertain(error)


class _Lapsed(OSError):
    """Raised on the sending thread for a request its send gave up on before it was
    written: it must never be written (the send's outcome was a retry)."""


class _Watch:
    """One Connector request's deadline, shared by the event loop, which gives up on the
    request when its time is up, and the thread requests sends it on, which nothing can
    cancel (``requests`` runs on the Teams send pool, see :class:`_PooledSender`).

    Whether the request's first byte was written and whether the send gave up are
    decided under one lock: a request given up on before it was written is never
    written (:class:`_Lapsed`), so its retry posts once. Giving up shuts the
    connection's socket down, which ends the thread's wait for a Connector or proxy
    that trickles its answer (each byte within the read timeout) or for a TLS
    handshake's answer, and the pool's thread with it."""

    def __init__(self, on_write: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._on_write = on_write
        self._connections: list[urllib3.connection.HTTPConnection] = []
        # A handle of our own on the socket of each connection still connecting: the
        # TLS layer takes the connection's socket over (its object detached) for the
        # handshake, which a lapse must end too (the thread waited out its socket
        # timeout, 30 s, in a handshake the server never answered).
        self._connecting: dict[urllib3.connection.HTTPConnection, socket.socket] = {}
        #: the request's first byte was (about to be) written
        self.written = False
        #: the send gave up on the request
        self.lapsed = False
        #: the request went where no connection of ours is seen (a SOCKS proxy)
        self.blind = False

    def opened(
        self, connection: urllib3.connection.HTTPConnection, sock: socket.socket | None = None
    ) -> None:
        """(sending thread) ``connection`` has its socket (``sock``: just opened, a
        proxy's CONNECT and the TLS handshake next): watch it."""
        with self._lock:
            if self.lapsed:
                raise _Lapsed("the send gave up before the request was written")
            if connection not in self._connections:
                self._connections.append(connection)
            if sock is not None and connection not in self._connecting:
                self._connecting[connection] = sock.dup()

    def connected(self, connection: urllib3.connection.HTTPConnection) -> None:
        """(sending thread) ``connection``'s connect has ended, one way or another."""
        with self._lock:
            handle = self._connecting.pop(connection, None)
        if handle is not None:
            handle.close()

    def writing(self, connection: urllib3.connection.HTTPConnection) -> None:
        """(sending thread) The request is about to be written on ``connection``."""
        self.opened(connection)
        with self._lock:
            if self.lapsed:
                raise _Lapsed("the send gave up before the request was written")
            first, self.written = not self.written, True
        if first:
            self._on_write()

    def closing(self, connection: urllib3.connection.HTTPConnection) -> threading.Lock:
        """(any thread) The lock to hold while ``connection`` closes (its socket is
        never shut down by :meth:`lapse` after it was closed, and its descriptor reused)."""
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)
        return self._lock

    def lapse(self) -> bool:
        """(event loop) Give up on the request; whether it may have been written."""
        with self._lock:
            self.lapsed = True
            for connection in self._connections:
                sock = connection.sock
                if sock is not None:
                    with contextlib.suppress(OSError):
                        # socket's own shutdown, not SSLSocket's (which drops its TLS
                        # state under the thread reading through it): the thread's
                        # read ends at once.
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
            for handle in self._connecting.values():
                with contextlib.suppress(OSError):
                    handle.shutdown(socket.SHUT_RDWR)  # (the handshake's read ends)
            return self.written or self.blind


_sending = threading.local()


def _watch_of_thread() -> _Watch | None:
    watch = getattr(_sending, "watch", None)
    return watch if isinstance(watch, _Watch) else None


class _Watched(urllib3.connection.HTTPConnection):
    """urllib3's connection, telling the :class:`_Watch` of the thread that opens it
    (``requests`` sends a request, and reads its answer, on one thread) what it does;
    over TLS with :class:`_WatchedHTTPSConnection` (which puts urllib3's TLS connection
    between this and the plain one)."""

    watch: _Watch | None = None

    def _new_conn(self) -> socket.socket:
        return _opened(self, super()._new_conn())

    def connect(self) -> None:
        """Connect (a lapse meanwhile ends it, the TLS handshake included)."""
        try:
            super().connect()
        finally:
            if self.watch is not None:
                self.watch.connected(self)

    def request(self, *args: Any, **kwargs: Any) -> None:
        """Write the request, unless its send gave up on it."""
        _writing(self)
        super().request(*args, **kwargs)

    def close(self) -> None:
        """Close (never while the watch shuts the socket down)."""
        with _closing(self):
            super().close()


class _WatchedHTTPConnection(_Watched):
    """:class:`_Watched` over plain HTTP."""


class _WatchedHTTPSConnection(_Watched, urllib3.connection.HTTPSConnection):
    """:class:`_Watched` over TLS."""


def _opened(connection: _Watched, sock: socket.socket) -> socket.socket:
    connection.watch = connection.watch or _watch_of_thread()
    if connection.watch is not None:
        try:
            # (a proxy's CONNECT and the TLS handshake come next: a lapse ends them)
            connection.watch.opened(connection, sock)
        except _Lapsed:
            sock.close()
            raise
    return sock


def _writing(connection: _Watched) -> None:
    connection.watch = connection.watch or _watch_of_thread()
    if connection.watch is not None:
        if connection.sock is None:
            # Connected now, not by http.client's first write: the connection (a
            # proxy's CONNECT included) is no part of the request.
            connection.connect()
        connection.watch.writing(connection)


def _closing(connection: _Watched) -> contextlib.AbstractContextManager[object]:
    if connection.watch is None:
        return contextlib.nullcontext()
    return connection.watch.closing(connection)


class _WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_WATCHED_POOLS: dict[str, type[urllib3.HTTPConnectionPool]] = {
    "http": _WatchedHTTPPool,
    "https": _WatchedHTTPSPool,
}


class _WatchedAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter for one Connector request, on connections ``watch`` sees."""

    def __init__(self, watch: _Watch, max_retries: Any) -> None:
        self._watch = watch
        super().__init__(max_retries=max_retries)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        """requests' pool manager, making watched connections."""
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _WATCHED_POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        """requests' manager for ``proxy``, making watched connections (a SOCKS proxy's
        are its own: the watch is blind to them)."""
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if type(manager) is urllib3.ProxyManager:
            manager.pool_classes_by_scheme = _WATCHED_POOLS
        else:
            self._watch.blind = True
        return manager

    def send(self, *args: Any, **kwargs: Any) -> requests.Response:
        """Send on this thread, watched."""
        _sending.watch = self._watch
        try:
            return super().send(*args, **kwargs)
        finally:
            _sending.watch = None


@dataclass(frozen=True)
class _Refused:
    """The Connector answered ``401`` to a request carrying the held ``token``."""

    source: TokenSource
    token: str
    #: what the answer means when a new token does not help
    outcome: SendOutcome


class _PooledSender(AsyncRequestsHTTPSender):
    """msrest's requests sender, sending on ``pool`` (msrest's own sends on the loop's
    default executor, which the rest of the service shares)."""

    def __init__(self, config: Any, pool: concurrent.futures.Executor) -> None:
        super().__init__(config)
        self._pool = pool

    async def send(  # type: ignore[override]  # (as msrest's own async sender's)
        self, request: ClientRequest, **kwargs: Any
    ) -> AsyncRequestsClientResponse:
        """Send ``request`` as msrest does (its session configured, its errors wrapped)."""
        requests_kwargs = self._configure_send(request, **kwargs)
        session = requests_kwargs.pop("session", self.session)
        send = functools.partial(session.request, request.method, request.url, **requests_kwargs)
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, send)
        except requests.RequestException as err:
            raise_with_traceback(ClientRequestError, "Error occurred in request.", err)
        return AsyncRequestsClientResponse(request, answer)  # type: ignore[no-untyped-call]


def _pipeline(
    config: Any, pool: concurrent.futures.Executor, token: str | None
) -> AsyncPipeline[Any, Any]:
    """msrest's default pipeline for a Connector client's ``config`` (as
    ``ServiceClientAsync`` builds it), sending on ``pool`` with ``token`` (None: no
    ``Authorization``, the local no-auth mode)."""
    policies: list[Any] = [config.user_agent_policy, RawDeserializer(), config.http_logger_policy]
    if token is not None:
        bearer = BasicTokenAuthentication({"access_token": token})
        policies.insert(1, AsyncRequestsCredentialsPolicy(bearer))  # type: ignore[no-untyped-call]
    return AsyncPipeline(policies, AsyncPipelineRequestsHTTPSender(_PooledSender(config, pool)))


def send_tokens(
    *, clock: Clock | None = None, timeout_s: float = TOKEN_TIMEOUT_S, threads: int = SEND_THREADS
) -> ConnectorTokens:
    """The Connector's access tokens, fetched on a new Teams send pool of ``threads``.

    The threads requests sends on (the token's request and the Connector's), not the
    loop's default executor: a send stuck where no lapse reaches (a DNS look-up, a TCP
    connect, a TLS handshake) holds one of these, never a thread the rest of the service
    waits for."""
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="teams-send"
    )
    return ConnectorTokens(clock=clock or SystemClock(), pool=pool, timeout_s=timeout_s)


class TeamsChannel:
    """Posts replies and approved output through the Bot Connector.

    ``kind == "reply"`` answers the triggering activity
    (``POST .../conversations/{id}/activities/{activity_id}``); ``"gating"`` posts a new
    message into the same conversation (``POST .../conversations/{id}/activities``).

    Idempotency: the outgoing activity's ``id`` is set from the idempotency key, but the
    SDK (``TurnContext.send_activities``) clears ``id`` before posting and the Connector
    assigns its own ids, so Teams offers no de-duplication: a timed-out post is
    :class:`Uncertain`. The SDK's own HTTP retries are switched off (retries are the
    relay's, with backoff and Retry-After).
    """

    name = CHANNEL
    max_chars = MAX_TEXT_BYTES
    text_size = staticmethod(text_size)

    def __init__(
        self,
        adapter: CloudAdapter,
        app_id: str,
        *,
        timeout_s: float = 30.0,
        deadline_s: float = SEND_DEADLINE_S,
        token_timeout_s: float = TOKEN_TIMEOUT_S,
        clock: Clock | None = None,
        send_threads: int = SEND_THREADS,
        tokens: ConnectorTokens | None = None,
    ) -> None:
        if deadline_s <= timeout_s:
            raise ValueError("deadline_s must be longer than timeout_s")
        self._adapter = adapter
        self._app_id = app_id
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        #: the access tokens (shared with the SDK's credentials by :class:`TeamsAdapter`)
        self.tokens = tokens or send_tokens(
            clock=clock, timeout_s=token_timeout_s, threads=send_threads
        )
        self._tokens = self.tokens
        self._pool = self.tokens.pool

    def fetch_token_ahead(self, context: TurnContext) -> None:
        """Start fetching the access token the Connector's calls for ``context`` (an
        inbound activity being handled) carry, when none is held, without waiting
        (:meth:`ConnectorTokens.fetch_ahead`; no app id: there is none)."""
        client = context.turn_state.get(self._adapter.BOT_CONNECTOR_CLIENT_KEY)
        config = getattr(client, "config", None)
        source = TokenSource.of(getattr(config, "credentials", None))
        if source is not None:
            self._tokens.fetch_ahead(source)

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post ``message.text`` (or, ``message.card`` set, a review card as an
        Adaptive Card) to the bound conversation; never raises for SDK errors."""
        reply_to: str | None = None
        if message.kind in ("reply", "notice"):
            # (a notice answers the message it is about: bots.base.tell_not_taken_in)
            reply_to = message.address.get("activity_id") or None
        if message.card is not None:
            activity = Activity(
                type=ActivityTypes.message,
                attachments=[CardFactory.adaptive_card(teams_review.adaptive_card(message.card))],
                summary=teams_review.summary_text(message.card),
                id=message.idempotency_key,
            )
        else:
            activity = Activity(
                type=ActivityTypes.message, text=message.text, id=message.idempotency_key
            )

        async def post(turn_context: TurnContext) -> str | None:
            response = await turn_context.send_activity(activity)
            return getattr(response, "id", None) or None

        return await self._continue(message, post, reply_to=reply_to, fallback_reply=True)

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """Replace the card posted as activity ``external_id``
        (``PUT .../conversations/{id}/activities/{external_id}``). Repeating a replace is
        harmless, so an answer that never came is a Retry."""
        if message.card is None:
            return Permanent("teams: card update without a card")
        card = message.card

        async def replace(turn_context: TurnContext) -> str | None:
            await turn_context.update_activity(
                Activity(
                    type=ActivityTypes.message,
                    id=external_id,
                    attachments=[CardFactory.adaptive_card(teams_review.adaptive_card(card))],
                )
            )
            return external_id

        outcome = await self._continue(
            message, replace, reply_to=None, fallback_reply=False, edit=True
        )
        if isinstance(outcome, Uncertain):
            return Retry(outcome.error, said=outcome.said)
        return outcome

    async def _continue(
        self,
        message: OutboundMessage,
        call: Callable[[TurnContext], Awaitable[str | None]],
        *,
        reply_to: str | None,
        fallback_reply: bool,
        edit: bool = False,
    ) -> SendOutcome:
        """Run ``call`` in a proactive turn on the stored conversation reference, mapping
        every failure onto an outcome class (``edit``: ``call`` edits a card).

        The whole send ends within ``deadline_s`` (:data:`SEND_DEADLINE_S`, or what is
        left of its delivery's: the message's ``within_s``; less than ``timeout_s``
        left, nothing is sent: :class:`Retry`): the
        Connector's request must be under way (its access token got, connected, through
        any proxy's tunnel and the TLS handshake) within ``deadline_s - timeout_s``
        (past it: :class:`Retry`, and the request is never written), and then it and
        its answer get ``timeout_s`` (past it: :class:`Uncertain`). requests bounds each
        socket operation alone, and a Connector or proxy trickling its answer kept a
        send past its lease.

        A ``401`` from the Connector to a held access token drops the token, and the
        call is made once more with a new one, within the same deadline (a 401 is
        answered before anything is posted).
        """
        raw_reference = message.address.get("reference")
        if not isinstance(raw_reference, dict):
            return Permanent("teams binding has no conversation reference")
        try:
            reference = ConversationReference().deserialize(raw_reference)
        except Exception as exc:  # msrest raises DeserializationError and friends
            return Permanent(f"teams conversation reference is invalid: {exc}")
        if not reference.service_url or reference.conversation is None:
            return Permanent("teams conversation reference lacks serviceUrl or conversation")
        if fallback_reply and message.kind == "reply" and reply_to is None:
            reply_to = reference.activity_id

        deadline_s = message.budget_s(self._deadline_s)
        if deadline_s <= self._timeout_s:
            # The request and its answer could not get their timeout within the deadline.
            return too_little_left(
                "teams connector", deadline_s, self._timeout_s, "the request and its answer"
            )
        started = asyncio.get_running_loop().time()
        outcome = await self._attempt(reference, call, reply_to, started, deadline_s, edit=edit)
        if isinstance(outcome, _Refused):
            self._tokens.drop(outcome.source, outcome.token)
            outcome = await self._attempt(reference, call, reply_to, started, deadline_s, edit=edit)
        return outcome.outcome if isinstance(outcome, _Refused) else outcome

    async def _attempt(
        self,
        reference: ConversationReference,
        call: Callable[[TurnContext], Awaitable[str | None]],
        reply_to: str | None,
        started: float,
        deadline_s: float,
        *,
        edit: bool,
    ) -> SendOutcome | _Refused:
        """One proactive turn of :meth:`_continue`, within ``deadline_s`` counted from
        ``started``."""
        loop = asyncio.get_running_loop()
        before_write_s = deadline_s - self._timeout_s
        scope: asyncio.Timeout | None = None

        def answer_within_timeout() -> None:
            # The request is being written: it and its answer get timeout_s, within
            # the send's deadline.
            if scope is not None and not scope.expired() and scope.when() is not None:
                scope.reschedule(min(loop.time() + self._timeout_s, started + deadline_s))

        def written() -> None:  # (on the sending thread)
            loop.call_soon_threadsafe(answer_within_timeout)

        watch = _Watch(written)
        try:
            async with asyncio.timeout_at(started + before_write_s) as scope:
                return await self._run(reference, call, reply_to, watch, edit=edit)
        except TimeoutError:
            pass
        finally:
            scope = None  # (a late answer_within_timeout finds it gone)
        if watch.lapse():
            return Uncertain(
                f"teams connector: no answer within {self._timeout_s:g} s after the request "
                "was sent; the post may have landed"
            )
        return Retry(
            f"teams connector: the connection took longer than {before_write_s:g} s "
            "(a free send thread, the access token's request, any proxy's tunnel and the "
            "TLS handshake included); nothing was sent"
        )

    async def _run(
        self,
        reference: ConversationReference,
        call: Callable[[TurnContext], Awaitable[str | None]],
        reply_to: str | None,
        watch: _Watch,
        *,
        edit: bool,
    ) -> SendOutcome | _Refused:
        """:meth:`_continue`'s proactive turn, every failure mapped (never raises)."""
        sent: list[str | None] = []
        in_flight = False
        answers: list[requests.Response] = []
        # the access token the Connector's request carries, and whose it is
        used: tuple[TokenSource, str] | None = None

        def heard(response: requests.Response, *args: Any, **kwargs: Any) -> None:
            answers.append(response)

        def watched(
            session: requests.Session, config: Any, local: Any, **kwargs: Any
        ) -> dict[str, Any]:
            # (msrest's hook on each request's session, before it is sent)
            for prefix in ("https://", "http://"):
                # (msrest's retry policy, set on requests' adapters)
                retries = getattr(session.get_adapter(prefix), "max_retries", 0)
                session.mount(prefix, _WatchedAdapter(watch, retries))
            return kwargs

        async def run(turn_context: TurnContext) -> None:
            nonlocal in_flight, used
            client = turn_context.turn_state.get(self._adapter.BOT_CONNECTOR_CLIENT_KEY)
            if client is not None:
                # msrest's urllib3 retry policy would silently re-POST on some errors.
                client.config.retry_policy.retries = 0
                # With no retries left, urllib3 turns an answer it would retry (msrest
                # lists 408 and the 5xx but 501 and 505) to a method it deems
                # idempotent, a card's PUT, into MaxRetryError, the status and its
                # Retry-After lost: it is to hand the answer back instead.
                client.config.retry_policy.policy.raise_on_status = False
                client.config.connection.timeout = self._timeout_s
                # Its request goes out on connections the watch sees (its deadline).
                client.config.session_configuration_callback = watched
                # msrest reads every answer's body by its content type before it looks
                # at the status, and names neither when it cannot: the answer, heard
                # here (a requests hook; the client is this call's own), tells.
                client.config.hooks.append(heard)
                # The token comes from the shared, bounded cache (the SDK's own
                # credentials asked msal for a new one for each send, on the event
                # loop), and the request goes out on the send pool, watched.
                source = TokenSource.of(client.config.credentials)
                if source is not None:
                    used = (source, await self._tokens.token(source))
                client.config.pipeline = _pipeline(
                    client.config, self._pool, used[1] if used is not None else None
                )
            # The SDK sets replyToId from the turn activity's id: for a continuation that
            # is a fresh random id, so set it to what this delivery means (None: a new
            # message in the conversation, posted to .../activities).
            turn_context.activity.id = reply_to
            in_flight = True
            try:
                sent.append(await call(turn_context))
            finally:
                if client is not None:
                    await _close_client(client)

        try:
            await self._adapter.continue_conversation(reference, run, self._app_id)
        except NoToken as exc:
            return Retry(f"teams: {exc}; nothing was sent")
        except ErrorResponseException as exc:
            outcome = _classify_status(exc)
            if used is not None and getattr(exc.response, "status_code", None) == 401:
                return _Refused(used[0], used[1], outcome)
            return outcome
        except ClientRequestError as exc:
            inner = getattr(exc, "inner_exception", None)
            return _classify_transport_error(
                inner if inner is not None else exc,
                written=None if watch.blind else watch.written,
            )
        except Exception as exc:
            if isinstance(exc, DeserializationError) and in_flight and answers:
                return _not_the_connectors_answer(answers[-1], reference.service_url, edit=edit)
            if in_flight:
                return Uncertain(f"teams send failed mid-request: {exc!r}")
            return Permanent(f"teams send failed before posting: {exc!r}")
        return Sent(sent[0] if sent else None)

    async def close(self) -> None:
        """Nothing to release: connector clients are closed after each send, and the
        pool is left to end its threads by itself (a send still finishing at shutdown
        must find it open: one refused there would fail a delivery for good)."""


async def _close_client(client: Any) -> None:
    # ConnectorClient has no close(); leaving its async context closes the requests
    # session (and its pooled sockets) that msrest opened for this one call.
    try:
        await client.__aexit__(None, None, None)
    except Exception:  # closing is best effort
        log.debug("teams: closing the connector client failed", exc_info=True)


class TeamsAdapter:
    """``POST /api/messages`` plus :class:`TeamsChannel`, sharing one ``CloudAdapter``."""

    def __init__(
        self,
        settings: TeamsSettings,
        core: Core,
        *,
        send_timeout_s: float = 30.0,
        send_deadline_s: float = SEND_DEADLINE_S,
        auth_timeout_s: float = 10.0,
        token_timeout_s: float = TOKEN_TIMEOUT_S,
        clock: Clock | None = None,
    ) -> None:
        self._settings = settings
        self._core = core
        self._auth_timeout_s = auth_timeout_s
        config = sdk_config(settings)
        tokens = send_tokens(clock=clock, timeout_s=token_timeout_s)
        # The SDK's own Connector calls (a reply while an activity is handled) wait for
        # the shared token too: its credentials asked msal on the event loop.
        self.auth = ConfigurationBotFrameworkAuthentication(
            config,
            credentials_factory=HeldTokenCredentialsFactory(
                ConfigurationServiceClientCredentialFactory(config), tokens
            ),
        )
        self.cloud_adapter = CloudAdapter(self.auth)
        self.teams_channel = TeamsChannel(
            self.cloud_adapter,
            settings.app_id,
            timeout_s=send_timeout_s,
            deadline_s=send_deadline_s,
            tokens=tokens,
        )
        self.channel: Channel = self.teams_channel
        # The "not taken in" notice, sent as the channel's sends are, on shorter bounds
        # (each notice's: what recording left of Teams' wait, TeamsBot.on_turn).
        notices = TeamsChannel(
            self.cloud_adapter,
            settings.app_id,
            timeout_s=REPLY_TIMEOUT_S,
            deadline_s=RECORD_DEADLINE_S + REPLY_DEADLINE_S,
            tokens=tokens,
        )
        self.bot: Bot = TeamsBot(core, notices)
        # Token validation may fetch the OpenID metadata with a blocking `requests.get`
        # and no timeout; it runs on these threads so the event loop never blocks on it.
        self._auth_pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def auth_enabled(self) -> bool:
        """False only in the local no-auth mode (empty app id and password)."""
        return bool(self._settings.app_id or self._settings.app_password)

    def enable_reviews(self, backend: ChatReviewBackend) -> None:
        """Review cards' ``Action.Execute`` invokes (and remembering conversations for
        ``notify add --channel teams``), on the same verified endpoint."""
        self.bot = teams_review.ReviewingBot(self.bot, backend, self._core.spawn)

    def mount(self, app: web.Application) -> None:
        """Add ``POST /api/messages``."""
        app.router.add_post("/api/messages", answering_errors(self.handle))

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """The thread pool that validates Bot Framework tokens."""
        if not self.auth_enabled:
            log.warning(
                "teams: app_id and app_password are empty: /api/messages accepts "
                "unauthenticated requests (local testing only)"
            )
        self._auth_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="teams-auth"
        )
        try:
            yield
        finally:
            self._auth_pool.shutdown(wait=False, cancel_futures=True)
            self._auth_pool = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Verify, parse and acknowledge one activity (the turn runs in the background).

        This does what ``CloudAdapter.process`` does, in two steps, so that an
        authentication failure is told apart from every other error: the SDK lets a
        malformed token surface as an arbitrary exception (a 500), which is a 401 here.
        """
        token = bearer_token(request)
        auth_header = request.headers.get("Authorization", "")
        if self.auth_enabled and (
            token is None
            or not _readable_jwt(token)
            # The token alone (signature, issuer, audience, lifetime): no body is read
            # for a sender that cannot present a valid one.
            or await self._authenticate(Activity(), auth_header) is None
        ):
            raise _unauthorized()
        if request.content_type != "application/json":
            raise _UnsupportedContentType(
                "the body must be application/json (a Bot Framework activity)",
                rule="teams.content_type",
            )
        body = json_object(await read_body(request), allow_nul=True)
        check_activity(body)
        try:
            activity = Activity().deserialize(body)
        except Exception:
            raise _not_an_activity() from None
        # Again with the activity: the token must be the one issued for this serviceUrl
        # and channel (in no-auth mode, the SDK's anonymous identity).
        auth_result = await self._authenticate(activity, auth_header)
        if auth_result is None:
            raise _unauthorized()
        invoke = await self.cloud_adapter.process_activity(auth_result, activity, self.bot.on_turn)
        if invoke is not None:
            if invoke.status == 501:
                # The SDK's answer to an invoke no handler of ours takes (a message
                # extension, a task module): it asked for something we do not serve,
                # which is the caller's request, not our failure.
                raise ValidationError(
                    "this invoke is not one leadgate answers (only the review cards')",
                    rule="teams.invoke",
                )
            # A plain dict body (the review cards' invoke answers) is JSON already;
            # serializer_helper only takes msrest models (interactivity.md).
            body = invoke.body if isinstance(invoke.body, dict) else serializer_helper(invoke.body)
            return web.json_response(body, status=invoke.status)
        return web.Response(status=202)

    async def _authenticate(self, activity: Activity, auth_header: str) -> Any:
        """The SDK's authentication result, or None when it refuses the request (the SDK
        raises arbitrary exceptions for a bad token, so any of them is a refusal)."""

        def run() -> Any:
            return asyncio.run(self.auth.authenticate_request(activity, auth_header))

        try:
            if self._auth_pool is None:  # not started through the app (direct use in tests)
                return await self.auth.authenticate_request(activity, auth_header)
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(
                loop.run_in_executor(self._auth_pool, run), timeout=self._auth_timeout_s
            )
        except Exception as exc:
            log.info("teams: rejected an unauthenticated request: %r", exc)
            return None


def _readable_jwt(token: str) -> bool:
    """Whether ``token`` (printable ASCII, from :func:`bearer_token`) is a JWT whose JOSE
    header decodes (no signature checked: the SDK does that next)."""
    try:
        jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        return False
    return True


def create(settings: Settings, core: Core) -> Adapter | None:
    """The Teams adapter, or None when ``[teams]`` is off (no app_id and not enabled)."""
    teams = settings.teams
    if not teams.on:
        return None
    return TeamsAdapter(teams, core)
