"""Revision dispatch: lead feedback and human returns reach the worker as internal turns.

A pass that claims nothing also reads when the earliest revision lease held lapses (one
indexed read: ``inProgress`` items by the status index, with feedback and a lease), and
the runner loop sleeps no longer than that (:meth:`RevisionRunner.due_in_s`): a revision
whose dispatcher stalled (alive, never finishing) or went away without a reap is run
again when its lease lapses, not up to a poll later.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

from leadgate.core.errors import DatabaseDamaged
from leadgate.database import schema as t
from leadgate.domain.workitems import Status
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.runners")
W = t.work_items.c

#: The earliest revision lease not lapsed yet: an ``inProgress`` item whose feedback
#: waits holds one while its revision turn runs (the lease and the feedback are given
#: back together). Built once: the plan cache keys on the statement object.
_NEXT_LAPSE = sa.select(sa.func.min(W.lease_expires_at)).where(
    W.status == Status.inProgress.value,
    W.pending_feedback.is_not(None),
    W.lease_expires_at >= sa.bindparam("p_now"),
)


class RevisionRunner:
    """Claims an ``inProgress`` item with pending feedback (leased) and runs its turn."""

    name = "revision-dispatch"

    def __init__(self, turns: TurnService) -> None:
        self.turns = turns
        #: the earliest revision lease not lapsed at the last empty pass (None: none)
        self._next_lapse: int | None = None

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until the earliest revision lease the last
        empty pass saw lapses, or None when it saw none. The runner loop sleeps no longer
        than this (:func:`leadgate.core.runners.run_loop`). Read from the database (every
        replica's leases as of that pass): a revision finished since makes the loop wake
        early and look again."""
        if self._next_lapse is None:
            return None
        # Claimable once the clock is past it (``<``): never earlier, so no busy loop.
        return max(0.0, (self._next_lapse + 1 - self.turns.clock.now_ms()) / 1000)

    async def run_once(self) -> bool:
        """Claim one item with pending feedback and run its internal turn."""
        # Before the claim: a lease that lapses between the two reads is either claimed
        # or seen by the second (due at once), never missed by both.
        now = self.turns.clock.now_ms()
        item = await self.turns.claim_revision()
        if item is None:
            async with self.turns.db.read() as conn:
                self._next_lapse = await conn.scalar(_NEXT_LAPSE, {"p_now": now})
            return False
        try:
            await self.turns.run_revision(item)
        except DatabaseDamaged:
            # The lease expires as below; the loop says what it is in one line (it was
            # a traceback per pass).
            raise
        except Exception:
            # The lease expires and another pass retries the turn; feedback is kept.
            log.exception("revision turn for %s failed", item.id)
        return True
