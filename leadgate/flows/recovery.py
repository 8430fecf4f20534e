"""Recovery of flow runs whose executor stopped while they were ``running``.

A ``running`` run is leased to the process executing it (see :mod:`leadgate.flows.runs`).
When that process dies (SIGKILL, power loss, a ``leadgate flow run`` killed mid-node),
or stalls past the lease, nothing renews the lease any more. :class:`FlowRecovery`
finds a run whose lease lapsed, or whose holder is known dead
(:func:`~leadgate.domain.processes.owner_gone`), claims it under a new token (a
conditional ``UPDATE`` fenced by status and the old token, after ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL: of several replicas exactly one wins) and executes it from the
first node whose output was not kept. The node that was running when the process died
is executed again without a second turn: its turn's external event id makes the intake
answer Duplicate when the turn was taken in (see :meth:`FlowService._agent_node`).
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.domain.processes import owner_gone
from leadgate.flows.runs import FlowService, RunLease, RunStatus, take_over

log = logging.getLogger("leadgate.flows")

RECOVERED_EVENT = "Flow run continued by recovery (its executor stopped)"
R = t.flow_runs.c

#: The oldest running run nobody holds: its lease lapsed, its holder is known dead, or it
#: has none (left ``running`` by a version before leases). Built once (polled).
_LAPSED = (
    sa.select(R.id, R.lease_token)
    .where(
        R.status == RunStatus.running.value,
        sa.or_(
            R.lease_expires_at.is_(None),
            R.lease_expires_at < sa.bindparam("p_now"),
            owner_gone(R.lease_owner),
        ),
    )
    .order_by(R.updated_at, R.id)
    .limit(1)
)


async def claim_lapsed(flows: FlowService) -> RunLease | None:
    """Claim one running run whose lease lapsed under a new lease token; None when there
    is none (or another process claimed it first)."""
    db, clock = flows.db, flows.clock
    now = clock.now_ms()
    # Read first: the runner polls, and nearly always finds nothing; a read takes no
    # write lock (the claim below is fenced).
    async with db.read() as conn:
        if (await conn.execute(_LAPSED, {"p_now": now})).first() is None:
            return None
    async with db.tx() as conn:
        row = (await conn.execute(db.skip_locked(_LAPSED), {"p_now": now})).first()
        if row is None:
            return None
        lease = await take_over(
            conn, flows.clock, flows.ids, row.id, row.lease_token, flows.owner()
        )
        if lease is not None:
            await flows._event(conn, row.id, RECOVERED_EVENT)
    return lease


class FlowRecovery:
    """Claims a running flow run whose executor stopped (its lease lapsed, or its process
    is known dead) and continues it."""

    name = "flow-recovery"

    def __init__(self, flows: FlowService) -> None:
        self.flows = flows

    async def run_once(self) -> bool:
        """Claim and continue one lapsed run; True when there was one."""
        lease = await claim_lapsed(self.flows)
        if lease is None:
            return False
        log.warning("continuing flow run %s: its executor stopped", lease.run_id)
        await self.flows.execute(lease)
        return True
