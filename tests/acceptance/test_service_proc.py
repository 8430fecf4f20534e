"""The subprocess harness itself (``tests/service_proc.py``) against the real service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.service_proc import (
    AdminError,
    DemoTemplate,
    ServiceProcess,
    clone_sqlite,
    start_from_template,
    toml_dumps,
)
from tests.standins.model_server import ModelServer


def post(proc: ServiceProcess, model: str, text: str, session: str = "s") -> tuple[int, Any]:
    assert proc.demo is not None
    request = urllib.request.Request(
        f"{proc.url}/v1/chat/completions",
        data=json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode(),
        headers={"Authorization": f"Bearer {proc.demo.key}", "X-Session-Id": session},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_toml_writer_round_trips() -> None:
    data = {
        "server": {"host": "127.0.0.1", "port": 8080, "public_url": 'http://x/"q"'},
        "models": {
            "script": {"provider": "script"},
            "gpt": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "timeout_s": 1.5},
        },
        "email": {"start_tls": False, "listen_port": 0},
        "odd keys": {"a.b": ["x", 1, True]},
    }
    assert tomllib.loads(toml_dumps(data)) == data


def test_config_file_has_the_given_sections(tmp_path: Path) -> None:
    proc = ServiceProcess(
        tmp_path,
        config={
            "slack": {"signing_secret": "s3cret", "api_url": "http://127.0.0.1:1/api/"},
            "models": {"gpt": {"provider": "openai", "model": "m"}},
        },
    )
    config = tomllib.loads(proc.config_path.read_text())
    assert config["server"] == {"host": "127.0.0.1", "port": proc.port, "public_url": proc.url}
    assert config["database"]["url"] == f"sqlite+aiosqlite:///{tmp_path.resolve()}/leadgate.db"
    assert config["models"] == {
        "script": {"provider": "script"},
        "gpt": {"provider": "openai", "model": "m"},
    }
    assert config["slack"]["signing_secret"] == "s3cret"


def test_crash_restart_admin_errors_and_clean_stop(leadgate: ServiceProcess) -> None:
    assert leadgate.running and leadgate.healthy()
    assert post(leadgate, "plain", "before")[0] == 200
    # A rule violation of the admin CLI: exit code 2 and the rule's name.
    with pytest.raises(AdminError) as info:
        leadgate.admin("agent", "create", "--org", "demo", "--name", "worker")
    assert info.value.returncode == 2 and info.value.rule == "agent.name_taken"
    # Crash (SIGKILL), then start again on the same database: the key still works.
    assert leadgate.kill() == -signal.SIGKILL
    assert not leadgate.running and not leadgate.healthy()
    leadgate.start()
    status, body = post(leadgate, "plain", "after the crash")
    assert status == 200 and body["choices"][0]["message"]["content"] == "Echo: after the crash"
    assert leadgate.stop() == 0  # SIGTERM: clean exit, code 0
    assert leadgate.log_text().count("===== leadgate serve") == 2


def test_role_and_environment_overrides(demo_template: DemoTemplate, tmp_path: Path) -> None:
    proc = start_from_template(
        demo_template, tmp_path, role="worker", env={"LEADGATE_LOG__LEVEL": "WARNING"}
    )
    try:
        assert get_json(f"{proc.url}/healthz") == {"status": "ok", "role": "worker"}
        assert post(proc, "plain", "hi")[0] == 404  # the worker role serves no API
        assert "leadgate listening" not in proc.log_text()  # INFO is off
    finally:
        proc.stop()
    proc.start(role="api")
    try:
        assert get_json(f"{proc.url}/healthz")["role"] == "api"
        assert post(proc, "plain", "hi")[0] == 200
    finally:
        proc.stop()


def test_postgresql(leadgate_pg: ServiceProcess) -> None:
    assert leadgate_pg.sqlite_file is None
    status, body = post(leadgate_pg, "plain", "on pg")
    assert status == 200 and body["choices"][0]["message"]["content"] == "Echo: on pg"
    status, body = post(leadgate_pg, "worker", "#escalate #complete", session="pg-1")
    assert status == 409 and body["error"]["workItemId"] is None
    status, body = post(leadgate_pg, "worker", "again", session="pg-1")
    assert status == 409 and "workItemId" not in body["error"]


async def test_sigterm_cancels_a_request_stuck_on_its_model_after_the_grace(
    demo_template: DemoTemplate, tmp_path: Path
) -> None:
    """A turn waiting on a model that hangs held the exit for two minutes (aiohttp's
    default 60 s, twice), past a service manager's stop timeout; with ``[server]
    shutdown_grace_s`` it is cancelled once the grace has passed, and the exit is clean."""
    async with ModelServer() as model:
        model.push_hang()
        proc = ServiceProcess(
            tmp_path,
            config={
                "server": {"shutdown_grace_s": 2.0},
                "models": {
                    "hangs": {
                        "provider": "openai",
                        "base_url": model.base_url,
                        "api_key": "sk-test",
                        "model": "m",
                        "timeout_s": 60.0,
                    }
                },
            },
        )
        assert proc.sqlite_file is not None
        clone_sqlite(demo_template.database, proc.sqlite_file)
        proc.demo = demo_template.demo
        proc.admin("agent", "create", "--org", "demo", "--name", "stuck", "--model", "hangs")
        proc.start()
        try:
            request = asyncio.create_task(asyncio.to_thread(post, proc, "stuck", "hello"))
            await model.wait_for_requests(1, within_s=10)
            started = time.monotonic()
            assert await asyncio.to_thread(proc.stop, 20) == 0
            took = time.monotonic() - started
            assert took < 2.0 + 4.0, took  # the grace, and the rest of a clean exit
            assert "requests in flight get 2 s to finish" in proc.log_text()
            with contextlib.suppress(Exception):  # the connection closed unanswered
                await request
        finally:
            proc.stop(check=False)
