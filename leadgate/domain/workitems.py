"""Work items: the status enum, the one transition table, fenced updates.

Every status change goes through :func:`transition`: a conditional
``UPDATE ... WHERE id = :id AND status = :from [AND lease_token = :token] RETURNING *``.
When nothing matched (someone else moved the item first, or a lease was lost) it raises
:class:`leadgate.core.errors.TransitionError` and changes nothing, so two replicas can never
both win. Each change writes an audit row in the same transaction, and a public
``review`` event of the item's session when its public status changed
(:mod:`leadgate.domain.session_events`).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import DAY_MS, Clock, IdFactory, iso
from leadgate.core.errors import NotFound, TransitionError, quoted
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.runners import LOCKED_RECHECK_MS, seconds_until
from leadgate.core.types import BindingKind
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, count_after_commit, notify_sender
from leadgate.database.plans import AnyRow
from leadgate.database.sql import later_of, locked_by_id, one_row, unindexed
from leadgate.domain import session_events, wakes
from leadgate.domain.rows import WorkItem
from leadgate.domain.wakes import Wake

#: PostgreSQL NOTIFY channel: an item was queued for its lead (wakes lead runners on
#: every replica; within one process the turn path pokes its runner directly).
REVIEW_CHANNEL = "leadgate_reviews"
_NOTIFY_REVIEW = sa.text(f"SELECT pg_notify('{REVIEW_CHANNEL}', :sender)")

#: An ``inProgress`` item idle this long becomes ``abandoned`` (SPEC 3 rule 4).
ABANDON_AFTER_MS = 7 * DAY_MS


class Status(enum.StrEnum):
    """Work item statuses (SPEC 3)."""

    #: the worker is working; external messages are appended to the task context
    inProgress = "inProgress"
    #: complete_task was signalled; waiting for a lead run to claim it
    reviewQueued = "reviewQueued"
    #: a lead run holds the 20-minute review lease
    reviewing = "reviewing"
    #: a human must decide (approve, reject, return, cancel)
    awaitingHuman = "awaitingHuman"
    #: approved; the gating delivery is pending, in flight, or deliveryUnknown
    approved = "approved"
    #: terminal: approved output was delivered (or needed no delivery)
    completed = "completed"
    #: terminal: a human rejected the work
    rejected = "rejected"
    #: terminal: the gating delivery failed permanently
    failed = "failed"
    #: terminal: cancelled by an operator
    cancelled = "cancelled"
    #: terminal: inProgress and idle for 7 days
    abandoned = "abandoned"


S = Status
TERMINAL = frozenset({S.completed, S.rejected, S.failed, S.cancelled, S.abandoned})
ACTIVE = frozenset(set(S) - TERMINAL)

#: The one transition table: from-status -> statuses it may move to.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    S.inProgress: frozenset({S.reviewQueued, S.awaitingHuman, S.abandoned, S.cancelled}),
    S.reviewQueued: frozenset({S.reviewing, S.cancelled}),
    S.reviewing: frozenset(
        {S.approved, S.inProgress, S.awaitingHuman, S.reviewQueued, S.cancelled}
    ),
    S.awaitingHuman: frozenset({S.approved, S.rejected, S.inProgress, S.cancelled}),
    S.approved: frozenset({S.completed, S.failed, S.cancelled}),
    S.completed: frozenset(),
    S.rejected: frozenset(),
    S.failed: frozenset(),
    S.cancelled: frozenset(),
    S.abandoned: frozenset(),
}

W = t.work_items.c


#: A move's time: the mover's clock, or the item's last update when that is later
#: (:class:`~leadgate.database.sql.later_of`); audit rows take the time the row got.
_MOVED_AT = later_of(sa.bindparam("p_at", type_=W.updated_at.type), W.updated_at)


def _fenced_update(*fences: Any) -> Any:
    return (
        t.work_items.update()
        .where(W.id == sa.bindparam("p_id"), W.status == sa.bindparam("p_src"), *fences)
        .values(updated_at=_MOVED_AT)
        .returning(*t.work_items.c)
    )


# The fenced UPDATE of :func:`transition`, built once per fence combination (lease token,
# organization): the new values are parameters named after their columns.
_TRANSITIONS: dict[tuple[bool, bool], Any] = {
    (False, False): _fenced_update(),
    (True, False): _fenced_update(W.lease_token == sa.bindparam("p_lease")),
    (False, True): _fenced_update(W.org_id == sa.bindparam("p_org")),
    (True, True): _fenced_update(
        W.lease_token == sa.bindparam("p_lease"), W.org_id == sa.bindparam("p_org")
    ),
}


def allowed(src: Status, dst: Status) -> bool:
    """Whether the transition table permits ``src -> dst``."""
    return dst in TRANSITIONS[src]


_INSERT_AUDIT = t.audit.insert()


async def audit(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    actor: str,
    action: str,
    work_item_id: str | None = None,
    delivery_id: str | None = None,
    from_status: str | None = None,
    to_status: str | None = None,
    text: str | None = None,
    surface: str | None = None,
    identity: str | None = None,
    created_at: int | None = None,
) -> None:
    """Append one audit row (who, when, what, text; for human decisions also the
    surface and the platform identity), at ``created_at`` or the clock's time."""
    await conn.execute(
        _INSERT_AUDIT,
        audit_values(
            clock,
            ids,
            org_id=org_id,
            actor=actor,
            action=action,
            work_item_id=work_item_id,
            delivery_id=delivery_id,
            from_status=from_status,
            to_status=to_status,
            text=text,
            surface=surface,
            identity=identity,
            created_at=created_at,
        ),
    )


def audit_values(
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    actor: str,
    action: str,
    work_item_id: str | None = None,
    delivery_id: str | None = None,
    from_status: str | None = None,
    to_status: str | None = None,
    text: str | None = None,
    surface: str | None = None,
    identity: str | None = None,
    created_at: int | None = None,
    audit_id: str | None = None,
) -> dict[str, Any]:
    """A new ``audit`` row, as :func:`audit` appends it; at ``created_at`` (a move's
    time, as its row got it) or the clock's time; ``audit_id`` when the caller made the
    row's id beforehand, else a new one."""
    return {
        "id": ids.new("aud") if audit_id is None else audit_id,
        "org_id": org_id,
        "work_item_id": work_item_id,
        "delivery_id": delivery_id,
        "actor": actor,
        "action": action,
        "from_status": from_status,
        "to_status": to_status,
        "text": text,
        "created_at": clock.now_ms() if created_at is None else created_at,
        "surface": surface,
        "identity": identity,
    }


@dataclass(frozen=True)
class Then:
    """A second move right after the first, in the same fenced ``UPDATE``
    (:func:`transition`'s ``then``): ``dst -> status`` by ``actor`` with ``action``.

    ``between`` runs after the first move's session event and before the second's, with
    the item as it ends up: what makes the second move due (an internal delivery, which
    an approval does at once) is written there, so the session's events come in the
    order two transitions would have written them."""

    status: Status
    actor: str
    action: str
    between: Callable[[WorkItem], Awaitable[object]]


async def _not_moved(
    conn: Conn, item_id: str, src: Status, lease_token: str | None, org_id: str | None
) -> str:
    """Why a fenced move matched no row, for the person who asked: the item's status now
    (it said "is not awaitingHuman (or its lease was lost)" of a completed item, with no
    lease in play). Only read on that failure; another organization's item is not named."""
    query = sa.select(W.status).where(W.id == item_id)
    if org_id is not None:
        query = query.where(W.org_id == org_id)
    found = (await conn.execute(query)).first()
    status = found.status if found is not None else None
    if status is not None and status != src.value:
        return f"work item {item_id} is {status}, not {src}{await _left(conn, item_id, src)}"
    if lease_token is not None:
        return f"work item {item_id} is not {src} under this lease (it was lost); nothing changed"
    return f"work item {item_id} is not {src}; nothing changed"


async def not_there(conn: Conn, item_id: str, src: Status) -> TransitionError:
    """The refusal of a move from ``src`` of an item that is no longer there (as
    :func:`transition` words it when its fenced update matches nothing), for a move
    refused before its update: ``workItem.status`` naming who moved it on."""
    return TransitionError(await _not_moved(conn, item_id, src, None, None), rule="workItem.status")


async def _left(conn: Conn, item_id: str, src: Status) -> str:
    """What took the item out of ``src`` (its last audit row from there), for
    :func:`_not_moved`: an operator who runs a decision again after an answer was lost
    (the commit in doubt) reads there that the first one landed ("approve by
    key:... (cli) at ..."), as chat cards say "Already approved by ..."."""
    a = t.audit.c
    row = (
        await conn.execute(
            sa.select(a.action, a.actor, a.surface, a.created_at)
            .where(a.work_item_id == item_id, a.from_status == src.value)
            .order_by(a.created_at.desc(), a.id.desc())
            .limit(1)
        )
    ).first()
    if row is None:
        return "; nothing changed"
    return f": {who_did(row)}; nothing changed"


async def ended_already(conn: Conn, item: WorkItem, dst: Status) -> TransitionError:
    """The refusal of a move to ``dst`` of ``item``, which has ended (its status is
    terminal): ``workItem.status`` naming the move that ended it, as a decision fenced
    on ``awaitingHuman`` names who decided meanwhile (a cancel of a rejected item said
    ``workItem.transition`` "cannot go from rejected to cancelled", naming nobody)."""
    a = t.audit.c
    row = (
        await conn.execute(
            sa.select(a.action, a.actor, a.surface, a.created_at)
            .where(a.work_item_id == item.id, a.to_status == item.status)
            .order_by(a.created_at.desc(), a.id.desc())
            .limit(1)
        )
    ).first()
    by = "" if row is None else f": {who_did(row)}"
    return TransitionError(
        f"work item {item.id} is {item.status} already, it cannot be {dst}{by}; nothing changed",
        rule="workItem.status",
    )


def who_did(row: AnyRow, *, of: str = "") -> str:
    """An audit row (``action``, ``actor``, ``surface``, ``created_at``) as a person reads
    it in a 409: ``approve by key:... (cli) at 2026-...`` (``of``, after the action: whose
    it was, when not the thing the 409 is about)."""
    surface = f" ({row.surface})" if row.surface else ""
    return f"{row.action}{of} by {row.actor}{surface} at {iso(row.created_at)}"


async def transition(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item_id: str,
    *,
    src: Status,
    dst: Status,
    actor: str,
    action: str,
    text: str | None = None,
    lease_token: str | None = None,
    org_id: str | None = None,
    values: dict[str, Any] | None = None,
    surface: str | None = None,
    identity: str | None = None,
    then: Then | None = None,
    audit_id: str | None = None,
) -> WorkItem:
    """Move ``item_id`` from ``src`` to ``dst``, fenced by status (and lease token).

    With ``then``, the item goes on from ``dst`` to ``then.status`` in the same
    ``UPDATE``: both moves must be in the table, each has its audit row and session
    event, and nobody can see the item at ``dst`` (the transaction holds both). It
    costs one statement where two transitions took two, and the item's indexes are
    written once.

    ``audit_id``: the move's audit row's id, made by the caller beforehand (the lead
    runner's verdict: a commit in doubt is looked for by it); else a new one.

    Raises :class:`TransitionError` when the table forbids the move or no row matched.
    """
    if not allowed(src, dst) or (then is not None and not allowed(dst, then.status)):
        last = dst if then is None else f"{dst} and on to {then.status}"
        raise TransitionError(
            f"a work item cannot go from {src} to {last}", rule="workItem.transition"
        )
    params: dict[str, Any] = {
        **(values or {}),
        "status": (dst if then is None else then.status).value,
        "p_at": clock.now_ms(),
        "p_id": item_id,
        "p_src": src.value,
    }
    if lease_token is not None:
        params["p_lease"] = lease_token
    if org_id is not None:
        params["p_org"] = org_id
    stmt = _TRANSITIONS[lease_token is not None, org_id is not None]
    row = (await conn.execute(stmt, params)).first()
    if row is None:
        raise TransitionError(
            await _not_moved(conn, item_id, src, lease_token, org_id), rule="workItem.status"
        )
    first = audit_values(
        clock,
        ids,
        org_id=row.org_id,
        actor=actor,
        action=action,
        work_item_id=item_id,
        from_status=src.value,
        to_status=dst.value,
        text=text,
        surface=surface,
        identity=identity,
        created_at=row.updated_at,
        audit_id=audit_id,
    )
    item = WorkItem.from_row(row)
    if then is None:
        await conn.execute(_INSERT_AUDIT, first)
    await session_events.status_changed(
        conn, clock, row.session_id, src.value, dst.value, row.revision
    )
    if then is not None:
        await then.between(item)
        second = audit_values(
            clock,
            ids,
            org_id=row.org_id,
            actor=then.actor,
            action=then.action,
            work_item_id=item_id,
            from_status=dst.value,
            to_status=then.status.value,
            created_at=row.updated_at,
        )
        # Both audit rows in one statement; ``first``'s id was made first: it sorts first.
        await conn.execute(_INSERT_AUDIT, [first, second])
        await session_events.status_changed(
            conn, clock, row.session_id, dst.value, then.status.value, row.revision
        )
        count_after_commit(conn, labelled(METRICS.transitions, dst.value, then.status.value))
    count_after_commit(conn, labelled(METRICS.transitions, src.value, dst.value))
    return item


def require_move(src: Status, dst: Status, *, event: bool) -> None:
    """For statements that write a move themselves (built at import time): raise
    :class:`TransitionError` unless the transition table allows ``src -> dst`` and the
    move changes the public status (a session event is due) exactly when ``event``."""
    if not allowed(src, dst):
        raise TransitionError(
            f"a work item cannot go from {src} to {dst}", rule="workItem.transition"
        )
    changes = any(
        session_events.public_status(dst.value, revision)
        != session_events.public_status(src.value, revision)
        for revision in (0, 1)
    )
    if changes != event:
        raise TransitionError(
            f"{src} -> {dst} {'changes no' if event else 'changes the'} public status",
            rule="workItem.transition",
        )


def moved_with_audit(
    ids: sa.ColumnElement[Any],
    *,
    src: Status,
    dst: Status,
    actor: str,
    action: str,
    values: dict[str, Any],
    name: str,
) -> tuple[Any, Any]:
    """PostgreSQL CTEs for :func:`transition` inside one statement: the items whose id is
    ``ids`` (a column of another CTE, e.g. a ``FOR UPDATE SKIP LOCKED`` head) moved
    ``src -> dst`` fenced by status, with ``values`` (column -> bound parameter), as CTE
    ``name`` returning the whole rows; and their audit rows (id ``:p_audit_id``), a CTE
    the statement must add (``add_cte``). The move's time is ``:p_now``, or the item's
    last update when that is later: a caller reads its clock before it waits for a
    connection, and a write that committed during the wait (the item's submission, say)
    may carry a later time; the audit trail, read in time order, must not put this move
    before it. For moves that change no public status only: the statement writes no
    session event, as :func:`transition` would write none; a move the table forbids or
    that would need one raises at once (these are built at import time)."""
    require_move(src, dst, event=False)
    moved = (
        t.work_items.update()
        .where(W.id == ids, W.status == src.value)
        .values(
            status=dst.value,
            updated_at=later_of(sa.bindparam("p_now", type_=W.updated_at.type), W.updated_at),
            **values,
        )
        .returning(*t.work_items.c)
        .cte(name)
    )
    a = t.audit.c
    audited = (
        t.audit.insert()
        .from_select(
            [
                a.id,
                a.org_id,
                a.work_item_id,
                a.actor,
                a.action,
                a.from_status,
                a.to_status,
                a.created_at,
            ],
            sa.select(
                sa.bindparam("p_audit_id", type_=a.id.type),
                moved.c.org_id,
                moved.c.id,
                sa.literal(actor, a.actor.type),
                sa.literal(action, a.action.type),
                sa.literal(src.value, a.from_status.type),
                sa.literal(dst.value, a.to_status.type),
                moved.c.updated_at,
            ),
        )
        .cte(f"{name}_audit")
    )
    return moved, audited


async def notify_review_queued(conn: Conn) -> None:
    """Tell every replica's lead runner, once this transaction commits, that an item
    waits for review (PostgreSQL ``NOTIFY``; SQLite has one process per file). The
    payload names the sending :class:`~leadgate.database.db.Database`: its own process
    poked its runner at commit and skips the notification."""
    if conn.dialect.name == "postgresql":
        await conn.execute(_NOTIFY_REVIEW, {"sender": notify_sender(conn)})


async def transition_many(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item_ids: list[str],
    *,
    src: Status,
    dst: Status,
    actor: str,
    action: str,
) -> list[str]:
    """:func:`transition` for many items at once (the outbox relay's batch commit).

    One fenced ``UPDATE ... WHERE id IN (...) AND status = :from RETURNING`` and one
    multi-row audit insert. Returns the ids that moved; an item that was not ``src`` is
    left alone (the caller decides whether that matters).
    """
    if not allowed(src, dst):
        raise TransitionError(
            f"a work item cannot go from {src} to {dst}", rule="workItem.transition"
        )
    if not item_ids:
        return []
    now = clock.now_ms()
    rows = (
        await conn.execute(
            _TRANSITION_MANY_BY_ID if conn.dialect.name == "postgresql" else _TRANSITION_MANY,
            {"p_ids": item_ids, "p_src": src.value, "status": dst.value, "p_at": now},
        )
    ).all()
    for row in rows:
        await session_events.status_changed(
            conn, clock, row.session_id, src.value, dst.value, row.revision
        )
    if rows:
        await conn.execute(
            _INSERT_AUDIT,
            [
                {
                    "id": ids.new("aud"),
                    "org_id": row.org_id,
                    "work_item_id": row.id,
                    "delivery_id": None,
                    "actor": actor,
                    "action": action,
                    "from_status": src.value,
                    "to_status": dst.value,
                    "text": None,
                    "created_at": row.updated_at,
                }
                for row in rows
            ],
        )
        count_after_commit(conn, labelled(METRICS.transitions, src.value, dst.value), len(rows))
    return [str(row.id) for row in rows]


_MANY_LOCKED = locked_by_id(
    t.work_items,
    W.id.in_(sa.bindparam("p_ids", expanding=True)),
    W.status == sa.bindparam("p_src"),
    name="locked",
)
# Built once (the plan cache keys on the statement object): a statement built per
# call costs its construction and cache key, more than SQLite takes to run it.
_TRANSITION_MANY = (
    t.work_items.update()
    .where(
        W.id.in_(sa.bindparam("p_ids", expanding=True)),
        unindexed(W.status) == sa.bindparam("p_src"),
    )
    .values(updated_at=_MOVED_AT)
    .returning(W.id, W.org_id, W.session_id, W.revision, W.updated_at)
)
# PostgreSQL: the same move, its rows locked in id order first (locked_by_id), as the
# relay's group commit and a lease expiry lock items; the plain update locked them in
# the order its scan found them, which at size is physical order.
_TRANSITION_MANY_BY_ID = (
    t.work_items.update()
    .where(W.id == _MANY_LOCKED.c.id, W.status == sa.bindparam("p_src"))
    .values(updated_at=_MOVED_AT)
    .returning(W.id, W.org_id, W.session_id, W.revision, W.updated_at)
)
_GET = sa.select(t.work_items).where(W.id == sa.bindparam("p_id"))
_GET_IN_ORG = _GET.where(W.org_id == sa.bindparam("p_org"))
_GET_FOR_UPDATE = _GET.with_for_update()
_GET_IN_ORG_FOR_UPDATE = _GET_IN_ORG.with_for_update()


async def get(
    conn: Conn, item_id: str, org_id: str | None = None, *, lock: bool = False
) -> WorkItem:
    """A work item (``NotFound`` when absent, or of another organization; ``lock``: FOR
    UPDATE on PostgreSQL, waiting for a transaction that holds the row; SQLite serializes
    writers anyway)."""
    locked = lock and conn.dialect.name == "postgresql"
    if org_id is None:
        row = (await conn.execute(_GET_FOR_UPDATE if locked else _GET, {"p_id": item_id})).first()
    else:
        query = _GET_IN_ORG_FOR_UPDATE if locked else _GET_IN_ORG
        row = (await conn.execute(query, {"p_id": item_id, "p_org": org_id})).first()
    if row is None:
        raise not_found(item_id)
    return WorkItem.from_row(row)


def not_found(item_id: str) -> NotFound:
    """The error of a work item that is absent or of another organization."""
    return NotFound(f"no work item {quoted(item_id)}", rule="workItem.not_found")


_ACTIVE_FOR = sa.select(t.work_items).where(
    W.agent_id == sa.bindparam("p_agent_id"),
    W.session_id == sa.bindparam("p_session_id"),
    # The unique partial index's own predicate, so that this lookup uses that index.
    sa.text(t.ACTIVE_ITEM_PREDICATE.replace("status", "work_items.status", 1)),
)
_ACTIVE_FOR_UPDATE = _ACTIVE_FOR.with_for_update()


async def active_for(
    conn: Conn, agent_id: str, session_id: str, *, lock: bool = False
) -> WorkItem | None:
    """The active (non-terminal) item of a (worker, session), if any (``lock``: FOR UPDATE
    on PostgreSQL; SQLite serializes writers anyway)."""
    query = _ACTIVE_FOR_UPDATE if lock and conn.dialect.name == "postgresql" else _ACTIVE_FOR
    row = (await conn.execute(query, {"p_agent_id": agent_id, "p_session_id": session_id})).first()
    return None if row is None else WorkItem.from_row(row)


#: The items the sweeper abandons: ``inProgress`` and idle since ``p_cutoff``.
_IS_IDLE = (W.status == S.inProgress.value, W.last_activity_at <= sa.bindparam("p_cutoff"))


def _binding_kind(binding_id: sa.ColumnElement[Any]) -> sa.Label[Any]:
    """The kind of binding ``binding_id`` (a primary key lookup per item found idle;
    none when nothing is). A scalar subquery, not a join, so that the PostgreSQL pick
    locks the work items alone."""
    return (
        sa.select(t.bindings.c.kind)
        .where(t.bindings.c.id == binding_id)
        .scalar_subquery()
        .label("kind")
    )


#: SQLite: the sweep's pick, each item with its binding kind. Built once: the plan cache
#: keys on the statement object.
_IDLE = sa.select(W.id, _binding_kind(W.binding_id)).where(*_IS_IDLE).limit(sa.bindparam("p_limit"))
#: PostgreSQL: the items picked, locked; those another transaction holds are skipped.
_PICKED = (
    sa.select(W.id, W.binding_id)
    .where(*_IS_IDLE)
    .limit(sa.bindparam("p_limit"))
    .with_for_update(skip_locked=True)
    .cte("picked")
)
#: PostgreSQL: the sweep's pick as one statement that answers at least one row
#: (:func:`leadgate.database.sql.one_row`; an idle pass's is all NULL but ``locked``),
#: each item with its binding kind, and ``locked``: whether idle items were there that
#: the pick did not take (skipped as row-locked by another transaction, when it took
#: fewer than its limit). Asking that in a second statement cost every pass, idle ones
#: included, a round trip more.
_IDLE_LOCKED = sa.select(
    _PICKED.c.id,
    _binding_kind(_PICKED.c.binding_id),
    sa.exists().where(*_IS_IDLE, W.id.not_in(sa.select(_PICKED.c.id))).label("locked"),
).select_from(one_row(_PICKED))
_ABANDON = (
    t.work_items.update()
    .where(
        W.id == sa.bindparam("p_id"),
        # Fenced on idleness too: an append racing the sweeper wins.
        *_IS_IDLE,
    )
    .values(status=S.abandoned.value, updated_at=_MOVED_AT)
    .returning(W.org_id, W.session_id, W.revision, W.updated_at)
)


@dataclass(frozen=True, slots=True)
class Swept:
    """What one :func:`sweep_abandoned` did."""

    #: items moved to ``abandoned``
    moved: int
    #: PostgreSQL: idle items were left because another transaction held them row-locked
    #: (the pick skipped them); never on SQLite
    locked: bool


async def sweep_abandoned(
    conn: Conn, db: Database, clock: Clock, ids: IdFactory, idle_ms: int, limit: int = 500
) -> Swept:
    """Move ``inProgress`` items idle for ``idle_ms`` to ``abandoned``, at most ``limit``.
    When one was a flow node's item (its binding is a flow's), the flow resumer is woken
    at commit, on every replica: the run paused on it ends then, not at its poll.

    PostgreSQL: the pick locks the items it takes and skips those another transaction
    holds (``FOR UPDATE SKIP LOCKED``). A move that waited on one would stall the whole
    pass, every idle item after it with it, behind a transaction of any length (an
    intake appending to the item, a turn's submission), and keep the rows it had already
    moved locked meanwhile; and when the holder's commit made the item busy again, the
    waiting move would keep its row lock to the sweep's commit all the same. A skipped
    item is reported (:attr:`Swept.locked`): the caller looks again soon."""
    cutoff = clock.now_ms() - idle_ms
    args = {"p_cutoff": cutoff, "p_limit": limit}
    rows = (await conn.execute(_IDLE_LOCKED if db.is_postgres else _IDLE, args)).all()
    # (PostgreSQL: an idle pass's one row took nothing; a full pick may have left more,
    # locked or not, and the caller sweeps again at once.)
    locked = db.is_postgres and bool(rows[0].locked)
    rows = [row for row in rows if row.id is not None]
    locked = locked and len(rows) < limit
    moved = 0
    flow_ended = False
    for row in rows:
        updated = (
            await conn.execute(
                _ABANDON, {"p_id": row.id, "p_cutoff": cutoff, "p_at": clock.now_ms()}
            )
        ).first()
        if updated is None:
            continue
        moved += 1
        await audit(
            conn,
            clock,
            ids,
            org_id=updated.org_id,
            actor="system:sweeper",
            action="abandon",
            work_item_id=row.id,
            from_status=S.inProgress.value,
            to_status=S.abandoned.value,
            text="idle for 7 days",
            created_at=updated.updated_at,
        )
        await session_events.status_changed(
            conn, clock, updated.session_id, S.inProgress.value, S.abandoned.value, updated.revision
        )
        count_after_commit(
            conn, labelled(METRICS.transitions, S.inProgress.value, S.abandoned.value)
        )
        flow_ended = flow_ended or row.kind == BindingKind.flow.value
    if flow_ended:
        await wakes.after_commit(conn, Wake.flow)
    return Swept(moved, locked)


#: The oldest last activity of an ``inProgress`` item (the next one the sweeper abandons,
#: once it has been idle for :data:`ABANDON_AFTER_MS`). Built once.
_OLDEST_ACTIVITY = sa.select(sa.func.min(W.last_activity_at)).where(W.status == S.inProgress.value)


class Sweeper:
    """The abandonment sweeper: ``inProgress`` items idle for 7 days become ``abandoned``.

    A pass that abandoned nothing knows when the next item will have been idle that long
    (its oldest last activity, a week on), and the runner loop sleeps no longer than that
    (:meth:`due_in_s`): an item is abandoned when its week is up, not up to a poll later.
    That time is read only when the one known has passed or none is known: every later
    activity, and every item that enters ``inProgress`` since (its activity is now), can
    only make the true one later (clocks agreeing), so the known one is never past it;
    waking for an item that had activity since finds nothing and reads the time again.
    A clock seen going back (a pass's clock before the last pass's) breaks that: an item
    that enters ``inProgress`` after the step has an activity before the one known, and
    would have been abandoned late by up to the step (at the poll, not at its time): the
    time is read again then too.

    PostgreSQL: a pass that left idle items because another transaction held them
    row-locked (:attr:`Swept.locked`) looks again :data:`LOCKED_RECHECK_MS` on: its
    holder may commit with no wake-up for the sweeper, and the oldest last activity
    would be the skipped item's, past already (the loop would spin on it).
    """

    name = "abandonment-sweeper"

    def __init__(self, db: Database, clock: Clock, ids: IdFactory) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        #: when the oldest ``inProgress`` item seen becomes abandonable (None: none seen)
        self._next_due: int | None = None
        #: PostgreSQL: when to look again for idle items the last pass skipped as locked
        self._locked_look: int | None = None
        #: the clock at the last pass (None: no pass yet)
        self._last_now: int | None = None

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until the next item the last idle pass knew
        of has been idle for :data:`ABANDON_AFTER_MS`, or until the look again for items
        it skipped as locked, whichever is sooner; None when it knew of neither. The
        runner loop sleeps no longer than this (:func:`leadgate.core.runners.run_loop`)."""
        return seconds_until(self.clock.now_ms(), self._next_due, self._locked_look)

    async def run_once(self) -> bool:
        """Sweep one batch."""
        async with self.db.tx() as conn:
            swept = await sweep_abandoned(conn, self.db, self.clock, self.ids, ABANDON_AFTER_MS)
            now = self.clock.now_ms()
            if self._last_now is not None and now < self._last_now:
                self._next_due = None  # the clock went back: the known time may be late
            self._last_now = now
            self._locked_look = now + LOCKED_RECHECK_MS if swept.locked else None
            if swept.locked:
                # The oldest idle item is a skipped one, due already: read it again once
                # none is skipped.
                self._next_due = None
            # After a pass that moved any, the loop runs again at once: no time needed.
            elif not swept.moved and (self._next_due is None or self._next_due <= now):
                oldest = await conn.scalar(_OLDEST_ACTIVITY)
                self._next_due = None if oldest is None else int(oldest) + ABANDON_AFTER_MS
        return swept.moved > 0
