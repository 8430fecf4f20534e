"""OpenAI-compatible REST (SPEC 7): ``POST /v1/chat/completions``, ``GET /v1/models``.

Bodies follow OpenAI's published schemas to the letter (``tests/contract`` validates them
against a trimmed copy of the OpenAPI document): ``chat.completion`` with
``logprobs: null``, ``message.refusal: null`` and ``usage``; chunks with
``finish_reason: null`` until the end and, with ``stream_options.include_usage``,
``usage: null`` on every chunk and one last usage chunk with ``choices: []``; every error
envelope with ``param``. The 409 of a gated or busy turn keeps exactly the seed's type,
code and message (and ``workItemId``/``revision`` rules); a mid-stream failure is one
``data: {"error": ...}`` frame whose ``error`` is the non-streaming envelope's.

Retries never double a message:

* every error answered after the message was taken in carries ``x-should-retry: false``,
  which the official clients obey (they retry 5xx, 409 and connection errors otherwise);
* ``Idempotency-Key`` (:mod:`leadgate.operations.idempotency`): the same key within 24 h
  gets the first answer again (or the same 409) and runs no second turn;
* without one, the official clients' own retry (``x-stainless-retry-count`` 1 or more) of
  a request whose turn still runs in this process gets that turn's answer
  (:class:`_Attempts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.decoding import header_text, single_header
from leadgate.core.errors import (
    DatabaseDamaged,
    LeadgateError,
    NotFound,
    Unavailable,
    ValidationError,
)
from leadgate.core.logs import loggable
from leadgate.core.types import (
    BUSY_RULE,
    GATED_RULE,
    Busy,
    Duplicate,
    Gated,
    Outcome,
    Reply,
    Usage,
)
from leadgate.database.db import Conn
from leadgate.database.faults import unavailable
from leadgate.domain import agents
from leadgate.domain.rows import Agent
from leadgate.operations.idempotency import RECOVERED, RETRY_AFTER_MAX_S, Claim, fingerprint
from leadgate.operations.sessions import api_session_key
from leadgate.turns.path import TurnAnswer
from leadgate.web.common import (
    NO_RETRY,
    PrincipalLookup,
    authenticate,
    damaged_answers,
    error_answer,
    error_body,
    error_response,
    json_body,
    request_id,
)

log = logging.getLogger("leadgate.web")

PENDING_MESSAGE = "This turn is pending Lead review. Retry after the review completes."
#: What the official ``openai`` clients (Python and Node) send on every attempt of a
#: request: 0, then 1, 2 for their own retries of it (after a lost connection, a
#: timeout, a 5xx), each the same request again.
ATTEMPT_HEADER = "x-stainless-retry-count"
# The answer to a request whose Idempotency-Key was taken over after the process that
# ran its turn died: the message was taken in once, the answer was lost with the process.
LOST_MESSAGE = (
    "The first request with this Idempotency-Key was interrupted after its message was "
    "taken in; its answer is lost. Read the session transcript."
)


def pending_body(*, gated: bool) -> dict[str, Any]:
    """The 409 body: a gated turn carries null workItemId/revision; busy omits them.

    The SPEC's form, plus ``rule`` as every other error envelope names it:
    :data:`GATED_RULE` or :data:`BUSY_RULE`, the names MCP and Studio give the same cases
    (it named none, and the two cases differed only by the keys present)."""
    error: dict[str, Any] = {
        "message": PENDING_MESSAGE,
        "type": "lead_review_pending",
        "param": None,
        "code": "LEAD_REVIEW_PENDING",
        "rule": GATED_RULE if gated else BUSY_RULE,
    }
    if gated:
        error["workItemId"] = None
        error["revision"] = None
    return {"error": error}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[Any] = [
            part.get("text")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        ]
        if any(not isinstance(text, str) for text in texts):
            # As OpenAI answers: a text part carries its text as a string.
            raise ValidationError("a text part's text must be a string", rule="messages.content")
        if texts:
            return "\n".join(texts)
    raise ValidationError("message content must be a string or text parts", rule="messages.content")


class ChatBackend(Protocol):
    """What the route needs: one api-binding turn (``operations.messages.Messages``)."""

    async def send(
        self,
        principal: Principal,
        agent_ref: str,
        text: str,
        *,
        session: str | None,
        user: str | None = None,
        on_delta: Callable[[str], Awaitable[None]] | None = None,
        on_start: Callable[[], Awaitable[None]] | None = None,
        external_event_id: str | None = None,
        answer: TurnAnswer | None = None,
        retake: bool = False,
    ) -> Outcome: ...

    def refuse_unknown(self, principal: Principal, agent_ref: str) -> None: ...


class ModelBackend(Protocol):
    """The organization's agents (``operations.agents.Agents``)."""

    async def list(self, principal: Principal) -> list[Agent]: ...

    async def get(self, principal: Principal, ref: str) -> Agent: ...


class IdempotencyBackend(Protocol):
    """``operations.idempotency.Idempotency``."""

    async def begin(self, principal: Principal, key: str, request_fingerprint: str) -> Claim: ...

    async def finish(
        self,
        principal: Principal,
        claim: Claim,
        response: dict[str, Any],
        *,
        provisional: bool = False,
        request_id: str | None = None,
    ) -> None: ...

    async def store(
        self, conn: Conn, principal: Principal, claim: Claim, response: dict[str, Any]
    ) -> None: ...

    async def release(self, principal: Principal, claim: Claim) -> None: ...

    async def lapse(self, principal: Principal, claim: Claim) -> None: ...

    async def answer_of(self, principal: Principal, claim: Claim) -> dict[str, Any] | None: ...

    async def used(self, principal: Principal, key: str) -> bool: ...

    def held(self, principal: Principal, claim: Claim) -> AbstractAsyncContextManager[None]: ...


@dataclass(frozen=True)
class ChatRequest:
    """The parts of an OpenAI chat completion request leadgate uses."""

    model: str
    text: str
    user: str | None
    stream: bool
    include_usage: bool = False


def _number(body: dict[str, Any], name: str, low: float, high: float, *, whole: bool) -> None:
    value = body.get(name)
    if value is None:
        return
    kind = int if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what, span = (
            ("an integer", f"{low:,} to {high:,}")
            if whole
            else ("a number", f"{low:g} to {high:g}")
        )
        raise ValidationError(f"`{name}` must be {what} from {span}", rule=f"{name}.range")


#: The numeric parameters :func:`_check_options` checks: (lowest, highest, integer only).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "max_tokens": (1, 2**31 - 1, True),
    "max_completion_tokens": (1, 2**31 - 1, True),
    "seed": (-(2**63), 2**63 - 1, True),
    "top_logprobs": (0, 20, True),
    "temperature": (0, 2, False),
    "top_p": (0, 1, False),
    "presence_penalty": (-2, 2, False),
    "frequency_penalty": (-2, 2, False),
}
#: The request parameters :func:`_check_options` reads (besides ``user``); an error about
#: one names it as the envelope's ``param``, as OpenAI's do.
CHECKED_OPTIONS = frozenset(
    {
        *_RANGES,
        "stop",
        "metadata",
        "logprobs",
        "parallel_tool_calls",
        "store",
        "tools",
        "functions",
        "tool_choice",
        "function_call",
        "response_format",
        "modalities",
        "audio",
    }
)


#: Every request parameter an error's ``param`` may name.
REQUEST_PARAMS = CHECKED_OPTIONS | {"model", "messages", "n", "stream", "stream_options", "user"}


def _param_of(rule: str, session_header: str | None) -> str | None:
    """The request parameter a 400's ``rule`` is about, as OpenAI names it, else ``None``:
    the turn path's checks of the message text (``message.*``) are about ``messages``,
    of the agent (``agent.*``) about ``model``, and of the session name (``session.*``)
    about ``user`` when no ``X-Session-Id`` header named the session (a header is no
    request parameter)."""
    field = rule.split(".", 1)[0]
    if field in REQUEST_PARAMS:
        return field
    if field == "message":
        return "messages"
    if field == "agent":
        return "model"  # the agent it names (``agent.inactive``)
    if field == "session" and session_header is None:
        return "user"
    return None


def _check_options(body: dict[str, Any]) -> None:
    """The optional OpenAI parameters leadgate knows: the wrong type or range is a 400
    naming the parameter (they were dropped unread, and ``"user": 5`` quietly chose the
    default session). What the agent cannot do for a client is refused, not pretended:
    client-side tools, a guaranteed JSON answer, log probabilities, audio. Sampling
    parameters (``temperature``, ``max_tokens``, ...) are checked and then belong to the
    agent: its model configuration decides them (README)."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValidationError("`user` must be a string", rule="user.type")
    if CHECKED_OPTIONS.isdisjoint(body):
        return  # the common request: none of them (about 4 us less per request)
    for name, (low, high, whole) in _RANGES.items():
        _number(body, name, low, high, whole=whole)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str)
        or (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop))
    ):
        raise ValidationError("`stop` must be a string or up to 4 strings", rule="stop.type")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValidationError(
            "`metadata` must be an object of at most 16 string values", rule="metadata.type"
        )
    for name in ("logprobs", "parallel_tool_calls", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ValidationError(f"`{name}` must be a boolean", rule=f"{name}.type")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ValidationError(
            "leadgate does not return log probabilities", rule="logprobs.unsupported"
        )
    for name in ("tools", "functions"):
        tools = body.get(name)
        if tools is not None and not isinstance(tools, list):
            raise ValidationError(f"`{name}` must be an array", rule="tools.type")
        if tools:
            raise ValidationError(
                "the agent runs its own tools; client-side function calling is not offered",
                rule="tools.unsupported",
            )
    for name in ("tool_choice", "function_call"):
        choice = body.get(name)
        if choice is not None and choice not in ("none", "auto"):
            raise ValidationError(
                f"`{name}` may only be none or auto: the agent runs its own tools",
                rule=f"{name}.unsupported",
            )
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValidationError(
                "`response_format.type` must be text, json_object or json_schema",
                rule="response_format.type",
            )
        if kind != "text":
            raise ValidationError(
                "leadgate cannot guarantee a JSON answer: the agent's text is returned as it "
                "is (ask for JSON in the message instead)",
                rule="response_format.unsupported",
            )
    modalities = body.get("modalities")
    if body.get("audio") is not None or (modalities is not None and modalities != ["text"]):
        raise ValidationError("leadgate answers with text only", rule="modalities.unsupported")


def parse_request(body: dict[str, Any]) -> ChatRequest:
    """The :class:`ChatRequest` of an OpenAI request body (400 naming the rule)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValidationError("`model` must name an agent (id or slug)", rule="model.required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValidationError("`messages` must be a non-empty array", rule="messages.required")
    last_user = None
    for message in reversed(messages):
        if not isinstance(message, dict):
            raise ValidationError("each message must be an object", rule="messages.item")
        if message.get("role") == "user":
            last_user = message
            break
    if last_user is None:
        raise ValidationError("`messages` has no user message", rule="messages.user")
    text = _text_of(last_user.get("content"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValidationError("`stream` must be a boolean", rule="stream.type")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        # One turn, one answer: several choices would be several turns of one message.
        raise ValidationError("leadgate answers with one choice: `n` must be 1", rule="n.one")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ValidationError("`stream_options` must be an object", rule="stream_options")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise ValidationError(
                "`stream_options.include_usage` must be a boolean", rule="stream_options"
            )
        if not stream:
            # As OpenAI answers it: the options describe a stream.
            raise ValidationError(
                "`stream_options` is only allowed when `stream` is true", rule="stream_options"
            )
        include_usage = flag
    _check_options(body)  # (``user``, when given, is a string from here on)
    return ChatRequest(model, text, body.get("user") or None, stream, include_usage)


def _usage(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage()
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _completion(cid: str, model: str, created: int, reply: Reply) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.text, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(reply.usage),
    }


def _model(agent: Agent, owner: str) -> dict[str, Any]:
    return {
        "id": agent.slug,
        "object": "model",
        "created": agent.created_at // 1000,
        "owned_by": owner,
    }


class _Chunks:
    """The ``data:`` frames of one streamed answer (kept when they must be replayable)."""

    def __init__(
        self,
        response: web.StreamResponse,
        cid: str,
        created: int,
        model: str,
        include_usage: bool,
        keep: bool,
    ) -> None:
        self.response = response
        self.base: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self.include_usage = include_usage
        self.frames: list[str] | None = [] if keep else None
        #: The client went away mid-stream. The turn goes on to its end all the same (its
        #: message was taken in): the answer is stored in the transcript, and an
        #: Idempotency-Key's retry gets the whole stream. It used to end the turn as a
        #: "model failure", its answer lost and its key locked as still running.
        self.gone = False

    async def start(self, request: web.Request) -> None:
        """Send the headers and the role chunk (nothing, if the client is gone)."""
        try:
            await self.response.prepare(request)
        except ConnectionError:
            self.gone = True
        await self.chunk({"role": "assistant", "content": ""}, None)

    async def frame(self, payload: str) -> None:
        await self.send(f"data: {payload}\n\n")

    async def send(self, text: str) -> None:
        """Send one whole frame (and keep it, when kept)."""
        if self.frames is not None:
            self.frames.append(text)
        if self.gone:
            return
        try:
            await self.response.write(text.encode())
        except ConnectionError:  # aiohttp's ClientConnectionResetError is one
            self.gone = True

    async def end(self) -> None:
        """The end of the stream."""
        if not self.gone:
            with contextlib.suppress(ConnectionError):
                await self.response.write_eof()

    async def chunk(self, delta: dict[str, Any], finish: str | None) -> None:
        await self.frame(self._chunk(delta, finish))

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> str:
        payload: dict[str, Any] = {
            **self.base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if self.include_usage:
            payload["usage"] = None
        return json.dumps(payload)

    def closing(self, outcome: Outcome) -> list[str]:
        """The frames that end the stream after the turn's ``outcome``: its text when it
        did not go out delta by delta, the last chunk, the usage chunk (asked for) and
        ``[DONE]`` (a gated turn's: no text, no workItemId anywhere). Made before they
        are sent, so that a keyed turn stores them in its last transaction."""
        frames = []
        usage = None
        if isinstance(outcome, Reply):
            usage = outcome.usage
            if outcome.text and not outcome.streamed:
                frames.append(f"data: {self._chunk({'content': outcome.text}, None)}\n\n")
        frames.append(f"data: {self._chunk({}, 'stop')}\n\n")
        if self.include_usage:
            last = json.dumps({**self.base, "choices": [], "usage": _usage(usage)})
            frames.append(f"data: {last}\n\n")
        frames.append("data: [DONE]\n\n")
        return frames


def _error_json(request: web.Request, exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and envelope of ``exc`` exactly as the error middleware answers it (counted
    and logged as it would be)."""
    resp = error_answer(request, exc)
    assert isinstance(resp.body, bytes)
    return resp.status, json.loads(resp.body)


def _client_attempt(request: web.Request) -> int | None:
    """Which attempt of its request this is, as the official clients number them
    (:data:`ATTEMPT_HEADER`); None from other clients (or a value that is no count)."""
    value = request.headers.get(ATTEMPT_HEADER, "")
    return int(value) if value.isascii() and value.isdigit() and len(value) < 4 else None


#: What makes a retry the same request: the organization, the caller (its key), the
#: ``X-Session-Id``, the request's fingerprint (:func:`_request_print`).
AttemptKey = tuple[str, str, str, str]


class _Attempts:
    """The unkeyed requests of the official clients whose turns run in this process,
    each with the answer it will have (a replayable one, as an Idempotency-Key's).

    Those clients send a request again by themselves after a lost connection or a
    timeout (their default retries, ``x-stainless-retry-count`` 1, 2), with no
    Idempotency-Key: the retry was a new message, its own turn run beside the first's
    (the model called twice, the message twice in the transcript). A retry of a request
    whose turn still runs here is now that request: it waits for the running turn and
    is answered what the first would have been, ``Idempotent-Replayed: true``. Once that
    turn has ended it is a new message again, as MCP's call sent again (nothing else
    tells a resend from the same words sent anew); so is one reaching another replica.
    The first request failing before its message was taken in leaves the retry to run
    its own turn."""

    def __init__(self) -> None:
        self._running: dict[AttemptKey, asyncio.Future[dict[str, Any] | None]] = {}

    def running(self, key: AttemptKey) -> asyncio.Future[dict[str, Any] | None] | None:
        """The answer to come of the request ``key`` whose turn runs, if one does."""
        return self._running.get(key)

    @contextlib.contextmanager
    def attempt(self, key: AttemptKey) -> Iterator[asyncio.Future[dict[str, Any] | None]]:
        """Register a request's turn for its retries; set the future's result to its
        answer (None when it has none to share). Unset, it resolves to None."""
        answer: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._running[key] = answer
        try:
            yield answer
        finally:
            if not answer.done():
                answer.set_result(None)
            if self._running.get(key) is answer:
                del self._running[key]


def _request_print(
    principal: Principal, body: dict[str, Any], session: str | None, parsed: ChatRequest
) -> str:
    """The fingerprint of a request: its body, its ``X-Session-Id`` and, for the default
    session, the API key (each key's own: the same body from another key of the
    organization is another request)."""
    parts = [json.dumps(body, sort_keys=True, separators=(",", ":")).encode()]
    parts.append((session or "").encode())
    target = api_session_key(principal, session=session, user=parsed.user)
    if target.startswith("default:"):
        parts.append(target.encode())
    return fingerprint(*parts)


def setup(
    app: web.Application,
    *,
    authenticate_with: PrincipalLookup,
    chat: ChatBackend,
    ids: IdFactory,
    clock: Clock,
    models: ModelBackend | None = None,
    idempotency: IdempotencyBackend | None = None,
) -> None:
    """Register ``POST /v1/chat/completions`` and (with ``models``) ``GET /v1/models``."""
    attempts = _Attempts()

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request, authenticate_with, cookie=False)
        body = await json_body(request)
        session = header_text(request, "X-Session-Id")
        try:
            return await _completions(request, principal, body, session)
        except ValidationError as exc:
            # ``param`` names the request parameter the rule is about, as OpenAI's do,
            # also for the turn path's own checks (the message text, the ``user``
            # session name), which refuse before anything is taken in.
            return error_response(
                request,
                exc.status,
                exc.message,
                exc.code,
                exc.rule,
                param=_param_of(exc.rule, session),
            )

    async def _completions(
        request: web.Request, principal: Principal, body: dict[str, Any], session: str | None
    ) -> web.StreamResponse:
        parsed = parse_request(body)
        key = single_header(request, "Idempotency-Key")
        if key is None or idempotency is None:
            attempt = _client_attempt(request)
            if attempt is None:
                return await _turn(request, principal, parsed, session, None)
            same: AttemptKey = (
                principal.org_id,
                principal.actor,
                session or "",
                _request_print(principal, body, session, parsed),
            )
            running = attempts.running(same) if attempt else None
            if running is not None:
                log.info("a client's retry of a request whose turn runs: answered by that turn")
                answer = await asyncio.shield(running)
                if answer is not None:
                    return await _replay(request, answer, parsed)
            with attempts.attempt(same) as answer_of_turn:
                return await _turn(request, principal, parsed, session, None, answer_of_turn)
        # A model already found missing is refused before the key is claimed (the
        # claim and its release would be two writes for a 404), unless the key was used:
        # its message may have been taken in before the agent was deleted, and the
        # retry gets the key's answer (or takes it over), not the 404.
        try:
            chat.refuse_unknown(principal, parsed.model)
        except NotFound:
            if not await idempotency.used(principal, key):
                raise
        claim = await idempotency.begin(
            principal, key, _request_print(principal, body, session, parsed)
        )
        if claim.action == "replay" and claim.response is not None:
            return await _replay(request, claim.response, parsed)
        if claim.action == "running":
            return _in_progress(request, claim.retry_after_s)
        return await _turn(request, principal, parsed, session, claim)

    async def _turn(
        request: web.Request,
        principal: Principal,
        parsed: ChatRequest,
        session: str | None,
        claim: Claim | None,
        shared: asyncio.Future[dict[str, Any] | None] | None = None,
    ) -> web.StreamResponse:
        """Run the turn; with a ``claim``, store its answer for the key's later requests
        (or release the key when nothing was taken in); with ``shared``, hand its answer
        to the client's retries waiting for it (:class:`_Attempts`)."""
        exchange = _Exchange(
            request,
            parsed,
            f"chatcmpl-{ids.new('c')}",
            clock.now_ms() // 1000,
            chat,
            principal,
            session,
            claim,
            idempotency,
            remember=shared is not None,
        )
        try:
            if claim is None or idempotency is None:
                response, stored = await exchange.run()
                if shared is not None:
                    shared.set_result(stored)
            else:
                async with idempotency.held(principal, claim):
                    response, stored = await exchange.run()
        except BaseException as exc:
            if claim is not None and idempotency is not None and exchange.lapse:
                await idempotency.lapse(principal, claim)
            elif claim is not None and idempotency is not None and not exchange.recorded:
                if isinstance(exc, Unavailable) and exc.in_doubt:
                    await idempotency.lapse(principal, claim)
                else:
                    await idempotency.release(principal, claim)
            raise
        if claim is not None and idempotency is not None and exchange.lapse:
            # Its turn still runs elsewhere (turn recovery's rerun): the next retry takes
            # the key over at once and looks again.
            await idempotency.lapse(principal, claim)
        elif claim is not None and idempotency is not None and not exchange.kept:
            if stored is None:
                await idempotency.release(principal, claim)
            else:
                try:
                    await idempotency.finish(
                        principal,
                        claim,
                        stored,
                        provisional=exchange.provisional,
                        request_id=request_id(request),
                    )
                except DatabaseDamaged as exc:
                    # As above, and counted in the one line a minute naming the file
                    # (it was this warning with the driver's traceback).
                    damaged_answers(request).note(request, exc)
                except Exception as exc:
                    # The turn ended and its answer (a busy 409, an error after the intake,
                    # a stream's error frame, already sent) is in hand: the client gets it.
                    # It was a retryable 503 "nothing was stored" for a message taken in
                    # and answered. Unstored, the answer is held by ``finish`` for its watch
                    # to store once the database is back (the retry gets it replayed); past
                    # the watch's budget the claim's lease is ended, and a retry takes the
                    # key over and is told ``idempotency.lost`` (or busy), never a 2nd turn.
                    log.warning(
                        "storing the answer under its Idempotency-Key failed: %s",
                        type(exc).__name__,
                        # (A database error's traceback without its text: it quotes
                        # the statement's values, the answer.)
                        exc_info=loggable(exc) if unavailable(exc) is None else None,
                    )
        return response

    async def list_models(request: web.Request) -> web.Response:
        assert models is not None
        principal = await authenticate(request, authenticate_with, cookie=False)
        principal.require(Scope.trigger)
        rows = await models.list(principal)
        data = [_model(agent, principal.org_id) for agent in rows if agent.active]
        return web.json_response({"object": "list", "data": data})

    async def get_model(request: web.Request) -> web.Response:
        assert models is not None
        principal = await authenticate(request, authenticate_with, cookie=False)
        principal.require(Scope.trigger)
        ref = request.match_info["model"]
        agent = await models.get(principal, ref)
        if not agent.active:
            raise agents.unknown_agent(ref)
        return web.json_response(_model(agent, principal.org_id))

    app.router.add_post("/v1/chat/completions", chat_completions)
    if models is not None:
        app.router.add_get("/v1/models", list_models)
        app.router.add_get("/v1/models/{model}", get_model)


class _Exchange:
    """One chat completion request's turn and its answer.

    ``recorded`` turns true once the message was taken in (the turn path's ``on_start``):
    from then on every error carries ``x-should-retry: false``. :meth:`run` returns the
    response and, for an idempotent request, the answer to store (``None``: nothing was
    taken in, so a retry may run the turn); ``lost`` says that answer is only "lost".
    ``kept``: the answer is stored already, written in the turn's last transaction (the
    completion, the gated 409, or a stream's frames), so there is nothing left to store
    or release.

    ``cid`` and ``created`` (the clock's seconds) are fixed before the turn runs: the
    answer stored with the turn is byte for byte the one this request returns.
    """

    def __init__(
        self,
        request: web.Request,
        parsed: ChatRequest,
        cid: str,
        created: int,
        chat: ChatBackend,
        principal: Principal,
        session: str | None,
        claim: Claim | None,
        idempotency: IdempotencyBackend | None,
        *,
        remember: bool = False,
    ) -> None:
        self.request = request
        self.parsed = parsed
        self.cid = cid
        self.created = created
        self.chat = chat
        self.principal = principal
        self.session = session
        self.claim = claim
        self.idempotency = idempotency
        self.keep = claim is not None
        #: The answer is made replayable, as a key's, for the client's retries waiting
        #: for it (:class:`_Attempts`), though nothing is stored.
        self.remember = remember
        self.kept = False
        #: The status and body :meth:`_store_answer` stored with the turn (what to send).
        self.answered: tuple[int, dict[str, Any]] | None = None
        #: The closing frames :meth:`_store_frames` stored with the turn (what to send).
        self.closing: list[str] | None = None
        self.recorded = False
        #: The answer is stored only while the key has none (see
        #: :meth:`Idempotency.finish`): "lost" (a takeover found the message taken in),
        #: or an error after the message was taken in (the turn's last transaction, which
        #: stores its answer, may have committed in doubt: then that answer stands).
        self.provisional = False
        #: A takeover whose message's turn still runs elsewhere (turn recovery's rerun, or
        #: a live process): nothing is stored, and the claim's lease is ended for the
        #: next retry (:meth:`_taken_over`).
        self.lapse = False

    async def _send(
        self,
        on_start: Callable[[], Awaitable[None]],
        on_delta: Callable[[str], Awaitable[None]] | None = None,
        answer: TurnAnswer | None = None,
    ) -> Outcome:
        parsed = self.parsed
        return await self.chat.send(
            self.principal,
            parsed.model,
            parsed.text,
            session=self.session,
            user=parsed.user,
            on_delta=on_delta,
            on_start=on_start,
            external_event_id=self.claim.external_event_id if self.claim else None,
            answer=answer,
            # Only a takeover's event id can be a duplicate: its first request's process
            # died, and the turn of its message is this request's to run, if nobody runs it.
            retake=self.claim is not None,
        )

    async def _store_answer(self, conn: Conn, outcome: Reply | Gated) -> None:
        """The answer of ``outcome`` (the completion, or the gated 409), stored under the
        key in the turn's last transaction ``conn`` (:data:`~leadgate.turns.path.TurnAnswer`)."""
        assert self.claim is not None and self.idempotency is not None
        if isinstance(outcome, Reply):
            status, body = 200, _completion(self.cid, self.parsed.model, self.created, outcome)
        else:
            status, body = 409, pending_body(gated=True)
        await self.idempotency.store(
            conn, self.principal, self.claim, {"status": status, "body": body}
        )
        self.answered = status, body

    async def run(self) -> tuple[web.StreamResponse, dict[str, Any] | None]:
        """Run the turn and answer it (see the class docstring)."""
        if self.parsed.stream:
            return await self._stream()
        parsed = self.parsed

        async def taken_in() -> None:
            self.recorded = True

        try:
            # Keyed, the answer is stored in the turn's last transaction (with its reply);
            # unkeyed, nothing more is passed or made.
            outcome = await self._send(taken_in, None, self._store_answer if self.keep else None)
        except Exception as exc:
            if not self.recorded:
                raise
            self.provisional = True
            return self._json(*_error_json(self.request, exc))
        if self.answered is not None and isinstance(outcome, Reply | Gated):
            # Committed with the turn: this very answer is what a retry gets.
            self.kept = True
            return self._json(*self.answered)[0], None
        if isinstance(outcome, Duplicate) and not outcome.busy:
            taken = await self._taken_over(outcome)
            if taken is not None:
                return taken, None
        if isinstance(outcome, Reply):
            completion = _completion(self.cid, parsed.model, self.created, outcome)
            return self._json(200, completion)
        return self._json(*self._refused(outcome))

    async def _taken_over(self, outcome: Duplicate) -> web.StreamResponse | None:
        """A takeover of the key whose message was taken in already, by a request whose
        process died (:meth:`~leadgate.turns.path.TurnService.run` ran its cut turn here
        when nobody ran it). Still running elsewhere (turn recovery's rerun): 409
        ``idempotency.in_progress``, the claim's lease ended so that the next retry
        looks again. Ended: the answer a rerun stored under the key meanwhile, if it
        did (it committed with the end of the run found gone). None: the answer was
        lost (:meth:`_refused`)."""
        assert self.claim is not None and self.idempotency is not None
        self.kept = True  # (nothing of this request's own to store)
        if outcome.running:
            self.lapse = True
            return _in_progress(self.request, RETRY_AFTER_MAX_S)
        stored = await self.idempotency.answer_of(self.principal, self.claim)
        if stored is not None:
            return await _replay(self.request, stored, self.parsed)
        self.kept = False
        return None

    def _refused(self, outcome: Outcome) -> tuple[int, dict[str, Any]]:
        """The 409 of a turn that produced no answer (gated, busy, or a lost answer)."""
        if isinstance(outcome, Gated | Busy):
            return 409, pending_body(gated=isinstance(outcome, Gated))
        # Duplicate: only a takeover of an Idempotency-Key after a crash (or after a fault
        # kept the first answer from being stored) reaches here.
        self.provisional = True
        if isinstance(outcome, Duplicate) and outcome.busy:
            # The first request was answered busy: its message was recorded, not taken
            # into the transcript, so "read the transcript" would send the client looking
            # for a message that is not there. Its answer was this 409: it is again.
            return 409, pending_body(gated=False)
        return _error_json(
            self.request,
            _LostAnswer(LOST_MESSAGE, rule="idempotency.lost"),
        )

    def _json(
        self, status: int, body: dict[str, Any]
    ) -> tuple[web.StreamResponse, dict[str, Any] | None]:
        # Every non-200 answer here comes after the intake decided (taken in, busy or
        # lost): retrying it would not help, and an idempotent retry gets it again.
        headers = NO_RETRY if status >= 400 else None
        stored = {"status": status, "body": body} if self.keep or self.remember else None
        return web.json_response(body, status=status, headers=headers), stored

    async def _stream(self) -> tuple[web.StreamResponse, dict[str, Any] | None]:
        parsed = self.parsed
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        chunks = _Chunks(
            response,
            self.cid,
            self.created,
            parsed.model,
            parsed.include_usage,
            self.keep or self.remember,
        )
        started = False

        async def start() -> None:
            nonlocal started
            self.recorded = started = True
            await chunks.start(self.request)

        async def delta(piece: str) -> None:
            await chunks.chunk({"content": piece}, None)

        answer = functools.partial(self._store_frames, chunks) if self.keep else None
        try:
            outcome = await self._send(start, delta, answer)
        except Exception as exc:
            if not self.recorded:
                raise
            self.provisional = True  # as in :meth:`run`
            if not started:
                return self._json(*_error_json(self.request, exc))
            # Exactly one error frame, the non-streaming envelope, and no [DONE].
            await chunks.frame(json.dumps(_error_json(self.request, exc)[1]))
            await chunks.end()
            return response, self._frames(chunks)
        if not started:
            if isinstance(outcome, Duplicate) and not outcome.busy:
                taken = await self._taken_over(outcome)
                if taken is not None:
                    return taken, None
            return self._json(*self._refused(outcome))
        closing = self.closing
        if closing is None:
            closing = chunks.closing(outcome)
        else:
            # Stored with the turn, after the frames sent so far: the replay is whole.
            self.kept = True
        for text in closing:
            await chunks.send(text)
        await chunks.end()
        return response, None if self.kept else self._frames(chunks)

    async def _store_frames(self, chunks: _Chunks, conn: Conn, outcome: Reply | Gated) -> None:
        """The whole stream of ``outcome`` (the frames sent so far and its closing ones),
        stored under the key in the turn's last transaction ``conn``."""
        assert self.claim is not None and self.idempotency is not None
        assert chunks.frames is not None
        closing = chunks.closing(outcome)
        await self.idempotency.store(
            conn, self.principal, self.claim, {"status": 200, "frames": chunks.frames + closing}
        )
        self.closing = closing

    @staticmethod
    def _frames(chunks: _Chunks) -> dict[str, Any] | None:
        return None if chunks.frames is None else {"status": 200, "frames": chunks.frames}


class _LostAnswer(LeadgateError):
    """The answer of a taken-over Idempotency-Key's first request was lost."""

    status = 409
    code = "idempotency_answer_lost"


def _in_progress(request: web.Request, retry_after_s: int) -> web.Response:
    """409 ``idempotency.in_progress``: the key's request (or its turn) still runs."""
    resp = error_response(
        request,
        409,
        "a request with this Idempotency-Key is still running; retry shortly",
        "idempotency_in_progress",
        "idempotency.in_progress",
    )
    resp.headers["Retry-After"] = str(retry_after_s)
    return resp


def _recovered(stored: dict[str, Any], parsed: ChatRequest) -> dict[str, Any]:
    """The answer, as the first request would have had it, of a turn that turn recovery
    ran again and stored under the key in neutral form
    (:meth:`~leadgate.operations.idempotency.Idempotency.store_recovered`), made for
    ``parsed`` (the retry's request, the same as the first: the same model name,
    stream or not). The same every time: its ``id`` and ``created`` are stored.

    A run that ended failed (``error``) is answered as a live request's failure after
    its intake: the error's status and envelope, or (streamed) the role chunk and the
    one error frame, no ``[DONE]``."""
    recovered = stored[RECOVERED]
    cid, created = str(recovered["id"]), int(recovered["created"])
    error = recovered.get("error")
    outcome: Outcome = Gated(None, None)
    if not recovered.get("gated") and error is None:
        counts = recovered.get("usage")
        usage = Usage(int(counts[0]), int(counts[1])) if counts else None
        outcome = Reply(str(recovered.get("content", "")), usage=usage)
    envelope = None
    if isinstance(error, dict):
        status = int(stored["status"])
        envelope = error_body(status, str(error["message"]), error["code"], error["rule"])
    if parsed.stream:
        chunks = _Chunks(
            web.StreamResponse(), cid, created, parsed.model, parsed.include_usage, True
        )
        role = f"data: {chunks._chunk({'role': 'assistant', 'content': ''}, None)}\n\n"
        if envelope is not None:
            return {"status": 200, "frames": [role, f"data: {json.dumps(envelope)}\n\n"]}
        return {"status": 200, "frames": [role, *chunks.closing(outcome)]}
    if envelope is not None:
        return {"status": status, "body": envelope}
    if isinstance(outcome, Reply):
        return {"status": 200, "body": _completion(cid, parsed.model, created, outcome)}
    return {"status": 409, "body": pending_body(gated=True)}


async def _replay(
    request: web.Request, stored: dict[str, Any], parsed: ChatRequest
) -> web.StreamResponse:
    """The stored answer of an Idempotency-Key's first request, again."""
    headers = {"Idempotent-Replayed": "true"}
    if RECOVERED in stored:
        stored = _recovered(stored, parsed)
    frames = stored.get("frames")
    if isinstance(frames, list):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        for frame in frames:
            await response.write(str(frame).encode())
        await response.write_eof()
        return response
    status = int(stored.get("status", 200))
    if status >= 400:
        headers.update(NO_RETRY)
    return web.json_response(stored.get("body"), status=status, headers=headers)


__all__ = [
    "NO_RETRY",
    "PENDING_MESSAGE",
    "ChatBackend",
    "IdempotencyBackend",
    "ModelBackend",
    "parse_request",
    "pending_body",
    "setup",
]
