"""What a command says when it meets a database fault (PostgreSQL, in process).

A write that commits in doubt (the COMMIT landed and its answer was lost) says the change
may have been made, so look before running it again: run again blindly, ``key create``
makes a second key (nothing names the first). A command that only reads (``list``,
``show``) says the database is unavailable, not that nothing was stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from leadgate.cli.main import main
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
