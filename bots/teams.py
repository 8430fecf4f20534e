"""Microsoft Teams through the Bot Framework SDK (botbuilder ``CloudAdapter``).

Inbound: ``POST /api/messages``. With authentication on, the Bot Framework JWT is
verified before the body is read: a request whose ``Authorization`` is not a bearer JWT
(its header segment unreadable) is ``401`` at once, and then the SDK's
``ConfigurationBotFrameworkAuthentication`` checks the token's signature, issuer,
audience (our app id) and lifetime on its own (an activity without ``serviceUrl`` and
``channelId``: the SDK checks neither then), so a sender without a valid token never gets
its body parsed. The body is then read and decoded through the one decoding path (413
over the size limit, 400 for bad JSON), and the SDK checks the token again against the
parsed activity: its ``serviceurl`` claim must name the activity's ``serviceUrl``, and its
signing key must be endorsed for the activity's ``channelId``. Then
a message activity becomes a
:class:`leadgate.core.types.Inbound` that is **recorded** (:func:`bots.base.accept`)
before the channel gets its ``202`` (Teams allows 15 s), and its turn runs in the
background. Outbound: :class:`TeamsChannel` rebuilds the stored conversation
reference and posts through ``CloudAdapter.continue_conversation``.

Authentication modes:

* ``app_id`` set: every request must carry a valid Bot Framework bearer token; a missing,
  malformed or unverifiable token is ``401`` and runs no turn. Outbound calls carry a
  token the SDK fetches from the Microsoft identity platform.
* ``app_id`` and ``app_password`` empty (``[teams] enabled = true``): no authentication
  at all, inbound or outbound. For local testing only; a warning is logged at startup.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import logging
import re
import ssl
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import jwt
import requests
import urllib3.exceptions
from aiohttp import web
from azure.core.exceptions import DeserializationError
from botbuilder.core import Bot, CardFactory, TurnContext, serializer_helper
from botbuilder.integration.aiohttp import (
    CloudAdapter,
    ConfigurationBotFrameworkAuthentication,
)
from botbuilder.schema import (
    Activity,
    ActivityTypes,
    ConversationReference,
    ErrorResponseException,
)
from msrest.exceptions import ClientRequestError

from bots import teams_review
from bots.base import (
    DATABASE_FAULTS,
    Adapter,
    Core,
    accept,
    answering_errors,
    not_taken_in,
    quoted_page,
)
from bots.review_base import ChatReviewBackend
from bots.teams_review import MAX_TEXT_BYTES, text_size
from leadgate.core.bodies import read_body
from leadgate.core.config import Settings, TeamsSettings
from leadgate.core.decoding import bearer_token, json_object
from leadgate.core.errors import ConfigError
from leadgate.core.limits import EVENT_ID_LIMIT, SESSION_KEY_LIMIT, bounded
from leadgate.core.types import BindingKind, Inbound
from outbox.channel import Channel, OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain

log = logging.getLogger(__name__)

CHANNEL = "teams"
#: Teams waits 15 s for the answer to an activity; recording ends well before.
RECORD_DEADLINE_S = 10.0
# How long the reply telling a person their message was not taken in may take.
REPLY_DEADLINE_S = 3.0

_MENTION_TAG = re.compile(r"<at>(.*?)</at>", re.IGNORECASE | re.DOTALL)


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
    """Turns message activities into triggers; never posts a turn's text itself."""

    def __init__(self, core: Core) -> None:
        self._core = core

    async def on_turn(self, context: TurnContext) -> None:
        """Parse and record (before the 202); the turn runs in the background.

        When the database cannot take the message in, its author is told in a reply and
        the channel gets its 202: nothing documents that Teams sends a message again
        after a 5xx (the person saw a message that was simply never answered). Only when
        that reply cannot be posted either is the fault passed on (503)."""
        inbound = parse_message(context.activity)
        if inbound is None:
            return
        try:
            await accept(
                self._core,
                inbound,
                name=f"teams-turn {inbound.external_event_id}",
                deadline_s=RECORD_DEADLINE_S,
            )
        except DATABASE_FAULTS as exc:
            log.warning("teams: could not record a message (%s)", exc.rule)
            try:
                # Bounded: Teams waits 15 s for the answer, recording may have taken 10.
                await asyncio.wait_for(context.send_activity(not_taken_in(exc)), REPLY_DEADLINE_S)
            except Exception as reply_exc:
                log.warning("teams: could not tell the author either: %r", reply_exc)
                raise exc from None


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


def _classify_transport_error(exc: BaseException, *, posting: bool = True) -> SendOutcome:
    """Map a ``requests`` failure (msrest sends with requests) onto an outcome class.

    Connect-phase failures (refused, DNS, connect timeout, TLS handshake) happen before
    a byte of the request is written: retry. A read timeout, a connection dropped or a
    TLS error after the handshake (while waiting for the answer) means the connector
    may have posted: uncertain. ``posting`` False: ``exc`` is not the post's own (the
    token request before it), so a TLS error there is a retry.
    """
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return Retry(f"teams connector connect timeout: {exc}")
    if isinstance(exc, requests.exceptions.ReadTimeout):
        return Uncertain(f"teams connector read timeout after the request was sent: {exc}")
    if isinstance(exc, requests.exceptions.SSLError):
        if not posting or _in_handshake(exc):
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

    def __init__(self, adapter: CloudAdapter, app_id: str, *, timeout_s: float = 30.0) -> None:
        self._adapter = adapter
        self._app_id = app_id
        self._timeout_s = timeout_s

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post ``message.text`` (or, ``message.card`` set, a review card as an
        Adaptive Card) to the bound conversation; never raises for SDK errors."""
        reply_to: str | None = None
        if message.kind == "reply":
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
        every failure onto an outcome class (``edit``: ``call`` edits a card)."""
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

        sent: list[str | None] = []
        in_flight = False
        answers: list[requests.Response] = []

        def heard(response: requests.Response, *args: Any, **kwargs: Any) -> None:
            answers.append(response)

        async def run(turn_context: TurnContext) -> None:
            nonlocal in_flight
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
                # msrest reads every answer's body by its content type before it looks
                # at the status, and names neither when it cannot: the answer, heard
                # here (a requests hook; the client is this call's own), tells.
                client.config.hooks.append(heard)
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
        except ErrorResponseException as exc:
            return _classify_status(exc)
        except ClientRequestError as exc:
            inner = getattr(exc, "inner_exception", None)
            return _classify_transport_error(inner if inner is not None else exc)
        except requests.RequestException as exc:
            # e.g. the token request to the Microsoft identity platform
            return _classify_transport_error(exc, posting=False)
        except PermissionError as exc:
            # The SDK raises PermissionError when it cannot obtain an access token.
            return Retry(f"teams: no access token for the connector: {exc}")
        except Exception as exc:
            if isinstance(exc, DeserializationError) and in_flight and answers:
                return _not_the_connectors_answer(answers[-1], reference.service_url, edit=edit)
            if in_flight:
                return Uncertain(f"teams send failed mid-request: {exc!r}")
            return Permanent(f"teams send failed before posting: {exc!r}")
        return Sent(sent[0] if sent else None)

    async def close(self) -> None:
        """Nothing to release: connector clients are closed after each send."""


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
        auth_timeout_s: float = 10.0,
    ) -> None:
        self._settings = settings
        self._core = core
        self._auth_timeout_s = auth_timeout_s
        self.auth = ConfigurationBotFrameworkAuthentication(sdk_config(settings))
        self.cloud_adapter = CloudAdapter(self.auth)
        self.bot: Bot = TeamsBot(core)
        self.teams_channel = TeamsChannel(
            self.cloud_adapter, settings.app_id, timeout_s=send_timeout_s
        )
        self.channel: Channel = self.teams_channel
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
            return web.Response(status=401, text="unauthorized")
        if request.content_type != "application/json":
            return web.Response(status=415, text="expected application/json")
        body = json_object(await read_body(request), allow_nul=True)
        try:
            activity = Activity().deserialize(body)
        except Exception:
            return web.Response(status=400, text="body is not an activity")
        if not isinstance(activity.type, str) or not activity.type:
            return web.Response(status=400, text="body is not an activity")
        # Again with the activity: the token must be the one issued for this serviceUrl
        # and channel (in no-auth mode, the SDK's anonymous identity).
        auth_result = await self._authenticate(activity, auth_header)
        if auth_result is None:
            return web.Response(status=401, text="unauthorized")
        invoke = await self.cloud_adapter.process_activity(auth_result, activity, self.bot.on_turn)
        if invoke is not None:
            if invoke.status == 501:
                # The SDK's answer to an invoke no handler of ours takes (a message
                # extension, a task module): it asked for something we do not serve,
                # which is the caller's request, not our failure.
                return web.json_response({"error": "this invoke is not supported"}, status=400)
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
