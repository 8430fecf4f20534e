"""The published API document (``GET /openapi.json``) against the routes the service
serves: every documented path and method reaches a route (a client built from the
document met a bare 404 where the document named a path the service does not have)."""

from __future__ import annotations

import re
from typing import Any

from leadgate.turns import runs
from tests.helpers import make_agent, make_org, session_item
from tests.serving import served_app


async def test_every_documented_operation_is_routed(migrated_url: str) -> None:
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        document = await (await client.get("/openapi.json")).json()
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                samples = {
                    param["name"]: str(param["schema"].get("enum", ["x"])[0])
                    for param in operation.get("parameters", [])
                    if param["in"] == "path"
                }
                assert set(samples) == set(re.findall(r"\{(\w+)\}", path)), path
                target = path
                for name, value in samples.items():
                    target = target.replace(f"{{{name}}}", value)
                resp = await client.request(
                    method,
                    target,
                    json={} if method in ("post", "patch") else None,
                    headers={"Authorization": f"Bearer {org.key}", "X-Leadgate-Console": "1"},
                )
                assert resp.status != 405, (method, path)
                if resp.status == 404:
                    error = (await resp.json())["error"]
                    assert error["rule"] != "http", (method, path, target)  # no such route


async def test_the_documented_bounds_are_the_routes(migrated_url: str) -> None:
    """The document said a transcript page takes ``limit`` up to 200 (the route refuses
    more than 100) and an Idempotency-Key up to 200 characters (the route takes 255)."""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        paths = (await (await client.get("/openapi.json")).json())["paths"]

        def schema_of(path: str, method: str, name: str) -> dict[str, Any]:
            params = paths[path][method]["parameters"]
            return next(p["schema"] for p in params if p["name"] == name)

        limit = schema_of("/v1/agents/{agent}/sessions/{session}/messages", "get", "limit")
        page = "/v1/agents/plain/sessions/s/messages?limit="
        assert (await client.get(f"{page}{limit['maximum']}", headers=auth)).status == 200
        assert (await client.get(f"{page}{limit['maximum'] + 1}", headers=auth)).status == 400
        key = schema_of("/v1/chat/completions", "post", "Idempotency-Key")
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        for length, status in ((key["maxLength"], 200), (key["maxLength"] + 1, 400)):
            resp = await client.post(
                "/v1/chat/completions", json=body, headers={**auth, "Idempotency-Key": "k" * length}
            )
            assert resp.status == status, length
        assert key["minLength"] == 1


#: Routes the document leaves out on purpose (see leadgate.web.openapi): pages and their
#: assets for browsers (the console and Studio), MCP's own protocol, Prometheus text.
UNDOCUMENTED = re.compile(r"^/(console/?$|console/static/|console/studio|mcp$|metrics$)")


def _pattern(path: str) -> re.Pattern[str]:
    """``path`` with each ``{name}`` segment matching any one segment (or the literal
    ``{name}`` of the other side)."""
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(path)) + "$")


async def test_every_route_is_documented(migrated_url: str) -> None:
    """The document left out routes a client may call: the session events stream and
    the operator feed (each test above only went from the document to the routes)."""
    async with served_app(migrated_url) as (_service, client):
        document = await (await client.get("/openapi.json")).json()
        documented = [(method, path) for path, ops in document["paths"].items() for method in ops]
        for route in client.app.router.routes():
            path = route.resource.canonical if route.resource is not None else ""
            if route.method == "HEAD" or UNDOCUMENTED.match(path):
                continue
            method = route.method.lower()
            assert any(m == method and _pattern(path).match(p) for m, p in documented), (
                f"{route.method} {path} is not in /openapi.json"
            )
        for path in ("/v1/agents/{agent}/sessions/{session}/events", "/operator/events"):
            assert (
                "text/event-stream" in document["paths"][path]["get"]["responses"]["200"]["content"]
            ), path


async def test_the_answers_the_routes_give_are_declared(migrated_url: str) -> None:
    """The document declared neither a chat completion's 409s (a turn held for its lead,
    an Idempotency-Key in progress or lost) nor its 502, nor the 409 of a decision or of
    a taken agent name; it described ``days`` as 7, 30 or 90 (the route takes 1..365)
    and ``since`` as an integer (it takes ISO 8601 too). Nor did it name the 502
    ``turn.gave_up`` an Idempotency-Key's retry gets for a turn turn recovery gave up,
    nor a chat completion's 503s that say not to send the message again
    (``turn.interrupted``, ``intake.in_doubt``, replayed under the key)."""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        paths = (await (await client.get("/openapi.json")).json())["paths"]

        async def declared(method: str, path: str, target: str, **kwargs: Any) -> int:
            """Call ``target`` (of the documented ``path``): its status is declared there
            (an error's with the error envelope), and the description of an operation's
            own 409 or 502 names the answer's rule or code."""
            headers = {**auth, **kwargs.pop("headers", {})}
            resp = await client.request(method, target, headers=headers, **kwargs)
            responses = paths[path][method.lower()]["responses"]
            assert str(resp.status) in responses, (method, target, resp.status)
            if resp.status >= 400:
                assert "application/json" in responses[str(resp.status)]["content"]
            if resp.status in (409, 502):
                error = (await resp.json())["error"]
                said = responses[str(resp.status)]["description"]
                names = [error.get("rule"), error.get("code")]
                assert any(name and name in said for name in names), (error, said)
            return resp.status

        chat = "/v1/chat/completions"

        def turn(model: str, text: str) -> dict[str, Any]:
            return {"json": {"model": model, "messages": [{"role": "user", "content": text}]}}

        assert (
            await declared("POST", chat, chat, **turn("worker", "held for the lead #complete"))
            == 409
        )
        assert await declared("POST", chat, chat, **turn("plain", "please #fail")) == 502
        # Every answer an Idempotency-Key's retry can get is declared with its rule: the
        # first request's replayed, or the end of its turn that turn recovery ran again
        # (its model's failure, or the give-up, stored over a 503 it was told).
        said = {
            "409": ("turn.gated", "turn.busy", "idempotency.in_progress", "idempotency.lost"),
            "502": ("model_error", "model.*", runs.GAVE_UP_RULE),
            "503": ("service.unavailable", "turn.interrupted", "intake.in_doubt"),
        }
        for status, rules in said.items():
            description = paths[chat]["post"]["responses"][status]["description"]
            assert [rule for rule in rules if rule not in description] == [], status
        item = await session_item(service, f"default:{org.principal.key_id}")
        approve = "/operator/reviews/{item_id}/approve"
        assert await declared("POST", approve, approve.replace("{item_id}", item), json={}) == 409
        assert await declared("POST", "/v1/agents", "/v1/agents", json={"name": "plain"}) == 409
        for days in (1, 365):
            insights = f"/operator/insights?days={days}"
            assert await declared("GET", "/operator/insights", insights) == 200
        days = next(p for p in paths["/operator/insights"]["get"]["parameters"])
        assert days["schema"] == {"type": "integer", "minimum": 1, "maximum": 365}
        activity = "/operator/activity"
        for since in ("1700000000000", "2026-01-01T00:00:00Z"):
            target = f"{activity}?since={since}&until={since}"
            assert await declared("GET", activity, target) == 200
        events = "/v1/agents/{agent}/sessions/{session}/events"
        target = events.replace("{agent}", "plain").replace("{session}", "s1")
        assert await declared("GET", events, target, headers={"Last-Event-ID": "x"}) == 400
        async with client.get(target, headers=auth) as stream:
            assert stream.status == 200 and stream.content_type == "text/event-stream"
