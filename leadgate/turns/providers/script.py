"""The built-in offline model (SPEC 11): deterministic, so the service runs with no API.

Worker: ``Echo: <last message>``; ``#complete`` also calls complete_task with
``Summary: <message without the tag>``; ``#fail`` raises mid-turn (after the first chunk);
on an internal revision turn it replies ``Revised: <feedback>`` and completes with that text.
Lead: ``#escalate`` in the task context -> escalated; ``#revise`` -> changesRequested with
``Please revise.`` on revision 0, approved afterwards; otherwise approved.

Usage: the model counts its own tokens, one per 4 characters (rounded up):
``prompt_tokens`` of the content of all the messages it was sent, ``completion_tokens``
of the text it produced plus the JSON arguments of its tool calls. The figures are
reported after the call's last event (none when ``#fail`` ended it).
"""

from __future__ import annotations

import json
import operator
from collections.abc import AsyncIterator

from leadgate.core.errors import ModelError
from leadgate.core.types import Usage
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta, ToolCall


def _chunks(text: str, size: int = 16) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


_CONTENT = operator.attrgetter("content")


def _tokens(characters: int) -> int:
    """The script model's token count of ``characters``: one per 4, rounded up."""
    return -(-characters // 4)


class ScriptProvider:
    """Deterministic worker and lead behaviour for demos and tests."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """Yield the scripted events for ``request``, then their :class:`Usage`."""
        produced = 0  # characters
        async for event in self._events(request):
            if isinstance(event, TextDelta):
                produced += len(event.text)
            elif isinstance(event, ToolCall):
                produced += len(json.dumps(event.arguments))
            yield event
        # map/attrgetter: no Python-level call per message of the (50-message) history.
        sent = sum(map(len, map(_CONTENT, request.messages)))
        yield Usage(prompt_tokens=_tokens(sent), completion_tokens=_tokens(produced))

    async def _events(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if request.messages and request.messages[-1].role == "tool":
            return  # the tool result was delivered; the scripted turn is over
        if request.purpose == "lead":
            async for event in self._lead(request):
                yield event
            return
        offered = {tool.name for tool in request.tools}
        if request.revision_feedback is not None:
            text = f"Revised: {request.revision_feedback}"
            for piece in _chunks(text):
                yield TextDelta(piece)
            if "complete_task" in offered:
                # The summary rule caps at 2,000 characters; long feedback is cut so the
                # revision still completes (SPEC 11 says "that same text").
                yield ToolCall("call_revise", "complete_task", {"summary": text[:2000]})
            return
        last = next((m.content for m in reversed(request.messages) if m.role == "user"), "")
        text = f"Echo: {last}"
        pieces = _chunks(text)
        for index, piece in enumerate(pieces):
            yield TextDelta(piece)
            if index == 0 and "#fail" in last:
                raise ModelError("script model: #fail requested a runtime error mid-turn")
        if "#complete" in last and "complete_task" in offered:
            summary = " ".join(last.replace("#complete", " ").split())
            # Capped at the 2,000-character summary rule so long tasks still complete.
            yield ToolCall(
                "call_complete", "complete_task", {"summary": f"Summary: {summary}"[:2000]}
            )

    async def _lead(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        envelope: dict[str, object] = {}
        for message in request.messages:
            if message.role == "user":
                try:
                    envelope = json.loads(message.content)
                except ValueError:
                    continue
        context = str(envelope.get("taskContext", ""))
        revision = envelope.get("revision", 0)
        if "#escalate" in context:
            args: dict[str, object] = {"verdict": "escalated", "feedback": "Needs a human."}
        elif "#revise" in context and revision == 0:
            args = {"verdict": "changesRequested", "feedback": "Please revise."}
        else:
            args = {"verdict": "approved"}
        yield ToolCall("call_verdict", "submit_lead_review", args)
