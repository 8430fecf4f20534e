"""The built-in offline ``script`` model, exactly as SPEC 11 describes it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.errors import ModelError
from leadgate.core.runners import drain
from leadgate.core.types import Gated, Reply, Usage
from leadgate.database import schema as t
from leadgate.review.runner import LEAD_TOOLS
from leadgate.runners.revisions import RevisionRunner
from leadgate.turns.context import COMPLETE_TASK
from leadgate.turns.messages import visible_transcript
from leadgate.turns.providers.base import ChatMessage, ModelEvent, ModelRequest, TextDelta, ToolCall
from leadgate.turns.providers.script import ScriptProvider
from tests.helpers import api_trigger, make_agent, make_org
from tests.stack import Stack


async def events_of(request: ModelRequest) -> list[ModelEvent]:
    return [event async for event in ScriptProvider().stream(request)]


def worker_request(text: str, *, offered: bool = True, **kwargs: Any) -> ModelRequest:
    return ModelRequest(
        messages=[
            ChatMessage("system", "You are a helpful agent."),
            ChatMessage("user", "an earlier message #complete #fail"),
            ChatMessage("assistant", "Echo: an earlier message"),
            ChatMessage("user", text),
        ],
        tools=[COMPLETE_TASK] if offered else [],
        **kwargs,
    )


def text_of(events: list[ModelEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(events: list[ModelEvent]) -> list[ToolCall]:
    return [e for e in events if isinstance(e, ToolCall)]


# ------------------------------------------------------------------------- worker


async def test_worker_echoes_the_last_user_message() -> None:
    events = await events_of(worker_request("hello there"))
    assert text_of(events) == "Echo: hello there"
    assert calls_of(events) == []
    long = "z" * 1000
    events = await events_of(worker_request(long))
    assert text_of(events) == "Echo: " + long
    assert len([e for e in events if isinstance(e, TextDelta)]) > 1  # it streams in pieces


@pytest.mark.parametrize(
    ("message", "summary"),
    [
        ("write it #complete", "Summary: write it"),
        ("#complete write it", "Summary: write it"),
        ("write #complete it", "Summary: write it"),
        ("  padded   #complete  ", "Summary: padded"),
        # Whitespace: the tag is removed, runs of whitespace (newlines and tabs included)
        # collapse to one space, and the ends are trimmed.
        ("line one\nline two #complete", "Summary: line one line two"),
        ("tab\tseparated\t#complete", "Summary: tab separated"),
        ("#complete", "Summary: "),
    ],
)
async def test_complete_tag_calls_complete_task_with_the_summary(
    message: str, summary: str
) -> None:
    events = await events_of(worker_request(message))
    assert text_of(events) == f"Echo: {message}"
    [call] = calls_of(events)
    assert call.name == "complete_task"
    assert call.arguments == {"summary": summary}
    assert isinstance(events[-2], ToolCall), "the tool call comes after the text"
    assert isinstance(events[-1], Usage), "then the call's token counts"


async def test_complete_tag_without_the_tool_offered_is_plain_text() -> None:
    events = await events_of(worker_request("write it #complete", offered=False))
    assert text_of(events) == "Echo: write it #complete"
    assert calls_of(events) == []


async def test_fail_raises_a_model_error_after_the_first_chunk() -> None:
    seen: list[ModelEvent] = []
    with pytest.raises(ModelError):
        async for event in ScriptProvider().stream(worker_request("please #fail now")):
            seen.append(event)
    assert len(seen) == 1
    assert isinstance(seen[0], TextDelta)
    assert seen[0].text
    assert "Echo: please #fail now".startswith(seen[0].text)


async def test_revision_turn_replies_revised_and_completes_with_that_text() -> None:
    request = worker_request("ignored #fail", revision_feedback="Please revise.")
    events = await events_of(request)
    assert text_of(events) == "Revised: Please revise."
    [call] = calls_of(events)
    assert (call.name, call.arguments) == ("complete_task", {"summary": "Revised: Please revise."})
    # a human's return text works the same way
    events = await events_of(worker_request("x", revision_feedback="Add the totals"))
    assert text_of(events) == "Revised: Add the totals"
    assert calls_of(events)[0].arguments == {"summary": "Revised: Add the totals"}
    # without the tool on offer it only replies
    events = await events_of(worker_request("x", offered=False, revision_feedback="Fix"))
    assert (text_of(events), calls_of(events)) == ("Revised: Fix", [])


async def test_after_a_tool_result_the_scripted_turn_is_over() -> None:
    request = worker_request("write it #complete")
    request.messages.append(ChatMessage("tool", '{"ok": true}', tool_call_id="call_complete"))
    # Nothing but the prompt's token count.
    [usage] = await events_of(request)
    assert isinstance(usage, Usage) and usage.completion_tokens == 0


async def test_usage_counts_one_token_per_four_characters() -> None:
    request = ModelRequest(
        messages=[ChatMessage("system", "abcd"), ChatMessage("user", "hello")],  # 9 chars
        tools=[COMPLETE_TASK],
    )
    events = await events_of(request)
    # "Echo: hello" (11 characters) = 3 tokens; no tool call without #complete.
    assert events[-1] == Usage(prompt_tokens=3, completion_tokens=3)
    request = ModelRequest(messages=[ChatMessage("user", "x #complete")], tools=[COMPLETE_TASK])
    events = await events_of(request)
    # "Echo: x #complete" (17) plus json.dumps({"summary": "Summary: x"}) (25) = 42: 11.
    assert events[-1] == Usage(prompt_tokens=3, completion_tokens=11)
    assert text_of(events) == "Echo: x #complete"


# --------------------------------------------------------------------------- lead


def lead_request(task: str, revision: int) -> ModelRequest:
    envelope = {
        "taskContext": task,
        "summary": "Summary: x",
        "submissionSnapshot": "Echo: x",
        "revision": revision,
        "maxRevisionRounds": 3,
        "previousFeedback": None,
    }
    return ModelRequest(
        messages=[ChatMessage("system", "lead"), ChatMessage("user", json.dumps(envelope))],
        tools=LEAD_TOOLS,
        purpose="lead",
    )


@pytest.mark.parametrize(
    ("task", "revision", "verdict"),
    [
        ("plain task", 0, {"verdict": "approved"}),
        ("plain task", 2, {"verdict": "approved"}),
        ("please #escalate this", 0, {"verdict": "escalated", "feedback": "Needs a human."}),
        ("#escalate and #revise", 1, {"verdict": "escalated", "feedback": "Needs a human."}),
        ("first\n\nthen #revise", 0, {"verdict": "changesRequested", "feedback": "Please revise."}),
        ("then #revise", 1, {"verdict": "approved"}),
        ("then #revise", 3, {"verdict": "approved"}),
    ],
)
async def test_lead_verdicts(task: str, revision: int, verdict: dict[str, str]) -> None:
    events = await events_of(lead_request(task, revision))
    assert text_of(events) == ""
    [call] = calls_of(events)
    assert call.name == "submit_lead_review"
    assert call.arguments == verdict


# ---------------------------------------------------------------- on the real path


async def test_script_model_drives_the_whole_review_loop(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    revisions = RevisionRunner(stack.turns)

    out = await stack.turns.run(api_trigger(org, worker, "draft it #revise #complete"))
    assert isinstance(out, Gated)
    item_id = out.work_item_id
    await drain(stack.lead_runner)  # revision 0 + #revise -> changesRequested

    async def item() -> Any:
        async with stack.db.read() as conn:
            return (
                await conn.execute(sa.select(t.work_items).where(t.work_items.c.id == item_id))
            ).one()

    row = await item()
    assert (row.status, row.revision, row.pending_feedback) == ("inProgress", 1, "Please revise.")
    await drain(revisions)  # internal turn: "Revised: Please revise." + complete_task
    row = await item()
    assert (row.status, row.summary, row.snapshot) == (
        "reviewQueued",
        "Revised: Please revise.",
        "Revised: Please revise.",
    )
    assert row.pending_feedback is None
    await drain(stack.lead_runner)  # revision 1 -> approved
    await drain(stack.relay)
    row = await item()
    assert row.status == "completed"
    async with stack.db.read() as conn:
        shown = await visible_transcript(conn, org.id, row.session_id)
    assert [(r["role"], r["content"]) for r in shown] == [
        ("user", "draft it #revise #complete"),
        ("assistant", "Revised: Please revise."),
    ]

    # #escalate -> a human must decide
    out = await stack.turns.run(
        api_trigger(org, worker, "hard one #escalate #complete", session="s2")
    )
    assert isinstance(out, Gated)
    await drain(stack.lead_runner)
    async with stack.db.read() as conn:
        status = await conn.scalar(
            sa.select(t.work_items.c.status).where(t.work_items.c.id == out.work_item_id)
        )
    assert status == "awaitingHuman"


async def test_fail_on_the_turn_path(stack: Stack) -> None:
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")

    deltas: list[str] = []

    async def on_delta(piece: str) -> None:
        deltas.append(piece)

    with pytest.raises(ModelError):
        await stack.turns.run(api_trigger(org, plain, "boom #fail"), on_delta=on_delta)
    assert len(deltas) == 1 and "Echo: boom #fail".startswith(deltas[0])
    with pytest.raises(ModelError):
        await stack.turns.run(api_trigger(org, worker, "boom #fail #complete"))
    async with stack.db.read() as conn:
        assistant = await conn.scalar(
            sa.select(sa.func.count()).where(t.messages.c.role == "assistant")
        )
        status = await conn.scalar(
            sa.select(t.work_items.c.status).where(t.work_items.c.agent_id == worker["id"])
        )
    assert assistant == 0, "a failed turn stores no assistant text"
    assert status == "inProgress", "a failed turn signals nothing"
    # the session keeps working afterwards
    assert await stack.turns.run(api_trigger(org, plain, "ok now")) == Reply("Echo: ok now")
