"""The OpenAI-compatible route's additions (SPEC 7, issue 12) through a real aiohttp
server on 127.0.0.1, on SQLite and PostgreSQL: Idempotency-Key (one turn per key,
replays, mismatch, in progress, takeover after a crash), ``x-should-retry: false`` after
a message was taken in, ``/v1/models``, ``usage``, ``n`` and ``stream_options``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx2
import openai
import pytest
import sqlalchemy as sa
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent
from openai import AsyncOpenAI

from leadgate.app import App
from leadgate.core.auth import Scope
from leadgate.core.clock import FakeClock
from leadgate.core.errors import ModelError, TurnInterrupted, Unavailable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import DROPPED, drain
from leadgate.core.types import BUSY_RULE, GATED_RULE, BindingKind, BindingSpec, Busy, Trigger
from leadgate.database import schema as t
from leadgate.domain import agents as agents_mod
from leadgate.operations import idempotency as idempotency_mod
from leadgate.operations.idempotency import (
    LEASE_MS,
    RETRY_AFTER_MAX_S,
    SWEEP_EVERY_MS,
    TTL_MS,
    fingerprint,
)
from leadgate.operations.sessions import api_session_key
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns import runs
from leadgate.turns.intake import Accepted
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.script import ScriptProvider
from leadgate.web.common import INFLIGHT
from leadgate.web.openai_api import pending_body
from tests.fakes import CommitLandsLater, DownFor, FaultProvider, GateProvider, HeldCommits
from tests.helpers import (
    Org,
    blocked_on_a_lock,
    eventually,
    fake_clock,
    item_row,
    make_agent,
    make_key,
    make_org,
    ours,
    session_item,
)
from tests.serving import served_app
from tests.statement_faults import PgFaults, SqliteFaults, injector


@dataclass
class Env:
    service: App
    client: TestClient[web.Request, web.Application]
    org: Org
    other: Org
    gate: GateProvider

    @property
    def clock(self) -> FakeClock:
        return fake_clock(self.service)

    async def chat(
        self,
        model: str,
        text: str,
        *,
        key: str | None = None,
        idem: str | None = None,
        session: str | None = None,
        **extra: Any,
    ) -> ClientResponse:
        headers = {"Authorization": f"Bearer {key or self.org.key}"}
        if idem is not None:
            headers["Idempotency-Key"] = idem
        if session is not None:
            headers["X-Session-Id"] = session
        body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)

    async def user_messages(self, agent: str, session: str) -> list[str]:
        return [text for role, text in await self.transcript(agent, session) if role == "user"]

    async def transcript(self, agent: str, session: str) -> list[tuple[str, str]]:
        """The session's visible messages: (role, content) each."""
        resp = await self.client.get(
            f"/v1/agents/{agent}/sessions/{session}/messages",
            headers={"Authorization": f"Bearer {self.org.key}"},
        )
        return [(m["role"], m["content"]) for m in (await resp.json())["data"]]

    def official(self) -> AsyncOpenAI:
        """The official client of this server, retrying nothing by itself."""
        return AsyncOpenAI(
            base_url=str(self.client.make_url("/v1")), api_key=self.org.key, max_retries=0
        )

    async def task_context(self, session: str) -> str:
        async with self.service.db.read() as conn:
            row = (
                await conn.execute(
                    sa.select(t.work_items.c.task_context)
                    .select_from(
                        t.work_items.join(t.sessions, t.sessions.c.id == t.work_items.c.session_id)
                    )
                    .where(t.sessions.c.key == f"h:{session}")
                )
            ).one()
        return str(row.task_context)


@pytest.fixture
async def env(migrated_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    gate = GateProvider()
    providers: dict[str, Provider] = {
        "script": ScriptProvider(),
        "gate": gate,
        "fault": FaultProvider(),
    }
    like_production = request.node.get_closest_marker("like_production") is not None
    async with served_app(migrated_url, providers=providers, like_production=like_production) as (
        service,
        client,
    ):
        org = await make_org(service)
        other = await make_org(service, "other")
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        await make_agent(service, org, "slow", model="gate")
        await make_agent(service, org, "faulty", model="fault")
        await make_agent(service, other, "theirs")
        try:
            yield Env(service, client, org, other, gate)
        finally:
            gate.release.set()


# -------------------------------------------------------------------- Idempotency-Key


async def test_same_key_runs_one_turn_and_answers_the_same(env: Env) -> None:
    first = await env.chat("plain", "once please", idem="k-1", session="i1")
    again = await env.chat("plain", "once please", idem="k-1", session="i1")
    assert first.status == again.status == 200
    assert await first.json() == await again.json()  # the very same completion id
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert await env.user_messages("plain", "i1") == ["once please"]
    # Another key is another request; the same key in another organization too.
    await env.chat("plain", "once please", idem="k-2", session="i1")
    assert await env.user_messages("plain", "i1") == ["once please"] * 2
    theirs = await env.chat("theirs", "once please", key=env.other.key, idem="k-1", session="i1")
    assert theirs.status == 200 and "Idempotent-Replayed" not in theirs.headers


async def test_same_key_other_request_is_400_naming_the_rule(env: Env) -> None:
    assert (await env.chat("plain", "a", idem="k-m", session="m")).status == 200
    for changed in (
        env.chat("plain", "b", idem="k-m", session="m"),
        env.chat("plain", "a", idem="k-m", session="other-session"),
    ):
        resp = await changed
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["rule"] == "idempotency.mismatch" and error["param"] is None
    # No session named: each key's own default session, so another key's same body is
    # another request (it was given the first key's answer, and its session got nothing).
    assert (await env.chat("plain", "d", idem="k-d")).status == 200
    other_key = await make_key(env.service, env.org, Scope.trigger)
    resp = await env.chat("plain", "d", key=other_key, idem="k-d")
    assert resp.status == 400
    assert (await resp.json())["error"]["rule"] == "idempotency.mismatch"
    replayed = await env.chat("plain", "d", idem="k-d")  # the first key still gets its answer
    assert replayed.status == 200 and replayed.headers["Idempotent-Replayed"] == "true"
    bad = await env.chat("plain", "a", idem="\u00e9", session="m")
    assert bad.status == 400 and (await bad.json())["error"]["rule"] == "idempotency.key"
    assert await env.user_messages("plain", "m") == ["a"]


async def test_a_model_found_missing_is_refused_before_its_key_is_claimed(env: Env) -> None:
    """An unknown model answers 404 ``agent.not_found`` with or without a key. Once it
    was found missing, a keyed request for it claims no key (a claim and its release
    would be two writes for a 404; it reads whether the key was used, which a retry of
    a message taken in before its agent was deleted is), and once the agent exists the
    key runs its turn."""
    first = await env.chat("later", "hi", idem="k-u1", session="u")
    assert first.status == 404 and (await first.json())["error"]["rule"] == "agent.not_found"
    with env.service.db.record_statements() as statements:
        again = await env.chat("later", "hi", idem="k-u2", session="u")
    assert again.status == 404 and (await again.json())["error"]["rule"] == "agent.not_found"
    written = [sql for sql in statements if "idempotency_keys" in sql and "SELECT" not in sql]
    assert not written, statements
    # A key without the trigger scope is still told so, not the kept 404.
    reviewer = await make_key(env.service, env.org, Scope.review)
    denied = await env.chat("later", "hi", key=reviewer, idem="k-u3", session="u")
    assert denied.status == 403
    await make_agent(env.service, env.org, "later")
    # None of the refusals kept anything under its key (README, Idempotency-Key).
    for key in ("k-u1", "k-u2", "k-u3"):
        resp = await env.chat("later", "hi", idem=key, session="u")
        assert resp.status == 200 and "Idempotent-Replayed" not in resp.headers
    assert await env.user_messages("later", "u") == ["hi"] * 3


async def test_gated_and_failed_answers_are_replayed_not_rerun(env: Env) -> None:
    gated = await env.chat("worker", "ship #complete", idem="k-g", session="g")
    assert gated.status == 409
    again = await env.chat("worker", "ship #complete", idem="k-g", session="g")
    # The same 409 (gated, with the null ids), not "busy".
    assert await again.json() == await gated.json()
    assert "workItemId" in (await again.json())["error"]
    failed = await env.chat("worker", "break #fail", idem="k-f", session="f")
    assert failed.status == 502 and failed.headers["x-should-retry"] == "false"
    retried = await env.chat("worker", "break #fail", idem="k-f", session="f")
    assert retried.status == 502 and await retried.json() == await failed.json()
    assert await env.user_messages("worker", "f") == ["break #fail"]
    assert await env.task_context("f") == "break #fail"


async def test_a_second_request_while_the_first_runs_is_told_to_wait(env: Env) -> None:
    first = asyncio.create_task(env.chat("slow", "wait", idem="k-slow", session="w"))
    await eventually(lambda: env.gate.calls)
    assert env.gate.calls == 1
    second = await env.chat("slow", "wait", idem="k-slow", session="w")
    assert second.status == 409
    # Soon: the official clients retry twice after the wait named (it was up to 30 s).
    assert 1 <= int(second.headers["Retry-After"]) <= RETRY_AFTER_MAX_S
    assert (await second.json())["error"]["rule"] == "idempotency.in_progress"
    # Unlike every other 409 of the route, no ``x-should-retry: false``: the official
    # clients retry this one after the wait it names (README), and that header would
    # stop them.
    assert "x-should-retry" not in second.headers
    env.gate.release.set()
    done = await first
    assert done.status == 200
    third = await env.chat("slow", "wait", idem="k-slow", session="w")
    assert await third.json() == await done.json()
    assert env.gate.calls == 1


async def test_a_running_request_keeps_its_key_and_an_abandoned_claim_lapses_in_a_minute(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim nobody renews (its request died, or a database fault kept its release
    from being written) frees the key after LEASE_MS, a minute (it was 15); a request
    still running renews its own, however long its turn takes."""
    monkeypatch.setattr(idempotency_mod, "RENEW_EVERY_S", 0.02)
    idem, principal = env.service.idempotency, env.org.principal
    claim = await idem.begin(principal, "k-held", "print")
    assert claim.action == "run"

    async def renewed() -> bool:  # since the clock last moved
        async with env.service.db.read() as conn:
            lapses = await conn.scalar(
                sa.select(t.idempotency_keys.c.lease_expires_at).where(
                    t.idempotency_keys.c.owner == claim.owner
                )
            )
        return lapses is not None and lapses > env.clock.now_ms()

    async with idem.held(principal, claim):
        for _ in range(3):  # three lifetimes of a lease pass while the turn runs
            env.clock.advance(LEASE_MS + 1)
            # A renewal, waited for: 0.1 s of real time (five renewal periods) was not
            # always enough for one on a loaded machine.
            await eventually(renewed)
            assert (await idem.begin(principal, "k-held", "print")).action == "running"
    # The request is gone without finishing or releasing its claim.
    assert (await idem.begin(principal, "k-held", "print")).action == "running"
    env.clock.advance(LEASE_MS + 1)
    assert (await idem.begin(principal, "k-held", "print")).action == "run"
    assert LEASE_MS == 60_000


async def test_a_stalled_request_neither_releases_nor_renews_the_claim_that_took_it_over(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request stalls past its lease and a retry takes the key over. When the
    first one's intake then fails, its release must not free the key the retry holds
    (a third request ran the turn again beside the retry), and its renewals must not
    keep the retry's claim alive once the retry is gone."""
    monkeypatch.setattr(idempotency_mod, "RENEW_EVERY_S", 0.02)
    idem, principal = env.service.idempotency, env.org.principal
    stalled = await idem.begin(principal, "k-stall", "print")
    env.clock.advance(LEASE_MS + 1)
    retry = await idem.begin(principal, "k-stall", "print")
    assert retry.action == "run" and retry.owner != stalled.owner
    assert retry.external_event_id == stalled.external_event_id  # the intake de-duplicates
    await idem.release(principal, stalled)
    assert (await idem.begin(principal, "k-stall", "print")).action == "running"
    async with idem.held(principal, stalled):
        # The retry's process dies; only the stalled request is left, renewing.
        env.clock.advance(LEASE_MS + 1)
        await asyncio.sleep(0.1)  # several of its renewal rounds
        third = await idem.begin(principal, "k-stall", "print")
    assert third.action == "run" and third.owner not in (stalled.owner, retry.owner)
    await idem.release(principal, third)
    assert (await idem.begin(principal, "k-stall", "print")).action == "run"


@pytest.mark.parametrize("real_first", [True, False])
async def test_the_first_requests_real_answer_outlives_the_takeovers_lost_answer(
    env: Env, real_first: bool
) -> None:
    """The first request stalls past its lease, a retry takes the key over and finds the
    message taken in ("lost"), and then the first request finishes after all. Whichever
    stores its answer first, the real answer is what later requests get: a "lost" one
    stored last said "read the transcript" for an answer the key had."""
    idem, principal = env.service.idempotency, env.org.principal
    stalled = await idem.begin(principal, "k-order", "print")
    env.clock.advance(LEASE_MS + 1)
    takeover = await idem.begin(principal, "k-order", "print")
    assert takeover.action == "run"
    real = {"status": 200, "body": {"answer": "the real one"}}
    lost = {"status": 409, "body": {"error": {"rule": "idempotency.lost"}}}
    if real_first:
        await idem.finish(principal, stalled, real)
        await idem.finish(principal, takeover, lost, provisional=True)
    else:
        await idem.finish(principal, takeover, lost, provisional=True)
        await idem.finish(principal, stalled, real)
    replay = await idem.begin(principal, "k-order", "print")
    assert replay.action == "replay" and replay.response == real


async def claim_and_crash(
    env: Env,
    text: str,
    key: str,
    session: str,
    *,
    taken_in: bool,
    model: str = "plain",
    stream: bool = False,
) -> None:
    """What a process that took ``key`` and died leaves behind: the key's claim (and,
    when ``taken_in``, the message, taken in under the claim's event id). A worker with
    a lead (``model``) has its turn recorded: the process died before running it, and
    the run is left to a dead owner (:data:`DEAD`) for turn recovery."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    request_print = fingerprint(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), session.encode()
    )
    claim = await env.service.idempotency.begin(env.org.principal, key, request_print)
    assert claim.action == "run"
    if taken_in and model in RECORDED:
        turns = env.service.turns
        turns.intake.owner = lambda: DEAD
        try:
            taken = await turns.take(
                Trigger(
                    org_id=env.org.id,
                    agent_id=model,
                    session_key=api_session_key(env.org.principal, session=session),
                    text=text,
                    binding=BindingSpec(BindingKind.api),
                    external_event_id=claim.external_event_id,
                )
            )
        finally:
            turns.intake.owner = lambda: None
        # (Busy: the session's item waits for its lead; recorded, no run.)
        assert isinstance(taken, Busy) or (
            isinstance(taken, Accepted) and taken.ctx.run_token is not None
        ), taken
    elif taken_in:
        await env.service.messages.send(
            env.org.principal,
            model,
            text,
            session=session,
            external_event_id=claim.external_event_id,
        )


async def test_a_crashed_first_request_is_taken_over_without_a_second_message(env: Env) -> None:
    await claim_and_crash(env, "crash after intake", "k-c1", "c1", taken_in=True)
    running = await env.chat("plain", "crash after intake", idem="k-c1", session="c1")
    assert running.status == 409  # its lease has not lapsed yet
    env.clock.advance(LEASE_MS + 1)
    resp = await env.chat("plain", "crash after intake", idem="k-c1", session="c1")
    assert resp.status == 409 and resp.headers["x-should-retry"] == "false"
    assert (await resp.json())["error"]["rule"] == "idempotency.lost"
    assert await env.user_messages("plain", "c1") == ["crash after intake"]
    # A crash before the intake: the takeover runs the turn, once.
    await claim_and_crash(env, "crash before intake", "k-c2", "c2", taken_in=False)
    env.clock.advance(LEASE_MS + 1)
    resp = await env.chat("plain", "crash before intake", idem="k-c2", session="c2")
    assert resp.status == 200
    assert await env.user_messages("plain", "c2") == ["crash before intake"]


#: A process that is not registered: the runs it leaves are a dead process's.
DEAD = "prc_dead_process"
#: The agents whose api turns are recorded as runs (those with a lead), as the crash
#: tests below make them.
RECORDED = ("worker", "gated-slow", "faulty-worker")


async def runs_left(env: Env) -> list[tuple[str, str | None]]:
    """The recorded runs: (policy, lease owner) each."""
    async with env.service.db.read() as conn:
        rows = (await conn.execute(sa.select(t.turn_runs))).all()
    return [(r.policy, r.lease_owner) for r in rows]


@pytest.mark.parametrize("found", [True, False], ids=["in-the-wait", "before-recovery"])
async def test_a_keyed_retry_in_the_resend_wait_runs_the_cut_turn_once(
    env: Env, found: bool
) -> None:
    """A keyed request to a worker with a lead: its message was taken in, its process
    died before the turn ran. Turn recovery leaves the run to wait a minute for the
    client's resend (``await``). The official client's retry with the same key comes in
    that wait (or before recovery's pass found the run), once the key's claim lapsed:
    it takes the run (fenced by its lease, as recovery claims it) and
    runs the turn from the stored message, and gets the turn's answer. It was 409
    ``idempotency.lost`` ("read the transcript"), and recovery reran the turn a minute
    later for a transcript nobody was told to read. The request is worked once: one
    user message, one answer, nothing left for recovery, and the key replays it."""
    await claim_and_crash(env, "draft it", "k-w1", "w1", taken_in=True, model="worker")
    recovery = TurnRecovery(env.service.turns)
    env.clock.advance(30_000)  # the process is found dead (its heartbeat lapsed)
    if found:
        assert await drain(recovery) == 1
        assert await runs_left(env) == [(runs.AWAIT, None)]
    env.clock.advance(LEASE_MS - 30_000 + 1)  # the key's claim lapsed, the wait goes on
    async with env.official() as client:
        first = await answer_of(client, **keyed("k-w1", "w1", "worker", "draft it"))
        assert await runs_left(env) == []
        env.clock.advance(runs.RESEND_GRACE_MS)
        assert await drain(recovery) == 0  # nothing left to rerun
        again = await answer_of(client, **keyed("k-w1", "w1", "worker", "draft it"))
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == "Echo: draft it"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert await env.transcript("worker", "w1") == [
        ("user", "draft it"),
        ("assistant", "Echo: draft it"),
    ]


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
@pytest.mark.parametrize("model", ["worker", "plain"])
async def test_a_keyed_retry_after_its_agent_was_deactivated_gets_the_keys_answer(
    env: Env, model: str, since: str
) -> None:
    """A keyed request's message was taken in and its process died (``worker``: before
    its recorded turn ran; ``plain``: after its turn answered, before the answer was
    stored under the key); the agent is then deactivated or deleted. The client's retry
    with the key takes it over once its claim lapsed, and is answered as it would be
    were the agent active: the cut turn run here and its answer (``worker``), or 409
    ``idempotency.lost`` (``plain``: read the transcript); and every later retry gets
    that answer again. It was 400 ``agent.inactive`` / 404 ``agent.not_found``, the key
    given back, though the message was taken in (and, for a worker, recovery would
    answer it later)."""
    await claim_and_crash(env, "draft it", "k-d1", "d1", taken_in=True, model=model)
    change: dict[str, Any] = {"delete": True} if since == "deleted" else {"active": False}
    async with env.service.db.tx() as conn:
        await agents_mod.save_agent(
            conn, env.clock, env.service.ids, env.org.id, agent_ref=model, **change
        )
    env.clock.advance(LEASE_MS + 1)
    first = await env.chat(model, "draft it", idem="k-d1", session="d1")
    again = await env.chat(model, "draft it", idem="k-d1", session="d1")
    if model == "worker":
        assert first.status == 200, await first.text()
        body = await first.json()
        assert body["choices"][0]["message"]["content"] == "Echo: draft it"
        assert await runs_left(env) == []
    else:
        assert first.status == 409, await first.text()
        assert (await first.json())["error"]["rule"] == "idempotency.lost"
    assert (again.status, again.headers["Idempotent-Replayed"]) == (first.status, "true")
    assert await again.read() == await first.read()
    async with env.service.db.read() as conn:
        users = await conn.scalar(
            sa.select(sa.func.count()).where(
                t.messages.c.role == "user", t.messages.c.content == "draft it"
            )
        )
    assert users == 1  # taken in once


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_keyed_retry_after_the_rerun_gets_the_reruns_answer(env: Env, stream: bool) -> None:
    """A keyed request whose process died mid-turn, whose client retried with its key
    only after turn recovery's wait: recovery reran the turn from the stored message and
    stored its answer under the key, in the rerun's last transaction. The retry (through
    the official client) gets that answer, as the first request would have had it (a
    stream for a streamed request), and so does every later one, byte for byte. It was
    409 ``idempotency.lost``: "read the transcript"."""
    await claim_and_crash(
        env, "draft it", "k-w2", "w2", taken_in=True, model="worker", stream=stream
    )
    recovery = TurnRecovery(env.service.turns)
    assert await drain(recovery) == 1  # waits for a resend
    env.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1  # none came: rerun
    assert await runs_left(env) == []
    request = keyed("k-w2", "w2", "worker", "draft it")
    async with env.official() as client:
        if stream:
            chunks = await client.chat.completions.create(**request, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in chunks if c.choices]
            assert "".join(parts) == "Echo: draft it"
        else:
            reply = await client.chat.completions.create(**request)
            assert reply.choices[0].message.content == "Echo: draft it"
            assert reply.model == "worker"
    streamed: dict[str, Any] = {"stream": True} if stream else {}
    first = await env.chat("worker", "draft it", idem="k-w2", session="w2", **streamed)
    again = await env.chat("worker", "draft it", idem="k-w2", session="w2", **streamed)
    assert first.status == again.status == 200
    assert first.headers["Idempotent-Replayed"] == "true"
    assert await first.read() == await again.read()
    assert await env.transcript("worker", "w2") == [
        ("user", "draft it"),
        ("assistant", "Echo: draft it"),
    ]


async def test_a_keyed_retry_while_the_rerun_runs_waits_for_its_answer(env: Env) -> None:
    """The retry comes while turn recovery reruns the turn (after the wait): the run is
    a live process's, so the retry runs nothing and is told 409
    ``idempotency.in_progress`` (``Retry-After``), the key's claim given back at once;
    once the rerun committed, the retry gets its answer. It was 409
    ``idempotency.lost``, before and after the rerun."""
    await make_agent(env.service, env.org, "gated-slow", model="gate", lead="lead")
    await claim_and_crash(env, "slowly", "k-w3", "w3", taken_in=True, model="gated-slow")
    recovery = TurnRecovery(env.service.turns)
    assert await drain(recovery) == 1
    env.clock.advance(runs.RESEND_GRACE_MS + 1)
    rerun = asyncio.create_task(recovery.run_once())
    request = keyed("k-w3", "w3", "gated-slow", "slowly")
    try:
        await eventually(lambda: env.gate.calls == 1)
        async with env.official() as client:
            waiting = await answer_of(client, **request)
            assert waiting.status_code == 409, waiting.text
            assert waiting.json()["error"]["rule"] == "idempotency.in_progress"
            assert waiting.headers["Retry-After"] == str(RETRY_AFTER_MAX_S)
            assert "x-should-retry" not in waiting.headers  # (the client may retry it)
            env.gate.release.set()
            assert await rerun
            reply = await client.chat.completions.create(**request)
        assert reply.choices[0].message.content == "slow answer"
    finally:
        env.gate.release.set()
        await asyncio.gather(rerun, return_exceptions=True)
    assert env.gate.calls == 1  # one turn: the rerun's
    assert await env.transcript("gated-slow", "w3") == [
        ("user", "slowly"),
        ("assistant", "slow answer"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_keyed_turn_interrupted_and_rerun_replays_the_reruns_answer(
    env: Env, stream: bool
) -> None:
    """A keyed turn of a worker with a lead stops on a database fault: its client is
    told 503 ``turn.interrupted`` ("do not send it again"), stored under the key, and
    turn recovery reruns the turn (nobody sends it again). The rerun's answer is stored
    over that 503, in the rerun's last transaction: the client's retry with the key
    gets the answer. It was the 503 again, every time, the answer only in the
    transcript."""
    await make_agent(env.service, env.org, "faulty-worker", model="fault", lead="lead")
    streamed: dict[str, Any] = {"stream": True} if stream else {}
    told = await env.chat("faulty-worker", "once", idem="k-i1", session="i1", **streamed)
    assert "turn.interrupted" in (await told.read()).decode()
    assert await drain(TurnRecovery(env.service.turns)) == 1  # rerun in this process
    retry = await env.chat("faulty-worker", "once", idem="k-i1", session="i1", **streamed)
    assert retry.status == 200 and retry.headers["Idempotent-Replayed"] == "true"
    assert "answered once the database was back" in (await retry.read()).decode()
    assert await env.transcript("faulty-worker", "i1") == [
        ("user", "once"),
        ("assistant", "answered once the database was back"),
    ]


async def _crashed_past_the_resend_wait(
    env: Env, session: str
) -> tuple[TurnRecovery, dict[str, Any]]:
    """A keyed request for a reviewed worker whose process died with its message taken
    in, past turn recovery's wait for a resend (none came; the key's claim lapsed): the
    recovery that would rerun it now, and the request its client retries."""
    key = f"k-{session}"
    await claim_and_crash(env, "draft it", key, session, taken_in=True, model="worker")
    recovery = TurnRecovery(env.service.turns)
    assert await drain(recovery) == 1  # waits for a resend
    env.clock.advance(runs.RESEND_GRACE_MS + 1)
    return recovery, keyed(key, session, "worker", "draft it")


def _held_commits(env: Env, monkeypatch: pytest.MonkeyPatch, claim: str) -> HeldCommits:
    """``runs.<claim>`` runs on a database whose COMMIT (and row locks) it holds until
    released: the claim stands mid-way for the other side of the race."""
    held, real = HeldCommits(env.service.db), getattr(runs, claim)
    monkeypatch.setattr(runs, claim, lambda _db, *a, **kw: real(held.database, *a, **kw))
    return held


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_keyed_retry_meeting_recoverys_claim_mid_way_loses_to_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: turn recovery's claim of a keyed request's run for its rerun has
    written its lease and not committed yet when the client's retry (the official
    client, the key taken over) looks for that run. The retry waits for the claim's row
    lock, then finds the run a live process's: it runs nothing and is told 409
    ``idempotency.in_progress``, and the one turn, the rerun's, is what the next retry
    gets. One user message, one answer."""
    recovery, request = await _crashed_past_the_resend_wait(env, "r1")
    real = runs.claim
    held = _held_commits(env, monkeypatch, "claim")
    rerun = asyncio.create_task(recovery.run_once())
    try:
        await asyncio.wait_for(held.reached.wait(), 10)
        monkeypatch.setattr(runs, "claim", real)  # (the retry's own claim as usual)
        async with env.official() as client:
            retry = asyncio.create_task(answer_of(client, **request))
            await blocked_on_a_lock(env.service.db, retry)
            assert not retry.done()
            held.release.set()
            waiting = await retry
            assert await rerun
            answered = await answer_of(client, **request)
    finally:
        held.release.set()
        await asyncio.gather(rerun, return_exceptions=True)
    assert waiting.status_code == 409, waiting.text
    assert waiting.json()["error"]["rule"] == "idempotency.in_progress"
    assert answered.status_code == 200, answered.text
    assert answered.headers["Idempotent-Replayed"] == "true"
    assert answered.json()["choices"][0]["message"]["content"] == "Echo: draft it"
    assert await runs_left(env) == []
    assert await env.transcript("worker", "r1") == [
        ("user", "draft it"),
        ("assistant", "Echo: draft it"),
    ]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_recovery_meeting_a_keyed_retrys_claim_mid_way_leaves_the_run_to_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL, the reverse: the client's keyed retry has claimed its message's run
    (the resend wait is over: recovery would rerun it now) and not committed yet when
    turn recovery's pass comes. Recovery skips the run it holds (it neither waits for it
    nor takes it after), and the retry runs the turn and gets its answer, replayed
    after. One turn, one user message, one answer, nothing left to recover."""
    recovery, request = await _crashed_past_the_resend_wait(env, "r2")
    held = _held_commits(env, monkeypatch, "claim_for_retry")
    async with env.official() as client:
        retry = asyncio.create_task(answer_of(client, **request))
        try:
            await asyncio.wait_for(held.reached.wait(), 10)
            assert not await asyncio.wait_for(recovery.run_once(), 5)  # nothing claimed
            held.release.set()
            answered = await retry
        finally:
            held.release.set()
            await asyncio.gather(retry, return_exceptions=True)
        again = await answer_of(client, **request)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"] == "Echo: draft it"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == answered.content
    assert await runs_left(env) == []
    assert await drain(recovery) == 0
    assert await env.transcript("worker", "r2") == [
        ("user", "draft it"),
        ("assistant", "Echo: draft it"),
    ]


def error_frame(raw: bytes) -> dict[str, Any]:
    """The error envelope a stream's last frame carries (its one error frame)."""
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert frames[-1] != "data: [DONE]", frames
    envelope: dict[str, Any] = json.loads(frames[-1].removeprefix("data: "))
    return envelope


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_keyed_reruns_model_failure_is_its_retrys_answer(env: Env, stream: bool) -> None:
    """A keyed request whose process died mid-turn; no retry came in turn recovery's
    wait, so recovery reran the turn, and the model failed in the rerun: the failure
    notice went to the transcript and the item was abandoned, and in that transaction
    the key got the answer a live request gets when its model fails (the 502 naming the
    model's rule, or the stream's one error frame). The retry through the official
    client gets that, as a live request's failure, every time. It was 409
    ``idempotency.lost`` for good, the outcome known."""
    await make_agent(env.service, env.org, "faulty-worker", model="fault", lead="lead")
    await claim_and_crash(
        env, "model", "k-f1", "f1", taken_in=True, model="faulty-worker", stream=stream
    )
    recovery = TurnRecovery(env.service.turns)
    assert await drain(recovery) == 1  # waits for a resend
    env.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1  # none came: rerun, and its model fails
    assert await runs_left(env) == []
    request = keyed("k-f1", "f1", "faulty-worker", "model")
    streamed: dict[str, Any] = {"stream": True} if stream else {}
    # What a live request is answered for the same failure (another key and session).
    live = await env.chat("faulty-worker", "model", idem="k-f2", session="f2", **streamed)
    async with env.official() as client:
        if stream:
            chunks = await client.chat.completions.create(**request, stream=True)
            with pytest.raises(openai.APIError) as failed:
                async for _ in chunks:
                    pass
            assert "the provider failed" in str(failed.value)
        else:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(**request)
            assert refused.value.status_code == 502
            assert refused.value.response.headers["x-should-retry"] == "false"
    first = await env.chat("faulty-worker", "model", idem="k-f1", session="f1", **streamed)
    again = await env.chat("faulty-worker", "model", idem="k-f1", session="f1", **streamed)
    assert first.headers["Idempotent-Replayed"] == "true"
    assert first.status == again.status == live.status == (200 if stream else 502)
    body, live_body = await first.read(), await live.read()
    assert body == await again.read()
    envelope = error_frame(body) if stream else json.loads(body)
    assert envelope == (error_frame(live_body) if stream else json.loads(live_body))
    error = envelope["error"]
    assert (error["code"], error["rule"]) == ("model_error", "model.failed")
    assert await env.transcript("faulty-worker", "f1") == [
        ("user", "model"),
        ("assistant", runs.FAILURE_NOTICE),
    ]


async def test_a_gated_turn_whose_failed_run_cannot_be_closed_is_interrupted(env: Env) -> None:
    """A gated worker's REST turn fails (its model's error) and closing its run meets a
    database fault: the run is left to the recovery runner, which runs the turn again.
    The client is told 503 ``turn.interrupted`` ("do not send it again"), not the
    model's 502, which it might have answered by sending the message a second time."""
    await make_agent(env.service, env.org, "slow-worker", model="gate", lead="lead")
    asked = asyncio.ensure_future(env.chat("slow-worker", "draft it", session="cf"))
    await eventually(lambda: env.gate.calls == 1)
    env.gate.failure = ModelError("the provider failed", rule="model.failed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(env.service.db, "tx", DownFor(env.service.db.tx, 1, after_commit=False))
        env.gate.release.set()
        told = await asked
    assert told.status == 503, await told.text()
    assert (await told.json())["error"]["rule"] == "turn.interrupted"
    assert len(await runs_left(env)) == 1  # (the recovery runner's)


async def test_a_keyed_turn_recovery_gave_up_answers_its_retry_so(env: Env) -> None:
    """A keyed request whose message killed its process on every attempt: turn
    recovery gave its turn up (the failure notice in the transcript, the item
    abandoned) and, in that transaction, stored under the key the 502 a failed turn is
    answered, its rule ``turn.gave_up``: the retry is told its turn failed for good. It
    was 409 ``idempotency.lost`` ("read the transcript") for ever."""
    await claim_and_crash(env, "draft it", "k-g1", "g1", taken_in=True, model="worker")
    async with env.service.db.tx() as conn:
        await conn.execute(t.turn_runs.update().values(attempts=runs.MAX_ATTEMPTS))
    recovery = TurnRecovery(env.service.turns)
    assert await drain(recovery) == 1  # waits for a resend
    env.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1  # none came: given up
    assert await runs_left(env) == []
    async with env.official() as client:
        told = await answer_of(client, **keyed("k-g1", "g1", "worker", "draft it"))
        again = await answer_of(client, **keyed("k-g1", "g1", "worker", "draft it"))
    assert told.status_code == 502, told.text
    assert told.headers["Idempotent-Replayed"] == "true"
    assert told.headers["x-should-retry"] == "false"
    error = told.json()["error"]
    assert (error["code"], error["rule"]) == ("model_error", runs.GAVE_UP_RULE)
    assert error["message"] == runs.GAVE_UP_MESSAGE
    assert again.content == told.content
    assert await env.transcript("worker", "g1") == [
        ("user", "draft it"),
        ("assistant", runs.FAILURE_NOTICE),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_keyed_turn_whose_handoff_recovery_surfaced_answers_its_retry_gated(
    env: Env, stream: bool
) -> None:
    """A keyed request to a worker with a lead whose turn had committed its
    ``complete_task`` signal when its process died: turn recovery submits that handoff
    to a person (``awaitingHuman``) instead of running the turn again, and, in that
    claim's transaction, stores under the key what a live request whose turn ended gated
    gets (the gated 409, or a stream with no text). The retry through the official
    client gets it, as the live request does, every time. It was 409
    ``idempotency.lost`` ("read the transcript") for ever."""
    streamed: dict[str, Any] = {"stream": True} if stream else {}
    await claim_and_crash(
        env, "draft it", "k-s1", "s1", taken_in=True, model="worker", stream=stream
    )
    # The dead turn got as far as its complete_task signal, then the process died.
    async with env.service.db.tx() as conn:
        run = (await conn.execute(sa.select(t.turn_runs))).one()
        await conn.execute(
            t.work_items.update()
            .where(t.work_items.c.id == run.work_item_id)
            .values(signal_summary="Summary: draft it", signal_turn_id=run.turn_id)
        )
    assert await drain(TurnRecovery(env.service.turns)) == 1  # surfaced
    assert await runs_left(env) == []
    env.clock.advance(LEASE_MS + 1)  # the dead request's claim of the key lapsed
    # What a live request whose turn ended gated is answered (another key and session).
    live = await env.chat("worker", "draft #complete", idem="k-s2", session="s2", **streamed)
    request = keyed("k-s1", "s1", "worker", "draft it")
    async with env.official() as client:
        if stream:
            chunks = await client.chat.completions.create(**request, stream=True)
            got = [c.choices[0] async for c in chunks if c.choices]
            assert "".join(c.delta.content or "" for c in got) == ""
            assert got[-1].finish_reason == "stop"
        else:
            with pytest.raises(openai.ConflictError) as gated:
                await client.chat.completions.create(**request)
            assert gated.value.response.headers["Idempotent-Replayed"] == "true"
            assert gated.value.response.headers["x-should-retry"] == "false"
    first = await env.chat("worker", "draft it", idem="k-s1", session="s1", **streamed)
    again = await env.chat("worker", "draft it", idem="k-s1", session="s1", **streamed)
    assert first.headers["Idempotent-Replayed"] == "true"
    assert first.status == again.status == live.status == (200 if stream else 409)
    body = await first.read()
    assert body == await again.read()
    if stream:
        # The live stream's frames, the completion's id and created aside.
        def shape(raw: bytes) -> list[Any]:
            frames = [f.removeprefix("data: ") for f in raw.decode().split("\n\n") if f]
            return [
                {k: v for k, v in json.loads(f).items() if k not in ("id", "created")}
                if f != "[DONE]"
                else f
                for f in frames
            ]

        assert shape(body) == shape(await live.read())
    else:
        assert json.loads(body) == await live.json() == pending_body(gated=True)
        assert first.headers["x-should-retry"] == live.headers["x-should-retry"] == "false"
    async with env.service.db.read() as conn:
        status = await conn.scalar(
            sa.select(t.work_items.c.status).where(t.work_items.c.id == run.work_item_id)
        )
    assert status == "awaitingHuman"
    assert await env.transcript("worker", "s1") == [("user", "draft it")]


async def test_a_keyed_turn_closed_for_a_later_message_tells_its_retry_to_read_on(
    env: Env,
) -> None:
    """A keyed request whose process died mid-turn, after which its client sent the
    session another message (a new request, not the retry): turn recovery closes the
    first run without running it again, the later message's turn having answered the
    session with the first message in its history. No answer of the first request's
    own exists to store, so its key's retry is told 409 ``idempotency.lost`` (read the
    transcript): there the first message is followed by the later one and its answer.
    The gated or busy 409 would say the message waits for review or was not taken in,
    and the later turn's answer is another request's (and may not be known yet when
    the run is closed)."""
    await claim_and_crash(env, "draft it", "k-n1", "n1", taken_in=True, model="worker")
    later = await env.chat("worker", "and the summary", session="n1")
    assert later.status == 200, await later.text()
    assert await drain(TurnRecovery(env.service.turns)) == 1  # closed: a message came after
    assert await runs_left(env) == []
    env.clock.advance(LEASE_MS + 1)  # the dead request's claim of the key lapsed
    async with env.official() as client:
        told = await answer_of(client, **keyed("k-n1", "n1", "worker", "draft it"))
    assert told.status_code == 409, told.text
    assert told.headers["x-should-retry"] == "false"
    assert told.json()["error"]["rule"] == "idempotency.lost"
    assert await env.transcript("worker", "n1") == [
        ("user", "draft it"),
        ("user", "and the summary"),
        ("assistant", "Echo: and the summary"),
    ]


async def test_a_takeover_that_fails_before_its_intake_keeps_the_first_event_id(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request took its message in and died; the retry takes the key over and
    meets a database fault before its intake (503, "nothing was stored, please retry").
    Its claim is handed back with the key kept (its lease ended), not deleted: the key
    holds the first request's event id. Deleted, the next retry claimed the key afresh
    under a new event id, and the intake took the message in a second time (a second
    turn for one request)."""
    await claim_and_crash(env, "taken once", "k-r1", "r1", taken_in=True)
    env.clock.advance(LEASE_MS + 1)
    send = env.service.messages.send

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise Unavailable("database is locked", rule="service.unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(env.service.messages, "send", down)
        failed = await env.chat("plain", "taken once", idem="k-r1", session="r1")
        assert failed.status == 503
    assert env.service.messages.send == send
    retry = await env.chat("plain", "taken once", idem="k-r1", session="r1")
    assert retry.status == 409, await retry.text()
    assert (await retry.json())["error"]["rule"] == "idempotency.lost"
    assert await env.user_messages("plain", "r1") == ["taken once"]


async def test_a_busy_message_taken_over_after_a_crash_is_answered_busy_again(env: Env) -> None:
    """A keyed message to a worker whose item waits for its lead is recorded busy (not
    taken into the transcript), and its process dies before the busy 409 is stored under
    the key. The takeover's intake finds the event recorded busy and answers the busy
    409 again, the first request's answer. It was 409 ``idempotency.lost``, "read the
    session transcript", where the message is not."""
    held = await env.chat("worker", "ship #complete", session="b1")
    assert held.status == 409 and (await held.json())["error"]["rule"] == GATED_RULE
    await claim_and_crash(env, "more", "k-b1", "b1", taken_in=True, model="worker")
    env.clock.advance(LEASE_MS + 1)
    resp = await env.chat("worker", "more", idem="k-b1", session="b1")
    assert resp.status == 409 and resp.headers["x-should-retry"] == "false", await resp.text()
    assert await resp.json() == pending_body(gated=False)
    again = await env.chat("worker", "more", idem="k-b1", session="b1")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.json() == pending_body(gated=False)
    assert await env.user_messages("worker", "b1") == ["ship #complete"]


@pytest.mark.like_production
async def test_a_client_gone_mid_stream_leaves_a_whole_answer_to_replay(env: Env) -> None:
    """The client hangs up after the role chunk: the turn goes on to its end, its answer
    is stored, and the same key's retry gets the whole stream (the turn ended as a
    "model failure", the answer was lost and the key answered "still running" for 15
    minutes, then "lost")."""
    first = await env.chat("slow", "stream then hang up", idem="k-h", session="h", stream=True)
    assert first.status == 200
    assert (await first.content.readline()).startswith(b"data: ")  # the role chunk
    first.close()  # the client goes away
    await asyncio.sleep(0.2)  # let the server see the connection closed
    env.gate.release.set()

    async def answered() -> bool:
        reply = await env.client.get(
            "/v1/agents/slow/sessions/h/messages",
            headers={"Authorization": f"Bearer {env.org.key}"},
        )
        return "slow answer" in [m["content"] for m in (await reply.json())["data"]]

    await eventually(answered, 5.0)
    again = await env.chat("slow", "stream then hang up", idem="k-h", session="h", stream=True)
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    frames = [f for f in (await again.read()).decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert "slow answer" in "".join(frames)
    assert await env.user_messages("slow", "h") == ["stream then hang up"]


async def test_a_database_fault_after_the_intake_says_the_message_was_taken_in(
    env: Env,
) -> None:
    """It said "nothing was stored, please retry shortly" while the message was stored:
    a client obeying it sent the message twice."""
    interrupted = METRICS.unavailable.labels("turn.interrupted")
    before = interrupted._value.get()
    for stream in (False, True):
        session = f"f{int(stream)}"
        resp = await env.chat("faulty", "hello", session=session, stream=stream)
        if stream:  # the stream had started: its one error frame
            frames = [f for f in (await resp.read()).decode().split("\n\n") if f]
            error = json.loads(frames[-1].removeprefix("data: "))["error"]
        else:
            assert resp.status == 503 and resp.headers["x-should-retry"] == "false"
            assert "Retry-After" not in resp.headers
            error = (await resp.json())["error"]
        assert error["rule"] == "turn.interrupted"
        assert "Do not send it again" in error["message"]
        assert "nothing was stored" not in error["message"]
        assert await env.user_messages("faulty", session) == ["hello"]
    # Counted with the other 503s, under its own rule (operators see the outage).
    assert interrupted._value.get() == before + 2


async def test_the_turn_path_says_turn_interrupted_once_for_every_caller(env: Env) -> None:
    """REST, MCP and Studio each decided "taken in, then a database fault" for itself,
    and flows and schedules saw the fault's own "nothing was stored, please retry". The
    turn path raises :class:`TurnInterrupted` for all of them, the driver's words kept
    as the log's detail; a model error is left as it is."""

    def trigger(text: str, session: str) -> Trigger:
        return Trigger(
            org_id=env.org.id,
            agent_id="faulty",
            session_key=f"api:{session}",
            text=text,
            binding=BindingSpec(BindingKind.api),
        )

    with pytest.raises(TurnInterrupted) as raised:
        await env.service.turns.run(trigger("hello", "ti-fault"))
    assert raised.value.rule == "turn.interrupted" and raised.value.retry_after_s is None
    assert raised.value.detail == "database is locked (what the driver said)"
    assert isinstance(raised.value.__cause__, Unavailable)
    with pytest.raises(ModelError):
        await env.service.turns.run(trigger("model", "ti-model"))


async def test_a_fault_storing_the_answer_under_its_key_still_answers(env: Env) -> None:
    """The turn ran and answered, then storing its answer under the Idempotency-Key met a
    database fault: the client got a retryable 503 "nothing was stored, please retry"
    (no ``x-should-retry: false``) for a message taken in and answered, and a stream
    that was already sent whole was followed by an error answer. The answer is the
    client's; the unstored claim lapses, and a retry after that is ``idempotency.lost``
    (this ``finish`` only fails, as after the process holding the answer stopped; the
    real one hands it to its watch, which stores it: see
    test_an_answer_a_fault_kept_from_its_key_is_stored_once_the_database_is_back). That is
    left to answers stored after the turn (here a model failure's 502): a plain
    or streamed answer is stored in the turn's own last transaction, not by ``finish``
    (see test_a_fault_storing_a_keyed_answer_fails_its_turn)."""

    async def faulty_finish(*args: Any, **kwargs: Any) -> None:
        raise Unavailable("database is locked", rule="service.unavailable")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(env.service.idempotency, "finish", faulty_finish)
        failed = await env.chat("worker", "break #fail", idem="k-fin-f", session="fin-f")
        assert failed.status == 502 and failed.headers["x-should-retry"] == "false"
        plain = await env.chat("plain", "hello", idem="k-fin", session="fin")
        assert plain.status == 200, await plain.text()
        assert (await plain.json())["choices"][0]["message"]["content"] == "Echo: hello"
        streamed = await env.chat("plain", "hello", idem="k-fin-s", session="fin-s", stream=True)
        assert streamed.status == 200
        assert (await streamed.read()).endswith(b"data: [DONE]\n\n")
    env.clock.advance(LEASE_MS + 1)  # the claim nobody renews lapses
    lost = await env.chat("worker", "break #fail", idem="k-fin-f", session="fin-f")
    assert lost.status == 409 and (await lost.json())["error"]["rule"] == "idempotency.lost"
    assert await env.user_messages("worker", "fin-f") == ["break #fail"]  # taken in once
    replayed = await env.chat("plain", "hello", idem="k-fin", session="fin")
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert await replayed.read() == await plain.read()
    replayed = await env.chat("plain", "hello", idem="k-fin-s", session="fin-s", stream=True)
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert await replayed.read() == await streamed.read()
    assert await env.user_messages("plain", "fin") == await env.user_messages("plain", "fin-s")


@pytest.mark.like_production  # (the test server cancelled the MCP session's handlers)
async def test_a_database_fault_after_the_intake_tells_an_mcp_client_not_to_resend(
    env: Env,
) -> None:
    """MCP's tool error was the fault's own text ("nothing was stored, please retry
    shortly" for a real one) for a message that was taken in: a client obeying it sent
    the message twice. It now says what REST's ``turn.interrupted`` says."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {env.org.key}"}) as http,
        streamable_http_client(str(env.client.make_url("/mcp")), http_client=http) as streams,
        ClientSession(*streams) as session,
    ):
        await session.initialize()
        result = await session.call_tool(
            "send_action_agent_message", {"agent": "faulty", "message": "hello", "session": "m"}
        )
    assert result.is_error is True
    [block] = result.content
    assert isinstance(block, TextContent)
    assert "Do not send it again" in block.text and "nothing was stored" not in block.text
    assert await env.user_messages("faulty", "m") == ["hello"]


async def test_a_database_fault_after_the_intake_tells_studio_not_to_resend(env: Env) -> None:
    """Studio answered the fault's own retryable 503 ("nothing was stored, please retry
    shortly" for a real one), and its page put the message, taken in, back in the box
    to be sent again. It is REST's ``turn.interrupted`` answer now."""
    resp = await env.client.post(
        "/console/studio/agents/faulty/sessions/st/messages",
        json={"message": "hello"},
        headers={"Authorization": f"Bearer {env.org.key}"},
    )
    assert resp.status == 503 and "Retry-After" not in resp.headers
    assert "retry-after-ms" not in resp.headers and resp.headers["x-should-retry"] == "false"
    error = (await resp.json())["error"]
    assert error["rule"] == "turn.interrupted"
    assert "Do not send it again" in error["message"]
    assert await env.user_messages("faulty", "st") == ["hello"]


async def test_a_key_is_free_again_after_a_day(env: Env) -> None:
    await env.chat("plain", "day one", idem="k-d", session="d")
    env.clock.advance(TTL_MS + 1)
    resp = await env.chat("plain", "day two", idem="k-d", session="d")
    assert resp.status == 200 and "Idempotent-Replayed" not in resp.headers
    assert await env.user_messages("plain", "d") == ["day one", "day two"]


async def test_errors_before_the_intake_leave_the_key_free(env: Env) -> None:
    missing = await env.chat("nobody", "hi", idem="k-n", session="n")
    assert missing.status == 404 and "x-should-retry" not in missing.headers
    await make_agent(env.service, env.org, "nobody")
    assert (await env.chat("nobody", "hi", idem="k-n", session="n")).status == 200


def keyed(key: str, session: str, model: str = "plain", text: str = "hello") -> dict[str, Any]:
    """The official client's arguments of a keyed request."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "extra_headers": {"Idempotency-Key": key, "X-Session-Id": session},
    }


async def answer_of(official: AsyncOpenAI, **request: Any) -> httpx2.Response:
    """The HTTP answer the official client got, an error status included."""
    try:
        raw = await official.chat.completions.with_raw_response.create(**request)
    except openai.APIStatusError as refused:
        return refused.response
    answer: httpx2.Response = raw.http_response  # (mypy: Any otherwise)
    return answer


async def test_a_keyed_answer_is_replayed_byte_for_byte(env: Env) -> None:
    """The replay is the first answer's very bytes, ``created`` included, and
    ``created`` is the service clock's second when the request came (it was the wall
    clock's, whatever the injected clock said)."""
    official = env.official()
    came = env.clock.now_ms() // 1000
    first = await official.chat.completions.with_raw_response.create(**keyed("k-b", "b"))
    env.clock.advance(5_000)
    again = await official.chat.completions.with_raw_response.create(**keyed("k-b", "b"))
    await official.close()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.http_response.content == first.http_response.content
    completion = first.parse()
    assert completion.created == came and completion.choices[0].message.content == "Echo: hello"
    assert await env.transcript("plain", "b") == [("user", "hello"), ("assistant", "Echo: hello")]


#: (agent, message): a plain reply; a worker's (its turn has a run); a gated turn's 409.
ENDINGS = [("plain", "hello"), ("worker", "hello"), ("worker", "ship #complete")]


@pytest.mark.parametrize(("agent", "text"), ENDINGS)
async def test_a_process_ending_after_the_turn_committed_leaves_its_answer(
    env: Env, monkeypatch: pytest.MonkeyPatch, agent: str, text: str
) -> None:
    """The turn's last transaction commits, then the request ends before it answers (its
    process stops): the answer was stored after that commit, in a transaction of its
    own, so it was never stored, and the retry after the lease was told
    ``idempotency.lost`` for an answer the session had. It is stored with the turn now:
    the retry gets it, the very answer the first request would have sent."""
    official = env.official()
    came = env.clock.now_ms() // 1000
    send = env.service.messages.send

    async def send_then_stop(*args: Any, **kwargs: Any) -> Any:
        await send(*args, **kwargs)
        raise asyncio.CancelledError  # as the handler of a process stopping

    with monkeypatch.context() as patch:
        patch.setattr(env.service.messages, "send", send_then_stop)
        with pytest.raises(openai.APIConnectionError):
            await official.chat.completions.create(**keyed("k-end", "end", agent, text))
    env.clock.advance(LEASE_MS + 1)  # whatever claim was left has lapsed
    retry = await answer_of(official, **keyed("k-end", "end", agent, text))
    await official.close()
    assert retry.headers["Idempotent-Replayed"] == "true", retry.text
    if text == "hello":
        assert retry.status_code == 200
        completion = retry.json()
        assert completion["choices"][0]["message"]["content"] == "Echo: hello"
        assert completion["created"] == came
        assert await env.transcript(agent, "end") == [
            ("user", "hello"),
            ("assistant", "Echo: hello"),
        ]
    else:
        assert retry.status_code == 409 and retry.headers["x-should-retry"] == "false"
        assert retry.json()["error"]["rule"] == GATED_RULE
        assert await env.transcript(agent, "end") == [("user", text)]


@contextlib.asynccontextmanager
async def served_with_faults(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Env, SqliteFaults | PgFaults]]:
    """The app at ``url`` with the agents of :data:`ENDINGS`, and a statement-fault
    injector made before it opens the database; ``env.gate`` is the model ``gate``."""
    faults = injector(url, monkeypatch)
    gate = GateProvider()
    providers: dict[str, Provider] = {"script": ScriptProvider(), "gate": gate}
    async with served_app(url, providers=providers) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        try:
            yield Env(service, client, org, org, gate), faults
        finally:
            gate.release.set()


@pytest.mark.parametrize(("agent", "text"), ENDINGS[::2])
async def test_a_fault_storing_a_keyed_answer_fails_its_turn(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, agent: str, text: str
) -> None:
    """A database fault at the statement that stores an answer under its key: the turn's
    end and the answer are one transaction, so neither is kept and the turn is
    interrupted (503 ``turn.interrupted``, do not retry), and a retry with the key gets
    that 503 again. It was the turn's answer (200, or the gated 409) that was never
    stored: the key lapsed after a minute, and a retry then was told the answer was
    lost."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        official = env.official()
        faults.arm_on("UPDATE idempotency_keys SET response")
        cut = await answer_of(official, **keyed("k-fault", "fault", agent, text))
        faults.disarm()
        assert faults.fired is not None
        assert cut.status_code == 503 and cut.headers["x-should-retry"] == "false", cut.text
        assert cut.json()["error"]["rule"] == "turn.interrupted"
        assert await env.transcript(agent, "fault") == [("user", text)]
        env.clock.advance(LEASE_MS + 1)
        again = await answer_of(official, **keyed("k-fault", "fault", agent, text))
        await official.close()
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.content == cut.content
        assert await env.transcript(agent, "fault") == [("user", text)]


@pytest.mark.parametrize("answer", ["failed", "busy", "failed, past the budget"])
async def test_an_answer_a_fault_kept_from_its_key_is_stored_once_the_database_is_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """The turn answered after its intake (a model failure's 502, or the busy 409 of a
    worker whose item waits for its lead), and storing that answer under its key met a
    database fault. The answer is kept in memory and stored by the process's watch when
    its look falls due (1 s on; or by the next keyed request here): the client's retry
    meanwhile is told 409 ``idempotency.in_progress`` with ``Retry-After: 1`` (that
    look), and after it gets the answer replayed. It was told 409 ``idempotency.lost``
    at once, the claim's lease ended ("read the transcript": for a busy message, not
    there). Answers past :data:`ANSWERS_HELD_BYTES` are not kept: the lease is ended,
    and the retry's intake, finding the message taken in, says the answer was lost."""
    if answer == "failed, past the budget":
        monkeypatch.setattr(idempotency_mod, "ANSWERS_HELD_BYTES", 10)
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        agent, text = ("worker", "more") if answer == "busy" else ("plain", "please #fail")
        if answer == "busy":
            held = await env.chat("worker", "ship #complete", session="u")
            assert held.status == 409 and (await held.json())["error"]["rule"] == GATED_RULE
        faults.arm_on("UPDATE idempotency_keys SET response")
        first = await env.chat(agent, text, idem="k-unstored", session="u")
        faults.disarm()
        assert faults.fired is not None
        assert first.status == (409 if answer == "busy" else 502), await first.text()
        assert first.headers["x-should-retry"] == "false"
        retry = await env.chat(agent, text, idem="k-unstored", session="u")
        if answer == "failed, past the budget":
            assert retry.status == 409 and retry.headers["x-should-retry"] == "false"
            assert (await retry.json())["error"]["rule"] == "idempotency.lost"
        else:
            assert retry.status == 409, await retry.text()
            assert (await retry.json())["error"]["rule"] == "idempotency.in_progress"
            assert retry.headers["Retry-After"] == "1"
            env.clock.advance(1_000)  # the watch's look is due: it stores the answer
            retry = await env.chat(agent, text, idem="k-unstored", session="u")
            assert retry.headers["Idempotent-Replayed"] == "true", await retry.text()
            assert await retry.json() == await first.json()
        again = await env.chat(agent, text, idem="k-unstored", session="u")
        assert again.headers["Idempotent-Replayed"] == "true"
        assert await again.json() == await retry.json()
        user_messages = await env.user_messages(agent, "u")
        assert user_messages == (["ship #complete"] if answer == "busy" else [text])  # once


def _refusal(faults: SqliteFaults | PgFaults) -> Callable[[], Exception]:
    """What the driver raises when the database refuses a statement (a constraint): a
    fault no wait ends."""
    if isinstance(faults, PgFaults):
        return lambda: asyncpg.exceptions.CheckViolationError("answer refused")
    return lambda: sqlite3.IntegrityError("answer refused")


async def test_an_answer_the_database_refuses_to_store_is_given_up(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn's answer kept from its key by a database fault is held, and when the
    watch's look stores it the database refuses it (a constraint: no wait would store
    it). It is given up there: one ERROR names the request (its ``X-Request-Id``) and
    the answer's rule, and the claim's lease is ended, so the retry takes the key over
    and is told ``idempotency.lost`` (the message was taken in once). It was tried
    again at every look for as long as the process ran, holding its bytes, and the
    retry was told ``idempotency.in_progress`` until the claim's lease lapsed."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        faults.arm_on("UPDATE idempotency_keys SET response")
        first = await env.chat("plain", "please #fail", idem="k-refused", session="u")
        faults.disarm()
        assert first.status == 502 and faults.fired is not None, await first.text()
        rule = (await first.json())["error"]["rule"]
        caplog.set_level(logging.INFO, logger="leadgate.idempotency")
        faults.arm_on("UPDATE idempotency_keys SET response", error=_refusal(faults))
        env.clock.advance(1_000)  # the watch's look is due: the database refuses it
        idempotency = env.service.idempotency
        await idempotency.run_once()  # (or the loop's own pass, whichever takes it)
        await eventually(lambda: not idempotency._lost, what="the claim's lease ended")
        faults.disarm()
        assert faults.fired is not None
        lost = await env.chat("plain", "please #fail", idem="k-refused", session="u")
        assert lost.status == 409, await lost.text()
        assert (await lost.json())["error"]["rule"] == "idempotency.lost"
        [error] = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
        said = error.getMessage()
        assert first.headers["X-Request-Id"] in said and f"rule {rule}" in said
        assert await env.user_messages("plain", "u") == ["please #fail"]  # (once)


async def test_a_keyed_request_without_a_fault_costs_what_it_did(env: Env) -> None:
    """What a keyed request runs without a fault: the claim, the intake (its event first,
    for the de-duplication), and the answer stored with the turn or after it (a busy
    409). Holding an unstored answer, naming the watch's next look, and reading a
    duplicate's earlier event cost nothing here."""
    held = await env.chat("worker", "ship #complete", session="h")
    assert held.status == 409
    env.clock.advance(SWEEP_EVERY_MS + 1)  # (the sweep, a statement every 10 minutes)
    await env.chat("plain", "warm", idem="k-warm", session="p")
    for model, text, session, status in (
        ("plain", "hello", "p", 200),
        ("worker", "more", "h", 409),
    ):
        with env.service.db.record_statements() as statements:
            answer = await env.chat(model, text, idem=f"k-{model}", session=session)
        assert answer.status == status, await answer.text()
        keyed = [" ".join(sql.split()[:3]) for sql in statements if "idempotency_keys" in sql]
        assert keyed == ["INSERT INTO idempotency_keys", "UPDATE idempotency_keys SET"], keyed
        assert not [sql for sql in statements if "FROM inbound_events" in sql], statements


@pytest.mark.parametrize("then", ["another answer", "a give-back"])
async def test_a_full_watch_never_drops_an_answer_it_holds(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The watch holds an answer a fault kept from its key and is full (its token budget,
    shrunk here to one), when another answer's store fails, or a key's release does.
    The answer held stays held, and is replayed once stored; the other answer is not
    held, its claim's lease ended at once (its retry takes the key over and is told
    ``idempotency.lost``), and the give-back is not looked for (its claim waits for its
    lease). The full watch dropped the answer it held for either: its claim ran out a
    minute later, and the retry was told ``idempotency.in_progress`` until then."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        monkeypatch.setattr(env.service.idempotency._lost, "limit", 1)
        not_held, dropped = idempotency_mod.NOT_HELD.total, DROPPED.total
        faults.arm_on("UPDATE idempotency_keys SET response")
        first = await env.chat("plain", "please #fail", idem="k-held", session="u")
        faults.disarm()
        assert first.status == 502 and faults.fired is not None, await first.text()
        env.clock.advance(500)  # (the held answer's claim lapses first: the one to drop)
        if then == "another answer":
            faults.arm_on("UPDATE idempotency_keys SET response")
            other = await env.chat("plain", "please #fail", idem="k-other", session="v")
            faults.disarm()
            assert other.status == 502 and faults.fired is not None, await other.text()
            lost = await env.chat("plain", "please #fail", idem="k-other", session="v")
            assert lost.status == 409, await lost.text()
            assert (await lost.json())["error"]["rule"] == "idempotency.lost"
            assert idempotency_mod.NOT_HELD.total == not_held + 1  # (logged)
        else:
            faults.arm_on("INSERT INTO messages", and_on="idempotency_keys")
            cut = await env.chat("worker", "hello", idem="k-rel", session="rel")
            faults.disarm()
            assert cut.status == 503 and faults.fired is not None, await cut.text()
            running = await env.chat("worker", "hello", idem="k-rel", session="rel")
            assert (await running.json())["error"]["rule"] == "idempotency.in_progress"
            assert DROPPED.total == dropped + 1  # (logged)
        running = await env.chat("plain", "please #fail", idem="k-held", session="u")
        assert running.status == 409, await running.text()
        assert (await running.json())["error"]["rule"] == "idempotency.in_progress"
        assert running.headers["Retry-After"] == "1"
        env.clock.advance(500)  # the watch's look is due: it stores the answer
        retry = await env.chat("plain", "please #fail", idem="k-held", session="u")
        assert retry.headers["Idempotent-Replayed"] == "true", await retry.text()
        assert await retry.json() == await first.json()


async def test_a_key_whose_release_failed_says_when_it_is_given_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed request failed before its message was taken in, and the release of its
    key failed too: the process's watch gives the key back 1 s on. The client's retry
    meanwhile is told 409 ``idempotency.in_progress`` with ``Retry-After: 1``, when the
    key can be retried (it said 5, the cap of the lease's minute, whatever the watch's
    next look), and a retry then runs the turn."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        faults.arm_on("INSERT INTO messages", and_on="idempotency_keys")
        cut = await env.chat("worker", "hello", idem="k-rel", session="rel")
        faults.disarm()
        assert faults.fired is not None
        assert cut.status == 503, await cut.text()
        running = await env.chat("worker", "hello", idem="k-rel", session="rel")
        assert running.status == 409, await running.text()
        assert (await running.json())["error"]["rule"] == "idempotency.in_progress"
        assert running.headers["Retry-After"] == "1"
        env.clock.advance(1_000)
        retry = await env.chat("worker", "hello", idem="k-rel", session="rel")
        assert retry.status == 200, await retry.text()
        assert await env.user_messages("worker", "rel") == ["hello"]


@pytest.mark.parametrize(("agent", "text"), ENDINGS[::2])
async def test_a_keyed_turn_whose_last_commit_is_in_doubt_keeps_the_answer_it_committed(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, agent: str, text: str
) -> None:
    """PostgreSQL: the turn's last transaction (its reply and the answer under its key)
    commits, and the connection drops before COMMIT's answer arrives. The request is told
    503 ``turn.interrupted``, and that error, met after the message was taken in, must not
    be stored over the answer that did commit: a retry with the key gets the turn's real
    answer (it got the 503 again, stored over it)."""
    async with served_with_faults(migrated_pg, monkeypatch) as (env, faults):
        official = env.official()
        faults.arm_on("UPDATE idempotency_keys SET response", then="COMMIT", after_commit=True)
        cut = await answer_of(official, **keyed("k-doubt", "doubt", agent, text))
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("COMMIT")
        assert cut.status_code == 503, cut.text
        assert cut.json()["error"]["rule"] == "turn.interrupted"
        again = await answer_of(official, **keyed("k-doubt", "doubt", agent, text))
        await official.close()
        assert again.headers["Idempotent-Replayed"] == "true", again.text
        if text == "hello":
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["message"]["content"] == "Echo: hello"
            assert await env.transcript(agent, "doubt") == [
                ("user", "hello"),
                ("assistant", "Echo: hello"),
            ]
        else:
            assert again.status_code == 409, again.text
            assert again.json()["error"]["rule"] == GATED_RULE


async def test_a_keyed_claim_in_doubt_that_lands_late_is_given_back_for_another_replica(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL, two replicas: a keyed request's claim met a fault at its COMMIT (503),
    its give-back found nothing, and then the server applied the claim. The client's
    retry reaches the other replica, which knows nothing of the claim's owner token (409
    ``idempotency.in_progress``); the first replica's loop gives the claim back when its
    look falls due, with no keyed request of its own, and the next retry runs the turn.
    It was answered 409 until the claim's lease lapsed, a minute on, though no request
    held the key."""
    body = {"model": "plain", "messages": [{"role": "user", "content": "hello"}]}

    def keyed(key: str) -> dict[str, Any]:
        return {
            "json": body,
            "headers": {"Authorization": f"Bearer {org.key}", "Idempotency-Key": key},
        }

    async with served_app(migrated_pg) as (here, client), served_app(migrated_pg) as (_, there):
        org = await make_org(here)
        await make_agent(here, org, "plain")
        first = await client.post("/v1/chat/completions", **keyed("k-first"))  # (its sweep)
        assert first.status == 200, await first.text()
        late = CommitLandsLater(here.db.tx)
        monkeypatch.setattr(here.db, "tx", late)
        try:
            cut = await client.post("/v1/chat/completions", **keyed("k-late"))
            assert cut.status == 503, await cut.text()
        finally:
            await late.land()  # after the give-back that found nothing
        retry = await there.post("/v1/chat/completions", **keyed("k-late"))
        assert retry.status == 409, await retry.text()
        assert (await retry.json())["error"]["rule"] == "idempotency.in_progress"

        async def keys_held() -> int:
            async with here.db.read() as conn:
                count = sa.select(sa.func.count()).select_from(t.idempotency_keys)
                return int(await conn.scalar(count) or 0)

        async def given_back() -> bool:
            return await keys_held() == 1  # (k-first's answer stays)

        assert await keys_held() == 2
        fake_clock(here).advance(1_000)  # the first look is due: its loop, asleep toward
        here.idempotency.wake()  # it by this fake clock, is woken to see it
        await eventually(given_back)
        again = await there.post("/v1/chat/completions", **keyed("k-late"))
        assert again.status == 200, await again.text()
        assert (await again.json())["choices"][0]["message"]["content"] == "Echo: hello"


#: An unkeyed intake in doubt, by the path it takes: (agent, the session of a turn run
#: before it, if any ("doubt": its own), the statement that writes the message,
#: ``then``: the statement whose answer is lost after it; None: that one, run alone). A
#: new session's intake is one statement (a gated worker's once it and its lead are
#: cached, its run recorded in it), as is a plain agent's next message; a gated
#: worker's is otherwise a transaction (its COMMIT in doubt).
IntakeCase = tuple[str, str | None, str, str | None]
#: (one of each)
INTAKES: list[IntakeCase] = [
    ("plain", None, "WITH new_session", None),
    ("plain", "doubt", "INSERT INTO messages", None),
    ("worker", None, "INSERT INTO messages", "COMMIT"),
    ("worker", "warm", "WITH new_session", None),
    ("worker", "doubt", "INSERT INTO messages", "COMMIT"),
]
#: The read-back of an intake in doubt (leadgate.turns.intake._LANDED).
READ_BACK = "FROM messages LEFT OUTER JOIN bindings"


async def doubtful_intake(
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    intake: IntakeCase,
    and_on: str | None = None,
) -> tuple[httpx2.Response, list[tuple[str, str]], App]:
    """An unkeyed request of the official client (retrying as it does by default) whose
    intake's write lands and whose answer is lost (``and_on``: the statements that fail
    after it); its answer, the session's transcript, and the service."""
    agent, before, text, then = intake
    async with served_with_faults(migrated_pg, monkeypatch) as (env, faults):
        # (the client's default retries, unlike Env.official's)
        official = AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.org.key)
        ask = {"model": agent, "messages": [{"role": "user", "content": "hello"}]}
        if before is not None:
            first = await answer_of(official, **ask, extra_headers={"X-Session-Id": before})
            assert first.status_code == 200, first.text
        faults.arm_on(text, then=then, after_commit=True, and_on=and_on)
        answer = await answer_of(official, **ask, extra_headers={"X-Session-Id": "doubt"})
        faults.disarm()
        await official.close()
        assert faults.fired is not None
        assert faults.fired.startswith(then or "WITH"), faults.fired
        return answer, await env.transcript(agent, "doubt"), env.service


@pytest.mark.parametrize("intake", INTAKES)
async def test_an_unkeyed_intake_in_doubt_that_landed_is_answered_once(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, intake: IntakeCase
) -> None:
    """PostgreSQL: a request without an Idempotency-Key whose intake's COMMIT (or its one
    statement) lands and whose answer is lost: the intake reads back that its message
    exists, and the turn goes on. One message, one reply, the normal answer. It was 503
    "nothing was stored, please retry", and the official client's retry took the
    message in a second time."""
    answer, transcript, service = await doubtful_intake(migrated_pg, monkeypatch, intake)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Echo: hello"
    earlier = [("user", "hello"), ("assistant", "Echo: hello")] if intake[1] == "doubt" else []
    assert transcript == [*earlier, ("user", "hello"), ("assistant", "Echo: hello")]
    assert not service.turns.orphans  # (its run, if recorded, ran here: not recovery's)


@pytest.mark.parametrize("intake", INTAKES[1:])
async def test_an_intake_in_doubt_unread_says_it_may_have_been_taken_in(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, intake: IntakeCase
) -> None:
    """PostgreSQL: an intake in doubt whose read-back fails too (the database still
    away): 503 ``intake.in_doubt``, which says the message may have been taken in and
    asks for no retry (``x-should-retry: false``, no ``Retry-After``), so the client
    sends it once. It was "nothing was stored, please retry" for a message taken in."""
    answer, transcript, service = await doubtful_intake(
        migrated_pg, monkeypatch, intake, and_on=READ_BACK
    )
    # A run it recorded (a worker's: gated) may exist with no turn running it: the
    # recovery takes it over once the database is back. A plain turn records none: its
    # process owes its run (recorded by the service's stop here, the database back).
    assert service.turns.orphans and not service.turns.owed
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["rule"] == "intake.in_doubt", error
    assert "may have been taken in" in error["message"]
    assert "nothing was stored" not in error["message"]
    assert answer.headers["x-should-retry"] == "false"
    assert "Retry-After" not in answer.headers
    earlier = [("user", "hello"), ("assistant", "Echo: hello")] if intake[1] == "doubt" else []
    assert transcript == [*earlier, ("user", "hello")]  # (it had landed: once)


async def test_an_intake_in_doubt_that_wrote_nothing_is_retried_once(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a plain turn's one statement, run with its answer lost, that wrote
    nothing (its session did not exist yet): the read-back finds no message, so the 503
    "nothing was stored, please retry" is true, and the official client's retry takes
    the message in once."""
    intake: IntakeCase = ("plain", None, "WITH sb AS", None)
    answer, transcript, _ = await doubtful_intake(migrated_pg, monkeypatch, intake)
    assert answer.status_code == 200, answer.text
    assert transcript == [("user", "hello"), ("assistant", "Echo: hello")]


async def test_a_keyed_intake_in_doubt_that_lands_late_is_answered_under_its_key(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a keyed request to a worker with a lead whose intake's COMMIT answer
    was lost and whose read-back found nothing: 503 "nothing was stored, please retry",
    the key's claim lapsed for the retry. Then the server applied the COMMIT: the message
    and its run exist. The retry with the key takes it over under the same event id, a
    duplicate of that message, while the run is its live owner's (409
    ``idempotency.in_progress``). Turn recovery's look finds the run: its client's
    resend is that retry, no new message, so the run is rerun and its answer stored
    under the key, which the next retry gets. It was closed as "its client will send it
    again", and the next retry was told ``idempotency.lost``: nothing ever answered."""
    async with served_with_faults(migrated_pg, monkeypatch) as (env, _):
        service = env.service
        late = CommitLandsLater(service.db.tx)
        begin = service.idempotency.begin

        async def claimed_then_doubt(*args: Any) -> Any:
            claim = await begin(*args)
            monkeypatch.setattr(service.db, "tx", late)  # the intake's is the next
            return claim

        monkeypatch.setattr(service.idempotency, "begin", claimed_then_doubt)
        official = env.official()
        ask = keyed("k-late", "late", "worker", "draft it")
        try:
            cut = await answer_of(official, **ask)
            monkeypatch.setattr(service.idempotency, "begin", begin)
            assert late.held is not None  # (the intake's transaction, its answer lost)
        finally:
            if late.held is not None:
                await late.land()  # after its read-back found nothing
        assert cut.status_code == 503, cut.text
        assert "nothing was stored" in cut.json()["error"]["message"]
        assert await env.user_messages("worker", "late") == ["draft it"]
        busy = await answer_of(official, **ask)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["rule"] == "idempotency.in_progress"
        env.clock.advance(1_000)  # recovery's look for the run is due
        assert await drain(TurnRecovery(service.turns)) == 1
        assert await runs_left(env) == []
        again = await answer_of(official, **ask)
        await official.close()
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == "Echo: draft it"
        assert again.headers["Idempotent-Replayed"] == "true"
        assert await env.transcript("worker", "late") == [
            ("user", "draft it"),
            ("assistant", "Echo: draft it"),
        ]


@pytest.mark.parametrize("read_back", ["works", "fails"])
async def test_a_busy_message_whose_commit_is_in_doubt_is_read_back(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, read_back: str
) -> None:
    """PostgreSQL: a message to a worker whose item waits for its lead is recorded
    (a ``rejectedBusy`` inbound event) in a transaction whose COMMIT lands with its answer
    lost. The intake reads the event back: found, the answer is the busy 409, once. It
    was 503 "nothing was stored, please retry", and the official client's retry recorded
    the message a second time. When the read-back fails too: 503 ``intake.in_doubt``,
    no retry asked for."""
    async with served_with_faults(migrated_pg, monkeypatch) as (env, faults):
        # (the client's default retries, unlike Env.official's)
        official = AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.org.key)
        ask: dict[str, Any] = {"model": "worker", "extra_headers": {"X-Session-Id": "held"}}
        first = await answer_of(
            official, messages=[{"role": "user", "content": "ship #complete"}], **ask
        )
        assert first.status_code == 409 and first.json()["error"]["rule"] == GATED_RULE
        faults.arm_on(
            "INSERT INTO inbound_events",
            then="COMMIT",
            after_commit=True,
            and_on="FROM inbound_events" if read_back == "fails" else None,
        )
        answer = await answer_of(official, messages=[{"role": "user", "content": "more"}], **ask)
        faults.disarm()
        await official.close()
        assert faults.fired is not None and faults.fired.startswith("COMMIT")
        async with env.service.db.read() as conn:
            busy = await conn.scalar(
                sa.select(sa.func.count()).where(t.inbound_events.c.outcome == "rejectedBusy")
            )
        assert busy == 1  # recorded once
        error = answer.json()["error"]
        if read_back == "works":
            assert answer.status_code == 409 and error["rule"] == BUSY_RULE, answer.text
        else:
            assert answer.status_code == 503 and error["rule"] == "intake.in_doubt", answer.text
            assert answer.headers["x-should-retry"] == "false"


async def streamed(official: AsyncOpenAI, **request: Any) -> httpx2.Response:
    """The HTTP answer of a streamed request as the official client got it, read whole
    (an error status included)."""
    try:
        raw = await official.chat.completions.with_raw_response.create(stream=True, **request)
    except openai.APIStatusError as refused:
        return refused.response
    answer: httpx2.Response = raw.http_response  # (mypy: Any otherwise)
    await answer.aread()
    return answer


async def test_a_streamed_keyed_answer_is_stored_with_its_turn(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's frames, the closing ones included, are made before the turn's last
    transaction and stored in it: a request that stops after that commit leaves the
    whole stream for the retry (it was ``idempotency.lost``), and a fault storing them
    ends the stream with the ``turn.interrupted`` error frame, which the key replays
    (the stream ended with ``[DONE]`` and its answer was never stored)."""
    faults = injector(migrated_url, monkeypatch)
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        env = Env(service, client, org, org, GateProvider())
        official = env.official()
        came = env.clock.now_ms() // 1000
        send = service.messages.send

        async def send_then_stop(*args: Any, **kwargs: Any) -> Any:
            await send(*args, **kwargs)
            raise asyncio.CancelledError  # as the handler of a process stopping

        with monkeypatch.context() as patch:
            patch.setattr(service.messages, "send", send_then_stop)
            with pytest.raises((openai.APIError, httpx2.HTTPError)):
                await streamed(official, **keyed("k-s-end", "s-end"))
        faults.arm_on("UPDATE idempotency_keys SET response")
        cut = await streamed(official, **keyed("k-s-fault", "s-fault"))
        faults.disarm()
        assert faults.fired is not None
        frames = [f for f in cut.content.decode().split("\n\n") if f]
        assert json.loads(frames[-1].removeprefix("data: "))["error"]["rule"] == "turn.interrupted"
        env.clock.advance(LEASE_MS + 1)  # whatever claim was left has lapsed
        retry = await streamed(official, **keyed("k-s-end", "s-end"))
        assert retry.status_code == 200 and retry.headers["Idempotent-Replayed"] == "true"
        frames = [f for f in retry.content.decode().split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Echo: hello"
        assert {c["created"] for c in chunks} == {came}
        again = await streamed(official, **keyed("k-s-fault", "s-fault"))
        await official.close()
        assert again.headers["Idempotent-Replayed"] == "true" and again.content == cut.content
        assert await env.transcript("plain", "s-end") == [
            ("user", "hello"),
            ("assistant", "Echo: hello"),
        ]
        assert await env.transcript("plain", "s-fault") == [("user", "hello")]


async def test_streamed_answer_is_replayed_frame_for_frame(env: Env) -> None:
    first = await env.chat("plain", "stream me", idem="k-s", session="s", stream=True)
    body = await first.read()
    again = await env.chat("plain", "stream me", idem="k-s", session="s", stream=True)
    assert again.headers["Content-Type"].startswith("text/event-stream")
    assert await again.read() == body
    assert body.endswith(b"data: [DONE]\n\n")
    assert await env.user_messages("plain", "s") == ["stream me"]


# -------------------------------------------------------------------- x-should-retry


@pytest.mark.parametrize("agent", ["plain", "worker"])
async def test_a_failed_turn_says_do_not_retry(env: Env, agent: str) -> None:
    resp = await env.chat(agent, "please #fail", session=f"x-{agent}")
    assert resp.status == 502 and resp.headers["x-should-retry"] == "false"
    error = (await resp.json())["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    # Refused before anything was taken in: retrying is fine.
    bad = await env.chat(agent, "", session=f"x-{agent}")
    assert bad.status == 400 and "x-should-retry" not in bad.headers
    assert await env.user_messages(agent, f"x-{agent}") == ["please #fail"]


async def test_a_message_sent_again_after_a_502_runs_the_turn_of_the_same_item(
    env: Env,
) -> None:
    """README: after a model failure's 502 the message stays in the transcript
    unanswered and a gated turn's work item stays ``inProgress``; the message the caller
    sends again is taken into that item and runs the turn (no second item, nothing of
    the first message lost)."""
    failed = await env.chat("worker", "ship it #fail", session="again")
    assert failed.status == 502 and failed.headers["x-should-retry"] == "false"
    first = await session_item(env.service, "h:again")
    assert (await item_row(env.service, first))["status"] == "inProgress"
    assert await env.transcript("worker", "again") == [("user", "ship it #fail")]
    resent = await env.chat("worker", "ship it #complete", session="again")
    assert resent.status == 409, await resent.text()
    assert (await resent.json())["error"]["rule"] == GATED_RULE
    assert await session_item(env.service, "h:again") == first  # the same item
    assert (await item_row(env.service, first))["status"] != "inProgress"
    # Both messages in the item's task context (one item: ``task_context`` reads one).
    assert await env.task_context("again") == "ship it #fail\n\nship it #complete"
    assert await env.user_messages("worker", "again") == ["ship it #fail", "ship it #complete"]


# ------------------------------------------------------------------ to the letter


async def test_models_list_the_organizations_active_agents(env: Env) -> None:
    headers = {"Authorization": f"Bearer {env.org.key}"}
    listing = await (await env.client.get("/v1/models", headers=headers)).json()
    assert listing["object"] == "list"
    assert {m["id"] for m in listing["data"]} == {"lead", "worker", "plain", "slow", "faulty"}
    model = next(m for m in listing["data"] if m["id"] == "plain")
    assert set(model) == {"id", "object", "created", "owned_by"}
    assert model["object"] == "model" and isinstance(model["created"], int)
    one = await env.client.get("/v1/models/plain", headers=headers)
    assert await one.json() == model
    theirs = await env.client.get("/v1/models/theirs", headers=headers)
    assert theirs.status == 404
    assert (await theirs.json())["error"]["type"] == "not_found_error"
    async with env.service.db.tx() as conn:
        await conn.execute(t.agents.update().where(t.agents.c.slug == "slow").values(active=False))
    listing = await (await env.client.get("/v1/models", headers=headers)).json()
    assert "slow" not in {m["id"] for m in listing["data"]}
    assert (await env.client.get("/v1/models/slow", headers=headers)).status == 404


async def test_usage_is_the_script_models_count(env: Env) -> None:
    body = await (await env.chat("plain", "count these words")).json()
    usage = body["usage"]
    # System prompt "You are a helpful agent." (24 characters) and the user message (17):
    # 41 characters, 11 tokens; the reply "Echo: count these words" (23): 6.
    assert usage == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["message"]["refusal"] is None


async def test_n_other_than_one_is_400(env: Env) -> None:
    for n in (2, 0, True, "1"):
        resp = await env.chat("plain", "hi", n=n)
        assert resp.status == 400, n
        assert (await resp.json())["error"]["rule"] == "n.one"
    assert (await env.chat("plain", "hi", n=1)).status == 200


REFUSED_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"user": 5}, "user.type"),  # it chose the default session without a word
    ({"max_tokens": "x"}, "max_tokens.range"),
    ({"max_completion_tokens": 0}, "max_completion_tokens.range"),
    ({"temperature": 5}, "temperature.range"),
    ({"top_p": True}, "top_p.range"),
    ({"stop": [1]}, "stop.type"),
    ({"metadata": "x"}, "metadata.type"),
    ({"tools": "x"}, "tools.type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.unsupported"),
    ({"tool_choice": "required"}, "tool_choice.unsupported"),
    ({"response_format": {"type": "json_object"}}, "response_format.unsupported"),
    ({"response_format": "json"}, "response_format.type"),
    ({"logprobs": True}, "logprobs.unsupported"),
    ({"modalities": ["text", "audio"]}, "modalities.unsupported"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
]


async def test_a_repeated_session_or_idempotency_header_is_refused(env: Env) -> None:
    """Two ``X-Session-Id`` (or ``Idempotency-Key``) headers silently meant the first:
    the message went to one of two sessions (or keys) a client, a proxy or a library
    added. Now a 400 ``header.repeated`` naming the header, before anything is taken in;
    ``param`` is null, as for every header (a header is no request parameter)."""
    body = {"model": "plain", "messages": [{"role": "user", "content": "which one"}]}
    auth = ("Authorization", f"Bearer {env.org.key}")
    for name, values in (("X-Session-Id", ("r1", "r2")), ("Idempotency-Key", ("k-a", "k-b"))):
        headers = [auth, *((name, value) for value in values)]
        if name == "Idempotency-Key":
            headers.append(("X-Session-Id", "r3"))
        resp = await env.client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 400, name
        error = (await resp.json())["error"]
        assert (error["rule"], error["param"], error["type"]) == (
            "header.repeated",
            None,
            "invalid_request_error",
        )
        assert name in error["message"], error
    for session in ("r1", "r2", "r3"):
        assert await env.user_messages("plain", session) == [], session
    # Once each is as before.
    assert (await env.chat("plain", "which one", idem="k-a", session="r1")).status == 200


async def test_the_turn_paths_refusals_name_their_parameter(env: Env) -> None:
    """The message text and the ``user`` session name are checked on the turn path; their
    400s said ``param: null`` though the README says ``param`` names the request
    parameter a 400 is about (``messages``, ``user``). A session named by the
    ``X-Session-Id`` header is no request parameter: ``null`` there."""
    cases: list[tuple[str, dict[str, Any], str, str | None]] = [
        ("", {}, "message.empty", "messages"),
        ("x" * 100_001, {}, "message.too_long", "messages"),
        ("hi", {"user": "u" * 201}, "session.length", "user"),
        ("hi", {"user": "a\x01b"}, "session.text", "user"),
    ]
    for idem in (None, "k-param"):  # (the Idempotency-Key path checks the session first)
        for text, extra, rule, param in cases:
            resp = await env.chat("plain", text, idem=idem, **extra)
            assert resp.status == 400, (rule, idem)
            error = (await resp.json())["error"]
            assert (error["rule"], error["param"]) == (rule, param), idem
    header = await env.chat("plain", "hi", session="s" * 201)
    error = (await header.json())["error"]
    assert (error["rule"], error["param"]) == ("session.length", None)
    async with env.service.db.tx() as conn:
        await conn.execute(t.agents.update().where(t.agents.c.slug == "slow").values(active=False))
    inactive = await env.chat("slow", "hi")
    error = (await inactive.json())["error"]
    assert (inactive.status, error["rule"], error["param"]) == (400, "agent.inactive", "model")
    official = AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.org.key)
    with pytest.raises(openai.BadRequestError) as refused:
        await official.chat.completions.create(
            model="plain", messages=[{"role": "user", "content": " "}]
        )
    assert refused.value.param == "messages" and refused.value.code == "invalid_request"


async def test_parameters_are_checked_and_what_the_agent_cannot_do_is_refused(
    env: Env,
) -> None:
    """They were dropped unread: ``max_tokens="x"`` was a 200, and a client asking for
    JSON got free text its parser then failed on."""
    for extra, rule in REFUSED_OPTIONS:
        resp = await env.chat("plain", "hi", session="opts", **extra)
        assert resp.status == 400, extra
        error = (await resp.json())["error"]
        assert error["rule"] == rule, extra
        assert error["param"] == rule.split(".")[0], extra  # as OpenAI names it
    assert await env.user_messages("plain", "opts") == []  # nothing taken in
    # The sampling parameters a client commonly sends are checked, then the agent's.
    official = AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.org.key)
    answer = await official.chat.completions.create(
        model="plain",
        messages=[{"role": "user", "content": "with options"}],
        max_tokens=50,
        temperature=0.2,
        top_p=1,
        stop=["\n\n"],
        seed=7,
        metadata={"team": "a"},
        tool_choice="none",
        response_format={"type": "text"},
        logprobs=False,
    )
    assert answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        await official.chat.completions.create(
            model="plain",
            messages=[{"role": "user", "content": "json please"}],
            response_format={"type": "json_object"},
        )
    assert "cannot guarantee a JSON answer" in str(refused.value)
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["rule"] == "response_format.unsupported"


async def test_include_usage_sends_the_usage_chunk_last(env: Env) -> None:
    resp = await env.chat("plain", "stream it", stream=True, stream_options={"include_usage": True})
    frames = [f for f in (await resp.read()).decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[len("data: ") :]) for f in frames[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    plain = await env.chat("plain", "stream it", stream=True)
    assert all(
        "usage" not in json.loads(f[len("data: ") :])
        for f in (await plain.read()).decode().split("\n\n")
        if f and f != "data: [DONE]"
    )


# -------------------------------------------------------------------- overload


async def test_requests_beyond_max_inflight_are_503_until_one_ends(migrated_url: str) -> None:
    """``[server] max_inflight``: a request beyond it is 503 ``server.busy`` with
    Retry-After at once (not queued behind the others); health, and open event streams,
    which have their own bound, do not count; the service takes requests again as soon as
    one ends, and the official ``openai`` client's own retry gets its answer."""
    gate = GateProvider()
    providers: dict[str, Provider] = {"script": ScriptProvider(), "gate": gate}
    config = {"server": {"max_inflight": 2}, "api": {"events_heartbeat_s": 0.3}}
    async with served_app(migrated_url, config=config, providers=providers) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        await make_agent(service, org, "slow", model="gate")
        await make_agent(service, org, "faulty", model="fault")
        env = Env(service, client, org, org, gate)
        auth = {"Authorization": f"Bearer {org.key}"}
        streams = [
            await client.get(f"/v1/agents/plain/sessions/watch{i}/events", headers=auth)
            for i in range(3)
        ] + [await client.get("/operator/events", headers=auth) for _ in range(2)]
        assert [s.status for s in streams] == [200] * 5
        held = [asyncio.create_task(env.chat("slow", "wait", session=f"h{i}")) for i in range(2)]
        await eventually(lambda: gate.calls == 2, 5.0)
        refused = await env.chat("plain", "one too many", session="busy")
        assert refused.status == 503
        assert 1 <= int(refused.headers["Retry-After"]) <= 3
        assert 1000 <= int(refused.headers["retry-after-ms"]) < 3000
        assert (await refused.json())["error"]["rule"] == "server.busy"
        assert (await client.get("/healthz")).status == 200
        # The official client retries the 503 after the wait it names (1-3 s): room made
        # during that wait answers it.
        inflight = client.app[INFLIGHT]
        official = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=org.key)
        call = asyncio.create_task(
            official.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "retried"}]
            )
        )
        await eventually(lambda: inflight.shed == 2, 5.0)
        gate.release.set()
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
        assert (await call).choices[0].message.content == "Echo: retried"
        assert inflight.shed == 2
        await official.close()
        assert await env.user_messages("plain", "busy") == []  # refused before anything
        again = await env.chat("plain", "room now", session="busy")
        assert again.status == 200
        for stream in streams:
            stream.close()


async def test_a_keyed_request_refused_before_its_intake_is_told_why_when_its_key_stays_held(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed request refused before its message is taken in (here an unknown model,
    404 ``agent.not_found``) gives its key back; when that write meets a database fault,
    the client is still told why its request was refused (it was told a 503, "retry",
    for a request that will never run), and the key is given back by the watch, so the
    retry after the watch's look is refused the same way, not told
    ``idempotency.in_progress`` for a request that runs nowhere."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        faults.arm_on("DELETE FROM idempotency_keys WHERE idempotency_keys.org_id")
        refused = await env.chat("nope", "hello", idem="k-refused", session="u")
        faults.disarm()
        assert faults.fired is not None and "owner" in faults.fired, faults.statements
        assert refused.status == 404, await refused.text()
        assert (await refused.json())["error"]["rule"] == "agent.not_found"

        async def given_back() -> bool:
            async with env.service.db.read() as conn:
                count = sa.select(sa.func.count()).select_from(t.idempotency_keys)
                return bool(await conn.scalar(count) == 0)

        assert not await given_back()
        # The watch's first look at the key to give back: its loop, asleep toward it by
        # this fake clock, is woken to see it. The retry comes after that look: sent
        # while the loop's look was in flight (its 1 s sleep ending just then), it found
        # the key still held and was told 409 ``idempotency.in_progress``, retry shortly.
        env.clock.advance(1_001)
        env.service.idempotency.wake()
        await eventually(given_back)
        again = await env.chat("nope", "hello", idem="k-refused", session="u")
        assert again.status == 404, await again.text()
        assert (await again.json())["error"]["rule"] == "agent.not_found"


async def test_a_takeover_told_in_progress_is_told_so_when_ending_its_claim_fails(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed retry that comes while turn recovery reruns its message's turn runs
    nothing: it is told 409 ``idempotency.in_progress`` and its claim's lease is ended.
    When that write meets a database fault (it is watched and tried again), the retry is
    still told 409 ``idempotency.in_progress``: it was a 503 saying nothing was stored,
    for a message taken in and being answered. The next retry gets the rerun's answer."""
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        await make_agent(env.service, env.org, "gated-slow", model="gate", lead="lead")
        await claim_and_crash(env, "slowly", "k-w4", "w4", taken_in=True, model="gated-slow")
        recovery = TurnRecovery(env.service.turns)
        assert await drain(recovery) == 1  # waits for a resend
        env.clock.advance(runs.RESEND_GRACE_MS + 1)
        rerun = asyncio.create_task(recovery.run_once())
        try:
            await eventually(lambda: env.gate.calls == 1)
            # (The first such statement is the retry's takeover of the key; the next,
            # the end of its claim's lease.)
            faults.arm_on(
                "UPDATE idempotency_keys SET lease_expires_at",
                then="UPDATE idempotency_keys SET lease_expires_at",
            )
            waiting = await env.chat("gated-slow", "slowly", idem="k-w4", session="w4")
            faults.disarm()
            assert faults.fired is not None and "owner=" not in faults.fired, faults.fired
            assert waiting.status == 409, await waiting.text()
            assert (await waiting.json())["error"]["rule"] == "idempotency.in_progress"
            env.gate.release.set()
            assert await rerun
        finally:
            env.gate.release.set()
            await asyncio.gather(rerun, return_exceptions=True)
        env.clock.advance(1_001)  # the watch's first look at the claim to end
        reply = await env.chat("gated-slow", "slowly", idem="k-w4", session="w4")
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["choices"][0]["message"]["content"] == "slow answer"
        assert env.gate.calls == 1  # one turn: the rerun's


# ------------------------------------------------ the official client's own retries
# The official client with its default retries (2), as an application uses it: a
# connection lost, or a 503, is sent again by the client itself (the test holds each of
# its waits until the server has done what the case needs, instead of sleeping them).


class DropsFirst(httpx2.AsyncBaseTransport):
    """The client's transport, losing its first connection once the service has called
    the model (the message was taken in) and before the client read the answer: the
    request reached the service, the client saw a reset connection."""

    def __init__(self, called: Callable[[], bool]) -> None:
        self.real = httpx2.AsyncHTTPTransport()
        self.called = called
        self.drops = 1
        self.sent = 0

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.sent += 1
        if not self.drops:
            return await self.real.handle_async_request(request)
        self.drops -= 1
        sending = asyncio.ensure_future(self.real.handle_async_request(request))
        await eventually(self.called, what="the model called")
        if sending.done():  # (a stream's head came first: lost all the same)
            await sending.result().aclose()
        else:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
        raise httpx2.ReadError("Connection reset by peer")

    async def aclose(self) -> None:
        await self.real.aclose()


class HeldRetries:
    """``AsyncOpenAI._sleep_for_retry`` held until ``go`` is set; ``waits`` are the
    seconds the client would have slept, each computed as it computes them."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.waits: list[float] = []

    def install(self, mp: pytest.MonkeyPatch) -> None:
        """Hold the waits of every ``AsyncOpenAI`` (until the context ``mp`` ends)."""
        held = self

        async def sleep_for_retry(
            client: AsyncOpenAI, *, retries_taken: int, max_retries: int, **rest: Any
        ) -> None:
            response: httpx2.Response | None = rest["response"]
            held.waits.append(
                client._calculate_retry_timeout(
                    max_retries - retries_taken,
                    rest["options"],
                    response.headers if response is not None else None,
                )
            )
            await held.go.wait()

        mp.setattr(AsyncOpenAI, "_sleep_for_retry", sleep_for_retry)


@pytest.mark.like_production
@pytest.mark.parametrize("stream", [False, True])
async def test_the_official_clients_keyed_retry_after_a_lost_connection_gets_the_one_answer(
    env: Env, stream: bool
) -> None:
    """The connection drops after the service took the message in and before its
    answer reached the client; the client sends the request again by itself (its
    default retries), under the ``Idempotency-Key`` it was given, once the turn has
    ended: the retry gets the turn's answer, marked replayed, and the model was called
    once, the message taken in once."""
    held = HeldRetries()
    session = f"lost-{stream}"
    headers = {"Idempotency-Key": session, "X-Session-Id": session}
    with pytest.MonkeyPatch.context() as mp:
        held.install(mp)
        asked, transport = lose_the_first_connection(env, "answer once", stream, headers)
        await eventually(lambda: held.waits, what="the client's retry after the lost connection")
        env.gate.release.set()

        async def answered() -> bool:
            return len(await env.transcript("slow", session)) == 2

        await eventually(answered, what="the first request's turn ended")
        held.go.set()
        answer = await asked
    await one_answer(env, session, answer, transport, held)


@pytest.mark.like_production
@pytest.mark.parametrize("stream", [False, True])
async def test_the_official_clients_retry_while_the_turn_runs_gets_its_answer_without_a_key(
    env: Env, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The same without an ``Idempotency-Key`` (the client's default: it sends none),
    the retry reaching the service while the first request's turn runs (a proxy's or
    the client's timeout ended the first connection): the client's retry
    (``x-stainless-retry-count: 1``) waits for that turn and gets its answer. It was a
    new message: the model called a second time, the message twice in the transcript,
    and the client given the second turn's answer."""
    caplog.set_level(logging.INFO, logger="leadgate.web")
    held = HeldRetries()
    session = f"unkeyed-{stream}"
    with pytest.MonkeyPatch.context() as mp:
        held.install(mp)
        asked, transport = lose_the_first_connection(
            env, "answer once", stream, {"X-Session-Id": session}
        )
        await eventually(lambda: held.waits, what="the client's retry after the lost connection")
        held.go.set()
        await eventually(
            lambda: (
                env.gate.calls == 2
                or [r for r in caplog.records if "whose turn runs" in r.getMessage()]
            ),
            what="the retry waiting for the running turn (or running its own)",
        )
        env.gate.release.set()
        answer = await asked
    await one_answer(env, session, answer, transport, held)


def lose_the_first_connection(
    env: Env, text: str, stream: bool, headers: dict[str, str]
) -> tuple[asyncio.Future[Any], DropsFirst]:
    """An official client with its default retries asking the ``slow`` agent ``text``,
    its first connection lost once the model was called: the request running, and the
    transport."""
    transport = DropsFirst(lambda: env.gate.calls >= 1)
    official = AsyncOpenAI(
        base_url=str(env.client.make_url("/v1")),
        api_key=env.org.key,
        http_client=httpx2.AsyncClient(transport=transport),
    )
    ask: dict[str, Any] = {
        "model": "slow",
        "messages": [{"role": "user", "content": text}],
        "extra_headers": headers,
    }

    async def streamed() -> str:
        chunks = await official.chat.completions.create(**ask, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def asked() -> Any:
        async with official:
            if stream:
                return await streamed()
            return await official.chat.completions.with_raw_response.create(**ask)

    return asyncio.ensure_future(asked()), transport


async def one_answer(
    env: Env, session: str, answer: Any, transport: DropsFirst, held: HeldRetries
) -> None:
    """The client got the one turn's answer (replayed) from its one retry."""
    if isinstance(answer, str):
        assert answer == "slow answer"
    else:
        assert answer.headers["Idempotent-Replayed"] == "true"
        assert answer.parse().choices[0].message.content == "slow answer"
    assert transport.sent == 2 and len(held.waits) == 1
    assert env.gate.calls == 1
    assert await env.transcript("slow", session) == [
        ("user", "answer once"),
        ("assistant", "slow answer"),
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_official_client_retries_a_503_of_a_database_fault_and_is_answered_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A database fault at the intake (storing the message) is a 503 with
    ``Retry-After`` (and ``retry-after-ms``), nothing stored, before any stream: the
    client waits what it names, sends the request again by itself, and the retry's turn
    is the one turn."""
    held = HeldRetries()
    held.go.set()
    async with served_with_faults(migrated_url, monkeypatch) as (env, faults):
        official = AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.org.key)
        ask: dict[str, Any] = {
            "model": "plain",
            "messages": [{"role": "user", "content": "after the fault"}],
            "extra_headers": {"X-Session-Id": "fault"},
        }
        with pytest.MonkeyPatch.context() as mp:
            held.install(mp)
            faults.arm_on("INSERT INTO messages")
            if stream:
                chunks = await official.chat.completions.create(**ask, stream=True)
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                )
            else:
                text = (await official.chat.completions.create(**ask)).choices[0].message.content
            faults.disarm()
        assert faults.fired is not None
        assert text == "Echo: after the fault"
        assert len(held.waits) == 1 and 1 <= held.waits[0] <= 5, held.waits  # its Retry-After
        assert await env.transcript("plain", "fault") == [
            ("user", "after the fault"),
            ("assistant", "Echo: after the fault"),
        ]
        await official.close()
