"""A name a client sends that names nothing (an agent, through REST's ``model`` or the
MCP tool's ``agent``) is quoted in the refusal, at most its first characters: 5,000
characters sent came back whole in the error text (bounded only by the body limit)."""

from __future__ import annotations

import httpx2
import openai
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from leadgate.core.errors import QUOTE_LIMIT
from tests.helpers import make_agent, make_org
from tests.serving import served_app

LONG = "ghost-\x07" + "x" * 4_993  # a control character escaped, not sent back
TOOL = "send_action_agent_message"


def assert_short_quote(text: str) -> None:
    """``text`` names the name's head and its length, not the name whole."""
    assert len(text) < QUOTE_LIMIT + 100, text
    assert "'ghost-\\x07xxx" in text and "(5,000 characters)" in text
    assert "\x07" not in text


async def test_a_long_unknown_model_is_a_short_404_naming_the_rule(migrated_url: str) -> None:
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        official = openai.AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=org.key, max_retries=0
        )
        async with official:
            with pytest.raises(openai.NotFoundError) as raised:
                await official.chat.completions.create(
                    model=LONG, messages=[{"role": "user", "content": "hi"}]
                )
    body = raised.value.body
    assert isinstance(body, dict) and body["rule"] == "agent.not_found"
    assert_short_quote(str(body["message"]))


async def test_a_long_unknown_agent_is_a_short_tool_error_naming_the_rule(
    migrated_url: str,
) -> None:
    async with served_app(migrated_url, like_production=True) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {org.key}"}) as http,
            streamable_http_client(str(client.make_url("/mcp")), http_client=http) as streams,
            ClientSession(*streams) as session,
        ):
            await session.initialize()
            told = await session.call_tool(TOOL, {"agent": LONG, "message": "hi"})
    assert told.is_error is True
    assert told.meta == {"rule": "agent.not_found"}
    [block] = told.content
    assert isinstance(block, TextContent)
    assert_short_quote(block.text)
