"""Operator JSON API (SPEC 5): the actionable queue, review detail, decisions, recovery.

Bearer key with ``agent:review`` or a console session. GETs never change state. A
decision answers the updated detail; a decision from the wrong status is 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.decoding import INT64_MAX, decimal_int, query_value, refuse_unknown_fields
from leadgate.core.errors import ValidationError
from leadgate.web import charts

if TYPE_CHECKING:
    from leadgate.operations.reviews import RecoveredView
    from leadgate.review.insights import InsightsView
    from leadgate.review.queue import ActivityView, QueueView, ReviewDetailView, UncertainView
from leadgate.web.common import PrincipalLookup, authenticate, json_body


class ReviewBackend(Protocol):
    """What the routes need (:class:`leadgate.operations.reviews.Reviews`)."""

    async def queue(
        self, principal: Principal, *, limit: int = 50, cursor: str | None = None, **filters: Any
    ) -> QueueView: ...

    async def detail(self, principal: Principal, item_id: str) -> ReviewDetailView: ...

    async def activity(
        self, principal: Principal, *, limit: int = 50, **filters: Any
    ) -> ActivityView: ...

    async def uncertain(
        self, principal: Principal, *, limit: int = 50, cursor: str | None = None
    ) -> UncertainView: ...

    async def decide(
        self,
        principal: Principal,
        item_id: str,
        action: str,
        text: object = None,
        *,
        surface: str = "api",
        identity: str | None = None,
        revision: int | None = None,
    ) -> ReviewDetailView: ...

    async def recover(
        self,
        principal: Principal,
        delivery_id: str,
        action: str,
        *,
        surface: str = "api",
        identity: str | None = None,
        attempts: int | None = None,
    ) -> RecoveredView: ...


#: Which body field carries a decision's text.
_TEXT_FIELD = {"reject": "reason", "return": "feedback", "cancel": "reason"}
#: The fields a decision's body may have, by action; a recovery's.
_DECISION_FIELDS = {
    action: frozenset({"revision", *([_TEXT_FIELD[action]] if action in _TEXT_FIELD else [])})
    for action in ("approve", "reject", "return", "cancel")
}
_RECOVERY_FIELDS = frozenset({"attempts"})


class InsightsBackend(Protocol):
    """What the insights routes need (:class:`leadgate.operations.oversight.Oversight`)."""

    async def insights(self, principal: Principal, *, days: int = 30) -> InsightsView: ...


def _int(request: web.Request, name: str, default: int, rule: str) -> int:
    raw = query_value(request, name)
    if raw is None:
        return default
    value = decimal_int(raw)
    if value is None:
        raise ValidationError(f"{name} must be a non-negative integer", rule=rule)
    return value


def _read(body: dict[str, Any], name: str, rule: str) -> int | None:
    """An optional fence of a decision or recovery: what its operator read (a decision's
    ``revision``, a delivery's ``attempts``; the console sends the ones it shows), so
    that a page left open or a click sent again does not act on something newer."""
    value = body.get(name)
    if value is None:
        return None
    # At most INT64_MAX, as a count in a query string (decimal_int): a larger attempts
    # failed in the driver (a 500) where the fenced update compared it.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ValidationError(
            f"{name} must be a non-negative integer (at most {INT64_MAX})", rule=rule
        )
    return value


def _opts(request: web.Request, *names: str) -> dict[str, str | None]:
    """Optional query parameters (an empty value is no value)."""
    return {name: query_value(request, name) or None for name in names}


def setup(
    app: web.Application,
    *,
    authenticate_with: PrincipalLookup,
    reviews: ReviewBackend,
    insights: InsightsBackend | None = None,
) -> None:
    """Register the routes (``insights``: also ``/operator/insights`` and its charts)."""

    async def reviewer(request: web.Request) -> Principal:
        return await authenticate(request, authenticate_with, cookie=True)

    def surface_of(principal: Principal) -> str:
        # A console session is a user without a key; a bearer key is the API.
        return "console" if principal.key_id is None else "api"

    async def list_reviews(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        page = await reviews.queue(
            principal,
            limit=_int(request, "limit", 50, "queue.limit"),
            order=query_value(request, "order") or "oldest",
            **_opts(request, "cursor", "agent", "channel", "reason"),
        )
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
        refuse_unknown_fields(body, _DECISION_FIELDS[action], rule="decision.unknown_field")
        field = _TEXT_FIELD.get(action)
        text = body.get(field) if field else None
        detail = await reviews.decide(
            principal,
            request.match_info["item_id"],
            action,
            text,
            surface=surface_of(principal),
            revision=_read(body, "revision", "decision.revision"),
        )
        return web.json_response(detail)

    async def recover_delivery(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        body: dict[str, Any] = {}
        if request.can_read_body:
            body = await json_body(request)
        refuse_unknown_fields(body, _RECOVERY_FIELDS, rule="delivery.unknown_field")
        detail = await reviews.recover(
            principal,
            request.match_info["delivery_id"],
            request.match_info["action"],
            surface=surface_of(principal),
            attempts=_read(body, "attempts", "delivery.attempts"),
        )
        return web.json_response(detail)

    async def activity(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        page = await reviews.activity(
            principal,
            limit=_int(request, "limit", 50, "activity.limit"),
            **_opts(request, "cursor", "agent", "status", "channel", "since", "until", "q"),
        )
        return web.json_response(page)

    async def uncertain(request: web.Request) -> web.Response:
        principal = await reviewer(request)
        page = await reviews.uncertain(
            principal,
            limit=_int(request, "limit", 50, "deliveries.limit"),
            **_opts(request, "cursor"),
        )
        return web.json_response(page)

    async def get_insights(request: web.Request) -> web.Response:
        assert insights is not None
        principal = await reviewer(request)
        days = _int(request, "days", 30, "insights.days")
        return web.json_response(await insights.insights(principal, days=days))

    async def chart(request: web.Request) -> web.Response:
        assert insights is not None
        principal = await reviewer(request)
        days = _int(request, "days", 30, "insights.days")
        data = await insights.insights(principal, days=days)
        return web.Response(
            body=charts.render(request.match_info["name"], data),
            content_type="image/svg+xml",
            headers={
                "Content-Security-Policy": charts.SVG_CSP,
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-store",
            },
        )

    app.router.add_get("/operator/reviews", list_reviews)
    app.router.add_get("/operator/reviews/{item_id}", get_review)
    app.router.add_post("/operator/reviews/{item_id}/{action:approve|reject|return|cancel}", decide)
    app.router.add_post(
        "/operator/deliveries/{delivery_id}/{action:confirm|retry}", recover_delivery
    )
    app.router.add_get("/operator/activity", activity)
    app.router.add_get("/operator/deliveries", uncertain)
    if insights is not None:
        app.router.add_get("/operator/insights", get_insights)
        names = "|".join(charts.CHARTS)
        app.router.add_get(f"/operator/insights/charts/{{name:{names}}}.svg", chart)
