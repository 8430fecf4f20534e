"""Crash recovery of recorded turns (see :mod:`leadgate.turns.runs`)."""

from __future__ import annotations

import logging

from leadgate.core.errors import DatabaseDamaged, log_failure
from leadgate.core.runners import after_lapse, seconds_until
from leadgate.turns import runs
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.runners")


class TurnRecovery:
    """Claims a recorded run whose process is known dead (or whose lease expired, or
    that stopped here on a database fault) and carries it out: re-run, closed, surfaced
    to a human, or answered with a failure notice. One claim takes every takeable run of
    one session, so a session gets one recovered turn, never two at once. Each pass
    without orphans of its own (nor a look due for a lost one's token:
    :attr:`TurnService.lost <leadgate.turns.path.TurnService.lost>`) first reads whether
    anything is takeable and when the earliest lease lapses
    (:func:`leadgate.turns.runs.lease_check`): the loop sleeps no longer than until then,
    or until the next such look (:meth:`due_in_s`).

    ``own_only``: the recovery of a process that runs no runners (``serve --role api``).
    Its orphans and watched tokens are in its memory alone, so no worker replica's
    recovery can take those runs before their 15-minute lease lapses (their owner is
    alive), and then it closed them as a live owner's stalled turn, the message never
    answered. This one takes those runs only (:func:`leadgate.turns.runs.claim`'s
    ``own_only``), and never reads for lapsed leases: a pass with neither an orphan nor
    a look due is free."""

    name = "turn-recovery"

    def __init__(self, turns: TurnService, *, own_only: bool = False) -> None:
        self.turns = turns
        self.own_only = own_only
        #: the earliest run lease not lapsed at the last check (None: none)
        self._next_lapse: int | None = None
        #: whether processes may have gone whose plain messages are unsearched (at start,
        #: and after each reap or stop: :meth:`gone_found`)
        self._gone = not own_only

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until the earliest run lease the last check
        saw lapses, or None when it saw none. The runner loop sleeps no longer than this
        (:func:`leadgate.core.runners.run_loop`), so a run whose process stalled (alive,
        never finishing) or went away without a reap is recovered when its lease lapses,
        not up to a poll later. Read from the database (every replica's runs as of the
        check): a run finished since makes the loop wake early and look again."""
        # The next look for a lost run's token counts too, when sooner.
        return seconds_until(
            self.turns.clock.now_ms(),
            after_lapse(self._next_lapse),
            self.turns.lost.next_due(),
            self.turns.owed_lost.next_due(),
        )

    def _look_due(self) -> bool:
        """Whether a look for a lost run's token is due (the claim makes it): between
        looks a pass is the read above, not a claim (a write transaction)."""
        return _due(self.turns.lost.next_due(), self.turns.clock.now_ms())

    def gone_found(self) -> None:
        """Processes were reaped, or one stopped (``Wake.leases``): the next pass
        searches the plain REST/MCP/Studio messages they took in and nothing answered
        (:func:`leadgate.turns.runs.record_taken`)."""
        self._gone = not self.own_only

    async def run_once(self) -> bool:
        """Claim and carry out one session's runs; True when there were any."""
        if self._gone:
            # Before the claim: the runs it records are takeable at once (their holder
            # is gone). Searched again at the next pass when this fails.
            self._gone = False
            try:
                found = await runs.record_taken(
                    self.turns.db, self.turns.ids, self.turns.clock.now_ms()
                )
            except BaseException:
                self._gone = True
                raise
            if found:
                log.warning(
                    "%d plain turn(s) of gone processes left unanswered: recorded for recovery",
                    found,
                )
        if self.turns.owed or _due(self.turns.owed_lost.next_due(), self.turns.clock.now_ms()):
            # Plain turns stopped on a fault record their runs first (orphans then), and
            # intakes in doubt not found taken in are looked for again when due.
            await self.turns.record_owed()
        if not self.turns.orphans and not (self.turns.lost and self._look_due()):
            if self.own_only:
                return False
            # One read first: mostly nothing is takeable, and the claim is a write
            # transaction. It also says when the earliest lease lapses (due_in_s).
            takeable, self._next_lapse = await runs.lease_check(
                self.turns.db, self.turns.clock.now_ms()
            )
            if not takeable:
                return False
        claimed = await runs.claim(
            self.turns.db,
            self.turns.clock,
            self.turns.ids,
            owner=self.turns.owner(),
            orphans=self.turns.orphans,
            lost=self.turns.lost,
            surfaced=self.turns.store_surfaced,
            own_only=self.own_only,
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
        except DatabaseDamaged:
            # Not the run's failure: not claimed again at once (each claim counts an
            # attempt, and the third ends in a failure notice) and no traceback per
            # pass; the claim lapses and a later pass takes it again.
            raise
        except Exception as exc:
            # Claimed again on the next pass rather than when its lease lapses (minutes):
            # each claim counts an attempt, so a run that keeps failing gets its failure
            # notice after MAX_ATTEMPTS instead of being retried for ever.
            self.turns.orphans.add(claimed.token)
            log_failure(log, exc, "recovering session %s failed", claimed.session_id)
        return True


def _due(look: int | None, now: int) -> bool:
    """Whether a look due at ``look`` (None: none watched) has come at ``now``."""
    return look is not None and look <= now
