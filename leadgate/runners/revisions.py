"""Revision dispatch: lead feedback and human returns reach the worker as internal turns.

A pass that claims nothing learns, from the claim's own read, when the earliest revision
lease held lapses (:meth:`leadgate.turns.path.TurnService.claim_revision_or_lapse`), and
the runner loop sleeps no longer than that (:meth:`RevisionRunner.due_in_s`): a revision
whose dispatcher stalled (alive, never finishing) or went away without a reap is run
again when its lease lapses, not up to a poll later. An empty pass is that one read.
"""

from __future__ import annotations

import logging

from leadgate.core.errors import DatabaseDamaged, log_failure
from leadgate.core.runners import after_lapse, seconds_until
from leadgate.domain.rows import WorkItem
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.runners")


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
        early and look again. The next look for a claim in doubt, when sooner
        (:meth:`TurnService.claim_revision_or_lapse
        <leadgate.turns.path.TurnService.claim_revision_or_lapse>`). On PostgreSQL a
        pass whose claim found the claimable items all row-locked by another transaction
        looks again after :data:`~leadgate.core.runners.LOCKED_RECHECK_MS` (the claim
        answers that time), not at the poll: their holder may commit with no wake-up to
        follow."""
        return seconds_until(
            self.turns.clock.now_ms(),
            after_lapse(self._next_lapse),
            self.turns.revisions_lost.next_due(),
        )

    async def run_once(self) -> bool:
        """Claim one item with pending feedback and run its internal turn."""
        # One read: an item to claim or, when none is claimable, the earliest lapse.
        item = await self.turns.claim_revision_or_lapse()
        if not isinstance(item, WorkItem):
            self._next_lapse = item
            return False
        try:
            await self.turns.run_revision(item)
        except DatabaseDamaged:
            # The lease expires as below; the loop says what it is in one line (it was
            # a traceback per pass).
            raise
        except Exception as exc:
            # The lease expires and another pass retries the turn; feedback is kept.
            log_failure(log, exc, "revision turn for %s failed", item.id)
        return True
