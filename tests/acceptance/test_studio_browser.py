"""Studio (SPEC 13) in headless Chromium (Playwright) against the real ``leadgate serve``:
a Member signs in, chats with an agent on the ``studio`` binding; a plain reply appears
at once; a gated turn shows "pending review", and after the operator approves, the
approved answer replaces it in place through the events stream, without a reload."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, Route, async_playwright, expect

from tests.service_proc import DemoTemplate, ServiceProcess, start_from_template

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
PASSWORD = "correct horse battery"
MEMBER = "studio-member@example.com"
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def svc(
    demo_template: DemoTemplate, tmp_path_factory: pytest.TempPathFactory, service_guard: Any
) -> Iterator[ServiceProcess]:
    proc = start_from_template(demo_template, tmp_path_factory.mktemp("studio"))
    with service_guard(proc):
        assert proc.demo is not None
        proc.admin(
            "user", "create", "--org", proc.demo.org, "--email", MEMBER,
            "--role", "Member", "--password", PASSWORD,
        )  # fmt: skip
        yield proc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1100, "height": 900})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def sign_in_and_open(page: Page, svc: ServiceProcess, agent: str, session: str) -> None:
    await page.goto(f"{svc.url}/console/studio/")
    await page.get_by_label("Email").fill(MEMBER)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Log in").click()
    await expect(page.locator("#chat-view")).to_be_visible()
    await page.get_by_label("Agent", exact=True).select_option(agent)
    await page.get_by_label("Session", exact=True).fill(session)
    await page.get_by_role("button", name="Open").click()
    await expect(page.locator("#link")).to_have_text("live")


async def say(page: Page, text: str) -> None:
    await page.get_by_label("Message", exact=True).fill(text)
    await page.get_by_role("button", name="Send").click()


async def approve_held(svc: ServiceProcess, marker: str) -> None:
    """Operator approval of the awaitingHuman item whose task holds ``marker``."""
    assert svc.demo is not None
    auth = {"Authorization": f"Bearer {svc.demo.key}"}
    async with httpx2.AsyncClient(base_url=svc.url, headers=auth, timeout=TIMEOUT) as http:
        for _ in range(int(TIMEOUT / 0.1)):
            for item in (await http.get("/operator/reviews")).json()["items"]:
                detail = (await http.get(f"/operator/reviews/{item['id']}")).json()
                if marker in detail["taskContext"]:
                    resp = await http.post(f"/operator/reviews/{item['id']}/approve")
                    assert resp.status_code == 200, resp.text
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"no item waiting with {marker!r}")


async def test_plain_reply_appears_at_once(page: Page, svc: ServiceProcess) -> None:
    await sign_in_and_open(page, svc, "plain", f"st-{uuid.uuid4().hex[:8]}")
    await say(page, "hello studio")
    transcript = page.locator("#transcript li")
    await expect(transcript).to_have_text(["hello studio", "Echo: hello studio"])
    # Rendered once each, even though the reply came both in the answer and the stream.
    await asyncio.sleep(0.5)
    await expect(transcript).to_have_count(2)


async def test_held_turn_is_pending_then_the_approved_answer_in_place(
    page: Page, svc: ServiceProcess, tmp_path: Path
) -> None:
    session = f"st-{uuid.uuid4().hex[:8]}"
    marker = f"write it {session} #escalate #complete"
    await sign_in_and_open(page, svc, "worker", session)
    await say(page, marker)
    bubbles = page.locator("#transcript li")
    await expect(bubbles).to_have_text([marker, "pending review"])
    # A message refused while the turn is held leaves the transcript and goes back into
    # the box (nothing was stored), with the reason shown until the review is over.
    await say(page, "another one while pending")
    await expect(page.locator("#error")).to_contain_text("under review")
    await expect(bubbles).to_have_text([marker, "pending review"])
    await expect(page.get_by_label("Message", exact=True)).to_have_value(
        "another one while pending"
    )
    held = bubbles.nth(1)
    handle = await held.element_handle()
    assert handle is not None
    await page.screenshot(path=tmp_path / "studio-pending.png")
    await approve_held(svc, session)
    # The same element now holds the approved answer: revealed in place, no reload.
    await expect(held).to_have_text(f"Echo: {marker}", timeout=TIMEOUT * 1000)
    await expect(bubbles).to_have_count(2)
    await expect(page.locator("#error")).to_be_hidden()
    assert await handle.text_content() == f"Echo: {marker}"
    assert await page.evaluate("performance.getEntriesByType('navigation').length") == 1
    await page.screenshot(path=tmp_path / "studio-approved.png")
    # Reloading renders the same session from its event log.
    await page.reload()
    await expect(page.locator("#chat-view")).to_be_visible()
    await page.get_by_label("Agent", exact=True).select_option("worker")
    await page.get_by_label("Session", exact=True).fill(session)
    await page.get_by_role("button", name="Open").click()
    await expect(bubbles).to_have_text([marker, f"Echo: {marker}"])


async def test_a_turn_that_fails_after_its_message_was_taken_in_is_not_offered_again(
    page: Page, svc: ServiceProcess
) -> None:
    """The page treated every error as "refused, nothing stored": a model failure (502)
    took the message out of the transcript and put it back in the box, so the person
    sent it again and the worker got it twice. The message stays; the box stays empty."""
    session = f"st-{uuid.uuid4().hex[:8]}"
    await sign_in_and_open(page, svc, "plain", session)
    await say(page, "boom #fail")
    await expect(page.locator("#error")).to_contain_text("#fail requested a runtime error")
    bubbles = page.locator("#transcript li.user")
    await expect(bubbles).to_have_text(["boom #fail"])
    await expect(page.get_by_label("Message", exact=True)).to_have_value("")
    # The transcript agrees: it was stored once.
    await page.reload()
    await expect(page.locator("#chat-view")).to_be_visible()
    await page.get_by_label("Agent", exact=True).select_option("plain")
    await page.get_by_label("Session", exact=True).fill(session)
    await page.get_by_role("button", name="Open").click()
    await expect(bubbles).to_have_text(["boom #fail"])


async def test_a_message_that_may_have_been_taken_in_is_not_offered_again(
    page: Page, svc: ServiceProcess
) -> None:
    """503 ``intake.in_doubt`` (the database went away as the message's intake committed,
    and could not be read back) says the message may have been taken in: the page keeps
    it and leaves the box empty, as for ``turn.interrupted``; it put the text back to be
    sent again, twice if it had landed. The answer is made in the browser (the served
    process cannot be made to lose a COMMIT's answer from here)."""
    session = f"st-{uuid.uuid4().hex[:8]}"
    await sign_in_and_open(page, svc, "plain", session)
    said = "the message may have been taken in; look for it in the transcript"

    async def in_doubt(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        error = {"message": said, "type": "service_unavailable", "code": None}
        await route.fulfill(
            status=503,
            content_type="application/json",
            headers={"x-should-retry": "false"},
            body=json.dumps({"error": {**error, "rule": "intake.in_doubt"}}),
        )

    await page.route("**/messages", in_doubt)
    await say(page, "maybe once")
    await expect(page.locator("#error")).to_contain_text(said)
    await expect(page.locator("#transcript li.user")).to_have_text(["maybe once"])
    await expect(page.get_by_label("Message", exact=True)).to_have_value("")


async def test_a_message_whose_answer_was_lost_is_not_offered_again(
    page: Page, svc: ServiceProcess
) -> None:
    """The connection drops after the message reached the service (it was stored, the
    reply made), before the answer reached the page. The page took any error without a
    status for "refused, nothing stored" and put the text back in the box, to be sent a
    second time. Now it stays in the transcript, the box stays empty, and the stream
    shows the message once, with its reply."""
    session = f"st-{uuid.uuid4().hex[:8]}"
    await sign_in_and_open(page, svc, "plain", session)

    async def lost(route: Route) -> None:
        if route.request.method != "POST":
            await route.continue_()
            return
        await route.fetch()  # the service takes it in and answers...
        await route.abort("connectionreset")  # ...and the page never sees the answer

    await page.route("**/messages", lost)
    await say(page, "only once please")
    await expect(page.locator("#error")).to_contain_text("may have been taken in")
    await expect(page.get_by_label("Message", exact=True)).to_have_value("")
    await expect(page.locator("#transcript li")).to_have_text(
        ["only once please", "Echo: only once please"]
    )


async def test_a_message_goes_to_the_session_the_transcript_shows(
    page: Page, svc: ServiceProcess
) -> None:
    """A session name typed without Open: the message went to that session while the
    transcript (and its stream) showed the one opened before, and a message written
    before any Open had no stream at all, so a held answer never appeared. Sending now
    opens the session named first."""
    first, second = (f"st-{uuid.uuid4().hex[:8]}" for _ in range(2))
    await sign_in_and_open(page, svc, "plain", first)
    await say(page, "in the first")
    bubbles = page.locator("#transcript li")
    await expect(bubbles).to_have_text(["in the first", "Echo: in the first"])
    await page.get_by_label("Session", exact=True).fill(second)
    await say(page, "in the second")
    await expect(bubbles).to_have_text(["in the second", "Echo: in the second"])
    await expect(page.locator("#link")).to_have_text("live")


async def test_a_held_answer_appears_when_the_message_was_sent_without_open(
    page: Page, svc: ServiceProcess
) -> None:
    session = f"st-{uuid.uuid4().hex[:8]}"
    marker = f"write it {session} #escalate #complete"
    await page.goto(f"{svc.url}/console/studio/")
    await page.get_by_label("Email").fill(MEMBER)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Log in").click()
    await expect(page.locator("#chat-view")).to_be_visible()
    await page.get_by_label("Agent", exact=True).select_option("worker")
    await page.get_by_label("Session", exact=True).fill(session)
    await say(page, marker)  # no Open
    bubbles = page.locator("#transcript li")
    await expect(bubbles).to_have_text([marker, "pending review"])
    await approve_held(svc, session)
    await expect(bubbles).to_have_text([marker, f"Echo: {marker}"], timeout=TIMEOUT * 1000)


async def test_a_stream_ended_by_the_service_is_not_taken_for_a_logout(
    page: Page, svc: ServiceProcess
) -> None:
    """The session's stream ends with ``event: end`` when the console session ends, and
    also when the service cannot go on (a damaged database file). The page took every
    end for a logout and showed the login form to a person still logged in. (The end is
    made by the page's route: the served process's database cannot be damaged from
    here.)"""
    said = "the database file is damaged; an operator must repair it"
    await sign_in_and_open(page, svc, "plain", f"st-{uuid.uuid4().hex[:8]}")

    async def ended(route: Route) -> None:
        body = f"event: end\ndata: {json.dumps({'reason': said})}\n\n"
        await route.fulfill(status=200, content_type="text/event-stream", body=body)

    await page.route("**/events", ended)
    await page.get_by_role("button", name="Open").click()
    await expect(page.locator("#error")).to_contain_text(said)
    await expect(page.locator("#login-view")).to_be_hidden()
    await expect(page.locator("#link")).to_have_text("disconnected: open the session again")


async def test_a_console_session_logged_out_elsewhere_shows_the_login_form(
    page: Page, svc: ServiceProcess
) -> None:
    await sign_in_and_open(page, svc, "plain", f"st-{uuid.uuid4().hex[:8]}")
    cookie = next(c for c in await page.context.cookies() if c["name"] == "leadgate_session")
    async with httpx2.AsyncClient(base_url=svc.url, timeout=TIMEOUT) as http:
        resp = await http.post(
            "/console/logout",
            headers={"Cookie": f"leadgate_session={cookie['value']}", "X-Leadgate-Console": "1"},
        )
        assert resp.status_code == 200
    await expect(page.locator("#login-view")).to_be_visible(timeout=TIMEOUT * 1000)
    await expect(page.locator("#error")).to_contain_text("Your console session has ended")
