"""Operator JSON API (SPEC 5): the actionable queue, review detail, decisions, recovery.

Bearer key with ``agent:review`` or a console session. GETs never change state. A
decision answers the updated detail; a decision from the wrong status is 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine import workitems
from engine.auth import Principal, Scope
from engine.errors import ValidationError
from outbox.store import get_delivery, recover
from review import decisions, queue
from web.common import authenticate, json_body

if TYPE_CHECKING:
    from engine.service import Service


def setup(app: web.Application, service: Service) -> None:
    """Register the routes."""

    async def reviewer(request: web.Request) -> Principal:
        principal = await authenticate(request, service.lookup_principal, cookie=True)
        principal.require(Scope.review)
        return principal

    async def list_reviews(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            raise ValidationError("limit must be an integer", rule="queue.limit") from None
        async with service.db.read() as conn:
            page = await queue.actionable(
                conn, principal.org_id, limit=limit, cursor=request.query.get("cursor")
            )
        return web.json_response(page)

    async def get_review(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        async with service.db.read() as conn:
            body = await queue.detail(conn, principal.org_id, request.match_info["item_id"])
        return web.json_response(body)

    async def decide(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        action = request.match_info["action"]
        body: dict[str, Any] = {}
        if request.can_read_body:
            body = await json_body(request)
        item_id = request.match_info["item_id"]
        async with service.db.tx() as conn:
            item = await workitems.get(conn, item_id, principal.org_id)
            if action == "approve":
                await decisions.human_approve(
                    conn, service.clock, service.ids, item, principal.actor
                )
            elif action == "reject":
                await decisions.human_reject(
                    conn, service.clock, service.ids, item, principal.actor, body.get("reason")
                )
            elif action == "return":
                await decisions.human_return(
                    conn, service.clock, service.ids, item, principal.actor, body.get("feedback")
                )
            else:
                await decisions.cancel(conn, service.clock, service.ids, item, principal.actor)
            detail = await queue.detail(conn, principal.org_id, item_id)
        service.wake_all()
        return web.json_response(detail)

    async def recover_delivery(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        async with service.db.tx() as conn:
            delivery = await get_delivery(conn, request.match_info["delivery_id"], principal.org_id)
            row = await recover(
                conn,
                service.clock,
                service.ids,
                delivery,
                action=request.match_info["action"],
                actor=principal.actor,
            )
            detail = (
                await queue.detail(conn, principal.org_id, row["work_item_id"])
                if row["work_item_id"]
                else {"id": row["id"], "status": row["status"]}
            )
        service.wake_all()
        return web.json_response(detail)

    async def activity(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        async with service.db.read() as conn:
            body = await queue.activity(conn, principal.org_id)
        return web.json_response(body)

    app.router.add_get("/operator/reviews", list_reviews)
    app.router.add_get("/operator/reviews/{item_id}", get_review)
    app.router.add_post("/operator/reviews/{item_id}/{action:approve|reject|return|cancel}", decide)
    app.router.add_post(
        "/operator/deliveries/{delivery_id}/{action:confirm|retry}", recover_delivery
    )
    app.router.add_get("/operator/activity", activity)
