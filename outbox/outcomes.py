"""Committing send outcomes: each fenced by its lease token, with the work item's move.

A delivery's outcome is committed with ``... WHERE id = :id AND lease_token = :token AND
status = 'sending'``: a relay whose lease was taken back (expiry) commits nothing. The
work item moves in the same transaction (``approved -> completed / failed``), and an
api/studio reveal clears the gated message's ``leadGated`` flag there too, and announces
the revealed message in its session's public event log.

Successful sends are committed as a group in a handful of statements whatever its size;
every other outcome is one row at a time (they are rare). On PostgreSQL a group of posts
(no reveal) is one statement outside a transaction block (:meth:`OutcomeCommitter.commit_alone`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import TransitionError
from leadgate.core.metrics import METRICS, labelled
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, count_after_commit
from leadgate.database.sql import later_of_sql, locked_by_id, unindexed
from leadgate.domain import session_events, workitems
from leadgate.domain.rows import Delivery
from leadgate.domain.workitems import Status
from outbox.channel import (
    UNTIL_SENT,
    Permanent,
    Retry,
    SendOutcome,
    Sent,
    Uncertain,
    stored_error,
)
from outbox.store import (
    CARD,
    CARD_CLOSED_AT,
    CARD_UPDATE,
    ENDED,
    NEXT_PART_AT,
    PARTS_POSTED,
    DeliveryStatus,
    ReviewNeeded,
    posts_of_ended_items,
    taken_back,
)

log = logging.getLogger("leadgate.relay")
#: The outcomes committed one by one (:meth:`OutcomeCommitter._commit_one`).
NotSent = Retry | Permanent | Uncertain
D = t.deliveries.c

# The platform message ids of a committed group (one cached statement, run as an
# executemany; the rows were fenced by the status update just before).
_SET_EXTERNAL_ID = (
    t.deliveries.update()
    .where(D.id == sa.bindparam("b_id"))
    .values(external_id=sa.bindparam("b_external"))
)
#: A sent delivery's address without its :data:`UNTIL_SENT` values.
_SET_ADDRESS = (
    t.deliveries.update()
    .where(D.id == sa.bindparam("b_id"))
    .values(address=sa.bindparam("b_address"))
)
# The same for a committed group, and the group's fenced ``sending -> sent``.
_REVEAL = (
    t.messages.update()
    .where(
        t.messages.c.id.in_(
            sa.select(t.work_items.c.gated_message_id).where(
                t.work_items.c.id.in_(sa.bindparam("p_items", expanding=True))
            )
        )
    )
    .returning(t.messages.c.id, t.messages.c.session_id)
)
_MARK_SENT_ANY = (
    t.deliveries.update()
    .where(
        D.id.in_(sa.bindparam("p_ids", expanding=True)),
        unindexed(D.status) == DeliveryStatus.sending.value,
    )
    .returning(D.id)
)
_MARK_SENT = _MARK_SENT_ANY.where(D.lease_token == sa.bindparam("p_token"))
#: (claims always carry a token; a row without one is fenced on that, as SQL's = cannot)
_MARK_SENT_NO_TOKEN = _MARK_SENT_ANY.where(D.lease_token.is_(None))


def _mark_sent_by_id(token: sa.ColumnElement[bool]) -> Any:
    """PostgreSQL: the fenced ``sending -> sent`` with its rows locked in id order first
    (:func:`~leadgate.database.sql.locked_by_id`), as a lease expiry and the one-statement
    group commit lock deliveries; the plain update locked them in the order its scan
    found them (physical order, at size)."""
    fence = (D.status == DeliveryStatus.sending.value, token)
    locked = locked_by_id(
        t.deliveries, D.id.in_(sa.bindparam("p_ids", expanding=True)), *fence, name="locked"
    )
    return t.deliveries.update().where(D.id == locked.c.id, *fence).returning(D.id)


#: ``(token, no token)``, PostgreSQL's forms of the two statements above.
_MARK_SENT_BY_ID = (
    _mark_sent_by_id(D.lease_token == sa.bindparam("p_token")),
    _mark_sent_by_id(D.lease_token.is_(None)),
)
#: Whether a card's wait was closed, its episode row locked (PostgreSQL) until the
#: outcome commits: a decision closes the episode with an update of that row, and then
#: reads the wait's cards, so either it reads the card's outcome committed, or this
#: reads the episode closed (see :meth:`OutcomeCommitter._ended_card`).
_CARD_CLOSED_AT_LOCKED = CARD_CLOSED_AT.with_for_update(of=t.review_episodes)
#: The status of the card a ``cardUpdate`` edits.
_CARD_STATUS = sa.select(D.status).where(D.id == sa.bindparam("p_card"))
#: A card's statuses that leave its edit nothing to edit for good: not posted (refused
#: for good, or ended by a decision), or maybe posted with no message id (a click that
#: proves it posted queues an edit of its own: ``leadgate.review.cards.settled_card``).
_UNEDITABLE = frozenset(
    {
        DeliveryStatus.cancelled.value,
        DeliveryStatus.failed.value,
        DeliveryStatus.deliveryUnknown.value,
    }
)

# A group of successful posts on PostgreSQL, as one statement (see
# OutcomeCommitter.commit_alone): the same fenced moves and audit rows as the transaction
# of ``commit``, and the session events session_events writes for the items' move, in one
# round trip instead of seven (BEGIN, the deliveries, their external ids, the items, their
# audit rows, the session events, COMMIT). Measured with four relay replicas: the outcome
# commit's round trips were most of the relay's and of PostgreSQL's CPU per delivery.
# Its rows are locked by id (``ORDER BY id FOR UPDATE``, read whole before the updates
# that join them): the deliveries, then the items, as the transaction of ``commit``
# takes them and as a lease expiry takes the items (outbox.store.ended_meanwhile). An
# update locks rows in the order its plan finds them (the items by status and
# updated_at): two items approved in the other order than their ids were locked the
# other way round from an expiry on another replica, and PostgreSQL ended one of the
# two (40P01 deadlock_detected).
_SENT_AND_MOVED = (
    "WITH input AS ("
    " SELECT * FROM unnest(CAST(:ids AS varchar[]), CAST(:tokens AS varchar[]),"
    " CAST(:externals AS varchar[])) AS i(id, token, external_id)"
    "), sending AS ("
    " SELECT d.id FROM deliveries AS d JOIN input AS i ON i.id = d.id"
    " WHERE d.status = :sending AND d.lease_token IS NOT DISTINCT FROM i.token"
    " ORDER BY d.id FOR UPDATE OF d"
    "), sent AS ("
    " UPDATE deliveries AS d SET status = :sent, lease_token = NULL, lease_expires_at = NULL,"
    " updated_at = :now, error = NULL, external_id = COALESCE(i.external_id, d.external_id)"
    " FROM input AS i JOIN sending ON sending.id = i.id"
    " WHERE d.id = i.id AND d.status = :sending AND d.lease_token IS NOT DISTINCT FROM i.token"
    " RETURNING d.id, d.kind, d.work_item_id"
    "), approved AS ("
    " SELECT w.id FROM work_items AS w"
    " WHERE w.id IN (SELECT work_item_id FROM sent WHERE sent.kind = 'gating')"
    " AND w.status = :src ORDER BY w.id FOR UPDATE"
    "), moved AS ("
    " UPDATE work_items AS w SET status = :dst,"
    f" updated_at = {later_of_sql('now', 'w.updated_at')}"
    " FROM approved WHERE w.id = approved.id AND w.status = :src"
    " RETURNING w.id, w.org_id, w.session_id, w.updated_at"
    "), audit_rows AS ("
    " INSERT INTO audit (id, org_id, work_item_id, delivery_id, actor, action, from_status,"
    " to_status, text, created_at)"
    " SELECT a.audit_id, moved.org_id, moved.id, NULL, :actor, :action, :src, :dst, NULL,"
    " moved.updated_at"
    " FROM moved JOIN unnest(CAST(:audit_items AS varchar[]), CAST(:audit_ids AS varchar[]))"
    " AS a(item, audit_id) ON a.item = moved.id"
    ")"
)
_SRC, _DST = Status.approved, Status.completed


def _moved_events() -> session_events.MovedItemEvents:
    events = session_events.postgres_moved_item_events("moved", _SRC.value, _DST.value)
    if events is None:  # completed is a public status and approved is not: never
        raise RuntimeError("approved -> completed changes no public status")
    return events


_EVENTS = _moved_events()
_COMMIT_POSTS = sa.text(
    _SENT_AND_MOVED
    + _EVENTS.ctes
    + " SELECT ARRAY(SELECT id FROM sent) AS sent, ARRAY(SELECT id FROM moved) AS moved, "
    + _EVENTS.columns
)


#: The error of a delivery posted in full whose send lease lapsed before that was recorded
#: (:meth:`OutcomeCommitter._record_all_posted`).
ALL_POSTED_ERROR = (
    "send lease expired after every part was posted, before that was recorded: nothing "
    "is sent again (Confirm delivered, or a Retry, completes it)"
)
#: The most of an error a delivery keeps, per part (the error, what the platform said):
#: a platform's refusal may quote a whole page.
ERROR_CHARS = 2000
_ID_TYPE = D.external_id.type
#: The longest platform message id a delivery keeps (its column's bound: PostgreSQL
#: refuses a longer one).
EXTERNAL_ID_CHARS = (
    _ID_TYPE.length if isinstance(_ID_TYPE, sa.String) and _ID_TYPE.length else ERROR_CHARS
)


def _storable_text(text: str) -> str:
    """``text`` as every backend takes it: at most :data:`ERROR_CHARS`, no NUL
    (PostgreSQL's text refuses it) and no lone surrogate (UTF-8 has none: the driver
    cannot encode it), each such character a replacement one."""
    if len(text) > ERROR_CHARS:
        text = text[: ERROR_CHARS - 1] + "\u2026"
    if text.isascii():
        return text.replace("\x00", "\ufffd") if "\x00" in text else text
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def _storable_id(external_id: object) -> str | None:
    """A platform's message id if every backend stores it as it is (a string within
    :data:`EXTERNAL_ID_CHARS`, no NUL, no lone surrogate), else ``None``: an id changed
    to fit would name another message (or none), and editing or quoting it would go
    astray; no id is what a delivery posted without one keeps."""
    if not isinstance(external_id, str):
        return None
    if len(external_id) <= EXTERNAL_ID_CHARS and _storable_text(external_id) == external_id:
        return external_id
    return None


def storable(done: Done) -> Done:
    """``done`` with what its channel's answer put into it (error text, what the
    platform said, message ids) made storable by every backend (:func:`_storable_text`,
    :func:`_storable_id`). A value the database refuses made its group's commit fail at
    every try, and the relay kept the group, not sending or taking back anything more.
    Every outcome is committed through this (:meth:`OutcomeCommitter.commit`,
    :meth:`OutcomeCommitter.commit_alone`): no channel needs to know the schema."""
    outcome = done.outcome
    if isinstance(outcome, Sent):
        if outcome.external_id is not None and _storable_id(outcome.external_id) is None:
            outcome = Sent(None)
    else:
        error, said = _storable_text(outcome.error), _storable_text(outcome.said)
        if (error, said) != (outcome.error, outcome.said):
            outcome = replace(outcome, error=error, said=said)
    external_id = done.external_id
    if external_id is not None:
        external_id = _storable_id(external_id)
    if outcome is done.outcome and external_id == done.external_id:
        return done  # (the usual case: no copy on the relay's path)
    return replace(done, outcome=outcome, external_id=external_id)


def _keeps_secret(row: Delivery) -> bool:
    """Whether the delivery's address holds a value only its send needs."""
    return isinstance(row.address, dict) and any(k in row.address for k in UNTIL_SENT)


@dataclass
class Done:
    """A finished send waiting for its outcome to be committed."""

    row: Delivery
    outcome: SendOutcome
    #: a long text's parts now posted when a later one was not (surely) posted: recorded
    #: with the outcome (:data:`outbox.store.PARTS_POSTED`), with ``external_id``, the
    #: first part's platform id (``None``: nothing to record), and ``next_part_at``,
    #: where in the text the part not posted starts (:data:`outbox.store.NEXT_PART_AT`).
    #: A text posted in full has them too (``next_part_at`` its length), recorded only
    #: when its ``sent`` cannot be (:meth:`OutcomeCommitter._record_all_posted`)
    parts_posted: int | None = None
    external_id: str | None = None
    next_part_at: int | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """How retryable failures are rescheduled (``backoff(attempts, retry_after)`` in
    seconds) and after how many attempts a delivery counts as stalled.

    A retryable failure never gives up: it was definitely not posted, and approved
    output must not be dropped because a platform was down for a while (it was
    ``failed`` after 8 attempts, about two minutes, terminal and in no queue). Past
    ``stalled_after`` attempts each retry is logged as a WARNING and counted with the
    outcome ``stalled``, for an alert; the backoff is capped (5 minutes)."""

    stalled_after: int
    backoff: Callable[[int, float | None], float]


class OutcomeCommitter:
    """Commits groups of :class:`Done` inside the caller's transaction."""

    def __init__(
        self,
        clock: Clock,
        ids: IdFactory,
        policy: RetryPolicy,
        *,
        review_needed: ReviewNeeded | None = None,
    ) -> None:
        self.clock = clock
        self.ids = ids
        self.policy = policy
        #: writes review cards when a gating delivery becomes deliveryUnknown
        self.review_needed = review_needed
        #: earliest retry scheduled by a commit (the relay claims again by then)
        self.next_due: int | None = None

    async def commit(self, conn: Conn, done: list[Done], now: int) -> None:
        """Commit every outcome of ``done``."""
        done = [storable(d) for d in done]
        sent = [d for d in done if isinstance(d.outcome, Sent)]
        if sent:
            await self._commit_sent(conn, sent, now)
        not_sent = [(d, d.outcome) for d in done if not isinstance(d.outcome, Sent)]
        for item, outcome in sorted(not_sent, key=lambda pair: _lock_order(pair[0])):
            await self._commit_one(conn, item, outcome, now)

    async def commit_alone(self, db: Database, group: list[Done], now: int) -> bool:
        """PostgreSQL: commit a group of successful posts in one statement outside a
        transaction block (:data:`_COMMIT_POSTS`). False, with nothing done, when the
        group needs :meth:`commit` instead (another backend, another outcome, a reveal).

        Posts whose send lease was lost before the statement have their record written
        after it (:meth:`_record_all_posted`, a transaction of its own). When that
        raises, the statement's outcomes are committed (and counted): ``group`` is left
        holding only those posts, whose record is to be committed again, and the error
        is raised."""
        if not db.statements_alone or not group:
            return False
        done = [storable(d) for d in group]
        if any(
            not isinstance(d.outcome, Sent) or d.row.action == "reveal" or _keeps_secret(d.row)
            for d in done
        ):
            return False
        # Each item once (its audit row too), as transition_many's IN list does.
        items = list(dict.fromkeys(i for d in done if (i := _gating_item(d.row))))
        result = await db.write_alone(
            _COMMIT_POSTS,
            {
                "ids": [d.row.id for d in done],
                "tokens": [d.row.lease_token for d in done],
                "externals": [
                    d.outcome.external_id if isinstance(d.outcome, Sent) else None for d in done
                ],
                "sent": DeliveryStatus.sent.value,
                "sending": DeliveryStatus.sending.value,
                "now": now,
                "src": _SRC.value,
                "dst": _DST.value,
                "actor": "system:relay",
                "action": "delivered",
                "audit_items": items,
                "audit_ids": [self.ids.new("aud") for _ in items],
                **_EVENTS.params,
                "ev_at": now,
            },
            signals_from=lambda row: session_events.woken(row.ev_sessions),
        )
        row = result.one()
        sent = set(row.sent)
        if lost := _lost_posts(done, sent):
            try:
                async with db.tx() as conn:
                    await self._record_all_posted(conn, lost, now)
            except BaseException:
                # The statement committed: only the record is left to commit again. The
                # group, committed again whole, counted (and logged) its posts marked
                # sent here as leases lost (their rows were no longer ``sending``).
                again = {d.row.id for d in lost}
                _report_sent(None, [d for d in done if d.row.id not in again], sent)
                group[:] = [d for d in group if d.row.id in again]
                raise
        committed = _report_sent(None, done, sent)
        moved = set(row.moved)
        if moved:
            labelled(METRICS.transitions, _SRC.value, _DST.value).inc(len(moved))
        _warn_not_moved([_gating_item(d.row) for d in committed], moved)
        return True

    async def _commit_sent(self, conn: Conn, sent: list[Done], now: int) -> None:
        """Successful sends: a few statements for the whole group, whatever its size."""
        committed = await self._mark_sent(conn, sent, now)
        external = [
            {"b_id": d.row.id, "b_external": d.outcome.external_id}
            for d in sent
            if isinstance(d.outcome, Sent)
            and d.outcome.external_id is not None
            and d.row.id in committed
        ]
        if external:
            await conn.execute(_SET_EXTERNAL_ID, external)
        items: list[str] = []
        reveal: list[str] = []
        scrubbed: list[dict[str, Any]] = []
        if lost := _lost_posts(sent, committed):
            await self._record_all_posted(conn, lost, now)
        for d in _report_sent(conn, sent, committed):
            item_id = _gating_item(d.row)
            if item_id:
                items.append(item_id)
                if d.row.action == "reveal":
                    reveal.append(item_id)
            elif _keeps_secret(d.row):  # a card (no gating item) with its reply token
                address = d.row.address
                kept = {k: v for k, v in address.items() if k not in UNTIL_SENT}
                scrubbed.append({"b_id": d.row.id, "b_address": kept})
        if scrubbed:
            # Sent: what only the send needed (an email card's reply token) leaves the row.
            # (Checked in the loop above, not in a pass of its own: this runs per batch
            # on the relay's path, and a pass of its own counted ~5,600 instructions
            # per Slack lifecycle in bench.instructions.)
            await conn.execute(_SET_ADDRESS, scrubbed)
        if reveal:
            revealed = await conn.execute(_REVEAL, {"p_items": reveal, "lead_gated": False})
            await self._announce(conn, revealed.all())
        if items:
            moved = await workitems.transition_many(
                conn,
                self.clock,
                self.ids,
                items,
                src=Status.approved,
                dst=Status.completed,
                actor="system:relay",
                action="delivered",
            )
            _warn_not_moved(items, set(moved))

    async def _record_all_posted(self, conn: Conn, lost: list[Done], now: int) -> None:
        """Texts posted in full whose send lease was lost before their ``sent`` could be
        committed: the lease expiry took them back as ``deliveryUnknown`` with the record
        of the parts posted before the last one (written before each next part), so an
        operator's Retry posted the last part (a one-part text: the whole text) again.
        Each such row still as that expiry left it (:func:`outbox.store.taken_back`)
        records every part posted (``next_part_at`` at the end of the text): it stays
        ``deliveryUnknown`` for an operator, and a Retry posts nothing again."""
        for d in lost:
            row = d.row
            recorded = await conn.execute(
                t.deliveries.update()
                .where(D.id == row.id, taken_back(row))
                .values(
                    address={
                        **row.address,
                        PARTS_POSTED: d.parts_posted,
                        NEXT_PART_AT: d.next_part_at,
                    },
                    external_id=sa.func.coalesce(D.external_id, d.external_id),
                    error=ALL_POSTED_ERROR,
                    # The send is over: a Retry need not wait for it (outbox.store.recover).
                    lease_expires_at=None,
                    updated_at=now,
                )
            )
            if recorded.rowcount:
                log.warning(
                    "delivery %s: its send lease lapsed after every part was posted: "
                    "recorded posted, left deliveryUnknown",
                    row.id,
                )

    async def _announce(self, conn: Conn, revealed: Sequence[Any]) -> None:
        """Revealed messages become ``message`` events of their sessions (queued before
        the items' move to ``completed``, so ``delivered`` follows them)."""
        for message_id, session_id in revealed:
            await session_events.message_visible(conn, self.clock, session_id, message_id)

    async def _mark_sent(self, conn: Conn, sent: list[Done], now: int) -> set[str]:
        """``sending -> sent``, one fenced update per lease token; the ids that moved."""
        by_token: dict[str | None, list[Done]] = {}
        for d in sent:
            by_token.setdefault(d.row.lease_token, []).append(d)
        committed: set[str] = set()
        if conn.dialect.name == "postgresql":
            with_token, no_token = _MARK_SENT_BY_ID
        else:
            with_token, no_token = _MARK_SENT, _MARK_SENT_NO_TOKEN
        for token, group in by_token.items():
            rows = (
                await conn.execute(
                    with_token if token is not None else no_token,
                    {
                        "p_ids": [d.row.id for d in group],
                        **({"p_token": token} if token is not None else {}),
                        "status": DeliveryStatus.sent.value,
                        "lease_token": None,
                        "lease_expires_at": None,
                        "updated_at": now,
                        "error": None,
                    },
                )
            ).all()
            committed.update(r.id for r in rows)
        return committed

    def _values_for(
        self, done: Done, outcome: NotSent, now: int
    ) -> tuple[dict[str, Any], Status | None, str]:
        """The delivery's new values, the item's destination status (``None``: it stays
        ``approved``) and the metrics label for one outcome (a send that succeeded is
        committed with its group, by :meth:`_commit_sent`)."""
        row = done.row
        values: dict[str, Any] = {"lease_token": None, "lease_expires_at": None, "updated_at": now}
        if done.parts_posted is not None:
            values["address"] = {
                **row.address,
                PARTS_POSTED: done.parts_posted,
                NEXT_PART_AT: done.next_part_at,
            }
            values["external_id"] = row.external_id or done.external_id
        label = type(outcome).__name__.lower()
        if isinstance(outcome, Retry):
            delay = self.policy.backoff(row.attempts, outcome.delay_s)
            if row.attempts >= self.policy.stalled_after:
                label = "stalled"
                log.warning(
                    "delivery %s on %s still not posted after %d attempts (%s); "
                    "next attempt in %.0f s",
                    row.id,
                    row.channel,
                    row.attempts,
                    outcome.error,
                    delay,
                )
            values.update(
                status=DeliveryStatus.pending.value,
                error=stored_error(outcome),
                next_attempt_at=now + int(delay * 1000),
            )
            due = values["next_attempt_at"]
            self.next_due = due if self.next_due is None else min(self.next_due, due)
            return values, None, label
        if isinstance(outcome, Permanent):
            # Ended: what only its send needed leaves the row (an email card's token).
            values.update(status=DeliveryStatus.failed.value, error=stored_error(outcome), **ENDED)
            return values, Status.failed, label
        values.update(status=DeliveryStatus.deliveryUnknown.value, error=stored_error(outcome))
        return values, None, "deliveryUnknown"

    async def _commit_one(self, conn: Conn, done: Done, outcome: NotSent, now: int) -> None:
        row = done.row
        values, item_dst, label = self._values_for(done, outcome, now)
        if not isinstance(outcome, Permanent) and await self._ended_card(conn, row):
            # A card in flight when its item was decided: the decision left it to its
            # send (and queued the edit of a chat card). Not posted for sure, it is not
            # posted any more, as the decision cancels a card not yet sent; maybe posted,
            # it has no message id to edit, and neither an operator nor a second post
            # has anything left to do for a decided item. Either way it ends, with an
            # email card's Reply-To (the plain reply token); a chat card's edit then
            # finds it ended and ends too (below).
            values.update(
                status=DeliveryStatus.cancelled.value, error=stored_error(outcome), **ENDED
            )
        elif (
            not isinstance(outcome, Permanent)
            and row.kind == "gating"
            and await posts_of_ended_items(conn, D.id == row.id)
        ):
            # A post in flight when its item was cancelled: the cancel ended the item's
            # unsent deliveries, but not this one, being sent. Not posted for sure, it
            # went back to ``pending`` and was posted later all the same; maybe posted,
            # it opened a "confirm or retry" wait (cards, reminders) for a cancelled item,
            # whose Retry posted it again. It ends here, as a card of a decided wait does.
            values.update(
                status=DeliveryStatus.cancelled.value,
                error=f"{stored_error(outcome)}; its work item was cancelled meanwhile",
                **ENDED,
            )
            log.warning(
                "delivery %s: its work item was cancelled while it was being sent (%s): cancelled",
                row.id,
                label,
            )
        elif row.kind == CARD_UPDATE and (card := await self._card_not_posted(conn, row)):
            # The edit of a card that ended not posted (or maybe posted, with no id to
            # edit): it ends too, never sent, as a decision queues no edit of a card it
            # cancels (it was failed, an error of its own about a card that was not). An
            # edit that found its card still being posted ends here when the card ended
            # meanwhile, else on its next attempt (outbox.relay waits for the card).
            error = f"the card was not posted ({card}); nothing to update"
            values.update(status=DeliveryStatus.cancelled.value, error=error, **ENDED)
        if values["status"] == DeliveryStatus.cancelled.value:
            # Counted as what became of it: not a retry (it will not be tried again), nor
            # an uncertain send an operator must settle, nor a failure.
            label = "cancelled"
        res = await conn.execute(
            t.deliveries.update()
            .where(
                D.id == row.id,
                D.lease_token == row.lease_token,
                D.status == DeliveryStatus.sending.value,
            )
            .values(**values)
        )
        if not res.rowcount:
            log.warning("delivery %s: send lease lost before commit", row.id)
            # Its send is over (what it may have posted is the operator's to check): a
            # Retry of the row its lease lapsed into need not wait for it
            # (outbox.store.recover).
            await conn.execute(
                t.deliveries.update()
                .where(D.id == row.id, taken_back(row), D.lease_expires_at.is_not(None))
                .values(lease_expires_at=None)
            )
            count_after_commit(conn, labelled(METRICS.deliveries, row.channel, "leaseLost"))
            return
        count_after_commit(conn, labelled(METRICS.deliveries, row.channel, label))
        if row.kind != "gating" or row.work_item_id is None:
            return
        if item_dst is None:
            if values["status"] == DeliveryStatus.deliveryUnknown.value:
                await workitems.audit(
                    conn,
                    self.clock,
                    self.ids,
                    org_id=row.org_id,
                    actor="system:relay",
                    action="deliveryUnknown",
                    work_item_id=row.work_item_id,
                    delivery_id=row.id,
                    text=values.get("error"),
                )
                if self.review_needed is not None:
                    await self.review_needed(conn, row.work_item_id, "deliveryUnknown", row.id)
            return
        try:
            await workitems.transition(
                conn,
                self.clock,
                self.ids,
                row.work_item_id,
                src=Status.approved,
                dst=item_dst,
                actor="system:relay",
                action="deliveryFailed",  # (the only end committed one by one)
                text=values.get("error"),
            )
        except TransitionError:
            log.warning(
                "work item %s was not approved when its delivery finished", row.work_item_id
            )

    async def _ended_card(self, conn: Conn, row: Delivery) -> bool:
        """Whether ``row`` is a card (email or chat) whose wait a decision closed (the
        decision cancels cards not sent yet, but one being sent is left to its send:
        :func:`leadgate.review.cards.close_for_item`)."""
        if row.kind != CARD or row.work_item_id is None:
            return False
        closed_at = await conn.scalar(
            _CARD_CLOSED_AT_LOCKED, {"p_item": row.work_item_id, "p_card": row.id}
        )
        return closed_at is not None

    async def _card_not_posted(self, conn: Conn, row: Delivery) -> str | None:
        """The status of the card ``row`` (a card's edit) edits when it leaves nothing
        to edit for good (``cancelled``, ``failed``, ``deliveryUnknown``), else ``None``."""
        card_id = row.address.get("card_delivery_id") if isinstance(row.address, dict) else None
        if not isinstance(card_id, str):
            return None
        status = await conn.scalar(_CARD_STATUS, {"p_card": card_id})
        return str(status) if status in _UNEDITABLE else None


def _lock_order(done: Done) -> tuple[int, str]:
    """Where ``done`` comes in a group's one-by-one commit: the gating posts first, by
    their items' ids, then the rest as they came (a sort is stable). Each post locks its
    item (:func:`outbox.store.posts_of_ended_items`) and each card its wait; taken in
    the order of the group, two posts' items were locked in the other order than the
    lease expiry of another replica takes them (:func:`outbox.store.ended_meanwhile`:
    items by id, then waits, as a decision locks an item, then its wait), and PostgreSQL
    ended one of the two transactions (40P01 deadlock_detected)."""
    item = _gating_item(done.row)
    return (0, item) if item is not None else (1, "")


def _gating_item(row: Delivery) -> str | None:
    """The work item a delivery completes when it is sent (gating deliveries), or None."""
    return row.work_item_id if row.kind == "gating" else None


def _lost_posts(sent: Sequence[Done], committed: set[str]) -> list[Done]:
    """The texts of ``sent`` posted in full (their parts counted) whose ``sent`` was not
    committed: their send lease was lost."""
    return [d for d in sent if d.parts_posted is not None and d.row.id not in committed]


def _report_sent(conn: Conn | None, sent: Sequence[Done], committed: set[str]) -> list[Done]:
    """Count successful sends by whether their ``sent`` was committed (a lost send lease
    is logged), once ``conn``'s transaction commits (``None``: it has); returns the
    committed ones."""
    counts: Counter[tuple[str, str]] = Counter()
    kept: list[Done] = []
    for d in sent:
        if d.row.id in committed:
            counts[d.row.channel, "sent"] += 1
            kept.append(d)
        else:
            log.warning("delivery %s: send lease lost before commit", d.row.id)
            counts[d.row.channel, "leaseLost"] += 1
    for (channel, label), count in counts.items():
        counter = labelled(METRICS.deliveries, channel, label)
        if conn is None:
            counter.inc(count)
        else:
            count_after_commit(conn, counter, count)
    return kept


def _warn_not_moved(items: Sequence[str | None], moved: set[str]) -> None:
    for item_id in set(items) - moved - {None}:
        log.warning("work item %s was not approved when its delivery finished", item_id)
