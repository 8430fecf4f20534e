"""Small SQL helpers shared by the engine, the review runner and the outbox."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from engine.db import Conn


def insert_ignore(conn: Conn, table: sa.Table, **values: Any) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` in the connection's dialect."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table).values(**values).on_conflict_do_nothing()
    return sqlite.insert(table).values(**values).on_conflict_do_nothing()


def row_dict(row: sa.Row[Any] | None) -> dict[str, Any] | None:
    """A result row as a plain dict (``None`` passes)."""
    return None if row is None else dict(row._mapping)
