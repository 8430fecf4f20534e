"""Reviewers' operations: the actionable queue, the detail, decisions, delivery recovery.

Every decision goes through the one fenced commit path of :mod:`leadgate.review.decisions`
(two people deciding at once make one decision; the other gets a 409), and answers the
updated detail. Each wakes the runner it gave work to at its commit, on every replica:
a return the revision dispatcher and an approved flow continuation the flow resumer
(:mod:`leadgate.domain.wakes`), a delivery the relay (:mod:`outbox.store`). A cancel or
rejection of a flow node's item wakes the flow resumer (:attr:`Wake.flow
<leadgate.domain.wakes.Wake.flow>`): the run paused on that item ends then, not at the
resumer's poll. A delivery's recovery gives work to the relay alone (a retried row due
again, the card edits a confirm queues), which those rows wake.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypedDict

from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import Conflict, ValidationError
from leadgate.core.metrics import METRICS
from leadgate.core.types import BindingKind
from leadgate.database.db import Conn, Database
from leadgate.domain import wakes, workitems
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import Status
from leadgate.flows.runs import ENDED_WITHOUT_APPROVAL
from leadgate.review import decisions, queue
from leadgate.review.queue import ActivityView, QueueView, ReviewDetailView, UncertainView
from outbox.store import Outbox, get_delivery

#: Runs inside a decision's transaction, after the decision (what must commit with it,
#: or not at all: the answer to a reviewer's mail).
InDecision = Callable[[Conn], Awaitable[None]]

#: The human decisions (SPEC 5) and the delivery recovery actions.
DECISIONS = ("approve", "reject", "return", "cancel")
RECOVERIES = ("confirm", "retry")


class RecoveredDelivery(TypedDict):
    """What became of a recovered delivery."""

    id: str
    kind: str
    status: str
    error: str | None


class RecoveredDetailView(ReviewDetailView):
    """A recovery's answer when the delivery has an item: the item's detail."""

    delivery: RecoveredDelivery


class RecoveredDeliveryView(TypedDict):
    """A recovery's answer when the delivery has no item: its id and status."""

    id: str
    status: str
    delivery: RecoveredDelivery


RecoveredView = RecoveredDetailView | RecoveredDeliveryView


class Reviews:
    """What the operator API, the console and the CLI do for reviewers."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        outbox: Outbox,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.outbox = outbox

    async def queue(
        self,
        principal: Principal,
        *,
        limit: int = 50,
        cursor: str | None = None,
        **filters: Any,
    ) -> QueueView:
        """The actionable queue (awaitingHuman, or approved with deliveryUnknown);
        ``filters``: ``agent``, ``channel``, ``reason``, ``order`` (see
        :func:`leadgate.review.queue.actionable`)."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await queue.actionable(
                conn, principal.org_id, limit=limit, cursor=cursor, **filters
            )

    async def detail(self, principal: Principal, item_id: str) -> ReviewDetailView:
        """The review detail of one item of the caller's organization."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await queue.detail(conn, principal.org_id, item_id)

    async def activity(
        self, principal: Principal, *, limit: int = 50, **filters: Any
    ) -> ActivityView:
        """Agent Activity (never the approved text); ``filters``: ``cursor``, ``agent``,
        ``status``, ``channel``, ``since``, ``until``, ``q`` (see
        :func:`leadgate.review.queue.activity`)."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await queue.activity(conn, principal.org_id, limit=limit, **filters)

    async def uncertain(
        self, principal: Principal, *, limit: int = 50, cursor: str | None = None
    ) -> UncertainView:
        """Every ``deliveryUnknown`` delivery, gating or not (see
        :func:`leadgate.review.queue.uncertain_deliveries`)."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await queue.uncertain_deliveries(
                conn, principal.org_id, limit=limit, cursor=cursor
            )

    async def decide(
        self,
        principal: Principal,
        item_id: str,
        action: str,
        text: object = None,
        *,
        surface: str = "api",
        identity: str | None = None,
        then: InDecision | None = None,
        revision: int | None = None,
    ) -> ReviewDetailView:
        """Approve, reject (``text`` = reason), return (``text`` = feedback) or cancel
        (``text`` = an optional reason).

        ``surface`` (console, api, cli, slack, teams, discord, email) and ``identity``
        (the platform identity, e.g. ``slack:T1:U2``) are audited beside the actor;
        ``then`` runs in the decision's transaction, after it. ``revision``: the one the
        decider read; an item sent back for changes since (another revision, so another
        wait) is a 409 ``decision.revision`` and nothing changes.
        """
        principal.require(Scope.review)
        if action not in DECISIONS:
            raise ValidationError(
                f"the decision must be one of {', '.join(DECISIONS)}", rule="decision.action"
            )
        async with self.db.tx() as conn:
            # Held to the commit (PostgreSQL) when fenced on a revision: checked, then
            # decided, with no return in between.
            item = await workitems.get(conn, item_id, principal.org_id, lock=revision is not None)
            if revision is not None and item.revision != revision:
                raise Conflict(
                    f"work item {item_id} is at revision {item.revision} ({item.status}) now, "
                    f"not {revision}: it was sent back for changes since that revision was "
                    "read; nothing changed",
                    rule="decision.revision",
                )
            # Every open review card of the item is updated in this transaction.
            await decisions.decide(
                conn,
                self.outbox,
                item,
                action,
                principal.actor,
                text,
                surface=surface,
                identity=identity,
            )
            if then is not None:
                await then(conn)
            detail = await queue.detail(conn, principal.org_id, item_id)
            if (
                detail["channel"] == BindingKind.flow.value
                and detail["status"] in ENDED_WITHOUT_APPROVAL
            ):
                # A flow node's item cancelled or rejected: the run paused on it can
                # never resume, and the flow resumer ends it (here at commit, on every
                # replica by NOTIFY). The detail just read says so: no statement more.
                await wakes.after_commit(conn, Wake.flow)
        waited = "awaitingHuman" if item.status == Status.awaitingHuman.value else None
        self._count(surface, action, waited, item.updated_at)
        return detail

    def _count(self, surface: str, verdict: str, waited: str | None, since_ms: int) -> None:
        """Decision metrics: by surface and verdict; the time to decision of an item
        that was waiting for a human (``waited``: awaitingHuman | deliveryUnknown)."""
        METRICS.decisions.labels(surface, verdict).inc()
        if waited is not None:
            waited_s = max(0.0, (self.clock.now_ms() - since_ms) / 1000)
            METRICS.time_to_decision.labels(waited).observe(waited_s)

    async def recover(
        self,
        principal: Principal,
        delivery_id: str,
        action: str,
        *,
        surface: str = "api",
        identity: str | None = None,
        external_id: str | None = None,
        then: InDecision | None = None,
        attempts: int | None = None,
    ) -> RecoveredView:
        """Confirm delivered, or retry, a ``deliveryUnknown`` delivery (audited with the
        surface and identity as :meth:`decide`; ``external_id``: the message's id, when
        a click on the card itself confirms it; ``then``: as :meth:`decide`).

        Answers its item's detail (or, with no item, the delivery's id and status) with
        ``delivery``: what became of this one (``id``, ``kind``, ``status``, ``error``).
        A Retry of a review card whose item was decided ends it ``cancelled``, not
        ``pending`` (:func:`outbox.store.recover`): ``error`` says why. ``attempts``: the
        send the operator checked; one sent again since is a 409 ``delivery.attempts``."""
        principal.require(Scope.review)
        if action not in RECOVERIES:
            raise ValidationError("the recovery must be confirm or retry", rule="delivery.action")
        async with self.db.tx() as conn:
            delivery = await get_delivery(conn, delivery_id, principal.org_id)
            row = await decisions.recover_delivery(
                conn,
                self.outbox,
                delivery,
                action,
                principal.actor,
                surface=surface,
                identity=identity,
                external_id=external_id,
                attempts=attempts,
            )
            if then is not None:
                await then(conn)
            delivery_view: RecoveredDelivery = {
                "id": row.id,
                "kind": row.kind,
                "status": row.status,
                "error": row.error,
            }
            detail: RecoveredView
            if row.work_item_id:
                item_detail = await queue.detail(conn, principal.org_id, row.work_item_id)
                detail = {**item_detail, "delivery": delivery_view}
            else:
                detail = {"id": row.id, "status": row.status, "delivery": delivery_view}
        if delivery.kind == "gating":
            self._count(surface, action, "deliveryUnknown", delivery.updated_at)
        return detail
