"""``POST /v1/chat/completions``: OpenAI-compatible, on the shared turn path (SPEC 7)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.clock import IdFactory
from leadgate.core.decoding import header_text
from leadgate.core.errors import LeadgateError, ModelError, ValidationError
from leadgate.core.types import Busy, Duplicate, Gated, Outcome, Reply
from leadgate.web.common import PrincipalLookup, authenticate, json_body, openai_error

PENDING_MESSAGE = "This turn is pending Lead review. Retry after the review completes."
# The official OpenAI clients retry a 409 by default (twice), which would resend a turn
# that was taken in (gated) or refused (busy); this header, which they obey, says not to.
NO_RETRY = {"x-should-retry": "false"}


def pending_body(*, gated: bool) -> dict[str, Any]:
    """The 409 body: a gated turn carries null workItemId/revision; busy omits them."""
    error: dict[str, Any] = {
        "message": PENDING_MESSAGE,
        "type": "lead_review_pending",
        "code": "LEAD_REVIEW_PENDING",
    }
    if gated:
        error["workItemId"] = None
        error["revision"] = None
    return {"error": error}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        ]
        if texts:
            return "\n".join(str(t) for t in texts)
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
    ) -> Outcome: ...


@dataclass(frozen=True)
class ChatRequest:
    """The parts of an OpenAI chat completion request leadgate uses."""

    model: str
    text: str
    user: str | None
    stream: bool


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
    user = body.get("user")
    return ChatRequest(model, text, user if isinstance(user, str) and user else None, stream)


def _chunk(cid: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> bytes:
    payload = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


def _completion(cid: str, model: str, created: int, text: str) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


async def _error_frame(response: web.StreamResponse, exc: Exception) -> web.StreamResponse:
    """A mid-stream failure: exactly one ``data: {"error": ...}`` frame, no ``[DONE]``."""
    if isinstance(exc, LeadgateError):
        error = {"message": exc.message, "type": "server_error", "code": exc.code}
        if isinstance(exc, ModelError):
            error["type"] = "model_error"
    else:
        error = {"message": "internal error", "type": "server_error", "code": "internal_error"}
    await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
    await response.write_eof()
    return response


def setup(
    app: web.Application, *, authenticate_with: PrincipalLookup, chat: ChatBackend, ids: IdFactory
) -> None:
    """Register ``POST /v1/chat/completions``."""

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request, authenticate_with, cookie=False)
        body = await json_body(request)
        parsed = parse_request(body)
        session = header_text(request, "X-Session-Id")
        cid = f"chatcmpl-{ids.new('c')}"
        created = int(time.time())
        model = parsed.model
        if not parsed.stream:
            outcome = await chat.send(
                principal, parsed.model, parsed.text, session=session, user=parsed.user
            )
            if isinstance(outcome, Reply):
                return web.json_response(_completion(cid, model, created, outcome.text))
            return web.json_response(
                pending_body(gated=isinstance(outcome, Gated)), status=409, headers=NO_RETRY
            )

        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

        async def start() -> None:
            await response.prepare(request)
            await response.write(
                _chunk(cid, model, created, {"role": "assistant", "content": ""}, None)
            )

        async def delta(piece: str) -> None:
            await response.write(_chunk(cid, model, created, {"content": piece}, None))

        try:
            outcome = await chat.send(
                principal,
                parsed.model,
                parsed.text,
                session=session,
                user=parsed.user,
                on_delta=delta,
                on_start=start,
            )
        except Exception as exc:
            if not response.prepared:
                raise
            return await _error_frame(response, exc)
        if isinstance(outcome, Busy | Duplicate):
            return web.json_response(pending_body(gated=False), status=409, headers=NO_RETRY)
        if isinstance(outcome, Reply) and outcome.text and not outcome.streamed:
            await delta(outcome.text)
        await response.write(_chunk(cid, model, created, {}, "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app.router.add_post("/v1/chat/completions", chat_completions)


__all__ = [
    "PENDING_MESSAGE",
    "ChatBackend",
    "openai_error",
    "parse_request",
    "pending_body",
    "setup",
]
