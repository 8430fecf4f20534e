"""Upgrading in place through the real ``leadgate`` command, on SQLite and PostgreSQL: a
database behind the newest schema revision, ahead of it (a newer release's, after a
rollback) or never migrated is refused at start by ``serve`` and the other commands,
with one line naming what to do and nothing written (those commands one after the other
in one child process, through ``leadgate.cli.main.main``); two replicas running ``leadgate db
upgrade`` at once on one PostgreSQL, or two on one SQLite file, both succeed, and the
schema is upgraded once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
from asyncio.subprocess import Process
from pathlib import Path
from subprocess import PIPE
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from leadgate.database.db import UPGRADE_LOCK, alembic_config
from leadgate.database.pg import asyncpg_dsn
from tests.helpers import eventually
from tests.integration.test_cli import LEADGATE, TIMEOUT, Run, _env, run
from tests.service_proc import cli_batch
from tests.unit.test_migration_0016 import run as run_sql

pytestmark = pytest.mark.timeout(300)

HEAD = str(ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head())
#: A revision no release of this version knows: a newer release's database.
FUTURE = "0999_newer_release"
#: Commands that read or write the database (serve refuses before it listens).
COMMANDS = {
    "serve": ["serve"],
    "org list": ["org", "list"],
    "review list": ["review", "list", "--org", "acme"],
}


def url_config(path: Path, url: str, busy_timeout_s: float = 5.0) -> Path:
    """A config file naming the database ``url`` (either backend)."""
    path.write_text(
        f'[server]\nport = 0\n[database]\nurl = "{url}"\nbusy_timeout_s = {busy_timeout_s}\n'
        '[log]\nlevel = "WARNING"\n'
    )
    return path


def contents(url: str) -> list[Any]:
    """Every row of every table (with the schema revision), to show nothing was written."""

    def read(conn: sa.Connection) -> list[Any]:
        names = sorted(sa.inspect(conn).get_table_names())
        return [
            (name, sorted(map(tuple, conn.execute(sa.text(f"SELECT * FROM {name}")).all())))
            for name in names
        ]

    result: list[Any] = run_sql(url, read)
    return result


def at(url: str, revision: str) -> None:
    """Migrate ``url`` to ``revision``, with an organization in it, and keep it there."""
    command.upgrade(alembic_config(url), revision)
    run_sql(
        url,
        lambda conn: conn.execute(
            sa.text("INSERT INTO organizations (id, name, created_at) VALUES ('org_1', 'acme', 1)")
        ),
    )


def sqlite_file(url: str) -> bytes | None:
    """The SQLite file's bytes, with its write-ahead log's (None on PostgreSQL): a refusal
    must leave them as they were (the schema check once put the file into WAL mode)."""
    path = sa.make_url(url).database
    if not url.startswith("sqlite") or path is None:
        return None
    wal = Path(f"{path}-wal")
    return Path(path).read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def refusals(config: Path, commands: dict[str, list[str]]) -> dict[str, Run]:
    """The commands one after the other in one child process (``cli_batch``: a
    ``leadgate`` start costs most of a second of CPU), in the config's directory."""
    done = cli_batch(
        sys.executable,
        config,
        list(commands.values()),
        env=_env(),
        cwd=config.parent,
        timeout=TIMEOUT * 3,
    )
    return {
        name: Run(tuple(one.args), one.code, one.out.strip(), one.err.strip())
        for name, one in zip(commands, done, strict=True)
    }


def test_a_database_behind_head_is_refused_naming_db_upgrade(db_url: str, tmp_path: Path) -> None:
    at(db_url, "0016")
    before, file_before = contents(db_url), sqlite_file(db_url)
    for name, result in refusals(url_config(tmp_path / "c.toml", db_url), COMMANDS).items():
        result.rule_error("db.not_migrated")
        assert f"schema revision 0016, this version needs {HEAD}" in result.err, name
        assert "run `leadgate db upgrade --config <your config>` first" in result.err, name
    assert sqlite_file(db_url) == file_before
    assert contents(db_url) == before


def test_a_newer_releases_database_is_refused_and_db_upgrade_does_not_touch_it(
    db_url: str, tmp_path: Path
) -> None:
    """After a rollback: the message says what happened and what to do (it said to run
    ``db upgrade``, which then failed with exit 1 and Alembic's "Can't locate
    revision")."""
    at(db_url, "head")
    run_sql(
        db_url,
        lambda conn: conn.execute(sa.text(f"UPDATE alembic_version SET version_num = '{FUTURE}'")),
    )
    before = contents(db_url)
    config = url_config(tmp_path / "c.toml", db_url)
    for name, result in refusals(config, {**COMMANDS, "upgrade": ["db", "upgrade"]}).items():
        result.rule_error("db.newer_schema")
        assert f"schema revision {FUTURE}, newer than this version knows" in result.err, name
        assert "a newer release of leadgate upgraded it" in result.err, name
        assert "restore the backup" in result.err, name
        assert "db upgrade --config" not in result.err, name
    assert contents(db_url) == before


def test_a_database_never_migrated_is_refused_and_left_empty(db_url: str, tmp_path: Path) -> None:
    if db_url.startswith("sqlite"):
        # An existing, empty SQLite file (a missing one is refused by name elsewhere).
        run_sql(db_url, lambda conn: conn.execute(sa.text("SELECT 1")))
    file_before = sqlite_file(db_url)
    for name, result in refusals(url_config(tmp_path / "c.toml", db_url), COMMANDS).items():
        result.rule_error("db.not_migrated")
        assert "schema revision none" in result.err, name
        assert "run `leadgate db upgrade" in result.err, name
    assert sqlite_file(db_url) == file_before
    assert contents(db_url) == []


REPLICAS = 3


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("start", [None, "0016"])
def test_replicas_upgrading_one_postgresql_at_once_take_turns(
    db_url: str, tmp_path: Path, start: str | None
) -> None:
    """Each replica's ``db upgrade`` waits for the upgrade lock, held here until all of
    them wait (without it they did not wait, and two racing from an empty database both
    created ``alembic_version``: one failed, exit 1 with the driver's error and SQL);
    released, they take turns, and all but the first find nothing left to do."""
    if start is not None:
        at(db_url, start)
    config = url_config(tmp_path / "c.toml", db_url)

    async def upgrade_while_locked() -> list[Run]:
        holder = await asyncpg.connect(asyncpg_dsn(db_url))
        try:
            await holder.execute(f"SELECT pg_advisory_lock({UPGRADE_LOCK})")
            procs = await start_upgrades(config)
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"

            async def all_wait() -> bool:
                return bool(await holder.fetchval(waiting) == REPLICAS)

            await eventually(all_wait, within=TIMEOUT, what="the replicas waiting")
            await holder.execute(f"SELECT pg_advisory_unlock({UPGRADE_LOCK})")
            return await finished(procs)
        finally:
            await holder.close()

    upgraded_once(db_url, config, asyncio.run(upgrade_while_locked()), start)


async def start_upgrades(config: Path, n: int = REPLICAS) -> list[Process]:
    """``n`` processes of ``leadgate db upgrade`` with ``config``, started at once."""
    args = [*LEADGATE, "--config", str(config), "db", "upgrade"]
    return [
        await asyncio.create_subprocess_exec(
            *args, stdout=PIPE, stderr=PIPE, env=_env(), cwd=config.parent
        )
        for _ in range(n)
    ]


async def finished(procs: list[Process]) -> list[Run]:
    """What each of ``procs`` answered (bounded in time)."""
    outs = [await asyncio.wait_for(p.communicate(), TIMEOUT) for p in procs]
    return [
        Run(("db", "upgrade"), p.returncode or 0, out.decode().strip(), err.decode().strip())
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


def upgraded_once(url: str, config: Path, results: list[Run], start: str | None) -> None:
    """Every upgrade succeeded; the database is at head, with one version row and the
    rows it had."""
    for result in results:
        assert result.json() == {"revision": HEAD}, result
        assert result.err == "", result
    versions = run_sql(
        url, lambda conn: conn.execute(sa.text("SELECT version_num FROM alembic_version")).all()
    )
    assert [tuple(v) for v in versions] == [(HEAD,)]
    names = [org["name"] for org in run(config, "org", "list").json()]
    assert names == ([] if start is None else ["acme"])


def sqlite_write_lock(url: str) -> sqlite3.Connection:
    """A connection holding the write lock of the SQLite file of ``url`` (created when
    missing), as a running upgrade or the service's writer holds it; ROLLBACK ends it."""
    holder = sqlite3.connect(url.removeprefix("sqlite+aiosqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def opened(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has the file ``path`` open, or has ended already (Linux)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:
        return True
    for fd in fds:
        with contextlib.suppress(OSError):  # (closed meanwhile)
            if os.readlink(fd) == str(path):
                return True
    return False


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("start", [None, "0016"])
def test_upgrades_of_one_sqlite_file_at_once_take_turns(
    db_url: str, tmp_path: Path, start: str | None
) -> None:
    """``db upgrade`` run several times at once on one SQLite file (the service runs as
    one process there, but two terminals or a script and a person still can): each
    waits for the file's write lock, held here until all of them have the file open
    (before, the second failed at once, exit 1 with "database is locked" and the
    driver's SQL), then they take turns and all but the first find nothing to do."""
    if start is not None:
        at(db_url, start)
    config = url_config(tmp_path / "c.toml", db_url, busy_timeout_s=TIMEOUT / 3)
    path = Path(db_url.removeprefix("sqlite+aiosqlite:///")).resolve()

    async def upgrade_while_locked() -> list[Run]:
        holder = sqlite_write_lock(db_url)
        try:
            procs = await start_upgrades(config)

            def all_wait() -> bool:
                return all(opened(p.pid, path) for p in procs)

            await eventually(all_wait, within=TIMEOUT, what="the upgrades started")
            holder.execute("ROLLBACK")
            return await finished(procs)
        finally:
            holder.close()

    upgraded_once(db_url, config, asyncio.run(upgrade_while_locked()), start)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_db_upgrade_refuses_a_sqlite_file_locked_past_the_busy_timeout(
    db_url: str, tmp_path: Path
) -> None:
    """Another writer (an upgrade, the service) that keeps the file's write lock past
    ``[database] busy_timeout_s``: exit 2 with one line naming ``db.locked``, no SQL, and
    the file as it was (no revision half applied); once the lock is free, the upgrade
    goes through."""
    at(db_url, "0016")
    before = contents(db_url)
    config = url_config(tmp_path / "c.toml", db_url, busy_timeout_s=0.2)
    holder = sqlite_write_lock(db_url)
    try:
        result = run(config, "db", "upgrade")
    finally:
        holder.close()
    result.rule_error("db.locked")
    assert "another `leadgate db upgrade` or a running service" in result.err, result
    assert "[SQL" not in result.err and "OperationalError" not in result.err, result
    assert contents(db_url) == before
    upgraded_once(db_url, config, [run(config, "db", "upgrade")], "0016")
