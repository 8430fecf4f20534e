"""Crash recovery of recorded turns (see :mod:`leadgate.turns.runs`)."""

from __future__ import annotations

import logging

from leadgate.turns import runs
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.runners")


class TurnRecovery:
    """Claims a recorded run whose process is known dead (or whose lease expired, or
    that stopped here on a database fault) and carries it out: re-run, closed, surfaced
    to a human, or answered with a failure notice. One claim takes every takeable run of
    one session, so a session gets one recovered turn, never two at once."""

    name = "turn-recovery"

    def __init__(self, turns: TurnService) -> None:
        self.turns = turns

    async def run_once(self) -> bool:
        """Claim and carry out one session's runs; True when there were any."""
        claimed = await runs.claim(
            self.turns.db,
            self.turns.clock,
            self.turns.ids,
            owner=self.turns.owner(),
            orphans=self.turns.orphans,
        )
        if claimed is None:
            return False
        log.warning(
            "recovering %d recorded turn(s) of session %s: %s",
            len(claimed.run_ids),
            claimed.session_id,
            claimed.action,
        )
        try:
            await self.turns.resume(claimed)
        except Exception:
            # Claimed again on the next pass rather than when its lease lapses (minutes):
            # each claim counts an attempt, so a run that keeps failing gets its failure
            # notice after MAX_ATTEMPTS instead of being retried for ever.
            self.turns.orphans.add(claimed.token)
            log.exception("recovering session %s failed", claimed.session_id)
        return True
