"""Operator JSON API (SPEC 5): the actionable queue, review detail, decisions, recovery.

Bearer key with ``agent:review`` or a console session. GETs never change state. A
decision answers the updated detail; a decision from the wrong status is 409.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.errors import ValidationError
from leadgate.web.common import PrincipalLookup, authenticate, json_body


class ReviewBackend(Protocol):
    """What the routes need (:class:`leadgate.operations.reviews.Reviews`)."""

    async def queue(
        self, principal: Principal, *, limit: int = 50, cursor: str | None = None
    ) -> dict[str, Any]: ...

    async def detail(self, principal: Principal, item_id: str) -> dict[str, Any]: ...

    async def activity(self, principal: Principal, *, limit: int = 50) -> dict[str, Any]: ...

    async def decide(
        self,
        principal: Principal,
        item_id: str,
        action: str,
        text: object = None,
        *,
        surface: str = "api",
        identity: str | None = None,
    ) -> dict[str, Any]: ...

    async def recover(
        self,
        principal: Principal,
        delivery_id: str,
        action: str,
        *,
        surface: str = "api",
        identity: str | None = None,
    ) -> dict[str, Any]: ...


#: Which body field carries a decision's text.
_TEXT_FIELD = {"reject": "reason", "return": "feedback"}


def setup(
    app: web.Application, *, authenticate_with: PrincipalLookup, reviews: ReviewBackend
) -> None:
    """Register the routes."""

    async def reviewer(request: web.Request) -> Principal:
        return await authenticate(request, authenticate_with, cookie=True)

    def surface_of(principal: Principal) -> str:
        # A console session is a user without a key; a bearer key is the API.
        return "console" if principal.key_id is None else "api"

    async def list_reviews(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            raise ValidationError("limit must be an integer", rule="queue.limit") from None
        page = await reviews.queue(principal, limit=limit, cursor=request.query.get("cursor"))
        return web.json_response(page)

    async def get_review(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        return web.json_response(await reviews.detail(principal, request.match_info["item_id"]))

    async def decide(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        action = request.match_info["action"]
        body: dict[str, Any] = {}
        if request.can_read_body:
            body = await json_body(request)
        field = _TEXT_FIELD.get(action)
        text = body.get(field) if field else None
        detail = await reviews.decide(
            principal,
            request.match_info["item_id"],
            action,
            text,
            surface=surface_of(principal),
        )
        return web.json_response(detail)

    async def recover_delivery(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        detail = await reviews.recover(
            principal,
            request.match_info["delivery_id"],
            request.match_info["action"],
            surface=surface_of(principal),
        )
        return web.json_response(detail)

    async def activity(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        return web.json_response(await reviews.activity(principal))

    app.router.add_get("/operator/reviews", list_reviews)
    app.router.add_get("/operator/reviews/{item_id}", get_review)
    app.router.add_post("/operator/reviews/{item_id}/{action:approve|reject|return|cancel}", decide)
    app.router.add_post(
        "/operator/deliveries/{delivery_id}/{action:confirm|retry}", recover_delivery
    )
    app.router.add_get("/operator/activity", activity)
