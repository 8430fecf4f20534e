"""A name a client sends that names nothing (an agent, through REST's ``model`` or the
MCP tool's ``agent``) is quoted in the refusal, at most its first characters: 5,000
characters sent came back whole in the error text (bounded only by the body limit)."""

from __future__ import annotations

from urllib.parse import quote

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


async def test_a_long_unknown_tool_is_a_short_tool_error_naming_the_rule(
    migrated_url: str,
) -> None:
    async with served_app(migrated_url, like_production=True) as (service, client):
        org = await make_org(service)
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {org.key}"}) as http,
            streamable_http_client(str(client.make_url("/mcp")), http_client=http) as streams,
            ClientSession(*streams) as session,
        ):
            await session.initialize()
            told = await session.call_tool(LONG, {"agent": "plain", "message": "hi"})
    assert told.is_error is True
    assert told.meta == {"rule": "tool.unknown"}
    [block] = told.content
    assert isinstance(block, TextContent)
    assert_short_quote(block.text)


async def test_a_long_id_in_a_url_is_a_short_4xx_naming_the_rule(migrated_url: str) -> None:
    """Every id a REST URL carries (the operator API's work items and deliveries, the
    agents API's agent, the sessions API's agent and session): 5,000 characters sent
    came back whole in ``no work item ...`` and ``no delivery ...``."""
    in_url = quote(LONG, safe="")
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        for method, path, rule in (
            ("GET", f"/operator/reviews/{in_url}", "workItem.not_found"),
            ("POST", f"/operator/reviews/{in_url}/cancel", "workItem.not_found"),
            ("POST", f"/operator/deliveries/{in_url}/retry", "delivery.not_found"),
            ("GET", f"/v1/agents/{in_url}", "agent.not_found"),
            ("GET", f"/v1/agents/{in_url}/sessions/s/messages", "agent.not_found"),
        ):
            resp = await client.request(method, path, headers=auth)
            said = (await resp.json())["error"]
            assert (resp.status, said["rule"]) == (404, rule), (path, said)
            assert_short_quote(said["message"])
        # A session's name is bounded before it is looked up: named by its rule, not echoed.
        resp = await client.get(f"/v1/agents/plain/sessions/{in_url}/messages", headers=auth)
        said = (await resp.json())["error"]
        assert (resp.status, said["rule"]) == (400, "session.length")
        assert "xxxxx" not in said["message"]
