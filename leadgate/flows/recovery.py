"""Recovery of flow runs whose executor stopped while they were ``running``.

A ``running`` run is leased to the process executing it (see :mod:`leadgate.flows.runs`).
When that process dies (SIGKILL, power loss, a ``leadgate flow run`` killed mid-node),
or stalls past the lease, nothing renews the lease any more. :class:`FlowRecovery`
finds a run whose lease lapsed, or whose holder is known dead
(:func:`~leadgate.domain.processes.owner_gone`), claims it under a new token (a
conditional ``UPDATE`` fenced by status and the old token, after ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL: of several replicas exactly one wins) and executes it from the
first node whose output was not kept. The node that was running when the process died
is executed again without a second turn: the turn taken in, found by its external event
id, decides what the node does, whatever its worker's lead or activity is now (see
:meth:`FlowService._agent_node`).

Recovery is bounded. Every claim counts in ``flow_runs.recovery_attempts`` (in the
claim's ``UPDATE``, so a run that kills each process executing it is counted too); a run
that keeps a node's output starts again from zero. A run that cannot go on (its flow was
deleted, its stored outputs do not decode: :class:`~leadgate.flows.runs.RunUnreadable`,
or anything else its execution raises) fails on the :data:`MAX_RECOVERIES`-th attempt
without progress, and one claimed after that many attempts that stopped silently fails
at once, instead of being claimed again every lease for ever (an attempt a database fault
ended is not counted: an outage is not the run's fault): ``failed`` with the error
and event naming :data:`UNRECOVERABLE_RULE`, one log line and one count of
``leadgate_flow_runs_unrecoverable_total``.

Each pass's read also learns when the earliest running run's lease lapses, and the
runner loop sleeps no longer than that (:meth:`FlowRecovery.due_in_s`): a run whose
executor stalled is continued when its lease lapses, not up to a poll later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from leadgate.core.errors import LeadgateError, Unavailable
from leadgate.core.logs import error_text
from leadgate.core.metrics import METRICS
from leadgate.core.runners import LostClaims, after_lapse, seconds_until
from leadgate.database import schema as t
from leadgate.database.db import count_held
from leadgate.domain.processes import owner_gone
from leadgate.flows.runs import (
    RUN_LEASE_MS,
    FlowService,
    LostRun,
    RunLease,
    RunLeaseLost,
    RunStatus,
    move_run,
    take_over,
)

# The rule in the error and event of a run recovery gave up on; defined with the resumer,
# which gives an unreadable paused run up the same way.
from leadgate.flows.runs import UNRECOVERABLE_RULE as UNRECOVERABLE_RULE

log = logging.getLogger("leadgate.flows")

RECOVERED_EVENT = "Flow run continued by recovery (its executor stopped)"
#: Recovery attempts without progress after which a run is failed rather than claimed
#: again (each attempt waits for a lapsed lease: about 2 minutes apart).
MAX_RECOVERIES = 3
R = t.flow_runs.c

_RUNNING = R.status == RunStatus.running.value
#: Nobody holds the run: its lease lapsed, its holder is known dead, or it has none (left
#: ``running`` by a version before leases).
_UNHELD = sa.or_(
    R.lease_expires_at.is_(None),
    R.lease_expires_at < sa.bindparam("p_now"),
    owner_gone(R.lease_owner),
)
#: The oldest running run nobody holds. Built once (polled).
_LAPSED = (
    sa.select(R.id, R.lease_token).where(_RUNNING, _UNHELD).order_by(R.updated_at, R.id).limit(1)
)
#: The pass's read, one statement: whether any running run is unheld, and when the
#: earliest lease of a running run lapses (both off ``ix_flow_runs_status_lease``).
_CHECK = sa.select(
    sa.exists().where(_RUNNING, _UNHELD).label("lapsed"),
    sa.select(sa.func.min(R.lease_expires_at))
    .where(_RUNNING)
    .scalar_subquery()
    .label("next_lapse"),
)
#: A recovery claim's token looked for (:func:`claim_lapsed`): the run that holds it.
_HELD = sa.select(R.id, R.recovery_attempts).where(
    _RUNNING, R.lease_token == sa.bindparam("p_token")
)


@dataclass(frozen=True)
class Claim:
    """A lapsed run claimed under a new lease, and which recovery attempt (since the run
    last made progress) this claim is."""

    lease: RunLease
    attempt: int


async def claim_lapsed(
    flows: FlowService,
    seen: Callable[[int | None], None] = lambda next_lapse: None,
    lost: LostClaims[LostRun] | None = None,
) -> Claim | None:
    """Claim one running run whose lease lapsed under a new lease token (counting the
    attempt); None when there is none (or another process claimed it first). ``seen`` is
    told when the earliest lease of a running run lapses, as read first (None: no running
    run has one that has not lapsed yet).

    ``lost``: the tokens of this process's claims whose ``COMMIT`` was in doubt (and of
    the runs its resumer inserted so: :attr:`FlowService.lost
    <leadgate.flows.runs.FlowService.lost>`). Landed (or landing later), such a claim
    left its run under a token nobody held until its lease lapsed
    (:data:`~leadgate.flows.runs.RUN_LEASE_MS`), and its next claim counted a second
    attempt for an outage. So a claim in doubt adds its token, looked for first by the
    next pass and then 1 s on and at doubling gaps until that lease would have lapsed; a
    run found holding it is this process's to continue (the look is the claim)."""
    db, clock = flows.db, flows.clock
    now = clock.now_ms()
    if lost:  # (only after a claim in doubt)
        found = await _look_for_lost(flows, lost, now)
        if found is not None:
            return found
    # Read first: the runner polls, and nearly always finds nothing; a read takes no
    # write lock (the claim below is fenced).
    async with db.read() as conn:
        check = (await conn.execute(_CHECK, {"p_now": now})).one()
    # A lease that had lapsed already is this pass's to claim (True: the loop runs again
    # at once) or another process's that claimed it first: not a time to wake at again,
    # or a run nobody can claim would keep the loop from sleeping.
    lapse = check.next_lapse
    seen(lapse if lapse is None or lapse >= now else None)
    if not check.lapsed:
        return None
    token = flows.ids.new("lease")
    try:
        async with db.tx() as conn:
            row = (await conn.execute(db.skip_locked(_LAPSED), {"p_now": now})).first()
            if row is None:
                return None
            lease = await take_over(
                conn, flows.clock, flows.ids, row.id, row.lease_token, flows.owner(), token=token
            )
            if lease is None:
                return None
            attempt = int(
                await conn.scalar(sa.select(R.recovery_attempts).where(R.id == lease.run_id)) or 0
            )
            if attempt <= MAX_RECOVERIES:  # else it is given up, not continued
                await flows._event(conn, row.id, RECOVERED_EVENT)
    except Unavailable as fault:
        if fault.in_doubt and lost is not None:
            # Not woken: this is the recovery's own pass (its loop backs off, then looks).
            lost.watch(LostRun(token), due=now, lapses=now + RUN_LEASE_MS, wake=False)
        raise
    return Claim(lease, attempt)


async def _look_for_lost(flows: FlowService, lost: LostClaims[LostRun], now: int) -> Claim | None:
    """The claim of a watched token whose look is due, found landed (its run holds the
    token), else None (each token not found is looked for again later)."""
    due = lost.take_due(now)
    for n, look in enumerate(due):
        try:
            async with flows.db.read() as conn:
                row = (await conn.execute(_HELD, {"p_token": look.token.token})).first()
        except BaseException:  # (cancelled too: the tokens not looked for stay watched)
            lost.put_back(due[n:])
            raise
        if row is not None:
            lost.put_back(due[n + 1 :])
            # The write landed: what it counted is counted now (once: found, the token
            # is watched no more), as its commit would have.
            count_held(look.token.held)
            return Claim(RunLease(row.id, look.token.token), int(row.recovery_attempts))
        lost.not_found(look, now)
    return None


class FlowRecovery:
    """Claims a running flow run whose executor stopped (its lease lapsed, or its process
    is known dead) and continues it; gives it up after :data:`MAX_RECOVERIES` attempts
    without progress."""

    name = "flow-recovery"

    def __init__(self, flows: FlowService) -> None:
        self.flows = flows
        #: Attempts a database fault ended whose count is not taken back yet.
        self._faulted: list[RunLease] = []
        #: the earliest ``lease_expires_at`` of a running run at the last pass (any
        #: process's; None: none)
        self._next_lapse: int | None = None

    def due_in_s(self) -> float | None:
        """Seconds (by the clock) until the earliest lease of a running run the last pass
        saw lapses, or None when it saw none. The runner loop sleeps no longer than this
        (:func:`leadgate.core.runners.run_loop`). Read from the database, so it covers
        every process's runs: a lease renewed or ended since makes the loop wake early
        and look again (rarely: a lease is renewed long before it lapses, so the next
        lapse is usually further away than the poll); one taken since lapses after the
        earliest (every lease lasts :data:`~leadgate.flows.runs.RUN_LEASE_MS`)."""
        # The next look for a run whose write was in doubt counts too, when sooner.
        return seconds_until(
            self.flows.clock.now_ms(), after_lapse(self._next_lapse), self.flows.lost.next_due()
        )

    def _seen(self, next_lapse: int | None) -> None:
        self._next_lapse = next_lapse

    async def run_once(self) -> bool:
        """Claim and continue one lapsed run (or fail one recovery gave up on); True when
        there was one."""
        await self._uncount_faulted()
        claim = await claim_lapsed(self.flows, self._seen, self.flows.lost)
        if claim is None:
            return False
        lease, attempt = claim.lease, claim.attempt
        if attempt > MAX_RECOVERIES:
            # The earlier attempts stopped without a word (their process died; one a
            # database fault ended was taken back): no further attempt is made.
            await self.give_up(
                lease, attempt - 1, "each attempt stopped before the run could go on"
            )
            return True
        log.warning(
            "continuing flow run %s: its executor stopped (recovery attempt %d of %d)",
            lease.run_id,
            attempt,
            MAX_RECOVERIES,
        )
        try:
            await self.flows.execute(lease)
        except RunLeaseLost:
            raise  # another process holds it now
        except Unavailable:
            # Not the run's fault: the database is away. The attempt is taken back (now,
            # or before the next claim once the database answers), so that a database
            # outage spanning a few attempts does not fail a run that can go on.
            self._faulted.append(lease)
            await self._uncount_faulted()
            raise
        except Exception as exc:
            if attempt < MAX_RECOVERIES:
                raise  # logged by the runner loop; claimed again once the lease lapses
            why = exc.message if isinstance(exc, LeadgateError) else error_text(exc)
            await self.give_up(lease, attempt, why)
        return True

    async def _uncount_faulted(self) -> None:
        """Take back the count of each attempt a database fault ended, fenced by that
        attempt's lease token: once another claim took the run, the attempt stays
        counted (only that claim's process knows how it went). Kept for the next round
        while the database is still away."""
        while self._faulted:
            lease = self._faulted[0]
            try:
                async with self.flows.db.tx() as conn:
                    await conn.execute(
                        t.flow_runs.update()
                        .where(
                            R.id == lease.run_id,
                            R.status == RunStatus.running.value,
                            R.lease_token == lease.token,
                            R.recovery_attempts > 0,
                        )
                        .values(recovery_attempts=R.recovery_attempts - 1)
                    )
            except Unavailable:
                return
            self._faulted.pop(0)

    async def give_up(self, lease: RunLease, attempts: int, why: str) -> None:
        """Fail the run of ``lease`` (fenced by its token) with an error naming
        :data:`UNRECOVERABLE_RULE`, ``attempts`` and ``why``; logged and counted once
        (only the holder of the lease gets this far)."""
        flows = self.flows
        error = (
            f"{UNRECOVERABLE_RULE}: recovery gave up after {attempts} attempts to continue "
            f"the run: {why}"
        )
        async with flows.db.tx() as conn:
            await move_run(
                conn,
                flows.clock,
                flows.ids,
                lease.run_id,
                src=RunStatus.running,
                dst=RunStatus.failed,
                token=lease.token,
                values={"error": error},
                ended=flows.item_ended,
            )
            await flows._event(conn, lease.run_id, f"Flow run failed: {error}")
        METRICS.flow_runs_unrecoverable.inc()
        log.error("flow run %s failed: %s", lease.run_id, error)
