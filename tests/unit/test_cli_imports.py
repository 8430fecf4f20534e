"""What a ``leadgate`` command process imports: the admin and operator commands run
without the service's HTTP server, channel SDKs and Alembic (each ``leadgate`` process
paid about 0.3 s for them, and the suite runs a few hundred), and a command on SQLite
without the PostgreSQL driver, the metrics library, the log renderer or the turn path."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leadgate.cli.main import main

#: Loaded by ``serve`` (the composition root) and ``db upgrade`` only.
SERVICE_ONLY = ("aiohttp", "alembic", "mcp", "slack_sdk", "slack_bolt", "discord", "botbuilder")

#: Not used by a command on SQLite that logs nothing and counts nothing (``review
#: list``): asyncpg (PostgreSQL only), prometheus_client (the service's counters),
#: structlog (it renders log lines, and loads rich), the turn path (flows are handed it).
SQLITE_READ_UNUSED = (
    *SERVICE_ONLY,
    "asyncpg",
    "prometheus_client",
    "structlog",
    "rich",
    "leadgate.turns.path",
)


def loaded_after(code: str, packages: tuple[str, ...] = SERVICE_ONLY) -> set[str]:
    """The modules of ``packages`` (a package is loaded with any of its modules) a fresh
    interpreter has loaded after running ``code``."""
    found = f"sorted(set(sys.modules) & {set(packages)!r})"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({found}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(out.stdout))


def test_the_commands_load_no_service_library() -> None:
    assert loaded_after("import leadgate.cli.main, leadgate.cli.commands") == set()


def test_version_and_help_load_no_service_library() -> None:
    code = (
        "import contextlib, io\n"
        "from leadgate.cli.parser import build_parser\n"
        "for argv in (['--version'], ['--help'], ['review', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        build_parser('').parse_args(argv)\n"
    )
    assert loaded_after(code) == set()


def test_the_composition_root_loads_the_mcp_sdk_only_to_mount_it() -> None:
    # A worker process (serve --role worker) never mounts the MCP server; the SDK's
    # types took about 0.4 s of its start.
    assert loaded_after("import leadgate.app", ("mcp", "mcp_types")) == set()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sqlite_command_loads_only_what_it_runs(migrated_url: str, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "{migrated_url}"\n')
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--config", str(config), "org", "create", "acme"]) == 0
    code = (
        "import contextlib, io\n"
        "from leadgate.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['--config', {str(config)!r}, 'review', 'list', '--org', 'acme']) == 0\n"
    )
    assert loaded_after(code, SQLITE_READ_UNUSED) == set()


def test_version_loads_neither_the_configuration_nor_the_database_libraries() -> None:
    code = (
        "import contextlib, io\n"
        "from leadgate.cli.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--version'])\n"
    )
    unused = ("asyncio", "pydantic", "sqlalchemy", *SQLITE_READ_UNUSED)
    assert loaded_after(code, unused) == set()
