"""The lead on a real OpenAI-compatible provider: ``[models.remote] provider = "openai"``
pointing at the model stand-in (real HTTP, SSE and tool calls), worker on ``script``."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.errors import ModelError
from leadgate.core.runners import drain
from leadgate.core.types import Gated
from leadgate.database.db import upgrade
from leadgate.domain import workitems
from leadgate.runners.revisions import RevisionRunner
from leadgate.turns.providers.openai import OpenAIProvider
from tests.helpers import Org, api_trigger, item_deliveries, make_agent, make_org
from tests.standins.model_server import ModelServer, ScriptedToolCall

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
KEY = "sk-lead-standin-0123456789"
LEAD_TOOL_NAMES = ["submit_lead_review", "inspect_lead_messages", "inspect_lead_artifacts"]
_TEMPLATE: list[Path] = []


@pytest.fixture
def migrated_url(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """conftest's migrated database, as a copy of one migrated template."""
    if not _TEMPLATE:
        path = tmp_path_factory.mktemp("template") / "t.db"
        upgrade(f"sqlite+aiosqlite:///{path}")
        _TEMPLATE.append(path)
    shutil.copyfile(_TEMPLATE[0], db_url.removeprefix("sqlite+aiosqlite:///"))
    return db_url


@pytest.fixture
async def model() -> AsyncIterator[ModelServer]:
    async with ModelServer(api_key=KEY, model="lead-model") as server:
        yield server


@pytest.fixture
async def service(migrated_url: str, model: ModelServer) -> AsyncIterator[App]:
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "models": {
                "script": {"provider": "script"},
                "remote": {
                    "provider": "openai",
                    "base_url": model.base_url,
                    "api_key": KEY,
                    "model": "lead-model",
                    "timeout_s": 10,
                },
            },
        }
    )
    svc = App(settings, clock=FakeClock(), enable_adapters=False)
    yield svc
    await svc.stop()


async def setup(service: App) -> tuple[Org, dict[str, Any]]:
    org = await make_org(service)
    await make_agent(service, org, "lead", model="remote", instructions="Be strict.")
    worker = await make_agent(service, org, "worker", lead="lead", model="script")
    return org, worker


async def submit(service: App, org: Org, worker: dict[str, Any], text: str) -> str:
    out = await service.turns.run(api_trigger(org, worker, f"{text} #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    return out.work_item_id


async def status(service: App, item_id: str) -> dict[str, Any]:
    async with service.db.read() as conn:
        return (await workitems.get(conn, item_id))._asdict()


def tool_names(body: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in body["tools"]]


async def test_the_service_builds_an_openai_provider_for_the_lead(service: App) -> None:
    provider = service.providers.get("remote")
    assert isinstance(provider, OpenAIProvider)
    assert provider.model == "lead-model"


async def test_a_submit_lead_review_call_approves(service: App, model: ModelServer) -> None:
    org, worker = await setup(service)
    item_id = await submit(service, org, worker, "summarise the doc")
    model.push_tool_calls([{"name": "submit_lead_review", "arguments": {"verdict": "approved"}}])
    await drain(service.lead_runner)
    item = await status(service, item_id)
    assert item["status"] == "completed"  # approved; the reveal is done in the same commit
    [dlv] = await _deliveries(service, item_id)
    assert (dlv["kind"], dlv["action"], dlv["status"]) == ("gating", "reveal", "sent")
    [request] = model.requests
    assert request["model"] == "lead-model"
    assert tool_names(request) == LEAD_TOOL_NAMES
    assert all(tool["type"] == "function" for tool in request["tools"])
    system, user = request["messages"]
    assert system["role"] == "system" and system["content"].startswith("Be strict.")
    envelope = json.loads(user["content"])
    assert envelope["taskContext"] == "summarise the doc #complete"
    assert envelope["summary"] == "Summary: summarise the doc"
    assert envelope["submissionSnapshot"] == "Echo: summarise the doc #complete"
    assert envelope["revision"] == 0
    assert envelope["previousFeedback"] is None


async def test_inspect_then_verdict_takes_two_executions(service: App, model: ModelServer) -> None:
    org, worker = await setup(service)
    item_id = await submit(service, org, worker, "build it")
    model.push_tool_calls([ScriptedToolCall("inspect_lead_messages", {"limit": 10}, id="call_i")])
    model.push_tool_calls(
        [{"name": "submit_lead_review", "arguments": {"verdict": "approved", "feedback": "ok"}}],
        text="Checked the transcript.",
    )
    await drain(service.lead_runner)
    assert (await status(service, item_id))["status"] == "completed"
    assert len(model.requests) == 2
    second = model.requests[1]
    assert tool_names(second) == LEAD_TOOL_NAMES
    assistant, tool = second["messages"][-2:]
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"][0]["function"]["name"] == "inspect_lead_messages"
    assert (tool["role"], tool["tool_call_id"]) == ("tool", "call_i")
    transcript = json.loads(tool["content"])
    assert {"role": "assistant", "content": "Echo: build it #complete", "leadGated": True} in (
        transcript
    )


async def test_changes_requested_over_the_wire_then_approved(
    service: App, model: ModelServer
) -> None:
    org, worker = await setup(service)
    item_id = await submit(service, org, worker, "draft")
    model.push_tool_calls(
        [
            {
                "name": "submit_lead_review",
                "arguments": {"verdict": "changesRequested", "feedback": "Add a title."},
            }
        ]
    )
    model.push_tool_calls([{"name": "submit_lead_review", "arguments": {"verdict": "approved"}}])
    await drain(service.lead_runner)
    item = await status(service, item_id)
    assert (item["status"], item["revision"]) == ("inProgress", 1)
    await drain(RevisionRunner(service.turns))
    await drain(service.lead_runner)
    item = await status(service, item_id)
    assert (item["status"], item["snapshot"]) == ("completed", "Revised: Add a title.")
    envelope = json.loads(model.requests[1]["messages"][1]["content"])
    assert (envelope["revision"], envelope["previousFeedback"]) == (1, "Add a title.")


async def test_a_lead_that_never_submits_escalates_after_four_requests(
    service: App, model: ModelServer
) -> None:
    org, worker = await setup(service)
    item_id = await submit(service, org, worker, "task")
    for n in range(6):
        model.push_text(f"I think it is fine ({n}).")
    await drain(service.lead_runner)
    assert len(model.requests) == 4
    assert model.pending == 2
    for request in model.requests:
        assert tool_names(request) == LEAD_TOOL_NAMES
    assert model.requests[3]["messages"][-1] == {
        "role": "user",
        "content": "Call submit_lead_review with your verdict.",
    }
    assert (await status(service, item_id))["status"] == "awaitingHuman"
    assert await _deliveries(service, item_id) == []


async def test_a_servers_echo_of_the_request_stays_out_of_the_log(
    service: App, model: ModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A model server's error may quote the request (message text); the caller gets its
    words, the log only which server failed and how."""
    org, worker = await setup(service)
    remote = await make_agent(service, org, "remote-worker", model="remote")
    echo = 'bad request, you sent: {"content": "PRIVATE-TEXT-42"}'
    for _ in range(5):  # one for the worker's turn, four for the lead's executions
        model.push_error(400, echo)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ModelError) as info:
        await service.turns.run(api_trigger(org, remote, "PRIVATE-TEXT-42 hello"))
    assert "PRIVATE-TEXT-42" in info.value.message  # the caller's own text, for the caller
    await submit(service, org, worker, "PRIVATE-TEXT-42 task")
    await drain(service.lead_runner)  # the lead's four executions fail the same way
    # Our loggers (the SDKs' DEBUG lines are [log] include_content's, dropped by default).
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("leadgate"))
    assert "model error: the model server at" in logged
    assert "lead execution 4 failed: the model server at" in logged
    assert "PRIVATE-TEXT-42" not in logged


async def test_an_invalid_verdict_over_the_wire_is_a_tool_error(
    service: App, model: ModelServer
) -> None:
    org, worker = await setup(service)
    item_id = await submit(service, org, worker, "task")
    model.push_tool_calls(
        [ScriptedToolCall("submit_lead_review", {"verdict": "ship it"}, id="call_bad")]
    )
    model.push_tool_calls([ScriptedToolCall("submit_lead_review", '{"verdict": "esc', id="c2")])
    model.push_tool_calls([{"name": "submit_lead_review", "arguments": {"verdict": "escalated"}}])
    await drain(service.lead_runner)
    assert len(model.requests) == 3
    for request, call_id in ((model.requests[1], "call_bad"), (model.requests[2], "c2")):
        tool = request["messages"][-1]
        assert (tool["role"], tool["tool_call_id"]) == ("tool", call_id)
        assert "verdict must be" in json.loads(tool["content"])["error"]
    assert (await status(service, item_id))["status"] == "awaitingHuman"


async def _deliveries(service: App, item_id: str) -> list[dict[str, Any]]:
    return await item_deliveries(service, item_id)
