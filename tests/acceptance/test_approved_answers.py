"""Issue 12 against the real ``leadgate serve`` process: approved answers reach REST and MCP
clients, retries never double a message, OpenAI-compatible to the letter.

Official clients with their default settings (``openai`` retries 5xx and connection
errors twice; ``mcp`` 2.x over httpx2 with the bearer header), httpx2 for the SSE stream.
One service for the module; every test uses its own sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import mcp_types as mt
import openai
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.helpers import LEGACY_SUBSCRIBE
from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

TIMEOUT = 30.0
TOOL = "send_action_agent_message"


@dataclass(frozen=True)
class Env:
    proc: ServiceProcess
    key: str  # demo Owner key (every scope)
    other_key: str  # Owner key of another organization

    @property
    def url(self) -> str:
        return self.proc.url

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}


@pytest.fixture(scope="module")
def env(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, service_guard: Any
) -> Iterator[Env]:
    proc = start_from_template(demo_template, tmp_path_factory.mktemp("answers"))
    with service_guard(proc):
        assert proc.demo is not None
        other = proc.admin("org", "create", "elsewhere")
        yield Env(proc, proc.demo.key, other["apiKey"])


def sid() -> str:
    return f"a-{uuid.uuid4().hex[:12]}"


def client(env: Env, key: str | None = None) -> openai.AsyncOpenAI:
    # Default max_retries on purpose (2: three attempts for a 5xx).
    return openai.AsyncOpenAI(base_url=f"{env.url}/v1", api_key=key or env.key, timeout=TIMEOUT)


async def transcript(env: Env, agent: str, session: str) -> list[tuple[str, str]]:
    async with httpx2.AsyncClient(base_url=env.url, headers=env.auth(), timeout=TIMEOUT) as http:
        resp = await http.get(f"/v1/agents/{agent}/sessions/{session}/messages")
    assert resp.status_code == 200, resp.text
    return [(m["role"], m["content"]) for m in resp.json()["data"]]


@dataclass
class EventReader:
    """A background reader of ``/events`` (httpx2 streaming), event by event."""

    env: Env
    agent: str
    session: str
    last_event_id: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        headers = self.env.auth()
        if self.last_event_id is not None:
            headers["Last-Event-ID"] = str(self.last_event_id)
        url = f"{self.env.url}/v1/agents/{self.agent}/sessions/{self.session}/events"
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(TIMEOUT, read=None)) as http,
            http.stream("GET", url, headers=headers) as resp,
        ):
            assert resp.status_code == 200
            fields: dict[str, str] = {}
            async for line in resp.aiter_lines():
                if line.startswith(":"):
                    continue
                if line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                if fields:
                    self.events.append(
                        {
                            "id": int(fields["id"]),
                            "event": fields["event"],
                            "data": json.loads(fields["data"]),
                        }
                    )
                    fields = {}
                    self.arrived.set()

    async def wait_for(self, count: int) -> list[dict[str, Any]]:
        for _ in range(int(TIMEOUT / 0.05)):
            if len(self.events) >= count:
                return self.events[:count]
            await asyncio.sleep(0.05)
        raise AssertionError(f"only {len(self.events)} events: {self.events}")


@asynccontextmanager
async def reading(reader: EventReader) -> AsyncIterator[EventReader]:
    task = asyncio.create_task(reader.run())
    try:
        yield reader
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def operator_item(env: Env, marker: str, status: str) -> str:
    """The id of the work item whose task context holds ``marker`` once it is ``status``
    (operator API, Owner key: agent:review)."""
    async with httpx2.AsyncClient(base_url=env.url, headers=env.auth(), timeout=TIMEOUT) as http:
        for _ in range(int(TIMEOUT / 0.1)):
            activity = (await http.get("/operator/activity")).json()["items"]
            for item in activity:
                detail = (await http.get(f"/operator/reviews/{item['id']}")).json()
                if marker in detail["taskContext"] and detail["status"] == status:
                    return str(item["id"])
            await asyncio.sleep(0.1)
    raise AssertionError(f"no {status} work item with {marker!r}")


async def approve(env: Env, item_id: str) -> None:
    async with httpx2.AsyncClient(base_url=env.url, headers=env.auth(), timeout=TIMEOUT) as http:
        resp = await http.post(f"/operator/reviews/{item_id}/approve")
    assert resp.status_code == 200, resp.text


async def eventually_transcript(
    env: Env, agent: str, session: str, count: int
) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for _ in range(int(TIMEOUT / 0.1)):
        rows = await transcript(env, agent, session)
        if len(rows) >= count:
            return rows
        await asyncio.sleep(0.1)
    raise AssertionError(f"the transcript never reached {count} rows: {rows}")


# ------------------------------------------------------------------------------ REST


async def test_rest_held_answer_reaches_the_transcript_and_the_event_stream(env: Env) -> None:
    s = sid()
    marker = f"publish {s} #escalate #complete"
    async with reading(EventReader(env, "worker", s)) as stream:
        async with client(env) as c:
            with pytest.raises(openai.ConflictError) as gated:
                await c.chat.completions.create(
                    model="worker",
                    messages=[{"role": "user", "content": marker}],
                    extra_headers={"X-Session-Id": s},
                )
        assert gated.value.response.json()["error"]["workItemId"] is None
        # The lead escalates: the item waits for a human; the answer is held.
        item_id = await operator_item(env, s, "awaitingHuman")
        assert await transcript(env, "worker", s) == [("user", marker)]
        first = await stream.wait_for(2)
        assert [(e["event"], e["data"].get("status")) for e in first] == [
            ("message", None),
            ("review", "pending"),
        ]
        await approve(env, item_id)
        rows = await eventually_transcript(env, "worker", s, 2)
        assert rows == [("user", marker), ("assistant", f"Echo: {marker}")]
        events = await stream.wait_for(4)
    assert (events[2]["event"], events[2]["data"]["content"]) == ("message", f"Echo: {marker}")
    assert (events[3]["event"], events[3]["data"]) == ("review", {"status": "delivered"})
    assert item_id not in json.dumps(events)
    # Reconnect where the first reader was after "pending": nothing twice, nothing missed.
    async with reading(EventReader(env, "worker", s, last_event_id=events[1]["id"])) as again:
        resumed = await again.wait_for(2)
        await asyncio.sleep(0.3)  # nothing else arrives
        assert again.events == events[2:4] == resumed


async def test_models_list_with_the_official_client(env: Env) -> None:
    async with client(env) as c:
        models = await c.models.list()
        ids = {m.id for m in models.data}
        assert {"worker", "plain", "lead"} <= ids
        one = await c.models.retrieve("plain")
        assert (one.id, one.object) == ("plain", "model")
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("no-such-agent")
        plain = await c.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "count me"}]
        )
    assert plain.usage is not None and plain.usage.total_tokens > 0
    assert plain.choices[0].message.refusal is None and plain.choices[0].logprobs is None


@pytest.mark.parametrize("agent", ["worker", "plain"])
async def test_a_failing_turn_leaves_its_message_once(env: Env, agent: str) -> None:
    s = sid()
    text = f"{s} will #fail"
    async with client(env) as c:
        with pytest.raises(openai.APIStatusError) as failed:
            await c.chat.completions.create(
                model=agent,
                messages=[{"role": "user", "content": text}],
                extra_headers={"X-Session-Id": s},
            )
    assert failed.value.status_code == 502
    assert failed.value.response.headers["x-should-retry"] == "false"
    assert await transcript(env, agent, s) == [("user", text)]
    if agent == "worker":
        async with httpx2.AsyncClient(
            base_url=env.url, headers=env.auth(), timeout=TIMEOUT
        ) as http:
            activity = (await http.get("/operator/activity")).json()["items"]
            details = [(await http.get(f"/operator/reviews/{i['id']}")).json() for i in activity]
        [mine] = [d for d in details if s in d["taskContext"]]
        assert mine["taskContext"] == text  # once, not three times


async def test_one_idempotency_key_runs_one_turn(env: Env) -> None:
    s = sid()
    headers = {"X-Session-Id": s, "Idempotency-Key": f"key-{s}"}
    async with client(env) as c:
        first = await c.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "once"}], extra_headers=headers
        )
        second = await c.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "once"}], extra_headers=headers
        )
    assert first.id == second.id and first.choices[0].message.content == "Echo: once"
    assert await transcript(env, "plain", s) == [("user", "once"), ("assistant", "Echo: once")]


# ------------------------------------------------------------------------------- MCP


@asynccontextmanager
async def mcp_session(env: Env, updates: list[str]) -> AsyncIterator[ClientSession]:
    async def on_message(message: Any) -> None:
        if isinstance(message, mt.ResourceUpdatedNotification):
            updates.append(str(message.params.uri))

    async with (
        httpx2.AsyncClient(headers=env.auth(), timeout=TIMEOUT) as http,
        streamable_http_client(f"{env.url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write, message_handler=on_message) as session,
    ):
        await session.initialize()
        yield session


@LEGACY_SUBSCRIBE
async def test_mcp_resource_read_and_subscription_update(env: Env) -> None:
    s = sid()
    resource = f"leadgate://agents/worker/sessions/{s}/messages"
    marker = f"draft {s} #escalate #complete"
    updates: list[str] = []
    async with mcp_session(env, updates) as session:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            await session.subscribe_resource(resource)
        result = await session.call_tool(TOOL, {"agent": "worker", "message": marker, "session": s})
        assert result.structured_content == {
            "success": True,
            "result": {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None},
        }
        item_id = await operator_item(env, s, "awaitingHuman")
        read = await session.read_resource(resource)
        content = read.contents[0]
        assert isinstance(content, mt.TextResourceContents)
        assert [m["role"] for m in json.loads(content.text)["data"]] == ["user"]
        seen = len(updates)
        await approve(env, item_id)
        for _ in range(int(TIMEOUT / 0.05)):
            if len(updates) > seen:
                break
            await asyncio.sleep(0.05)
        assert updates[seen:] == [resource]
        read = await session.read_resource(resource)
        content = read.contents[0]
        assert isinstance(content, mt.TextResourceContents)
        page = json.loads(content.text)
        assert [m["content"] for m in page["data"]] == [marker, f"Echo: {marker}"]


# ------------------------------------------------------------------ organizations


async def test_another_organizations_key_gets_404_on_every_new_route(env: Env) -> None:
    s = sid()
    async with client(env) as c:
        await c.chat.completions.create(
            model="plain",
            messages=[{"role": "user", "content": "mine"}],
            extra_headers={"X-Session-Id": s},
        )
    async with httpx2.AsyncClient(base_url=env.url, timeout=TIMEOUT) as http:
        agents = (await http.get("/v1/agents", headers=env.auth())).json()["data"]
        plain_id = next(a["id"] for a in agents if a["slug"] == "plain")
        theirs = env.auth(env.other_key)
        for path in (
            f"/v1/agents/{plain_id}/sessions/{s}/messages",
            f"/v1/agents/{plain_id}/sessions/{s}/events",
            f"/v1/agents/plain/sessions/{s}/messages",
            f"/v1/agents/plain/sessions/{s}/events",
            f"/v1/models/{plain_id}",
            "/v1/models/plain",
        ):
            resp = await http.get(path, headers=theirs)
            assert resp.status_code == 404, path
            assert resp.json()["error"]["type"] == "not_found_error"
    updates: list[str] = []
    other = Env(env.proc, env.other_key, env.key)
    async with mcp_session(other, updates) as session:
        with pytest.raises(MCPError) as unknown:
            await session.read_resource(f"leadgate://agents/{plain_id}/sessions/{s}/messages")
        assert unknown.value.error.code == mt.INVALID_PARAMS
