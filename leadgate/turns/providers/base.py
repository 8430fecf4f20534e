"""The model provider Protocol.

A provider turns a :class:`ModelRequest` into a stream of :class:`TextDelta` and
:class:`ToolCall` events, and (when it knows them) one
:class:`~leadgate.core.types.Usage` with the call's token counts. The turn path
executes tool calls and, when any were made, calls the provider again with the tool
results appended (at most a few rounds).
Providers raise :class:`leadgate.core.errors.ModelError` for any failure of the model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from leadgate.core.types import Usage


@dataclass(frozen=True)
class ToolSpec:
    """A function tool offered to the model (OpenAI ``tools`` entry)."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made. ``arguments`` is the parsed JSON object;
    ``arguments_error`` is set instead when the model sent unparseable arguments."""

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_error: str | None = None


class ChatMessage(NamedTuple):
    """One message of the conversation sent to the model (a named tuple: a turn builds
    up to 50 of them from the history, and a frozen dataclass costs twice as much)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ModelRequest:
    """Everything a provider needs for one model call.

    ``purpose`` is ``"worker"`` for worker turns and ``"lead"`` for a lead review;
    ``revision_feedback`` is set on internal revision turns (lead feedback or a human's
    return) so that the built-in ``script`` model can answer deterministically.
    """

    messages: list[ChatMessage]
    tools: list[ToolSpec] = field(default_factory=list)
    purpose: Literal["worker", "lead"] = "worker"
    revision_feedback: str | None = None


@dataclass(frozen=True)
class TextDelta:
    """A piece of assistant text."""

    text: str


ModelEvent = TextDelta | ToolCall | Usage


class Provider(Protocol):
    """A model backend."""

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """Yield text deltas and tool calls for one model call (and its usage)."""
        ...
