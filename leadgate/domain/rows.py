"""Typed rows: what the domain's public functions take and return.

Each is a ``NamedTuple`` whose fields are its table's columns, in table order, so that
``from_row`` is a plain ``_make`` of a ``SELECT <table>`` row (the turn path builds
several per request: a named tuple costs a fraction of a dataclass built by keyword).
``tests/unit/test_rows.py`` checks that fields and columns stay in step.

Rows are values: a changed item is a new row (``row._replace(...)``), and a transition
returns the row as the database has it after the fenced update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Self


class WorkItem(NamedTuple):
    """A work item (``work_items``): one worker's task in one session, and its review."""

    id: str
    org_id: str
    agent_id: str
    session_id: str
    lead_agent_id: str
    status: str
    completion_policy: str
    max_revision_rounds: int
    revision: int
    extra_allowance: int
    task_context: str
    signal_summary: str | None
    signal_turn_id: str | None
    summary: str | None
    snapshot: str | None
    gated_message_id: str | None
    binding_id: str | None
    pending_feedback: str | None
    last_feedback: str | None
    lease_token: str | None
    lease_expires_at: int | None
    lease_expiries: int
    last_activity_at: int
    created_at: int
    updated_at: int
    lease_owner: str | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT work_items`` (or ``RETURNING *``) row."""
        return cls._make(row)


class Agent(NamedTuple):
    """An agent (``agents``): a worker, a lead, or both."""

    id: str
    org_id: str
    name: str
    slug: str
    model: str
    instructions: str
    preset_id: str | None
    lead_agent_id: str | None
    completion_policy: str | None
    max_revision_rounds: int | None
    active: bool
    deleted_at: int | None
    created_at: int
    updated_at: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT agents`` row (extra trailing columns are ignored)."""
        return cls._make(row[: len(cls._fields)])


class Preset(NamedTuple):
    """A preset (``presets``): an organization preset may carry a lead, a platform
    preset (``org_id`` None) never does."""

    id: str
    org_id: str | None
    name: str
    lead_agent_id: str | None
    completion_policy: str | None
    max_revision_rounds: int | None
    created_at: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT presets`` row."""
        return cls._make(row)


class Delivery(NamedTuple):
    """A delivery (``deliveries``): one outbox row (statuses in :mod:`outbox.store`)."""

    id: str
    org_id: str
    work_item_id: str | None
    kind: str
    action: str
    channel: str
    binding_id: str | None
    address: dict[str, Any]
    text: str
    status: str
    attempts: int
    next_attempt_at: int
    lease_token: str | None
    lease_expires_at: int | None
    error: str | None
    external_id: str | None
    created_at: int
    updated_at: int
    lease_owner: str | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT deliveries`` (or ``RETURNING *``) row."""
        return cls._make(row)


class Binding(NamedTuple):
    """A trigger binding (``bindings``): where a session's replies go."""

    id: str
    org_id: str
    session_id: str
    kind: str
    address: dict[str, Any]
    silent: bool
    route_id: str | None
    active: bool
    created_at: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT bindings`` row."""
        return cls._make(row)


class Session(NamedTuple):
    """A session (``sessions``): one conversation of one agent, named by its key."""

    id: str
    org_id: str
    agent_id: str
    key: str
    created_at: int
    event_seq: int
    #: PostgreSQL: its events are NOTIFYed until then (ms, the server's clock)
    watched_until: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Self:
        """From a ``SELECT sessions`` row."""
        return cls._make(row)
