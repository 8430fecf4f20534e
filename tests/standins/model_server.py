"""A scriptable stand-in for an OpenAI-compatible model server.

It speaks the real wire protocol of ``POST /v1/chat/completions`` (plain JSON and SSE
streaming, tool calls, the OpenAI error envelope), so that :class:`OpenAIProvider` and
the whole service can be tested through the official ``openai`` SDK with no network.

In-process use::

    async with ModelServer(api_key="sk-test") as server:
        server.push_tool_calls([{"name": "lookup", "arguments": {"q": "x"}}])
        server.push_text("Done.")
        ...  # point a client at server.base_url
        assert server.requests[0]["tools"][0]["function"]["name"] == "lookup"

Subprocess use (acceptance tests, a real service with ``provider = "openai"``)::

    python -m tests.standins.model_server --port 0 [--api-key KEY]

prints ``LISTENING <port>`` on stdout and serves until killed. With an empty queue it
answers deterministically (echo mode, see :meth:`ModelServer._echo_reply`). A test in
another process can still script it over HTTP: ``POST /_standin/push`` with a reply
object (``{"kind": "text", "text": "hi"}``, ``{"kind": "tool_calls", "calls": [...]}``,
``{"kind": "error", "status": 429}``, ``{"kind": "hang"}``, ``{"kind": "drop"}``,
``{"kind": "raw", "body": "..."}``), ``GET /_standin/requests`` for the recorded bodies
and ``POST /_standin/reset``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from aiohttp import web

__all__ = [
    "DropReply",
    "ErrorReply",
    "HangReply",
    "ModelServer",
    "RawReply",
    "Reply",
    "ScriptedToolCall",
    "TextReply",
    "ToolCallsReply",
    "main",
]

CONTROL_PREFIX = "/_standin"


@dataclass
class ScriptedToolCall:
    """One tool call the stand-in model makes.

    ``arguments`` is a dict (sent as its JSON text) or a raw string sent verbatim, which
    is how a test makes the model send unparseable arguments. ``id`` defaults to a
    generated ``call_...`` id.
    """

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None


@dataclass
class TextReply:
    """A final assistant text, streamed in ``pieces`` content deltas."""

    text: str
    pieces: int = 3
    delay_s: float = 0.0


@dataclass
class ToolCallsReply:
    """One or more tool calls (``finish_reason: "tool_calls"``), optionally after text.

    When streaming, each call's arguments are split across ``pieces`` chunks.
    """

    calls: list[ScriptedToolCall]
    text: str | None = None
    pieces: int = 3
    delay_s: float = 0.0


@dataclass
class ErrorReply:
    """An HTTP error with the OpenAI error envelope.

    ``retry_after`` (seconds) sets both ``Retry-After`` and ``retry-after-ms`` (the SDK
    prefers the latter, and only honours values > 0). ``body`` replaces the whole
    envelope, e.g. with an HTML page from a broken proxy.
    """

    status: int
    message: str | None = None
    type: str | None = None
    code: str | None = None
    retry_after: float | None = None
    body: str | None = None


@dataclass
class HangReply:
    """Never answer (until the server stops), to exercise client timeouts.

    With ``after_text`` set and a streaming request, the role chunk and that text are
    sent first and the stream then stalls mid-response.
    """

    after_text: str | None = None


@dataclass
class DropReply:
    """Close the TCP connection without a (complete) response.

    With ``after_text`` set and a streaming request, the connection is dropped after the
    role chunk and that text were sent, i.e. mid-stream.
    """

    after_text: str | None = None


@dataclass
class RawReply:
    """A verbatim response body, for malformed-stream tests."""

    body: str
    status: int = 200
    content_type: str = "text/event-stream"


Reply = TextReply | ToolCallsReply | ErrorReply | HangReply | DropReply | RawReply
Responder = Callable[[dict[str, Any]], Reply | None]

_DEFAULT_ERROR_TYPES: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Forbidden."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    500: ("server_error", None, "The server had an error while processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


def _error_envelope(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _split(text: str, pieces: int) -> list[str]:
    """Split ``text`` into at most ``pieces`` non-empty, nearly equal parts."""
    if not text:
        return []
    n = max(1, min(pieces, len(text)))
    size = math.ceil(len(text) / n)
    return [text[i : i + size] for i in range(0, len(text), size)]


def _content_text(content: Any) -> str:
    """The text of a message ``content`` (a string or a list of content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def reply_from_json(data: Mapping[str, Any]) -> Reply:
    """Build a reply from the control API's JSON form (``kind`` plus the fields)."""
    kind = data.get("kind")
    fields = {k: v for k, v in data.items() if k != "kind"}
    if kind == "text":
        return TextReply(**fields)
    if kind == "tool_calls":
        calls = [_coerce_call(c) for c in fields.pop("calls")]
        return ToolCallsReply(calls=calls, **fields)
    if kind == "error":
        return ErrorReply(**fields)
    if kind == "hang":
        return HangReply(**fields)
    if kind == "drop":
        return DropReply(**fields)
    if kind == "raw":
        return RawReply(**fields)
    raise ValueError(f"unknown reply kind {kind!r}")


def _coerce_call(call: ScriptedToolCall | Mapping[str, Any]) -> ScriptedToolCall:
    if isinstance(call, ScriptedToolCall):
        return call
    return ScriptedToolCall(
        name=str(call["name"]), arguments=call.get("arguments", {}), id=call.get("id")
    )


class ModelServer:
    """A scriptable OpenAI-compatible chat completions server on 127.0.0.1.

    Replies are consumed first-in first-out, one per authorized, well-formed request.
    When the queue is empty the ``responder`` (if set) is asked, and then the default
    applies: ``empty_reply="text"`` answers ``default_text``; ``"echo"`` answers
    ``Echo: <last user message>`` (plus deterministic tool calls, see
    :meth:`_echo_reply`).
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        model: str = "standin-model",
        empty_reply: Literal["text", "echo"] = "text",
        default_text: str = "Hello from the stand-in model.",
        host: str = "127.0.0.1",
    ) -> None:
        self.api_key = api_key
        self.model = model
        self.empty_reply = empty_reply
        self.default_text = default_text
        self.host = host
        self.responder: Responder | None = None
        #: Every request body received on /v1/chat/completions, in arrival order
        #: (including rejected ones: bad key, invalid body).
        self.requests: list[dict[str, Any]] = []
        #: The request headers, parallel to :attr:`requests`.
        self.headers: list[dict[str, str]] = []
        self._queue: deque[Reply] = deque()
        self._seq = 0
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._stopping = asyncio.Event()
        self._request_arrived = asyncio.Condition()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> str:
        """Start listening (``port=0`` picks a free port); return :attr:`base_url`."""
        self._stopping.clear()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_post(f"{CONTROL_PREFIX}/push", self._handle_push)
        app.router.add_get(f"{CONTROL_PREFIX}/requests", self._handle_requests)
        app.router.add_post(f"{CONTROL_PREFIX}/reset", self._handle_reset)
        # A short shutdown timeout: hung handlers are released by _stopping anyway, and
        # a test's teardown must not wait a minute for a client that went away.
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, port).start()
        self._port = int(self._runner.addresses[0][1])
        return self.base_url

    async def stop(self) -> None:
        """Release hung requests and stop listening."""
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ModelServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The TCP port (after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("ModelServer is not started")
        return self._port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: what ``AsyncOpenAI(base_url=...)`` wants."""
        return f"http://{self.host}:{self.port}/v1"

    # ------------------------------------------------------------------ scripting

    def push(self, reply: Reply) -> None:
        """Queue any reply object."""
        self._queue.append(reply)

    def push_text(self, text: str, *, pieces: int = 3, delay_s: float = 0.0) -> None:
        """Queue a final assistant text (streamed as ``pieces`` deltas)."""
        self.push(TextReply(text, pieces=pieces, delay_s=delay_s))

    def push_tool_calls(
        self,
        calls: Iterable[ScriptedToolCall | Mapping[str, Any]],
        *,
        text: str | None = None,
        pieces: int = 3,
        delay_s: float = 0.0,
    ) -> None:
        """Queue tool calls: ``ScriptedToolCall`` or ``{"name", "arguments", "id"?}``.

        ``arguments`` may be a raw string to send invalid JSON.
        """
        self.push(
            ToolCallsReply(
                [_coerce_call(c) for c in calls], text=text, pieces=pieces, delay_s=delay_s
            )
        )

    def push_error(
        self,
        status: int,
        message: str | None = None,
        *,
        type: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        body: str | None = None,
    ) -> None:
        """Queue an HTTP error with the OpenAI error envelope."""
        self.push(ErrorReply(status, message, type, code, retry_after, body))

    def push_hang(self, *, after_text: str | None = None) -> None:
        """Queue a request that is never answered (optionally after some text)."""
        self.push(HangReply(after_text))

    def push_drop(self, *, after_text: str | None = None) -> None:
        """Queue a connection drop (before any response, or mid-stream after text)."""
        self.push(DropReply(after_text))

    def push_raw(
        self, body: str, *, status: int = 200, content_type: str = "text/event-stream"
    ) -> None:
        """Queue a verbatim response body."""
        self.push(RawReply(body, status=status, content_type=content_type))

    def set_responder(self, responder: Responder | None) -> None:
        """Set a function ``body -> Reply | None`` consulted when the queue is empty."""
        self.responder = responder

    @property
    def pending(self) -> int:
        """How many queued replies are not consumed yet."""
        return len(self._queue)

    @property
    def last_request(self) -> dict[str, Any]:
        """The most recent request body."""
        if not self.requests:
            raise AssertionError("the model server received no request")
        return self.requests[-1]

    def reset(self) -> None:
        """Drop queued replies, the responder and the recorded requests."""
        self._queue.clear()
        self.responder = None
        self.requests.clear()
        self.headers.clear()

    async def wait_for_requests(self, count: int, within_s: float = 2.0) -> None:
        """Wait until at least ``count`` requests were received (``TimeoutError`` else)."""
        async with asyncio.timeout(within_s), self._request_arrived:
            await self._request_arrived.wait_for(lambda: len(self.requests) >= count)

    # ------------------------------------------------------------------ handlers

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        denied = self._check_auth(request)
        if denied is not None:
            return denied
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "standin"}
                ],
            }
        )

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = {"_unparseable": raw.decode("utf-8", "replace")}
        if not isinstance(body, dict):
            body = {"_not_an_object": body}
        await self._record(body, request)

        denied = self._check_auth(request)
        if denied is not None:
            return denied
        problem = self._validate(body)
        if problem is not None:
            return web.json_response(
                _error_envelope(problem, "invalid_request_error", param=None), status=400
            )

        reply = self._next_reply(body)
        stream = body.get("stream") is True
        self._seq += 1
        if isinstance(reply, ErrorReply):
            return self._error_response(reply)
        if isinstance(reply, RawReply):
            return web.Response(
                text=reply.body, status=reply.status, content_type=reply.content_type
            )
        if isinstance(reply, DropReply) and (reply.after_text is None or not stream):
            self._abort(request)
            return web.Response(status=500)
        if isinstance(reply, HangReply) and (reply.after_text is None or not stream):
            await self._stopping.wait()
            self._abort(request)
            return web.Response(status=500)
        if stream:
            return await self._stream(request, body, reply)
        return web.json_response(self._completion(body, reply))

    async def _record(self, body: dict[str, Any], request: web.Request) -> None:
        async with self._request_arrived:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            self._request_arrived.notify_all()

    def _check_auth(self, request: web.Request) -> web.Response | None:
        if self.api_key is None:
            return None
        header = request.headers.get("Authorization", "")
        if header == f"Bearer {self.api_key}":
            return None
        if not header.startswith("Bearer ") or not header[7:]:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
            return web.json_response(_error_envelope(message, "invalid_request_error"), status=401)
        given = header[7:]
        # OpenAI shows a masked form of the key it was given; so does the stand-in.
        masked = f"{given[:3]}{'*' * 8}{given[-4:]}" if len(given) > 8 else "*" * len(given)
        message = (
            f"Incorrect API key provided: {masked}. You can find your API key at "
            "https://platform.openai.com/account/api-keys."
        )
        return web.json_response(
            _error_envelope(message, "invalid_request_error", code="invalid_api_key"),
            status=401,
        )

    @staticmethod
    def _validate(body: dict[str, Any]) -> str | None:
        if "_unparseable" in body or "_not_an_object" in body:
            return "We could not parse the JSON body of your request."
        if not isinstance(body.get("model"), str) or not body["model"]:
            return "you must provide a model parameter"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty array"
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in (
                "system",
                "developer",
                "user",
                "assistant",
                "tool",
                "function",
            ):
                return f"Invalid value for 'messages[{i}].role'."
            if msg["role"] == "tool" and not msg.get("tool_call_id"):
                return f"Missing required parameter: 'messages[{i}].tool_call_id'."
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not tools):
            return "Invalid 'tools': empty array. Expected an array with minimum length 1."
        return None

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        if self._queue:
            return self._queue.popleft()
        if self.responder is not None:
            reply = self.responder(body)
            if reply is not None:
                return reply
        if self.empty_reply == "echo":
            return self._echo_reply(body)
        return TextReply(self.default_text)

    @staticmethod
    def _echo_reply(body: dict[str, Any]) -> Reply:
        """The deterministic default of subprocess mode, mirroring the ``script`` model
        (engine/providers/script.py) as far as the wire shows it.

        - The last message is a tool result: the turn is over, answer an empty text.
        - ``submit_lead_review`` offered (a lead run): the last user message that parses
          as a JSON envelope gives ``taskContext`` and ``revision``; ``#escalate`` ->
          ``escalated`` (feedback ``Needs a human.``), ``#revise`` on revision 0 ->
          ``changesRequested`` (``Please revise.``), otherwise ``approved``.
        - Otherwise ``Echo: <last user message>``; ``#fail`` drops the connection after
          the first 16 characters (streaming); ``#complete`` with ``complete_task``
          offered also calls it with summary ``Summary: <message without the tag>``.
        """
        messages: list[dict[str, Any]] = body.get("messages", [])
        offered = {
            t.get("function", {}).get("name")
            for t in body.get("tools") or []
            if isinstance(t, dict)
        }
        if messages and messages[-1].get("role") == "tool":
            return TextReply("")
        users = [_content_text(m.get("content")) for m in messages if m.get("role") == "user"]
        if "submit_lead_review" in offered:
            envelope: dict[str, Any] = {}
            for content in users:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(content)
                    envelope = parsed if isinstance(parsed, dict) else envelope
            context = str(envelope.get("taskContext", ""))
            arguments: dict[str, Any] = {"verdict": "approved"}
            if "#escalate" in context:
                arguments = {"verdict": "escalated", "feedback": "Needs a human."}
            elif "#revise" in context and envelope.get("revision", 0) == 0:
                arguments = {"verdict": "changesRequested", "feedback": "Please revise."}
            return ToolCallsReply([ScriptedToolCall("submit_lead_review", arguments)])
        last_user = users[-1] if users else ""
        text = f"Echo: {last_user}"
        if "#fail" in last_user:
            return DropReply(after_text=text[:16])
        if "#complete" in last_user and "complete_task" in offered:
            summary = " ".join(last_user.replace("#complete", " ").split())
            return ToolCallsReply(
                [ScriptedToolCall("complete_task", {"summary": f"Summary: {summary}"})],
                text=text,
            )
        return TextReply(text)

    @staticmethod
    def _abort(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.abort()

    def _error_response(self, reply: ErrorReply) -> web.Response:
        headers: dict[str, str] = {"x-request-id": f"req_standin_{self._seq}"}
        if reply.retry_after is not None:
            headers["Retry-After"] = str(max(0, math.ceil(reply.retry_after)))
            headers["retry-after-ms"] = str(max(0, int(reply.retry_after * 1000)))
        if reply.body is not None:
            return web.Response(
                text=reply.body, status=reply.status, headers=headers, content_type="text/html"
            )
        default_type, default_code, default_message = _DEFAULT_ERROR_TYPES.get(
            reply.status,
            ("server_error" if reply.status >= 500 else "invalid_request_error", None, "Error."),
        )
        envelope = _error_envelope(
            reply.message or default_message,
            reply.type or default_type,
            reply.code if reply.code is not None else default_code,
        )
        return web.json_response(envelope, status=reply.status, headers=headers)

    # ------------------------------------------------------------------ bodies

    def _ids(self, reply: ToolCallsReply) -> list[str]:
        return [c.id or f"call_standin{self._seq}x{i}" for i, c in enumerate(reply.calls)]

    @staticmethod
    def _arguments(call: ScriptedToolCall) -> str:
        if isinstance(call.arguments, str):
            return call.arguments
        return json.dumps(call.arguments)

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        """A non-streaming ``chat.completion`` object."""
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        finish = "stop"
        if isinstance(reply, TextReply):
            message["content"] = reply.text
        elif isinstance(reply, ToolCallsReply):
            message["content"] = reply.text
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": self._arguments(call)},
                }
                for call_id, call in zip(self._ids(reply), reply.calls, strict=True)
            ]
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-standin{self._seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", self.model)),
            "system_fingerprint": "fp_standin",
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            ],
            "usage": self._usage(body),
        }

    @staticmethod
    def _usage(body: dict[str, Any]) -> dict[str, int]:
        prompt = sum(len(_content_text(m.get("content")).split()) for m in body["messages"])
        return {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}

    async def _stream(
        self, request: web.Request, body: dict[str, Any], reply: Reply
    ) -> web.StreamResponse:
        """Answer with SSE ``chat.completion.chunk`` events the way OpenAI does."""
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "x-request-id": f"req_standin_{self._seq}",
            }
        )
        await resp.prepare(request)
        base = {
            "id": f"chatcmpl-standin{self._seq}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": str(body.get("model", self.model)),
            "system_fingerprint": "fp_standin",
        }
        delay = reply.delay_s if isinstance(reply, TextReply | ToolCallsReply) else 0.0

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            await self._send_event(resp, {**base, "choices": [choice]})
            if delay:
                await asyncio.sleep(delay)

        if isinstance(reply, HangReply | DropReply):
            await send({"role": "assistant", "content": "", "refusal": None})
            for piece in _split(reply.after_text or "", 3):
                await send({"content": piece})
            if isinstance(reply, HangReply):
                await self._stopping.wait()
            self._abort(request)
            return resp

        text = reply.text if isinstance(reply, TextReply | ToolCallsReply) else None
        pieces = reply.pieces if isinstance(reply, TextReply | ToolCallsReply) else 3
        calls = reply.calls if isinstance(reply, ToolCallsReply) else []
        ids = self._ids(reply) if isinstance(reply, ToolCallsReply) else []

        if text or not calls:
            await send({"role": "assistant", "content": "", "refusal": None})
            for piece in _split(text or "", pieces):
                await send({"content": piece})
        for index, (call_id, call) in enumerate(zip(ids, calls, strict=True)):
            header: dict[str, Any] = {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
            if index == 0 and not text:
                # OpenAI puts the role into the first tool-call chunk when there is no text.
                header = {"role": "assistant", "content": None, **header, "refusal": None}
            await send(header)
            for piece in _split(self._arguments(call), pieces):
                await send({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        await send({}, "tool_calls" if calls else "stop")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await self._send_event(resp, {**base, "choices": [], "usage": self._usage(body)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _send_event(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode())

    # ------------------------------------------------------------------ control API

    async def _handle_push(self, request: web.Request) -> web.Response:
        data = await request.json()
        items = data if isinstance(data, list) else [data]
        try:
            for item in items:
                self.push(reply_from_json(item))
        except (TypeError, ValueError, KeyError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"pending": self.pending})

    async def _handle_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def _handle_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"pending": 0})


async def _serve(args: argparse.Namespace) -> None:
    server = ModelServer(api_key=args.api_key, model=args.model, empty_reply="echo", host=args.host)
    await server.start(args.port)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    print(f"LISTENING {server.port}", flush=True)
    try:
        await done.wait()
    finally:
        await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the stand-in as a process: print ``LISTENING <port>``, serve until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--model", default="standin-model")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
