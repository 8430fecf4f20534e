"""What a command says when it meets a database fault (PostgreSQL, in process).

A write whose COMMIT is in doubt (the connection dropped with it sent: it landed, or not)
asks the server whether it committed and ends as it did: its answer and a WARNING line,
or "nothing was stored". When the server cannot say, exit 3 names what tells (run
again blindly, ``key create`` made a second key). A command that only reads (``list``,
``show``) says the database is unavailable, not that nothing was stored."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from leadgate.app import App
from leadgate.cli.main import main
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain.orgs import KEY_PREFIX
from tests.helpers import api_trigger, make_agent, make_org
from tests.statement_faults import PgFaults

#: A flow of one output node: ``flow run`` completes it without a model.
ONE_OUTPUT = '[{"type": "output", "value": "done"}]'


@pytest.fixture
def config(migrated_pg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A config naming the database, with organization ``acme`` made."""
    path = tmp_path / "config.toml"
    path.write_text(f'[database]\nurl = "{migrated_pg}"\n')
    assert main(["--config", str(path), "org", "create", "acme"]) == 0
    capsys.readouterr()
    return path


def _keys(config: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """``acme``'s keys but the Owner key ``org create`` made, as ``key list`` shows them."""
    assert main(["--config", str(config), "key", "list", "--org", "acme"]) == 0
    keys: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return [key for key in keys if key["scopes"] == ["agent:trigger"]]


KEY_CREATE = ["key", "create", "--org", "acme", "--scope", "agent:trigger"]


@pytest.mark.parametrize("landed", [True, False])
def test_a_key_create_whose_commit_is_in_doubt_asks_the_server_whether_it_landed(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """The connection dropped with ``key create``'s COMMIT sent: the command asks the
    server whether the transaction committed. Landed: the key and its secret are
    printed (once: they were never shown), exit 0, one WARNING line; not landed: exit 2,
    nothing was stored, and no key. It exited 2 "it may have been made; look (list or
    show)" either way: a key that had landed could never be used (its secret was
    lost), and run again the command made a second one."""
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO api_keys", then="COMMIT", after_commit=landed)
    code = main(["--config", str(config), *KEY_CREATE])
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    if landed:
        assert code == 0, err
        assert "COMMIT was in doubt" in err and "the server says it committed" in err, err
        made = json.loads(out)
        assert out.count(made["apiKey"]) == 2  # (apiKey and its alias key: one print)
        assert [key["id"] for key in _keys(config, capsys)] == [made["id"]]
    else:
        assert (code, out) == (2, ""), err
        assert "nothing was stored" in err and err.rstrip().endswith("[service.unavailable]")
        assert _keys(config, capsys) == []


@pytest.mark.parametrize("landed", [True, False])
def test_a_write_in_doubt_the_server_cannot_settle_exits_3_naming_what_tells(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """The database still away when the command asks: exit 3 (not 2, "refused", which
    lets a script run it again), ``[cli.in_doubt]``, naming the command that tells and
    the key to look for; ``key list`` then shows it exactly when it landed. Never the
    secret (the key may not exist)."""
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO api_keys", then="COMMIT", after_commit=landed, and_on="txid_status")
    code = main(["--config", str(config), *KEY_CREATE])
    faults.disarm()
    out, err = capsys.readouterr()
    assert (code, out) == (3, ""), err
    assert err.rstrip().endswith("[cli.in_doubt]"), err
    assert "the change may have been made" in err and f"{KEY_PREFIX}." not in err, err
    [key_id] = re.findall(r"`leadgate key list --org acme` tells: if key (key_\w+) is listed", err)
    assert f"`leadgate key revoke --org acme {key_id}`" in err, err
    assert [key["id"] for key in _keys(config, capsys)] == ([key_id] if landed else [])


def test_a_repeatable_write_the_server_cannot_settle_says_running_it_again_is_safe(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``key revoke`` in doubt, the database still away when asked: exit 3, saying that
    running it again is safe and what a repeat answers when the first landed."""
    owner = _owner_key(config, capsys)
    faults = PgFaults(monkeypatch)
    faults.arm_on("UPDATE api_keys", then="COMMIT", after_commit=True, and_on="txid_status")
    code = main(["--config", str(config), "key", "revoke", "--org", "acme", owner])
    faults.disarm()
    out, err = capsys.readouterr()
    assert (code, out) == (3, ""), err
    assert "running the command again is safe once the database is back" in err, err
    assert "refused [key.revoked]" in err and err.rstrip().endswith("[cli.in_doubt]"), err
    assert main(["--config", str(config), "key", "revoke", "--org", "acme", owner]) == 2
    assert capsys.readouterr().err.rstrip().endswith("[key.revoked]")


def _owner_key(config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["--config", str(config), "key", "list", "--org", "acme"]) == 0
    [owner] = json.loads(capsys.readouterr().out)
    return str(owner["id"])


@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.parametrize(
    ("command", "statement", "again"),
    [
        (["key", "revoke", "--org", "acme", "{owner}"], "UPDATE api_keys", 2),
        (
            ["policy", "add", "--org", "acme", "--pattern", "x+", "--action", "block"],
            "INTO policy",
            0,
        ),
        (["org", "create", "globex"], "INSERT INTO organizations", 2),
        (
            ["flow", "create", "--org", "acme", "--name", "g", "--nodes", ONE_OUTPUT],
            "INTO flows",
            2,
        ),
    ],
)
def test_each_write_in_doubt_ends_as_its_commit_did(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    statement: str,
    again: int,
    landed: bool,
) -> None:
    """One mechanism for every command that writes: landed, its ordinary answer (exit
    0) and the WARNING line; not landed, exit 2 with nothing stored. Run again, it meets
    what is there (landed: refused, or made a second time where nothing tells them
    apart)."""
    owner = _owner_key(config, capsys)
    args = [owner if arg == "{owner}" else arg for arg in command]
    faults = PgFaults(monkeypatch)
    faults.arm_on(statement, then="COMMIT", after_commit=landed)
    code = main(["--config", str(config), *args])
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    if landed:
        assert code == 0 and "the server says it committed" in err, err
        assert json.loads(out)
    else:
        assert (code, out) == (2, "") and "nothing was stored" in err, err
    # Run again: refused as made already (exit 2), or, a policy rule, made a second time.
    assert main(["--config", str(config), *args]) == (again if landed else 0)


@pytest.mark.parametrize("command", [["key", "list"], ["review", "list"]])
def test_a_command_that_only_reads_is_not_told_nothing_was_stored(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    faults = PgFaults(monkeypatch)
    faults.arm_on("SELECT", and_on="SELECT")  # (every read, retries too)
    code = main(["--config", str(config), *command, "--org", "acme"])
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None
    assert (code, out) == (2, ""), err
    assert "the database is unavailable right now" in err, err
    assert "nothing was stored" not in err, err
    assert err.rstrip().endswith("[service.unavailable]"), err


@pytest.fixture
def flow(config: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """``config`` with the flow ``f`` (one output node) made in ``acme``."""
    args = ["--config", str(config), "flow", "create", "--org", "acme", "--name", "f"]
    assert main([*args, "--nodes", ONE_OUTPUT]) == 0
    capsys.readouterr()
    return config


def _runs(url: str) -> list[tuple[str, str]]:
    """Every flow run stored (id, status), read beside the command."""

    async def read() -> list[tuple[str, str]]:
        db = Database(url)
        try:
            async with db.read() as conn:
                rows = await conn.execute(sa.select(t.flow_runs.c.id, t.flow_runs.c.status))
                return [(row.id, row.status) for row in rows]
        finally:
            await db.close()

    return asyncio.run(read())


@pytest.mark.parametrize("landed", [True, False])
def test_a_flow_run_whose_start_is_in_doubt_ends_as_its_commit_did(
    flow: Path,
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """``flow run``: the connection dropped with the start's COMMIT sent. The command
    asks the server, as every command does. Landed: it runs the run, once, and prints
    it (exit 0, the WARNING line). Not landed: exit 2, nothing stored, and running the
    command again starts the flow once. (It stored the run again under its id, its own
    way.)"""
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO flow_runs", then="COMMIT", after_commit=landed)
    code = main(["--config", str(flow), "flow", "run", "--org", "acme", "f"])
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    if landed:
        assert code == 0 and "the server says it committed" in err, err
        run = json.loads(out)
        assert run["status"] == "completed" and run["outputs"] == [
            {"data": "done", "success": True}
        ]
        assert run["events"] == ["Flow run started", "Flow run completed"]
        assert _runs(migrated_pg) == [(run["id"], "completed")]
    else:
        assert (code, out) == (2, "") and "nothing was stored" in err, err
        assert _runs(migrated_pg) == []
        assert main(["--config", str(flow), "flow", "run", "--org", "acme", "f"]) == 0
        run = json.loads(capsys.readouterr().out)
        assert _runs(migrated_pg) == [(run["id"], "completed")]


@pytest.mark.parametrize("landed", [True, False])
def test_a_flow_run_whose_start_the_server_cannot_settle_names_the_run_and_exits_3(
    flow: Path,
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """The database still away when ``flow run`` asks: exit 3 ``[cli.in_doubt]`` (not
    2, "refused"), naming the run and the command that tells whether it was started;
    ``flow show`` then says it (found and running: a worker's recovery continues it;
    not found: run the command again, which starts it)."""
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO flow_runs", then="COMMIT", after_commit=landed, and_on="txid_status")
    code = main(["--config", str(flow), "flow", "run", "--org", "acme", "f"])
    faults.disarm()
    out, err = capsys.readouterr()
    assert (code, out) == (3, ""), err
    assert err.rstrip().endswith("[cli.in_doubt]"), err
    assert "do not start the flow again, it would run twice" in err, err
    # The command it names, as given, and the run to look for:
    [(show, run_id)] = re.findall(r"`leadgate (flow show --org acme (run_\w+))` tells", err)
    assert f"if run {run_id} is shown, it was made" in err, err
    shown = main(["--config", str(flow), *show.split()])
    out, err = capsys.readouterr()
    if landed:
        assert shown == 0 and json.loads(out)["status"] == "running", err
        assert _runs(migrated_pg) == [(run_id, "running")]
    else:
        assert shown == 2 and err.rstrip().endswith("[flowRun.not_found]"), err
        assert _runs(migrated_pg) == []
        assert main(["--config", str(flow), "flow", "run", "--org", "acme", "f"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "completed"
        assert len(_runs(migrated_pg)) == 1


def _awaiting_item(url: str) -> str:
    """A work item of a new organization ``beta`` awaiting a person's review (escalated
    by its lead), made in process through the real turn path."""

    async def seed() -> str:
        app = App(Settings.model_validate({"database": {"url": url}}), enable_adapters=False)
        try:
            org = await make_org(app, "beta")
            await make_agent(app, org, "lead")
            worker = await make_agent(app, org, "worker", lead="lead")
            out = await app.turns.run(api_trigger(org, worker, "task #complete #escalate"))
            assert isinstance(out, Gated)
            await drain(app.lead_runner)
            return str(out.work_item_id)
        finally:
            await app.stop()

    return asyncio.run(seed())


@pytest.mark.parametrize("landed", [True, False])
def test_a_review_decision_in_doubt_ends_as_its_commit_did(
    config: Path,
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """``review approve`` whose COMMIT is in doubt: landed, the item's detail (completed)
    and exit 0, and approving again is refused [workItem.status]; not landed, exit 2,
    nothing stored, and approving again approves it."""
    item = _awaiting_item(migrated_pg)
    approve = ["--config", str(config), "review", "approve", "--org", "beta", item]
    faults = PgFaults(monkeypatch)
    faults.arm_on("UPDATE work_items", then="COMMIT", after_commit=landed)
    code = main(approve)
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    if landed:
        assert code == 0 and "the server says it committed" in err, err
        assert json.loads(out)["status"] == "completed"
        assert main(approve) == 2
        assert capsys.readouterr().err.rstrip().endswith("[workItem.status]")
    else:
        assert (code, out) == (2, "") and "nothing was stored" in err, err
        assert main(approve) == 0


class Pauses:
    """:meth:`Database.committed`'s time and wait, moved by hand: each wait it asks for
    is noted in ``asked`` and moves the time on by as much at once (nothing is waited);
    the ``at``-th runs ``then`` first (what happens on the server meanwhile)."""

    def __init__(self, at: int = 0, then: Callable[[], Awaitable[object]] | None = None) -> None:
        self.now = 0.0
        self.asked: list[float] = []
        self.at, self.then = at, then

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.now += seconds
        if len(self.asked) == self.at and self.then is not None:
            await self.then()


@pytest.mark.parametrize("ends", ["COMMIT", "ROLLBACK"])
async def test_asking_whether_a_transaction_committed_waits_while_it_is_in_progress(
    migrated_pg: str, ends: str
) -> None:
    """A COMMIT the server applies late (a synchronous standby's wait, a server slow
    to see the connection go): ``committed`` asks again while the transaction is in
    progress, 10 ms on and doubling to 200 ms, and answers what it became, not "rolled
    back" from a read that came too early. Past ``busy_timeout_s`` still in progress,
    it cannot say (None). Its waits are the Database's injected ones: none is real."""
    raw = await asyncpg.connect(asyncpg_dsn(migrated_pg))
    held = raw.transaction()
    await held.start()
    xid = await raw.fetchval("SELECT txid_current()")
    bounded = Pauses()
    short = Database(
        migrated_pg, busy_timeout_s=1, monotonic=bounded.monotonic, sleep=bounded.sleep
    )
    # The transaction ends during the third wait: the fourth ask sees what it became.
    ending = Pauses(at=3, then=held.commit if ends == "COMMIT" else held.rollback)
    db = Database(migrated_pg, busy_timeout_s=5, monotonic=ending.monotonic, sleep=ending.sleep)
    try:
        assert await short.committed(xid) is None
        assert bounded.asked == [0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.2, 0.2]
        assert await db.committed(xid) is (ends == "COMMIT")
        assert ending.asked == [0.01, 0.02, 0.04]
    finally:
        await raw.close()
        await db.close()
        await short.close()
