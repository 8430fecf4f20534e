"""Our OpenAI-compatible bodies against OpenAI's published OpenAPI schemas.

``openai_schemas.json`` beside this file is a trimmed copy of OpenAI's OpenAPI document
(``https://github.com/openai/openai-openapi``, ``openapi.json`` at the commit named in its
``x-source``): the schemas ``CreateChatCompletionResponse``,
``CreateChatCompletionStreamResponse``, ``ErrorResponse``/``Error``,
``ListModelsResponse``/``Model`` and everything they reference, copied unchanged.

The document is OpenAPI 3.1 but still marks some fields with 3.0's ``nullable: true``
(among them the stream chunk's ``finish_reason`` and ``usage``), which a JSON Schema
2020-12 validator ignores; :func:`nullable_to_any_of` rewrites each such node into
``anyOf: [node, {"type": "null"}]`` first (see shared/notes/wire-formats.md).

Bodies come from the real app on 127.0.0.1 (SQLite: they do not depend on the database).
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError as SchemaError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.helpers import Org, make_agent, make_org
from tests.serving import served_app

DOCUMENT = Path(__file__).with_name("openai_schemas.json")
URI = "urn:openai-openapi"


def nullable_to_any_of(node: Any) -> Any:
    """``{..., "nullable": true}`` -> ``{"anyOf": [{...}, {"type": "null"}]}``, recursively
    (a ``$ref`` beside ``nullable`` is wrapped whole)."""
    if isinstance(node, list):
        return [nullable_to_any_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: nullable_to_any_of(value) for key, value in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _registry() -> Registry[Any]:
    document = json.loads(DOCUMENT.read_text())
    schemas = nullable_to_any_of(copy.deepcopy(document))
    # (referencing's with_resource has no return annotation)
    registry: Registry[Any] = Registry().with_resource(
        URI, Resource.from_contents(schemas, DRAFT202012)
    )
    return registry


REGISTRY = _registry()


def check(name: str, body: Any) -> None:
    """Validate ``body`` against ``#/components/schemas/<name>`` (all errors listed)."""
    validator = Draft202012Validator(
        {"$ref": f"{URI}#/components/schemas/{name}"}, registry=REGISTRY
    )
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
    assert not errors, f"{name}: {errors}\n{json.dumps(body)[:2000]}"


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only here (overrides the both-backends fixture)."""
    return f"sqlite+aiosqlite:///{tmp_path}/t.db"


@pytest.fixture
async def api(migrated_url: str) -> AsyncIterator[tuple[TestClient[Any, Any], Org]]:
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        yield client, org


async def chat(
    api: tuple[TestClient[Any, Any], Org], body: dict[str, Any], **headers: str
) -> ClientResponse:
    client, org = api
    headers = {"Authorization": f"Bearer {org.key}", **headers}
    return await client.post("/v1/chat/completions", json=body, headers=headers)


def ask(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def frames(raw: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (``[DONE]`` left out)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block and block != "data: [DONE]":
            assert block.startswith("data: ")
            out.append(json.loads(block[len("data: ") :]))
    return out


def test_the_copy_is_the_published_document() -> None:
    document = json.loads(DOCUMENT.read_text())
    source = document["x-source"]
    assert source["repository"] == "https://github.com/openai/openai-openapi"
    assert len(source["commit"]) == 40
    assert {
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "ErrorResponse",
        "Error",
        "ListModelsResponse",
        "Model",
    } <= set(document["components"]["schemas"])


def test_the_validator_has_teeth() -> None:
    good: dict[str, Any] = {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
    }
    check("CreateChatCompletionResponse", good)
    for path in (("logprobs",), ("message", "refusal")):
        broken = copy.deepcopy(good)
        target = broken["choices"][0]
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        with pytest.raises(AssertionError):
            check("CreateChatCompletionResponse", broken)
    with pytest.raises(AssertionError):
        check("ErrorResponse", {"error": {"message": "x", "type": "t", "code": None}})
    # The rewrite is what lets a null finish_reason through.
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
        "usage": None,
    }
    check("CreateChatCompletionStreamResponse", chunk)
    raw = json.loads(DOCUMENT.read_text())
    plain = Registry().with_resource(URI, Resource.from_contents(raw, DRAFT202012))
    validator = Draft202012Validator(
        {"$ref": f"{URI}#/components/schemas/CreateChatCompletionStreamResponse"},
        registry=plain,
    )
    with pytest.raises(SchemaError):
        validator.validate(chunk)


async def test_completion_and_models(api: tuple[TestClient[Any, Any], Org]) -> None:
    resp = await chat(api, ask("plain", "hello"))
    assert resp.status == 200
    check("CreateChatCompletionResponse", await resp.json())
    client, org = api
    auth = {"Authorization": f"Bearer {org.key}"}
    check("ListModelsResponse", await (await client.get("/v1/models", headers=auth)).json())
    check("Model", await (await client.get("/v1/models/plain", headers=auth)).json())


async def test_every_error_envelope(api: tuple[TestClient[Any, Any], Org]) -> None:
    client, org = api
    s = {"X-Session-Id": "held"}
    responses = [
        await chat(api, ask("worker", "#escalate #complete"), **s),  # 409 gated
        await chat(api, ask("worker", "again"), **s),  # 409 busy
        await chat(api, {"model": "plain"}),  # 400
        await chat(api, ask("plain", "hi", n=3)),  # 400 n
        await chat(api, ask("nobody", "hi")),  # 404
        await chat(api, ask("plain", "#fail")),  # 502 after the intake
        await client.post("/v1/chat/completions", json=ask("plain", "x")),  # 401
        await client.get("/v1/models/nobody", headers={"Authorization": f"Bearer {org.key}"}),
        await client.get(
            "/v1/agents/plain/sessions/x/messages?limit=0",
            headers={"Authorization": f"Bearer {org.key}"},
        ),
        await client.get("/v1/nothing-here", headers={"Authorization": f"Bearer {org.key}"}),
    ]
    statuses = [r.status for r in responses]
    assert statuses == [409, 409, 400, 400, 404, 502, 401, 404, 400, 404]
    for resp in responses:
        check("ErrorResponse", await resp.json())
    gated, busy = (await responses[0].json())["error"], (await responses[1].json())["error"]
    assert gated["workItemId"] is None and gated["revision"] is None
    assert "workItemId" not in busy and "revision" not in busy
    # The SPEC's form, plus the rule every other error names (they named none): the
    # names MCP's tool error and Studio give the same cases.
    assert (gated["rule"], busy["rule"]) == ("turn.gated", "turn.busy")
    assert set(busy) == {"message", "type", "param", "code", "rule"}
    assert set(gated) == set(busy) | {"workItemId", "revision"}


async def test_every_stream_chunk(api: tuple[TestClient[Any, Any], Org]) -> None:
    with_usage = {"stream": True, "stream_options": {"include_usage": True}}
    bodies = [
        await (await chat(api, ask("plain", "stream a plain answer", **with_usage))).read(),
        await (await chat(api, ask("plain", "stream a plain answer", stream=True))).read(),
        await (await chat(api, ask("worker", "held #complete", **with_usage))).read(),
    ]
    for raw in bodies:
        chunks = frames(raw)
        assert chunks
        for chunk in chunks:
            check("CreateChatCompletionStreamResponse", chunk)
    assert frames(bodies[0])[-1]["usage"]["total_tokens"] > 0
    # A mid-stream failure: one error frame whose error is the non-streaming envelope.
    failed = frames(await (await chat(api, ask("plain", "x #fail", stream=True))).read())
    for chunk in failed[:-1]:
        check("CreateChatCompletionStreamResponse", chunk)
    check("ErrorResponse", failed[-1])
    unstreamed = await (await chat(api, ask("plain", "x #fail"))).json()
    assert failed[-1]["error"]["type"] == unstreamed["error"]["type"]
    assert failed[-1]["error"]["code"] == unstreamed["error"]["code"]


async def test_bodies_the_validator_finds_broken(api: tuple[TestClient[Any, Any], Org]) -> None:
    """A body we answer, minus one required field, fails: the checks are not vacuous."""
    body = await (await chat(api, ask("plain", "hello"))).json()
    del body["choices"][0]["message"]["refusal"]
    with pytest.raises(AssertionError):
        check("CreateChatCompletionResponse", body)
