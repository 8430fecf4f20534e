"""The real ``leadgate`` command (SPEC 12) as subprocesses against a temporary SQLite
config, plus ``/metrics`` and the no-secrets-in-logs rule on a running app.

The commands are grouped into phases; the commands of one phase do not depend on each
other. ``db upgrade``, the commands before it, the first ``org create`` and a raw-bytes
argument run as ``leadgate`` processes of their own; the phases run in one child process
(``cli_batch``: each command through ``leadgate.cli.main.main`` with its own stdout,
stderr and exit code)."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from leadgate.app import App
from tests.helpers import api_trigger, make_agent, make_org
from tests.service_proc import cli_batch

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("leadgate")
LEADGATE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "leadgate.cli.main"]
TIMEOUT = 90
# The module's world once ran about 60 CLI commands, each a new process (about 100 s
# here): over pytest-timeout's 120 s on a loaded or slow machine, which erred every test.
pytestmark = pytest.mark.timeout(360)


@dataclass
class Run:
    args: tuple[str, ...]
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, self
        return json.loads(self.out)

    def rule_error(self, rule: str) -> None:
        """Exit 2, nothing on stdout, a message on stderr naming ``rule``."""
        assert self.code == 2, self
        assert self.out == "", self
        assert f"[{rule}]" in self.err, self
        assert "Traceback" not in self.err, self


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEADGATE_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # Run this checkout's code whatever the editable install's package map says.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def write_config(path: Path, db: Path, extra: str = "") -> Path:
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
port = 0
public_url = "http://127.0.0.1:0"

[database]
url = "sqlite+aiosqlite:///{db}"

[log]
level = "WARNING"
{extra}
""",
        encoding="utf-8",
    )
    return path


def run(config: Path, *args: str) -> Run:
    proc = subprocess.run(
        [*LEADGATE, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=config.parent,
    )
    return Run(args, proc.returncode, proc.stdout.strip(), proc.stderr.strip())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cli")
    cfg = write_config(root / "leadgate.toml", root / "lg.db")
    fresh = write_config(root / "fresh.toml", root / "fresh.db")
    acme = ("--org", "acme")
    r: dict[str, Run] = {}
    (root / "latin1.json").write_bytes(b'[{"prompt": "caf\xe9"}]')

    with ThreadPoolExecutor(max_workers=3) as pool:
        upgrade = pool.submit(run, cfg, "db", "upgrade")
        unmigrated = {k: pool.submit(run, fresh, *v) for k, v in UNMIGRATED.items()}
        r["upgrade"] = upgrade.result()
        r |= {f"fresh:{k}": v.result() for k, v in unmigrated.items()}
    assert r["upgrade"].code == 0, r["upgrade"]
    r["org"] = run(cfg, "org", "create", "acme")
    assert r["org"].code == 0, r["org"]
    phases: list[dict[str, list[str]]] = [
        {
            "org_dup": ["org", "create", "acme"],
            "key": ["key", "create", *acme, "--scope", "agent:review"],
            "key_bad": ["key", "create", *acme, "--scope", "agent:everything"],
            "lead": ["agent", "create", *acme, "--name", "lead"],
            "idle": ["agent", "create", *acme, "--name", "idle"],
            "gone": ["agent", "create", *acme, "--name", "gone"],
            "lead_missing": ["agent", "create", *acme, "--name", "x1", "--lead", "nope"],
            "policy_bad": ["policy", "add", *acme, "--pattern", "(", "--action", "block"],
            "platform_lead": ["preset", "create", "--platform", "--name", "plat", "--lead", "lead"],
        },
        {
            "deactivate": ["agent", "update", "idle", *acme, "--deactivate"],
            "delete": ["agent", "update", "gone", *acme, "--delete"],
            "preset": ["preset", "create", *acme, "--name", "reviewed", "--lead", "lead"],
            "worker": ["agent", "create", *acme, "--name", "worker", "--lead", "lead"],
            "policy_name": [
                *("agent", "create", *acme, "--name", "x2", "--lead", "lead"),
                *("--completion-policy", "sometimes"),
            ],
            "rounds_0": [
                *("agent", "create", *acme, "--name", "x3", "--lead", "lead"),
                *("--max-revision-rounds", "0"),
            ],
            "route_bad": [
                *("route", "add", *acme, "--agent", "lead", "--channel", "slack"),
                *("--match", "guild=G1"),
            ],
            "cron_bad": [
                *("schedule", "add", *acme, "--agent", "lead"),
                *("--cron", "61 * * * *", "--message", "hi"),
            ],
            # A Latin-1 shell's "café": the byte 0xe9 reaches Python as a surrogate escape.
            "argv_bytes": ["policy", "add", *acme, "--pattern", "caf\udce9", "--action", "block"],
            "nodes_deep": ["flow", "create", *acme, "--name", "f1", "--nodes", "[" * 99 + "]" * 99],
            "nodes_surrogate": ["flow", "create", *acme, "--name", "f2", "--nodes", '["\\ud800"]'],
            "nodes_latin1": [
                *("flow", "create", *acme, "--name", "f3", "--nodes", f"@{root / 'latin1.json'}")
            ],
        },
        {
            "lead_inactive": ["agent", "create", *acme, "--name", "x4", "--lead", "idle"],
            "lead_deleted": ["agent", "create", *acme, "--name", "x5", "--lead", "gone"],
            "lead_self": ["agent", "update", "worker", *acme, "--lead", "worker"],
            "update_nothing": ["agent", "update", "worker", *acme],
            "org_list": ["org", "list"],
            "rotate_alone": ["demo", "--rotate-key"],
            "agent_list": ["agent", "list", *acme],
            "agent_table": ["agent", "list", *acme, "--format", "table"],
            "cron_step": [
                *("schedule", "add", *acme, "--agent", "lead"),
                *("--cron", "*/99999999999999999999 * * * *", "--message", "hi"),
            ],
            "preset_has_lead": [
                *("agent", "create", *acme, "--name", "pw"),
                *("--preset", "reviewed", "--lead", "lead"),
            ],
        },
    ]
    # The phases' commands through one interpreter (cli_batch: a `leadgate` start costs
    # most of a second of CPU, about 30 of them were most of this module's time), in
    # order; beside them, the command whose argument is raw bytes goes through the real
    # `leadgate` script as the shell would start it.
    argv_bytes = phases[1].pop("argv_bytes")
    with ThreadPoolExecutor(max_workers=1) as pool:
        real = pool.submit(run, cfg, *argv_bytes)
        commands = [(name, args) for batch in phases for name, args in batch.items()]
        done = cli_batch(
            sys.executable,
            cfg,
            [args for _, args in commands],
            env=_env(),
            cwd=root,
            timeout=TIMEOUT * 3,
        )
        r["argv_bytes"] = real.result()
    for (name, _), one in zip(commands, done, strict=True):
        r[name] = Run(tuple(one.args), one.code, one.out.strip(), one.err.strip())
    return {"runs": r, "config": cfg, "db": root / "lg.db"}


UNMIGRATED: dict[str, list[str]] = {
    "org": ["org", "create", "acme"],
    "serve": ["serve"],
}


def runs(world: dict[str, Any]) -> dict[str, Run]:
    result: dict[str, Run] = world["runs"]
    return result


def db_rows(world: dict[str, Any], sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(world["db"]) as conn:
        return conn.execute(sql).fetchall()


# ------------------------------------------------------------------------- tests


def test_db_upgrade_prints_the_revision(world: dict[str, Any]) -> None:
    body = runs(world)["upgrade"].json()
    assert set(body) == {"revision"} and body["revision"]


@pytest.mark.parametrize("command", sorted(UNMIGRATED))
def test_every_command_before_db_upgrade_says_to_run_it(
    world: dict[str, Any], command: str
) -> None:
    result = runs(world)[f"fresh:{command}"]
    assert result.code == 2, result
    assert "leadgate db upgrade" in result.err
    assert "[db.not_migrated]" in result.err
    assert "Traceback" not in result.err
    if command != "serve":
        assert result.out == ""


def test_org_create_prints_id_name_and_an_owner_key(world: dict[str, Any]) -> None:
    body = runs(world)["org"].json()
    assert set(body) == {"id", "name", "apiKey"}
    assert body["name"] == "acme"
    assert body["apiKey"].startswith("lg.")
    # the key is stored hashed only
    secret = body["apiKey"].split(".")[2]
    rows = db_rows(world, "SELECT * FROM api_keys")
    assert rows and secret not in repr(rows)


def test_duplicate_org_is_a_rule_error(world: dict[str, Any]) -> None:
    result = runs(world)["org_dup"]
    result.rule_error("org.name_taken")
    assert "acme" in result.err
    assert db_rows(world, "SELECT count(*) FROM organizations WHERE name = 'acme'") == [(1,)]


def test_key_create(world: dict[str, Any]) -> None:
    body = runs(world)["key"].json()
    # The secret as `org create` and `demo` print theirs, `apiKey` (it was `key` alone);
    # `key`, the same secret, stays for scripts written against earlier releases.
    assert set(body) == {"id", "apiKey", "key", "scopes"}
    assert body["scopes"] == ["agent:review"]
    assert body["apiKey"].startswith(f"lg.{body['id']}.")
    assert body["key"] == body["apiKey"]
    runs(world)["key_bad"].rule_error("key.scope")
    assert "agent:everything" in runs(world)["key_bad"].err
    [(scopes,)] = db_rows(world, f"SELECT scopes FROM api_keys WHERE id = '{body['id']}'")
    assert json.loads(scopes) == ["agent:review"]


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("lead_missing", "lead.not_found"),
        ("lead_inactive", "lead.inactive"),
        ("lead_deleted", "lead.deleted"),
        ("lead_self", "lead.self"),
        ("preset_has_lead", "lead.preset_has_lead"),
        ("policy_name", "leadReviewConfig.completionPolicy"),
        ("rounds_0", "leadReviewConfig.maxRevisionRounds"),
    ],
)
def test_agent_save_rules_exit_2_naming_the_rule(
    world: dict[str, Any], name: str, rule: str
) -> None:
    runs(world)[name].rule_error(rule)


def test_rejected_agent_saves_wrote_nothing(world: dict[str, Any]) -> None:
    names = {row[0] for row in db_rows(world, "SELECT name FROM agents")}
    assert names == {"lead", "idle", "gone", "worker"}
    [(lead_id,)] = db_rows(world, "SELECT id FROM agents WHERE name = 'lead'")
    [(worker_lead,)] = db_rows(world, "SELECT lead_agent_id FROM agents WHERE name = 'worker'")
    assert worker_lead == lead_id


def test_agent_create_output_shows_the_resolved_lead(world: dict[str, Any]) -> None:
    lead = runs(world)["lead"].json()
    assert lead["name"] == "lead" and lead["model"] == "script" and lead["active"] is True
    assert lead["lead"] is None
    worker = runs(world)["worker"].json()
    assert worker["lead"] == {
        "leadAgentId": lead["id"],
        "completionPolicy": "requestHumanApproval",
        "maxRevisionRounds": 3,
        "source": "agent",
    }
    assert "leadAgentId" not in worker and "leadReviewConfig" not in worker


def test_agent_update_deactivate_and_delete(world: dict[str, Any]) -> None:
    idle = runs(world)["deactivate"].json()
    assert idle["active"] is False
    gone = runs(world)["delete"].json()
    assert gone["active"] is False
    [(deleted_at,)] = db_rows(world, "SELECT deleted_at FROM agents WHERE name = 'gone'")
    assert deleted_at is not None
    [(active, deleted)] = db_rows(
        world, "SELECT active, deleted_at FROM agents WHERE name = 'idle'"
    )
    assert (active, deleted) == (0, None)


def test_org_and_agent_lists(world: dict[str, Any]) -> None:
    """An operator sees organizations and agents without the REST API."""
    assert [o["name"] for o in runs(world)["org_list"].json()] == ["acme"]
    agents = {a["name"]: a for a in runs(world)["agent_list"].json()}
    assert "gone" not in agents  # deleted
    assert agents["idle"]["active"] is False
    assert agents["worker"]["leadName"] == "lead"
    assert agents["worker"]["lead"]["source"] == "agent"
    assert agents["lead"]["leadName"] is None
    header, *rows = runs(world)["agent_table"].out.splitlines()
    assert header.split() == ["ID", "NAME", "MODEL", "ACTIVE", "LEADNAME", "PRESETID", "UPDATEDAT"]
    assert any(row.split()[1:5] == ["worker", "script", "True", "lead"] for row in rows)


def test_presets(world: dict[str, Any]) -> None:
    runs(world)["platform_lead"].rule_error("preset.platform_lead")
    reviewed = runs(world)["preset"].json()
    assert reviewed["kind"] == "organization"
    assert reviewed["leadReviewConfig"] == {
        "completionPolicy": "requestHumanApproval",
        "maxRevisionRounds": 3,
    }
    assert db_rows(world, "SELECT name, org_id IS NULL FROM presets") == [("reviewed", 0)]


def test_policy_route_and_schedule_errors(world: dict[str, Any]) -> None:
    runs(world)["policy_bad"].rule_error("policy.pattern")
    runs(world)["route_bad"].rule_error("route.match")
    assert "guild" in runs(world)["route_bad"].err
    runs(world)["cron_bad"].rule_error("schedule.cron")
    runs(world)["cron_step"].rule_error("schedule.cron")
    assert "step 99999999999999999999 of the minute field" in runs(world)["cron_step"].err
    # Nothing to change: the agent as it is, and nothing written (updatedAt kept).
    same = runs(world)["update_nothing"].json()
    assert same["updatedAt"] == runs(world)["worker"].json()["updatedAt"]
    runs(world)["rotate_alone"].rule_error("demo.rotate_key")
    runs(world)["argv_bytes"].rule_error("cli.utf8")
    assert "the pattern argument is not valid UTF-8" in runs(world)["argv_bytes"].err
    for name, says in [
        ("nodes_deep", "nested deeper than 64 levels"),
        ("nodes_surrogate", "lone UTF-16 surrogate"),
        ("nodes_latin1", "latin1.json is not UTF-8 text"),
    ]:
        runs(world)[name].rule_error("flow.nodes")
        assert says in runs(world)[name].err, runs(world)[name]
    for table in ("policy_rules", "routes", "schedules", "flows"):
        assert db_rows(world, f"SELECT count(*) FROM {table}") == [(0,)], table


# ------------------------------------------------------- metrics and logs in-process


def turn_counts(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for match in re.finditer(r'^leadgate_turns_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        counts[match.group(1)] = float(match.group(2))
    return counts


async def test_metrics_count_turns_and_the_key_never_reaches_the_logs(
    service: App, caplog: pytest.LogCaptureFixture
) -> None:
    org = await make_org(service)
    await make_agent(service, org, "lead")
    await make_agent(service, org, "worker", lead="lead")
    plain = await make_agent(service, org, "plain")
    secret = org.key.split(".")[2]
    caplog.set_level(logging.DEBUG)

    async with TestClient(TestServer(service.web_app(), host="127.0.0.1")) as client:
        before = turn_counts(await (await client.get("/metrics")).text())
        auth = {"Authorization": f"Bearer {org.key}"}

        async def chat(agent: str, text: str, session: str) -> Any:
            body = {"model": agent, "messages": [{"role": "user", "content": text}]}
            headers = {**auth, "X-Session-Id": session}
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            return resp.status, await resp.json()

        status, body = await chat("plain", "hello", "a")
        assert status == 200 and body["choices"][0]["message"]["content"] == "Echo: hello"
        status, body = await chat("worker", "ship it #complete", "b")
        assert status == 409 and body["error"]["code"] == "LEAD_REVIEW_PENDING"
        assert body["error"]["workItemId"] is None
        status, body = await chat("worker", "are you done?", "b")
        assert status == 409 and "workItemId" not in body["error"]
        # a wrong secret is refused without echoing it
        resp = await client.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {org.key}x"},
        )
        assert resp.status == 401
        assert secret not in await resp.text()

        after_text = await (await client.get("/metrics")).text()
        after = turn_counts(after_text)
    for outcome in ("plain", "gated", "busy"):
        assert after.get(outcome, 0) - before.get(outcome, 0) == 1, outcome
    assert "# TYPE leadgate_turns_total counter" in after_text

    # also straight through the engine, with the key authenticated by the service
    principal = await service.access.principal(org.key, None)
    assert principal is not None and principal.org_id == org.id
    await service.turns.run(api_trigger(org, plain, "again"))

    assert caplog.records, "DEBUG logging was captured"
    for record in caplog.records:
        assert secret not in record.getMessage()
        assert secret not in repr(record.args)
    assert secret not in caplog.text
