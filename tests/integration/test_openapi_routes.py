"""The published API document (``GET /openapi.json``) against the routes the service
serves: every documented path and method reaches a route (a client built from the
document met a bare 404 where the document named a path the service does not have)."""

from __future__ import annotations

import re
from typing import Any

from tests.helpers import make_agent, make_org
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
