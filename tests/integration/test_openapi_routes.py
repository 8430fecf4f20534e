"""The published API document (``GET /openapi.json``) against the routes the service
serves: every documented path and method reaches a route (a client built from the
document met a bare 404 where the document named a path the service does not have)."""

from __future__ import annotations

import re

from tests.helpers import make_org
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
