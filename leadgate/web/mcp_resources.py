"""The hosted MCP server's resources (SPEC 13): a session transcript, and its updates.

Resource template ``leadgate://agents/{agent}/sessions/{session}/messages``: reading it
gives the JSON text of the transcript page REST answers
(``{"object": "list", "data": [...], "has_more"}``; ``?after=<message id>&limit=1..100``
may follow, as on REST), plus ``"review"``: ``{"status"}`` of the session's latest held
work as the events stream's ``review`` event names it, or ``null`` (MCP has no events
stream: without it a rejected answer showed nowhere). ``{agent}`` and ``{session}`` are
percent-encoded as in a URL path; the session is the public session name (MCP's
``session`` argument, or ``default``). Another organization's agent is "Unknown
resource" (-32602, ``"rule": "agent.not_found"`` in ``error.data``).

Updates (a message stored or revealed in the session, or its held work's public status
changed) reach subscribers both ways the protocol has:

* handshake era (``initialize``, up to 2025-11-25): ``resources/subscribe`` keeps the
  subscriber's connection; ``notifications/resources/updated`` goes out on its standalone
  stream. Subscriptions end with ``resources/unsubscribe`` or the MCP session (idle
  expiry, DELETE): the connection's teardown removes them (bounded per connection and in
  all).
* 2026-07-28 (``server/discover``): ``subscriptions/listen`` with
  ``resourceSubscriptions``; the SDK's :class:`~mcp.server.subscriptions.ListenHandler`
  serves the stream (bounded backlog) after this module checked that the caller may read
  every URI it asked for. Its events go through :class:`SessionBus`, which hands a
  session's update only to the streams opened on that session: the same URI text names
  a different session in each organization (and each key's ``default``), and the SDK's
  in-memory bus matches on the text alone.

Wake-ups come from :class:`leadgate.operations.event_hub.EventHub` (any replica); they
are queued (bounded, dropped when full: a client re-reads anyway) and sent by one task.
Every ``recheck_s`` (``[api] events_reauth_s``) another task drops what is subscribed to
a session whose agent was deleted (:meth:`Resources.recheck`: one read for them all). A
revoked key's streams end at their own re-check (:mod:`leadgate.web.mcp`). Updates are
not stored for replay (no event store: a notification names only the URI, and a client
whose stream reconnected reads the resource again for the current state).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

import mcp_types as mt
from aiohttp import web
from mcp.server.context import ServerRequestContext
from mcp.server.subscriptions import ListenHandler, ResourceUpdated, ServerEvent
from mcp.shared.exceptions import MCPError

from leadgate.core.auth import Principal
from leadgate.core.decoding import single_value
from leadgate.core.errors import (
    DatabaseDamaged,
    LeadgateError,
    NotFound,
    Unavailable,
    ValidationError,
    log_failure,
    quoted,
    when_reading,
)
from leadgate.core.logs import Tally, loggable
from leadgate.web.common import DamagedAnswers, damaged_answers
from leadgate.web.sessions_api import SessionReads

log = logging.getLogger("leadgate.mcp")

#: Where the bridge (:mod:`leadgate.web.mcp`) leaves a :class:`CallSource` for the HTTP
#: request that carried an MCP call, in its ASGI scope: a handler meeting a damaged
#: database counts it with the application's other requests
#: (:class:`leadgate.web.common.DamagedAnswers`).
REQUEST_SCOPE_KEY: Final = "leadgate.request"


@dataclasses.dataclass(frozen=True, slots=True)
class CallSource:
    """What an MCP call needs of the HTTP request that carried it: where to count a
    damaged database, and the request's method and path for that line. Not the aiohttp
    request itself: the SDK keeps the ASGI request of a session's last message for as
    long as the session lives, and with it the aiohttp request (its transport and
    buffers) long after it was answered."""

    answers: DamagedAnswers
    method: str
    path: str

    @classmethod
    def of(cls, request: web.Request) -> CallSource:
        """The source of a call carried by ``request``."""
        return cls(damaged_answers(request), request.method, request.path)


# For a call that came without one (no bridge: a wiring bug): counted apart.
_DAMAGED = Tally(
    log, "%d MCP call(s) met a damaged database: %s", every_s=60.0, level=logging.ERROR
)


def note_damaged(ctx: ServerRequestContext[Any, Any], exc: DatabaseDamaged) -> None:
    """Count ``exc``, met by an MCP call (a tool call, a resource read or subscription),
    in the one ERROR line a minute naming the database: the call's error went to its
    client alone, and the operators never heard of it."""
    scope = getattr(ctx.request, "scope", None)
    source = scope.get(REQUEST_SCOPE_KEY) if isinstance(scope, dict) else None
    if isinstance(source, CallSource):
        source.answers.note_for(source.method, source.path, exc)
    else:
        _DAMAGED.add(exc.detail)


URI_TEMPLATE: Final = "leadgate://agents/{agent}/sessions/{session}/messages"
TEMPLATE_NAME: Final = "session_messages"
#: Subscriptions kept at most, per connection and in all (the oldest are dropped).
MAX_PER_CONNECTION: Final = 100
MAX_SUBSCRIPTIONS: Final = 10_000
#: Wake-ups waiting to be sent at most (more are dropped: clients re-read anyway).
MAX_PENDING: Final = 10_000
#: A notification that cannot be written this fast is dropped with its subscription.
SEND_TIMEOUT_S: Final = 5.0
#: How often subscriptions are checked against deleted agents (``[api] events_reauth_s``).
RECHECK_S: Final = 5.0

PrincipalOf = Callable[[ServerRequestContext[Any, Any]], Principal | None]
EventListener = Callable[[ServerEvent], None]
#: Which of the given sessions may still be read (their agent is not deleted):
#: :meth:`leadgate.operations.transcripts.Transcripts.readable`.
Readable = Callable[[set[str]], Awaitable[set[str]]]

#: (session id, URI) pairs the listen call under way has been checked for; read by
#: :meth:`SessionBus.subscribe`, which the SDK's handler calls in that call's task (the
#: handler's interface passes the bus no caller).
_LISTENING_TO: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "leadgate_mcp_listening_to", default=()
)


class SessionBus:
    """The SDK's ``SubscriptionBus`` for listen streams, keyed by session id.

    :meth:`updated` reaches only the streams whose caller was checked for that session,
    with a ``ResourceUpdated`` for each URI of it they listen to. :meth:`publish` (the
    protocol's own method, for list-changed events, which name nothing of an
    organization's) still reaches every stream; nothing here calls it.
    """

    def __init__(self) -> None:
        # session id -> {subscription token: (listener, the session's URIs it asked for)}
        self._by_session: dict[str, dict[object, tuple[EventListener, tuple[str, ...]]]] = {}
        self._all: dict[object, EventListener] = {}

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        """Register one stream's listener for the sessions its listen call was checked for."""
        token = object()
        wanted: dict[str, list[str]] = {}
        for session_id, uri in _LISTENING_TO.get():
            wanted.setdefault(session_id, []).append(uri)
        for session_id, uris in wanted.items():
            self._by_session.setdefault(session_id, {})[token] = (listener, tuple(uris))
        self._all[token] = listener

        def unsubscribe() -> None:
            self._all.pop(token, None)
            for session_id in wanted:
                streams = self._by_session.get(session_id, {})
                streams.pop(token, None)
                if not streams:
                    self._by_session.pop(session_id, None)

        return unsubscribe

    async def publish(self, event: ServerEvent) -> None:
        """Deliver ``event`` to every stream."""
        for listener in list(self._all.values()):
            _deliver(listener, event)
        await asyncio.sleep(0)  # let the streams drain between events, as the SDK's bus

    async def updated(self, session_id: str) -> None:
        """Tell the streams listening to ``session_id`` that its transcript changed."""
        for listener, uris in list(self._by_session.get(session_id, {}).values()):
            for uri in uris:
                _deliver(listener, ResourceUpdated(uri=uri))
        await asyncio.sleep(0)

    def sessions(self) -> set[str]:
        """The sessions some stream listens to."""
        return set(self._by_session)

    def forget(self, session_id: str) -> None:
        """Hand no more of ``session_id``'s updates to any stream."""
        self._by_session.pop(session_id, None)

    def listens_to(self, session_id: str) -> bool:
        """Whether some stream listens to ``session_id``."""
        return session_id in self._by_session


def _deliver(listener: EventListener, event: ServerEvent) -> None:
    try:
        listener(event)
    except Exception as exc:  # one stream's failure must not starve the others
        log.error("MCP listen stream failed to take an update; continuing", exc_info=loggable(exc))


#: What the event hub calls on a session's wake-up: ``(session_id, has_message)``.
Watcher = Callable[[str, bool], None]


class Notifier(Protocol):
    """Where a handshake-era notification goes (the SDK's connection or session)."""

    async def send_resource_updated(self, uri: str) -> None: ...


def resource_uri(agent: str, session: str) -> str:
    """The transcript resource of ``session`` with ``agent``."""
    return URI_TEMPLATE.format(agent=quote(agent, safe=""), session=quote(session, safe=""))


def parse_uri(uri: str) -> tuple[str, str, str | None, str | None]:
    """(agent, session, after, limit) of a transcript URI; -32602 otherwise, naming
    ``query.repeated`` for ``after`` or ``limit`` given twice (as REST refuses it)."""
    parts = urlsplit(uri)
    path = parts.path.split("/")
    # leadgate://agents/<agent>/sessions/<session>/messages -> ["", agent, "sessions", ...]
    if (
        parts.scheme != "leadgate"
        or parts.netloc != "agents"
        or len(path) != 5
        or path[0] != ""
        or path[2] != "sessions"
        or path[4] != "messages"
        or not path[1]
        or not path[3]
    ):
        raise _unknown(uri)
    # Blank values kept, as aiohttp keeps them on REST: ``?limit=&limit=2`` gives limit
    # twice on both surfaces (an empty value is still no value).
    query = parse_qs(parts.query, keep_blank_values=True)
    try:
        after = single_value("after", query.get("after", [])) or None
        limit = single_value("limit", query.get("limit", []))
    except ValidationError as exc:
        raise _refused(uri, exc) from None
    return unquote(path[1]), unquote(path[3]), after, limit


def _damaged(ctx: ServerRequestContext[Any, Any], uri: str, exc: DatabaseDamaged) -> MCPError:
    """The error for a call that met a damaged database (counted: :func:`note_damaged`);
    it tells the client what a request's 500 does, not the file or the server's text."""
    note_damaged(ctx, exc)
    return MCPError(code=mt.INTERNAL_ERROR, message=exc.message, data=_uri_data(uri))


def _refused(uri: str, exc: LeadgateError) -> MCPError:
    """The JSON-RPC error for a call the service refused, naming its rule as the service's
    other JSON-RPC refusals do: ``INVALID_PARAMS`` for what the caller asked (a request's
    4xx), ``INTERNAL_ERROR`` for the service's own state (a request's 5xx: a database
    fault, with ``retryAfterS`` when retrying helps). A database fault was
    ``INVALID_PARAMS``, which tells a client to change its request, not to retry it."""
    data = _uri_data(uri)
    data["rule"] = exc.rule
    if exc.status < 500:
        return MCPError(code=mt.INVALID_PARAMS, message=exc.message, data=data)
    if exc.retry_after_s is not None:
        data["retryAfterS"] = exc.retry_after_s
    return MCPError(code=mt.INTERNAL_ERROR, message=exc.message, data=data)


#: How much of an unknown resource's URI its refusal quotes: a transcript URI of ordinary
#: ids whole (quoted() cuts at 80, and cut one organization's ids at another place than
#: another's), 5,000 characters sent not.
URI_QUOTE_LIMIT = 300


def _uri_data(uri: str) -> dict[str, Any]:
    """An error's ``data`` naming the URI a client sent: whole up to
    :data:`URI_QUOTE_LIMIT` characters, else its first that many and ``uriLength`` (its
    full length), as the message quotes it. ``data.uri`` carried the URI whole: a
    megabyte sent came back a megabyte."""
    if len(uri) <= URI_QUOTE_LIMIT:
        return {"uri": uri}
    return {"uri": uri[:URI_QUOTE_LIMIT], "uriLength": len(uri)}


def _unknown(uri: str, rule: str = "resource.unknown") -> MCPError:
    """-32602 for a URI that names no resource of the caller's: ``resource.unknown`` when
    it is no transcript URI at all, else the lookup's rule (``agent.not_found``, also for
    another organization's agent). It named no rule, unlike every other refusal here. The
    message quotes the URI as every refusal quotes what a client sent (:func:`quoted`):
    an agent's name of 5,000 characters came back whole."""
    return MCPError(
        code=mt.INVALID_PARAMS,
        message=f"Unknown resource: {quoted(uri, URI_QUOTE_LIMIT)}",
        data={**_uri_data(uri), "rule": rule},
    )


class Resources:
    """Resource handlers for the lowlevel ``Server`` and the update fan-out."""

    def __init__(
        self,
        reads: SessionReads,
        principal_of: PrincipalOf,
        parse_limit: Callable[[str | None], int],
        *,
        keep_notified: Callable[[str], Awaitable[None]] | None = None,
        readable: Readable | None = None,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.reads = reads
        self._keep_notified = keep_notified
        self._readable = readable
        self._recheck_s = recheck_s
        self.principal_of = principal_of
        self.parse_limit = parse_limit
        self.bus = SessionBus()
        self.listen_handler = ListenHandler(self.bus)
        # session id -> {(connection key, uri): notifier} (handshake era)
        self._subscribed: dict[str, dict[tuple[int, str], Notifier]] = {}
        self._by_connection: dict[int, dict[str, str]] = {}  # key -> {uri: session id}
        self._pending: asyncio.Queue[str] = asyncio.Queue(MAX_PENDING)

    # ------------------------------------------------------------------ handlers

    async def list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: mt.PaginatedRequestParams | None
    ) -> mt.ListResourcesResult:
        """No fixed resources: transcripts are reached through the template."""
        return mt.ListResourcesResult(resources=[])

    async def list_templates(
        self, ctx: ServerRequestContext[Any, Any], params: mt.PaginatedRequestParams | None
    ) -> mt.ListResourceTemplatesResult:
        """The transcript template."""
        return mt.ListResourceTemplatesResult(
            resource_templates=[
                mt.ResourceTemplate(
                    uri_template=URI_TEMPLATE,
                    name=TEMPLATE_NAME,
                    title="Session transcript",
                    description=(
                        "The visible messages of one session with an agent, oldest first, "
                        "as JSON {object, data: [{id, role, content, createdAt}], has_more}. "
                        "An answer held for Lead review appears here once it is approved. "
                        "Subscribe to hear when a message is added or revealed."
                    ),
                    mime_type="application/json",
                )
            ]
        )

    async def read(
        self, ctx: ServerRequestContext[Any, Any], params: mt.ReadResourceRequestParams
    ) -> mt.ReadResourceResult:
        """One transcript page as JSON text."""
        uri = str(params.uri)
        principal = self._principal(ctx)
        agent, session, after, limit = parse_uri(uri)
        try:
            page = await self.reads.messages(
                principal,
                agent,
                session,
                after=after,
                limit=self.parse_limit(limit),
                with_review=True,
            )
        except NotFound as exc:
            raise _unknown(uri, exc.rule) from None
        except DatabaseDamaged as exc:
            raise _damaged(ctx, uri, exc) from None
        except Unavailable as exc:
            raise _refused(uri, when_reading(exc)) from None
        except LeadgateError as exc:
            raise _refused(uri, exc) from None
        text = json.dumps(page)
        return mt.ReadResourceResult(
            contents=[mt.TextResourceContents(uri=uri, mime_type="application/json", text=text)]
        )

    async def subscribe(
        self, ctx: ServerRequestContext[Any, Any], params: mt.SubscribeRequestParams
    ) -> mt.EmptyResult:
        """Handshake era: notify this connection when the session's transcript changes."""
        uri = str(params.uri)
        session_id = await self._open(ctx, uri)
        await self._notified(ctx, session_id, uri)
        # The per-connection state the SDK tears down with the MCP session; not a public
        # attribute of ServerSession in mcp 2.3, so reached defensively: without it the
        # subscription lives until unsubscribe or the global bound.
        connection = getattr(ctx.session, "_connection", None)
        notifier: Notifier = connection if connection is not None else ctx.session
        key = id(connection if connection is not None else ctx.session)
        if key not in self._by_connection and connection is not None:
            connection.exit_stack.callback(self._forget_connection, key)
        uris = self._by_connection.setdefault(key, {})
        if uri not in uris and len(uris) >= MAX_PER_CONNECTION:
            self._remove(key, next(iter(uris)))
        uris[uri] = session_id
        self._subscribed.setdefault(session_id, {})[(key, uri)] = notifier
        while self.subscriptions > MAX_SUBSCRIPTIONS:
            oldest = next(iter(self._by_connection))
            self._remove(oldest, next(iter(self._by_connection[oldest])))
        return mt.EmptyResult()

    async def unsubscribe(
        self, ctx: ServerRequestContext[Any, Any], params: mt.UnsubscribeRequestParams
    ) -> mt.EmptyResult:
        """Handshake era: stop notifying this connection about ``uri``."""
        connection = getattr(ctx.session, "_connection", None)
        self._remove(id(connection if connection is not None else ctx.session), str(params.uri))
        return mt.EmptyResult()

    async def listen(
        self, ctx: ServerRequestContext[Any, Any], params: mt.SubscriptionsListenRequestParams
    ) -> mt.SubscriptionsListenResult:
        """2026-07-28: a listen stream, once every requested URI is the caller's to read."""
        uris = list(params.notifications.resource_subscriptions or [])
        sessions = [(await self._open(ctx, uri), uri) for uri in uris]
        for session_id, uri in sessions:
            await self._notified(ctx, session_id, uri)
        checked = _LISTENING_TO.set(tuple(sessions))
        try:
            return await self.listen_handler(ctx, params)
        finally:
            _LISTENING_TO.reset(checked)

    # ------------------------------------------------------------------ fan-out

    @property
    def subscriptions(self) -> int:
        """Handshake-era subscriptions held (all connections)."""
        return sum(len(uris) for uris in self._by_connection.values())

    def changed(self, session_id: str, has_message: bool) -> None:
        """Hub watcher: queue a notification when a message was stored or revealed, or
        the session's held work changed its public status (the page's ``review``: a
        rejection, a cancellation shows nowhere else on MCP, and a subscriber waiting
        for a revealed answer waited forever)."""
        if session_id not in self._subscribed and not self.bus.listens_to(session_id):
            return
        try:
            self._pending.put_nowait(session_id)
        except asyncio.QueueFull:
            log.warning("MCP resource notifications are backed up; one was dropped")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Send queued notifications for the duration of the block."""
        tasks = [asyncio.create_task(self._send_forever(), name="leadgate-mcp-resource-updates")]
        if self._readable is not None:
            tasks.append(
                asyncio.create_task(self._recheck_forever(), name="leadgate-mcp-subscriptions")
            )
        try:
            yield
        finally:
            self.listen_handler.close()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def recheck(self) -> None:
        """End what is subscribed to a session whose agent was deleted since: its
        handshake-era subscriptions are dropped, and listen streams hear no more of it
        (their other sessions go on). One read for all subscribed sessions
        (:data:`Readable`), none per update. A key revoked needs nothing here: its
        streams, where updates are written, end at their own re-check, and it opens
        no new one."""
        if self._readable is None:
            return
        sessions = self.sessions()
        if not sessions:
            return
        gone = sessions - await self._readable(sessions)
        for session_id in gone:
            for key, uri in list(self._subscribed.get(session_id, {})):
                self._remove(key, uri)
            self.bus.forget(session_id)
        if gone:
            log.info("MCP subscriptions of %d session(s) ended: their agent is deleted", len(gone))

    async def _recheck_forever(self) -> None:
        while True:
            await asyncio.sleep(self._recheck_s)
            try:
                await self.recheck()
            except Exception as exc:  # a database fault: the next round checks again
                log_failure(log, exc, "re-checking MCP resource subscriptions failed")

    async def _send_forever(self) -> None:
        while True:
            session_id = await self._pending.get()
            for (key, uri), notifier in list(self._subscribed.get(session_id, {}).items()):
                try:
                    await asyncio.wait_for(notifier.send_resource_updated(uri), SEND_TIMEOUT_S)
                except Exception:
                    log.info("MCP subscriber of %s is gone; subscription dropped", uri)
                    self._remove(key, uri)
            await self.bus.updated(session_id)

    # ------------------------------------------------------------------ helpers

    def _principal(self, ctx: ServerRequestContext[Any, Any]) -> Principal:
        principal = self.principal_of(ctx)
        if principal is None:  # the bridge always puts one there
            raise MCPError(code=mt.INTERNAL_ERROR, message="no caller")
        return principal

    async def _open(self, ctx: ServerRequestContext[Any, Any], uri: str) -> str:
        """The session id behind ``uri`` (created when no turn ran in it yet), after
        checking that the caller may read it."""
        principal = self._principal(ctx)
        agent, session, _, _ = parse_uri(uri)
        try:
            return await self.reads.open(principal, agent, session)
        except NotFound as exc:
            raise _unknown(uri, exc.rule) from None
        except DatabaseDamaged as exc:
            raise _damaged(ctx, uri, exc) from None
        except LeadgateError as exc:
            raise _refused(uri, exc) from None

    async def _notified(
        self, ctx: ServerRequestContext[Any, Any], session_id: str, uri: str
    ) -> None:
        """Every replica's writes to the session wake this one from now on (before the
        subscription is confirmed: the client's next read covers what came before)."""
        if self._keep_notified is None:
            return
        try:
            await self._keep_notified(session_id)
        except DatabaseDamaged as exc:
            raise _damaged(ctx, uri, exc) from None
        except LeadgateError as exc:
            raise _refused(uri, exc) from None

    def sessions(self) -> set[str]:
        """The sessions subscribed to here now (the hub renews their marks)."""
        return set(self._subscribed) | self.bus.sessions()

    def _remove(self, key: int, uri: str) -> None:
        session_id = self._by_connection.get(key, {}).pop(uri, None)
        if not self._by_connection.get(key, True):
            self._by_connection.pop(key, None)
        if session_id is None:
            return
        subscribers = self._subscribed.get(session_id, {})
        subscribers.pop((key, uri), None)
        if not subscribers:
            self._subscribed.pop(session_id, None)

    def _forget_connection(self, key: int) -> None:
        for uri in list(self._by_connection.get(key, {})):
            self._remove(key, uri)
        self._by_connection.pop(key, None)
