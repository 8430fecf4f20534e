"""The official Node clients as extra peers of the real service process (SPEC 7, 8, 13).

``tests/acceptance/test_rest.py`` and ``test_mcp.py`` drive ``leadgate serve`` with the
Python ``openai`` and ``mcp`` clients; this module runs the small ES modules in
``tests/node/`` against one served process: the ``openai`` Node client (default retries)
and the MCP TypeScript SDK (``StreamableHTTPClientTransport``), plus plain ``fetch`` for
the transcript. Each script prints one JSON line.

They run on the Node runtime pinned in ``tests/node/package-lock.json`` (the ``node``
fixture, see ``node_kit.py``), installed by ``scripts/test.sh`` (``npm ci --prefix
tests/node``). Without it every test here fails: it does not skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.node_kit import NODE_DIR
from tests.acceptance.pending_bodies import GATED_BODY
from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

SCRIPT_TIMEOUT = 30.0
TOOL = "send_action_agent_message"


@pytest.fixture(scope="module")
def svc(
    node: Path,
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
) -> Iterator[ServiceProcess]:
    proc = start_from_template(demo_template, tmp_path_factory.mktemp("node"))
    with service_guard(proc):
        yield proc


def run_node(node: Path, script: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run ``tests/node/<script>`` with ``args`` as JSON; its one JSON output line."""
    done = subprocess.run(
        [str(node), str(NODE_DIR / script), json.dumps(args)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr}"
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"{script} printed {done.stdout!r} (stderr {done.stderr!r})"
    result: dict[str, Any] = json.loads(lines[0])
    return result


def sid() -> str:
    return f"n-{uuid.uuid4().hex[:16]}"


def key(svc: ServiceProcess) -> str:
    assert svc.demo is not None
    return svc.demo.key


def chat(node: Path, svc: ServiceProcess, model: str, message: str, **more: Any) -> dict[str, Any]:
    args = {"baseURL": f"{svc.url}/v1", "apiKey": key(svc), "model": model, "message": message}
    return run_node(node, "openai_chat.mjs", {**args, **more})


def turns(svc: ServiceProcess) -> dict[str, float]:
    """``leadgate_turns_total`` by outcome, from the process's ``/metrics``."""
    with urllib.request.urlopen(f"{svc.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^leadgate_turns_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


# ------------------------------------------------------------------------ openai (Node)


def test_openai_node_plain_chat(node: Path, svc: ServiceProcess) -> None:
    result = chat(node, svc, "plain", "hello from node")
    assert result == {
        "ok": True,
        "role": "assistant",
        "content": "Echo: hello from node",
        "finishReason": "stop",
        "requests": 1,
    }


def test_openai_node_plain_stream(node: Path, svc: ServiceProcess) -> None:
    message = "a long enough message for the script model to stream it in pieces"
    result = chat(node, svc, "plain", message, stream=True)
    assert result["ok"] is True, result
    assert result["role"] == "assistant"
    assert result["content"] == f"Echo: {message}"
    assert result["pieces"] >= 3  # a plain agent streams real deltas
    assert result["finishReason"] == "stop"
    assert result["requests"] == 1


def test_openai_node_gated_409_is_not_retried_and_the_answer_is_revealed(
    node: Path, svc: ServiceProcess
) -> None:
    session = sid()
    before = turns(svc)
    result = chat(node, svc, "worker", "ship it #complete", session=session)
    after = turns(svc)
    assert result["ok"] is False, result
    error = result["error"]
    assert error["name"] == "ConflictError" and error["conflict"] is True
    assert error["status"] == 409
    assert error["code"] == "LEAD_REVIEW_PENDING"
    assert error["type"] == "lead_review_pending"
    assert error["body"] == GATED_BODY["error"]
    assert error["shouldRetry"] == "false"
    # One request, by the client's own count and by the server's: a retry is a second
    # turn, busy, or gated again once the lead approved the first (without the header the
    # client sent it three times: three gated turns).
    assert result["requests"] == 1
    assert after.get("gated", 0) - before.get("gated", 0) == 1
    assert after.get("busy", 0) == before.get("busy", 0)

    # The lead approves in the service; the answer is revealed in the transcript.
    seen = run_node(
        node,
        "transcript.mjs",
        {"url": svc.url, "apiKey": key(svc), "agent": "worker", "session": session},
    )
    assert seen["review"] == "delivered", seen
    assert seen["messages"] == [
        {"role": "user", "content": "ship it #complete"},
        {"role": "assistant", "content": "Echo: ship it #complete"},
    ]
    assert [e["event"] for e in seen["events"]][-2:] == ["message", "review"]


# ---------------------------------------------------------------- MCP TypeScript SDK


def test_mcp_typescript_sdk(node: Path, svc: ServiceProcess) -> None:
    session = sid()
    uri = f"leadgate://agents/plain/sessions/{session}/messages"
    out = run_node(
        node,
        "mcp_peer.mjs",
        {"url": svc.url, "apiKey": key(svc), "tool": TOOL, "agent": "plain", "session": session},
    )
    assert out["protocolVersion"] == "2025-11-25"  # the SDK's latest, a handshake era
    assert out["server"]["name"] == "leadgate"
    assert out["tools"] == [TOOL]
    assert out["templates"] == ["leadgate://agents/{agent}/sessions/{session}/messages"]
    assert out["capabilities"]["resources"]["subscribe"] is True
    assert "prompts" not in out["capabilities"]
    for name, text in (("first", "hello from node"), ("second", "and again")):
        answer = {"leadReviewPending": False, "text": f"Echo: {text}"}
        expected = {"success": True, "result": answer}
        assert out[name]["structuredContent"] == expected
        assert json.loads(out[name]["content"][0]["text"]) == expected
        assert not out[name].get("isError")
    assert out["before"]["review"] is None
    assert [(m["role"], m["content"]) for m in out["before"]["data"]] == [
        ("user", "hello from node"),
        ("assistant", "Echo: hello from node"),
    ]
    assert out["updatedUri"] == uri
    assert set(out["updates"]) == {uri}
    assert [(m["role"], m["content"]) for m in out["after"]["data"]] == [
        ("user", "hello from node"),
        ("assistant", "Echo: hello from node"),
        ("user", "and again"),
        ("assistant", "Echo: and again"),
    ]
    assert out["sessionId"] and out["sessionAfterDelete"] is None
