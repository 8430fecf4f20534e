"""Small SQL helpers shared by the engine, the review runner and the outbox."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite


@functools.cache
def insert_ignore_stmt(dialect: str, table: sa.Table) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` for ``dialect``, built once: execute it with
    the row as parameters (hot paths: a new statement per call is compiled per call on
    the inline SQLite connection)."""
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    return sqlite.insert(table).on_conflict_do_nothing()


def row_dict(row: sa.Row[Any] | None) -> dict[str, Any] | None:
    """A result row as a plain dict (``None`` passes)."""
    return None if row is None else dict(row._mapping)
