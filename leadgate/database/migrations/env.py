"""Alembic environment: runs migrations over the async engine named in the config."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from leadgate.database.db import UPGRADE_LOCK
from leadgate.database.schema import metadata

config = context.config
target_metadata = metadata


def _run(connection: sa.Connection) -> None:
    if connection.dialect.name == "postgresql":
        # Replicas upgrading at once take turns (see UPGRADE_LOCK): taken before Alembic
        # reads the current revision, in the one transaction that migrates and commits.
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(config.get_main_option("sqlalchemy.url") or "")
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


def run() -> None:
    """Entry point used by Alembic (online mode only)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(_main())
        return
    raise RuntimeError("run `leadgate db upgrade` outside a running event loop")


run()
