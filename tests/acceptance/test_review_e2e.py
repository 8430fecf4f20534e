"""Lead review end to end through the real service process (``leadgate serve``).

A gated REST turn is reviewed in the background by the ``script`` lead and revealed; an
escalated one waits in the operator queue until a human decides over the operator API,
and the session takes new messages again afterwards. Work item ids are not public: the
tests find them through Agent Activity (``GET /operator/activity``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.acceptance.pending_bodies import PENDING
from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def proc(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, service_guard: Any
) -> Iterator[ServiceProcess]:
    # Default settings: the runners are woken by commits and decisions, not by polling.
    svc = start_from_template(demo_template, tmp_path_factory.mktemp("review-e2e"))
    with service_guard(svc):
        yield svc


@pytest.fixture
async def http(proc: ServiceProcess) -> AsyncIterator[aiohttp.ClientSession]:
    assert proc.demo is not None
    async with aiohttp.ClientSession(
        base_url=proc.url,
        headers={"Authorization": f"Bearer {proc.demo.key}"},
        timeout=aiohttp.ClientTimeout(total=TIMEOUT),
    ) as session:
        yield session


@pytest.fixture
async def client(proc: ServiceProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    assert proc.demo is not None
    # No SDK retries: a 409 must be seen as the service sent it.
    async with openai.AsyncOpenAI(
        base_url=f"{proc.url}/v1", api_key=proc.demo.key, max_retries=0, timeout=TIMEOUT
    ) as sdk:
        yield sdk


async def ask(client: openai.AsyncOpenAI, session: str, text: str) -> Any:
    return await client.chat.completions.create(
        model="worker",
        messages=[{"role": "user", "content": text}],
        extra_headers={"X-Session-Id": session},
    )


async def pending(client: openai.AsyncOpenAI, session: str, text: str) -> dict[str, Any]:
    with pytest.raises(openai.ConflictError) as err:
        await ask(client, session, text)
    body = err.value.response.json()
    assert body["error"]["code"] == "LEAD_REVIEW_PENDING"
    assert body["error"]["message"] == PENDING
    return dict(body["error"])


async def get(http: aiohttp.ClientSession, path: str) -> Any:
    async with http.get(path) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def find_item(http: aiohttp.ClientSession, known: set[str]) -> str:
    """The id of the one work item Agent Activity shows that ``known`` does not hold."""
    activity = await get(http, "/operator/activity")
    fresh = [i["id"] for i in activity["items"] if i["id"] not in known]
    assert len(fresh) == 1, activity
    return str(fresh[0])


async def known_items(http: aiohttp.ClientSession) -> set[str]:
    return {i["id"] for i in (await get(http, "/operator/activity"))["items"]}


async def wait_for(http: aiohttp.ClientSession, item_id: str, status: str) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for _ in range(int(TIMEOUT / 0.05)):
        body = await get(http, f"/operator/reviews/{item_id}")
        if body["status"] == status:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"work item never reached {status}: {body}")


def sid() -> str:
    return f"e2e-{uuid.uuid4().hex[:12]}"


async def test_a_gated_turn_is_approved_in_the_background_and_revealed(
    client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    session = sid()
    before = await known_items(http)
    error = await pending(client, session, "Write the release notes #complete")
    assert (error["workItemId"], error["revision"]) == (None, None)
    item_id = await find_item(http, before)

    body = await wait_for(http, item_id, "completed")
    assert body["taskContext"] == "Write the release notes #complete"
    assert body["summary"] == "Summary: Write the release notes"
    assert body["snapshot"] == "Echo: Write the release notes #complete"
    assert [(d["status"], d["channel"]) for d in body["deliveries"]] == [("sent", "api")]
    assert [a["action"] for a in body["audit"]] == [
        "create",
        "completeTask",
        "claim",
        "approve",
        "delivered",
    ]
    # Never in the actionable queue; the session takes new work.
    queue = await get(http, "/operator/reviews")
    assert item_id not in {i["id"] for i in queue["items"]}
    reply = await ask(client, session, "Thanks!")
    assert reply.choices[0].message.content == "Echo: Thanks!"


async def test_an_escalated_turn_waits_for_a_human_decision(
    client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    session = sid()
    before = await known_items(http)
    await pending(client, session, "Refund the customer #escalate #complete")
    item_id = await find_item(http, before)
    body = await wait_for(http, item_id, "awaitingHuman")
    assert body["audit"][-1]["action"] == "escalate"

    queue = await get(http, "/operator/reviews")
    [entry] = [i for i in queue["items"] if i["id"] == item_id]
    assert (entry["status"], entry["agent"]["name"], entry["revision"]) == (
        "awaitingHuman",
        "worker",
        0,
    )
    # Busy while a human decides: the same 409, without workItemId and revision.
    busy = await pending(client, session, "Any news?")
    assert "workItemId" not in busy and "revision" not in busy

    # Return to the worker: it revises in the background; the script lead escalates again
    # (the task context still says #escalate).
    async with http.post(
        f"/operator/reviews/{item_id}/return", json={"feedback": "Check the order total."}
    ) as resp:
        assert resp.status == 200
        returned = await resp.json()
    assert (returned["status"], returned["revision"]) == ("inProgress", 1)
    body = await wait_for(http, item_id, "awaitingHuman")
    assert body["revision"] == 1
    assert body["snapshot"] == "Revised: Check the order total."

    async with http.post(f"/operator/reviews/{item_id}/approve") as resp:
        assert resp.status == 200
        approved = await resp.json()
    assert approved["id"] == item_id
    assert approved["status"] in ("approved", "completed")
    assert approved["audit"][-1]["action"] in ("approve", "delivered")
    async with http.post(f"/operator/reviews/{item_id}/approve") as resp:
        assert resp.status == 409  # decided already
    body = await wait_for(http, item_id, "completed")
    assert [d["status"] for d in body["deliveries"]] == ["sent"]
    queue = await get(http, "/operator/reviews")
    assert item_id not in {i["id"] for i in queue["items"]}

    reply = await ask(client, session, "Next task, please.")
    assert reply.choices[0].message.content == "Echo: Next task, please."
