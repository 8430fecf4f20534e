"""OpenAIProvider against the stand-in model server, over real HTTP and SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from leadgate.core.config import ModelSettings
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
from leadgate.turns.providers.openai import OpenAIProvider
from tests.standins.model_server import ModelServer, ScriptedToolCall

KEY = "sk-standin-secret-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]

LOOKUP = ToolSpec(
    name="lookup",
    description="Look something up.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
)


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer(api_key=KEY) as srv:
        yield srv


def make_provider(
    server: ModelServer, *, api_key: str = KEY, timeout_s: float = 2.0, max_retries: int = 0
) -> OpenAIProvider:
    return OpenAIProvider(
        base_url=server.base_url,
        api_key=api_key,
        model="test-model",
        timeout_s=timeout_s,
        max_retries=max_retries,
    )


@pytest.fixture
async def provider(server: ModelServer) -> AsyncIterator[OpenAIProvider]:
    prov = make_provider(server)
    yield prov
    await prov.close()


def ask(text: str = "hello", tools: list[ToolSpec] | None = None) -> ModelRequest:
    return ModelRequest(messages=[ChatMessage("user", text)], tools=tools or [])


async def collect_all(provider: OpenAIProvider, request: ModelRequest) -> list[ModelEvent]:
    return [event async for event in provider.stream(request)]


async def collect(provider: OpenAIProvider, request: ModelRequest) -> list[ModelEvent]:
    """The text and tool-call events (the trailing token counts are checked on their own)."""
    return [e for e in await collect_all(provider, request) if not isinstance(e, Usage)]


async def failure(provider: OpenAIProvider, request: ModelRequest) -> ModelError:
    """Run the request, expect a ModelError, and check that it does not leak the key."""
    with pytest.raises(ModelError) as info:
        await collect(provider, request)
    err = info.value
    assert KEY not in str(err)
    assert KEY not in repr(err)
    assert KEY not in json.dumps(err.to_dict())
    # The SDK exception (which holds the request and its headers) is not chained.
    assert err.__cause__ is None
    return err


def texts(events: list[ModelEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta)]


def calls(events: list[ModelEvent]) -> list[ToolCall]:
    return [e for e in events if isinstance(e, ToolCall)]


# ---------------------------------------------------------------------- streaming


async def test_text_streams_as_several_deltas_in_order(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    server.push_text("The quick brown fox jumps.", pieces=4)

    events = await collect_all(provider, ask())

    # Four deltas, then the server's own token counts, passed through unchanged.
    assert len(events) == 5
    assert all(isinstance(e, TextDelta) for e in events[:4])
    assert events[4] == Usage(prompt_tokens=1, completion_tokens=1)
    assert "".join(texts(events)) == "The quick brown fox jumps."
    body = server.last_request
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "test-model"
    assert server.headers[-1]["Authorization"] == f"Bearer {KEY}"


async def test_deltas_are_yielded_before_the_stream_ends(server: ModelServer) -> None:
    # The server sends text, then stalls: the text must reach us before the timeout.
    server.push_hang(after_text="partial answer")
    # The timeout bounds the connect and each wait for bytes, the first chunk included:
    # 0.3 s failed once in a full CI run on a busy 2-core VM (nothing had arrived yet).
    provider = make_provider(server, timeout_s=1.0)
    received: list[str] = []
    with pytest.raises(ModelError) as info:
        async for event in provider.stream(ask()):
            assert isinstance(event, TextDelta)
            received.append(event.text)
    assert "".join(received) == "partial answer"
    assert info.value.rule == "model.timeout"
    await provider.close()


async def test_closing_the_stream_early_releases_the_response(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    server.push_text("a long answer that the caller abandons", pieces=8)
    server.push_text("next")

    async with contextlib.aclosing(provider.stream(ask())) as events:
        async for event in events:
            assert event == TextDelta("a lon")
            break

    assert "".join(texts(await collect(provider, ask()))) == "next"


async def test_tool_call_split_over_chunks_is_reassembled(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    args = {"query": 'weather in Paris, "quoted" ünïcode', "limit": 3, "nested": {"a": [1, 2]}}
    server.push_tool_calls([{"name": "lookup", "arguments": args, "id": "call_abc"}], pieces=6)

    events = await collect(provider, ask(tools=[LOOKUP]))

    assert events == [ToolCall(id="call_abc", name="lookup", arguments=args)]


async def test_two_tool_calls_after_text(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_tool_calls(
        [
            ScriptedToolCall("lookup", {"query": "one"}),
            ScriptedToolCall("lookup", {"query": "two", "limit": 2}),
        ],
        text="Let me check both.",
    )

    events = await collect(provider, ask(tools=[LOOKUP]))

    # Text first, tool calls once the stream has finished, in index order.
    assert "".join(texts(events)) == "Let me check both."
    assert isinstance(events[-1], ToolCall) and isinstance(events[-2], ToolCall)
    first, second = calls(events)
    assert (first.name, first.arguments) == ("lookup", {"query": "one"})
    assert (second.name, second.arguments) == ("lookup", {"query": "two", "limit": 2})
    assert first.id and second.id and first.id != second.id
    assert first.arguments_error is None and second.arguments_error is None


async def test_tool_call_without_arguments(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_tool_calls([{"name": "lookup", "arguments": ""}])

    (call,) = calls(await collect(provider, ask(tools=[LOOKUP])))

    assert call.arguments == {} and call.arguments_error is None


# ---------------------------------------------------------------------- tools offered


async def test_no_tools_key_when_no_tools_are_offered(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    await collect(provider, ask())

    assert "tools" not in server.last_request
    assert "tool_choice" not in server.last_request


async def test_offered_tool_schema_is_sent(server: ModelServer, provider: OpenAIProvider) -> None:
    other = ToolSpec("complete_task", "Signal completion.", {"type": "object", "properties": {}})

    await collect(provider, ask(tools=[LOOKUP, other]))

    assert server.last_request["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look something up.",
                "parameters": LOOKUP.parameters,
            },
        },
        {
            "type": "function",
            "function": {
                "name": "complete_task",
                "description": "Signal completion.",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]


# ---------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("raw", "expected"),
    [('{"query": "unterminated', "not valid JSON"), ("[1, 2]", "must be a JSON object")],
)
async def test_bad_arguments_set_arguments_error(
    server: ModelServer, provider: OpenAIProvider, raw: str, expected: str
) -> None:
    server.push_tool_calls(
        [{"name": "lookup", "arguments": raw}, {"name": "lookup", "arguments": {"query": "ok"}}]
    )

    bad, good = calls(await collect(provider, ask(tools=[LOOKUP])))

    assert bad.name == "lookup" and bad.arguments == {}
    assert bad.arguments_error is not None and expected in bad.arguments_error
    assert good.arguments == {"query": "ok"} and good.arguments_error is None


# ---------------------------------------------------------------------- failures


async def test_wrong_api_key_is_a_model_error_without_the_key(server: ModelServer) -> None:
    provider = make_provider(server, api_key=KEY + "-wrong")

    with pytest.raises(ModelError) as info:
        await collect(provider, ask())

    err = info.value
    assert err.rule == "model.auth"
    assert "HTTP 401" in err.message
    assert KEY not in err.message and "wrong" not in err.message
    assert server.pending == 0
    await provider.close()


async def test_server_echoing_the_key_is_redacted(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    server.push_error(401, f"Incorrect API key provided: {KEY}.")

    err = await failure(provider, ask())

    assert err.rule == "model.auth"
    assert "[redacted]" in err.message


async def test_rate_limit(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_error(429, "Rate limit reached for requests", retry_after=0.01)

    err = await failure(provider, ask())

    assert err.rule == "model.rate_limited"
    assert "HTTP 429" in err.message and "Rate limit reached" in err.message
    assert err.status == 502


async def test_rate_limit_is_retried_after_retry_after(server: ModelServer) -> None:
    server.push_error(429, retry_after=0.01)
    server.push_text("after the wait")
    provider = make_provider(server, max_retries=1)

    events = await collect(provider, ask())

    assert "".join(texts(events)) == "after the wait"
    assert len(server.requests) == 2
    await provider.close()


async def test_server_error(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_error(500)

    err = await failure(provider, ask())

    assert err.rule == "model.server_error"
    assert "HTTP 500" in err.message and "request id req_standin" in err.message


async def test_non_json_error_body(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_error(502, body="<html><body>Bad Gateway</body></html>")

    err = await failure(provider, ask())

    assert err.rule == "model.server_error"
    assert "HTTP 502" in err.message


async def test_hang_times_out(server: ModelServer) -> None:
    server.push_hang()
    provider = make_provider(server, timeout_s=0.3)
    started = time.monotonic()

    err = await failure(provider, ask())

    assert err.rule == "model.timeout"
    assert "0.3s" in err.message
    # The timeout (0.3 s), not the hang; with room for a loaded machine's scheduling
    # (1.5 s was within its reach).
    assert time.monotonic() - started < 4.0
    await provider.close()


async def test_connection_drop_before_response(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    server.push_drop()

    err = await failure(provider, ask())

    assert err.rule == "model.unreachable"


async def test_connection_drop_mid_stream(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_drop(after_text="half an ans")
    received: list[str] = []

    with pytest.raises(ModelError) as info:
        async for event in provider.stream(ask()):
            assert isinstance(event, TextDelta)
            received.append(event.text)

    assert "".join(received) == "half an ans"
    assert info.value.rule == "model.unreachable"
    assert "mid-answer" in info.value.message


async def test_nothing_listening() -> None:
    async with ModelServer() as srv:
        base_url = srv.base_url
    provider = OpenAIProvider(base_url=base_url, api_key=KEY, model="m", max_retries=0)

    err = await failure(provider, ask())

    assert err.rule == "model.unreachable"
    await provider.close()


async def test_malformed_stream(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_raw("data: {this is not json\n\ndata: [DONE]\n\n")

    err = await failure(provider, ask())

    assert err.rule == "model.bad_response"


async def test_stream_without_finish_reason_is_truncated(
    server: ModelServer, provider: OpenAIProvider
) -> None:
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
    }
    server.push_raw(f"data: {json.dumps(chunk)}\n\n")

    err = await failure(provider, ask())

    assert err.rule == "model.bad_response"


async def test_error_event_inside_the_stream(server: ModelServer, provider: OpenAIProvider) -> None:
    server.push_raw('data: {"error": {"message": "engine overloaded", "type": "server_error"}}\n\n')

    err = await failure(provider, ask())

    assert err.rule == "model.server_error"
    assert "engine overloaded" in err.message


# ---------------------------------------------------------------------- messages


async def test_message_conversion_round_trip(server: ModelServer, provider: OpenAIProvider) -> None:
    call = ToolCall(id="call_1", name="lookup", arguments={"query": "x"})
    messages = [
        ChatMessage("system", "You are a worker."),
        ChatMessage("user", "Find x."),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", '{"result": 42}', tool_call_id="call_1"),
        ChatMessage("assistant", "It is 42."),
        ChatMessage("user", "Thanks."),
    ]

    await collect(provider, ModelRequest(messages=messages, tools=[LOOKUP]))

    assert server.last_request["messages"] == [
        {"role": "system", "content": "You are a worker."},
        {"role": "user", "content": "Find x."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"query": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 42}'},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "Thanks."},
    ]


async def test_two_rounds_with_tool_results(server: ModelServer, provider: OpenAIProvider) -> None:
    # Round 1: the model calls a tool; round 2: the tool result goes back as the
    # turn path would append it, and the model answers.
    server.push_tool_calls([{"name": "lookup", "arguments": {"query": "x"}}], text="Looking.")
    server.push_text("Found it.")
    history = [ChatMessage("user", "Find x.")]

    first = await collect(provider, ModelRequest(messages=history, tools=[LOOKUP]))
    (call,) = calls(first)
    history += [
        ChatMessage("assistant", "".join(texts(first)), tool_calls=(call,)),
        ChatMessage("tool", "x is 1", tool_call_id=call.id),
    ]
    second = await collect(provider, ModelRequest(messages=history, tools=[LOOKUP]))

    assert "".join(texts(second)) == "Found it."
    sent = server.requests[1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.id
    assert sent[1]["content"] == "Looking."
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "x is 1"}


async def test_tool_message_without_id_is_refused(provider: OpenAIProvider) -> None:
    request = ModelRequest(messages=[ChatMessage("tool", "orphan")])

    with pytest.raises(ModelError):
        await collect(provider, request)


# ---------------------------------------------------------------------- construction


async def test_from_settings(server: ModelServer) -> None:
    settings = ModelSettings(
        provider="openai", base_url=server.base_url, api_key=KEY, model="gpt-x", timeout_s=5
    )
    provider = OpenAIProvider.from_settings(settings, max_retries=0)

    events = await collect(provider, ask())

    assert "".join(texts(events)) == server.default_text
    assert server.last_request["model"] == "gpt-x"
    await provider.close()


async def test_keyless_server() -> None:
    # Ollama / vLLM without --api-key: an empty key in the config must still work.
    async with ModelServer() as srv:
        provider = OpenAIProvider(base_url=srv.base_url, api_key="", model="llama")
        events = await collect(provider, ask())
        await provider.close()
    assert texts(events)


async def test_injected_client_is_not_closed(server: ModelServer) -> None:
    client = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    provider = OpenAIProvider(base_url=server.base_url, api_key=KEY, model="m", client=client)

    await provider.close()

    assert not client.is_closed()
    await client.close()


# ---------------------------------------------------------------------- the stand-in


async def test_standin_splits_tool_arguments_like_openai(server: ModelServer) -> None:
    server.push_tool_calls([{"name": "lookup", "arguments": {"query": "abcdefghij"}}], pieces=4)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server.base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        assert resp.status == 200
        raw = (await resp.text()).strip().split("\n\n")
    assert raw[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in raw[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    header = deltas[0]["tool_calls"][0]
    assert deltas[0]["role"] == "assistant"
    assert header["index"] == 0 and header["id"] and header["function"]["name"] == "lookup"
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:-1]]
    assert len(fragments) == 4
    assert json.loads("".join(fragments)) == {"query": "abcdefghij"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_standin_non_streaming_with_official_client(server: ModelServer) -> None:
    server.push_tool_calls([{"name": "lookup", "arguments": {"query": "q"}}])
    server.push_error(429, retry_after=0.01)
    async with AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0) as client:
        done = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        tool_call = choice.message.tool_calls[0]
        assert tool_call.type == "function"
        assert json.loads(tool_call.function.arguments) == {"query": "q"}
        with pytest.raises(Exception, match="429") as info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        assert type(info.value).__name__ == "RateLimitError"


async def test_standin_rejects_missing_key(server: ModelServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.base_url}/chat/completions", json={}) as resp:
            assert resp.status == 401
            envelope: dict[str, Any] = await resp.json()
    assert envelope["error"]["type"] == "invalid_request_error"
    assert len(server.requests) == 1


async def test_standin_as_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.standins.model_server",
        "--port",
        "0",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode().split()
        assert line[0] == "LISTENING"
        base_url = f"http://127.0.0.1:{int(line[1])}/v1"
        async with AsyncOpenAI(base_url=base_url, api_key="any", max_retries=0) as client:
            done = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi there"}]
            )
            assert done.choices[0].message.content == "Echo: hi there"

            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "please #complete"}],
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "complete_task", "parameters": {"type": "object"}},
                    }
                ],
                stream=True,
            )
            text, arguments = "", ""
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    for fragment in choice.delta.tool_calls or ():
                        assert fragment.function is not None
                        arguments += fragment.function.arguments or ""
            assert text == "Echo: please #complete"
            assert json.loads(arguments) == {"summary": "Summary: please"}

        # Scripting across the process boundary, then through the provider.
        async with aiohttp.ClientSession() as session:
            push = {"kind": "text", "text": "scripted reply"}
            async with session.post(f"{base_url[:-3]}/_standin/push", json=push) as resp:
                assert resp.status == 200
            provider = OpenAIProvider(base_url=base_url, api_key="", model="m", max_retries=0)
            events = await collect(provider, ask())
            await provider.close()
            assert "".join(texts(events)) == "scripted reply"
            async with session.get(f"{base_url[:-3]}/_standin/requests") as resp:
                recorded = await resp.json()
            assert len(recorded) == 3
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 5) == 0


async def test_standin_echo_mode_mirrors_the_script_model() -> None:
    verdict_tool = ToolSpec("submit_lead_review", "Verdict.", {"type": "object"})
    complete = ToolSpec("complete_task", "Done.", {"type": "object"})

    def lead(context: str, revision: int) -> ModelRequest:
        envelope = json.dumps({"taskContext": context, "revision": revision})
        return ModelRequest(
            messages=[ChatMessage("system", "You review."), ChatMessage("user", envelope)],
            tools=[verdict_tool],
            purpose="lead",
        )

    async with ModelServer(empty_reply="echo") as srv:
        provider = OpenAIProvider(base_url=srv.base_url, api_key="", model="m", max_retries=0)
        verdicts = []
        for context, revision in [("ok", 0), ("#escalate", 0), ("#revise", 0), ("#revise", 1)]:
            (call,) = calls(await collect(provider, lead(context, revision)))
            verdicts.append(call.arguments)
        worker = await collect(provider, ask("ship it #complete", tools=[complete]))
        after_tool = await collect(
            provider,
            ModelRequest(
                messages=[
                    ChatMessage("user", "x"),
                    ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "complete_task", {}),)),
                    ChatMessage("tool", "ok", tool_call_id="c1"),
                ]
            ),
        )
        received: list[str] = []
        with pytest.raises(ModelError):
            async for event in provider.stream(ask("boom #fail")):
                assert isinstance(event, TextDelta)
                received.append(event.text)
        await provider.close()

    assert verdicts == [
        {"verdict": "approved"},
        {"verdict": "escalated", "feedback": "Needs a human."},
        {"verdict": "changesRequested", "feedback": "Please revise."},
        {"verdict": "approved"},
    ]
    assert "".join(texts(worker)) == "Echo: ship it #complete"
    assert calls(worker)[0].arguments == {"summary": "Summary: ship it"}
    assert after_tool == []
    assert "".join(received) == "Echo: boom #fail"[:16]


async def test_wait_for_requests(server: ModelServer, provider: OpenAIProvider) -> None:
    task = asyncio.create_task(collect(provider, ask()))
    await server.wait_for_requests(1, within_s=2.0)
    await task
    with pytest.raises(TimeoutError):
        await server.wait_for_requests(2, within_s=0.05)
