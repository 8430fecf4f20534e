"""``leadgate notify ...`` and ``leadgate user link|unlink|links`` through the real CLI
entry point (``leadgate.cli.main.main``, in process) on a temporary SQLite database:
JSON on stdout, rule errors on stderr with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from leadgate.cli.main import main
from tests.service_proc import clone_sqlite


class Cli:
    def __init__(self, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.config = config
        self.capsys = capsys

    def run(self, *args: str) -> tuple[int, Any, str]:
        code = main(["--config", str(self.config), *args])
        out, err = self.capsys.readouterr()
        return code, (json.loads(out) if out.strip() else None), err

    def ok(self, *args: str) -> Any:
        code, out, err = self.run(*args)
        assert code == 0, err
        return out

    def rule(self, rule: str, *args: str) -> str:
        code, out, err = self.run(*args)
        assert (code, out) == (2, None), err
        assert err.rstrip().endswith(f"[{rule}]"), err
        return err


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], demo_cli_template: Path) -> Cli:
    return demo_cli(tmp_path, capsys, demo_cli_template)


def demo_config(directory: Path) -> Path:
    """``directory/leadgate.toml`` on the SQLite file ``directory/l.db`` (Slack set up)."""
    config = directory / "leadgate.toml"
    config.write_text(
        f'[database]\nurl = "sqlite+aiosqlite:///{directory}/l.db"\n'
        '[slack]\nsigning_secret = "s"\nbot_token = "xoxb-1"\n',
        encoding="utf-8",
    )
    return config


def seed_demo_cli(directory: Path) -> Path:
    """Through the CLI entry point: ``db upgrade``, ``demo`` and two console users into
    ``directory/l.db``; returns that file."""
    config = demo_config(directory)
    for args in (
        ("db", "upgrade"),
        ("demo",),
        ("user", "create", "--org", "demo", "--email", "ann@x.io", "--role", "Member",
         "--password", "password1"),
        ("user", "create", "--org", "demo", "--email", "vic@x.io", "--role", "Viewer",
         "--password", "password1"),
    ):  # fmt: skip
        assert main(["--config", str(config), *args]) == 0, args
    return directory / "l.db"


def demo_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], template: Path) -> Cli:
    """A migrated SQLite database with the demo organization and two console users: a
    copy of ``template`` (:func:`seed_demo_cli`, made once per session as the
    ``demo_cli_template`` fixture; the four commands cost about a second a test)."""
    config = demo_config(tmp_path)
    clone_sqlite(template, tmp_path / "l.db")
    capsys.readouterr()
    return Cli(config, capsys)


def test_notify_add_list_remove_and_sla(cli: Cli) -> None:
    slack = cli.ok("notify", "add", "--org", "demo", "--channel", "slack", "--to", "T01:C0REV")
    assert (slack["channel"], slack["to"], slack["tier"], slack["agent"]) == (
        "slack", "T01:C0REV", "notify", None,
    )  # fmt: skip
    assert slack["channelConfigured"] is True
    again = cli.ok("notify", "add", "--org", "demo", "--channel", "slack", "--to", "T01:C0REV")
    assert again["id"] == slack["id"]  # the same destination twice is one
    mail = cli.ok(
        "notify", "add", "--org", "demo", "--channel", "email", "--to", "boss@x.io",
        "--agent", "worker", "--escalation",
    )  # fmt: skip
    assert (mail["tier"], mail["agent"], mail["channelConfigured"]) == ("escalate", "worker", False)
    discord = cli.ok("notify", "add", "--org", "demo", "--channel", "discord", "--to", "1234567")
    listed = cli.ok("notify", "list", "--org", "demo")
    assert [d["id"] for d in listed["destinations"]] == [slack["id"], mail["id"], discord["id"]]
    assert listed["sla"]["effective"] == {
        "remindAfter": "30m", "remindEvery": "off", "escalateAfter": "off", "expireAfter": "off",
    }  # fmt: skip

    out = cli.ok(
        "notify", "sla", "--org", "demo", "--agent", "worker", "--remind-after", "10m",
        "--expire-after", "1d",
    )  # fmt: skip
    assert out["effective"]["remindAfter"] == "10m" and out["effective"]["expireAfter"] == "1d"
    out = cli.ok("notify", "sla", "--org", "demo", "--agent", "worker", "--remind-after", "inherit")
    assert out["override"]["remindAfter"] == "inherit" and out["effective"]["remindAfter"] == "30m"
    off = cli.ok("notify", "sla", "--org", "demo", "--remind-after", "off")
    assert off["effective"]["remindAfter"] == "off"

    removed = cli.ok("notify", "remove", "--org", "demo", discord["id"])
    assert removed == {"id": discord["id"], "removed": True}
    cli.rule("notify.not_found", "notify", "remove", "--org", "demo", discord["id"])
    assert len(cli.ok("notify", "list", "--org", "demo", "--agent", "worker")["destinations"]) == 2


@pytest.mark.parametrize(
    ("channel", "target", "rule"),
    [
        ("slack", "#reviews", "notify.target"),
        ("discord", "reviews", "notify.target"),
        ("email", "not-an-address", "notify.target"),
        ("teams", "19:never-seen@thread.tacv2", "notify.teams_unknown_conversation"),
        ("teams", '{"conversation": {}}', "notify.target"),
    ],
)
def test_notify_add_says_what_a_target_is(cli: Cli, channel: str, target: str, rule: str) -> None:
    cli.rule(rule, "notify", "add", "--org", "demo", "--channel", channel, "--to", target)


def test_notify_sla_rejects_bad_durations(cli: Cli) -> None:
    cli.rule("duration.format", "notify", "sla", "--org", "demo", "--escalate-after", "soon")
    cli.rule("notify.sla", "notify", "sla", "--org", "demo")
    cli.rule("agent.not_found", "notify", "sla", "--org", "demo", "--agent", "nobody",
             "--remind-after", "5m")  # fmt: skip


def test_user_link_unlink_and_links(cli: Cli) -> None:
    ann = cli.ok("user", "link", "--org", "demo", "--email", "ann@x.io", "--slack", "T01:U0ANN")
    assert ann == {
        "email": "ann@x.io", "role": "Member", "platform": "slack", "identity": "T01:U0ANN",
        "canReview": True,
    }  # fmt: skip
    vic = cli.ok("user", "link", "--org", "demo", "--email", "vic@x.io", "--discord", "99999999")
    assert vic["canReview"] is False
    teams = cli.ok(
        "user", "link", "--org", "demo", "--email", "ann@x.io", "--teams",
        "0000AAAA-0000-0000-0000-000000000001",
    )  # fmt: skip
    assert teams["identity"] == "0000aaaa-0000-0000-0000-000000000001"
    cli.rule("link.taken", "user", "link", "--org", "demo", "--email", "vic@x.io",
             "--slack", "T01:U0ANN")  # fmt: skip
    cli.rule("link.identity", "user", "link", "--org", "demo", "--email", "ann@x.io",
             "--slack", "U0ANN")  # fmt: skip
    cli.rule("user.not_found", "user", "link", "--org", "demo", "--email", "zed@x.io",
             "--discord", "12345")  # fmt: skip
    links = cli.ok("user", "links", "--org", "demo")
    assert [(link["email"], link["platform"]) for link in links] == [
        ("ann@x.io", "slack"), ("ann@x.io", "teams"), ("vic@x.io", "discord"),
    ]  # fmt: skip
    out = cli.ok("user", "unlink", "--org", "demo", "--email", "ann@x.io", "--slack", "T01:U0ANN")
    assert out["unlinked"] is True
    cli.rule("link.not_found", "user", "unlink", "--org", "demo", "--email", "ann@x.io",
             "--slack", "T01:U0ANN")  # fmt: skip
    with pytest.raises(SystemExit) as exited:  # argparse: exactly one platform
        cli.run("user", "link", "--org", "demo", "--email", "ann@x.io")
    assert exited.value.code == 2
    err = cli.capsys.readouterr().err
    assert "one of the arguments --slack --teams --discord is required" in err
