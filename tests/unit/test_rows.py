"""Typed rows stay in step with their tables (fields = columns, in order)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.domain import rows


@pytest.mark.parametrize(
    ("row", "table"),
    [
        (rows.WorkItem, t.work_items),
        (rows.Agent, t.agents),
        (rows.Preset, t.presets),
        (rows.Delivery, t.deliveries),
        (rows.Binding, t.bindings),
        (rows.Session, t.sessions),
    ],
)
def test_fields_are_the_columns_in_table_order(row: type, table: sa.Table) -> None:
    # from_row is a positional _make: a column added, dropped or moved without the row
    # would silently shift every field after it.
    assert row._fields == tuple(c.name for c in table.columns)  # type: ignore[attr-defined]
