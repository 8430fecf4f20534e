"""The service's own OpenAPI 3.1 document, ``GET /openapi.json`` (no authentication).

It describes the REST, agents, operator and console APIs, and is what the fuzz suite
(``tests/fuzz``, schemathesis) generates requests from. It is built from **one
declarative list**, :data:`OPERATIONS`: a route added elsewhere is described by
appending an :class:`Operation` here (or calling :func:`describe` at import time of the
surface); nothing else needs changing. Channel endpoints (Slack, Discord, Teams) and
``/mcp`` speak their platform's protocol and are documented by those platforms; they
are listed without body schemas. Server-sent event streams (``.../events``) are
described (``stream``: a ``text/event-stream`` answer), though the fuzz suite calls none
of them, as they never end by themselves. The console's and studio's pages are for
browsers: they are not in the document.

Each operation lists the answers of its own that a client can meet (a 409 and the rules
behind it, a model's 502) on top of the common errors of :data:`_COMMON`;
``tests/integration/test_openapi_routes.py`` checks both against the routes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from leadgate.core.decoding import INT64_MAX
from leadgate.operations.idempotency import KEY_LIMIT
from leadgate.operations.transcripts import PAGE_MAX
from leadgate.review.insights import MAX_DAYS
from leadgate.review.queue import (
    ACTIVITY_STATUSES,
    CHANNELS,
    DETAIL_LIST_MAX,
    FILTER_TEXT_MAX,
    ORDERS,
    REASONS,
)
from leadgate.web import charts

BEARER: list[dict[str, list[str]]] = [{"bearer": []}]
NONE: list[dict[str, list[str]]] = []

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "code": {"type": ["string", "null"]},
                "rule": {"type": "string"},
            },
            "required": ["message"],
        }
    },
    "required": ["error"],
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
CHAT_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
                    "content": {
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]
                    },
                },
                "required": ["role", "content"],
            },
        },
        "stream": {"type": "boolean"},
        "user": {"type": "string"},
        # Checked, then the agent's model configuration decides them (README).
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stop": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            ]
        },
        "metadata": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "maxProperties": 16,
        },
    },
    "required": ["model", "messages"],
}
LEAD_REVIEW_CONFIG = {
    "type": "object",
    "properties": {
        "completionPolicy": {
            "type": "string",
            "enum": ["completeAutomatically", "requestHumanApproval"],
        },
        "maxRevisionRounds": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "additionalProperties": False,
}
AGENT_BODY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 200},
        "model": {"type": "string"},
        "instructions": {"type": "string"},
        "presetId": {"type": ["string", "null"]},
        "leadAgentId": {"type": ["string", "null"]},
        "leadReviewConfig": {"anyOf": [LEAD_REVIEW_CONFIG, {"type": "null"}]},
        "active": {"type": "boolean"},
    },
}


@dataclass(frozen=True)
class Operation:
    """One documented route."""

    method: str
    path: str
    summary: str
    #: ``BEARER`` (API key or, where allowed, the console cookie) or ``NONE``
    security: list[dict[str, list[str]]] = field(default_factory=lambda: BEARER)
    body: dict[str, Any] | None = None
    #: the body may be left out (a decision's, whose only field is optional)
    body_optional: bool = False
    #: extra parameters beyond the path's own ``{name}`` segments
    parameters: list[dict[str, Any]] = field(default_factory=list)
    #: status -> description; every operation may also answer the common errors
    responses: dict[str, str] = field(default_factory=lambda: {"200": "OK"})
    content_type: str = "application/json"
    #: a server-sent event stream (``text/event-stream``), which ends only when the
    #: client, the key's revocation or shutdown ends it
    stream: bool = False


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


#: The cursor pagination every operator list takes.
_PAGE = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 200}),
    _query("cursor", {"type": "string"}),
]
#: ``days`` of the insights and their charts: any whole number of days up to a year
#: (it was described as 7, 30 or 90, the console's choices).
_DAYS = _query("days", {"type": "integer", "minimum": 1, "maximum": MAX_DAYS})
#: ``since`` and ``until`` of Agent Activity (it was described as an integer only).
_TIME = {
    "anyOf": [
        {"type": "string", "pattern": "^[0-9]+$", "description": "epoch milliseconds"},
        {"type": "string", "description": "an ISO 8601 date or time (UTC unless it names a zone)"},
    ]
}
_LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
}
#: What a delivery's recovery answers.
_RECOVERED = (
    "The item's detail (a delivery of no item: its id and status), with delivery: what "
    "became of this one (id, kind, status, error)"
)
#: What a decision or a delivery's recovery from the wrong state answers.
_TRANSITION = {"409": "invalid_transition: the item or delivery is not in a state that allows it"}
#: A decision's: the same, or the item is at another revision than the one given.
_DECIDED = {
    "409": f"{_TRANSITION['409']}; conflict (rule decision.revision): the item was sent "
    "back for changes since the revision given"
}


#: A decision's optional fence: the revision its decider read (409 ``decision.revision``
#: when the item was sent back for changes since).
_REVISION = {"revision": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}
#: (No other field: 400 ``decision.unknown_field`` / ``delivery.unknown_field``.)
_DECISION_BODY: dict[str, Any] = {
    "type": "object",
    "properties": _REVISION,
    "additionalProperties": False,
}
#: A cancel's: the revision, and optionally why (kept in the cancel's audit entry; an
#: empty one is no reason).
_CANCEL_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {"reason": {"type": "string", "maxLength": 2000}, **_REVISION},
    "additionalProperties": False,
}
#: A recovery's: the send its operator checked (409 ``delivery.attempts`` when it was
#: sent again since).
_RECOVERY_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {"attempts": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}},
    "additionalProperties": False,
}
_RECOVERY_409 = {
    "409": f"{_TRANSITION['409']}; conflict (rule delivery.attempts): the delivery was "
    "sent again since the attempts given; conflict (rule delivery.in_flight, a Retry, "
    "with Retry-After): the send whose lease lapsed into deliveryUnknown may still be "
    "posting"
}


def _text_body(name: str, limit: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "minLength": 1, "maxLength": limit}, **_REVISION},
        "required": [name],
        "additionalProperties": False,
    }


OPERATIONS: list[Operation] = [
    Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI-compatible chat completion with a worker agent (model = agent id or slug)",
        body=CHAT_REQUEST,
        parameters=[
            {
                "name": "X-Session-Id",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "maxLength": 200},
            },
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "minLength": 1, "maxLength": KEY_LIMIT},
            },
        ],
        responses={
            "200": "A completion (or an SSE stream)",
            "409": "LEAD_REVIEW_PENDING, its rule turn.gated (the turn is held for its lead; "
            "workItemId and revision null) or turn.busy (the session's work already waits "
            "for review: the message was not taken in); idempotency.in_progress (the first "
            "request with this Idempotency-Key, or turn recovery's rerun of its turn, "
            "still runs; Retry-After); idempotency.lost "
            "(its answer was lost with its process, or to a database fault storing it: "
            "read the transcript). Never retried "
            "(x-should-retry: false)",
            "502": "model_error: the model provider failed after the message was taken in, "
            "its rule the provider's failure (model.*) "
            "(x-should-retry: false: sending it again would take it twice). An "
            "Idempotency-Key's retry whose turn turn recovery ran again (its first "
            "request's process died) gets the same when the model failed in that rerun, "
            "or turn.gave_up when recovery gave the turn up after 3 attempts that each "
            "killed their process (the failure notice is in the transcript)",
            "503": "Nothing was stored (a database fault, or overload; service.unavailable): "
            "retry after Retry-After. Or, never retried (x-should-retry: false): "
            "turn.interrupted (the message was taken in, its turn stopped on a database "
            "fault: do not send it again) or intake.in_doubt (it may have been taken in: "
            "a retry with the same Idempotency-Key is safe); under an Idempotency-Key "
            "the retry gets it again until turn recovery's rerun of the turn stores its "
            "answer (or its failure, the 502) over it",
        },
    ),
    Operation("get", "/v1/models", "The organization's worker agents as models"),
    Operation("get", "/v1/models/{model}", "One worker agent as a model"),
    Operation(
        "get",
        "/v1/agents/{agent}/sessions/{session}/messages",
        "A session's visible transcript (approved answers included once revealed)",
        parameters=[
            _query("after", {"type": "string"}),
            _query("limit", {"type": "integer", "minimum": 1, "maximum": PAGE_MAX}),
        ],
    ),
    Operation(
        "get",
        "/v1/agents/{agent}/sessions/{session}/events",
        "A session's public events (messages, review status) as server-sent events, "
        "from the start or after Last-Event-ID",
        parameters=[_LAST_EVENT_ID],
        responses={"200": "text/event-stream of the session's events"},
        stream=True,
    ),
    Operation("get", "/v1/agents", "List the organization's agents"),
    Operation(
        "post",
        "/v1/agents",
        "Create an agent",
        body=AGENT_BODY,
        responses={"201": "Created", "409": "agent.name_taken: another agent has the name"},
    ),
    Operation("get", "/v1/agents/{agent_id}", "Get an agent"),
    Operation(
        "patch",
        "/v1/agents/{agent_id}",
        "Update an agent",
        body=AGENT_BODY,
        responses={"200": "OK", "409": "agent.name_taken: another agent has the name"},
    ),
    Operation(
        "get",
        "/operator/reviews",
        "The actionable queue",
        parameters=[
            *_PAGE,
            _query("order", {"type": "string", "enum": list(ORDERS)}),
            _query("agent", {"type": "string", "maxLength": FILTER_TEXT_MAX}),
            _query("channel", {"type": "string", "enum": list(CHANNELS)}),
            _query("reason", {"type": "string", "enum": list(REASONS)}),
        ],
    ),
    Operation(
        "get",
        "/operator/reviews/{item_id}",
        "Review detail",
        responses={
            "200": "The item, its verdicts, audit and deliveries; each delivery: id, status "
            "(pending, sending, sent, deliveryUnknown, failed, cancelled, continuation), kind, "
            "channel, to (where it goes, in words), action, attempts, error (the last one), "
            "createdAt, updatedAt, nextAttemptAt (a pending one's next try). The audit, the "
            f"verdicts (reviews) and the deliveries are each the item's newest {DETAIL_LIST_MAX} "
            "(oldest first), the deliveries with every one still pending, sending or "
            f"deliveryUnknown whatever its age (the oldest {DETAIL_LIST_MAX} of those); "
            "auditTruncated, reviewsTruncated and deliveriesTruncated are true when older "
            "ones exist, unsettledDeliveriesTruncated when more are still pending, sending "
            "or deliveryUnknown than are listed; each verdict's revision counts every "
            "verdict"
        },
    ),
    Operation(
        "post",
        "/operator/reviews/{item_id}/approve",
        "Approve",
        body=_DECISION_BODY,
        body_optional=True,
        responses={"200": "OK", **_DECIDED},
    ),
    Operation(
        "post",
        "/operator/reviews/{item_id}/reject",
        "Reject",
        body=_text_body("reason", 2000),
        responses={"200": "OK", **_DECIDED},
    ),
    Operation(
        "post",
        "/operator/reviews/{item_id}/return",
        "Return to the worker",
        body=_text_body("feedback", 10_000),
        responses={"200": "OK", **_DECIDED},
    ),
    Operation(
        "post",
        "/operator/reviews/{item_id}/cancel",
        "Cancel (with an optional reason)",
        body=_CANCEL_BODY,
        body_optional=True,
        responses={"200": "OK", **_DECIDED},
    ),
    Operation(
        "get",
        "/operator/deliveries",
        "Every deliveryUnknown delivery (plain replies and notices included)",
        parameters=_PAGE,
    ),
    Operation(
        "post",
        "/operator/deliveries/{delivery_id}/confirm",
        "Confirm delivered",
        body=_RECOVERY_BODY,
        body_optional=True,
        responses={"200": _RECOVERED, **_RECOVERY_409},
    ),
    Operation(
        "post",
        "/operator/deliveries/{delivery_id}/retry",
        "Retry the delivery",
        body=_RECOVERY_BODY,
        body_optional=True,
        responses={
            "200": _RECOVERED + "; a review card whose item was decided ends cancelled, "
            "not pending: it is not posted after its decision (error says so)",
            **_RECOVERY_409,
        },
    ),
    Operation(
        "get",
        "/operator/activity",
        "Agent Activity",
        parameters=[
            _query("agent", {"type": "string", "maxLength": FILTER_TEXT_MAX}),
            _query("status", {"type": "string", "enum": list(ACTIVITY_STATUSES)}),
            _query("channel", {"type": "string", "enum": list(CHANNELS)}),
            _query("q", {"type": "string", "maxLength": FILTER_TEXT_MAX}),
            _query("since", _TIME),
            _query("until", _TIME),
            _query("limit", {"type": "integer", "minimum": 1, "maximum": 200}),
            _query("cursor", {"type": "string"}),
        ],
    ),
    Operation(
        "get",
        "/operator/events",
        "Live changes of the review queue as server-sent events (the console's feed)",
        parameters=[_LAST_EVENT_ID],
        responses={"200": "text/event-stream of change marks"},
        stream=True,
    ),
    Operation(
        "get",
        "/operator/insights",
        "Review insights over the last days",
        parameters=[_DAYS],
    ),
    Operation(
        "get",
        "/operator/insights/charts/{name}.svg",
        "One insights chart (SVG)",
        parameters=[
            {
                "name": "name",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "enum": list(charts.CHARTS)},
            },
            _DAYS,
        ],
        responses={"200": "An image/svg+xml chart"},
    ),
    Operation(
        "post",
        "/console/login",
        "Log in to the operator console (sets the session cookie)",
        security=NONE,
        body={
            "type": "object",
            "properties": {"email": {"type": "string"}, "password": {"type": "string"}},
            "required": ["email", "password"],
        },
        responses={"200": "Logged in", "401": "Wrong email or password", "429": "Too many"},
    ),
    Operation("post", "/console/logout", "Log out", security=NONE),
    Operation("get", "/console/me", "The console user", security=NONE),
    Operation("get", "/healthz", "Health", security=NONE),
    Operation(
        "get",
        "/favicon.ico",
        "No icon (what browsers ask for by themselves), cacheable for a day",
        security=NONE,
        responses={"204": "No content; Cache-Control: public, max-age=86400"},
    ),
    Operation("get", "/openapi.json", "This document", security=NONE),
]


def describe(operation: Operation) -> None:
    """Add an operation (for surfaces that register routes of their own)."""
    OPERATIONS.append(operation)


def document(public_url: str) -> dict[str, Any]:
    """The OpenAPI document of :data:`OPERATIONS`."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        # (A path parameter the operation describes itself is not described twice.)
        own = {param["name"] for param in op.parameters if param["in"] == "path"}
        params = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _path_names(op.path)
            if name not in own
        ] + op.parameters
        responses: dict[str, Any] = {
            status: {"description": text} for status, text in op.responses.items()
        }
        for status, response in responses.items():
            if int(status) >= 400:
                response["content"] = {"application/json": {"schema": _ERROR}}
        if op.stream:
            responses["200"]["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        for status, text in _COMMON.items():
            responses.setdefault(
                status,
                {"description": text, "content": {"application/json": {"schema": _ERROR}}},
            )
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{op.method}{op.path}".replace("/", "_")
            .replace("{", "")
            .replace("}", ""),
            "security": op.security,
            "responses": responses,
        }
        if params:
            entry["parameters"] = params
        if op.body is not None:
            entry["requestBody"] = {
                "required": not op.body_optional,
                "content": {op.content_type: {"schema": op.body}},
            }
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "leadgate", "version": "1"},
        "servers": [{"url": public_url}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": paths,
    }


_COMMON = {
    "400": "The request broke a rule (the error names it)",
    "401": "No or unknown credentials",
    "403": "Missing permission",
    "404": "Not found in this organization",
    "408": "The body did not arrive in time",
    "413": "The body is too large",
    "500": "The service's database file is damaged (database.file; x-should-retry: false): "
    "its operators must restore it. Also any failure of the service itself (internal)",
    "503": "The service cannot take the request now (a database fault, or overload); "
    "retry after Retry-After",
}


def _path_names(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def setup(app: web.Application, *, public_url: str) -> None:
    """Serve ``GET /openapi.json``."""

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(document(public_url))

    app.router.add_get("/openapi.json", openapi)
