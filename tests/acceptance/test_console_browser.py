"""The operator console in a real browser (Chromium through Playwright) against the real
app served on 127.0.0.1: log in, the Lead Reviews queue, the review detail, approve ->
delivered -> completed, reject with a reason, markup in a snapshot shown as text, and a
Viewer's role message.

Work items are set up through the real turn path with the built-in ``script`` model
(``#complete #escalate`` -> the lead escalates -> ``awaitingHuman``); the lead runner and
the relay are drained by hand. One browser for the module; a fresh context (no cookies)
per test. Screenshots go to /tmp/console-*.png.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, Dialog, Page, async_playwright, expect

from leadgate.app import App
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.database.db import upgrade
from leadgate.domain import orgs
from outbox.channel import OutboundMessage, SendOutcome, Uncertain
from tests.helpers import Org, api_trigger, make_agent, make_org

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "correct horse battery"
MEMBER = "mia@example.com"
VIEWER = "vic@example.com"
SCREENSHOTS = Path("/tmp")


class TimeoutChannel:
    """A Slack stand-in whose sends time out after the request was written (uncertain)."""

    name = "slack"
    max_chars = 4_000

    async def send(self, message: OutboundMessage) -> SendOutcome:
        return Uncertain("read timeout after the request was written")

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("console-template") / "t.db"
    upgrade(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture
def migrated_url(migrated_template: Path, tmp_path: Path) -> str:
    """SQLite only (this is about the page; tests/integration covers both backends); each
    test gets a copy of one migrated database, which is much faster than migrating."""
    shutil.copyfile(migrated_template, tmp_path / "t.db")
    return f"sqlite+aiosqlite:///{tmp_path}/t.db"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


@dataclass
class Console:
    service: App
    org: Org
    worker: dict[str, Any]
    url: str
    dialogs: list[str] = field(default_factory=list)

    async def awaiting_item(self, message: str, session: str) -> str:
        """A work item escalated by the lead to awaitingHuman."""
        out = await self.service.turns.run(
            api_trigger(self.org, self.worker, f"{message} #complete #escalate", session)
        )
        assert isinstance(out, Gated) and out.work_item_id
        await drain(self.service.lead_runner)
        return out.work_item_id

    async def open(self, page: Page, email: str, role: str, *, login: bool = True) -> None:
        """Create the console user, load the console and log in through the form."""
        async with self.service.db.tx() as conn:
            await orgs.create_user(
                conn, self.service.clock, self.service.ids, self.org.id, email, role, PASSWORD
            )
        page.on("dialog", self._dialog)
        await page.goto(f"{self.url}/console/")
        if login:
            await self.login(page, email, PASSWORD)
            await expect(page.get_by_role("button", name="Log out")).to_be_visible()

    async def login(self, page: Page, email: str, password: str) -> None:
        await page.get_by_label("Email").fill(email)
        await page.get_by_label("Password").fill(password)
        await page.get_by_role("button", name="Log in").click()

    async def _dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(dialog.message)
        await dialog.dismiss()


@pytest_asyncio.fixture(loop_scope="module")
async def console(service: App) -> AsyncIterator[Console]:
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "writer", lead="lead")
    runner = web.AppRunner(service.web_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Console(service, org, worker, f"http://{host}:{port}")
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def test_member_approves_from_the_queue_and_the_item_completes(
    console: Console, page: Page
) -> None:
    item = await console.awaiting_item("draft the launch note", "s1")
    await console.open(page, MEMBER, "Member")

    row = page.locator("#queue tbody tr", has=page.get_by_role("link", name=item))
    await expect(row).to_have_count(1)
    await expect(row).to_contain_text("writer")
    await expect(row).to_contain_text("awaitingHuman")
    await expect(page.locator("#queue thead")).to_contain_text("Reason")
    await page.screenshot(path=SCREENSHOTS / "console-queue.png", full_page=True)

    await page.get_by_role("link", name=item).click()
    await expect(page).to_have_url(re.compile(f"#/review/{item}$"))
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    await expect(page.locator("#summary")).to_have_text("Summary: draft the launch note #escalate")
    await expect(page.locator("#snapshot")).to_contain_text("Echo: draft the launch note")
    await expect(page.locator(".meta")).to_contain_text("requestHumanApproval")
    await expect(page.locator("#audit")).to_contain_text("escalate")
    await page.screenshot(path=SCREENSHOTS / "console-detail.png", full_page=True)

    await page.get_by_role("button", name="Approve").click()
    await expect(page.locator("#detail-status")).to_have_text("approved")
    await expect(page.get_by_role("status")).to_have_text("Approved.")
    await expect(page.locator("#deliveries")).to_contain_text("pending")

    # The relay delivers the approval (api binding: reveal the stored message).
    assert await drain(console.service.relay) >= 1
    await page.reload()
    await expect(page.locator("#detail-status")).to_have_text("completed")
    await expect(page.locator("#deliveries")).to_contain_text("sent")
    await expect(page.get_by_role("button", name="Approve")).to_have_count(0)

    await page.get_by_role("link", name="Lead Reviews").first.click()
    await expect(page.locator("#queue-empty")).to_be_visible()
    assert console.dialogs == []


async def test_member_rejects_with_a_reason_and_server_errors_are_shown(
    console: Console, page: Page
) -> None:
    item = await console.awaiting_item("summarise the contract", "s2")
    await console.open(page, MEMBER, "Member")
    await page.get_by_role("link", name=item).click()
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")

    reason = page.get_by_label(re.compile("Reason for rejecting"))
    await page.get_by_role("button", name="Reject").click()  # empty: the server says no
    await expect(page.get_by_role("alert")).to_have_text("Error: reason is required")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")

    await reason.fill("x" * 2001)
    await expect(page.locator("#reject-count")).to_have_text("2,001 / 2,000")
    await page.get_by_role("button", name="Reject").click()
    await expect(page.get_by_role("alert")).to_contain_text("at most 2,000 characters")

    await reason.fill("The figures in section 2 are wrong.")
    await expect(page.locator("#reject-count")).to_have_text("35 / 2,000")
    await page.get_by_role("button", name="Reject").click()
    await expect(page.locator("#detail-status")).to_have_text("rejected")
    await expect(page.get_by_role("alert")).to_be_hidden()
    await expect(page.locator("#audit")).to_contain_text("The figures in section 2 are wrong.")
    await expect(page.get_by_role("button", name="Reject")).to_have_count(0)


async def test_markup_in_a_snapshot_is_text_and_activity_links_without_the_text(
    console: Console, page: Page
) -> None:
    markup = '<script>alert(1)</script><img src=x onerror="alert(2)"><b>bold</b>'
    item = await console.awaiting_item(markup, "s3")
    await console.open(page, MEMBER, "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#snapshot")).to_contain_text(f"Echo: {markup}")
    await expect(page.locator("#task-context")).to_contain_text(markup)
    injected = await page.evaluate(
        "document.querySelectorAll('#app-view script, #app-view img, #app-view b').length"
    )
    assert injected == 0
    assert console.dialogs == []
    await page.screenshot(path=SCREENSHOTS / "console-markup.png", full_page=True)

    await page.get_by_role("link", name="Agent Activity").click()
    row = page.locator("#activity tbody tr", has=page.get_by_role("link", name=item))
    await expect(row).to_contain_text("awaitingHuman")
    await expect(page.locator("#app-view")).not_to_contain_text("alert(1)")
    await expect(page.locator("#app-view")).not_to_contain_text("Echo:")
    await page.screenshot(path=SCREENSHOTS / "console-activity.png", full_page=True)
    await row.get_by_role("link", name=item).click()
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")

    feedback = page.get_by_label(re.compile("Feedback for the worker"))
    await feedback.fill("Plain text only, please.")
    await page.get_by_role("button", name="Return to worker").click()
    await expect(page.locator("#detail-status")).to_have_text("inProgress")
    await expect(page.locator("#last-feedback")).to_have_text("Plain text only, please.")

    await page.get_by_role("button", name="Log out").click()
    await expect(page.get_by_role("button", name="Log in")).to_be_visible()
    await page.reload()
    await expect(page.get_by_role("button", name="Log in")).to_be_visible()
    assert console.dialogs == []


async def test_a_viewer_is_told_their_role_cannot_review(console: Console, page: Page) -> None:
    await console.awaiting_item("anything", "s4")
    await console.open(page, VIEWER, "Viewer", login=False)
    await console.login(page, VIEWER, "not the password")
    await expect(page.get_by_role("alert")).to_have_text(
        "Error: the email or password is not correct"
    )
    await page.screenshot(path=SCREENSHOTS / "console-login.png")
    await console.login(page, VIEWER, PASSWORD)
    message = page.get_by_role("note")
    await expect(message).to_contain_text("Your role (Viewer) cannot review work items.")
    await expect(page.locator("#queue")).to_have_count(0)
    await page.screenshot(path=SCREENSHOTS / "console-viewer.png", full_page=True)


async def test_an_uncertain_delivery_is_confirmed_from_the_detail(
    console: Console, page: Page
) -> None:
    console.service.relay.channels["slack"] = TimeoutChannel()
    slack = BindingSpec(BindingKind.slack, {"team": "T1", "channel": "C1", "thread_ts": "1.1"})
    out = await console.service.turns.run(
        Trigger(console.org.id, console.worker["id"], "s5", "post the update #complete", slack)
    )
    assert isinstance(out, Gated) and out.work_item_id
    item = out.work_item_id
    await drain(console.service.lead_runner)  # approved
    await drain(console.service.relay)  # the send times out: deliveryUnknown

    await console.open(page, MEMBER, "Member")
    row = page.locator("#queue tbody tr", has=page.get_by_role("link", name=item))
    await expect(row).to_contain_text("approved")
    await expect(row).to_contain_text("deliveryUnknown")
    await row.get_by_role("link", name=item).click()
    await expect(page.locator("#detail-status")).to_have_text("approved")
    deliveries = page.locator("#deliveries")
    await expect(deliveries).to_contain_text("deliveryUnknown")
    await expect(deliveries).to_contain_text("read timeout after the request was written")
    await expect(page.get_by_role("button", name="Retry delivery")).to_be_visible()
    await page.get_by_role("button", name="Confirm delivered").click()
    await expect(page.locator("#detail-status")).to_have_text("completed")
    await expect(deliveries).to_contain_text("sent")
    await expect(page.get_by_role("button", name="Confirm delivered")).to_have_count(0)
