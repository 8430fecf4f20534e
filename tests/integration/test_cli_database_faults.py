"""What a command says when it meets a database fault (PostgreSQL, in process).

A write that commits in doubt (the COMMIT landed and its answer was lost) says the change
may have been made, so look before running it again: run again blindly, ``key create``
makes a second key (nothing names the first). A command that only reads (``list``,
``show``) says the database is unavailable, not that nothing was stored."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from leadgate.cli.main import main
from leadgate.database import schema as t
from tests.statement_faults import PgFaults


@pytest.fixture
def config(migrated_pg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A config naming the database, with organization ``acme`` made."""
    path = tmp_path / "config.toml"
    path.write_text(f'[database]\nurl = "{migrated_pg}"\n')
    assert main(["--config", str(path), "org", "create", "acme"]) == 0
    capsys.readouterr()
    return path


def test_a_command_whose_commit_is_in_doubt_says_it_may_have_been_made(
    config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO api_keys", then="COMMIT", after_commit=True)
    code = main(
        ["--config", str(config), "key", "create", "--org", "acme", "--scope", "agent:trigger"]
    )
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    assert (code, out) == (2, ""), err
    assert "may have been made" in err and "nothing was stored" not in err, err
    assert err.rstrip().endswith("[service.unavailable]"), err
    # It had: the key is there (beside the owner key org create made).
    assert main(["--config", str(config), "key", "list", "--org", "acme"]) == 0
    assert capsys.readouterr().out.count('"scopes": ["agent:trigger"]') == 1


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


#: A flow of one output node: ``flow run`` completes it without a model.
ONE_OUTPUT = '[{"type": "output", "value": "done"}]'


@pytest.fixture
def flow(config: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """``config`` with the flow ``f`` (one output node) made in ``acme``."""
    args = ["--config", str(config), "flow", "create", "--org", "acme", "--name", "f"]
    assert main([*args, "--nodes", ONE_OUTPUT]) == 0
    capsys.readouterr()
    return config


def _runs(url: str) -> list[tuple[str, str]]:
    """Every flow run stored (id, status), read beside the command."""
    from leadgate.database.db import Database

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
def test_a_flow_run_whose_start_is_in_doubt_reads_it_back_and_runs_it_once(
    flow: Path,
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """``flow run``: the connection dropped with the start's COMMIT sent (it landed, or
    it did not). The command stores the run again under its own id (a no-op when the
    first landed) and runs it: one run, completed, printed, exit 0. It said "it may have
    been made; look (list or show)", with no run id to show and no list of runs, and a
    run that had landed waited out its 2-minute lease for a worker."""
    faults = PgFaults(monkeypatch)
    faults.arm_on("INSERT INTO flow_runs", then="COMMIT", after_commit=landed)
    code = main(["--config", str(flow), "flow", "run", "--org", "acme", "f"])
    faults.disarm()
    out, err = capsys.readouterr()
    assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
    assert code == 0, err
    assert "its start's COMMIT was in doubt; it is stored" in err, err
    run = json.loads(out)
    assert run["status"] == "completed" and run["outputs"] == [{"data": "done", "success": True}]
    assert run["events"] == ["Flow run started", "Flow run completed"]
    assert _runs(migrated_pg) == [(run["id"], "completed")]


@pytest.mark.parametrize("landed", [True, False])
def test_a_flow_run_that_cannot_read_its_start_back_names_the_run_and_exits_3(
    flow: Path,
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    landed: bool,
) -> None:
    """The database still away when ``flow run`` reads its start back: exit 3 (not 2,
    "refused"), naming the run and how to tell whether it was started; ``flow show``
    then says it (found and running: a worker's recovery continues it; not found: run
    the command again, which starts it)."""
    faults = PgFaults(monkeypatch)
    faults.arm_on(
        "INSERT INTO flow_runs", then="COMMIT", after_commit=landed, and_on="INTO flow_runs"
    )
    code = main(["--config", str(flow), "flow", "run", "--org", "acme", "f"])
    faults.disarm()
    out, err = capsys.readouterr()
    assert (code, out) == (3, ""), err
    assert err.rstrip().endswith("[flow.start_in_doubt]"), err
    [run_id] = re.findall(r"flow run (run_\w+) may have been started", err)
    # The command it names, as given:
    [show] = re.findall(r"`leadgate (flow show --org \S+ (\S+))`", err)
    assert show[1] == run_id, err
    shown = main(["--config", str(flow), *show[0].split()])
    out, err = capsys.readouterr()
    if landed:
        assert shown == 0 and json.loads(out)["status"] == "running", err
    else:
        assert shown == 2 and err.rstrip().endswith("[flowRun.not_found]"), err
        assert main(["--config", str(flow), "flow", "run", "--org", "acme", "f"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "completed"
    assert len(_runs(migrated_pg)) == 1
