"""Authentication and organization confinement on every route and every MCP capability,
by enumeration (README, Security).

The served app's routes (``app.router.routes()``, with the Slack, Discord and Teams
webhooks mounted) and the hosted MCP server's tools and resource templates are listed,
not written down one by one: a route or capability this module does not know how to
fill fails the test, so whoever adds one adds it to :data:`FILLS` (or, if it is public
by design, to :data:`PUBLIC`) in :mod:`tests.integration.routes_kit`, which
``test_database_down`` shares. For each one:

- without credentials it is 401 in the error envelope (a channel webhook: its own
  signature refusal, naming its rule too), and the database is unchanged;
- with organization B's key, and with B's console session cookie (plus the header the
  console sends), on names and ids of organization A's real objects it answers exactly
  as on names and ids nobody has (404, not a 403 that confirms the object exists), no
  answer quotes any of A's names or ids, and no row but B's own changes.

Each fill is also called with A's own key on A's objects (after B's probes, since some
of them decide A's items): that answer must differ from the unknown-id one, so the
fill names a real object and the comparison above means something.

One served app per backend; every route and capability reuses it.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import sqlalchemy as sa
from nacl.signing import SigningKey

from leadgate.app import App
from leadgate.database import schema as t
from tests.helpers import LEGACY_SUBSCRIBE
from tests.integration.routes_kit import (
    FILLS,
    MCP_TEMPLATES,
    PUBLIC,
    WEBHOOKS,
    Answer,
    Call,
    Names,
    Prober,
    Scene,
    listing,
    mcp_answers,
    mcp_clients,
    routes,
    scene,
    web_app,
)
from tests.serving import served_app, webhook_channels

Rows = dict[str, set[str]]


async def dump(service: App) -> Rows:
    """Every row of every table, each as canonical JSON."""
    rows: Rows = {}
    async with service.db.read() as conn:
        for table in t.metadata.sorted_tables:
            result = await conn.execute(sa.select(table))
            rows[table.name] = {
                json.dumps(dict(r._mapping), sort_keys=True, default=str) for r in result
            }
    return rows


#: Tables without an ``org_id``: the column naming the row that has one.
OWNED_BY = {
    "session_events": ("session_id", "sessions"),
    "flow_run_events": ("run_id", "flow_runs"),
    "console_sessions": ("user_id", "users"),
}


def changed(before: Rows, after: Rows, *, allowed_org: str | None = None) -> list[str]:
    """The rows that appeared, went or changed between ``before`` and ``after``, but
    for rows of ``allowed_org`` (the caller's own organization)."""
    org_of = {
        row["id"]: row["org_id"]
        for table in {parent for _, parent in OWNED_BY.values()}
        for row in map(json.loads, after.get(table, set()))
    }

    def owner(table: str, row: dict[str, Any]) -> str | None:
        if table in OWNED_BY:
            return org_of.get(row[OWNED_BY[table][0]])
        return row.get("org_id")

    out = []
    for table, rows in after.items():
        for row in rows ^ before.get(table, set()):
            if allowed_org is not None and owner(table, json.loads(row)) == allowed_org:
                continue
            out.append(f"{table}: {row}")
    return out


async def probe_routes(s: Scene) -> list[tuple[str, str]]:
    """Every route, without credentials and as B on A's objects; the routes probed."""
    service, client, names, nobody = s.service, s.client, s.names, s.nobody
    served = routes(client)
    unfilled = sorted({key for key, _ in served if key not in FILLS and key not in WEBHOOKS})
    assert not unfilled, (
        f"routes this test does not know how to fill: {unfilled}; add each to FILLS "
        "(or, if it is public by design, to PUBLIC with the reason)"
    )
    every = {
        f"{r.method} {r.resource.canonical}" for r in web_app(client).router.routes() if r.resource
    }
    stale = sorted((set(FILLS) | set(PUBLIC) | set(WEBHOOKS)) - every)
    assert not stale, f"routes named here that are not served: {stale}"

    anonymous = Prober(client)
    callers = {"key": Prober(client, key=s.b.key), "cookie": Prober(client, cookie=s.b_cookie)}
    for route_key, path in served:
        method = route_key.split(" ", 1)[0]
        if route_key in WEBHOOKS:
            before = await dump(service)
            got = await anonymous(method, Call(path, {}))
            assert got.status == WEBHOOKS[route_key], (route_key, got)
            assert json.loads(got.body)["error"]["rule"], (route_key, got)
            assert not changed(before, await dump(service)), route_key
            continue
        for call in FILLS[route_key](nobody, path):
            before = await dump(service)
            got = await anonymous(method, call)
            assert got.status == 401, (route_key, call, got)
            assert json.loads(got.body)["error"]["rule"], (route_key, got)
            assert not changed(before, await dump(service)), (route_key, call)
        fill = FILLS[route_key]
        pairs = list(zip(fill(names, path), fill(nobody, path), strict=True))
        for (who, caller), (theirs, mine) in itertools.product(callers.items(), pairs):
            before = await dump(service)
            raw = await caller(method, theirs)
            writes = changed(before, await dump(service), allowed_org=s.b.id)
            assert not writes, (route_key, who, theirs, writes)
            assert not s.quoted(raw.body, sent=repr(theirs)), (route_key, who, raw)
            on_theirs = raw.named(names)
            if theirs == mine:
                continue  # nothing of A's in the request: only what it quotes counts
            on_nobodys = (await caller(method, mine)).named(nobody)
            if not theirs.exact:
                on_theirs, on_nobodys = on_theirs.outline(), on_nobodys.outline()
            assert on_theirs == on_nobodys, (route_key, who, theirs, on_theirs, on_nobodys)
    return served


async def owner_sees_routes(s: Scene, served: list[tuple[str, str]]) -> None:
    """The fills name A's real objects: A's own key is answered otherwise than on
    unknown ones (after B's probes: some of these decide A's items)."""
    owner = Prober(s.client, key=s.a.key)
    for route_key, path in served:
        fill = FILLS.get(route_key)
        if fill is None or fill is listing:
            continue
        method = route_key.split(" ", 1)[0]
        for theirs, mine in zip(fill(s.names, path), fill(s.nobody, path), strict=True):
            if theirs.on_b:
                continue
            on_real = (await owner(method, theirs)).named(s.names)
            on_fake = (await owner(method, mine)).named(s.nobody)
            assert on_real != on_fake, (route_key, theirs, on_real)


async def probe_mcp(s: Scene) -> None:
    """Every MCP tool and template as B on A's names: as on unknown names, quoting
    nothing of A's, writing nothing but B's rows."""
    async with mcp_clients(s, s.b.key) as clients:
        before = await dump(s.service)
        on_theirs = await mcp_answers(clients, s.names)
        writes = changed(before, await dump(s.service), allowed_org=s.b.id)
        assert not writes, writes
        on_nobodys = await mcp_answers(clients, s.nobody)
    assert not [(sent, got) for sent, got in on_theirs if s.quoted(got, sent)], on_theirs
    assert named(on_theirs, s.names) == named(on_nobodys, s.nobody)
    # Read, subscribe and listen refuse another organization's resource alike (listen
    # named "mcp.request" and no "uri").
    uris = {uri for fill in MCP_TEMPLATES.values() for uri in fill(s.names)}
    refusals = [(sent, json.loads(got)) for sent, got in on_theirs if sent in uris]
    assert len(refusals) == 3 * len(uris)
    assert all(got["data"] == {"rule": "agent.not_found", "uri": sent} for sent, got in refusals)
    async with mcp_clients(s, s.a.key) as clients:
        real = named(await mcp_answers(clients, s.names), s.names)
        fake = named(await mcp_answers(clients, s.nobody), s.nobody)
    assert all(r != f for r, f in zip(real, fake, strict=True)), list(zip(real, fake, strict=True))


def named(answers: list[tuple[str, str]], names: Names) -> list[str]:
    """The answers of :func:`mcp_answers`, ``names`` replaced by their fields' names."""
    return [Answer(0, "", got).named(names).body for _, got in answers]


@LEGACY_SUBSCRIBE
async def test_every_route_and_mcp_capability_is_confined(migrated_url: str) -> None:
    key = SigningKey.generate()
    async with served_app(
        migrated_url, config=webhook_channels(key), adapters=True, like_production=True
    ) as (service, client):
        s = await scene(service, client)
        served = await probe_routes(s)
        await probe_mcp(s)
        await owner_sees_routes(s, served)
