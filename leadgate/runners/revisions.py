"""Revision dispatch: lead feedback and human returns reach the worker as internal turns."""

from __future__ import annotations

import logging

from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.runners")


class RevisionRunner:
    """Claims an ``inProgress`` item with pending feedback (leased) and runs its turn."""

    name = "revision-dispatch"

    def __init__(self, turns: TurnService) -> None:
        self.turns = turns

    async def run_once(self) -> bool:
        """Claim one item with pending feedback and run its internal turn."""
        item = await self.turns.claim_revision()
        if item is None:
            return False
        try:
            await self.turns.run_revision(item)
        except Exception:
            # The lease expires and another pass retries the turn; feedback is kept.
            log.exception("revision turn for %s failed", item.id)
        return True
