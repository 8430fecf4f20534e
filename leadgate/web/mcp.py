"""Hosted MCP server (SPEC 8) mounted on the aiohttp application at ``/mcp``.

The official ``mcp`` SDK serves the protocol (streamable HTTP, ``MCPServer``); this module
adds what the SDK does not know about:

* bearer-key authentication in front of MCP (401 before the SDK sees the request);
* a small ASGI bridge, because the SDK speaks ASGI and the service is aiohttp (the
  ``aiohttp-asgi`` package spins the loop at 100% CPU on SSE streams, see
  ``shared/notes/mcp.md``);
* the single public tool, ``send_action_agent_message``, which maps the turn
  :data:`~leadgate.core.types.Outcome` onto the exact public results of SPEC 8.

There is deliberately no operator tool here: reviewing, approving and reading work items
are not part of the hosted MCP surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import anyio
import mcp_types as mt
from aiohttp import web
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError
from starlette.authentication import AuthCredentials
from starlette.types import Message
from starlette.types import Scope as AsgiScope

from leadgate.core.auth import Principal, Scope
from leadgate.core.bodies import read_body
from leadgate.core.decoding import bearer_token, decode_json
from leadgate.core.errors import (
    DatabaseDamaged,
    IntakeInDoubt,
    LeadgateError,
    ModelError,
    PayloadTooLarge,
    Unavailable,
    ValidationError,
    quoted,
    when_reading,
)
from leadgate.core.limits import MESSAGE_LIMIT, validate_message
from leadgate.core.logs import loggable
from leadgate.core.types import BUSY_RULE, Busy, Duplicate, Gated, Outcome, Reply
from leadgate.operations.sessions import DEFAULT_SESSION
from leadgate.operations.transcripts import parse_limit
from leadgate.web.common import detach_stream, error_body, retry_headers, unavailable_response
from leadgate.web.mcp_resources import (
    REQUEST_SCOPE_KEY,
    CallSource,
    Readable,
    Resources,
    Watcher,
    note_damaged,
)
from leadgate.web.sessions_api import SessionReads

logger = logging.getLogger(__name__)

MCP_PATH: Final = "/mcp"
TOOL_NAME: Final = "send_action_agent_message"
MAX_MESSAGE_CHARS: Final = MESSAGE_LIMIT

# SPEC 8: the only public text of a rejected (busy) call. It must not hint at the review.
BUSY_TEXT: Final = "The operation could not be completed. Try again."
# Unexpected failures say the same thing: nothing internal reaches the client.
GENERIC_ERROR_TEXT: Final = BUSY_TEXT

# Where the bridge leaves the caller in the ASGI scope for the tool to read.
PRINCIPAL_SCOPE_KEY: Final = "leadgate.principal"

# How often a waiting ``receive()`` looks at the socket. aiohttp offers no public
# "client went away" event once the body is read, so the bridge checks the transport at
# this pace (a cheap attribute read, not a busy loop).
_DISCONNECT_POLL_S: Final = 0.5

#: When a client refused a session (all ``max_sessions`` open) is told to try again.
SESSION_FULL_RETRY_MS: Final = 5_000

#: An MCP session with no request in flight this long ends (the SDK's idle timeout,
#: held from each request's arrival by :class:`InFlight`).
SESSION_IDLE_S: Final = 600.0
#: Open MCP sessions at most (a new one beyond that gets 503).
MAX_SESSIONS: Final = 1000
#: How often an open stream (the GET stream, a POST answered as SSE such as a listen
#: stream) checks its key again: it ends once the key is revoked.
REAUTH_S: Final = 5.0

Authenticate = Callable[[str], Awaitable[Principal | None]]
SendMessage = Callable[[Principal, str, str, str | None], Awaitable[Outcome]]
#: ``EventHub.watch``: calls a watcher on every session wake-up and keeps the sessions
#: the second callable names notified by every replica; returns its stop.
Watch = Callable[[Watcher, Callable[[], Iterable[str]]], Callable[[], None]]
#: ``EventHub.keep_notified``: returns once every replica NOTIFYs the session's events.
KeepNotified = Callable[[str], Awaitable[None]]

INSTRUCTIONS: Final = (
    "leadgate runs AI worker agents. Use send_action_agent_message to talk to one."
)
RESOURCE_INSTRUCTIONS: Final = (
    " When its work awaits Lead review (leadReviewPending), read or subscribe to the "
    "session's transcript, leadgate://agents/{agent}/sessions/{session}/messages "
    "(session 'default' when you sent none): the approved answer appears there, and its "
    "review.status says when it never will (rejected, cancelled, failed, abandoned)."
)

TOOL_DESCRIPTION: Final = """\
Send a message to a leadgate Action Agent (an AI worker agent) and get its answer.

Use `agent` to name the worker agent (its id or slug) and `message` for what you want
it to do. Pass the same `session` string on later calls to continue one conversation;
omit it to use your default session with that agent.

The structured result is {"success": true, "result": {...}}:
- `leadReviewPending: false`: `text` holds the agent's reply.
- `leadReviewPending: true`: the agent finished the task and its work awaits review
  before it is released; `text` is empty. Do not resend the same task.
If the call fails with "The operation could not be completed. Try again.", the agent
cannot take the message right now: wait, then try again later.
If a call ends without any result (it timed out, or its connection dropped), its message
may already have been taken in: read the session's transcript (the resource
leadgate://agents/{agent}/sessions/{session}/messages) before sending it again. The same
arguments sent again while that message is still being answered get its answer, not a
second one.
"""


class ActionAgentResult(BaseModel):
    """What the agent answered (the ``result`` of a successful call)."""

    # SPEC 8 fixes these camelCase wire names.
    model_config = ConfigDict(extra="forbid")

    leadReviewPending: bool = Field(
        description="True when the agent's finished work awaits Lead review; text is then empty."
    )
    text: str = Field(description="The agent's reply (empty while Lead review is pending).")
    # Present (always null) only on a pending review: the hosted surface never reveals
    # work-item ids or revisions (SPEC 7, 8), so the schema admits nothing but null.
    revision: None = Field(default=None, description="Always null.")
    workItemId: None = Field(default=None, description="Always null.")


class ActionAgentOutput(BaseModel):
    """Structured result of a successful send_action_agent_message call."""

    model_config = ConfigDict(extra="forbid")

    success: bool
    result: ActionAgentResult


#: What makes two calls the same message: the organization, the caller (its key: a
#: session left out, or ``default``, is that key's default; None), the agent as named,
#: the session, the text.
TurnKey = tuple[str, str, str, str | None, str]


@dataclass(eq=False)
class _Turn:
    task: asyncio.Task[Outcome]
    #: The calls awaiting it (0: every one was cancelled, nobody awaits its end).
    calls: int = 0


class ToolTurns:
    """The turns of the tool calls in flight, each run in a task of its own.

    A call's handler is cancelled when its client cancels it: a handshake-era client's
    ``notifications/cancelled`` (what the official client sends when its call is
    cancelled or times out), or a 2026-07-28 client's closed response stream (which
    that protocol defines as the cancellation, so a dropped connection is one too). The
    turn ran inside the handler and was cancelled with it wherever it was, its message
    taken in: the model's work was thrown away, nothing answered the message, and a
    worker with a lead left its run leased to this live process, closed unanswered once
    the lease lapsed (15 minutes), the item ``inProgress`` for the week-long sweep. A
    turn the handler started now runs to its end as a REST request's does when its
    client goes away: its answer is stored in the transcript (gated work goes to its
    lead). The cancelled call is answered as the SDK answers any (handshake era:
    ``Request cancelled``). :meth:`close` cancels the turns still running when the
    server stops.

    A call of the same message (:data:`TurnKey`) while its turn runs here is that call
    sent again (its client timed out or lost the answer, and it or its user resent it:
    the official client never resends by itself), not a new message: it awaits the
    running turn and is answered its outcome. It was taken in a second time, its own
    turn run beside the first, and the message answered twice.
    """

    def __init__(self) -> None:
        self._turns: dict[TurnKey, _Turn] = {}

    async def run(self, key: TurnKey, start: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """The outcome of the turn of ``key``: the one running, or ``start()``'s. If the
        caller is cancelled, the turn goes on without it."""
        turn = self._turns.get(key)
        if turn is None:
            turn = _Turn(asyncio.ensure_future(start()))
            self._turns[key] = turn
            turn.task.add_done_callback(lambda _: self._ended(key, turn))
        else:
            logger.info("MCP tool call of a message whose turn runs: answered by that turn")
        turn.calls += 1
        try:
            return await asyncio.shield(turn.task)
        except asyncio.CancelledError:
            if not turn.task.done():
                logger.info("MCP tool call cancelled by its client; its turn runs to its end")
            raise
        finally:
            turn.calls -= 1

    def detached(self) -> int:
        """How many turns run on with no call awaiting them (each was cancelled)."""
        return sum(1 for turn in self._turns.values() if not turn.calls)

    def _ended(self, key: TurnKey, turn: _Turn) -> None:
        if self._turns.get(key) is turn:
            del self._turns[key]
        if turn.calls or turn.task.cancelled():
            return  # its calls get the outcome (or the error) themselves
        exc = turn.task.exception()  # (retrieved here: nobody else will)
        if isinstance(exc, LeadgateError):
            # A model error's message ends in the provider's own words, which may echo
            # the request (the message's text): logged as the turn path logs it.
            said = exc.summary if isinstance(exc, ModelError) else exc.message
            logger.warning("MCP turn of a cancelled tool call failed: %s [%s]", said, exc.rule)
        elif exc is not None:
            logger.error("MCP turn of a cancelled tool call failed", exc_info=loggable(exc))

    async def close(self) -> None:
        """Cancel the turns still running and wait for them to stop."""
        tasks = [turn.task for turn in self._turns.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class McpLifecycle:
    """The hosted MCP server's lifecycle, owned by the composition root.

    :meth:`run` runs the SDK's session manager (enter it before the first request) and
    the resource-update sender; :meth:`release_streams` ends the standalone GET streams,
    which never end by themselves (call it when the HTTP server starts shutting down, so
    that its graceful wait does not sit out its timeout on them).
    """

    def __init__(
        self,
        manager: StreamableHTTPSessionManager,
        closing: asyncio.Event,
        resources: Resources | None = None,
        turns: ToolTurns | None = None,
    ) -> None:
        self._manager = manager
        self._closing = closing
        self.resources = resources
        self.turns = turns if turns is not None else ToolTurns()

    def release_streams(self) -> None:
        """Let every open GET stream end."""
        self._closing.set()
        if self.resources is not None:
            self.resources.listen_handler.close()

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Run the session manager for the duration of the block."""
        async with contextlib.AsyncExitStack() as stack:
            # Last out: the manager's exit cancels the calls still in flight, which
            # leaves their turns running; those are stopped here, before the database.
            stack.push_async_callback(self.turns.close)
            await stack.enter_async_context(_session_manager(self._manager))
            if self.resources is not None:
                await stack.enter_async_context(self.resources.running())
            yield


def mount_mcp(
    app: web.Application,
    *,
    authenticate: Authenticate,
    send_message: SendMessage,
    allowed_hosts: list[str],
    transcripts: SessionReads | None = None,
    readable: Readable | None = None,
    watch: Watch | None = None,
    keep_notified: KeepNotified | None = None,
    version: str = "",
    session_idle_s: float = SESSION_IDLE_S,
    max_sessions: int = MAX_SESSIONS,
    reauth_s: float = REAUTH_S,
) -> McpLifecycle:
    """Serve the hosted MCP server on ``app`` at ``/mcp`` (GET, POST, DELETE).

    ``authenticate`` turns the raw bearer key into a :class:`Principal` (``None`` for an
    unknown key); ``send_message(principal, agent, message, session)`` runs one turn on the
    shared turn path. ``allowed_hosts`` are the ``host[:port]`` values accepted in the
    ``Host`` header (DNS-rebinding protection of the SDK); matching ``http``/``https``
    origins are accepted in an ``Origin`` header. With ``transcripts`` (and ``watch`` and
    ``keep_notified``, the hub's :meth:`~leadgate.operations.event_hub.EventHub.watch`
    and :meth:`~leadgate.operations.event_hub.EventHub.keep_notified`) the transcript
    resource template and its subscriptions are served
    (:mod:`leadgate.web.mcp_resources`).
    ``version`` is ``serverInfo.version``. An MCP session with no request in flight for
    ``session_idle_s`` ends (its id then answers 404; a request is in flight from its
    arrival, see :class:`InFlight`); at most ``max_sessions`` are open
    (a new one beyond that gets 503). A request still streaming checks its key every
    ``reauth_s`` and ends, as if its client had gone, once the key is no longer valid;
    with ``readable`` (:meth:`~leadgate.operations.transcripts.Transcripts.readable`),
    resource subscriptions to a deleted agent's sessions end at the same pace
    (:meth:`~leadgate.web.mcp_resources.Resources.recheck`).

    Returns the server's :class:`McpLifecycle`; the caller runs it (the SDK's session
    manager must run before the first request).
    """
    resources = (
        Resources(
            transcripts,
            _principal_of,
            parse_limit,
            keep_notified=keep_notified,
            readable=readable,
            recheck_s=reauth_s,
        )
        if transcripts is not None
        else None
    )
    turns = ToolTurns()
    server = build_mcp_server(send_message, resources=resources, version=version, turns=turns)
    if resources is not None and watch is not None:
        watch(resources.changed, resources.sessions)
    origins = [f"{scheme}://{host}" for host in allowed_hosts for scheme in ("http", "https")]
    # Creates server.session_manager; the returned Starlette app itself is not used.
    server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=False,
        json_response=False,
        session_idle_timeout=session_idle_s,
        max_sessions=max_sessions,
        transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=list(allowed_hosts),
            allowed_origins=origins,
        ),
    )
    manager = server.session_manager
    closing = asyncio.Event()
    in_flight = InFlight(manager, session_idle_s)

    async def handle(request: web.Request) -> web.StreamResponse:
        # From its arrival: the key check and the body come before the SDK has it.
        with in_flight.holding(request.headers.get("mcp-session-id")):
            return await authenticated(request)

    async def authenticated(request: web.Request) -> web.StreamResponse:
        try:
            principal = await _authenticate_request(request, authenticate)
        except Unavailable as exc:
            if request.method != "POST":
                raise  # no JSON-RPC request to answer: the REST 503
            return await _jsonrpc_unavailable(request, exc)
        if principal is None:
            return _unauthorized()
        if request.method == "GET":
            # The session's standing stream, bounded by the session limit instead.
            detach_stream(request)

        async def still_valid() -> bool:
            try:
                return await _authenticate_request(request, authenticate) is not None
            except LeadgateError:
                return True  # the database, not the key: check again next time

        return await _bridge(request, manager, principal, closing, Recheck(still_valid, reauth_s))

    app.router.add_route("GET", MCP_PATH, handle)
    app.router.add_route("POST", MCP_PATH, handle)
    app.router.add_route("DELETE", MCP_PATH, handle)
    return McpLifecycle(manager, closing, resources, turns)


class SendArguments(BaseModel):
    """The arguments of ``send_action_agent_message`` (its input schema)."""

    model_config = ConfigDict(title="send_action_agent_messageArguments")

    agent: str = Field(description="The worker agent to message: its id or slug.")
    message: str = Field(
        description=f"The message for the agent (1 to {MAX_MESSAGE_CHARS} characters)."
    )
    session: str | None = Field(
        default=None,
        description=(
            "Conversation to continue. Reuse the same value across calls; "
            "omit for your default session with this agent."
        ),
    )


def build_mcp_server(
    send_message: SendMessage,
    *,
    resources: Resources | None = None,
    version: str = "",
    turns: ToolTurns | None = None,
) -> Server[Any]:
    """The lowlevel ``Server``: the one tool, ``send_action_agent_message``, and (with
    ``resources``) the transcript template. Capabilities are derived from the handlers
    given, so nothing is advertised that is not served (no prompts at all: an unknown
    ``prompts/get`` is -32601, method not found). Each call's turn runs in ``turns``
    (:class:`ToolTurns`): a call its client cancels leaves it running to its end."""
    in_flight = turns if turns is not None else ToolTurns()
    tool = mt.Tool(
        name=TOOL_NAME,
        title="Send a message to an Action Agent",
        description=TOOL_DESCRIPTION,
        input_schema=SendArguments.model_json_schema(),
        output_schema=ActionAgentOutput.model_json_schema(),
        annotations=ToolAnnotations(
            read_only_hint=False,
            destructive_hint=False,
            idempotent_hint=False,
            open_world_hint=True,
        ),
    )

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: mt.PaginatedRequestParams | None
    ) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=[tool])

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: mt.CallToolRequestParams
    ) -> CallToolResult:
        if params.name != TOOL_NAME:
            # As the SDK's MCPServer answers it: a tool result, not a protocol error.
            return _tool_error(f"Unknown tool: {quoted(params.name)}", "tool.unknown")
        principal = _principal_of(ctx)
        try:
            if principal is None:
                # The bridge always puts one there; a missing one is a wiring bug.
                raise RuntimeError("no principal in the MCP request scope")
            principal.require(Scope.trigger)
            try:
                args = SendArguments.model_validate(params.arguments or {})
            except PydanticValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                    for err in exc.errors()
                )
                return _tool_error(f"invalid arguments: {problems}", "tool.arguments")
            agent, message, session = _validate_arguments(args.agent, args.message, args.session)
            # (no session and "default" are the same session: the key's default)
            same = None if session == DEFAULT_SESSION else session
            outcome = await in_flight.run(
                (principal.org_id, principal.actor, agent, same, message),
                lambda: send_message(principal, agent, message, session),
            )
            return outcome_to_result(outcome)
        except IntakeInDoubt as exc:
            # REST's text offers a retry with the same Idempotency-Key, which MCP lacks.
            return _tool_error(exc.told_to("mcp").message, exc.rule)
        except DatabaseDamaged as exc:
            note_damaged(ctx, exc)  # (a tool error reached no log)
            return _tool_error(exc.message, exc.rule)  # (the file stays out of it)
        except LeadgateError as exc:
            return _tool_error(exc.message, exc.rule, retry_after_s=exc.retry_after_s)
        except Exception as exc:
            logger.error("send_action_agent_message failed", exc_info=loggable(exc))
            return _tool_error(GENERIC_ERROR_TEXT, "internal")

    handlers: dict[str, Any] = {}
    if resources is not None:
        handlers = {
            "on_list_resources": resources.list_resources,
            "on_list_resource_templates": resources.list_templates,
            "on_read_resource": resources.read,
            "on_subscribe_resource": resources.subscribe,
            "on_unsubscribe_resource": resources.unsubscribe,
            "on_subscriptions_listen": resources.listen,
        }
    return Server(
        "leadgate",
        version=version,
        instructions=INSTRUCTIONS if resources is None else INSTRUCTIONS + RESOURCE_INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        **handlers,
    )


def outcome_to_result(outcome: Outcome) -> CallToolResult:
    """Map a turn outcome onto the exact public tool result of SPEC 8."""
    if isinstance(outcome, Reply):
        return _tool_success({"leadReviewPending": False, "text": outcome.text})
    if isinstance(outcome, Gated):
        # Never the real ids: public surfaces do not reveal work items (SPEC 7, 8).
        return _tool_success(
            {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None}
        )
    if isinstance(outcome, Busy | Duplicate):
        return _tool_error(BUSY_TEXT, BUSY_RULE)
    raise TypeError(f"unknown outcome {outcome!r}")


def _tool_success(result: dict[str, Any]) -> CallToolResult:
    structured = {"success": True, "result": result}
    # Clients that ignore structured content read the same JSON as text (MCP spec advice).
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(structured))],
        structured_content=structured,
    )


def _tool_error(text: str, rule: str, *, retry_after_s: int | None = None) -> CallToolResult:
    """A tool error: the public text, and its rule in ``_meta`` (``{"rule": ...}``), where
    a client can branch on it as on every other surface's ``rule`` (tool errors named
    none). Not in ``structuredContent``, which the tool's output schema describes and
    some clients validate even on errors. An error that a retry may cure after a wait
    (a database fault before the message was taken in) says how long in
    ``retryAfterS``, as a resource read's JSON-RPC error and REST's ``Retry-After`` do;
    it said "please retry shortly" only."""
    meta: dict[str, Any] = {"rule": rule}
    if retry_after_s is not None:
        meta["retryAfterS"] = retry_after_s
    # Returned, not raised: a raised ToolError gets an "Error executing tool ..." prefix,
    # which would break the exact public text.
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True, _meta=meta)


def _validate_arguments(
    agent: str, message: str, session: str | None
) -> tuple[str, str, str | None]:
    agent = agent.strip()
    if not agent:
        raise ValidationError("agent must name a worker agent", rule="mcp.agent.empty")
    validate_message(message)
    # LLM clients often send "" for an optional argument: that means "no session".
    if session is not None and not session.strip():
        session = None
    return agent, message, session


def _principal_of(ctx: ServerRequestContext[Any, Any]) -> Principal | None:
    # The HTTP request that carried this very call (not the one that opened the MCP
    # session), so a key's scopes are always those of the current request.
    scope = getattr(ctx.request, "scope", None)
    if not isinstance(scope, dict):
        return None
    principal = scope.get(PRINCIPAL_SCOPE_KEY)
    return principal if isinstance(principal, Principal) else None


# --- authentication -----------------------------------------------------------------


async def _authenticate_request(
    request: web.Request, authenticate: Authenticate
) -> Principal | None:
    key = bearer_token(request)
    if key is None:
        return None
    try:
        return await authenticate(key)
    except LeadgateError as exc:
        # An authenticate that raises AuthError means "unknown key", same as None.
        if exc.status == 401:
            return None
        raise


def _unauthorized() -> web.Response:
    return web.json_response(
        error_body(401, "Missing or unknown API key.", "unauthorized", "auth.key"),
        status=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _sdk_user(principal: Principal) -> AuthenticatedUser:
    """The SDK's user object; the session manager binds each MCP session to it.

    The SDK compares (client_id, issuer, subject) of the user that created a session with
    the one of each later request and answers 404 on a mismatch, so a session id of one
    organization, or of another key, is useless to anybody else.
    """
    token = AccessToken(
        # Not the raw key: nothing secret needs to live in the SDK's objects.
        token=principal.actor,
        client_id=principal.org_id,
        subject=principal.actor,
        scopes=sorted(scope.value for scope in principal.scopes),
    )
    return AuthenticatedUser(token)


# --- session manager lifecycle ------------------------------------------------------


@contextlib.asynccontextmanager
async def _session_manager(manager: StreamableHTTPSessionManager) -> AsyncIterator[None]:
    # run() opens an anyio task group, which must be exited by the task that entered it.
    # aiohttp may run startup and cleanup in different tasks, so a dedicated task owns
    # the manager for the life of the app.
    started = asyncio.Event()
    stop = asyncio.Event()

    async def own() -> None:
        async with manager.run():
            started.set()
            await stop.wait()

    task = asyncio.create_task(own(), name="leadgate-mcp-session-manager")
    started_wait = asyncio.create_task(started.wait())
    await asyncio.wait({task, started_wait}, return_when=asyncio.FIRST_COMPLETED)
    started_wait.cancel()
    if task.done():
        task.result()  # re-raise why the manager could not start
    try:
        yield
    finally:
        stop.set()
        await task


# --- session idle timeout ----------------------------------------------------------


class InFlight:
    """The requests of each open MCP session, from the moment each arrives, holding the
    session's idle timeout.

    The timeout is the SDK's: each session's transport has an ``idle_scope`` whose
    deadline it suspends while a request is in the transport and restarts when the last
    one leaves. A request reaches the transport only after its key check (a database
    read when the key is not cached), its body and the JSON checks: a session whose one
    request waited on those longer than ``session_idle_s`` (a busy database, a slow
    upload, a short timeout) was ended as idle under it, and the request answered 404
    ``mcp.session``. Every request of a session passes through :meth:`holding` for its
    whole life, the SDK's part included, so while any is held here the deadline is
    suspended, and the countdown restarts when the last one ends.
    """

    def __init__(self, manager: StreamableHTTPSessionManager, idle_s: float) -> None:
        self._manager = manager
        self._idle_s = idle_s
        #: Requests held per session id (an entry only while one is held).
        self._held: dict[str, int] = {}

    @contextlib.contextmanager
    def holding(self, session_id: str | None) -> Iterator[None]:
        """Hold the idle timeout of ``session_id``'s session (if it is open) for the
        block. A request without one, or naming no open session, holds nothing."""
        scope = None if session_id is None else self._idle_scope(session_id)
        if session_id is None or scope is None:
            yield
            return
        self._held[session_id] = self._held.get(session_id, 0) + 1
        scope.deadline = math.inf
        try:
            yield
        finally:
            left = self._held.pop(session_id) - 1
            if left:
                self._held[session_id] = left
                # The SDK restarted the countdown when its own last request of the
                # session ended; one still being authenticated here holds it on.
                scope.deadline = math.inf
            elif not scope.cancel_called:
                # anyio's clock on asyncio is the loop's.
                scope.deadline = asyncio.get_running_loop().time() + self._idle_s

    def _idle_scope(self, session_id: str) -> anyio.CancelScope | None:
        # The SDK has no public lookup of a session's transport: its manager keeps them
        # by session id (mcp 2.3; tests/integration/test_mcp_bridge.py fails if that
        # changes, as a session would then be ended under a request again).
        # Looked up defensively: an SDK without it must cost the hold, not every request.
        transports = getattr(self._manager, "_server_instances", None)
        transport = None if transports is None else transports.get(session_id)
        scope = getattr(transport, "idle_scope", None)
        return scope if isinstance(scope, anyio.CancelScope) else None


# --- the ASGI bridge ----------------------------------------------------------------


@dataclass(frozen=True)
class Recheck:
    """How a streaming request checks its key again, and how often."""

    still_valid: Callable[[], Awaitable[bool]]
    every_s: float


async def _bridge(
    request: web.Request,
    manager: StreamableHTTPSessionManager,
    principal: Principal,
    closing: asyncio.Event,
    recheck: Recheck,
) -> web.StreamResponse:
    """Run one HTTP request through the SDK's ASGI handler and stream its answer back.

    ``receive`` and ``send`` are the two ASGI callables, closures over one request's
    state; they stay together here because their disconnect handling is one protocol.
    """
    scope = _asgi_scope(request, principal)
    # The whole body first, through the one decoding path: the size limit (413), the
    # body timeout and (POST) the JSON checks apply before the SDK sees anything.
    try:
        body = await read_body(request)
    except PayloadTooLarge as exc:
        if request.method != "POST":
            raise
        return _jsonrpc_too_large(request, exc)
    if body:
        try:
            decode_json(body)
        except ValidationError as exc:
            return _jsonrpc_refusal(body, exc)
    gone = asyncio.Event()  # the client went away, or the exchange is over
    # A request without a session id opens one; refused, the SDK discards it again.
    opening = "mcp-session-id" not in request.headers
    response: web.StreamResponse | None = None
    send_lock = asyncio.Lock()
    # What receive() reads of this exchange, dropped once it is over: the SDK keeps the
    # ASGI request (the scope and receive()) of a session's last message for as long as
    # the session lives, and through receive() it held the aiohttp request (transport,
    # buffers), the key's re-check and the whole body, in every idle session.
    exchange = _Exchange(request, body, recheck)
    stream_closing = closing if request.method == "GET" else None

    async def receive() -> Message:
        live = exchange
        if live.request is None or live.recheck is None:
            return {"type": "http.disconnect"}  # (the exchange is over)
        if live.body is not None:
            chunk, live.body = live.body, None
            return {"type": "http.request", "body": chunk, "more_body": False}
        # After the body, ASGI receive() must block until the client disconnects; the
        # SDK's SSE responses listen here to stop streaming. Returning at once (what
        # aiohttp-asgi does) makes them spin.
        await _wait_disconnect(live.request, gone, stream_closing, live.recheck)
        return {"type": "http.disconnect"}

    plain_error: tuple[int, bytearray] | None = None
    sdk_error: tuple[Message, bytearray] | None = None

    async def send(message: Message) -> None:
        nonlocal response, plain_error, sdk_error
        async with send_lock:
            if gone.is_set():
                return
            try:
                if message["type"] == "http.response.start" and _plain_error(message):
                    plain_error = (message["status"], bytearray())
                elif message["type"] == "http.response.start" and message["status"] >= 400:
                    # One of the SDK's JSON-RPC refusals: kept whole to name its rule.
                    sdk_error = (message, bytearray())
                elif message["type"] == "http.response.body" and plain_error is not None:
                    plain_error[1].extend(message.get("body", b""))
                    if not message.get("more_body", False):
                        response = _enveloped(*plain_error)
                elif message["type"] == "http.response.body" and sdk_error is not None:
                    sdk_error[1].extend(message.get("body", b""))
                    if not message.get("more_body", False):
                        response = _ruled(*sdk_error, opening=opening)
                elif message["type"] == "http.response.start":
                    response = web.StreamResponse(status=message["status"])
                    for raw_name, raw_value in message.get("headers", []):
                        name = raw_name.decode("latin-1")
                        # aiohttp frames the body itself (chunked); a copied length
                        # would conflict with that.
                        if name.lower() == "content-length":
                            continue
                        response.headers.add(name, raw_value.decode("latin-1"))
                    await response.prepare(request)
                elif message["type"] == "http.response.body" and response is not None:
                    body = message.get("body", b"")
                    if body:
                        await response.write(body)
                    if not message.get("more_body", False):
                        await response.write_eof()
            except ConnectionResetError:
                # The client left mid-answer: tell the SDK through receive(), not by
                # raising into its response task.
                gone.set()

    try:
        await manager.handle_request(scope, receive, send)
    finally:
        gone.set()
        exchange.request = exchange.body = exchange.recheck = None
    if response is None:
        # The SDK answered nothing (it crashed before responding).
        return web.json_response(
            error_body(500, GENERIC_ERROR_TEXT, "internal_error", "internal"), status=500
        )
    return response


class _Exchange:
    """:func:`_bridge`'s request, its body until the SDK has read it, and its key's
    re-check: all None once the exchange is over."""

    __slots__ = ("body", "recheck", "request")

    def __init__(self, request: web.Request, body: bytes, recheck: Recheck) -> None:
        self.request: web.Request | None = request
        self.body: bytes | None = body
        self.recheck: Recheck | None = recheck


#: The SDK's own plain-text refusals (its transport security checks), by their text:
#: the rule our envelope names.
_SDK_REFUSALS: Final = {
    "Invalid Host header": "mcp.host",
    "Invalid Origin header": "mcp.origin",
    "Invalid Content-Type header": "mcp.content_type",
    "Request body too large": "body.too_large",
}


def _plain_error(start: Message) -> bool:
    """Whether the SDK is answering an error that is not JSON (JSON-RPC errors are)."""
    if start["status"] < 400:
        return False
    for raw_name, raw_value in start.get("headers", []):
        if raw_name.lower() == b"content-type":
            return not raw_value.lower().startswith(b"application/json")
    return True


#: Our JSON checks that mean the body is no JSON at all (JSON-RPC's parse error); the
#: others (NUL, lone surrogate, depth, huge number) refuse what a request carries.
_NOT_JSON = frozenset({"body.json", "body.utf8"})


def _message(body: bytes) -> dict[str, object] | None:
    """The JSON object in ``body`` (None: none can be read)."""
    try:
        # The stdlib parser takes NUL and lone surrogates; only the id and method are read.
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _request_id(body: bytes) -> str | int | None:
    """The JSON-RPC id of the request in ``body`` (None: none can be read)."""
    return _id_of(_message(body) or {})


def _id_of(message: dict[str, object]) -> str | int | None:
    found = message.get("id")
    return found if isinstance(found, str | int) and not isinstance(found, bool) else None


#: JSON-RPC methods that only read: a database fault is told them as
#: :data:`leadgate.core.errors.CANNOT_READ`, not "nothing was stored" (a subscription
#: may create the session it names; a tool call runs a turn).
_ONLY_READ: Final = frozenset(
    {
        "ping",
        "tools/list",
        "resources/list",
        "resources/templates/list",
        "resources/read",
    }
)


def _jsonrpc_refusal(body: bytes, exc: ValidationError) -> web.Response:
    """A POST body that fails the service's JSON checks, answered as JSON-RPC (HTTP 400,
    as the SDK answers its own parse errors) so the MCP client matches it to its request
    and shows the rule; it was the REST envelope, which the client could only report as
    "Server returned an error response"."""
    request_id = None if exc.rule in _NOT_JSON else _request_id(body)
    code = -32700 if exc.rule in _NOT_JSON else -32602
    error = {"code": code, "message": f"{exc.message} [{exc.rule}]", "data": {"rule": exc.rule}}
    return web.json_response({"jsonrpc": "2.0", "id": request_id, "error": error}, status=400)


async def _jsonrpc_unavailable(request: web.Request, exc: Unavailable) -> web.Response:
    """A POST whose key could not be checked (a database fault; the key is checked
    again at least every ``PRINCIPAL_TTL_S``): the 503 every route answers (counted,
    logged, ``Retry-After``), its body the JSON-RPC error a resource read that meets the
    fault gets (-32603, ``rule`` and ``retryAfterS`` in ``data``) with the request's id,
    so the MCP client shows the rule and that retrying helps. It was the REST envelope,
    which the client could only report as "Server returned an error response"."""
    response = unavailable_response(request, exc)
    try:
        message = _message(await read_body(request)) or {}
    except LeadgateError:
        message = {}  # (a body too large, or too slow: its id is unknown)
    request_id = _id_of(message)
    if message.get("method") in _ONLY_READ:
        exc = when_reading(exc)
    data: dict[str, Any] = {"rule": exc.rule}
    if exc.retry_after_s is not None:
        data["retryAfterS"] = exc.retry_after_s
    error = {"code": mt.INTERNAL_ERROR, "message": f"{exc.message} [{exc.rule}]", "data": data}
    response.text = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error})
    return response


def _jsonrpc_too_large(request: web.Request, exc: PayloadTooLarge) -> web.Response:
    """A POST body over the size limit (a message too long for a tool call), answered as
    JSON-RPC with ``id: null`` (the body is never read, so its id is unknown; the official
    client answers its request with it) and HTTP 413. It was the REST envelope, which the
    client could only report as -32603 "Server returned an error response", no rule."""
    error = {"code": -32602, "message": f"{exc.message} [{exc.rule}]", "data": {"rule": exc.rule}}
    response = web.json_response({"jsonrpc": "2.0", "id": None, "error": error}, status=413)
    if not request.content.is_eof():
        # The unread rest of the body ends the connection (aiohttp closes it): say so, as
        # every other refusal of an unread body does.
        response.force_close()
    return response


#: The text of a body that is JSON but no JSON-RPC message.
NOT_JSONRPC_TEXT: Final = (
    'the body is not a JSON-RPC 2.0 message: an object with "jsonrpc": "2.0" and a '
    '"method" (a request or notification), or an "id" with a "result" or "error"'
)

#: The rules of the SDK's JSON-RPC refusals (HTTP 4xx, and its 503), by HTTP status.
_SDK_JSONRPC_RULES: Final = {
    404: "mcp.session",  # an unknown, ended or another caller's session id
    405: "http",
    406: "mcp.accept",  # the Accept header leaves out what the answer must be
    409: "mcp.stream",  # a second GET stream on one session
    415: "mcp.content_type",
    503: "mcp.sessions",  # every session the process may hold is open
}


def _sdk_jsonrpc_rule(status: int, text: str, code: object = None) -> str:
    if code == mt.METHOD_NOT_FOUND:
        # The 2026-07-28 transport answers it with 404, which is otherwise a session the
        # server does not know: it named ``mcp.session`` for a method the server lacks.
        return "mcp.method"
    if status == 400 and text.startswith("Validation error"):
        return "mcp.message"  # valid JSON, but no JSON-RPC message
    if status == 400 and "session ID" in text:
        return "mcp.session_id"  # a request other than initialize without Mcp-Session-Id
    return _SDK_JSONRPC_RULES.get(status, "mcp.request" if status < 500 else "internal")


def _ruled(start: Message, body: bytes | bytearray, *, opening: bool) -> web.Response:
    """One of the SDK's JSON-RPC refusals (``Session not found``, ``Missing session ID``,
    ``Not Acceptable``, ...) as it answered it, its error naming the rule in ``data``
    as the service's own JSON-RPC refusals do (``{"rule": ...}``); it named none. A 503
    says when to try again, as every 503 of the service does. A refusal of the service's
    own that the SDK answered with an HTTP error status keeps its ``data``
    (:func:`_names_rule`).

    The refusal of an ``opening`` request (no session id) carried the id of the session
    the SDK had made for it and discarded: a client that kept it got 404 on its next
    request. It is left out."""
    status = start["status"]
    # (Its headers are its content type and session id, each once.)
    headers = {
        name: value
        for name, value in (
            (raw_name.decode("latin-1"), raw_value.decode("latin-1"))
            for raw_name, raw_value in start.get("headers", [])
        )
        if name.lower() != "content-length" and not (opening and name.lower() == "mcp-session-id")
    }
    if status == 503 and "retry-after" not in {name.lower() for name in headers}:
        headers.update(retry_headers(SESSION_FULL_RETRY_MS))
    try:
        message = json.loads(body)
    except ValueError:
        message = None
    error = message.get("error") if isinstance(message, dict) else None
    if isinstance(error, dict) and not _names_rule(error.get("data")):
        rule = _sdk_jsonrpc_rule(status, str(error.get("message", "")), error.get("code"))
        if rule == "mcp.message":
            # The SDK's text is pydantic's dump: its version, the SDK's class names and
            # the values sent, echoed back (a secret in a misplaced field included).
            error["message"] = f"{NOT_JSONRPC_TEXT} [{rule}]"
        error["data"] = {"rule": rule}
        body = json.dumps(message).encode()
    return web.Response(status=status, body=bytes(body), headers=headers)


def _names_rule(data: object) -> bool:
    """Whether an error's ``data`` is one of the service's own refusals, raised by a
    handler (``{"uri", "rule"}``): the 2026-07-28 transport answers those with HTTP 400
    too, and the rule of the SDK's refusals replaced theirs (``subscriptions/listen`` or
    ``resources/read`` of another organization's agent named ``mcp.request``, no ``uri``,
    where the handshake era names ``agent.not_found``). The SDK's own errors carry no
    rule (its parameter validation sends ``data: ""``)."""
    return isinstance(data, dict) and isinstance(data.get("rule"), str)


def _enveloped(status: int, body: bytes | bytearray) -> web.Response:
    """One of the SDK's plain-text refusals in the envelope of every other HTTP error."""
    text = body.decode("utf-8", "replace").strip()[:200] or "the request was refused"
    rule = _SDK_REFUSALS.get(text, "mcp.request")
    body_ = error_body(status, text, None, rule, type_="invalid_request_error")
    return web.json_response(body_, status=status)


async def _wait_disconnect(
    request: web.Request, gone: asyncio.Event, closing: asyncio.Event | None, recheck: Recheck
) -> None:
    events = [gone] if closing is None else [gone, closing]
    waiters = [asyncio.create_task(event.wait()) for event in events]
    next_check = time.monotonic() + recheck.every_s
    try:
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                gone.set()
                return
            done, _ = await asyncio.wait(
                waiters, timeout=_DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                return
            if time.monotonic() >= next_check:
                if not await recheck.still_valid():
                    # Told to the SDK as the client's leaving: the stream ends cleanly,
                    # and the client's next request (a re-listen) is a 401.
                    logger.info("MCP stream ended: its key is no longer valid")
                    gone.set()
                    return
                next_check = time.monotonic() + recheck.every_s
    finally:
        for waiter in waiters:
            waiter.cancel()


def _asgi_scope(request: web.Request, principal: Principal) -> AsgiScope:
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    sock = transport.get_extra_info("sockname") if transport is not None else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        # ASGI wants the target's bytes as sent, still percent-encoded. aiohttp's decoded
        # query (``query_string``) may hold any character, and latin-1 raised on them: a
        # 500 for ``/mcp?x=%E2%80%AE``. The raw target holds what came off the wire.
        "raw_path": _wire_bytes(request.raw_path.split("?", 1)[0]),
        "query_string": _wire_bytes(request.rel_url.raw_query_string),
        "root_path": "",
        # ASGI wants lower-case names; Starlette looks them up that way.
        "headers": [(name.lower(), value) for name, value in request.raw_headers],
        "client": _host_port(peer),
        "server": _host_port(sock),
        "state": {},
        "user": _sdk_user(principal),
        "auth": AuthCredentials(sorted(scope.value for scope in principal.scopes)),
        PRINCIPAL_SCOPE_KEY: principal,
        REQUEST_SCOPE_KEY: CallSource.of(request),
    }


def _wire_bytes(text: str) -> bytes:
    # aiohttp decoded the request line as UTF-8 with surrogate escapes for the bytes that
    # were not; this gives the bytes back.
    return text.encode("utf-8", "surrogateescape")


def _host_port(address: Any) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None
