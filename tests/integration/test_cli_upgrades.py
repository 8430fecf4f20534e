"""Upgrading in place through the real ``leadgate`` command, on SQLite and PostgreSQL: a
database behind the newest schema revision, ahead of it (a newer release's, after a
rollback) or never migrated is refused at start by ``serve`` and the other commands,
with one line naming what to do and nothing written; two replicas running ``leadgate db
upgrade`` at once on one PostgreSQL both succeed, and the schema is upgraded once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
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


def url_config(path: Path, url: str) -> Path:
    """A config file naming the database ``url`` (either backend)."""
    path.write_text(f'[server]\nport = 0\n[database]\nurl = "{url}"\n[log]\nlevel = "WARNING"\n')
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


def refusals(config: Path, commands: dict[str, list[str]]) -> dict[str, Run]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, config, *args) for name, args in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def test_a_database_behind_head_is_refused_naming_db_upgrade(db_url: str, tmp_path: Path) -> None:
    at(db_url, "0016")
    before = contents(db_url)
    for name, result in refusals(url_config(tmp_path / "c.toml", db_url), COMMANDS).items():
        result.rule_error("db.not_migrated")
        assert f"schema revision 0016, this version needs {HEAD}" in result.err, name
        assert "run `leadgate db upgrade --config <your config>` first" in result.err, name
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
    for name, result in refusals(url_config(tmp_path / "c.toml", db_url), COMMANDS).items():
        result.rule_error("db.not_migrated")
        assert "schema revision none" in result.err, name
        assert "run `leadgate db upgrade" in result.err, name
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
            args = [*LEADGATE, "--config", str(config), "db", "upgrade"]
            procs = [
                await asyncio.create_subprocess_exec(
                    *args, stdout=PIPE, stderr=PIPE, env=_env(), cwd=tmp_path
                )
                for _ in range(REPLICAS)
            ]
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"

            async def all_wait() -> bool:
                return bool(await holder.fetchval(waiting) == REPLICAS)

            assert await eventually(all_wait, within=TIMEOUT), "the replicas did not wait"
            await holder.execute(f"SELECT pg_advisory_unlock({UPGRADE_LOCK})")
            outs = [await asyncio.wait_for(p.communicate(), TIMEOUT) for p in procs]
        finally:
            await holder.close()
        return [
            Run(("db", "upgrade"), p.returncode or 0, out.decode().strip(), err.decode().strip())
            for p, (out, err) in zip(procs, outs, strict=True)
        ]

    for result in asyncio.run(upgrade_while_locked()):
        assert result.json() == {"revision": HEAD}, result
        assert result.err == "", result
    versions = run_sql(
        db_url, lambda conn: conn.execute(sa.text("SELECT version_num FROM alembic_version")).all()
    )
    assert [tuple(v) for v in versions] == [(HEAD,)]
    names = [org["name"] for org in run(config, "org", "list").json()]
    assert names == ([] if start is None else ["acme"])
