"""``POST /v1/chat/completions``: OpenAI-compatible, on the shared turn path (SPEC 7)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.auth import Principal, Scope
from engine.errors import LeadgateError, ModelError, ValidationError
from engine.types import BindingKind, BindingSpec, Busy, Duplicate, Gated, Reply, Trigger
from web.common import authenticate, json_body, openai_error

if TYPE_CHECKING:
    from engine.service import Service

PENDING_MESSAGE = "This turn is pending Lead review. Retry after the review completes."
SESSION_LIMIT = 200
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


def parse_request(
    body: dict[str, Any], principal: Principal, header_session: str | None
) -> tuple[str, str, str, bool]:
    """(agent ref, message, session key, stream) from an OpenAI request body."""
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
    if header_session:
        session = f"h:{header_session}"
    elif isinstance(user, str) and user:
        session = f"u:{user}"
    else:
        session = f"default:{principal.key_id or principal.user_id}"
    if len(session) > SESSION_LIMIT + 2:
        raise ValidationError("the session id is longer than 200 characters", rule="session.length")
    return model, text, session, stream


def _chunk(cid: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> bytes:
    payload = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


def setup(app: web.Application, service: Service) -> None:
    """Register the route."""

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request, service.lookup_principal, cookie=False)
        body = await json_body(request)
        principal.require(Scope.trigger)
        agent_ref, text, session, stream = parse_request(
            body, principal, request.headers.get("X-Session-Id")
        )
        # The agent is looked up (404 when unknown) inside the intake transaction, which
        # runs before the stream starts.
        trigger = Trigger(
            org_id=principal.org_id,
            agent_id=agent_ref,
            session_key=session,
            text=text,
            binding=BindingSpec(BindingKind.api),
        )
        cid = f"chatcmpl-{service.ids.new('c')}"
        created = int(time.time())
        model = body["model"]
        if not stream:
            outcome = await service.turns.run(trigger)
            if isinstance(outcome, Reply):
                return web.json_response(
                    {
                        "id": cid,
                        "object": "chat.completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": outcome.text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                    }
                )
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
            outcome = await service.turns.run(trigger, on_delta=delta, on_start=start)
        except LeadgateError as exc:
            if not response.prepared:
                raise
            error = {"message": exc.message, "type": "server_error", "code": exc.code}
            if isinstance(exc, ModelError):
                error["type"] = "model_error"
            await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
            await response.write_eof()
            return response
        except Exception:
            if not response.prepared:
                raise
            error = {"message": "internal error", "type": "server_error", "code": "internal_error"}
            await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
            await response.write_eof()
            return response
        if isinstance(outcome, Busy | Duplicate):
            return web.json_response(pending_body(gated=False), status=409, headers=NO_RETRY)
        if isinstance(outcome, Reply) and outcome.text and not outcome.streamed:
            await delta(outcome.text)
        await response.write(_chunk(cid, model, created, {}, "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app.router.add_post("/v1/chat/completions", chat_completions)


__all__ = ["PENDING_MESSAGE", "openai_error", "pending_body", "setup"]
