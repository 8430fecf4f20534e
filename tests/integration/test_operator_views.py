"""Operator views over real HTTP on 127.0.0.1 (issue 15): the triage queue (preview,
requester, channel, why, waiting since, counts, filters, order), the detail (destination,
actor names, verdict history), Agent Activity (filters, search, pages, never the text),
``/operator/insights`` and its SVG charts, the live ``/operator/events`` stream, and the
one error envelope with request ids and once-only logging of model errors."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from leadgate.app import App
from leadgate.core.auth import Scope
from leadgate.core.clock import MINUTE_MS, FakeClock
from leadgate.core.config import Settings
from leadgate.core.logs import setup_logging
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.domain import orgs
from leadgate.runners.revisions import RevisionRunner
from tests.helpers import make_agent, make_key, make_org
from tests.integration.test_operator_api import Env as OperatorEnv
from tests.integration.test_operator_api import TimeoutChannel

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
PASSWORD = "correct horse battery"
#: PASSWORD's argon2 hash, made once (users are created with a hash).
HASHED = orgs.hash_password(PASSWORD)
SLACK = {"team": "T1", "channel": "C9", "thread_ts": "9.9"}
ENVELOPE = {"message", "type", "param", "code", "rule"}


@dataclass
class Env(OperatorEnv):
    """The operator API's test environment, with a second worker agent."""

    other: dict[str, Any] = field(default_factory=dict)

    async def item(
        self, text: str, session: str, *, agent: dict[str, Any] | None = None, slack: bool = False
    ) -> str:
        binding = BindingSpec(BindingKind.slack, SLACK) if slack else BindingSpec(BindingKind.api)
        self.clock.advance(MINUTE_MS)
        out = await self.service.turns.run(
            Trigger(
                self.org.id, (agent or self.worker)["id"], session, f"{text} #complete", binding
            )
        )
        assert isinstance(out, Gated) and out.work_item_id
        await drain(self.service.lead_runner)
        return out.work_item_id

    async def get(self, path: str, headers: dict[str, str] | None = None) -> Any:
        resp = await self.client.get(path, headers=self.owner if headers is None else headers)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def user(self, email: str, role: str, name: str | None = None) -> dict[str, str]:
        async with self.service.db.tx() as conn:
            await orgs.create_user(
                conn, self.clock, self.service.ids, self.org.id, email, role, HASHED, name=name
            )
            token = await orgs.login(conn, self.clock, self.service.ids, email, PASSWORD, 3600_000)
        return {"Cookie": f"leadgate_session={token}", "X-Leadgate-Console": "1"}


@pytest.fixture
async def env(migrated_url: str) -> AsyncIterator[Env]:
    # Streams check their key or session again at each tick (1 s) instead of every 5 s.
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "api": {"events_reauth_s": 0.05}}
    )
    slack = TimeoutChannel()
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels={"slack": slack})
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "worker", lead="lead")
    other = await make_agent(service, org, "other", lead="lead")
    client = TestClient(TestServer(service.web_app(), host="127.0.0.1"))
    await client.start_server()
    try:
        yield Env(service, client, org, worker, slack, other)
    finally:
        await client.close()
        await service.stop()


async def assert_envelope(resp: ClientResponse, status: int, rule: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE, body
    assert body["error"]["rule"] == rule
    assert resp.headers["X-Request-Id"]
    return dict(body["error"])


async def test_a_query_parameter_given_twice_is_400_naming_it(env: Env) -> None:
    """Every operator route that reads a query parameter refuses it given twice (the first
    was taken, unseen), with the one rule of every surface, ``query.repeated``."""
    for target, name in (
        ("/operator/reviews?limit=1&limit=2", "limit"),
        ("/operator/reviews?order=oldest&order=newest", "order"),
        ("/operator/reviews?agent=a&agent=", "agent"),
        ("/operator/activity?q=a&q=b", "q"),
        ("/operator/activity?since=1&since=2", "since"),
        ("/operator/deliveries?cursor=&cursor=", "cursor"),
        ("/operator/insights?days=7&days=30", "days"),
        ("/operator/insights/charts/decisions.svg?days=7&days=7", "days"),
    ):
        resp = await env.client.get(target, headers=env.owner)
        error = await assert_envelope(resp, 400, "query.repeated")
        assert f"query parameter {name} was given 2 times" in error["message"], target
    resp = await env.client.get("/operator/reviews?limit=1&x=1&x=2", headers=env.owner)
    assert resp.status == 200


# ------------------------------------------------------------------------ the queue


async def test_the_queue_is_built_for_triage(env: Env) -> None:
    first = await env.item("draft the launch note #escalate", "a")
    slack = await env.item("translate the FAQ #escalate", "b", agent=env.other, slack=True)
    unknown = await env.item("post the update", "c", slack=True)
    await drain(env.service.relay)  # the send times out: deliveryUnknown

    page = await env.get("/operator/reviews")
    assert [i["id"] for i in page["items"]] == [first, slack, unknown]  # oldest first
    by_id = {i["id"]: i for i in page["items"]}
    item = by_id[first]
    assert item["preview"] == "Summary: draft the launch note #escalate"
    assert item["previewOf"] == "summary"
    assert (item["reason"], item["reasonText"]) == ("escalated", "Needs a human.")
    assert (item["roundsUsed"], item["roundsAllowed"]) == (0, 3)
    assert (item["channel"], item["requester"]) == ("api", "session a")
    assert by_id[slack]["requester"] == "Slack channel C9 (team T1)"
    assert by_id[unknown]["reason"] == "deliveryUnknown"
    assert "read timeout" in by_id[unknown]["reasonText"]
    assert item["waitingSince"] < by_id[slack]["waitingSince"] < by_id[unknown]["waitingSince"]
    assert page["total"] == 3
    assert page["counts"] == {
        "all": 3,
        "agents": [
            {"id": env.other["id"], "name": "other", "count": 1},
            {"id": env.worker["id"], "name": "worker", "count": 2},
        ],
        "channels": {"api": 1, "slack": 2},
        "reasons": {"escalated": 2, "deliveryUnknown": 1},
    }

    async def ids(query: str) -> list[str]:
        body = await env.get(f"/operator/reviews?{query}")
        assert body["total"] == len(body["items"])
        return [i["id"] for i in body["items"]]

    assert await ids("agent=worker") == [first, unknown]
    assert await ids(f"agent={env.other['id']}") == [slack]
    assert await ids("channel=slack") == [slack, unknown]
    assert await ids("reason=deliveryUnknown") == [unknown]
    assert await ids("agent=worker&channel=slack") == [unknown]
    # A filter naming no agent is an error, not an empty queue (a misspelt name looked
    # like "nothing waits").
    nobody = await env.client.get("/operator/reviews?agent=nobody", headers=env.owner)
    assert nobody.status == 404
    assert (await nobody.json())["error"]["rule"] == "agent.not_found"
    assert await ids("agent=WORKER") == [first, unknown]  # names in any case
    assert await ids("order=newest") == [unknown, slack, first]
    body = await env.get("/operator/reviews?order=newest&limit=2")
    rest = await env.get(f"/operator/reviews?order=newest&limit=2&cursor={body['next']}")
    assert [i["id"] for i in body["items"] + rest["items"]] == [unknown, slack, first]
    for bad, rule in (("reason=bored", "queue.reason"), ("channel=fax", "queue.channel")):
        resp = await env.client.get(f"/operator/reviews?{bad}", headers=env.owner)
        await assert_envelope(resp, 400, rule)


@SQLITE_ONLY
async def test_the_detail_names_actors_shows_the_destination_and_the_verdicts(env: Env) -> None:
    item = await env.item("post the weekly update #escalate", "d", slack=True)
    cookie = await env.user("mia@example.com", "member", name="Mia Jones")
    resp = await env.client.post(
        f"/operator/reviews/{item}/return", json={"feedback": "Add numbers."}, headers=cookie
    )
    assert resp.status == 200
    await drain(RevisionRunner(env.service.turns))
    await drain(env.service.lead_runner)
    detail = await env.get(f"/operator/reviews/{item}")
    assert detail["destination"] == {
        "channel": "slack",
        "action": "post",
        "silent": False,
        "conversation": "C9",
        "thread": "9.9",
        "description": "Posts the approved text to Slack C9, in thread 9.9.",
    }
    assert "the verdict does" in detail["completionPolicyNote"]
    assert [(r["revision"], r["by"], r["verdict"], r["feedback"]) for r in detail["reviews"]] == [
        (0, "lead", "escalated", "Needs a human."),
        (0, "human", "returned", "Add numbers."),
        (1, "lead", "escalated", "Needs a human."),
    ]
    assert detail["reviews"][1]["actorName"] == "Mia Jones"
    assert detail["reason"] == "escalated" and detail["requester"] == "Slack channel C9 (team T1)"
    returned = next(a for a in detail["audit"] if a["action"] == "return")
    assert (returned["actorKind"], returned["actorName"], returned["actorEmail"]) == (
        "user",
        "Mia Jones",
        "mia@example.com",
    )
    assert returned["surface"] == "console"
    lead = next(a for a in detail["audit"] if a["action"] == "escalate")
    assert (lead["actorKind"], lead["actorName"]) == ("lead", "lead agent lead")
    system = next(a for a in detail["audit"] if a["action"] == "create")
    assert system["actorName"] == "leadgate (intake)"
    # A key's decision names the key.
    resp = await env.client.post(f"/operator/reviews/{item}/approve", headers=env.owner)
    body = await resp.json()
    approve = [a for a in body["audit"] if a["action"] == "approve"][-1]
    assert approve["actorName"].startswith("API key owner (key_")
    assert body["destination"]["description"].startswith("Posts the approved text to Slack")


# ------------------------------------------------------------------ agent activity


@SQLITE_ONLY
async def test_activity_filters_searches_and_pages_without_the_text(env: Env) -> None:
    made = [await env.item(f"rename invoice {n} #escalate", f"s{n}") for n in range(3)]
    pct = await env.item("100% done #escalate", "pct", agent=env.other, slack=True)
    t_mid = env.clock.now_ms() - MINUTE_MS // 2  # between the last two items
    body = await env.get("/operator/activity")
    assert [i["id"] for i in body["items"]] == [pct, *reversed(made)]
    raw = json.dumps(body)
    assert "invoice" not in raw and "Echo:" not in raw and "Summary" not in raw
    assert {"summary", "snapshot"}.isdisjoint(body["items"][0])
    assert {a["name"] for a in body["agents"]} == {"lead", "worker", "other"}

    async def ids(query: str) -> list[str]:
        return [i["id"] for i in (await env.get(f"/operator/activity?{query}"))["items"]]

    assert await ids("q=INVOICE%201") == [made[1]]  # case-insensitive, in the summary
    assert await ids("q=100%25") == [pct]  # % is a character, not a wildcard
    assert await ids("q=%25") == [pct]
    assert await ids("q=_") == []
    assert await ids("agent=other") == [pct]
    assert await ids("channel=slack") == [pct]
    assert await ids("status=awaitingHuman&agent=worker") == list(reversed(made))
    assert await ids("status=completed") == []
    assert await ids(f"since={t_mid}") == [pct]
    assert await ids(f"until={t_mid}") == list(reversed(made))
    seen: list[str] = []
    path = "/operator/activity?limit=3"
    while path:
        page = await env.get(path)
        seen += [i["id"] for i in page["items"]]
        path = f"/operator/activity?limit=3&cursor={page['next']}" if page["next"] else ""
    assert seen == [pct, *reversed(made)]
    for bad, rule in (
        ("status=nope", "activity.status"),
        ("since=yesterday", "activity.since"),
        ("cursor=zzz", "activity.cursor"),
        # Free text is at most 200 characters, as the page's fields (maxlength) and any
        # agent name are: a longer agent filter was looked up (agent.not_found).
        ("q=" + "x" * 201, "activity.q"),
        ("agent=" + "x" * 201, "activity.agent"),
    ):
        resp = await env.client.get(f"/operator/activity?{bad}", headers=env.owner)
        await assert_envelope(resp, 400, rule)
    assert await ids("q=" + "x" * 200) == []  # the longest search is a search
    resp = await env.client.get("/operator/reviews?agent=" + "x" * 201, headers=env.owner)
    await assert_envelope(resp, 400, "queue.agent")


# ------------------------------------------------------------------------- insights


@SQLITE_ONLY
async def test_insights_count_decisions_agreement_times_rounds_and_deliveries(env: Env) -> None:
    cookie = await env.user("mia@example.com", "Member")
    approved = await env.item("a #escalate", "a")
    env.clock.advance(4 * MINUTE_MS)
    assert (
        await env.client.post(f"/operator/reviews/{approved}/approve", headers=cookie)
    ).status == 200
    rejected = await env.item("b #escalate", "b")
    env.clock.advance(2 * MINUTE_MS)
    resp = await env.client.post(
        f"/operator/reviews/{rejected}/reject", json={"reason": "no"}, headers=cookie
    )
    assert resp.status == 200
    await env.item("c", "c")  # the lead approves it itself
    await drain(env.service.relay)
    data = await env.get("/operator/insights?days=7")
    assert data["days"] == 7 and len(data["decisions"]["perDay"]) == 7
    assert data["decisions"]["byVerdict"] == {"escalated": 2, "approved": 2, "rejected": 1}
    assert data["decisions"]["byDecider"] == {"lead": 3, "human": 2}
    assert data["agreement"]["escalated"] == {"confirmed": 1, "overrode": 1}
    assert data["agreement"]["rate"] == 0.5
    human = data["timeToDecision"]["human"]
    assert (human["count"], human["medianMs"], human["p90Ms"]) == (2, 3 * MINUTE_MS, 4 * MINUTE_MS)
    assert data["timeToDecision"]["lead"]["count"] == 3
    assert data["roundsUsed"] == [{"rounds": 0, "items": 3}]
    assert data["deliveries"]["byOutcome"] == {"sent": 2}
    for name in ("decisions", "deciders", "time", "agreement", "rounds", "deliveries"):
        resp = await env.client.get(f"/operator/insights/charts/{name}.svg", headers=env.owner)
        assert resp.status == 200 and resp.content_type == "image/svg+xml"
        assert "script-src" not in resp.headers["Content-Security-Policy"]  # no script runs
        assert "<svg" in await resp.text()
    resp = await env.client.get("/operator/insights?days=0", headers=env.owner)
    await assert_envelope(resp, 400, "insights.days")
    viewer = await env.user("vic@example.com", "viewer")
    resp = await env.client.get("/operator/insights", headers=viewer)
    await assert_envelope(resp, 403, "scope.agent:review")


# --------------------------------------------------------------------- live events


async def read_event(resp: ClientResponse) -> tuple[str, dict[str, Any]]:
    """The next named event of an SSE stream (comments and retry lines skipped), within a
    generous bound (events are checked about once a second)."""
    name, data = "", ""
    async with asyncio.timeout(15):
        while True:
            line = (await resp.content.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and name:
                return name, json.loads(data)


async def test_events_follow_the_organization_only(env: Env) -> None:
    other_org = await make_org(env.service, "globex")
    await make_agent(env.service, other_org, "lead")
    other_worker = await make_agent(env.service, other_org, "worker", lead="lead")
    mine = await env.client.get("/operator/events", headers=env.owner)
    theirs = await env.client.get(
        "/operator/events", headers={"Authorization": f"Bearer {other_org.key}"}
    )
    assert mine.status == 200 and mine.headers["Content-Type"] == "text/event-stream"
    assert await read_event(mine) == ("hello", {"queue": 0})
    assert await read_event(theirs) == ("hello", {"queue": 0})

    item = await env.item("news #escalate", "e")
    name, data = await read_event(mine)
    assert name == "change" and item in data["items"]
    while data["queue"] != 1:  # a change may be seen half-way (the item, then the verdict)
        name, data = await read_event(mine)
    assert data["queue"] == 1

    # The other organization hears only its own change.
    out = await env.service.turns.run(
        Trigger(other_org.id, other_worker["id"], "x", "hi #complete", BindingSpec(BindingKind.api))
    )
    assert isinstance(out, Gated) and out.work_item_id
    name, data = await read_event(theirs)
    assert name == "change" and data["items"] == [out.work_item_id]
    mine.close()
    theirs.close()

    # Resuming from an old mark answers at once with a full refresh.
    resumed = await env.client.get(
        "/operator/events", headers={**env.owner, "Last-Event-ID": "0-0"}
    )
    assert (await read_event(resumed))[0] == "hello"
    assert await read_event(resumed) == ("change", {"items": None, "queue": 1})
    resumed.close()


@SQLITE_ONLY
async def test_events_end_once_the_key_is_revoked_or_the_session_logged_out(env: Env) -> None:
    key = await make_key(env.service, env.org, Scope.review)
    by_key = await env.client.get("/operator/events", headers={"Authorization": f"Bearer {key}"})
    member = await env.user("mia@example.com", "Member")
    by_cookie = await env.client.get("/operator/events", headers=member)
    for stream in (by_key, by_cookie):
        assert (await read_event(stream))[0] == "hello"
    async with env.service.db.tx() as conn:
        await orgs.revoke_key(conn, env.clock, env.org.id, key.split(".")[1])
    env.clock.advance(5_001)  # past the key cache's lifetime on the service's clock
    reason = {"reason": "the session or key is not valid"}
    assert await read_event(by_key) == ("end", reason)
    assert (await env.client.post("/console/logout", headers=member)).status == 200
    assert await read_event(by_cookie) == ("end", reason)
    for stream in (by_key, by_cookie):
        async with asyncio.timeout(5):
            assert await stream.content.read() == b""


@SQLITE_ONLY
async def test_events_end_once_the_user_is_demoted_to_viewer(env: Env) -> None:
    """A console user made a Viewer while following: the stream ends at its next check
    (it needs agent:review), saying why, as a new one is refused."""
    member = await env.user("max@example.com", "Member")
    stream = await env.client.get("/operator/events", headers=member)
    assert (await read_event(stream))[0] == "hello"
    async with env.service.db.tx() as conn:
        await orgs.update_user(conn, env.clock, env.org.id, "max@example.com", role="Viewer")
    env.clock.advance(5_001)  # past the principal cache's lifetime on the service's clock
    name, data = await read_event(stream)
    assert name == "end" and "agent:review" in data["reason"], data
    async with asyncio.timeout(5):
        assert await stream.content.read() == b""
    await assert_envelope(
        await env.client.get("/operator/events", headers=member), 403, "scope.agent:review"
    )


@SQLITE_ONLY
async def test_events_need_a_reviewer(env: Env) -> None:
    await assert_envelope(await env.client.get("/operator/events"), 401, "auth.key")
    viewer = await env.user("vic@example.com", "Viewer")
    await assert_envelope(
        await env.client.get("/operator/events", headers=viewer), 403, "scope.agent:review"
    )


# ------------------------------------------------------- error envelope and logging


@SQLITE_ONLY
async def test_one_error_envelope_on_every_surface_with_a_request_id(env: Env) -> None:
    resp = await env.client.get("/operator/reviews/wi_nope", headers=env.owner)
    operator = await assert_envelope(resp, 404, "workItem.not_found")
    assert operator["type"] == "not_found_error" and operator["code"] == "not_found"
    rest = await env.client.get("/v1/agents/nope", headers=env.owner)
    assert set(await assert_envelope(rest, 404, "agent.not_found")) == ENVELOPE
    login = await env.client.post(
        "/console/login", json={"email": "x@example.com", "password": "wrong password"}
    )
    await assert_envelope(login, 401, "console.login")
    mcp = await env.client.post("/mcp", json={})
    await assert_envelope(mcp, 401, "auth.key")
    echoed = await env.client.get(
        "/operator/reviews/wi_nope", headers={**env.owner, "X-Request-Id": "trace-42"}
    )
    assert echoed.headers["X-Request-Id"] == "trace-42"
    odd = await env.client.get(
        "/operator/reviews/wi_nope", headers={**env.owner, "X-Request-Id": "bad id;"}
    )
    assert odd.headers["X-Request-Id"] != "bad id;" and len(odd.headers["X-Request-Id"]) == 32
    ok = await env.client.get("/healthz")
    assert ok.headers["X-Request-Id"]
    # The product's name, not aiohttp's and Python's versions; on errors and on MCP too.
    assert {r.headers["Server"] for r in (ok, odd, mcp, login)} == {"leadgate"}
    # Every JSON answer is the caller's alone: kept by no cache, sniffed as nothing else.
    me = await env.client.get("/console/me")
    detail = await env.client.get("/operator/reviews", headers=env.owner)
    for resp in (ok, odd, login, me, detail, rest):
        assert resp.headers["Cache-Control"] == "no-store", resp.url
        assert resp.headers["X-Content-Type-Options"] == "nosniff", resp.url


@SQLITE_ONLY
async def test_a_model_error_is_logged_once_with_the_request_id_and_no_text(env: Env) -> None:
    plain = await make_agent(env.service, env.org, "plain")
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    setup_logging(Settings.model_validate({"log": {"format": "json"}}))
    buffer = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        body = {"model": plain["name"], "messages": [{"role": "user", "content": "sekrit #fail"}]}
        resp = await env.client.post(
            "/v1/chat/completions", json=body, headers={**env.owner, "X-Request-Id": "req-502"}
        )
        error = await assert_envelope(resp, 502, "model_error")
        assert error["code"] == "model_error"
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    errors = [line for line in lines if "model error" in line["event"]]
    assert len(errors) == 1, lines
    assert errors[0]["request_id"] == "req-502"
    assert "sekrit" not in buffer.getvalue()
    assert env.org.key.split(".")[2] not in buffer.getvalue()
