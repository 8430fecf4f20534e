"""Migration 0016 on SQLite and PostgreSQL: continuations are unique per (run_id,
node_index); duplicates already stored are reduced to one of each group so the upgrade
never fails (the one that records how the node's pause was settled: resumed, else
closed, else one knowing its item, else the earliest by created_at, then id), and the
schema matches ``schema.py``."""

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
#: Duplicates of which a later one records the settled pause: (id, run, status,
#: work_item_id, created_at), all of node 0.
SETTLED = [
    ("cnt_h", "run_3", "waiting", None, 1),
    ("cnt_i", "run_3", "resumed", "wi_3", 2),  # the resume (summary, resumed run): kept
    ("cnt_j", "run_3", "closed", "wi_3", 3),
    ("cnt_k", "run_4", "waiting", "wi_4", 1),
    ("cnt_l", "run_4", "closed", "wi_4", 2),  # its run ended: kept
    ("cnt_m", "run_5", "waiting", None, 1),
    ("cnt_n", "run_5", "waiting", "wi_5", 2),  # the pause wrote its item here: kept
]


KEPT = {"cnt_c", "cnt_e", "cnt_f", "cnt_i", "cnt_l", "cnt_n"}


def run(url: str, work: Any) -> Any:
    async def main() -> Any:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _insert(
    conn: sa.Connection,
    cid: str,
    run_id: str,
    node: int,
    at: int,
    status: str = "waiting",
    item: str | None = None,
) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO continuations (id, org_id, run_id, node_index, agent_id, "
            "session_key, work_item_id, status, created_at, updated_at) VALUES "
            "(:id, 'org_1', :run, :node, 'agt_1', :key, :item, :status, :at, :at)"
        ),
        {
            "id": cid,
            "run": run_id,
            "node": node,
            "key": f"flow:{run_id}:{node}",
            "item": item,
            "status": status,
            "at": at,
        },
    )


def test_upgrade_keeps_one_continuation_of_each_node_and_makes_them_unique(
    db_url: str,
) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0015")

    def seed(conn: sa.Connection) -> None:
        for cid, run_id, node, at in CONTINUATIONS:
            _insert(conn, cid, run_id, node, at)
        for cid, run_id, status, item, at in SETTLED:
            _insert(conn, cid, run_id, 0, at, status, item)

    run(db_url, seed)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        ids = {r[0] for r in conn.execute(sa.text("SELECT id FROM continuations")).all()}
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"ids": ids, "diff": diff}

    out = run(db_url, check)
    assert out["ids"] == KEPT
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
    assert ids == KEPT
