"""SPEC 8: the hosted MCP server of the real service process, with the official client.

The ``mcp`` SDK's streamable HTTP client (httpx2 with the bearer header) talks to ``/mcp``
of a ``leadgate serve`` subprocess; the turns run on the real turn path with the script
model (``#complete`` gates, a ``#escalate`` task keeps the item under review).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent

from tests.helpers import mcp_initialize
from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

TOOL = "send_action_agent_message"
BUSY_TEXT = "The operation could not be completed. Try again."
GATED = {
    "success": True,
    "result": {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None},
}


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, service_guard: Any
) -> Iterator[ServiceProcess]:
    proc = start_from_template(demo_template, tmp_path_factory.mktemp("mcp"))
    with service_guard(proc):
        yield proc


@asynccontextmanager
async def mcp_session(svc: ServiceProcess, key: str | None = None) -> AsyncIterator[ClientSession]:
    assert svc.demo is not None
    headers = {"Authorization": f"Bearer {key or svc.demo.key}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(f"{svc.url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def sid() -> str:
    return f"m-{uuid.uuid4().hex[:16]}"


async def send(
    session: ClientSession, agent: str, message: str, conversation: str | None = None
) -> CallToolResult:
    args: dict[str, Any] = {"agent": agent, "message": message}
    if conversation is not None:
        args["session"] = conversation
    return await session.call_tool(TOOL, args)


def only_text(result: CallToolResult) -> str:
    assert len(result.content) == 1
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


async def test_exactly_one_tool_and_no_operator_tools(svc: ServiceProcess) -> None:
    async with mcp_session(svc) as session:
        tools = (await session.list_tools()).tools
    assert [tool.name for tool in tools] == [TOOL]
    assert set(tools[0].input_schema["properties"]) == {"agent", "message", "session"}
    assert set(tools[0].input_schema["required"]) == {"agent", "message"}


async def test_plain_turn_is_structured_text(svc: ServiceProcess) -> None:
    async with mcp_session(svc) as session:
        plain = await send(session, "plain", "hello mcp")
        lead_worker = await send(session, "worker", "no completion here", sid())
    for result, text in ((plain, "Echo: hello mcp"), (lead_worker, "Echo: no completion here")):
        expected = {"success": True, "result": {"leadReviewPending": False, "text": text}}
        assert result.is_error is False
        assert result.structured_content == expected
        assert json.loads(only_text(result)) == expected


async def test_gated_turn_is_exact_pending_result(svc: ServiceProcess) -> None:
    async with mcp_session(svc) as session:
        result = await send(session, "worker", "do the work #complete", sid())
    assert result.is_error is False
    assert result.structured_content == GATED
    assert json.loads(only_text(result)) == GATED
    dumped = result.model_dump_json()
    assert "wi_" not in dumped and "Echo" not in dumped


async def test_busy_is_the_generic_tool_error(svc: ServiceProcess) -> None:
    conversation = sid()
    async with mcp_session(svc) as session:
        gated = await send(session, "worker", "#escalate this #complete", conversation)
        assert gated.structured_content == GATED
        for _ in range(2):  # escalated: stays awaitingHuman, so stays busy
            busy = await send(session, "worker", "anything new?", conversation)
            assert busy.is_error is True
            assert only_text(busy) == BUSY_TEXT
            assert busy.structured_content is None
            assert "LEAD_REVIEW_PENDING" not in busy.model_dump_json()
        # Another session of the same worker is another work item.
        other = await send(session, "worker", "hi", sid())
    assert other.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "Echo: hi"},
    }


async def test_gated_then_approved_then_the_session_answers_again(svc: ServiceProcess) -> None:
    conversation = sid()
    async with mcp_session(svc) as session:
        assert (
            await send(session, "worker", "ship #complete", conversation)
        ).structured_content == GATED
        deadline = time.monotonic() + 15
        while True:
            result = await send(session, "worker", "next", conversation)
            if not result.is_error:
                break
            assert only_text(result) == BUSY_TEXT
            assert time.monotonic() < deadline, "the lead review never completed"
            await asyncio.sleep(0.1)
    assert result.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "Echo: next"},
    }


async def test_without_or_with_a_bad_key_is_401(svc: ServiceProcess) -> None:
    initialize = mcp_initialize()
    headers = {"Accept": "application/json, text/event-stream"}
    async with aiohttp.ClientSession() as http:
        for auth in (None, "Bearer lg.key_nope.secret", "Basic abc"):
            hdrs = dict(headers)
            if auth:
                hdrs["Authorization"] = auth
            async with http.post(f"{svc.url}/mcp", json=initialize, headers=hdrs) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                body = await resp.json()
                assert "error" in body
    # The official client cannot even initialize (the SDK reports the HTTP error as an
    # MCPError inside its task groups).
    with pytest.raises(BaseException) as info:
        async with (
            httpx2.AsyncClient(timeout=10) as client,
            streamable_http_client(f"{svc.url}/mcp", http_client=client) as (read, write),
            ClientSession(read, write) as session,
        ):
            await asyncio.wait_for(session.initialize(), 10)
    leaves = list(_leaves(info.value))
    assert leaves and all(isinstance(e, MCPError | httpx2.HTTPStatusError) for e in leaves), leaves


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
