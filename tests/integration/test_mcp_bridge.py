"""The hosted MCP surface (SPEC 8) through a real aiohttp server and the official client.

``send_message`` is an in-test fake: this checks the surface (auth, the ASGI bridge, the
tool's schema and its exact result mapping), not the turn path behind it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import jsonschema
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from mcp import ClientSession
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent

from leadgate.core.auth import Principal, Scope
from leadgate.core.errors import NotFound, PermissionDenied
from leadgate.core.types import Busy, Duplicate, Gated, Outcome, Reply
from leadgate.web.mcp import mount_mcp
from tests.helpers import eventually, mcp_initialize

GENERIC = "The operation could not be completed. Try again."

KEYS = {
    "key-a": Principal(org_id="org-a", scopes=frozenset({Scope.trigger}), key_id="ka"),
    "key-b": Principal(org_id="org-b", scopes=frozenset({Scope.trigger}), key_id="kb"),
    "key-review-only": Principal(org_id="org-a", scopes=frozenset({Scope.review}), key_id="kr"),
}


@dataclass
class Call:
    principal: Principal
    agent: str
    message: str
    session: str | None


@dataclass
class FakeCore:
    """Stands in for the turn path: the outcome is chosen by the message text."""

    calls: list[Call] = field(default_factory=list)

    async def send_message(
        self, principal: Principal, agent: str, message: str, session: str | None
    ) -> Outcome:
        self.calls.append(Call(principal, agent, message, session))
        if agent == "ghost":
            raise NotFound("no agent named ghost")
        if message == "forbidden":
            raise PermissionDenied("this agent is not yours")
        if message == "crash":
            raise RuntimeError("database password is hunter2")
        if message == "gated":
            return Gated(work_item_id="wi-secret-123", revision=2)
        if message == "busy":
            return Busy(work_item_id="wi-secret-123")
        if message == "duplicate":
            return Duplicate()
        return Reply(f"{principal.org_id} says: {message}")


async def authenticate(key: str) -> Principal | None:
    return KEYS.get(key)


@dataclass
class Served:
    url: str
    core: FakeCore
    runner: web.AppRunner
    # Requests whose aiohttp handler has not returned yet (open SSE streams included).
    active: list[web.Request] = field(default_factory=list)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serving() as served:
        yield served


@dataclass
class SlowKeyCheck:
    """The key check of a loaded server (its database read waiting for a connection):
    the next ``hold`` checks wait until ``release`` is set; ``entered`` is set once one
    waits."""

    hold: int = 0
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, key: str) -> Principal | None:
        if self.hold:
            self.hold -= 1
            self.entered.set()
            await self.release.wait()
        return await authenticate(key)


@asynccontextmanager
async def serving(
    check_key: Callable[[str], Awaitable[Principal | None]] = authenticate, **mount_options: Any
) -> AsyncIterator[Served]:
    # Bind first so allowed_hosts can name the real port, as the service does from its config.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    core = FakeCore()
    active: list[web.Request] = []

    @web.middleware
    async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
        active.append(request)
        try:
            return await handler(request)
        finally:
            active.remove(request)

    app = web.Application(middlewares=[track])
    mcp = mount_mcp(
        app,
        authenticate=check_key,
        send_message=core.send_message,
        allowed_hosts=[f"127.0.0.1:{port}", f"localhost:{port}"],
        **mount_options,
    )

    async def run_mcp(_app: web.Application) -> AsyncIterator[None]:
        async with mcp.run():
            yield

    async def release(_app: web.Application) -> None:
        mcp.release_streams()

    # As the composition root does: the session manager runs with the app, and open GET
    # streams are released when shutdown starts.
    app.cleanup_ctx.append(run_mcp)
    app.on_shutdown.append(release)
    runner = web.AppRunner(app, shutdown_timeout=5)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    served = Served(url=f"http://127.0.0.1:{port}/mcp", core=core, runner=runner, active=active)
    try:
        yield served
    finally:
        await runner.cleanup()


@asynccontextmanager
async def mcp_session(url: str, key: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def only_text(result: CallToolResult) -> str:
    assert len(result.content) == 1
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


async def test_lists_exactly_the_one_tool(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        tools = (await session.list_tools()).tools
    assert [tool.name for tool in tools] == ["send_action_agent_message"]
    tool = tools[0]
    assert tool.description and "agent" in tool.description
    # What the model driving the client reads before it sends a lost call again.
    assert "ends without any result" in tool.description
    assert "read the session's transcript" in tool.description
    props = tool.input_schema["properties"]
    assert set(props) == {"agent", "message", "session"}
    assert set(tool.input_schema["required"]) == {"agent", "message"}
    # The declared output schema admits both public shapes, including the nulls.
    assert tool.output_schema is not None
    reply = {"success": True, "result": {"leadReviewPending": False, "text": "hi"}}
    gated = {
        "success": True,
        "result": {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None},
    }
    jsonschema.validate(reply, tool.output_schema)
    jsonschema.validate(gated, tool.output_schema)
    leaked = {"success": True, "result": {**gated["result"], "workItemId": "wi-1"}}  # type: ignore[dict-item]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(leaked, tool.output_schema)


async def test_an_unknown_tool_is_a_tool_error_naming_its_rule(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool("send_message", {"agent": "writer", "message": "hi"})
    assert result.is_error is True
    assert only_text(result) == "Unknown tool: 'send_message'"
    assert result.meta == {"rule": "tool.unknown"}
    assert served.core.calls == []


async def test_reply_is_plain_success(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "hello"}
        )
    assert result.is_error is False
    assert result.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "org-a says: hello"},
    }
    assert served.core.calls == [Call(KEYS["key-a"], "writer", "hello", None)]


async def test_gated_hides_ids(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "gated", "session": "s1"}
        )
    assert result.is_error is False
    assert result.structured_content == {
        "success": True,
        "result": {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None},
    }
    assert "wi-secret" not in result.model_dump_json()
    assert served.core.calls == [Call(KEYS["key-a"], "writer", "gated", "s1")]


@pytest.mark.parametrize("message", ["busy", "duplicate"])
async def test_busy_and_duplicate_are_the_generic_error(served: Served, message: str) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": message, "session": "s1"}
        )
    assert result.is_error is True
    assert only_text(result) == GENERIC
    assert result.structured_content is None
    # The rule rides in _meta, as every other surface's error names one (it named none).
    assert result.meta == {"rule": "turn.busy"}
    dumped = result.model_dump_json()
    assert "LEAD_REVIEW_PENDING" not in dumped
    assert "wi-secret" not in dumped


async def test_engine_errors_keep_their_message(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        missing = await session.call_tool(
            "send_action_agent_message", {"agent": "ghost", "message": "hi"}
        )
        denied = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "forbidden"}
        )
    assert missing.is_error is True
    assert only_text(missing) == "no agent named ghost"
    assert missing.meta == {"rule": "not_found"}
    assert denied.is_error is True
    assert only_text(denied) == "this agent is not yours"
    assert denied.meta == {"rule": "forbidden"}


async def test_unexpected_error_leaks_nothing(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "crash"}
        )
    assert result.is_error is True
    assert only_text(result) == GENERIC
    assert result.meta == {"rule": "internal"}
    assert "hunter2" not in result.model_dump_json()
    # The traceback goes to the log for the operator.
    assert any(rec.exc_info and "hunter2" in str(rec.exc_info[1]) for rec in caplog.records)


async def test_missing_scope_names_it(served: Served) -> None:
    async with mcp_session(served.url, "key-review-only") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "hello"}
        )
    assert result.is_error is True
    assert "agent:trigger" in only_text(result)
    assert result.meta == {"rule": "scope.agent:trigger"}
    assert served.core.calls == []


@pytest.mark.parametrize(
    ("arguments", "expected", "rule"),
    [
        ({"agent": "writer", "message": ""}, "message must not be empty", "message.empty"),
        ({"agent": "writer", "message": "   "}, "message must not be empty", "message.empty"),
        (
            {"agent": "writer", "message": "x" * 100_001},
            "longer than 100,000 characters",
            "message.too_long",
        ),
        ({"agent": " ", "message": "hello"}, "agent", "mcp.agent.empty"),
        ({"agent": "writer", "message": 5}, "message: Input should be", "tool.arguments"),
    ],
)
async def test_invalid_arguments_are_tool_errors(
    served: Served, arguments: dict[str, Any], expected: str, rule: str
) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool("send_action_agent_message", arguments)
    assert result.is_error is True
    assert expected in only_text(result)
    assert result.meta == {"rule": rule}
    assert served.core.calls == []


async def test_a_body_failing_the_json_checks_is_a_jsonrpc_error_the_client_matches(
    served: Served,
) -> None:
    """NUL, a lone surrogate or deep nesting are refused before the SDK sees the body,
    as JSON-RPC errors naming the rule (it was the REST envelope, which the client could
    only report as "Server returned an error response")."""
    async with mcp_session(served.url, "key-a") as session:
        with pytest.raises(MCPError) as refused:
            await session.call_tool(
                "send_action_agent_message", {"agent": "writer", "message": "a\x00b"}
            )
        assert refused.value.error.code == -32602
        assert refused.value.error.message.endswith("[body.nul]"), refused.value.error
        # The session goes on.
        after = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "hi"}
        )
        assert after.is_error is False and "org-a says: hi" in only_text(after)
    assert [call.message for call in served.core.calls] == ["hi"]
    headers = {
        "Authorization": "Bearer key-a",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    deep = '{"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"x": ' + "[" * 80 + "]" * 80
    async with httpx2.AsyncClient() as http:
        for body, code, rule, request_id in [
            ("{nope", -32700, "body.json", None),
            (
                '{"jsonrpc": "2.0", "id": "s", "method": "ping", "params": {"x": "\\ud800"}}',
                -32602,
                "body.surrogate",
                "s",
            ),
            (deep + "}}", -32602, "body.depth", 7),
        ]:
            answer = await http.post(served.url, content=body, headers=headers)
            assert answer.status_code == 400
            assert answer.headers["content-type"].startswith("application/json")
            got = answer.json()
            assert (got["jsonrpc"], got["id"], got["error"]["code"]) == ("2.0", request_id, code)
            assert got["error"]["data"] == {"rule": rule}


async def test_a_body_over_the_size_limit_is_a_jsonrpc_error_the_client_matches(
    served: Served,
) -> None:
    """A tool call whose message makes the body larger than the limit is refused as
    JSON-RPC (HTTP 413) naming ``body.size``, which the official client reports on the
    call; it was the REST envelope, reported as -32603 "Server returned an error response"
    with no rule. The session goes on."""
    async with mcp_session(served.url, "key-a") as session:
        with pytest.raises(MCPError) as refused:
            await session.call_tool(
                "send_action_agent_message", {"agent": "writer", "message": "x" * 2_000_000}
            )
        assert refused.value.error.code == -32602
        assert refused.value.error.message.endswith("[body.size]"), refused.value.error
        assert refused.value.error.data == {"rule": "body.size"}
        after = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "hi"}
        )
        assert after.is_error is False and "org-a says: hi" in only_text(after)
    assert [call.message for call in served.core.calls] == ["hi"]


async def test_sessions_past_the_limit_are_503_with_retry_after() -> None:
    """At most ``max_sessions`` are open; the next initialize is a 503 that says when to
    try again, like every other 503 of the service (the SDK's own answer had no
    ``Retry-After``), and a closed session makes room."""
    async with serving(max_sessions=2) as served:
        async with mcp_session(served.url, "key-a"), mcp_session(served.url, "key-a"):
            async with httpx2.AsyncClient() as http:
                answer = await http.post(
                    served.url,
                    json=mcp_initialize(),
                    headers={
                        "Authorization": "Bearer key-a",
                        "Accept": "application/json, text/event-stream",
                    },
                )
            assert answer.status_code == 503, answer.text
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.json()["error"]["code"] == -32603
        async with mcp_session(served.url, "key-a") as session:  # room again
            await session.send_ping()


#: The idle timeout of the test below. The SDK counts it on the event loop's clock, which
#: no fake clock reaches, so the test waits it out; long enough for the requests between
#: ``initialize`` and the held one to come within it on a loaded machine.
IDLE_S = 2.0


async def test_a_session_is_not_ended_while_a_request_of_it_is_authenticated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The SDK's idle timer counts a request from when the SDK gets it, after the key
    check: a session whose request waited on a slow check longer than the idle timeout
    was ended under it, and the request answered 404 ``mcp.session``. It is held from
    the request's arrival now, and its countdown runs again once none is in flight,
    also after a request that held it and was refused."""
    caplog.set_level(logging.INFO, logger="mcp.server.streamable_http_manager")
    check = SlowKeyCheck()
    accept = {"Authorization": "Bearer key-a", "Accept": "application/json, text/event-stream"}

    def ping(number: int) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": number, "method": "ping"}

    async with (
        serving(check, session_idle_s=IDLE_S) as served,
        httpx2.AsyncClient(timeout=30) as http,
    ):
        opened = await http.post(served.url, json=mcp_initialize(), headers=accept)
        assert opened.status_code == 200
        sid = {
            **accept,
            "Mcp-Session-Id": opened.headers["mcp-session-id"],
            "Mcp-Protocol-Version": "2025-06-18",
        }
        check.hold = 1
        held = asyncio.create_task(http.post(served.url, json=ping(2), headers=sid))
        await check.entered.wait()
        # Another request of the session comes and goes meanwhile: as it leaves, the
        # SDK starts the countdown again (it does not know of the held one).
        assert (await http.post(served.url, json=ping(3), headers=sid)).status_code == 200
        await asyncio.sleep(IDLE_S * 1.5)
        check.release.set()
        answer = await held
        assert answer.status_code == 200, answer.text
        assert (await http.post(served.url, json=ping(4), headers=sid)).status_code == 200
        assert "idle timeout" not in caplog.text

        refused = await http.post(
            served.url, json=ping(5), headers={**sid, "Authorization": "Bearer unknown"}
        )
        assert refused.status_code == 401
        await eventually(lambda: "idle timeout" in caplog.text, within=IDLE_S * 3)
        assert (await http.post(served.url, json=ping(6), headers=sid)).status_code == 404


async def test_the_sdks_jsonrpc_refusals_name_their_rule() -> None:
    """The SDK answers some refusals itself, in JSON-RPC (an unknown session id, a
    request without one, an Accept it cannot answer, the session limit, a method it
    lacks): they named no
    rule, unlike every other refusal of the service. Now ``error.data`` names it, as the
    service's own JSON-RPC refusals do, and the rest of the answer is the SDK's."""
    accept = {"Authorization": "Bearer key-a", "Accept": "application/json, text/event-stream"}
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    async with serving(max_sessions=1) as served, httpx2.AsyncClient() as http:
        answers = {
            "mcp.session": await http.post(
                served.url,
                json=ping,
                headers={**accept, "Mcp-Session-Id": "nope", "Mcp-Protocol-Version": "2025-06-18"},
            ),
            "mcp.session_id": await http.post(served.url, json=ping, headers=accept),
            "mcp.accept": await http.post(
                served.url, json=mcp_initialize(), headers={**accept, "Accept": "text/html"}
            ),
        }
        # 2026-07-28: a method the server lacks is a 404, as an unknown session is.
        meta = {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        answers["mcp.method"] = await http.post(
            served.url,
            json={
                "jsonrpc": "2.0",
                "id": 3,
                "method": "prompts/get",
                "params": {"name": "x", "_meta": meta},
            },
            headers={
                **accept,
                "Mcp-Protocol-Version": "2026-07-28",
                "Mcp-Method": "prompts/get",
                "Mcp-Name": "x",
            },
        )
        opened = await http.post(served.url, json=mcp_initialize(), headers=accept)
        assert opened.status_code == 200
        answers["mcp.sessions"] = await http.post(served.url, json=mcp_initialize(), headers=accept)
    for rule, answer in answers.items():
        assert 400 <= answer.status_code < 600 and answer.status_code != 500, rule
        assert answer.headers["content-type"].startswith("application/json"), rule
        got = answer.json()
        assert got["jsonrpc"] == "2.0" and isinstance(got["error"]["code"], int), rule
        assert got["error"]["data"] == {"rule": rule}, (rule, got)
        # A refused opening request names no session: the SDK discarded the one it made.
        assert "mcp-session-id" not in answer.headers, rule
    assert answers["mcp.session"].status_code == 404
    # It named mcp.session: the 404 was taken for an unknown session.
    assert answers["mcp.method"].json()["error"]["code"] == -32601
    assert answers["mcp.sessions"].status_code == 503
    assert int(answers["mcp.sessions"].headers["Retry-After"]) >= 1


async def test_json_that_is_no_jsonrpc_message_leaks_no_validation_dump(
    served: Served,
) -> None:
    """The SDK answered it with pydantic's dump: its version (errors.pydantic.dev/2.x),
    the SDK's class names and every value sent, echoed back."""
    headers = {
        "Authorization": "Bearer key-a",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    async with httpx2.AsyncClient() as http:
        for body in (
            {"api_key": "sk-secret-echo"},
            [{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": "sk-secret-echo"}],
        ):
            answer = await http.post(served.url, json=body, headers=headers)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["data"] == {"rule": "mcp.message"}
            assert error["message"].startswith("the body is not a JSON-RPC 2.0 message")
            for leak in ("secret", "pydantic", "JSONRPCRequest", "input_value"):
                assert leak not in answer.text, leak
    assert served.core.calls == []


async def test_longest_message_is_accepted(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "x" * 100_000}
        )
    assert result.is_error is False
    assert len(served.core.calls[0].message) == 100_000


async def test_each_org_gets_its_own_principal(served: Served) -> None:
    async with (
        mcp_session(served.url, "key-a") as session_a,
        mcp_session(served.url, "key-b") as session_b,
    ):
        result_b = await session_b.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "one", "session": "x"}
        )
        result_a = await session_a.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "two", "session": "x"}
        )
    assert result_a.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "org-a says: two"},
    }
    assert result_b.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "org-b says: one"},
    }
    assert served.core.calls == [
        Call(KEYS["key-b"], "writer", "one", "x"),
        Call(KEYS["key-a"], "writer", "two", "x"),
    ]


async def test_mcp_session_is_bound_to_its_creator(served: Served) -> None:
    init = mcp_initialize("2025-11-25")
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        opened = await http.post(
            served.url, json=init, headers={**headers, "Authorization": "Bearer key-a"}
        )
        assert opened.status_code == 200
        session_id = opened.headers["mcp-session-id"]
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        hijack = await http.post(
            served.url,
            json=ping,
            headers={
                **headers,
                "Authorization": "Bearer key-b",
                "Mcp-Session-Id": session_id,
                "Mcp-Protocol-Version": "2025-11-25",
            },
        )
        assert hijack.status_code == 404
        await http.delete(
            served.url, headers={"Authorization": "Bearer key-a", "Mcp-Session-Id": session_id}
        )


async def test_newest_client_default_mode_works(served: Served) -> None:
    # mcp.Client defaults to mode="auto": it probes the 2026 per-request protocol first,
    # which the SDK serves on a different path than the initialize handshake.
    async with (
        httpx2.AsyncClient(headers={"Authorization": "Bearer key-b"}) as http,
        Client(streamable_http_client(served.url, http_client=http)) as client,
    ):
        result = await client.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "modern"}
        )
    assert result.structured_content == {
        "success": True,
        "result": {"leadReviewPending": False, "text": "org-b says: modern"},
    }
    assert served.core.calls == [Call(KEYS["key-b"], "writer", "modern", None)]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": "Basic a2V5LWE6"},
        {"Authorization": "Bearer"},
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
async def test_unauthenticated_is_401(served: Served, headers: dict[str, str], method: str) -> None:
    async with httpx2.AsyncClient() as http:
        response = await http.request(
            method,
            served.url,
            headers={**headers, "Accept": "application/json, text/event-stream"},
            content=b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}',
        )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json() == {
        "error": {
            "message": "Missing or unknown API key.",
            "type": "authentication_error",
            "param": None,
            "code": "unauthorized",
            "rule": "auth.key",
        }
    }
    assert served.core.calls == []


async def test_unknown_host_is_refused(served: Served) -> None:
    async with httpx2.AsyncClient() as http:

        async def ping(**extra: str) -> httpx2.Response:
            headers = {
                "Authorization": "Bearer key-a",
                "Accept": "application/json, text/event-stream",
                **extra,
            }
            body = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            return await http.post(served.url, headers=headers, json=body)

        response = await ping(Host="evil.example")
        assert response.status_code == 421
        # The SDK's plain-text refusals come in the envelope of every other HTTP error.
        assert response.json()["error"] == {
            "message": "Invalid Host header",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
            "rule": "mcp.host",
        }
        foreign = await ping(Origin="https://evil.example")
        assert foreign.status_code == 403
        assert foreign.headers["Content-Type"].startswith("application/json")
        assert foreign.json()["error"]["rule"] == "mcp.origin"


async def test_no_spin_and_quick_shutdown_after_disconnect(served: Served) -> None:
    async with mcp_session(served.url, "key-a") as session:
        await session.call_tool("send_action_agent_message", {"agent": "w", "message": "hi"})
    # The client has gone (its GET stream too). An idle server must not burn CPU...
    cpu_before = time.process_time()
    await asyncio.sleep(1.0)
    assert time.process_time() - cpu_before < 0.3
    # ...and must stop promptly: under the runner's 5 s shutdown timeout (2 s was within
    # a loaded machine's reach).
    started = time.monotonic()
    await served.runner.cleanup()
    assert time.monotonic() - started < 4.0


async def test_streams_of_a_vanished_client_end(served: Served) -> None:
    # A client that disappears without DELETE (crash, network loss) leaves its GET stream
    # behind; the bridge must notice the closed socket and let the handler return.
    async with (
        httpx2.AsyncClient(headers={"Authorization": "Bearer key-a"}) as http,
        streamable_http_client(served.url, http_client=http, terminate_on_close=False) as (
            read,
            write,
        ),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        await session.call_tool("send_action_agent_message", {"agent": "w", "message": "hi"})
        # The client opens its standalone GET stream after initialize.
        await eventually(lambda: any(r.method == "GET" for r in served.active))
    # No DELETE was sent: only the closed socket tells the server that the client left.
    await eventually(lambda: not served.active, within=3.0)
    cpu_before = time.process_time()
    await asyncio.sleep(1.0)
    assert time.process_time() - cpu_before < 0.3


async def test_quick_shutdown_while_a_client_stays_connected(served: Served) -> None:
    # A connected client keeps its standalone GET stream open; shutdown must release it
    # instead of waiting for aiohttp's shutdown timeout.
    async with mcp_session(served.url, "key-a") as session:
        await session.list_tools()
        cpu_before = time.process_time()
        await asyncio.sleep(1.0)
        assert time.process_time() - cpu_before < 0.3
        started = time.monotonic()
        await served.runner.cleanup()
        # Under the runner's 5 s shutdown timeout a held stream would wait out; 2 s was
        # within a loaded machine's reach.
        assert time.monotonic() - started < 4.0


async def test_an_answered_post_is_not_kept_while_its_mcp_session_lives(served: Served) -> None:
    """The SDK keeps the ASGI request of a session's last message (its scope and
    receive()) for as long as the session lives. The scope held the aiohttp request and
    receive() the request, its key's re-check and its whole body: every idle session
    kept its last POST, transport and buffers included, until it ended."""
    host = served.url.split("/")[2]

    def kept() -> list[web.BaseRequest]:
        gc.collect()
        return [
            o
            for o in gc.get_objects()
            if isinstance(o, web.BaseRequest) and o.method == "POST" and o.host == host
        ]

    async with mcp_session(served.url, "key-a") as session:
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "x" * 50_000}
        )
        assert result.is_error is False
        await eventually(lambda: not [r for r in served.active if r.method == "POST"])
        await eventually(lambda: kept() == [], what="no POST request kept alive")
        # The session lives on.
        again = await session.call_tool(
            "send_action_agent_message", {"agent": "writer", "message": "again"}
        )
        assert again.is_error is False
