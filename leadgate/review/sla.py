"""Reminders, escalation and expiry of items waiting for a human (the SLA runner).

Each open review episode (:mod:`leadgate.review.cards`) carries its timers, fixed when it
opened from ``[review]`` and the ``leadgate notify sla`` overrides: ``next_remind_at``
(then every ``remind_every_ms``, when set), ``escalate_at`` (once, to the escalate
tier's destinations) and ``expire_at`` (awaitingHuman only: a deliveryUnknown item is
reminded about, never expired; a human must say what happened).

Exactly once, across replicas and restarts: every firing is one transaction that moves
the episode's timers with a fenced ``UPDATE ... WHERE id = :id AND due_at = :seen AND
closed_at IS NULL`` and writes the cards of that firing; a second runner that read the
same episode matches no row and writes nothing. An expiry first moves the work item
(fenced on ``awaitingHuman``, the same lock order as a human decision, which moves the
item and then closes the episode), so a decision and an expiry racing each other make
exactly one outcome. It moves the item only while the episode it read is still open:
the item may be awaiting a person again in a later wait (returned and handed in again
after the pass read the episode), which is another episode's to expire. Time comes from
the injectable clock.

PostgreSQL: a firing locks the row it moves without waiting (``FOR UPDATE SKIP
LOCKED``): an expiry its item, a reminder or an escalation its episode. It leaves the
episode when another transaction holds that row (a person's decision on the item not
committed yet, which closed the episode too; a turn's intake): a move that waited would
stall the pass, every episode due after it with it, behind a transaction of any length.
The episode is left for :data:`leadgate.core.runners.LOCKED_RECHECK_MS`, and the loop
looks again then (:meth:`SlaRunner.due_in_s`): the holder may commit with no wake-up
for this runner. The episode is still due then, unless that commit decided the item (and
closed it). Until its time the pages pass it over; held again when it is tried again,
it is left for twice as long (up to :data:`leadgate.core.runners.LEFT_AT_MOST_MS`), as
the flow resumer leaves a held continuation. Every pass tried every held episode (a
transaction each), and the loop looked again 50 ms on: N held episodes cost 20 passes a
second of 4N statements each for as long as their rows were held; now each costs its
try at most once a second after its first few. An episode left so does not count
towards the pass's batch: the pass reads on past it, page after page by ``due_at`` then
id, until it has tried a batch of episodes or none is left due (it read one batch and
stopped: a batch of held episodes held back every episode due after them for as long
as their rows were held).

A pass that leaves nothing due also reads when the next timer falls due (the earliest
``due_at`` after now: the first entry of its index), and the runner loop sleeps no longer
than that (:meth:`SlaRunner.due_in_s`): a reminder, an escalation or an expiry fires at
its time, not up to a poll later. An episode opened in this process with a sooner timer
than that wakes the loop at its commit (:meth:`SlaRunner.timers_opened`), and one opened
on another replica does too (PostgreSQL NOTIFY, sent by the episode's INSERT).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import TransitionError
from leadgate.core.metrics import METRICS
from leadgate.core.runners import Left, leave, seconds_until
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, count_after_commit
from leadgate.domain.rows import WorkItem
from leadgate.domain.workitems import Status
from leadgate.review import decisions
from leadgate.review.cards import ReviewNotifier, earliest
from outbox.store import Outbox

log = logging.getLogger("leadgate.review.sla")
E = t.review_episodes.c
W = t.work_items.c

#: The earliest timer of an open episode not due yet, read off the ``due_at`` index (a
#: closed episode has none). Built once: the plan cache keys on the statement object.
_NEXT_DUE = (
    sa.select(E.due_at)
    .where(E.closed_at.is_(None), E.due_at > sa.bindparam("p_now"))
    .order_by(E.due_at)
    .limit(1)
)
#: The open episodes due at ``p_now``, ``p_limit`` of them in firing order; and those
#: after the episode ``p_due``, ``p_id`` in that order (the next page of one pass).
_DUE = (
    sa.select(t.review_episodes)
    .where(E.closed_at.is_(None), E.due_at <= sa.bindparam("p_now"))
    .order_by(E.due_at, E.id)
    .limit(sa.bindparam("p_limit"))
)
_DUE_AFTER = _DUE.where(
    sa.or_(
        E.due_at > sa.bindparam("p_due"),
        sa.and_(E.due_at == sa.bindparam("p_due"), E.id > sa.bindparam("p_id")),
    )
)
#: PostgreSQL: the same but for the episodes in ``p_left``, left because their row was
#: held and not to be tried again yet (only then: the expanding list is compiled again
#: at every execution).
_LEFT = E.id.not_in(sa.bindparam("p_left", expanding=True))
_DUE_BUT = _DUE.where(_LEFT)
_DUE_AFTER_BUT = _DUE_AFTER.where(_LEFT)
#: The item an expiry moves (PostgreSQL: locked, unless another transaction holds it:
#: :meth:`Database.skip_locked`), and whether it exists (told apart from one skipped).
_ITEM = sa.select(t.work_items).where(W.id == sa.bindparam("p_id"))
_ITEM_THERE = sa.select(sa.exists().where(W.id == sa.bindparam("p_id")))
#: Whether the episode is still open: an expiry's item found awaiting a person may be
#: in a later wait than the episode the pass read (a return or a decision closed it, and
#: the item was handed in again: a new episode, its own timers).
_STILL_OPEN = sa.select(sa.exists().where(E.id == sa.bindparam("p_id"), E.closed_at.is_(None)))
#: PostgreSQL: the episode a reminder or an escalation moves, locked unless another
#: transaction holds it (its fenced update matches nothing then, and does not wait for
#: it); an alias, or the update would correlate it with itself.
_LOCKED = t.review_episodes.alias("locked")
_EPISODE = sa.select(_LOCKED.c.id).where(_LOCKED.c.id == sa.bindparam("p_id"))
#: Whether the episode is still open and due at ``p_due``: a fenced update that matched
#: nothing then did so because another transaction held it (told apart from a firing of
#: another runner or a decision that committed first).
_STILL_DUE = sa.select(
    sa.exists().where(
        E.id == sa.bindparam("p_id"), E.closed_at.is_(None), E.due_at == sa.bindparam("p_due")
    )
)


class SlaRunner:
    """Fires due reminders, escalations and expiries (see the module docstring)."""

    name = "review-sla"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        outbox: Outbox,
        notifier: ReviewNotifier,
        *,
        batch: int = 100,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.outbox = outbox
        self.notifier = notifier
        self.batch = batch
        #: the earliest timer not due at the last pass that left nothing due (None: none)
        self._next_due: int | None = None
        #: PostgreSQL: when to look again at firings whose row (item or episode) a pass
        #: found row-locked by another transaction (None: none is left)
        self._locked_look: int | None = None
        #: PostgreSQL: the episodes left so, each with when it is tried again; the pages
        #: pass them over until then
        self._left: dict[str, Left] = {}
        #: Set by the composition root to the loop's wake (see :meth:`timers_opened`).
        self.wake: Callable[[], None] = lambda: None

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until the earliest timer the last pass saw
        falls due, or None when it saw none. The runner loop sleeps no longer than this
        (:func:`leadgate.core.runners.run_loop`). Read from the database, so it covers
        every replica's episodes as of that pass: a timer fired or closed since makes the
        loop wake early and look again; an episode opened since with an earlier timer
        wakes the loop at its commit (:meth:`timers_opened`: in this process, and on
        PostgreSQL from another replica's NOTIFY). Sooner when a pass left a firing
        because its row was row-locked: when the soonest such is tried again."""
        return seconds_until(self.clock.now_ms(), self._next_due, self._locked_look)

    def timers_opened(self, due_at: list[Any]) -> None:
        """Episodes whose earliest timers are ``due_at`` (ms) were opened and committed
        in this process (:data:`leadgate.review.cards.TIMERS_TOPIC`), or on another
        replica (:attr:`leadgate.domain.wakes.Wake.sla`): wake the loop when
        one is sooner than the timer it sleeps toward, or when it knows of none (else
        it would sleep past it, up to a poll). A later one is read by the pass that
        fires the known one: no pass is spent on it."""
        if self._next_due is None or min(due_at) < self._next_due:
            self.wake()

    async def run_once(self) -> bool:
        """Fire what is due now (one batch of episodes, not counting those whose row
        another transaction holds: the pass reads on past them, and passes over those
        left so until they are tried again); True when anything fired."""
        now = self.clock.now_ms()
        fired = tried = 0
        after: sa.Row[Any] | None = None
        # Left episodes not to be tried yet. A left one whose time has come is tried
        # in its place in the pages, or, not there, is no longer due (fired by another
        # runner, closed by a decision): forgotten once the pages reach the end.
        waiting = [ep for ep, left in self._left.items() if left.due > now]
        end = False
        # Page by page past the episodes whose row was held: a pass that read one batch
        # alone found it all held while other transactions kept those rows, fired
        # nothing, and read that same batch at every look, every episode due after it
        # held back meanwhile. Only ``batch`` episodes that were not held count.
        while tried < self.batch:
            page, full = await self._page(now, after, self.batch - tried, waiting)
            for episode in page:
                again = self._left.pop(episode.id, None)
                try:
                    async with self.db.tx() as conn:
                        done = await self._fire(conn, episode, now)
                except TransitionError:
                    done = 0  # decided meanwhile: that decision closed the episode
                if done is None:
                    # The pass's time: every episode left by one pass is tried again by
                    # one pass, not each by a pass of its own.
                    self._left[episode.id] = leave(again, now)
                else:
                    fired += done
                    tried += 1
            if not full:
                end = True  # nothing more is due
                break
            after = page[-1]
        if end:
            self._left = {ep: left for ep, left in self._left.items() if left.due > now}
        self._locked_look = min((left.due for left in self._left.values()), default=None)
        return fired > 0

    async def _page(
        self, now: int, after: sa.Row[Any] | None, limit: int, waiting: list[str]
    ) -> tuple[Sequence[sa.Row[Any]], bool]:
        """Up to ``limit`` open episodes due at ``now``, by ``due_at`` then id, after the
        episode ``after`` (None: from the first), but for those in ``waiting`` (left, not
        to be tried yet), and whether there were that many (more may be due). A short
        page also reads when the next timer falls due, for the loop's sleep
        (:attr:`_next_due`; one read, on the same connection); after a full page it is
        None: more may be due, and the loop runs again at once when the pass fired any
        (and at the poll when other runners fired them all first: never a busy loop)."""
        params: dict[str, Any] = {"p_now": now, "p_limit": limit}
        if after is not None:
            params |= {"p_due": after.due_at, "p_id": after.id}
        if waiting:
            params["p_left"] = waiting
            query = _DUE_BUT if after is None else _DUE_AFTER_BUT
        else:
            query = _DUE if after is None else _DUE_AFTER
        async with self.db.read() as conn:
            page = (await conn.execute(query, params)).all()
            full = len(page) == limit
            self._next_due = None if full else await conn.scalar(_NEXT_DUE, {"p_now": now})
        return page, full

    async def _fire(self, conn: Conn, ep: Any, now: int) -> int | None:
        """Fire what of episode ``ep`` is due at ``now``: the firings made (0 when another
        runner or a decision was first), None when the row it moves (its expiry's item,
        or the episode) was row-locked by another transaction (nothing written)."""
        if ep.expire_at is not None and ep.expire_at <= now:
            return await self._expire(conn, ep)
        purposes: list[str] = []
        next_remind = ep.next_remind_at
        reminders = ep.reminders
        escalate_at, escalated_at = ep.escalate_at, ep.escalated_at
        if next_remind is not None and next_remind <= now:
            purposes.append("reminder")
            reminders += 1
            every = ep.remind_every_ms
            if every:
                # One reminder for any number of missed ones; the next is the first on
                # the interval after now, computed: stepped to, a 1 s interval after a
                # year stopped (or a clock jump) was 31 million steps in the event loop
                # for each episode.
                next_remind += ((now - next_remind) // every + 1) * every
            else:
                next_remind = None
        if escalate_at is not None and escalate_at <= now:
            purposes.append("escalation")
            escalate_at, escalated_at = None, now
        db = self.db
        moved = await conn.execute(
            t.review_episodes.update()
            .where(
                E.id == (db.skip_locked(_EPISODE).scalar_subquery() if db.is_postgres else ep.id),
                E.closed_at.is_(None),
                E.due_at == ep.due_at,
            )
            .values(
                next_remind_at=next_remind,
                reminders=reminders,
                escalate_at=escalate_at,
                escalated_at=escalated_at,
                due_at=earliest(next_remind, escalate_at, ep.expire_at),
            ),
            {"p_id": ep.id},
        )
        if not moved.rowcount:
            if await self._held(conn, _STILL_DUE, {"p_id": ep.id, "p_due": ep.due_at}):
                return None  # looked at again soon
            return 0  # another runner fired it, or a decision closed it
        for purpose in purposes:
            await self.notifier.post_again(conn, ep, purpose)
            fired = METRICS.reminders if purpose == "reminder" else METRICS.escalations
            count_after_commit(conn, fired)
            log.info("review %s: %s for work item %s", ep.id, purpose, ep.work_item_id)
        return len(purposes)

    async def _held(self, conn: Conn, there: sa.Select[Any], params: dict[str, Any]) -> bool:
        """Whether the row a firing's skip-locked statement did not take was left because
        another transaction holds it: on PostgreSQL, ``there`` (read after that
        statement) still finds it as the firing saw it. Never on SQLite, which has no row
        locks (its writers take turns)."""
        return self.db.is_postgres and bool(await conn.scalar(there, params))

    async def _expire(self, conn: Conn, ep: Any) -> int | None:
        found = (await conn.execute(self.db.skip_locked(_ITEM), {"p_id": ep.work_item_id})).first()
        if found is None and await self._held(conn, _ITEM_THERE, {"p_id": ep.work_item_id}):
            return None  # looked at again soon
        if not await conn.scalar(_STILL_OPEN, {"p_id": ep.id}):
            # Closed since the pass read it (read after the item's lock: what closed it
            # has committed). The item awaiting a person now is in another wait.
            return 0
        item = None if found is None else WorkItem.from_row(found)
        if item is None or item.status != Status.awaitingHuman.value:
            # Should not happen (every way out of awaitingHuman closes the episode).
            await conn.execute(
                t.review_episodes.update()
                .where(E.id == ep.id, E.closed_at.is_(None))
                .values(closed_at=self.clock.now_ms(), due_at=None, outcome="stale")
            )
            return 0
        await decisions.expire(conn, self.outbox, item, int(ep.expire_after_ms or 0))
        count_after_commit(conn, METRICS.expiries)
        log.info("work item %s expired after waiting for a decision", item.id)
        return 1
