"""Migration 0016 on SQLite and PostgreSQL: continuations are unique per (run_id,
node_index); duplicates already stored are reduced to the earliest of each pair (by
created_at, then id) so the upgrade never fails, and the schema matches ``schema.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata

CONTINUATIONS = [
    # (id, run, node, created_at)
    ("cnt_b", "run_1", 0, 5),
    ("cnt_c", "run_1", 0, 3),  # the earliest of run_1/0: kept
    ("cnt_a", "run_1", 0, 5),
    ("cnt_e", "run_1", 1, 9),  # alone: kept
    ("cnt_g", "run_2", 0, 7),  # a tie on created_at: the smaller id is kept
    ("cnt_f", "run_2", 0, 7),
]


def run(url: str, work: Any) -> Any:
    async def main() -> Any:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _insert(conn: sa.Connection, cid: str, run_id: str, node: int, at: int) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO continuations (id, org_id, run_id, node_index, agent_id, "
            "session_key, status, created_at, updated_at) VALUES "
            "(:id, 'org_1', :run, :node, 'agt_1', :key, 'waiting', :at, :at)"
        ),
        {"id": cid, "run": run_id, "node": node, "key": f"flow:{run_id}:{node}", "at": at},
    )


def test_upgrade_keeps_the_earliest_continuation_of_each_node_and_makes_them_unique(
    db_url: str,
) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0015")

    def seed(conn: sa.Connection) -> None:
        for cid, run_id, node, at in CONTINUATIONS:
            _insert(conn, cid, run_id, node, at)

    run(db_url, seed)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        ids = {r[0] for r in conn.execute(sa.text("SELECT id FROM continuations")).all()}
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"ids": ids, "diff": diff}

    out = run(db_url, check)
    assert out["ids"] == {"cnt_c", "cnt_e", "cnt_f"}
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []

    # A second continuation of a node is refused by the database itself now.
    with pytest.raises(sa.exc.IntegrityError):
        run(db_url, lambda conn: _insert(conn, "cnt_z", "run_1", 1, 10))

    # Down and up again: the index goes and comes back.
    command.downgrade(cfg, "0015")
    run(db_url, lambda conn: _insert(conn, "cnt_y", "run_1", 1, 11))
    command.upgrade(cfg, "head")
    ids = run(
        db_url,
        lambda conn: {r[0] for r in conn.execute(sa.text("SELECT id FROM continuations")).all()},
    )
    assert ids == {"cnt_c", "cnt_e", "cnt_f"}
