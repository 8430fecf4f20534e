"""The configuration as the ``leadgate`` command meets it (``leadgate.cli.main.main``, in
process): a relative SQLite path follows the config file, not the current directory;
every configuration error is one line, exit 2, ending in a dotted rule; a client's
``LEADGATE_*`` variables do not stop a command; a database that cannot be reached, or
refuses the URL's login, is one line naming why."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from leadgate.cli.main import main
from tests.pg import PostgresServer


@pytest.fixture(autouse=True)
def _no_leadgate_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LEADGATE_")]:
        monkeypatch.delenv(name)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_relative_database_path_follows_the_config_file_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `./lg.db` was opened in the current directory: run from elsewhere, a command found
    # no database and `db upgrade` made a second one, empty.
    conf, here, there = (tmp_path / name for name in ("conf", "here", "there"))
    for folder in (conf, here, there):
        folder.mkdir()
    config = conf / "config.toml"
    config.write_text('[database]\nurl = "sqlite+aiosqlite:///./lg.db"\n', encoding="utf-8")
    monkeypatch.chdir(here)
    assert run(capsys, "--config", str(config), "db", "upgrade")[0] == 0
    code, out, err = run(capsys, "--config", "../conf/config.toml", "org", "create", "acme")
    assert code == 0, err
    monkeypatch.chdir(there)
    code, out, err = run(capsys, "--config", str(config), "key", "list", "--org", "acme")
    assert code == 0, err
    assert len(json.loads(out)) == 1
    assert [p.name for p in tmp_path.rglob("*.db")] == ["lg.db"]
    assert (conf / "lg.db").is_file()
    # An error names the database by its absolute path.
    code, out, err = run(capsys, "--config", str(config), "key", "list", "--org", "nope")
    assert code == 2 and f"database: sqlite+aiosqlite:///{conf}/lg.db)" in err


@pytest.mark.parametrize(
    ("contents", "rule"),
    [
        (b"[server\nport = = 1\n", "config.toml"),
        (b'[server]\nhost = "caf\xe9"\n', "config.encoding"),
        (None, "config.file"),  # no such file
        (b"[server]\nport = true\n", "config.invalid"),
        (b"[server]\nbogus = 1\n", "config.unknown_key"),
        (b'[email]\nreview_reply_address = "review@reviews.example.com"\n', "config.invalid"),
        (b'[database]\nurl = "sqlite:///./plain.db"\n', "database.url"),
        (b'[database]\nurl = "postgresql://u:pw@127.0.0.1/x"\n', "database.url"),
        (b'[database]\nurl = "sqlite+aiosqlite://"\n', "database.url"),
        (b'[database]\nurl = "sqlite+aiosqlite:///:memory:"\n', "database.url"),
        (b'[database]\nurl = "sqlite+aiosqlite:///./bad.db"\n', "database.file"),
    ],
)
def test_a_configuration_error_is_one_line_ending_in_a_dotted_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], contents: bytes | None, rule: str
) -> None:
    config = tmp_path / "config.toml"
    if contents is not None:
        config.write_bytes(contents)
    (tmp_path / "bad.db").write_text("hello\n")
    for command in (["db", "upgrade"], ["key", "list", "--org", "acme"]):
        code, out, err = run(capsys, "--config", str(config), *command)
        assert (code, out) == (2, ""), err
        assert err.count("\n") == 1 and err.rstrip().endswith(f"[{rule}]"), err
        for driver_text in ("Traceback", "[SQL:", "sqlalche.me", "config_error"):
            assert driver_text not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["bad.db", *(["config.toml"] if contents is not None else [])]
    )


def test_a_damaged_sqlite_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file with a valid header and damaged pages was the driver's "database disk image
    is malformed" with its SQL, exit 1: where the first statement meets it (the schema's
    pages), and where a command's own query does (one table's pages)."""
    db = tmp_path / "lg.db"
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "sqlite+aiosqlite:///{db}"\n')
    assert run(capsys, "--config", str(config), "db", "upgrade")[0] == 0
    assert run(capsys, "--config", str(config), "org", "create", "acme")[0] == 0
    with sqlite3.connect(db) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='api_keys'")
        api_keys = root.fetchone()[0]
    conn.close()
    good = db.read_bytes()

    def damage(first_page: int, pages: int) -> None:
        data = bytearray(good)
        start = (first_page - 1) * page
        data[start : start + pages * page] = b"\x07" * (pages * page)
        db.write_bytes(bytes(data))

    for first_page, pages, commands in (
        (2, 60, (["db", "upgrade"], ["org", "list"])),  # the schema
        (api_keys, 1, (["key", "list", "--org", "acme"],)),  # one table, mid-command
    ):
        damage(first_page, pages)
        for command in commands:
            code, out, err = run(capsys, "--config", str(config), *command)
            assert (code, out) == (2, ""), err
            assert f"the SQLite database {db} is damaged" in err, err
            assert err.count("\n") == 1 and err.rstrip().endswith("[database.file]"), err
            assert "[SQL:" not in err and "sqlalche.me" not in err, err


def test_an_empty_config_name_is_a_config_file_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--config ""`` and ``LEADGATE_CONFIG=""`` alike (the variable fell back to
    ./config.toml or the defaults), even with a ./config.toml to fall back to."""
    code, out, err = run(capsys, "--config", "", "key", "list", "--org", "acme")
    assert (code, out) == (2, "") and err.rstrip().endswith("[config.file]"), err
    (tmp_path / "config.toml").write_text(
        '[database]\nurl = "sqlite+aiosqlite:///lg.db"\n', encoding="utf-8"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LEADGATE_CONFIG", "")
    code, out, err = run(capsys, "key", "list", "--org", "acme")
    assert (code, out) == (2, "") and err.rstrip().endswith("[config.file]"), err
    assert "from $LEADGATE_CONFIG" in err, err
    assert not (tmp_path / "lg.db").exists()


def test_client_variables_do_not_stop_a_command_and_lists_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[database]\nurl = "sqlite+aiosqlite:///lg.db"\n', encoding="utf-8")
    # A client's key stopped every command: "write LEADGATE_API__KEY", no setting either.
    monkeypatch.setenv("LEADGATE_API_KEY", "lg.key_client")
    monkeypatch.setenv("LEADGATE_SERVER__TRUSTED_PROXIES", "127.0.0.1, 10.0.0.0/8")
    code, out, err = run(capsys, "--config", str(config), "db", "upgrade")
    assert code == 0, err
    monkeypatch.setenv("LEADGATE_DATABASE_URL", "sqlite+aiosqlite:///other.db")
    code, out, err = run(capsys, "--config", str(config), "db", "upgrade")
    assert (code, out) == (2, "") and err.rstrip().endswith("[config.unknown_key]"), err
    assert "write LEADGATE_DATABASE__URL" in err


@pytest.mark.parametrize(
    ("where", "rule", "says"),
    [
        ("closed_port", "service.unavailable", "Connect call failed"),
        ("unknown_user", "database.login", "SQLSTATE 28000 invalid_authorization_specification"),
        ("unknown_database", "database.login", "SQLSTATE 3D000 invalid_catalog_name"),
    ],
)
def test_a_database_that_cannot_be_reached_or_refuses_the_login_is_one_line_naming_why(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
    where: str,
    rule: str,
    says: str,
) -> None:
    """Met by the schema check that opens every command (and by ``db upgrade``), outside
    any transaction: each was exit 1 ``[internal]`` with the driver's error type."""
    if where == "closed_port":
        with socket.socket() as held:  # bound, never listening: connections are refused
            held.bind(("127.0.0.1", 0))
            url = f"postgresql+asyncpg://lg:secret@127.0.0.1:{held.getsockname()[1]}/lg"
            results = _database_commands(tmp_path, capsys, url)
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        base = make_url(server.url)
        wrong = (
            base.set(username="nosuchuser")
            if where == "unknown_user"
            else base.set(database="nosuchdb")
        )
        results = _database_commands(tmp_path, capsys, wrong.render_as_string(False))
    for command, (code, out, err) in results.items():
        assert (code, out) == (2, ""), (command, err)
        assert err.count("\n") == 1 and err.rstrip().endswith(f"[{rule}]"), (command, err)
        assert says in err and "secret" not in err and "Traceback" not in err, (command, err)
    if where == "closed_port":  # a read is not told that nothing was stored
        assert "the database is unavailable right now" in results["list"][2]
        assert "nothing was stored" in results["create"][2]


def _database_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> dict[str, tuple[int, str, str]]:
    """``db upgrade``, a read and a write on the database at ``url``."""
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "{url}"\nbusy_timeout_s = 2\n', encoding="utf-8")
    commands = {
        "upgrade": ["db", "upgrade"],
        "list": ["key", "list", "--org", "acme"],
        "create": ["org", "create", "acme"],
    }
    return {
        name: run(capsys, "--config", str(config), *command) for name, command in commands.items()
    }
