"""Delivery rows: written in the same transaction as the state change they deliver.

Delivery statuses:

* ``pending``: due at ``next_attempt_at``; the relay will claim it
* ``sending``: claimed by a relay holding the send lease
* ``sent``: posted (or revealed / marked sent); terminal
* ``failed``: definitely not posted, never will be; terminal, error recorded
* ``deliveryUnknown``: maybe posted; only a human moves it on (confirm or retry)
* ``cancelled``: not to be sent any more; terminal: the work item was cancelled before
  it was sent, or a review card's item was decided before (or while) it was sent, or
  before an operator's retry of its uncertain send
* ``continuation``: an ActionFlow continuation; never picked up by the relay

Actions: ``post`` (a channel message), ``reveal`` (clear leadGated on the stored
assistant message: api/studio), ``silent`` (silent binding: post nothing),
``scheduled`` (mark sent without a message), ``continuation`` (flow resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from binding.bindings import active_binding
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import NotFound, TransitionError, quoted
from leadgate.core.logs import Tally, loggable
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.types import CHANNEL_KINDS, BindingKind
from leadgate.database import schema as t
from leadgate.database.db import (
    Conn,
    Counts,
    count_after_commit,
    damage_met,
    held_counts,
    signal_after_commit,
)
from leadgate.database.faults import unavailable
from leadgate.domain import session_events, wakes, workitems
from leadgate.domain.rows import Binding, Delivery, WorkItem
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import Status
from outbox.channel import UNTIL_SENT

if TYPE_CHECKING:
    import asyncpg

log = logging.getLogger("leadgate.outbox")
D = t.deliveries.c

#: PostgreSQL NOTIFY channel that wakes relays on every replica.
NOTIFY_CHANNEL = "leadgate_outbox"
#: :meth:`leadgate.database.db.Database.on_commit` topic that wakes this process's relay.
OUTBOX_TOPIC = "outbox"
#: :meth:`leadgate.database.db.Database.on_commit_payloads` topic carrying rows handed to it
#: (:class:`Handoff` payloads).
HANDOFF_TOPIC = "outbox-handoff"


class Handoff(NamedTuple):
    """A delivery written already claimed for this process's relay (a
    :data:`HANDOFF_TOPIC` payload, at its write's commit or when that commit was in
    doubt)."""

    #: the row's inserted values (:func:`delivery_of`)
    row: dict[str, Any]
    #: what the write that inserted it counts at its commit, by reference (the
    #: transaction's own list: :func:`leadgate.database.db.held_counts`): a write in
    #: doubt whose row the relay finds landed counts them then
    #: (:func:`leadgate.database.db.count_found`, once for all its rows)
    held: Counts


#: How often a LISTEN connection must answer a liveness check, and
#: how long it has to answer (see :func:`listen_all`): a silently dead listener is found
#: within about their sum.
LISTEN_CHECK_S = 5.0
LISTEN_CHECK_TIMEOUT_S = 5.0
#: Delivery kinds of review cards: a card post, and the in-place edit of a posted card.
#: Neither is a gating delivery: the actionable queue and an item's completion ignore them.
CARD = "card"
CARD_UPDATE = "cardUpdate"
CARD_KINDS = frozenset({CARD, CARD_UPDATE})
_CARD_ITEM: sa.BindParameter[str] = sa.bindparam("p_item")
#: When a card's wait (review episode) was closed (``None``: still open), by card
#: delivery ``p_card`` of item ``p_item`` (``review_cards.delivery_id`` is indexed since
#: migration 0020; before, only the item's episodes and their cards were).
CARD_CLOSED_AT = (
    sa.select(t.review_episodes.c.closed_at)
    .select_from(
        t.review_episodes.join(
            t.review_cards, t.review_cards.c.episode_id == t.review_episodes.c.id
        )
    )
    .where(
        t.review_episodes.c.work_item_id == _CARD_ITEM,
        t.review_cards.c.work_item_id == _CARD_ITEM,
        t.review_cards.c.delivery_id == sa.bindparam("p_card"),
    )
)

#: Why an operator's Retry of an uncertain review card ended it ``cancelled`` (its wait
#: was closed by a decision: :func:`recover`), in the delivery's ``error`` and audit.
CARD_DECIDED_ERROR = (
    "not sent again: its item was decided, and a review card is not posted after its decision"
)

#: The delivery kind of the mail that answers a reviewer's email reply to a card (what
#: became of it). Its row holds its whole address (the reviewer, the subject, the reply
#: it answers): there is no binding.
ANSWER = "answer"
#: Gating actions with nothing to send (SPEC 6): the approval's own transaction writes
#: their delivery ``sent`` and completes the item; the relay never sees them.
INTERNAL_ACTIONS = frozenset({"reveal", "silent", "scheduled"})
#: The audit actor of an item completed by an internal delivery.
OUTBOX_ACTOR = "system:outbox"

#: ``(conn, work_item_id, reason, gating_delivery_id)``: an item started waiting for a
#: human (``awaitingHuman``, or its gating delivery became ``deliveryUnknown``); the
#: review layer writes its cards in ``conn``'s transaction (:meth:`Outbox.on_review_needed`).
ReviewNeeded = Callable[[Conn, str, str, str | None], Awaitable[object]]


SEND_LEASE_MS = 120_000
#: How long one delivery's send may take, all of it, every part of a long text together
#: (each channel bounds a send by its own, and a later part by what is left: the
#: message's ``within_s``): within half the send lease, as a relay holds up to two rounds
#: of its sends under their leases at once (the second round's sends wait for the
#: first's), and a send that outlives its lease has its outcome thrown away (the delivery
#: is taken back as ``deliveryUnknown`` meanwhile).
SEND_DEADLINE_S = SEND_LEASE_MS / 2000 - 5.0
#: How long after its send lease lapsed a send may still be in flight and then record
#: what it posted (:meth:`outbox.outcomes.OutcomeCommitter._record_all_posted`): its
#: deadline, and a few seconds for the record (the relay's commit retries). Until then
#: an operator's Retry of the ``deliveryUnknown`` row that lapse left is refused (409
#: ``delivery.in_flight``, :func:`recover`): put back ``pending`` before that record, it
#: was posted again by another relay, and the record found the row changed (posted twice).
IN_FLIGHT_AFTER_LAPSE_MS = int((SEND_DEADLINE_S + 5.0) * 1000)
#: The rule of that refusal.
IN_FLIGHT_RULE = "delivery.in_flight"


#: The address keys recording what of a long text (split by the relay,
#: :func:`outbox.relay.split_text`) earlier attempts posted: how many parts, and where in
#: the text the next part starts. The next attempt, the relay's retry or an operator's,
#: posts the text from there (split again), so no part is posted twice or skipped, even
#: when the split is not the same any more (a channel's limit changed by an upgrade).
#: A row recorded before the offset was has the count only (:func:`outbox.relay.resume_at`).
PARTS_POSTED = "parts_posted"
NEXT_PART_AT = "next_part_at"


def taken_back(row: Delivery) -> sa.ColumnElement[bool]:
    """Whether a delivery's row is still as the expiry of ``row``'s send lease left it:
    ``deliveryUnknown``, no lease, and no attempt since (an operator's Retry, claimed
    again, counts one). The fence of what a relay that lost its lease still records
    there of what it posted (the parts posted, ``outbox.relay``), so that the Retry
    posts only what it did not."""
    return sa.and_(
        D.lease_token.is_(None),
        D.status == DeliveryStatus.deliveryUnknown.value,
        D.attempts == row.attempts,
    )


class address_kept(FunctionElement[Any]):  # lower case: used like a SQL function
    """A delivery's ``address`` without its :data:`outbox.channel.UNTIL_SENT` values, in
    SQL: ``json_remove`` on SQLite; on PostgreSQL the ``json`` column goes through
    ``jsonb``, which alone can drop a key.

    Every update that ends a delivery (``sent``, ``failed``, ``cancelled``) sets
    ``address`` to this (see :data:`ENDED`): what only a send needs (an email card's
    Reply-To, whose token is otherwise kept only as a hash) must not outlive the row's
    last chance to be sent, however the row ends. A row that may still be sent
    (``pending``, ``sending``, ``deliveryUnknown``: a retry sends it again) keeps it.
    The keys are constants of ours, written into the SQL."""

    inherit_cache = True

    def __init__(self, column: sa.ColumnElement[Any]) -> None:
        super().__init__(column)
        self.type = column.type


@compiles(address_kept)
def _address_kept(element: address_kept, compiler: Any, **kw: Any) -> str:
    keys = ", ".join(f"'{key}'" for key in UNTIL_SENT)
    column = compiler.process(element.clauses, **kw)
    return f"CAST(CAST({column} AS jsonb) - CAST(ARRAY[{keys}] AS text[]) AS json)"


@compiles(address_kept, "sqlite")
def _address_kept_sqlite(element: address_kept, compiler: Any, **kw: Any) -> str:
    paths = ", ".join(f"'$.{key}'" for key in UNTIL_SENT)
    return f"json_remove({compiler.process(element.clauses, **kw)}, {paths})"


#: What every update that ends a delivery sets besides its status (see
#: :class:`address_kept`). The relay's group of successful sends drops the same values
#: in its own way (:mod:`outbox.outcomes`: only for the rows that hold them, on its hot
#: path).
ENDED: dict[str, Any] = {"address": address_kept(D.address)}


class DeliveryStatus(enum.StrEnum):
    """Delivery statuses (see the module docstring)."""

    pending = "pending"
    sending = "sending"
    sent = "sent"
    failed = "failed"
    deliveryUnknown = "deliveryUnknown"
    cancelled = "cancelled"
    continuation = "continuation"


def count_cancelled(conn: Conn, channels: Iterable[str]) -> None:
    """Count deliveries (review cards, cards' updates, an item's gating delivery) that
    ended ``cancelled`` unsent (their update to ``cancelled`` matched) with no attempt
    of theirs ending so, one per channel named, as
    ``leadgate_deliveries_total{outcome="cancelled"}`` once ``conn``'s transaction
    commits: every path that so ends one counts it here, once, where its fenced update
    matched (the relay's outcome commit counts the ones whose send it was,
    :mod:`outbox.outcomes`). One whose send ended uncertain was counted
    ``deliveryUnknown`` then, and is not counted again when it ends."""
    for channel in channels:
        count_after_commit(
            conn, labelled(METRICS.deliveries, channel, DeliveryStatus.cancelled.value)
        )


#: Card deliveries, each with when its wait was closed (``None``: still open), every
#: such wait's episode row locked (PostgreSQL) until the caller commits; the caller adds
#: which rows and in which status (:func:`cards_of_closed_waits`). Reached from the card
#: by ``review_cards.delivery_id`` (indexed, migration 0020).
_CARDS_WAITS = (
    sa.select(D.id, t.review_episodes.c.closed_at)
    .select_from(
        t.deliveries.join(t.review_cards, t.review_cards.c.delivery_id == D.id).join(
            t.review_episodes, t.review_episodes.c.id == t.review_cards.c.episode_id
        )
    )
    .where(D.kind == CARD)
    # Locked in one order: two relays taking back lapsed leases at once wait for each
    # other, never for each other's second lock (a deadlock).
    .order_by(t.review_episodes.c.id)
    .with_for_update(of=t.review_episodes)
)
#: The ``sending`` ones (a relay's send lease lapsed or its claim given back).
_SENDING_CARDS_WAITS = _CARDS_WAITS.where(D.status == DeliveryStatus.sending.value)
#: By status, as :func:`cards_of_closed_waits` reads them.
_CARDS_WAITS_IN = {
    DeliveryStatus.sending: _SENDING_CARDS_WAITS,
    # An operator's Retry of an uncertain card (:func:`recover`).
    DeliveryStatus.deliveryUnknown: _CARDS_WAITS.where(
        D.status == DeliveryStatus.deliveryUnknown.value
    ),
}


async def cards_of_closed_waits(
    conn: Conn,
    *where: sa.ColumnElement[bool],
    status: DeliveryStatus = DeliveryStatus.sending,
) -> list[str]:
    """The ids of the card deliveries in ``status`` (``sending`` or ``deliveryUnknown``)
    ``where`` selects whose wait (review episode) a decision closed: they end
    ``cancelled`` where they would have gone back to ``pending`` or on to
    ``deliveryUnknown`` (a decided item's card is neither posted after the decision nor
    left for an operator; see :meth:`outbox.outcomes.OutcomeCommitter._commit_one`,
    which ends a card whose send finished so, and :func:`recover`, an operator's Retry).

    Every selected card's episode row is locked (PostgreSQL) until ``conn`` commits,
    closed or not, before the caller updates the cards: a decision closes the episode
    with an update of that row and then reads the wait's cards, so either it reads the
    caller's outcome committed (and cancels a card put back ``pending``), or this reads
    the episode closed. Episode first, then the delivery, as the outcome commit locks
    them. SQLite has one writer: nothing to lock."""
    rows = (await conn.execute(_CARDS_WAITS_IN[status].where(*where))).all()
    return [str(r.id) for r in rows if r.closed_at is not None]


#: Gating deliveries being sent, each with its item's status, every such item's row
#: locked (PostgreSQL) until the caller commits, whatever its status: a cancel moves the
#: item first and then cancels its unsent deliveries, so either it finds the caller's
#: rows back in ``pending`` committed, or the caller reads the item cancelled
#: (:func:`ended_meanwhile`).
_SENDING_POSTS_ITEMS = (
    sa.select(D.id, t.work_items.c.status)
    .select_from(t.deliveries.join(t.work_items, t.work_items.c.id == D.work_item_id))
    .where(D.kind == "gating", D.status == DeliveryStatus.sending.value)
    .order_by(t.work_items.c.id)
    .with_for_update(of=t.work_items)
)


async def posts_of_ended_items(conn: Conn, *where: sa.ColumnElement[bool]) -> list[str]:
    """The ids of the ``sending`` gating deliveries ``where`` selects whose item is no
    longer ``approved`` (cancelled while they were being sent), every selected item's
    row locked (PostgreSQL) until ``conn`` commits (see :func:`ended_meanwhile`)."""
    posts = (await conn.execute(_SENDING_POSTS_ITEMS.where(*where))).all()
    return [str(r.id) for r in posts if r.status != Status.approved.value]


async def ended_meanwhile(conn: Conn, *where: sa.ColumnElement[bool]) -> list[str]:
    """The ids of the ``sending`` deliveries ``where`` selects that end ``cancelled``
    where they would have gone back to ``pending`` or on to ``deliveryUnknown``: cards
    whose wait a decision closed (:func:`cards_of_closed_waits`), and gating deliveries
    whose item was cancelled while they were being sent (the cancel ended the item's
    unsent deliveries, not one in flight: put back, it was posted after the cancel;
    uncertain, it asked an operator to confirm or retry the post of a cancelled item).
    Items are locked before waits' episodes, in the order a decision locks them."""
    ended = await posts_of_ended_items(conn, *where)
    return ended + await cards_of_closed_waits(conn, *where)


def action_for(binding: Binding | None) -> tuple[str, str]:
    """(action, channel) for a gating delivery on ``binding`` (SPEC 6 table)."""
    if binding is None:
        return "post", "none"
    kind = BindingKind(binding.kind)
    if kind == BindingKind.flow:
        return "continuation", kind.value
    if binding.silent:
        return "silent", kind.value
    if kind in (BindingKind.api, BindingKind.studio):
        return "reveal", kind.value
    if kind == BindingKind.scheduled:
        return "scheduled", kind.value
    return "post", kind.value


def _kinds(action: str) -> frozenset[str]:
    return frozenset(
        kind.value
        for kind in BindingKind
        if action_for(Binding("", "", "", kind.value, {}, False, None, True, 0))[0] == action
    )


#: Binding kinds whose (not silent) binding gets its approved answer as a channel post.
POST_KINDS = _kinds("post")
#: Binding kinds whose (not silent) binding sees its approved answer revealed.
REVEAL_KINDS = _kinds("reveal")


class LocalRelay(Protocol):
    """What :class:`Outbox` needs from the relay running in this process."""

    handoff_token: str
    send_lease_ms: int
    #: the process holding what is handed over (``lease_owner``)
    owner: Callable[[], str | None]

    def has_room(self) -> bool:
        """Whether the relay can start another send now."""
        ...


class Outbox:
    """Writes delivery rows in the caller's transaction (the state change they deliver).

    While this process runs a relay (:meth:`attach`) that has room, a new delivery is
    written already claimed by it (``sending``, its hand-off lease token, a send lease)
    and handed to it after commit (:data:`HANDOFF_TOPIC` payloads): the send starts
    without a claim round trip, so an approval reaches the channel a few milliseconds
    after it commits. Safety is that of any claim: the lease fences the outcome commit,
    and if the process dies before the outcome is committed, lease expiry makes a post
    ``deliveryUnknown``, never a second post. Without a relay (API-only replicas, the
    CLI) rows are ``pending`` for whichever relay claims them, woken by :func:`notify`.
    """

    def __init__(self, clock: Clock, ids: IdFactory) -> None:
        self.clock = clock
        self.ids = ids
        self._local: LocalRelay | None = None
        self._review_needed: ReviewNeeded | None = None
        #: Review-card writes that met a damaged database: one ERROR line a minute at
        #: most, naming the file or database, no traceback (the items still wait).
        self.cards_damaged = Tally(
            log,
            "%d review card write(s) met a damaged database (the latest: work item %s): %s",
            every_s=60.0,
            level=logging.ERROR,
        )

    def on_review_needed(self, hook: ReviewNeeded | None) -> None:
        """Let ``hook`` write review cards whenever an item starts waiting for a human
        (set by the composition root; the review layer sits above the outbox)."""
        self._review_needed = hook

    async def review_needed(
        self, conn: Conn, item_id: str, reason: str, delivery_id: str | None = None
    ) -> None:
        """Call the review hook inside the transition's transaction, in a SAVEPOINT: a
        failure to write cards is logged and rolled back alone, and never blocks the
        transition itself (the item still reaches the actionable queue). A database
        fault is no such failure: it fails the transition's transaction, which is tried
        again whole (a 503, a runner's kept verdict), cards and all."""
        hook = self._review_needed
        if hook is None:
            return
        try:
            async with conn.begin_nested():
                await hook(conn, item_id, reason, delivery_id)
        except Exception as exc:
            if unavailable(exc) is not None:
                # Committing the transition without them lost the cards (and the
                # episode their reminders and expiry hang on) for good: nobody was
                # told the item waits. The database is what failed, not the cards.
                raise
            damaged = damage_met(conn, exc)
            if damaged is None:
                log.error(
                    "review cards for work item %s could not be written",
                    item_id,
                    exc_info=loggable(exc),
                )
            else:
                # Counted as runners and requests count it (it was the driver's traceback
                # for every item that escalated).
                self.cards_damaged.add(item_id, damaged.detail)

    def attach(self, relay: LocalRelay | None) -> None:
        """Hand new deliveries to ``relay`` (``None``: stop handing them over)."""
        self._local = relay

    async def gating_row(self, conn: Conn, item: WorkItem) -> dict[str, Any]:
        """The gating delivery row of ``item`` for its session's active binding (read
        here), not yet written. An approval (``review.decisions.commit_verdict``) reads
        it before its move, then, in its transaction:

        * a channel post (or a flow's continuation): :meth:`write_gating` queues it for
          the relay, after the move to ``approved``;
        * an internal action (:func:`is_internal`: reveal, silent, scheduled) has
          nothing to send, so it is done at once: :meth:`deliver_internal` writes the
          row ``sent`` and reveals the withheld answer, between the move to
          ``approved`` and the move on to ``completed``, which the approval's own
          ``UPDATE`` makes (``workitems.Then``). SPEC 6: success is the delivery
          ``sent`` and the item ``completed`` in one transaction; through the relay it
          cost a second transaction and a relay pass, with no send that could fail in
          between."""
        binding = await active_binding(conn, item.session_id)
        action, channel = action_for(binding)
        now = self.clock.now_ms()
        return {
            "id": self.ids.new("dlv"),
            "org_id": item.org_id,
            "work_item_id": item.id,
            "kind": "gating",
            "action": action,
            "channel": channel,
            "binding_id": binding.id if binding else None,
            "address": binding.address if binding else {},
            "text": item.snapshot or item.summary or "",
            "status": (
                DeliveryStatus.continuation if action == "continuation" else DeliveryStatus.pending
            ).value,
            "attempts": 0,
            "next_attempt_at": now,
            "created_at": now,
            "updated_at": now,
        }

    async def write_gating(self, conn: Conn, values: dict[str, Any]) -> Delivery:
        """Queue a gating row of :meth:`gating_row` that has something to send (a post,
        or a flow's continuation), in the approval's transaction."""
        return await self._insert(conn, values, values["created_at"])

    async def deliver_internal(
        self, conn: Conn, values: dict[str, Any], item: WorkItem
    ) -> Delivery:
        """Do an internal gating delivery of :meth:`gating_row`: the row written
        ``sent`` and, for a reveal, the withheld answer made visible with its session
        event. The item's move to ``completed`` is the caller's, after this (so
        ``delivered`` follows the message in the session's events)."""
        values.update(status=DeliveryStatus.sent.value, attempts=1)
        await conn.execute(_INSERT_DELIVERY, values)
        if values["action"] == "reveal":
            await reveal(conn, self.clock, item.id)
        count_after_commit(conn, labelled(METRICS.deliveries, values["channel"], "sent"))
        return delivery_of(values)

    async def enqueue_reply(
        self, conn: Conn, *, org_id: str, binding: Binding, text: str
    ) -> Delivery | None:
        """Queue a plain turn's reply on a channel binding (none for silent or api)."""
        if binding.silent or BindingKind(binding.kind) not in CHANNEL_KINDS:
            return None
        now = self.clock.now_ms()
        values = self._post_row(
            now,
            org_id=org_id,
            work_item_id=None,
            kind="reply",
            channel=binding.kind,
            binding_id=binding.id,
            address=binding.address,
            text=text,
        )
        return await self._insert(conn, values, now)

    def _post_row(self, now: int, delivery_id: str | None = None, **fields: Any) -> dict[str, Any]:
        """A new pending ``post`` delivery row: ``fields`` plus the bookkeeping columns."""
        return {
            "id": delivery_id or self.ids.new("dlv"),
            **fields,
            "action": "post",
            "status": DeliveryStatus.pending.value,
            "attempts": 0,
            "next_attempt_at": now,
            "created_at": now,
            "updated_at": now,
        }

    async def enqueue_answer(
        self,
        conn: Conn,
        *,
        org_id: str,
        work_item_id: str | None,
        channel: str,
        address: dict[str, Any],
        text: str,
    ) -> Delivery:
        """Queue an :data:`ANSWER` in the caller's transaction (a decision's, when the
        reply decided): sent by the relay with its retries, like any delivery."""
        now = self.clock.now_ms()
        values = self._post_row(
            now,
            org_id=org_id,
            work_item_id=work_item_id,
            kind=ANSWER,
            channel=channel,
            binding_id=None,
            address=address,
            text=text,
        )
        return await self._insert(conn, values, now)

    async def enqueue_card(
        self,
        conn: Conn,
        *,
        org_id: str,
        work_item_id: str,
        channel: str,
        address: dict[str, Any],
        text: str,
        kind: str = CARD,
        delivery_id: str | None = None,
    ) -> Delivery:
        """Queue a review card post (or, ``kind`` :data:`CARD_UPDATE`, the edit of a
        posted card) in the caller's transaction: durable and retried like any delivery
        (``delivery_id``: the row's id, made beforehand when the card names it)."""
        now = self.clock.now_ms()
        values = self._post_row(
            now,
            delivery_id,
            org_id=org_id,
            work_item_id=work_item_id,
            kind=kind,
            channel=channel,
            binding_id=None,
            address=address,
            text=text,
        )
        return await self._insert(conn, values, now)

    async def _insert(self, conn: Conn, values: dict[str, Any], now: int) -> Delivery:
        """Insert a delivery row: handed to this process's relay after commit, or
        announced to every relay (NOTIFY) when no local relay takes it. A flow's
        continuation is no relay's work: it wakes the flow resumers instead (in this
        process at commit, on every replica by NOTIFY; only approvals of flow items pay
        it)."""
        handed = self.claim_for_local(values, now)
        if handed:
            signal_after_commit(conn, HANDOFF_TOPIC, Handoff(values, held_counts(conn)))
        await conn.execute(_INSERT_DELIVERY, values)
        if values["status"] == DeliveryStatus.continuation.value:
            await wakes.after_commit(conn, Wake.flow)
        elif not handed:
            await notify(conn)
        return delivery_of(values)

    def claim_for_local(self, values: dict[str, Any], now: int) -> bool:
        """Write ``values`` (a new pending row) already claimed for the local relay if it
        has room; its caller hands the row over (:data:`HANDOFF_TOPIC`) after commit.
        Then no other relay needs waking."""
        local = self._local
        if values["status"] != DeliveryStatus.pending.value or local is None:
            return False
        if not local.has_room():
            return False
        values.update(
            status=DeliveryStatus.sending.value,
            lease_token=local.handoff_token,
            lease_expires_at=now + local.send_lease_ms,
            lease_owner=local.owner(),
            attempts=1,
        )
        return True

    def post_values(self, item: WorkItem, now: int) -> dict[str, Any]:
        """The gating delivery row of ``item`` as a channel post, without the binding's
        columns (``channel``, ``binding_id``, ``address``: the caller's statement takes
        them from the binding it checked)."""
        return {
            **_UNSET_COLUMNS,
            **self._post_row(
                now,
                org_id=item.org_id,
                work_item_id=item.id,
                kind="gating",
                text=item.snapshot or item.summary or "",
            ),
        }


def is_internal(values: dict[str, Any]) -> bool:
    """Whether a gating row of :meth:`Outbox.gating_row` has nothing to send (reveal,
    silent, scheduled): it is done in the approval's transaction."""
    return values["action"] in INTERNAL_ACTIONS


async def reveal(conn: Conn, clock: Clock, item_id: str) -> None:
    """Make an approved item's withheld assistant message visible (api/studio) and queue
    its ``message`` event: before the item's move to ``completed``, so ``delivered``
    follows it in the session's event log."""
    revealed = await conn.execute(_REVEAL_ONE, {"p_item": item_id})
    for row in revealed.all():
        await session_events.message_visible(conn, clock, row.session_id, row.id)


_INSERT_DELIVERY = t.deliveries.insert()
#: Reveal (api/studio): the approved item's withheld assistant message becomes visible.
_REVEAL_ONE = (
    t.messages.update()
    .where(
        t.messages.c.id
        == sa.select(t.work_items.c.gated_message_id)
        .where(t.work_items.c.id == sa.bindparam("p_item"))
        .scalar_subquery()
    )
    .values(lead_gated=False)
    .returning(t.messages.c.id, t.messages.c.session_id)
)
#: Columns a new delivery row leaves to their defaults.
_UNSET_COLUMNS: dict[str, Any] = {
    "lease_owner": None,
    "lease_token": None,
    "lease_expires_at": None,
    "error": None,
    "external_id": None,
}


def delivery_of(values: dict[str, Any]) -> Delivery:
    """The :class:`Delivery` of a new row's inserted ``values``."""
    return Delivery(**{**_UNSET_COLUMNS, **values})


async def notify(conn: Conn) -> None:
    """Wake relays once this transaction commits: this process's relay through the
    database's after-commit hook (topic :data:`OUTBOX_TOPIC`), the other replicas through
    PostgreSQL ``NOTIFY`` (delivered at commit, dropped on rollback)."""
    signal_after_commit(conn, OUTBOX_TOPIC)
    if conn.dialect.name == "postgresql":
        await conn.execute(sa.text(f"SELECT pg_notify('{NOTIFY_CHANNEL}', '')"))


async def listen(
    dsn: str,
    on_notify: Callable[[], None],
    stop: asyncio.Event,
    *,
    reconnect_s: float = 1.0,
    ready: Callable[[], None] | None = None,
    channel: str = NOTIFY_CHANNEL,
    on_payload: Callable[[str], None] | None = None,
) -> None:
    """PostgreSQL ``LISTEN`` on one ``channel`` (default: the outbox's) until ``stop``.

    ``on_notify`` runs for every notification (``on_payload`` instead, with the
    payload, when given), and once after each (re)connection. See :func:`listen_all`.
    """
    handler = on_payload if on_payload is not None else (lambda _payload: on_notify())
    await listen_all(
        dsn, {channel: handler}, stop, on_connect=[on_notify], reconnect_s=reconnect_s, ready=ready
    )


async def listen_all(
    dsn: str,
    channels: Mapping[str, Callable[[str], None]],
    stop: asyncio.Event,
    *,
    on_connect: Sequence[Callable[[], None]] = (),
    on_lost: Sequence[Callable[[], None]] = (),
    reconnect_s: float = 1.0,
    ready: Callable[[], None] | None = None,
    check_s: float = LISTEN_CHECK_S,
    check_timeout_s: float = LISTEN_CHECK_TIMEOUT_S,
) -> None:
    """PostgreSQL ``LISTEN`` on every channel of ``channels`` over one connection, until
    ``stop`` is set; each notification's payload goes to its channel's handler.

    One connection per process, not one per channel: PostgreSQL signals every listening
    backend of the database for every NOTIFY, whatever it listens to, and each woken
    backend reads the queue in a transaction of its own (measured: with three listener
    connections per process those wake-ups were more transactions per gated lifecycle
    than the lifecycle's own). ``on_connect`` callbacks run after each (re)connection, so
    that nothing sent while the connection was down waits for the next poll, and
    ``on_lost`` callbacks when a connection they ran for is gone (or stopped). A lost
    connection is re-opened after ``reconnect_s``. ``dsn`` may be an SQLAlchemy
    ``postgresql+asyncpg://`` URL or a libpq one.

    A connection that dies without a word (the server's host gone, a firewall dropping an
    idle flow: no FIN, no termination event) would otherwise look alive for ever, and
    what relies on hearing every change (the intake's configuration cache) would go stale
    with it. So every ``check_s`` the connection must answer a no-op ``LISTEN`` within
    ``check_timeout_s``, or it counts as lost: ``on_lost`` runs and it is re-opened.
    """
    # Imported here, once per listener: only a PostgreSQL service listens, and an
    # operator command on SQLite has no use for the driver (about 20 ms of its start).
    import asyncpg

    dsn = dsn.replace("postgresql+asyncpg://", "postgresql://", 1)
    names = ", ".join(channels)
    while not stop.is_set():
        lost = asyncio.Event()
        try:
            conn = await asyncpg.connect(dsn)
        except (OSError, asyncpg.PostgresError) as exc:
            # Named by its rule, as every database fault in the log is (an operator
            # greps one rule for the whole outage).
            log.warning("LISTEN %s: cannot connect (service.unavailable): %s; retrying", names, exc)
        else:
            connected = False
            try:
                conn.add_termination_listener(lambda *_, lost=lost: lost.set())
                for channel, handler in channels.items():
                    await conn.add_listener(
                        channel, lambda *args, handler=handler: handler(str(args[-1]))
                    )
                connected = True
                for callback in on_connect:
                    callback()
                if ready is not None:
                    ready()
                check = f"LISTEN {_quoted(next(iter(channels)))}"
                await _hold(conn, stop, lost, check, check_s, check_timeout_s, names)
            finally:
                if connected:
                    for callback in on_lost:
                        callback()
                if lost.is_set():
                    conn.terminate()  # no goodbye to a connection that may not answer
                else:
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=2)
        if not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=reconnect_s)


async def _hold(
    conn: asyncpg.Connection,
    stop: asyncio.Event,
    lost: asyncio.Event,
    check: str,
    check_s: float,
    check_timeout_s: float,
    names: str,
) -> None:
    """Until ``stop``, or until the connection is lost (``lost`` is set then): its
    termination, or a liveness check (``check``) unanswered within ``check_timeout_s``.

    The check repeats a LISTEN (a no-op for PostgreSQL) rather than ``SELECT 1``, so that
    ``pg_stat_activity`` still shows the connection for what it is."""
    import asyncpg  # once per connection (see listen)

    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
    try:
        while not (stop.is_set() or lost.is_set()):
            await asyncio.wait(waiters, timeout=check_s, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() or lost.is_set():
                return
            try:
                await asyncio.wait_for(conn.execute(check), timeout=check_timeout_s)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning(
                    "LISTEN %s: the connection did not answer a liveness check "
                    "(service.unavailable): %s; reconnecting",
                    names,
                    type(exc).__name__,
                )
                lost.set()
    finally:
        for waiter in waiters:
            waiter.cancel()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_FOR_ITEM = (
    sa.select(t.deliveries)
    .where(D.work_item_id == sa.bindparam("p_item"))
    .order_by(D.created_at, D.id)
)


async def for_item(conn: Conn, item_id: str) -> list[Delivery]:
    """Deliveries of a work item, oldest first."""
    rows = (await conn.execute(_FOR_ITEM, {"p_item": item_id})).all()
    return [Delivery.from_row(r) for r in rows]


#: Deliveries not yet in a final state: one an operator may still have to act on
#: (``deliveryUnknown``) or one still on its way (``pending``, ``sending``).
UNSETTLED = (
    DeliveryStatus.pending.value,
    DeliveryStatus.sending.value,
    DeliveryStatus.deliveryUnknown.value,
)
_IS_UNSETTLED = D.status.in_(UNSETTLED)
# Every one of the item's deliveries ranked twice (newest first; unsettled ones oldest
# first among themselves) and counted, before any is left out: one statement. Ranked by
# their narrow columns alone, the whole rows joined for the few kept: ranking the whole
# rows sorted every delivery's text and address twice (20,000 deliveries of one item,
# PostgreSQL: 167 ms, the sorts spilled to disk; bench.operator_reads).
_RANKED = (
    sa.select(
        D.id,
        sa.func.row_number()
        .over(order_by=(D.created_at.desc(), D.id.desc()))
        .label("p_newest_rank"),
        sa.func.row_number()
        .over(partition_by=_IS_UNSETTLED, order_by=(D.created_at, D.id))
        .label("p_unsettled_rank"),
        _IS_UNSETTLED.label("p_is_unsettled"),
        sa.func.count().over().label("p_total"),
        sa.func.sum(sa.case((_IS_UNSETTLED, 1), else_=0)).over().label("p_unsettled"),
    )
    .where(D.work_item_id == sa.bindparam("p_item"))
    .subquery()
)
_R = _RANKED.c
_FOR_DETAIL = (
    sa.select(t.deliveries, _R.p_total, _R.p_unsettled)
    .join_from(t.deliveries, _RANKED, _R.id == D.id)
    .where(
        D.work_item_id == sa.bindparam("p_item"),
        sa.or_(
            _R.p_newest_rank <= sa.bindparam("p_limit"),
            sa.and_(_R.p_is_unsettled, _R.p_unsettled_rank <= sa.bindparam("p_limit")),
        ),
    )
    .order_by(D.created_at, D.id)
)
_DELIVERY_COLUMNS = len(t.deliveries.c)


class ItemDeliveries(NamedTuple):
    """Deliveries of a work item as its review detail lists them (:func:`for_detail`)."""

    #: the listed ones, oldest first
    listed: list[Delivery]
    #: how many the item has in all
    total: int
    #: how many of them are :data:`UNSETTLED`
    unsettled: int


async def for_detail(conn: Conn, item_id: str, limit: int) -> ItemDeliveries:
    """The deliveries of a work item an operator must see, oldest first, in one
    statement: its ``limit`` newest and its :data:`UNSETTLED` ones whatever their age
    (the oldest ``limit`` of those), so at most twice ``limit``. An uncertain delivery
    older than the newest ones dropped out of the detail, where the operator acts on it.
    """
    rows = (await conn.execute(_FOR_DETAIL, {"p_item": item_id, "p_limit": limit})).all()
    if not rows:
        return ItemDeliveries([], 0, 0)
    n = _DELIVERY_COLUMNS
    total, unsettled = rows[0][n:]
    return ItemDeliveries([Delivery.from_row(r[:n]) for r in rows], int(total), int(unsettled))


#: An item's cancel ends its unsent deliveries in one of these statuses, with the
#: item's transaction (:func:`cancel_for_item`), but for :data:`ANSWER` and
#: :data:`CARD_UPDATE` ones.
_CANCEL_FOR_ITEM = (
    t.deliveries.update()
    .where(
        D.work_item_id == sa.bindparam("p_item"),
        D.status == sa.bindparam("p_status"),
        D.kind.not_in([ANSWER, CARD_UPDATE]),
    )
    .values(status=DeliveryStatus.cancelled.value, updated_at=sa.bindparam("p_now"), **ENDED)
    .returning(D.channel)
)


async def cancel_for_item(conn: Conn, clock: Clock, item_id: str) -> None:
    """Cancel an item's unsent deliveries (the item was cancelled), but for answers to
    a reviewer's mail (:data:`ANSWER`) and the edits of posted cards
    (:data:`CARD_UPDATE`): what they say was so when they were written (an earlier
    wait's card edited to show its Return; cancelled, that card kept its buttons).

    The ``pending`` ones (a review card, or the gating delivery of an approved item
    whose post is being retried) are counted ``cancelled``, how they ended. The
    ``deliveryUnknown`` ones are cancelled too, uncounted: their sends were counted
    ``deliveryUnknown`` as they ended (``leadgate_deliveries_total`` counts each end
    of a delivery's run through the outbox once). One fenced update per status: the
    row's status before the update is what tells them apart."""
    now = clock.now_ms()
    for status in (DeliveryStatus.pending, DeliveryStatus.deliveryUnknown):
        ended = await conn.execute(
            _CANCEL_FOR_ITEM, {"p_item": item_id, "p_status": status.value, "p_now": now}
        )
        channels = [str(r.channel) for r in ended.all()]
        if status == DeliveryStatus.pending:
            count_cancelled(conn, channels)


async def get_delivery(conn: Conn, delivery_id: str, org_id: str) -> Delivery:
    """A delivery of ``org_id`` (404 otherwise)."""
    row = (
        await conn.execute(sa.select(t.deliveries).where(D.id == delivery_id, D.org_id == org_id))
    ).first()
    if row is None:
        raise NotFound(f"no delivery {quoted(delivery_id)}", rule="delivery.not_found")
    return Delivery.from_row(row)


#: The audit actions of an operator's recovery of a delivery (:func:`recover`).
RECOVERY_ACTIONS = ("deliveryConfirmed", "deliveryRetried")


async def _sent_again(conn: Conn, delivery_id: str, attempts: int) -> str | None:
    """Why a recovery fenced on ``attempts`` matched no row when the delivery is still
    ``deliveryUnknown``: it was sent again since (else ``None``)."""
    now = (await conn.execute(sa.select(D.status, D.attempts).where(D.id == delivery_id))).first()
    if now is None or now.status != DeliveryStatus.deliveryUnknown.value:
        return None
    return (
        f"delivery {delivery_id} was sent again since attempt {attempts} was read "
        f"(attempt {now.attempts}), and that send's outcome is unknown too; check the "
        "channel again; nothing changed"
    )


async def _not_recovered(conn: Conn, delivery: Delivery) -> str:
    """Why :func:`recover` matched no row, for the person who asked: the status the
    delivery has now, read again (it named the status read before the fenced update, so
    a change committed in between read "is deliveryUnknown, not deliveryUnknown"), and
    what the audit says moved it on. Only read on that failure."""
    now = (await conn.execute(sa.select(D.status, D.updated_at).where(D.id == delivery.id))).first()
    if now is None:
        raise NotFound(f"no delivery {delivery.id}", rule="delivery.not_found")
    return (
        f"delivery {delivery.id} is {now.status}, not deliveryUnknown"
        f"{await _moved_by(conn, delivery, now.status, int(now.updated_at))}; "
        "only an uncertain delivery can be confirmed or retried"
    )


async def _moved_by(conn: Conn, delivery: Delivery, status: str, updated_at: int) -> str:
    """What took ``delivery`` out of ``deliveryUnknown``, for :func:`_not_recovered`
    (": deliveryConfirmed by user:... (slack) at ..."): its latest recovery by an
    operator or, for a review card now ``cancelled``, the decision on its item that
    ended it if that came later (a decision cancels an uncertain email card, and audits
    the item, not the card), and for a gating delivery now ``cancelled``, its item's
    cancel. ``""`` when the audit knows nothing."""
    a = t.audit.c
    other = t.deliveries.alias("other")
    moved = (a.delivery_id == delivery.id) & a.action.in_(RECOVERY_ACTIONS)
    if (
        delivery.kind == "gating"
        and status == DeliveryStatus.cancelled.value
        and delivery.work_item_id
    ):
        # Only its item's cancel ends a gating delivery so (its approval came before).
        moved |= (
            (a.work_item_id == delivery.work_item_id)
            & (a.created_at <= updated_at)
            & a.delivery_id.is_(None)
            & (a.action == "cancel")
        )
    if delivery.kind == CARD and status == DeliveryStatus.cancelled.value and delivery.work_item_id:
        # The item's decision (a move out of awaitingHuman, a cancel, or the recovery of
        # its gating delivery), made before the card's cancellation in its transaction.
        moved |= (
            (a.work_item_id == delivery.work_item_id)
            & (a.created_at <= updated_at)
            & (
                (
                    a.delivery_id.is_(None)
                    & ((a.from_status == Status.awaitingHuman.value) | (a.action == "cancel"))
                )
                | ((other.c.kind == "gating") & a.action.in_(RECOVERY_ACTIONS))
            )
        )
    row = (
        await conn.execute(
            sa.select(a.action, a.actor, a.surface, a.created_at, a.delivery_id)
            .select_from(t.audit.outerjoin(other, other.c.id == a.delivery_id))
            .where(moved)
            .order_by(a.created_at.desc(), a.id.desc())
            .limit(1)
        )
    ).first()
    if row is None:
        return ""
    whose = "" if row.delivery_id == delivery.id else " of its work item"
    return f": {workitems.who_did(row, of=whose)}"


def _not_in_flight(now: int) -> sa.ColumnElement[bool]:
    """A ``deliveryUnknown`` row no send may still be posting: none lapsed into it
    (``lease_expires_at`` ``NULL``), or its lapsed lease is past
    :data:`IN_FLIGHT_AFTER_LAPSE_MS` at ``now``."""
    return sa.or_(
        D.lease_expires_at.is_(None), D.lease_expires_at <= now - IN_FLIGHT_AFTER_LAPSE_MS
    )


async def _refuse_in_flight(conn: Conn, delivery_id: str, now: int) -> None:
    """Raise 409 ``delivery.in_flight`` when a Retry matched no row because the send
    whose lease lapsed into ``deliveryUnknown`` may still be posting (with the seconds
    left, ``retry_after_s``); else nothing (another rule says why)."""
    found = (
        await conn.execute(sa.select(D.status, D.lease_expires_at).where(D.id == delivery_id))
    ).first()
    if (
        found is None
        or found.status != DeliveryStatus.deliveryUnknown.value
        or found.lease_expires_at is None
    ):
        return
    left_ms = int(found.lease_expires_at) + IN_FLIGHT_AFTER_LAPSE_MS - now
    if left_ms <= 0:
        return
    left_s = -(-left_ms // 1000)
    raise TransitionError(
        f"delivery {delivery_id}'s send lease lapsed while it may still have been posting: "
        f"that send may still post it and record what it posted; retry in {left_s} s "
        "(a Retry now could post it twice); Confirm delivered is taken now; nothing changed",
        rule=IN_FLIGHT_RULE,
        retry_after_s=left_s,
    )


async def recover(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    delivery: Delivery,
    *,
    action: str,
    actor: str,
    surface: str | None = None,
    identity: str | None = None,
    external_id: str | None = None,
    attempts: int | None = None,
) -> Delivery:
    """Operator recovery of a ``deliveryUnknown`` delivery, fenced on that status (and,
    given ``attempts``, on the send the operator checked: one sent again since and
    uncertain again is a 409 ``delivery.attempts``, so that a Retry clicked again after
    its answer was lost does not send it a third time).

    ``confirm``: the message did arrive -> delivery ``sent``, item ``completed``
    (``external_id``: the platform's id of the message, when the confirmation comes
    with it, e.g. a click on the card itself; later updates then edit that message).
    ``retry``: it did not -> delivery ``pending`` again (a new attempt), item stays
    ``approved``; but a review card whose wait a decision closed ends ``cancelled``
    (error :data:`CARD_DECIDED_ERROR`), as the decision cancels a card not sent yet:
    posted now, it would offer a decision already made. A second click finds the
    delivery no longer ``deliveryUnknown`` and gets a 409; nothing happens twice.

    A Retry of a row whose send lease lapsed less than :data:`IN_FLIGHT_AFTER_LAPSE_MS`
    ago (``lease_expires_at``, kept by the expiry) is a 409 ``delivery.in_flight`` with
    the seconds left: that send may still be posting, and then records what it posted
    (the last part of a long text, a one-part text whole), which a Retry before that
    record posted a second time. A Confirm is taken at once. A record of every part
    posted clears the wait (nothing is left to post).
    """
    now = clock.now_ms()
    if delivery.kind == "gating" and delivery.work_item_id and conn.dialect.name == "postgresql":
        # Its item's row first (SQLite has one writer), as a cancel takes it before it
        # cancels the item's unsent deliveries, one status at a time: a Retry landing between the
        # cancel's two updates was put back ``pending`` after the first and missed by
        # the second, and the relay posted the answer of a cancelled item. Now either
        # the cancel waits and finds it ``pending``, or this waits and finds it
        # ``cancelled`` (409). Item, then delivery, as the cancel and the relay's
        # outcome commit take them (a Confirm moves the item after the delivery: it
        # takes the item's row first too, so that it and a Retry never deadlock).
        await workitems.get(conn, delivery.work_item_id, lock=True)
    if action == "confirm":
        values: dict[str, Any] = {"status": DeliveryStatus.sent.value, "error": None, **ENDED}
        if external_id is not None:
            values["external_id"] = external_id
    elif delivery.kind == CARD and await cards_of_closed_waits(
        conn, D.id == delivery.id, status=DeliveryStatus.deliveryUnknown
    ):
        # Its wait's row is locked first (PostgreSQL), as a decision takes it, so a
        # decision committing meanwhile is waited for and read here.
        values = {"status": DeliveryStatus.cancelled.value, "error": CARD_DECIDED_ERROR, **ENDED}
    else:
        values = {"status": DeliveryStatus.pending.value, "next_attempt_at": now}
    fence = [D.id == delivery.id, D.status == DeliveryStatus.deliveryUnknown.value]
    if attempts is not None:
        fence.append(D.attempts == attempts)
    if values["status"] == DeliveryStatus.pending.value:
        fence.append(_not_in_flight(now))
    row = (
        await conn.execute(
            t.deliveries.update()
            .where(*fence)
            .values(updated_at=now, lease_expires_at=None, **values)
            .returning(*t.deliveries.c)
        )
    ).first()
    if row is None:
        if values["status"] == DeliveryStatus.pending.value:
            await _refuse_in_flight(conn, delivery.id, now)
        if attempts is not None:
            again = await _sent_again(conn, delivery.id, attempts)
            if again is not None:
                raise TransitionError(again, rule="delivery.attempts")
        raise TransitionError(await _not_recovered(conn, delivery), rule="delivery.status")
    # Ended cancelled, it is not counted again: its send was counted deliveryUnknown.
    updated = Delivery.from_row(row)
    await workitems.audit(
        conn,
        clock,
        ids,
        org_id=updated.org_id,
        actor=actor,
        action="deliveryConfirmed" if action == "confirm" else "deliveryRetried",
        work_item_id=updated.work_item_id,
        delivery_id=updated.id,
        text=updated.error if updated.status == DeliveryStatus.cancelled.value else None,
        surface=surface,
        identity=identity,
    )
    if action == "confirm" and updated.kind == "gating" and updated.work_item_id:
        await workitems.transition(
            conn,
            clock,
            ids,
            updated.work_item_id,
            src=Status.approved,
            dst=Status.completed,
            actor=actor,
            action="deliveryConfirmed",
            surface=surface,
            identity=identity,
        )
    if updated.status == DeliveryStatus.pending.value:
        await notify(conn)
    return updated
