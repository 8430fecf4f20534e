"""Alembic environment: runs migrations over the async engine named in the config."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from alembic import context
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

from leadgate.database.db import BUSY_TIMEOUT_ATTRIBUTE, UPGRADE_LOCK
from leadgate.database.schema import metadata

config = context.config
target_metadata = metadata


def _run(connection: sa.Connection) -> None:
    if connection.dialect.name == "postgresql":
        # Replicas upgrading at once take turns (see UPGRADE_LOCK): taken before Alembic
        # reads the current revision, in the one transaction that migrates and commits.
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
    elif connection.dialect.name == "sqlite":
        # The file's write lock (BEGIN IMMEDIATE, see _sqlite_transactional_ddl),
        # taken here for the same reason. Taken at the first statement instead (a read of
        # the revision, under a plain BEGIN), a second upgrader read the revision the
        # first had not committed yet, and its first write failed at once with
        # "database is locked": SQLite does not wait for a lock a reader asks for.
        connection.begin()
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _sqlite_transactional_ddl(engine: sa.Engine) -> None:
    """One transaction for the whole upgrade on SQLite too (SQLAlchemy's documented
    recipe): the driver otherwise begins a transaction only before DML, so each DDL
    statement committed alone, and an upgrade that failed midway left a revision half
    applied (a column added, the version not moved), which the next ``db upgrade`` then
    failed on for good. It begins with the write lock (``BEGIN IMMEDIATE``), which waits
    for another writer up to the connection's busy timeout: upgrades take turns."""

    @event.listens_for(engine, "connect")
    def _no_driver_transactions(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


async def _main() -> None:
    url = sa.engine.make_url(config.get_main_option("sqlalchemy.url") or "")
    # As the service's engine: a statement's parameters never go into an error's text,
    # which reaches the log and `db upgrade`'s output. No revision binds data yet; a data
    # migration would bind message text.
    kwargs: dict[str, Any] = {"hide_parameters": True}
    if url.get_backend_name() == "sqlite":
        # How long BEGIN IMMEDIATE waits for another writer: the service's busy timeout
        # (sqlite3's own default, 5 s, otherwise), as its own connections wait.
        timeout = float(config.attributes.get(BUSY_TIMEOUT_ATTRIBUTE, 5.0))
        kwargs["connect_args"] = {"timeout": timeout}
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        _sqlite_transactional_ddl(engine.sync_engine)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
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
