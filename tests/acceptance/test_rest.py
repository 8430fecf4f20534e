"""SPEC 7 (and the agents API of SPEC 2/12) against the real service process.

Official ``openai`` clients (sync and async, streaming and not, default retry settings)
plus raw aiohttp for byte-level checks. One service for the module; every test uses its
own sessions (``X-Session-Id``), so tests do not see each other's work items.

Script model (SPEC 11): ``Echo: <msg>``; ``#complete`` calls complete_task; ``#fail``
raises mid-turn. Script lead: approves, or escalates (-> awaitingHuman, the session stays
busy) when the task context contains ``#escalate``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.acceptance.pending_bodies import BUSY_BODY, GATED_BODY
from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

LEAD_FIELDS = ("leadAgentId", "leadReviewConfig")
TIMEOUT = 30.0


@dataclass(frozen=True)
class Env:
    """The module's service and the principals made for it through the CLI."""

    proc: ServiceProcess
    owner: str  # demo Owner key (every scope)
    trigger_only: str  # agent:trigger only
    review_only: str  # agent:review only
    other_org_key: str  # Owner key of a second organization

    @property
    def url(self) -> str:
        return self.proc.url


@pytest.fixture(scope="module")
def env(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, service_guard: Any
) -> Iterator[Env]:
    proc = start_from_template(demo_template, tmp_path_factory.mktemp("rest"))
    with service_guard(proc):
        assert proc.demo is not None
        org = proc.demo.org
        # "ghost" (a deleted agent, for the lead.deleted rule): created through the API,
        # deleted through the CLI (the API has no delete).
        request = urllib.request.Request(
            f"{proc.url}/v1/agents",
            data=b'{"name": "ghost"}',
            headers={"Authorization": f"Bearer {proc.demo.key}"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
            assert resp.status == 201
        # Independent admin commands run concurrently (each is a Python process).
        trig, review, other, _preset, _ghost = proc.admin_many(
            ("key", "create", "--org", org, "--scope", "agent:trigger"),
            ("key", "create", "--org", org, "--scope", "agent:review"),
            ("org", "create", "other"),
            ("preset", "create", "--org", org, "--name", "team", "--lead", "lead"),
            ("agent", "update", "--org", org, "ghost", "--delete"),
        )
        assert trig["scopes"] == ["agent:trigger"] and review["scopes"] == ["agent:review"]
        yield Env(proc, proc.demo.key, trig["apiKey"], review["apiKey"], other["apiKey"])


# ---------------------------------------------------------------------------- helpers


def sid() -> str:
    """A fresh session id."""
    return f"s-{uuid.uuid4().hex[:16]}"


def client(env: Env, key: str | None = None) -> openai.OpenAI:
    # Default max_retries on purpose: the surface must work with the client unchanged.
    return openai.OpenAI(base_url=f"{env.url}/v1", api_key=key or env.owner, timeout=TIMEOUT)


def aclient(env: Env, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{env.url}/v1", api_key=key or env.owner, timeout=TIMEOUT)


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def session(s: str) -> dict[str, str]:
    return {"X-Session-Id": s}


@dataclass
class Raw:
    status: int
    headers: Any
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_post(
    env: Env,
    body: Any,
    *,
    key: str | None = "owner",
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
    method: str = "POST",
) -> Raw:
    """A raw HTTP call; ``body`` is bytes or JSON; ``key="owner"`` = the Owner key."""
    hdrs = dict(headers or {})
    if key is not None:
        hdrs["Authorization"] = f"Bearer {env.owner if key == 'owner' else key}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if data is not None:
        hdrs.setdefault("Content-Type", "application/json")
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http,
        http.request(method, f"{env.url}{path}", data=data, headers=hdrs) as resp,
    ):
        return Raw(resp.status, resp.headers, await resp.read())


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (every event is one data line)."""
    text = raw.decode()
    assert text.endswith("\n\n"), f"stream does not end on an event boundary: {text[-80:]!r}"
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        events.append(lines[0][len("data: ") :])
    return events


def chunk_deltas(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]


def assert_openai_error(raw: Raw, status: int, type_: str) -> dict[str, Any]:
    assert raw.status == status, raw.body
    assert raw.headers["Content-Type"].startswith("application/json")
    body = raw.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    return dict(error)


async def escalated_session(env: Env, agent: str = "worker", key: str | None = None) -> str:
    """A session whose work item is under review and stays there (lead escalates)."""
    s = sid()
    raw = await raw_post(
        env,
        {"model": agent, "messages": user("#escalate #complete")},
        key=key or "owner",
        headers=session(s),
    )
    assert raw.status == 409 and raw.json() == GATED_BODY
    return s


# ------------------------------------------------------------------ non-streaming turns


def test_plain_worker_echoes_sync(env: Env) -> None:
    done = client(env).chat.completions.create(model="plain", messages=user("hello world"))
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == "Echo: hello world"
    assert done.choices[0].finish_reason == "stop"


async def test_plain_worker_echoes_async(env: Env) -> None:
    async with aclient(env) as c:
        done = await c.chat.completions.create(
            model="plain",
            messages=[
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "the last user message"},
            ],
        )
    assert done.choices[0].message.content == "Echo: the last user message"


def test_lead_worker_without_complete_is_plain_200(env: Env) -> None:
    done = client(env).chat.completions.create(
        model="worker", messages=user("just chatting"), extra_headers=session(sid())
    )
    assert done.choices[0].message.content == "Echo: just chatting"


def test_gated_turn_is_exact_409_sync(env: Env) -> None:
    with pytest.raises(openai.ConflictError) as info:
        client(env).chat.completions.create(
            model="worker", messages=user("write it #complete"), extra_headers=session(sid())
        )
    exc = info.value
    assert exc.status_code == 409
    # Not retried by the client (a retry would have answered the busy body instead).
    assert exc.response.json() == GATED_BODY
    assert exc.code == "LEAD_REVIEW_PENDING"
    assert exc.type == "lead_review_pending"
    assert exc.body == GATED_BODY["error"]


async def test_gated_turn_is_exact_409_async(env: Env) -> None:
    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError) as info:
            await c.chat.completions.create(
                model="worker", messages=user("write it #complete"), extra_headers=session(sid())
            )
    assert info.value.response.json() == GATED_BODY


async def test_gated_and_busy_raw_bytes(env: Env) -> None:
    s = sid()
    body = {"model": "worker", "messages": user("#escalate please #complete")}
    gated = await raw_post(env, body, headers=session(s))
    assert gated.status == 409
    assert gated.headers["Content-Type"].startswith("application/json")
    assert gated.headers["x-should-retry"] == "false"
    assert gated.json() == GATED_BODY
    # Key presence, byte for byte: both keys are there, with null.
    assert b'"workItemId": null' in gated.body and b'"revision": null' in gated.body

    busy = await raw_post(env, {"model": "worker", "messages": user("more")}, headers=session(s))
    assert busy.status == 409
    assert busy.headers["x-should-retry"] == "false"
    assert busy.json() == BUSY_BODY
    assert b"workItemId" not in busy.body and b"revision" not in busy.body


def test_busy_is_409_without_ids_sync(env: Env) -> None:
    s = asyncio.run(escalated_session(env))
    c = client(env)
    for _ in range(2):  # stays busy: the lead escalated, a human must decide
        with pytest.raises(openai.ConflictError) as info:
            c.chat.completions.create(model="worker", messages=user("hi"), extra_headers=session(s))
        assert info.value.response.json() == BUSY_BODY
        assert "workItemId" not in info.value.response.text


# -------------------------------------------------------------------------- streaming


async def test_streaming_plain_sends_several_deltas_raw(env: Env) -> None:
    message = "a fairly long message so that the script model streams several pieces"
    raw = await raw_post(env, {"model": "plain", "stream": True, "messages": user(message)})
    assert raw.status == 200
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw.body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    choices = chunk_deltas(events)
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["delta"]["content"] for c in choices[1:-1]]
    assert len(texts) >= 3 and all(texts)
    assert "".join(texts) == f"Echo: {message}"
    assert choices[-1] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    ids = {json.loads(e)["id"] for e in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_streaming_plain_sdk_sync(env: Env) -> None:
    message = "stream me through the official client please"
    stream = client(env).chat.completions.create(model="plain", messages=user(message), stream=True)
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) >= 3
    assert "".join(pieces) == f"Echo: {message}"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_streaming_lead_worker_without_complete(env: Env) -> None:
    async with aclient(env) as c:
        stream = await c.chat.completions.create(
            model="worker", messages=user("tell me"), stream=True, extra_headers=session(sid())
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "Echo: tell me"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_streaming_gated_raw_is_exact(env: Env) -> None:
    body = {"model": "worker", "stream": True, "messages": user("finish it #complete")}
    raw = await raw_post(env, body, headers=session(sid()))
    assert raw.status == 200
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    assert b"workItemId" not in raw.body and b"revision" not in raw.body
    assert b"error" not in raw.body and b"Echo" not in raw.body
    events = sse_events(raw.body)
    assert len(events) == 3
    first, stop = chunk_deltas(events)
    assert first == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "finish_reason": None,
    }
    assert stop == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert events[2] == "[DONE]"


def test_streaming_gated_sdk_sync(env: Env) -> None:
    stream = client(env).chat.completions.create(
        model="worker",
        messages=user("finish #complete"),
        stream=True,
        extra_headers=session(sid()),
    )
    chunks = list(stream)
    assert len(chunks) == 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert chunks[0].choices[0].finish_reason is None
    assert chunks[1].choices[0].delta.content is None
    assert chunks[1].choices[0].finish_reason == "stop"
    assert all("workItemId" not in c.model_dump_json() for c in chunks)


async def test_streaming_gated_sdk_async(env: Env) -> None:
    async with aclient(env) as c:
        stream = await c.chat.completions.create(
            model="worker",
            messages=user("finish #complete"),
            stream=True,
            extra_headers=session(sid()),
        )
        chunks = [chunk async for chunk in stream]
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]
    assert all(not c.choices[0].delta.content for c in chunks)


async def test_streaming_busy_is_409_before_any_stream(env: Env) -> None:
    s = await escalated_session(env)
    raw = await raw_post(
        env, {"model": "worker", "stream": True, "messages": user("x")}, headers=session(s)
    )
    assert raw.status == 409
    assert raw.headers["Content-Type"].startswith("application/json")
    assert raw.json() == BUSY_BODY
    assert b"data:" not in raw.body

    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError) as info:
            await c.chat.completions.create(
                model="worker", messages=user("x"), stream=True, extra_headers=session(s)
            )
    assert info.value.response.json() == BUSY_BODY
    with pytest.raises(openai.ConflictError):
        client(env).chat.completions.create(
            model="worker", messages=user("x"), stream=True, extra_headers=session(s)
        )


@pytest.mark.parametrize("agent", ["plain", "worker"])
async def test_streaming_fail_is_one_error_frame_raw(env: Env, agent: str) -> None:
    body = {"model": agent, "stream": True, "messages": user("this turn will #fail soon")}
    raw = await raw_post(env, body, headers=session(sid()))
    assert raw.status == 200
    events = sse_events(raw.body)
    assert "[DONE]" not in events
    errors = [e for e in events if '"error"' in e]
    assert errors == [events[-1]], events
    error = json.loads(events[-1])
    assert set(error) == {"error"}
    assert {"message", "type", "code"} <= set(error["error"])
    chunks = chunk_deltas(events[:-1])
    assert chunks and chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["finish_reason"] is None for c in chunks)
    if agent == "plain":  # live streaming: the first piece went out before the failure
        assert len(chunks) == 2 and chunks[1]["delta"]["content"] == "Echo: this turn "


def test_streaming_fail_sdk_raises_sync(env: Env) -> None:
    stream = client(env).chat.completions.create(
        model="plain", messages=user("please #fail now"), stream=True
    )
    seen: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert not isinstance(info.value, openai.APIStatusError)
    assert "".join(seen) == "Echo: please #fa"
    assert isinstance(info.value.body, dict) and info.value.body["message"]


async def test_streaming_fail_sdk_raises_async(env: Env) -> None:
    async with aclient(env) as c:
        stream = await c.chat.completions.create(
            model="plain", messages=user("please #fail now"), stream=True
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


# --------------------------------------------------------------------------- sessions


async def test_two_session_ids_are_independent_work_items(env: Env) -> None:
    a = await escalated_session(env)
    b = sid()
    async with aclient(env) as c:
        # a is under review; b is a different work item and answers normally.
        with pytest.raises(openai.ConflictError) as busy:
            await c.chat.completions.create(
                model="worker", messages=user("a again"), extra_headers=session(a)
            )
        assert busy.value.response.json() == BUSY_BODY
        done = await c.chat.completions.create(
            model="worker", messages=user("on b"), extra_headers=session(b)
        )
        assert done.choices[0].message.content == "Echo: on b"
        # b gets gated on its own (gated body, not busy).
        with pytest.raises(openai.ConflictError) as gated:
            await c.chat.completions.create(
                model="worker", messages=user("b #complete"), extra_headers=session(b)
            )
        assert gated.value.response.json() == GATED_BODY


async def test_user_field_is_the_session_and_header_wins(env: Env) -> None:
    name = f"user-{uuid.uuid4().hex[:8]}"
    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError) as gated:
            await c.chat.completions.create(
                model="worker", messages=user("#escalate #complete"), user=name
            )
        assert gated.value.response.json() == GATED_BODY
        with pytest.raises(openai.ConflictError) as busy:
            await c.chat.completions.create(model="worker", messages=user("again"), user=name)
        assert busy.value.response.json() == BUSY_BODY
        # Another user value is another session.
        done = await c.chat.completions.create(
            model="worker", messages=user("hi"), user=name + "-2"
        )
        assert done.choices[0].message.content == "Echo: hi"
        # X-Session-Id takes precedence over user.
        done = await c.chat.completions.create(
            model="worker", messages=user("hdr"), user=name, extra_headers=session(sid())
        )
        assert done.choices[0].message.content == "Echo: hdr"


async def test_default_session_is_per_key_and_agent(env: Env) -> None:
    # Only this test sends to "worker" without X-Session-Id/user with the trigger-only key
    # and with the Owner key.
    async with aclient(env, env.trigger_only) as c:
        with pytest.raises(openai.ConflictError) as gated:
            await c.chat.completions.create(model="worker", messages=user("#escalate #complete"))
        assert gated.value.response.json() == GATED_BODY
        # The same key and agent without header/user share the one default session: busy.
        with pytest.raises(openai.ConflictError) as busy:
            await c.chat.completions.create(model="worker", messages=user("still there?"))
        assert busy.value.response.json() == BUSY_BODY
        # An explicit session of the same key is another work item.
        done = await c.chat.completions.create(
            model="worker", messages=user("other"), extra_headers=session(sid())
        )
        assert done.choices[0].message.content == "Echo: other"
        # Another agent: its own default session.
        done = await c.chat.completions.create(model="plain", messages=user("plain one"))
        assert done.choices[0].message.content == "Echo: plain one"
    # Another key of the same organization: its own default session.
    async with aclient(env, env.owner) as c:
        done = await c.chat.completions.create(model="worker", messages=user("mine"))
        assert done.choices[0].message.content == "Echo: mine"


# ------------------------------------------------------------------------------- auth


async def test_missing_and_bad_keys_are_401(env: Env) -> None:
    body = {"model": "plain", "messages": user("hi")}
    for key in (None, "lg.key_nope.secret", "not-a-key"):
        raw = await raw_post(env, body, key=key)
        assert_openai_error(raw, 401, "authentication_error")
        assert raw.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError) as info:
        client(env, "lg.key_nope.secret").chat.completions.create(
            model="plain", messages=user("hi")
        )
    assert info.value.status_code == 401


async def test_key_without_trigger_scope_is_403(env: Env) -> None:
    raw = await raw_post(env, {"model": "plain", "messages": user("hi")}, key=env.review_only)
    error = assert_openai_error(raw, 403, "permission_error")
    assert "agent:trigger" in error["message"]
    with pytest.raises(openai.PermissionDeniedError):
        client(env, env.review_only).chat.completions.create(model="plain", messages=user("hi"))


def test_review_scope_is_not_needed_to_send(env: Env) -> None:
    c = client(env, env.trigger_only)
    done = c.chat.completions.create(model="plain", messages=user("no review scope"))
    assert done.choices[0].message.content == "Echo: no review scope"
    with pytest.raises(openai.ConflictError) as info:
        c.chat.completions.create(
            model="worker", messages=user("#complete"), extra_headers=session(sid())
        )
    assert info.value.response.json() == GATED_BODY


async def test_other_organizations_agent_is_404(env: Env) -> None:
    listing = await raw_post(env, None, path="/v1/agents", method="GET")
    worker_id = next(a["id"] for a in listing.json()["data"] if a["name"] == "worker")
    for model in (worker_id, "worker", "plain"):
        raw = await raw_post(env, {"model": model, "messages": user("hi")}, key=env.other_org_key)
        assert_openai_error(raw, 404, "not_found_error")
    with pytest.raises(openai.NotFoundError):
        client(env, env.other_org_key).chat.completions.create(model=worker_id, messages=user("hi"))
    raw = await raw_post(
        env, None, path=f"/v1/agents/{worker_id}", method="GET", key=env.other_org_key
    )
    assert_openai_error(raw, 404, "not_found_error")


# ------------------------------------------------------------------------- bad input


async def test_invalid_requests_are_400_envelopes(env: Env) -> None:
    cases: list[tuple[Any, str]] = [
        (b"{not json", "body.json"),
        (b"[1, 2]", "body.object"),
        ({"model": "plain"}, "messages.required"),
        ({"model": "plain", "messages": []}, "messages.required"),
        ({"model": "plain", "messages": [{"role": "system", "content": "x"}]}, "messages.user"),
        ({"messages": user("hi")}, "model.required"),
        ({"model": "plain", "messages": user("hi"), "stream": "yes"}, "stream.type"),
        ({"model": "plain", "messages": user("   ")}, "message.empty"),
    ]
    for body, rule in cases:
        raw = await raw_post(env, body)
        error = assert_openai_error(raw, 400, "invalid_request_error")
        assert error["rule"] == rule, (body, error)
    with pytest.raises(openai.BadRequestError):
        client(env).chat.completions.create(
            model="plain", messages=[{"role": "system", "content": "x"}]
        )


async def test_unknown_model_is_404_envelope(env: Env) -> None:
    raw = await raw_post(env, {"model": "no-such-agent", "messages": user("hi")})
    error = assert_openai_error(raw, 404, "not_found_error")
    assert error["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client(env).chat.completions.create(model="no-such-agent", messages=user("hi"))


async def test_a_model_asked_for_before_it_exists_answers_once_it_is_created(env: Env) -> None:
    """The service keeps a miss (no writer, no SELECT for the next request), but not past
    the agent's creation: through its own API, or by the CLI (another process)."""
    assert env.proc.demo is not None
    for how in ("api", "cli"):
        name = f"typo-{how}-{uuid.uuid4().hex[:8]}"
        for _ in range(3):  # the first looks it up, the others are answered from the miss
            raw = await raw_post(env, {"model": name, "messages": user("hi")})
            assert assert_openai_error(raw, 404, "not_found_error")["rule"] == "agent.not_found"
        if how == "api":
            created = await raw_post(env, {"name": name}, path="/v1/agents")
            assert created.status == 201, created.body
        else:
            env.proc.admin("agent", "create", "--org", env.proc.demo.org, "--name", name)
        answer = client(env).chat.completions.create(model=name, messages=user("hi"))
        assert answer.choices[0].message.content


async def test_body_over_the_limit_is_413(env: Env) -> None:
    big = "x" * (1_048_576 + 10)
    raw = await raw_post(env, {"model": "plain", "messages": user(big)})
    assert_openai_error(raw, 413, "invalid_request_error")
    # The service is fine afterwards.
    ok = await raw_post(env, {"model": "plain", "messages": user("still alive")})
    assert ok.status == 200


# ------------------------------------------------------------------------- end to end


async def test_gated_then_lead_approves_then_same_session_answers_again(env: Env) -> None:
    s = sid()
    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError) as gated:
            await c.chat.completions.create(
                model="worker", messages=user("ship it #complete"), extra_headers=session(s)
            )
        assert gated.value.response.json() == GATED_BODY
        # The lead runner (in the service) approves; the outbox reveals and completes the
        # item. Until then the session is busy.
        deadline = time.monotonic() + 15
        busy_seen = 0
        while True:
            try:
                done = await c.chat.completions.create(
                    model="worker", messages=user("next task"), extra_headers=session(s)
                )
                break
            except openai.ConflictError as exc:
                assert exc.response.json() == BUSY_BODY
                busy_seen += 1
                assert time.monotonic() < deadline, "the review never completed"
                await asyncio.sleep(0.1)
    assert done.choices[0].message.content == "Echo: next task"


# ------------------------------------------------------------------------- agents API


async def agents_call(
    env: Env, method: str, path: str = "", body: Any = None, key: str | None = "owner"
) -> Raw:
    return await raw_post(env, body, key=key, path=f"/v1/agents{path}", method=method)


def assert_no_lead_fields(payload: Any) -> None:
    text = json.dumps(payload)
    for field_name in LEAD_FIELDS:
        assert field_name not in text, payload


async def test_agents_list_and_get_never_show_lead_fields(env: Env) -> None:
    listing = await agents_call(env, "GET")
    assert listing.status == 200
    data = listing.json()
    assert data["object"] == "list"
    names = {a["name"] for a in data["data"]}
    assert {"lead", "worker", "plain"} <= names and "ghost" not in names
    assert_no_lead_fields(data)
    for ref in ("worker", next(a["id"] for a in data["data"] if a["name"] == "worker")):
        one = await agents_call(env, "GET", f"/{ref}")
        assert one.status == 200 and one.json()["name"] == "worker"
        assert_no_lead_fields(one.json())
        assert not any("lead" in key.lower() for key in one.json())


async def test_agents_create_and_patch_lead_is_applied_but_never_shown(env: Env) -> None:
    name = f"w-{uuid.uuid4().hex[:8]}"
    created = await agents_call(
        env,
        "POST",
        body={"name": name, "leadAgentId": "lead", "leadReviewConfig": {"maxRevisionRounds": 2}},
    )
    assert created.status == 201, created.body
    assert_no_lead_fields(created.json())
    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError) as info:  # the lead is in force
            await c.chat.completions.create(
                model=name, messages=user("#complete"), extra_headers=session(sid())
            )
        assert info.value.response.json() == GATED_BODY

    other = f"p-{uuid.uuid4().hex[:8]}"
    assert (await agents_call(env, "POST", body={"name": other})).status == 201
    lead_id = next(
        a["id"] for a in (await agents_call(env, "GET")).json()["data"] if a["name"] == "lead"
    )
    patched = await agents_call(
        env,
        "PATCH",
        f"/{other}",
        body={
            "leadAgentId": lead_id,
            "leadReviewConfig": {"completionPolicy": "completeAutomatically"},
        },
    )
    assert patched.status == 200, patched.body
    assert_no_lead_fields(patched.json())
    assert_no_lead_fields((await agents_call(env, "GET", f"/{other}")).json())
    assert_no_lead_fields((await agents_call(env, "GET")).json())
    async with aclient(env) as c:
        with pytest.raises(openai.ConflictError):
            await c.chat.completions.create(
                model=other, messages=user("#complete"), extra_headers=session(sid())
            )
    # Clearing the lead: plain chat again.
    cleared = await agents_call(env, "PATCH", f"/{other}", body={"leadAgentId": None})
    assert cleared.status == 200
    assert_no_lead_fields(cleared.json())
    done = client(env).chat.completions.create(
        model=other, messages=user("#complete"), extra_headers=session(sid())
    )
    assert done.choices[0].message.content == "Echo: #complete"


async def test_agents_patch_enforces_every_save_rule(env: Env) -> None:
    target = f"t-{uuid.uuid4().hex[:8]}"
    sleepy = f"z-{uuid.uuid4().hex[:8]}"
    presetted = f"q-{uuid.uuid4().hex[:8]}"
    assert (await agents_call(env, "POST", body={"name": target})).status == 201
    assert (await agents_call(env, "POST", body={"name": sleepy})).status == 201
    assert (await agents_call(env, "PATCH", f"/{sleepy}", body={"active": False})).status == 200
    made = await agents_call(env, "POST", body={"name": presetted, "presetId": "team"})
    assert made.status == 201, made.body
    assert made.json()["presetId"] is not None
    assert_no_lead_fields(made.json())

    cases: list[tuple[str, dict[str, Any], str]] = [
        (target, {"leadAgentId": target}, "lead.self"),
        (target, {"leadAgentId": sleepy}, "lead.inactive"),
        (target, {"leadAgentId": "ghost"}, "lead.deleted"),
        (target, {"leadAgentId": "nobody-by-that-name"}, "lead.not_found"),
        (presetted, {"leadAgentId": "lead"}, "lead.preset_has_lead"),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"maxRevisionRounds": 6}},
            "leadReviewConfig.maxRevisionRounds",
        ),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"maxRevisionRounds": 0}},
            "leadReviewConfig.maxRevisionRounds",
        ),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"maxRevisionRounds": True}},
            "leadReviewConfig.maxRevisionRounds",
        ),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"maxRevisionRounds": "3"}},
            "leadReviewConfig.maxRevisionRounds",
        ),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"completionPolicy": "later"}},
            "leadReviewConfig.completionPolicy",
        ),
        (
            target,
            {"leadAgentId": "lead", "leadReviewConfig": {"colour": "red"}},
            "leadReviewConfig.unknown_key",
        ),
        (target, {"leadAgentId": "lead", "leadReviewConfig": [3]}, "leadReviewConfig.type"),
    ]
    for agent, body, rule in cases:
        raw = await agents_call(env, "PATCH", f"/{agent}", body=body)
        error = assert_openai_error(raw, 400, "invalid_request_error")
        assert error["rule"] == rule, (body, error)
    # Nothing was saved: the target is still ungated plain chat.
    done = client(env).chat.completions.create(
        model=target, messages=user("#complete"), extra_headers=session(sid())
    )
    assert done.choices[0].message.content == "Echo: #complete"


async def test_agents_writes_require_update_scope(env: Env) -> None:
    for key in (env.trigger_only, env.review_only):
        patch = await agents_call(env, "PATCH", "/plain", body={"leadAgentId": "lead"}, key=key)
        error = assert_openai_error(patch, 403, "permission_error")
        assert "agent:update" in error["message"]
        post = await agents_call(env, "POST", body={"name": "nope"}, key=key)
        assert_openai_error(post, 403, "permission_error")
    # Reading is fine with any key of the organization; the plain agent is unchanged.
    listing = await agents_call(env, "GET", key=env.trigger_only)
    assert listing.status == 200
    done = client(env).chat.completions.create(model="plain", messages=user("#complete"))
    assert done.choices[0].message.content == "Echo: #complete"
    missing = await agents_call(env, "GET", key=None)
    assert_openai_error(missing, 401, "authentication_error")


async def test_model_names_the_worker_by_id_or_slug(env: Env) -> None:
    # SPEC 7: `model` is the worker's id or slug (the name works too).
    created = await agents_call(env, "POST", body={"name": f"Release Notes {uuid.uuid4().hex[:6]}"})
    assert created.status == 201, created.body
    agent = created.json()
    assert agent["slug"] != agent["name"]
    for ref in (agent["id"], agent["slug"], agent["name"]):
        done = client(env).chat.completions.create(
            model=ref, messages=user(f"by {ref}"), extra_headers=session(uuid.uuid4().hex)
        )
        assert done.choices[0].message.content == f"Echo: by {ref}"
        assert done.model == ref
