"""Migration 0005 on SQLite and PostgreSQL: ``u:<name>`` sessions join the one public
session namespace (``h:<name>``) unless that name is taken for the same agent, the new
tables and column exist, and the migrated schema matches ``schema.py`` exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata

SESSIONS = [
    # (id, agent, key)
    ("s1", "a1", "u:alice"),  # renamed to h:alice
    ("s2", "a1", "u:bob"),  # h:bob exists for a1: stays u:bob
    ("s3", "a1", "h:bob"),
    ("s4", "a2", "u:bob"),  # another agent: renamed
    ("s5", "a1", "default:key_1"),
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


def test_upgrade_renames_user_sessions_without_collisions(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0004")

    def seed(conn: sa.Connection) -> None:
        for sid, agent, key in SESSIONS:
            conn.execute(
                sa.text(
                    "INSERT INTO sessions (id, org_id, agent_id, key, created_at) "
                    "VALUES (:id, 'o1', :agent, :key, 1)"
                ),
                {"id": sid, "agent": agent, "key": key},
            )

    run(db_url, seed)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        rows = conn.execute(sa.text("SELECT id, key FROM sessions")).all()
        keys: dict[str, str] = {r.id: r.key for r in rows}
        seqs = {r[0] for r in conn.execute(sa.text("SELECT event_seq FROM sessions")).all()}
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"keys": keys, "seqs": seqs, "diff": diff}

    out = run(db_url, check)
    assert out["keys"] == {
        "s1": "h:alice",
        "s2": "u:bob",
        "s3": "h:bob",
        "s4": "h:bob",
        "s5": "default:key_1",
    }
    assert out["seqs"] == {0}
    # The migrated schema is schema.py (tables, columns, indexes), nothing more or less
    # (autogenerate does not know that ix_messages_session_rowid is SQLite-only).
    diff = [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ]
    assert diff == []
    command.downgrade(cfg, "0004")
    command.upgrade(cfg, "head")
