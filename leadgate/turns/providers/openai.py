"""A provider for any OpenAI-compatible chat completions server.

OpenAI, Azure OpenAI (``.../openai/v1/``), vLLM, Ollama and LiteLLM all speak the same
``POST {base_url}/chat/completions`` protocol; this provider drives it through the
official ``openai`` SDK with ``stream=True`` and function tools.

Text deltas are yielded as they arrive; the server's token counts (asked for with
``stream_options.include_usage``) are passed through as one last ``Usage`` event. Tool
calls arrive as fragments keyed by ``index`` (id and name first, then the JSON arguments
in pieces); they are reassembled and yielded once the stream has finished, because the
arguments are only complete then.

Every failure (transport, timeout, HTTP status, a broken or truncated stream) becomes
:class:`leadgate.core.errors.ModelError`. Its message names the server and the HTTP status but
never contains the API key, even when a server echoes the key back in an error body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import openai
from openai import AsyncOpenAI, omit
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

from leadgate.core.errors import ModelError
from leadgate.core.types import Usage
from leadgate.turns.providers.base import (
    ChatMessage,
    ModelEvent,
    ModelRequest,
    TextDelta,
    ToolCall,
    ToolSpec,
)

if TYPE_CHECKING:
    from leadgate.core.config import ModelSettings

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# The SDK refuses to build a client without a key, and local servers (Ollama, vLLM
# without --api-key) need none; this placeholder is what their docs suggest sending.
NO_KEY_PLACEHOLDER = "not-needed"
_MAX_DETAIL = 300


@dataclass
class _PartialToolCall:
    """Fragments of one streamed tool call, keyed by its ``index``."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAIProvider:
    """:class:`~leadgate.turns.providers.base.Provider` over an OpenAI-compatible server.

    ``timeout_s`` bounds connecting and each wait for the next bytes (so a long answer
    that keeps streaming is fine, a stalled one is not). ``max_retries`` is the SDK's
    retry budget for connection errors, timeouts, 408/409/429 and 5xx before the stream
    starts (it honours ``Retry-After``); nothing is retried once text has been yielded.
    A ``client`` passed in is used as is and not closed by :meth:`close`.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        client: AsyncOpenAI | None = None,
    ) -> None:
        if not model:
            raise ValueError("OpenAIProvider needs a model name")
        self.model = model
        self.base_url = base_url or DEFAULT_BASE_URL
        self.timeout_s = timeout_s
        self._api_key = api_key
        self._owns_client = client is None
        self._client = client or AsyncOpenAI(
            base_url=self.base_url,
            api_key=api_key or NO_KEY_PLACEHOLDER,
            timeout=timeout_s,
            max_retries=max_retries,
        )
        parts = urlsplit(self.base_url)
        # Only host and port: a base URL may carry user:password or a query token.
        self._server = parts.hostname or "the model server"
        if parts.port is not None:
            self._server = f"{self._server}:{parts.port}"

    @classmethod
    def from_settings(cls, settings: ModelSettings, *, max_retries: int = 2) -> OpenAIProvider:
        """Build a provider from a ``[models.NAME]`` section with ``provider = "openai"``."""
        return cls(
            base_url=settings.base_url,
            api_key=settings.api_key,
            model=settings.model,
            timeout_s=settings.timeout_s,
            max_retries=max_retries,
        )

    async def close(self) -> None:
        """Close the HTTP connection pool (only if this provider created the client)."""
        if self._owns_client:
            await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        """Yield :class:`TextDelta` as text arrives, then the :class:`ToolCall` events.

        Raises :class:`ModelError` for any failure, including a stream that ends without
        a ``finish_reason`` (a truncated answer must not pass for a complete one).
        """
        messages = [to_openai_message(m) for m in request.messages]
        tools = [to_openai_tool(t) for t in request.tools]
        started = False
        partial: dict[int, _PartialToolCall] = {}
        finish_reason: str | None = None
        usage: Usage | None = None
        try:
            response = await self._client.chat.completions.create(
                model=self.model,
                messages=messages,
                # Some servers reject an empty ``tools`` array, so none means no key.
                tools=tools if tools else omit,
                stream=True,
                # The server's own token counts, in one last chunk (passed through).
                stream_options={"include_usage": True},
            )
            async with response as chunks:
                async for chunk in chunks:
                    started = True
                    if chunk.usage is not None:
                        usage = Usage(
                            prompt_tokens=chunk.usage.prompt_tokens or 0,
                            completion_tokens=chunk.usage.completion_tokens or 0,
                        )
                    for choice in chunk.choices or ():
                        # We never ask for n > 1; ignore anything but the first choice.
                        if choice.index != 0:
                            continue
                        delta = choice.delta
                        if delta is not None:
                            # A refusal is the model's answer too; show it rather than
                            # ending the turn with no text at all.
                            text = delta.content or delta.refusal
                            if text:
                                yield TextDelta(text)
                            for fragment in delta.tool_calls or ():
                                _accumulate(partial, fragment)
                        if choice.finish_reason:
                            finish_reason = choice.finish_reason
        except openai.OpenAIError as exc:
            raise self._model_error(exc, started) from None
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            # json.JSONDecodeError (a ValueError) for a non-JSON ``data:`` line, and
            # attribute/type errors for chunks that are JSON but not chunk-shaped.
            raise ModelError(
                f"the model server at {self._server} sent a malformed stream "
                f"({type(exc).__name__})",
                rule="model.bad_response",
            ) from None
        if finish_reason is None:
            raise ModelError(
                f"the model server at {self._server} ended the stream before the answer "
                "was finished",
                rule="model.bad_response",
            )
        for index in sorted(partial):
            yield self._finish_tool_call(index, partial[index])
        if usage is not None:
            yield usage

    def _finish_tool_call(self, index: int, call: _PartialToolCall) -> ToolCall:
        if not call.name:
            raise ModelError(
                f"the model server at {self._server} sent a tool call without a name",
                rule="model.bad_response",
            )
        call_id = call.id or f"call_{index}"
        raw = "".join(call.arguments)
        if not raw.strip():
            # Servers send "" for a function without parameters.
            return ToolCall(id=call_id, name=call.name, arguments={})
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            return ToolCall(
                id=call_id,
                name=call.name,
                arguments={},
                arguments_error=f"arguments are not valid JSON: {exc}",
            )
        if not isinstance(parsed, dict):
            return ToolCall(
                id=call_id,
                name=call.name,
                arguments={},
                arguments_error=f"arguments must be a JSON object, got {type(parsed).__name__}",
            )
        return ToolCall(id=call_id, name=call.name, arguments=parsed)

    def _model_error(self, exc: openai.OpenAIError, started: bool) -> ModelError:
        """Translate an SDK error into a ModelError with a key-free message."""
        server = self._server
        if isinstance(exc, openai.APITimeoutError):
            return ModelError(
                f"the model server at {server} did not answer within {self.timeout_s:g}s",
                rule="model.timeout",
            )
        if isinstance(exc, openai.APIConnectionError):
            if started:
                message = f"the connection to the model server at {server} broke mid-answer"
            else:
                message = f"could not reach the model server at {server}"
            return ModelError(message, rule="model.unreachable")
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            detail = self._detail(exc)
            if status in (401, 403):
                rule = "model.auth"
                what = "rejected the API key"
            elif status == 429:
                rule = "model.rate_limited"
                what = "is rate limiting requests"
            elif status >= 500:
                rule = "model.server_error"
                what = "failed"
            else:
                rule = "model.bad_request"
                what = "rejected the request"
            request_id = f", request id {exc.request_id}" if exc.request_id else ""
            return ModelError(
                f"the model server at {server} {what} (HTTP {status}{request_id})",
                rule=rule,
                detail=detail,
            )
        if isinstance(exc, openai.APIError):
            # An ``error`` object sent inside an otherwise successful stream.
            return ModelError(
                f"the model server at {server} reported an error mid-answer",
                rule="model.server_error",
                detail=self._detail(exc),
            )
        return ModelError(
            f"the model call to {server} failed",
            rule="model.error",
            detail=f": {self._redact(str(exc))}",
        )

    def _detail(self, exc: openai.APIError) -> str:
        """``": <server message>"`` from the error envelope, redacted and shortened."""
        body = exc.body
        message: Any = None
        if isinstance(body, dict):
            inner = body.get("error", body)
            message = inner.get("message") if isinstance(inner, dict) else inner
        if not isinstance(message, str) or not message.strip():
            return ""
        text = " ".join(self._redact(message).split())
        if len(text) > _MAX_DETAIL:
            text = text[: _MAX_DETAIL - 3] + "..."
        return f": {text}"

    def _redact(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "[redacted]")
        return text


def _accumulate(partial: dict[int, _PartialToolCall], fragment: ChoiceDeltaToolCall) -> None:
    """Merge one streamed tool-call fragment into the call with the same index."""
    index: int | None = fragment.index
    if index is None:
        # A few compatibility layers omit ``index``: a fragment with a new id starts a
        # new call, anything else continues the latest one.
        latest = max(partial, default=None)
        starts_new = latest is None or bool(fragment.id and fragment.id != partial[latest].id)
        index = len(partial) if starts_new or latest is None else latest
    call = partial.setdefault(index, _PartialToolCall())
    if fragment.id and not call.id:
        call.id = fragment.id
    function = fragment.function
    if function is None:
        return
    if function.name and function.name != call.name:
        # OpenAI sends the whole name once; some proxies repeat it on every fragment,
        # and a few split it. Repeats are ignored, pieces are joined.
        call.name = function.name if not call.name else call.name + function.name
    if function.arguments:
        call.arguments.append(function.arguments)


def to_openai_tool(tool: ToolSpec) -> ChatCompletionFunctionToolParam:
    """A :class:`ToolSpec` as an OpenAI ``tools`` entry."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def to_openai_message(message: ChatMessage) -> ChatCompletionMessageParam:
    """A :class:`ChatMessage` as an OpenAI chat message dict."""
    if message.role == "system":
        system: ChatCompletionSystemMessageParam = {"role": "system", "content": message.content}
        return system
    if message.role == "user":
        user: ChatCompletionUserMessageParam = {"role": "user", "content": message.content}
        return user
    if message.role == "tool":
        if not message.tool_call_id:
            raise ModelError("a tool result message has no tool_call_id", rule="model.bad_request")
        tool: ChatCompletionToolMessageParam = {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "content": message.content,
        }
        return tool
    assistant: ChatCompletionAssistantMessageParam = {"role": "assistant"}
    if message.tool_calls:
        # OpenAI wants null content (not "") beside tool calls when there was no text.
        assistant["content"] = message.content or None
        assistant["tool_calls"] = [_to_openai_tool_call(c) for c in message.tool_calls]
    else:
        assistant["content"] = message.content
    return assistant


def _to_openai_tool_call(call: ToolCall) -> ChatCompletionMessageFunctionToolCallParam:
    # Unparseable arguments were replaced by {} when received; "{}" is what the model
    # gets back, alongside the tool error the turn path reports for that call.
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }
