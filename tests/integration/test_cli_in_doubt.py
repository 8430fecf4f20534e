"""A command whose write commits in doubt (PostgreSQL: the COMMIT landed and its answer
was lost) says so: the change may have been made, so look before running it again.
Run again blindly, ``key create`` makes a second key (nothing names the first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leadgate.cli.main import main
from tests.statement_faults import PgFaults


def test_a_command_whose_commit_is_in_doubt_says_it_may_have_been_made(
    migrated_pg: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "{migrated_pg}"\n')
    assert main(["--config", str(config), "org", "create", "acme"]) == 0
    capsys.readouterr()
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
