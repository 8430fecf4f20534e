"""Command-line edges found by the session 35 audit follow-up, through the real entry point
(``leadgate.cli.main.main``, in process): options that contradict each other, a repeated
match key, a misspelt agent filter, agent names in another case, the table format of
``route list`` and ``notify list``, and database paths SQLite cannot use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from leadgate.cli.main import main
from leadgate.core.errors import QUOTE_LIMIT
from tests.integration.test_review_cli import Cli, demo_cli


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], demo_cli_template: Path) -> Cli:
    return demo_cli(tmp_path, capsys, demo_cli_template)


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``args``; it must be a usage error: exit 2, nothing on stdout, ``[cli.usage]``."""
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, ""), err
    assert err.rstrip().endswith("[cli.usage]"), err
    return err


def test_contradicting_options_are_refused_before_anything_changes(
    cli: Cli, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ["--config", str(cli.config)]
    before = cli.ok("agent", "update", "worker", "--org", "demo")
    err = usage_error(
        capsys, *config, "agent", "update", "worker", "--org", "demo", "--activate", "--deactivate"
    )
    assert "not allowed with argument" in err
    usage_error(capsys, *config, "agent", "update", "worker", "--org", "demo", "--delete",
                "--activate")  # fmt: skip
    usage_error(capsys, *config, "agent", "update", "worker", "--org", "demo", "--no-lead",
                "--lead", "lead")  # fmt: skip
    after = cli.ok("agent", "update", "worker", "--org", "demo")
    assert after == before  # nothing to change: nothing written, updatedAt kept
    # A mistyped command says the rule too.
    usage_error(capsys, *config, "agent", "updat", "worker")


def test_a_match_key_given_twice_is_refused(cli: Cli) -> None:
    err = cli.rule(
        "route.match", "route", "add", "--org", "demo", "--agent", "worker", "--channel",
        "slack", "--match", "channel=C1", "--match", "channel=C2",
    )  # fmt: skip
    assert "'channel' given twice" in err
    assert cli.ok("route", "list", "--org", "demo") == []


def test_an_agent_filter_naming_no_agent_is_an_error_not_an_empty_queue(cli: Cli) -> None:
    cli.rule("agent.not_found", "review", "list", "--org", "demo", "--agent", "nosuch")
    assert cli.ok("review", "list", "--org", "demo", "--agent", "worker")["items"] == []


def test_agent_names_are_found_in_any_case(cli: Cli) -> None:
    """Names are unique by slug, so "WORKER" can only mean the agent "worker"."""
    worker = cli.ok("agent", "update", "worker", "--org", "demo")
    assert cli.ok("agent", "update", "WORKER", "--org", "demo")["id"] == worker["id"]
    route = cli.ok(
        "route", "add", "--org", "demo", "--agent", "Worker", "--channel", "slack",
        "--match", "channel=C1",
    )  # fmt: skip
    assert route["agentId"] == worker["id"]
    cli.ok("review", "list", "--org", "demo", "--agent", "WoRkEr")


def test_table_format_of_routes_and_review_destinations(
    cli: Cli, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = cli.ok("agent", "update", "worker", "--org", "demo")
    cli.ok("route", "add", "--org", "demo", "--agent", "worker", "--channel", "slack",
           "--match", "channel=C1")  # fmt: skip
    cli.ok("notify", "add", "--org", "demo", "--channel", "slack", "--to", "T01:C0REV")
    config = ["--config", str(cli.config), "--format", "table"]

    assert main([*config, "route", "list", "--org", "demo"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "AGENT", "CHANNEL", "MATCH", "SILENT", "ACTIVE"]
    assert row.split()[1] == worker["name"] and '{"channel":' in row

    assert main([*config, "notify", "list", "--org", "demo"]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out, out  # no Python dict printed raw
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "CHANNEL", "TO", "TIER", "AGENT", "CREATEDAT"]
    assert lines[1].split()[1:5] == ["slack", "T01:C0REV", "notify", "-"]
    assert "Review timers:" in lines
    assert any(line.split() == ["remindAfter", "inherit", "30m"] for line in lines), out


@pytest.mark.parametrize("shape", ["missing", "directory", "no_folder"])
def test_a_database_path_sqlite_cannot_use_is_a_clear_error_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    db = {
        "missing": tmp_path / "typo.db",
        "directory": tmp_path / "dir.db",
        "no_folder": tmp_path / "nowhere" / "l.db",
    }[shape]
    if shape == "directory":
        db.mkdir()
    config = tmp_path / "leadgate.toml"
    config.write_text(f'[database]\nurl = "sqlite+aiosqlite:///{db}"\n', encoding="utf-8")
    commands = [["review", "list", "--org", "demo"], ["org", "create", "acme"]]
    if shape != "missing":
        commands.append(["db", "upgrade"])  # upgrade creates a missing file, as it should
    for command in commands:
        assert main(["--config", str(config), *command]) == 2, command
        out, err = capsys.readouterr()
        assert out == "" and "Traceback" not in err
        says = {
            "missing": f"the database file {db} does not exist",
            "directory": f"names a directory, not a database file: {db}",
            "no_folder": f"the folder of the database file does not exist: {db.parent}",
        }[shape]
        assert says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["leadgate.toml", *(["dir.db"] if shape == "directory" else [])]
    )


class EndlessInput:
    """A standard input that never ends (``yes |``, ``< /dev/zero``): read only with a
    bound (a read without one never returned, holding more and more memory)."""

    def isatty(self) -> bool:
        return False

    def read(self, size: int = -1) -> str:
        assert size >= 0, "standard input read without a bound"
        return "y" * size

    def readline(self, size: int = -1) -> str:
        return self.read(size)


def test_endless_input_is_read_up_to_a_bound(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEADGATE_PASSWORD", raising=False)
    monkeypatch.setattr("sys.stdin", EndlessInput())
    for flag, rule in (("--reason", "decision.reason"), ("--feedback", "decision.feedback")):
        action = "reject" if flag == "--reason" else "return"
        err = cli.rule(rule, "review", action, "--org", "demo", "wi_any", flag, "-")
        assert "standard input is longer than 1,048,576 characters" in err
    err = cli.rule("user.password", "user", "create", "--org", "demo", "--email",
                   "e@example.com", "--role", "member")  # fmt: skip
    assert "password must be 8 to 1,024 characters" in err
    nodes = tmp_path / "nodes.json"
    nodes.write_text("[" + " " * 1024 * 1024 + "]", encoding="utf-8")
    err = cli.rule("flow.nodes", "flow", "create", "--org", "demo", "--name", "f",
                   "--nodes", f"@{nodes}")  # fmt: skip
    assert f"{nodes} is longer than 1,048,576 characters" in err
    users = cli.ok("user", "list", "--org", "demo")
    assert "e@example.com" not in [user["email"] for user in users]


def test_an_error_quoting_a_line_break_or_an_escape_stays_one_inert_line(cli: Cli) -> None:
    """An id pasted from a chat message: its line break split the error in two (scripts
    read the last line for the ``[rule]``), and its escape sequence acted on the
    terminal (here: clear the screen)."""
    err = cli.rule("workItem.not_found", "review", "show", "--org", "demo", "wi_1\nb\x1b[2J")
    assert err.count("\n") == 1 and "\x1b" not in err, err
    assert "no work item 'wi_1\\nb\\x1b[2J' (config: " in err, err


def _raising(raised: BaseException) -> Callable[..., NoReturn]:
    """A stand-in for a step of the command that meets ``raised`` (a real Ctrl-C at
    that step cannot be timed in a test)."""

    def interrupted(*_: object) -> NoReturn:
        raise raised

    return interrupted


@pytest.mark.parametrize(
    ("step", "by_pydantic"),
    [("discover", False), ("discover", True), ("check_text_arguments", True)],
)
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: str, by_pydantic: bool
) -> None:
    # Ctrl-C before the command knew its configuration (discover, and loading the
    # configuration's modules, ran outside the handler) was a KeyboardInterrupt
    # traceback; met while pydantic builds a model class, which says RuntimeError "Error
    # calling __set_name__" from it, a traceback too, or exit 1 `[internal]`.
    raised: BaseException = KeyboardInterrupt()
    if by_pydantic:
        raised = RuntimeError("Error calling __set_name__ on 'PydanticDescriptorProxy'")
        raised.__cause__ = KeyboardInterrupt()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(f"leadgate.cli.main.{step}", _raising(raised))
        try:
            code: int | None = main(["--config", str(tmp_path / "none.toml"), "org", "list"])
        except (KeyboardInterrupt, RuntimeError) as exc:
            code = None
            print(repr(exc))
    out, err = capsys.readouterr()
    assert (code, out) == (130, ""), (out, err)
    assert err.startswith("leadgate: error: interrupted (Ctrl-C)"), err
    assert err.rstrip().endswith("[cli.interrupted]") and err.count("\n") == 1, err


def test_a_long_id_on_the_command_line_is_quoted_short(cli: Cli) -> None:
    """An id that names nothing is quoted in the error at most its first 80 characters
    and its length: 5,000 characters given came back whole (``no work item ...``,
    ``no delivery ...``, ``no flow run ...``, ``no route ...``, ``no review
    destination ...``, ``no user ...``)."""
    long = "ghost-" + "x" * 4_994
    for rule, args in (
        ("workItem.not_found", ("review", "show", "--org", "demo", long)),
        ("workItem.not_found", ("review", "cancel", "--org", "demo", long)),
        ("delivery.not_found", ("delivery", "retry", "--org", "demo", long)),
        ("flowRun.not_found", ("flow", "show", "--org", "demo", long)),
        ("route.not_found", ("route", "disable", "--org", "demo", long)),
        ("notify.not_found", ("notify", "remove", "--org", "demo", long)),
        ("key.not_found", ("key", "revoke", "--org", "demo", long)),
        (
            "user.not_found",
            ("user", "unlink", "--org", "demo", "--email", long, "--discord", "1234567890"),
        ),
    ):
        err = cli.rule(rule, *args)
        said = err.split(" (config: ")[0]  # the paths' length depends on the test's tmp
        assert len(said) < QUOTE_LIMIT + 100, err
        assert "'ghost-xxx" in err and "(5,000 characters)" in err, err
