"""A plain worker's (no lead) REST turn (or MCP tool call) whose process dies before its
answer is stored, through two real apps on one database (both backends): ``died``,
whose turn is held in its model call (:class:`~tests.fakes.GateProvider`) when it
"dies" (its heartbeat lapses and the other app's reap removes its row: what a crash
leaves), and ``survivor``, whose turn recovery answers the message.

Such a turn records no run (the plain path stays cheap): nothing stored told its
message from an answered one, and it sat unanswered for ever. Its intake now names its
process (``messages.taken_by``), and a gone process's unanswered messages are recorded
as runs (:func:`leadgate.turns.runs.record_taken`) and rerun as a dead process's
client runs are (after the client's resend wait)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx2
import pytest
import sqlalchemy as sa
from openai import AsyncOpenAI

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.errors import ModelError, Unavailable
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Duplicate, Trigger
from leadgate.database import schema as t
from leadgate.operations.idempotency import LEASE_MS
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns import runs
from leadgate.turns.providers.base import ModelEvent, ModelRequest, Provider
from leadgate.turns.providers.script import ScriptProvider
from tests.fakes import GateProvider
from tests.helpers import eventually, make_agent, make_org, stops_beating
from tests.integration.test_mcp_tool_calls import TOOL, mcp_client, session_rows
from tests.integration.test_openai_surface import answer_of, keyed
from tests.serving import Client, served_app


@dataclass
class Pair:
    """The two apps, their clients, the held model of ``died`` and an API key."""

    died: App
    died_client: Client
    survivor: App
    survivor_client: Client
    gate: GateProvider
    key: str
    clock: FakeClock

    async def chat(self, client: Client, text: str) -> int:
        """A plain REST turn of session ``s`` through ``client``: its status."""
        resp = await client.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": [{"role": "user", "content": text}]},
            headers={"Authorization": f"Bearer {self.key}", "X-Session-Id": "s"},
        )
        return resp.status

    async def transcript(self) -> list[tuple[str, str]]:
        """Session ``s``'s messages (role, content), oldest first."""
        return (await session_rows(self.survivor, "h:s"))[0]

    async def runs_left(self) -> int:
        """How many turn runs are recorded."""
        return (await session_rows(self.survivor, "h:s"))[1]

    async def dies(self) -> None:
        """``died``'s heartbeat lapses and the survivor's reap removes its row (what a
        crash leaves: its turn, held in the model, never ends)."""
        survivor = self.survivor
        await stops_beating(survivor, survivor.liveness.dead_after_ms, self.died.liveness.id)
        assert await survivor.liveness.reap() == 1

    async def recorded(self) -> TurnRecovery:
        """``died`` dies (:meth:`dies`) and the survivor's turn recovery records its
        message's run, left to wait for a resend: that recovery, to drain again."""
        await self.dies()
        recovery = TurnRecovery(self.survivor.turns)
        assert await drain(recovery) == 1  # recorded, then left to wait for a resend
        return recovery


@asynccontextmanager
async def pair(
    url: str, survivor_model: Provider | None = None, gate: GateProvider | None = None
) -> AsyncIterator[Pair]:
    """Both apps on ``url`` (one clock), registered; session ``s`` opened by an exchange
    through the survivor (so that ``died``'s intake is the plain one of an existing
    session: one statement on PostgreSQL). The survivor's model answers ``Echo: <text>``
    unless ``survivor_model`` is given (which answers ``first`` too); ``died``'s is
    ``gate`` (a new :class:`~tests.fakes.GateProvider` unless given)."""
    gate = gate or GateProvider()
    clock = FakeClock()
    theirs = survivor_model or ScriptProvider()
    async with (
        served_app(url, providers={"script": ScriptProvider(), "gate": gate}, clock=clock) as (
            died,
            died_client,
        ),
        served_app(url, providers={"script": ScriptProvider(), "gate": theirs}, clock=clock) as (
            survivor,
            survivor_client,
        ),
    ):
        org = await make_org(survivor)
        await make_agent(survivor, org, "plain", model="gate")
        await died.start_liveness("api")
        await survivor.start_liveness("worker")
        both = Pair(died, died_client, survivor, survivor_client, gate, org.key, clock)
        assert await both.chat(survivor_client, "first") == 200
        yield both


@asynccontextmanager
async def held(both: Pair, text: str) -> AsyncIterator[None]:
    """A plain REST turn of ``text`` through ``died``, held in its model call (its
    message taken in); its client gives up at the end (the turn is cancelled)."""
    calls = both.gate.calls
    request = asyncio.ensure_future(both.chat(both.died_client, text))
    try:
        await eventually(lambda: both.gate.calls > calls, what="the model called")
        yield
    finally:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)


EARLIER = [("user", "first"), ("assistant", "Echo: first")]


async def test_a_plain_rest_turn_whose_process_died_mid_model_call_is_answered_once(
    migrated_url: str,
) -> None:
    """Another process's recovery records its run (a dead process's client run: it
    waits a minute for the client's resend) and reruns it when none came: answered
    once, nothing left, and a second search finds nothing."""
    async with pair(migrated_url) as both, held(both, "hi"):
        recovery = await both.recorded()
        assert await both.runs_left() == 1
        both.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await drain(recovery) == 1
        assert await both.transcript() == [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await both.runs_left() == 0
        recovery.gone_found()
        assert await drain(recovery) == 0
        assert await runs.record_taken(both.survivor.db, both.survivor.ids, 0) == 0


async def test_a_plain_turn_that_ran_longer_than_a_run_lease_before_its_process_died_is_answered(
    migrated_url: str,
) -> None:
    """The turn waited 20 minutes for the model (no hard limit: the model's timeout
    bounds each wait for the next bytes, not the stream), its process beating all along,
    then died: the search's window reaches back to the oldest turn in flight at the last
    beat, not only to that beat less 15 minutes (``RUN_LEASE_MS``), and the message is
    answered once (it was never found: nothing answered it)."""
    async with pair(migrated_url) as both, held(both, "hi"):
        both.clock.advance(runs.RUN_LEASE_MS + 5 * 60_000)
        await both.died.beat_once()  # alive, its turn still in the model
        recovery = await both.recorded()
        both.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await drain(recovery) == 1
        assert await both.transcript() == [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await both.runs_left() == 0


async def test_two_recoverers_record_a_dead_processs_plain_turn_once(
    migrated_url: str,
) -> None:
    """Two replicas' recoveries search the gone process at once: one run recorded."""
    async with pair(migrated_url) as both, held(both, "hi"):
        await both.dies()
        async with served_app(migrated_url, clock=both.clock) as (third, _client):
            now = both.survivor.clock.now_ms()
            found = await asyncio.gather(
                runs.record_taken(both.survivor.db, both.survivor.ids, now),
                runs.record_taken(third.db, third.ids, now),
            )
            assert sorted(found) == [0, 1]
            assert await both.runs_left() == 1


async def test_a_dead_processs_plain_turn_with_a_later_message_is_not_rerun(
    migrated_url: str,
) -> None:
    """The client sent the message again (an OpenAI client retries a cut turn: a new
    message) before recovery looked: that turn answered, nothing is recorded."""
    async with pair(migrated_url) as both, held(both, "hi"):
        assert await both.chat(both.survivor_client, "hi") == 200
        await both.dies()
        assert await runs.record_taken(both.survivor.db, both.survivor.ids, 0) == 0
        assert await drain(TurnRecovery(both.survivor.turns)) == 0
        assert await both.transcript() == [
            *EARLIER,
            ("user", "hi"),
            ("user", "hi"),
            ("assistant", "Echo: hi"),
        ]


async def test_a_plain_turn_answered_502_is_not_rerun_after_its_process_died(
    migrated_url: str,
) -> None:
    """Its model failed and its client was told so (502): it ended on purpose, and its
    process's death later does not make recovery answer it."""
    async with pair(migrated_url) as both:
        both.gate.failure = ModelError("the model failed")
        both.gate.release.set()
        assert await both.chat(both.died_client, "hi") == 502
        await both.dies()
        assert await runs.record_taken(both.survivor.db, both.survivor.ids, 0) == 0
        assert await drain(TurnRecovery(both.survivor.turns)) == 0
        assert await both.transcript() == [*EARLIER, ("user", "hi")]


async def test_a_plain_mcp_tool_call_whose_process_died_mid_model_call_is_answered_once(
    migrated_url: str,
) -> None:
    """The same through the official ``mcp`` client: a plain worker's
    ``send_action_agent_message`` call whose process dies while its turn waits for the
    model. An MCP client never sends the message again: the other process's recovery
    reruns it after the resend wait, and the transcript holds one answer."""
    async with (
        pair(migrated_url) as both,
        mcp_client(both.died_client, both.key, "2026-07-28") as mcp,
    ):
        calls = both.gate.calls
        call = asyncio.create_task(
            mcp.call_tool(TOOL, {"agent": "plain", "message": "hi", "session": "s"})
        )
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            recovery = await both.recorded()
            both.clock.advance(runs.RESEND_GRACE_MS + 1)
            assert await drain(recovery) == 1
            assert await both.transcript() == [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
            assert await both.runs_left() == 0
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)


def official(both: Pair, client: Client) -> AsyncOpenAI:
    """The official ``openai`` client through ``client`` (no retries of its own)."""
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=both.key, max_retries=0)


@pytest.mark.parametrize("retry", ["in-the-wait", "after-the-rerun", "before-the-search"])
async def test_a_keyed_rest_turn_whose_process_died_gives_its_retry_one_answer(
    migrated_url: str, retry: str
) -> None:
    """A plain worker's REST request with an ``Idempotency-Key`` (the official client)
    whose process died while its turn waited for the model. Recovery's search records
    its run under the key's event id (the message's inbound event), so that the key's
    retry, once the key's claim lapsed:
    - in the run's wait for a resend, takes the run and runs the turn from the stored
      message (one answer, the retry's, and nothing left to rerun);
    - after the rerun, gets the rerun's answer, stored under the key.
    It was 409 ``idempotency.lost`` both times (the run held no event id: the retry
    found no run, and the rerun's answer was stored under no key), the rerun's answer
    in a transcript the client was told to read. A retry before the search found the
    message is told the answer was lost, as before; the rerun's answer is then stored
    over that, and the next retry gets it."""
    ask = keyed("k", "s", "plain", "hi")
    async with pair(migrated_url) as both, official(both, both.died_client) as first:
        calls = both.gate.calls
        request = asyncio.ensure_future(answer_of(first, **ask))
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            await both.dies()
            recovery = TurnRecovery(both.survivor.turns)
            async with official(both, both.survivor_client) as client:
                both.clock.advance(30_000)
                if retry == "before-the-search":
                    both.clock.advance(LEASE_MS - 30_000 + 1)  # the key's claim lapsed
                    lost = await answer_of(client, **ask)
                    assert lost.status_code == 409, lost.text
                    assert lost.json()["error"]["rule"] == "idempotency.lost"
                assert await drain(recovery) == 1  # recorded, left to wait for a resend
                if retry == "after-the-rerun":
                    both.clock.advance(runs.RESEND_GRACE_MS + 1)
                    assert await drain(recovery) == 1
                elif retry == "in-the-wait":
                    both.clock.advance(LEASE_MS - 30_000 + 1)  # the key's claim lapsed
                    answer = await answer_of(client, **ask)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["message"]["content"] == "Echo: hi"
                else:
                    both.clock.advance(runs.RESEND_GRACE_MS + 1)
                    assert await drain(recovery) == 1  # rerun
                both.clock.advance(runs.RESEND_GRACE_MS + 1)
                assert await drain(recovery) == 0  # nothing left to rerun
                again = await answer_of(client, **ask)
            assert again.status_code == 200, again.text
            assert again.headers["Idempotent-Replayed"] == "true"
            assert again.json()["choices"][0]["message"]["content"] == "Echo: hi"
            assert await both.transcript() == [
                *EARLIER,
                ("user", "hi"),
                ("assistant", "Echo: hi"),
            ]
            assert await both.runs_left() == 0
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)


@pytest.mark.parametrize("noticed", [True, False], ids=["registered-anew", "beat-not-yet"])
async def test_a_plain_turn_whose_process_was_only_thought_dead_is_answered_once(
    migrated_url: str, noticed: bool
) -> None:
    """``died`` is alive, only thought dead (its heartbeat lapsed while its turn waited
    for the model: a partition, a starved loop) and reaped: the survivor's recovery
    records the message's run and leaves it to wait for a resend. Then ``died``'s turn
    stores its answer (200), after its process registered anew, or before its next
    beat noticed (its last beat older than ``dead_after``): that transaction takes the
    run back, and the wait's end finds nothing to rerun. It was rerun (its looks count
    later user messages only) and the message answered twice."""
    async with pair(migrated_url) as both:
        calls = both.gate.calls
        request = asyncio.ensure_future(both.chat(both.died_client, "hi"))
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            if not noticed:
                both.clock.advance(both.died.liveness.dead_after_ms + 1)
            recovery = await both.recorded()
            assert await both.runs_left() == 1
            if noticed:
                await both.died.liveness.beat()  # its row gone: registered anew
            both.gate.release.set()
            assert await request == 200
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        answered = [*EARLIER, ("user", "hi"), ("assistant", "slow answer")]
        assert await both.transcript() == answered
        assert await both.runs_left() == 0
        both.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await drain(recovery) == 0
        assert await both.transcript() == answered


async def test_a_rerun_in_flight_when_the_thought_dead_processs_turn_answers_rolls_back(
    migrated_url: str,
) -> None:
    """The same, the survivor's rerun already waiting for its model when ``died``'s
    turn stores its answer (registered anew): that turn took the run back, so the
    rerun's fenced last transaction finds its run gone and rolls its answer back. One
    answer, ``died``'s; the rerun's was stored beside it."""
    rerun_model = GateProvider()
    rerun_model.release.set()  # (it answers the opening exchange)
    async with pair(migrated_url, rerun_model) as both:
        rerun_model.release.clear()
        opened = rerun_model.calls
        calls = both.gate.calls
        request = asyncio.ensure_future(both.chat(both.died_client, "hi"))
        rerun: asyncio.Future[int] | None = None
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            recovery = await both.recorded()
            both.clock.advance(runs.RESEND_GRACE_MS + 1)
            rerun = asyncio.ensure_future(drain(recovery))
            await eventually(lambda: rerun_model.calls > opened, what="the rerun's model called")
            await both.died.liveness.beat()  # its row gone: registered anew
            both.gate.release.set()
            assert await request == 200
            rerun_model.release.set()
            await rerun
        finally:
            for pending in (request, rerun):
                if pending is not None:
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
        answered = [
            ("user", "first"),
            ("assistant", "slow answer"),
            ("user", "hi"),
            ("assistant", "slow answer"),
        ]
        assert await both.transcript() == answered
        assert await both.runs_left() == 0
        assert await drain(recovery) == 0


async def test_a_thought_dead_processs_plain_turn_answered_502_is_not_rerun(
    migrated_url: str,
) -> None:
    """``died`` is only thought dead while its turn waits for the model: the survivor's
    recovery records the message's run. Then the model fails and the client is told so
    (502): that turn ended on purpose, and its failure path takes the recorded run back
    as an answer's last transaction does, so the wait's end finds nothing to rerun. It
    was rerun a minute on, an answer stored after the 502 the client was given."""
    async with pair(migrated_url) as both:
        both.gate.failure = ModelError("the model failed")
        calls = both.gate.calls
        request = asyncio.ensure_future(both.chat(both.died_client, "hi"))
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            recovery = await both.recorded()
            await both.died.liveness.beat()  # its row gone: registered anew
            both.gate.release.set()
            assert await request == 502
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        assert await both.runs_left() == 0
        both.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await drain(recovery) == 0
        assert await both.transcript() == [*EARLIER, ("user", "hi")]


async def test_a_dead_processs_plain_turn_is_rerun_when_another_turns_answer_came_after_it(
    migrated_url: str,
) -> None:
    """Two plain turns of one session in flight (parallel MCP tool calls, REST calls
    without ``user``): "a" through the survivor, "b" through ``died``, then "a"'s answer,
    stored after "b" was taken in. ``died`` dies: that answer names "a"
    (``messages.answers``), so "b" is still unanswered, recorded and rerun. It was taken
    for answered (any message after it counted) and never answered."""
    theirs = GateProvider()
    theirs.release.set()  # (it answers the opening exchange)
    async with pair(migrated_url, theirs) as both:
        theirs.release.clear()
        opened = theirs.calls
        first = asyncio.ensure_future(both.chat(both.survivor_client, "a"))
        try:
            await eventually(lambda: theirs.calls > opened, what="a's model called")
            async with held(both, "b"):
                theirs.release.set()
                assert await first == 200  # "a" answered after "b" was taken in
                await both.dies()
            recovery = TurnRecovery(both.survivor.turns)
            assert await drain(recovery) == 1  # "b" recorded, left to wait for a resend
            both.clock.advance(runs.RESEND_GRACE_MS + 1)
            assert await drain(recovery) == 1
        finally:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        assert await both.transcript() == [
            ("user", "first"),
            ("assistant", "slow answer"),
            ("user", "a"),
            ("user", "b"),
            ("assistant", "slow answer"),
            ("assistant", "slow answer"),
        ]
        assert await both.runs_left() == 0


async def test_a_thought_dead_processs_turn_after_its_rerun_committed_stores_no_second_answer(
    migrated_url: str,
) -> None:
    """``died`` only thought dead: the survivor's recovery records its message, waits,
    and reruns it to the end (its answer, naming the message, committed) while
    ``died``'s turn still waits for its model. That turn then stores no answer of its
    own, and its request gets the rerun's: one answer in the transcript, the one its
    client got. Both stood."""
    async with pair(migrated_url) as both:
        calls = both.gate.calls
        request = asyncio.ensure_future(
            both.died_client.post(
                "/v1/chat/completions",
                json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {both.key}", "X-Session-Id": "s"},
            )
        )
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            recovery = await both.recorded()
            both.clock.advance(runs.RESEND_GRACE_MS + 1)
            assert await drain(recovery) == 1  # rerun: "Echo: hi" stored
            await both.died.liveness.beat()  # its row gone: registered anew
            both.gate.release.set()
            resp = await request
            assert resp.status == 200
            body = await resp.json()
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        assert body["choices"][0]["message"]["content"] == "Echo: hi"
        assert await both.transcript() == [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await both.runs_left() == 0
        assert await drain(recovery) == 0


async def test_a_rerun_ends_unanswered_when_the_thought_dead_processs_turn_answered_unaware(
    migrated_url: str,
) -> None:
    """``died`` is reaped while its turn waits for the model, and does not know it yet
    (its own last beat is recent by its clock: a reaper's clock ahead, or its answer's
    statement held past the reap), so its turn stores its answer as any, taking back
    nothing. The survivor's rerun, due a minute on, finds that answer naming the
    message and ends unanswered, its run closed: one answer. It looked for later user
    messages only, and answered the message a second time."""
    async with pair(migrated_url) as both:
        async with held(both, "hi"):
            recovery = await both.recorded()
            assert not both.died.liveness.maybe_reaped(str(both.died.liveness.id))
            both.gate.release.set()

            async def answered() -> bool:
                return (await both.transcript())[-1] == ("assistant", "slow answer")

            await eventually(answered, what="died's turn's answer stored")
        both.clock.advance(runs.RESEND_GRACE_MS + 1)
        assert await drain(recovery) == 1  # claimed, and closed unanswered
        assert await both.transcript() == [*EARLIER, ("user", "hi"), ("assistant", "slow answer")]
        assert await both.runs_left() == 0


async def key_lapses(both: Pair) -> None:
    """The ``Idempotency-Key`` claim of ``died``'s request lapses in the database (no
    renewal came: a partition), so the next request takes the key over. (The clock is
    not moved: ``died`` does not know it was reaped unless a test says so.)"""
    async with both.survivor.db.tx() as conn:
        await conn.execute(
            t.idempotency_keys.update().values(lease_expires_at=both.clock.now_ms() - 1)
        )


async def test_a_keyed_retry_runs_no_second_turn_for_a_message_its_process_answered_unaware(
    migrated_url: str,
) -> None:
    """``died`` is reaped while its keyed turn waits for the model, without knowing it:
    recovery's search records the message's run under the key's event id, and ``died``'s
    turn stores its answer (and the key's) taking nothing back. A retry that took the
    key over before that answer committed then claims the run (``claim_for_retry``): it
    finds the answer naming the message, closes the run and runs no turn (its route
    replays the key's answer). It took the run (it looked for later user messages only)
    and ran the turn: the message answered twice, the key's answer replaced."""
    ask = keyed("k", "s", "plain", "hi")
    async with pair(migrated_url) as both, official(both, both.died_client) as first:
        calls = both.gate.calls
        request = asyncio.ensure_future(answer_of(first, **ask))
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            await both.recorded()
            assert not both.died.liveness.maybe_reaped(str(both.died.liveness.id))
            both.gate.release.set()
            answer = await request
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        assert answer.status_code == 200, answer.text
        async with both.survivor.db.read() as conn:
            run = (await conn.execute(sa.select(t.turn_runs))).one()
        retry = Trigger(
            org_id=run.org_id,
            agent_id="plain",
            session_key="h:s",
            text="hi",
            binding=BindingSpec(BindingKind.api),
            external_event_id=run.external_event_id,
        )
        outcome = await both.survivor.turns.run(retry, retake=True)
        assert isinstance(outcome, Duplicate) and not outcome.running, outcome
        answered = [*EARLIER, ("user", "hi"), ("assistant", "slow answer")]
        assert await both.transcript() == answered
        assert await both.runs_left() == 0
        async with official(both, both.survivor_client) as client:
            again = await answer_of(client, **ask)
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.content == answer.content


@pytest.mark.parametrize("order", ["died-first", "died-first-unaware", "retry-first"])
async def test_a_keyed_retrys_takeover_beside_the_thought_dead_processs_own_turn(
    migrated_url: str, order: str
) -> None:
    """``died`` is only thought dead while its keyed turn waits for the model; recovery's
    search records its run, and the key's retry (the official client, through the
    survivor) takes that run over in its wait and runs the turn, held in its own model
    call. Then both turns end, ``died``'s first (knowing it was reaped: registered anew;
    or not knowing it yet) or the retry's. The message is answered once in the
    transcript, and every request of the key gets that answer: the first one's turn to
    end stores it, the other stores none and answers the stored text. ``died`` first,
    the retry's fenced end found its run taken back and the retry got 409 ``run`` ("taken
    over by another process", no retry); ``died`` unaware, the retry stored a second
    answer (its request and the key's replay another text than ``died``'s client got)."""
    theirs = GateProvider("retry answer")
    theirs.release.set()  # (it answers the opening exchange)
    ask = keyed("k", "s", "plain", "hi")
    async with pair(migrated_url, theirs) as both, official(both, both.died_client) as first:
        theirs.release.clear()
        opened = theirs.calls
        calls = both.gate.calls
        request = asyncio.ensure_future(answer_of(first, **ask))
        retry: asyncio.Future[httpx2.Response] | None = None
        try:
            await eventually(lambda: both.gate.calls > calls, what="the model called")
            await both.recorded()
            await key_lapses(both)
            async with official(both, both.survivor_client) as client:
                retry = asyncio.ensure_future(answer_of(client, **ask))
                await eventually(lambda: theirs.calls > opened, what="the retry's model called")
                if order == "retry-first":
                    theirs.release.set()
                    await retry
                if order != "died-first-unaware":
                    await both.died.liveness.beat()  # its row gone: registered anew
                both.gate.release.set()
                await request
                theirs.release.set()
                answers = [await request, await retry]
                again = await answer_of(client, **ask)
        finally:
            for pending in (request, retry):
                if pending is not None:
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
        text = "retry answer" if order == "retry-first" else "slow answer"
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == text
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["choices"][0]["message"]["content"] == text
        assert (await both.transcript())[-2:] == [("user", "hi"), ("assistant", text)]
        assert await both.runs_left() == 0


class _FaultsOnA(GateProvider):
    """``died``'s model: message "a"'s turn meets a database fault at once (its process
    owes it a run: :attr:`TurnService.owed <leadgate.turns.path.TurnService.owed>`);
    any other is held as :class:`~tests.fakes.GateProvider` holds it."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if request.messages[-1].content == "a":
            raise Unavailable("database is locked", rule="service.unavailable")
        async for event in super().stream(request):
            yield event


@pytest.mark.parametrize("moved_ms", [0, 1_000], ids=["same-clock", "clock-moved"])
async def test_a_rerun_of_two_runs_rolls_back_when_the_thought_dead_processs_turn_took_one_back(
    migrated_url: str, moved_ms: int
) -> None:
    """``died`` takes in "b" (its turn held in the model) and is reaped: the survivor's
    recovery records "b"'s run. ``died``, registered anew, takes in "a", whose turn meets
    a database fault (503: its run is owed and recorded), and is reaped again: the
    survivor reruns both runs under one lease, its answer naming "a" (the newest). While
    that rerun waits for its model, ``died`` (registered anew) answers "b", taking "b"'s
    run back. The rerun's last transaction finds no answer naming "a", and its delete
    finds "a"'s run only: it rolls its answer back (it answered "b" too, answered
    already), and the next claim reruns "a" alone, shown "b"'s answer. Its fenced end
    checked only that some run was deleted, and "b" was answered twice."""
    rerun_model = GateProvider("rerun answer")
    rerun_model.release.set()  # (it answers the opening exchange)
    async with pair(migrated_url, rerun_model, _FaultsOnA()) as both:
        rerun_model.release.clear()
        calls = both.gate.calls
        request = asyncio.ensure_future(both.chat(both.died_client, "b"))
        rerun: asyncio.Future[int] | None = None
        try:
            await eventually(lambda: both.gate.calls > calls, what="b's model called")
            recovery = await both.recorded()
            await both.died.liveness.beat()  # its row gone: registered anew
            # "a"'s run is stamped with its intake's clock reading, "b"'s (recorded by the
            # search) with its message's time, which PostgreSQL keeps after the session's
            # last: unmoved, "b"'s run is the later one, yet "a" is the newest message.
            both.clock.advance(moved_ms)
            assert await both.chat(both.died_client, "a") == 503
            await both.died.turns.record_owed()
            assert await both.runs_left() == 2
            await both.dies()
            both.clock.advance(runs.RESEND_GRACE_MS + 1)
            opened = rerun_model.calls
            rerun = asyncio.ensure_future(drain(recovery))
            await eventually(lambda: rerun_model.calls > opened, what="the rerun's model called")
            await both.died.liveness.beat()  # its row gone: registered anew
            both.gate.release.set()
            assert await request == 200  # "b" answered, its run taken back
            rerun_model.release.set()
            await rerun
        finally:
            for pending in (request, rerun):
                if pending is not None:
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
        # Rolled back, and "a" rerun alone by the drain's next claim: shown "b"'s answer.
        assert rerun_model.calls == opened + 2
        assert await both.transcript() == [
            ("user", "first"),
            ("assistant", "rerun answer"),
            ("user", "b"),
            ("user", "a"),
            ("assistant", "slow answer"),
            ("assistant", "rerun answer"),
        ]
        assert await both.runs_left() == 0
