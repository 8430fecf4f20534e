"""The operator console in a real browser (Chromium through Playwright) against the real
app served on 127.0.0.1: triage from the queue (preview, requester, why, waiting since,
count, filters, live arrival of new items), the review detail (where an approval goes,
the confirmation dialog, the verdict history per revision, names in the audit, the page
following the item's state), rejection errors, markup shown as text, Agent Activity
filters and search, Insights charts, a Viewer's role message and delivery recovery.

Work items are set up through the real turn path with the built-in ``script`` model
(``#complete #escalate`` -> the lead escalates -> ``awaitingHuman``); the lead runner,
the revision runner and the relay are drained by hand while the page is open, and the
page must follow through ``/operator/events`` (no reload). One browser for the module; a
fresh context (no cookies) per test. Screenshots go to the test's tmp_path (console-*.png), or to
``docs/`` with ``LEADGATE_SCREENSHOTS=docs`` (``scripts/screenshots.sh``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from aiohttp import ClientSession, web
from playwright.async_api import Browser, Dialog, Page, Route, async_playwright, expect

from leadgate.app import App
from leadgate.core.clock import MINUTE_MS, FakeClock
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.database import schema as t
from leadgate.database.db import upgrade
from leadgate.domain import orgs, workitems
from leadgate.review import queue
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import OutboundMessage, Retry, SendOutcome, Sent, Uncertain
from outbox.store import get_delivery
from tests.helpers import Org, fake_clock, make_agent, make_org
from tests.review_support import add_destination, reply_rows

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
#: PASSWORD's argon2 hash, made once (users are created with a hash).
HASHED = orgs.hash_password(PASSWORD)
MEMBER = "mia@example.com"
VIEWER = "vic@example.com"
REPO = Path(__file__).resolve().parents[2]
#: Live updates arrive within about a second (the events poll); generous for a busy CI.
LIVE_MS = 15_000
SLACK = {"team": "T1", "channel": "C1", "thread_ts": "1.1"}
LOADED = "(id) => { const i = document.getElementById(id); return i.complete && i.naturalWidth }"


class ScriptedSlack:
    """A Slack stand-in: sends succeed, or (``uncertain``) time out after writing."""

    name = "slack"
    max_chars = 4_000

    def __init__(self) -> None:
        self.uncertain = False
        self.sent: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> SendOutcome:
        if self.uncertain:
            return Uncertain("read timeout after the request was written")
        self.sent.append(message)
        return Sent(f"ts-{len(self.sent)}")

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        # An edit is idempotent: its timeout is one to retry.
        if self.uncertain:
            return Retry("read timeout after the request was written")
        return Sent(external_id)

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
    other: dict[str, Any]
    slack: ScriptedSlack
    url: str
    dialogs: list[str] = field(default_factory=list)

    @property
    def clock(self) -> FakeClock:
        return fake_clock(self.service)

    async def awaiting_item(
        self,
        message: str,
        session: str,
        *,
        agent: dict[str, Any] | None = None,
        binding: BindingSpec | None = None,
    ) -> str:
        """A work item escalated by the lead to awaitingHuman (a minute later than the
        previous one, so that "waiting since" differs)."""
        self.clock.advance(MINUTE_MS)
        out = await self.service.turns.run(
            Trigger(
                self.org.id,
                (agent or self.worker)["id"],
                session,
                f"{message} #complete #escalate",
                binding or BindingSpec(BindingKind.api),
            )
        )
        assert isinstance(out, Gated) and out.work_item_id
        await drain(self.service.lead_runner)
        return out.work_item_id

    async def open(
        self, page: Page, email: str, role: str, *, login: bool = True, name: str | None = None
    ) -> None:
        """Create the console user, load the console and log in through the form."""
        async with self.service.db.tx() as conn:
            await orgs.create_user(
                conn,
                self.service.clock,
                self.service.ids,
                self.org.id,
                email,
                role,
                HASHED,
                name=name,
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
    # Real-looking times on the page (the clock is still moved only by hand).
    assert isinstance(service.clock, FakeClock)
    service.clock.advance(int(time.time() * 1000) - 60 * MINUTE_MS - service.clock.now_ms())
    slack = ScriptedSlack()
    service.relay.channels["slack"] = slack
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "writer", lead="lead")
    other = await make_agent(service, org, "translator", lead="lead")
    runner = web.AppRunner(service.web_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Console(service, org, worker, other, slack, f"http://{host}:{port}")
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield await context.new_page()
    finally:
        await context.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where the pages' screenshots go: ``docs/`` with ``LEADGATE_SCREENSHOTS=docs``, else
    the test's own folder (a fixed /tmp name was shared by concurrent runs, and one
    left there by another user could not be overwritten)."""
    return REPO / "docs" if os.environ.get("LEADGATE_SCREENSHOTS") == "docs" else tmp_path


def queue_row(page: Page, item: str) -> Any:
    return page.locator(f'#queue tbody tr[data-id="{item}"]')


async def test_triage_from_the_queue_with_filters_and_live_arrivals(
    console: Console, page: Page, screenshots: Path
) -> None:
    first = await console.awaiting_item("draft the launch note for Friday", "s1")
    await console.awaiting_item(
        "translate the FAQ",
        "s2",
        agent=console.other,
        binding=BindingSpec(BindingKind.slack, SLACK),
    )
    await console.open(page, MEMBER, "Member", name="Mia Jones")

    row = queue_row(page, first)
    await expect(row.locator("a.preview")).to_have_text(
        "Summary: draft the launch note for Friday #escalate"
    )
    await expect(row).to_contain_text("writer")
    await expect(row).to_contain_text("session s1")  # the requester
    await expect(row).to_contain_text("Lead escalated")
    await expect(row).to_contain_text("Needs a human.")  # the lead's escalation text
    await expect(row).to_contain_text("round 0 of 3")
    await expect(row.locator("time[data-ago]")).to_have_text(re.compile(r"min ago$"))
    await expect(page.locator("#queue tbody tr")).to_have_count(2)
    # oldest first: the first item waits longest
    await expect(page.locator("#queue tbody tr").first).to_have_attribute("data-id", first)
    await expect(page.locator("#queue-count")).to_have_text("2")
    slack_row = page.locator("#queue tbody tr").nth(1)
    await expect(slack_row).to_contain_text("Slack channel C1 (team T1)")

    await page.locator("#filter-agent").select_option("writer")
    await expect(page.locator("#queue tbody tr")).to_have_count(1)
    await expect(page.locator("#queue-total")).to_have_text("1 of 2 waiting")
    await page.locator("#filter-agent").select_option("")
    await expect(page.locator("#queue tbody tr")).to_have_count(2)
    await page.locator("#filter-channel").select_option("slack")
    await expect(page.locator("#queue-total")).to_have_text("1 of 2 waiting")
    await expect(page.locator("#queue tbody tr")).to_contain_text("translator")
    await page.locator("#filter-channel").select_option("")
    await expect(page.locator("#queue tbody tr")).to_have_count(2)

    # A new item arrives while the page is open: no reload.
    arrived = await console.awaiting_item("answer the customer about pricing", "s3")
    await expect(queue_row(page, arrived)).to_be_visible(timeout=LIVE_MS)
    await expect(page.locator("#queue-count")).to_have_text("3", timeout=LIVE_MS)
    await expect(queue_row(page, arrived)).to_contain_text("answer the customer about pricing")
    await page.screenshot(path=screenshots / "console-queue.png", full_page=True)
    assert console.dialogs == []


async def test_detail_destination_confirmation_verdicts_names_and_live_state(
    console: Console, page: Page, screenshots: Path
) -> None:
    item = await console.awaiting_item(
        "post the weekly update", "s4", binding=BindingSpec(BindingKind.slack, SLACK)
    )
    await console.open(page, MEMBER, "Member", name="Mia Jones")
    await page.locator(f'#queue tbody tr[data-id="{item}"] a.preview').click()
    await expect(page).to_have_url(re.compile(f"#/review/{item}$"))
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    await expect(page.locator("#destination")).to_have_text(
        "Posts the approved text to Slack C1, in thread 1.1."
    )
    await expect(page.locator("#policy-note")).to_contain_text("the verdict does")
    verdicts = page.locator("#verdicts tbody tr")
    await expect(verdicts).to_have_count(1)
    await expect(verdicts.first).to_contain_text("lead agent lead")
    await expect(verdicts.first).to_contain_text("escalated")
    await expect(verdicts.first).to_contain_text("Needs a human.")

    # Return to the worker: the page follows the revision and the lead's next verdict.
    await page.get_by_label(re.compile("Feedback for the worker")).fill("Add the metrics.")
    await page.get_by_role("button", name="Return to worker").click()
    await expect(page.locator("#detail-status")).to_have_text("inProgress")
    await drain(RevisionRunner(console.service.turns))
    await drain(console.service.lead_runner)
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman", timeout=LIVE_MS)
    await expect(verdicts).to_have_count(3)
    await expect(verdicts.nth(1)).to_contain_text("Mia Jones")
    await expect(verdicts.nth(1)).to_contain_text("returned")
    await expect(verdicts.nth(1)).to_contain_text("Add the metrics.")
    await expect(verdicts.nth(2).locator("td").first).to_have_text("1")  # revision 1
    await expect(page.locator("#summary")).to_have_text("Revised: Add the metrics.")

    # Approve asks first, and says where the text goes.
    await page.get_by_role("button", name="Approve…").click()
    dialog = page.get_by_role("dialog", name="Approve this work item?")
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text("Posts the approved text to Slack C1, in thread 1.1.")
    await page.screenshot(path=screenshots / "console-approve.png")
    await dialog.get_by_role("button", name="Keep reviewing").click()
    await expect(dialog).to_be_hidden()
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    await page.screenshot(path=screenshots / "console-detail.png", full_page=True)
    await page.get_by_role("button", name="Approve…").click()
    await dialog.get_by_role("button", name="Approve and deliver").click()
    await expect(page.locator("#detail-status")).to_have_text("approved")
    await expect(page.locator("#notice")).to_have_text("Approved.")

    # The relay posts it; the page follows without a reload.
    assert await drain(console.service.relay) >= 1
    await expect(page.locator("#detail-status")).to_have_text("completed", timeout=LIVE_MS)
    await expect(page.locator("#deliveries")).to_contain_text("sent")
    assert [m.text for m in console.slack.sent] == ["Revised: Add the metrics."]
    audit = page.locator("#audit")
    await expect(audit).to_contain_text("Mia Jones")
    await expect(audit).to_contain_text(MEMBER)
    await expect(audit).to_contain_text("console")
    await expect(audit).to_contain_text("lead agent lead")
    await expect(audit).not_to_contain_text("user:usr_")
    assert console.dialogs == []


async def test_a_detail_cut_to_its_newest_audit_says_older_entries_exist(
    console: Console, page: Page
) -> None:
    """The API lists an item's newest audit rows, verdicts and deliveries only (and its
    oldest unsettled deliveries); the page says when it is cut, under the list that is."""
    item = await console.awaiting_item("a long story", "s-cut")
    other = await console.awaiting_item("a longer story", "s-cut-more")
    now = console.clock.now_ms()
    async with console.service.db.tx() as conn:
        await conn.execute(
            sa.insert(t.audit),
            [
                {
                    "id": f"aud_cut{i}",
                    "org_id": console.org.id,
                    "work_item_id": other,
                    "actor": "user:usr_gone",
                    "action": "return",
                    "to_status": "inProgress",
                    "created_at": now + i,
                }
                for i in range(2)
            ],
        )
        await conn.execute(
            sa.insert(t.deliveries),
            reply_rows(
                console.org.id, other, ["deliveryUnknown"] * 3 + ["sent"] * 2, now, "dlv_cut"
            ),
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "DETAIL_LIST_MAX", 2)
        await console.open(page, MEMBER, "Member")
        await page.goto(f"{console.url}/console/#/review/{item}")
        await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
        await expect(page.locator("#audit tbody tr")).to_have_count(2)
        await expect(page.locator("#audit-truncated")).to_have_text(
            "Only the newest audit entries are shown; older ones exist."
        )
        await expect(page.locator("#deliveries-truncated")).to_have_count(0)
        await expect(page.locator("#unsettled-deliveries-truncated")).to_have_count(0)
        await expect(page.locator("#verdicts-truncated")).to_have_count(0)
        # The verdict older than the rows listed is still shown.
        await expect(page.locator("#verdicts tbody tr")).to_have_count(1)

        await page.goto(f"{console.url}/console/#/review/{other}")
        await expect(page.locator("#verdicts tbody tr")).to_have_count(2)
        await expect(page.locator("#verdicts-truncated")).to_have_text(
            "Only the newest verdicts are shown; older ones exist."
        )
        # The two oldest uncertain deliveries and the two newest.
        await expect(page.locator("#deliveries tbody tr")).to_have_count(4)
        await expect(page.locator("#deliveries")).to_contain_text("dlv_cut0")
        await expect(page.locator("#deliveries-truncated")).to_contain_text(
            "those still pending, sending or uncertain"
        )
        await expect(page.locator("#unsettled-deliveries-truncated")).to_contain_text(
            "More deliveries are still pending, sending or uncertain than are shown"
        )


async def test_member_rejects_with_a_reason_and_server_errors_are_shown(
    console: Console, page: Page
) -> None:
    item = await console.awaiting_item("summarise the contract", "s5")
    await console.open(page, MEMBER, "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")

    reason = page.get_by_label(re.compile("Reason for rejecting"))
    await page.get_by_role("button", name="Reject").click()  # empty: the server says no
    await expect(page.get_by_role("alert")).to_have_text("Error: reason is required")
    await reason.fill("x" * 2001)
    await expect(page.locator("#reject-count")).to_have_text("2,001 / 2,000")
    await page.get_by_role("button", name="Reject").click()
    await expect(page.get_by_role("alert")).to_contain_text("at most 2,000 characters")
    await reason.fill("The figures in section 2 are wrong.")
    await page.get_by_role("button", name="Reject").click()
    await expect(page.locator("#detail-status")).to_have_text("rejected")
    await expect(page.get_by_role("alert")).to_be_hidden()
    await expect(page.locator("#audit")).to_contain_text("The figures in section 2 are wrong.")
    await expect(page.get_by_role("button", name="Reject")).to_have_count(0)


async def test_a_member_cancels_saying_why_and_the_audit_shows_it(
    console: Console, page: Page
) -> None:
    """The cancel's confirmation takes an optional reason, kept in its audit entry (the
    operator API refused one: 400 ``decision.unknown_field``)."""
    item = await console.awaiting_item("summarise the lease", "s9")
    await console.open(page, MEMBER, "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    await page.get_by_role("button", name="Cancel work item…").click()
    await page.get_by_label("Reason for cancelling (optional)").fill("Asked twice; see s5.")
    await page.get_by_role("button", name="Yes, cancel it").click()
    await expect(page.locator("#detail-status")).to_have_text("cancelled")
    await expect(page.locator("#audit")).to_contain_text("Asked twice; see s5.")


async def test_typed_feedback_survives_live_updates_and_a_decision_made_elsewhere_shows(
    console: Console, page: Page
) -> None:
    item = await console.awaiting_item("draft the memo", "s9")
    await console.open(page, "mo@example.com", "Member")
    await page.goto(f"{console.url}/console/#/review/%E0%A4%A")  # no URI at all
    await expect(page.get_by_role("alert")).to_have_text(
        "Error: There is no work item at this address."
    )
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    feedback = page.get_by_label(re.compile("Feedback for the worker"))
    await feedback.fill("Use the Q3 figures.")
    await feedback.evaluate("el => el.blur()")  # the box loses focus
    # Another item's change re-renders this page too (the feed reports recent items):
    # the detail is rebuilt, and what was typed is still there.
    await page.evaluate("document.querySelector('#detail-status').dataset.old = '1'")
    await console.awaiting_item("another one", "s10")
    await expect(page.locator("#detail-status[data-old]")).to_have_count(0, timeout=10_000)
    await expect(feedback).to_have_value("Use the Q3 figures.")
    await expect(page.locator("#return-count")).to_have_text("19 / 10,000")

    # Another reviewer rejects while this one has the approval dialog open: once it is
    # closed, the page catches up instead of offering a decision that is gone.
    await page.get_by_role("button", name="Approve…").click()
    async with ClientSession() as http:
        async with http.post(
            f"{console.url}/operator/reviews/{item}/reject",
            json={"reason": "Decided elsewhere."},
            headers={"Authorization": f"Bearer {console.org.key}"},
        ) as resp:
            assert resp.status == 200
    await page.locator("#approve-keep").click()
    await expect(page.locator("#detail-status")).to_have_text("rejected", timeout=10_000)
    await expect(page.get_by_role("button", name="Approve…")).to_have_count(0)


async def test_an_approval_confirmed_on_a_stale_page_does_not_decide_a_later_revision(
    console: Console, page: Page
) -> None:
    """The approval dialog holds the page still (its refresh waits for it to close).
    Meanwhile another reviewer sends the item back, the worker revises and the lead
    escalates again: a new revision, waiting again. Confirming the dialog approved that
    revision, which this reviewer never saw; now it is refused, and the page shows the
    item as it is, with why."""
    item = await console.awaiting_item("draft the board letter", "s-stale")
    await console.open(page, "sam@example.com", "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    await expect(page.locator("#summary")).to_contain_text("draft the board letter")
    await page.get_by_role("button", name="Approve…").click()
    async with ClientSession() as http:
        async with http.post(
            f"{console.url}/operator/reviews/{item}/return",
            json={"feedback": "Start over #escalate"},
            headers={"Authorization": f"Bearer {console.org.key}"},
        ) as resp:
            assert resp.status == 200
    await drain(RevisionRunner(console.service.turns))
    await drain(console.service.lead_runner)
    async with console.service.db.read() as conn:
        again = await workitems.get(conn, item)
    assert (again.status, again.revision) == ("awaitingHuman", 1)

    await page.locator("#approve-confirm").click()
    await expect(page.get_by_role("alert")).to_contain_text("sent back for changes")
    await expect(page.locator("#summary")).to_have_text("Revised: Start over #escalate")
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")
    async with console.service.db.read() as conn:
        assert (await workitems.get(conn, item)).status == "awaitingHuman"


async def test_a_session_logged_out_elsewhere_shows_the_login_form_without_a_click(
    console: Console, page: Page
) -> None:
    """The live feed ends once the console session is no longer valid (logged out in
    another tab, expired). The page only stopped following: the queue stayed on screen,
    no longer kept current, with nothing to say so until the next click was refused."""
    await console.awaiting_item("summarise the incident", "s-ended")
    await console.open(page, "lou@example.com", "Member")
    await expect(page.locator("#live")).to_have_text("live")
    await expect(page.locator("#queue tbody tr").first).to_be_visible()
    cookie = next(c for c in await page.context.cookies() if c["name"] == "leadgate_session")
    async with ClientSession() as http:
        async with http.post(
            f"{console.url}/console/logout",
            headers={"Cookie": f"leadgate_session={cookie['value']}", "X-Leadgate-Console": "1"},
        ) as resp:
            assert resp.status == 200
    await expect(page.locator("#login-view")).to_be_visible(timeout=LIVE_MS)
    await expect(page.get_by_role("alert")).to_contain_text("Your session has ended")
    await expect(page.locator("#queue")).to_have_count(0)


async def test_markup_is_text_and_activity_filters_and_searches_without_the_text(
    console: Console, page: Page, screenshots: Path
) -> None:
    markup = '<script>alert(1)</script><img src=x onerror="alert(2)"><b>bold</b>'
    item = await console.awaiting_item(markup, "s6")
    other = await console.awaiting_item("rename the invoices", "s7", agent=console.other)
    await console.open(page, MEMBER, "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#snapshot")).to_contain_text(f"Echo: {markup}")
    await expect(page.locator("#task-context")).to_contain_text(markup)
    injected = await page.evaluate(
        "document.querySelectorAll('#app-view script, #app-view img, #app-view b').length"
    )
    assert injected == 0
    assert console.dialogs == []

    await page.get_by_role("link", name="Agent Activity").click()
    rows = page.locator("#activity tbody tr")
    await expect(rows).to_have_count(2)
    await expect(page.locator("#app-view")).not_to_contain_text("alert(1)")
    await expect(page.locator("#app-view")).not_to_contain_text("Echo:")
    await page.locator("#activity-agent").select_option("translator")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_have_attribute("data-id", other)
    await page.locator("#activity-agent").select_option("")
    await expect(rows).to_have_count(2)
    await page.get_by_label("Search summaries").fill("INVOICES")
    await page.get_by_role("button", name="Search").click()
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_have_attribute("data-id", other)
    await expect(page.locator("#app-view")).not_to_contain_text("rename the invoices")
    await page.locator("#activity-status").select_option("completed")
    await expect(page.locator("#activity-empty")).to_be_visible()
    await page.screenshot(path=screenshots / "console-activity.png", full_page=True)
    await page.locator("#activity-status").select_option("")
    await page.get_by_label("Search summaries").fill("")
    await page.get_by_role("button", name="Search").click()
    await expect(rows).to_have_count(2)
    await page.locator(f'#activity tbody tr[data-id="{item}"] a').click()
    await expect(page.locator("#detail-status")).to_have_text("awaitingHuman")


async def test_insights_charts_render_with_data(
    console: Console, page: Page, screenshots: Path
) -> None:
    approved = await console.awaiting_item("first", "s8")
    rejected = await console.awaiting_item("second", "s9")
    for item, action, body in ((approved, "approve", {}), (rejected, "reject", {"reason": "no"})):
        await console.service.reviews.decide(
            console.org.principal, item, action, body.get("reason")
        )
    console.clock.advance(MINUTE_MS)
    plain = await console.service.turns.run(
        Trigger(
            console.org.id,
            console.worker["id"],
            "s10",
            "ship #complete",
            BindingSpec(BindingKind.api),
        )
    )
    assert isinstance(plain, Gated)
    await drain(console.service.lead_runner)  # the lead approves this one itself
    await drain(console.service.relay)
    await console.open(page, MEMBER, "Member")
    await page.get_by_role("link", name="Insights").click()
    await expect(page.get_by_role("heading", name="Insights")).to_be_visible()
    await expect(page.locator("#card-decisions")).to_contain_text("lead 3 · human 2")
    await expect(page.locator("#card-agreement")).to_contain_text("50%")
    await expect(page.locator("#card-agreement")).to_contain_text("confirmed 1 · overrode 1")
    for name in ("decisions", "deciders", "time", "agreement", "rounds", "deliveries"):
        chart = page.locator(f"#chart-{name}")
        await expect(chart).to_be_visible()
        await page.wait_for_function(LOADED, arg=f"chart-{name}")
        svg = await page.request.get(f"{console.url}/operator/insights/charts/{name}.svg?days=30")
        assert svg.ok and svg.headers["content-type"].startswith("image/svg+xml")
        text = await svg.text()
        assert 'class="no_data"' not in text, name
        assert text.count("<rect") > 2, name
    await page.screenshot(path=screenshots / "console-insights.png", full_page=True)


async def test_a_viewer_is_told_their_role_cannot_review(console: Console, page: Page) -> None:
    await console.awaiting_item("anything", "s11")
    await console.open(page, VIEWER, "Viewer", login=False)
    await console.login(page, VIEWER, "not the password")
    await expect(page.get_by_role("alert")).to_have_text(
        "Error: the email or password is not correct"
    )
    await console.login(page, VIEWER, PASSWORD)
    message = page.get_by_role("note")
    await expect(message).to_contain_text("Your role (Viewer) cannot review work items.")
    await expect(page.locator("#queue")).to_have_count(0)


async def test_the_login_button_says_it_is_working_until_the_answer_comes(
    console: Console, page: Page
) -> None:
    """The password check (argon2) takes a moment, and the button gave no sign of it: it
    says "Logging in…", disabled, while the request runs, and a refused login gives it
    back."""
    email = "lou@example.com"
    release = asyncio.Event()

    async def held(route: Route) -> None:
        await release.wait()  # the answer comes when the test says so
        await route.continue_()

    await console.open(page, email, "Member", login=False)
    await page.route("**/console/login", held)
    await console.login(page, email, "not the password")
    button = page.locator("#login-form button[type=submit]")
    await expect(button).to_have_text("Logging in…")
    await expect(button).to_be_disabled()
    release.set()
    await expect(page.get_by_role("alert")).to_have_text(
        "Error: the email or password is not correct"
    )
    await expect(button).to_have_text("Log in")
    await expect(button).to_be_enabled()
    await page.unroute("**/console/login")
    await console.login(page, email, PASSWORD)
    await expect(page.get_by_role("button", name="Log out")).to_be_visible()


async def test_a_role_taken_away_while_logged_in_is_named_as_it_is_now(
    console: Console, page: Page
) -> None:
    """`leadgate user update --role viewer` applies at the session's next request: the
    refused decision said "Your role (Member) cannot review" (the role read at login),
    and the header kept saying Member; a role given back was not seen until a reload.
    The typed feedback is kept for when it is back."""
    item = await console.awaiting_item("demoted", "s11b")
    email = "dee@example.com"
    await console.open(page, email, "Member", name="Dee")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await page.locator("#return-text").fill("Add the date, please.")
    async with console.service.db.tx() as conn:
        await orgs.update_user(conn, console.clock, console.org.id, email, role="Viewer")
    await page.get_by_role("button", name="Return to worker").click()
    message = page.get_by_role("note")
    await expect(message).to_contain_text("Your role (Viewer) cannot review work items.")
    await expect(page.locator("#who-name")).to_contain_text("(Viewer,")

    # Given back: the next page follows the role the server holds (it kept Viewer).
    async with console.service.db.tx() as conn:
        await orgs.update_user(conn, console.clock, console.org.id, email, role="Member")
    await page.get_by_role("link", name="Lead Reviews").click()
    await expect(queue_row(page, item)).to_have_count(1)
    await expect(page.locator("#who-name")).to_contain_text("(Member,")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await expect(page.locator("#return-text")).to_have_value("Add the date, please.")


async def test_the_counter_counts_characters_as_the_server_does(
    console: Console, page: Page
) -> None:
    """1,500 emoji are 1,500 characters of a 2,000-character reason (the server counts
    code points); the counter said 3,000 / 2,000, over the limit, for a reason the server
    accepts."""
    item = await console.awaiting_item("emoji", "s11c")
    await console.open(page, "emo@example.com", "Member")
    await page.goto(f"{console.url}/console/#/review/{item}")
    await page.locator("#reject-text").fill("\N{GRINNING FACE}" * 1500)
    count = page.locator("#reject-count")
    await expect(count).to_have_text("1,500 / 2,000")
    await expect(count).not_to_have_class(re.compile(r"\bover\b"))
    await page.get_by_role("button", name="Reject").click()
    await expect(page.locator("#notice")).to_have_text("Rejected.")


async def test_typed_text_is_never_shown_to_the_next_person_on_the_page(
    console: Console, page: Page
) -> None:
    """What one reviewer typed stayed in the page after they logged out: the next person
    to log in there found it in the form, ready to be sent under their own name. The
    same person coming back after their session ended keeps it."""
    item = await console.awaiting_item("shared desk", "s11d")
    first, second = "ann@example.com", "ben@example.com"
    async with console.service.db.tx() as conn:
        await orgs.create_user(
            conn, console.clock, console.service.ids, console.org.id, second, "Member", HASHED
        )
    await console.open(page, first, "Member")
    detail = f"{console.url}/console/#/review/{item}"
    await page.goto(detail)
    await page.locator("#reject-text").fill("Ann's private reason")
    await page.get_by_role("button", name="Log out").click()
    await console.login(page, second, PASSWORD)
    await expect(page.get_by_role("button", name="Log out")).to_be_visible()
    await page.goto(detail)
    await expect(page.locator("#reject-text")).to_have_value("")

    # Ben's session ends while he types; he logs in again: his words are still there.
    await page.locator("#return-text").fill("Ben's feedback")
    async with console.service.db.tx() as conn:
        await orgs.update_user(conn, console.clock, console.org.id, second, end_sessions=True)
    await page.get_by_role("link", name="Agent Activity").click()
    await expect(page.get_by_role("button", name="Log in")).to_be_visible()
    await console.login(page, second, PASSWORD)
    await expect(page.get_by_role("button", name="Log out")).to_be_visible()
    await page.goto(detail)
    await expect(page.locator("#return-text")).to_have_value("Ben's feedback")


async def test_an_uncertain_delivery_is_confirmed_from_the_detail(
    console: Console, page: Page
) -> None:
    console.slack.uncertain = True
    slack = BindingSpec(BindingKind.slack, SLACK)
    out = await console.service.turns.run(
        Trigger(console.org.id, console.worker["id"], "s12", "post the update #complete", slack)
    )
    assert isinstance(out, Gated) and out.work_item_id
    item = out.work_item_id
    await drain(console.service.lead_runner)  # approved
    await drain(console.service.relay)  # the send times out: deliveryUnknown

    await console.open(page, MEMBER, "Member")
    row = queue_row(page, item)
    await expect(row).to_contain_text("Delivery uncertain")
    await expect(row).to_contain_text("read timeout after the request was written")
    await row.locator("a.preview").click()
    await expect(page.locator("#detail-status")).to_have_text("approved")
    deliveries = page.locator("#deliveries")
    await expect(deliveries).to_contain_text("deliveryUnknown")
    # Where it was going, when, attempts and the last error (it showed the channel only).
    await expect(deliveries).to_contain_text(f"Slack channel {SLACK['channel']}")
    await expect(deliveries).to_contain_text("queued ")
    await expect(deliveries).to_contain_text("read timeout after the request was written")
    await expect(page.get_by_role("button", name="Retry delivery")).to_be_visible()
    await page.get_by_role("button", name="Confirm delivered").click()
    await expect(page.locator("#detail-status")).to_have_text("completed")
    await expect(deliveries).to_contain_text("sent")
    await expect(page.get_by_role("button", name="Confirm delivered")).to_have_count(0)


async def test_a_retry_clicked_again_after_its_answer_was_lost_does_not_send_a_third_time(
    console: Console, page: Page
) -> None:
    """A Retry reaches the service and its answer is lost (the connection drops): the
    page says the server could not be reached and the row is still there. The relay has
    meanwhile sent it again, uncertain again; the live feed is down, so the row is not
    redrawn. Clicking Retry again sent it a third time; the row's Retry names the send it
    showed, and the service refuses it as sent again since."""
    console.slack.uncertain = True
    slack = BindingSpec(BindingKind.slack, SLACK)
    out = await console.service.turns.run(
        Trigger(console.org.id, console.worker["id"], "s-lost", "post the digest #complete", slack)
    )
    assert isinstance(out, Gated) and out.work_item_id
    await drain(console.service.lead_runner)  # approved
    await drain(console.service.relay)  # the send times out: deliveryUnknown
    await page.route("**/operator/events", lambda route: route.abort())  # no live feed
    lost = {"armed": True}

    async def answer_lost(route: Route) -> None:
        if lost["armed"]:
            lost["armed"] = False
            await route.fetch()  # the service takes the Retry...
            await route.abort("connectionreset")  # ...and its answer never arrives
        else:
            await route.continue_()

    await page.route("**/operator/deliveries/*/retry", answer_lost)
    await console.open(page, "rory@example.com", "Member")
    await page.goto(f"{console.url}/console/#/deliveries")
    rows = page.locator("#uncertain tbody tr")
    await expect(rows).to_have_count(1)
    delivery = await rows.first.get_attribute("data-id")
    await rows.first.get_by_role("button", name="Retry delivery").click()
    await expect(page.get_by_role("alert")).to_contain_text("could not be reached")
    await drain(console.service.relay)  # sent again: uncertain again
    await rows.first.get_by_role("button", name="Retry delivery").click()
    await expect(page.get_by_role("alert")).to_contain_text("was sent again since")
    await drain(console.service.relay)
    async with console.service.db.read() as conn:
        row = await get_delivery(conn, str(delivery), console.org.id)
    assert (row.status, row.attempts) == ("deliveryUnknown", 2)


async def test_uncertain_deliveries_no_item_gates_are_listed_and_resolved(
    console: Console, page: Page
) -> None:
    # A plain reply (a worker without a lead) is in no review queue: its uncertain send
    # was only in the raw API. A gating one is listed too.
    console.slack.uncertain = True
    plain = await make_agent(console.service, console.org, "helper")
    slack = BindingSpec(BindingKind.slack, SLACK)
    await console.service.turns.run(
        Trigger(console.org.id, plain["id"], "s13", "a quick answer", slack)
    )
    out = await console.service.turns.run(
        Trigger(console.org.id, console.worker["id"], "s14", "post it #complete", slack)
    )
    assert isinstance(out, Gated) and out.work_item_id
    await drain(console.service.lead_runner)
    await drain(console.service.relay)  # both sends time out: deliveryUnknown
    console.slack.uncertain = False

    await console.open(page, MEMBER, "Member")
    await page.get_by_role("link", name="Uncertain deliveries").click()
    rows = page.locator("#uncertain tbody tr")
    await expect(rows).to_have_count(2)
    reply = rows.filter(has_not=page.locator("a"))  # no work item gates it
    gating = rows.filter(has=page.locator(f'a[href="#/review/{out.work_item_id}"]'))
    await expect(reply).to_contain_text("read timeout after the request was written")
    # Where each was going (README: "with where each was going"): the conversation to
    # check before confirming or sending again; the page named the channel only.
    await expect(reply).to_contain_text("Slack channel C1 (team T1), thread 1.1")
    await reply.get_by_role("button", name="Retry delivery").click()
    await expect(page.locator("#notice")).to_have_text("Delivery queued again.")
    await expect(rows).to_have_count(1)
    await drain(console.service.relay)
    assert [m.text for m in console.slack.sent] == ["Echo: a quick answer"]
    await gating.get_by_role("button", name="Confirm delivered").click()
    await expect(page.locator("#uncertain-empty")).to_have_text("No delivery is uncertain.")
    assert page.url.endswith("#/deliveries")  # still on the list, not the item


async def test_a_retried_card_whose_item_was_decided_is_said_not_sent(
    console: Console, page: Page
) -> None:
    """Retry on a review card whose post was uncertain and whose item was decided since
    ends it ``cancelled`` without posting it: the page says so and why, not "queued
    again", and the row leaves the list."""
    await add_destination(console.service, console.org.id, "slack", "C0R")
    console.slack.uncertain = True
    item = await console.awaiting_item("check the card", "s15")
    await drain(console.service.relay)  # the card's post times out: deliveryUnknown
    console.slack.uncertain = False
    await console.service.reviews.decide(console.org.principal, item, "approve")

    await console.open(page, MEMBER, "Member")
    await page.get_by_role("link", name="Uncertain deliveries").click()
    row = page.locator("#uncertain tbody tr").filter(has=page.locator(f'a[href="#/review/{item}"]'))
    await expect(row).to_contain_text("card")
    await row.get_by_role("button", name="Retry delivery").click()
    await expect(page.locator("#notice")).to_have_text(
        "Not sent again: the item was already decided, and a review card is not posted "
        "after its decision (the card is cancelled)."
    )
    await expect(page.locator("#uncertain-empty")).to_have_text("No delivery is uncertain.")
    await drain(console.service.relay)
    assert console.slack.sent == []


async def test_an_emptied_later_page_and_an_unknown_item_leave_no_stale_queue(
    console: Console, page: Page
) -> None:
    """Decisions made elsewhere that empty page 2 bring the first page back (it said
    "Nothing needs a decision" beside a count of waiting items); an address naming no
    work item replaces the page (the queue stayed under the error, no longer updating)."""
    pager = await make_agent(console.service, console.org, "pager", lead="lead")
    items = [await console.awaiting_item(f"page item {n}", f"p{n}", agent=pager) for n in range(27)]
    await console.open(page, "pat@example.com", "Member")
    await page.locator("#filter-agent").select_option("pager")
    await expect(page.locator("#queue-total")).to_have_text(re.compile(r"^27 of \d+ waiting$"))
    await page.get_by_role("button", name="Next page").click()
    await expect(page.locator("#queue tbody tr")).to_have_count(2)
    await expect(queue_row(page, items[26])).to_be_visible()
    async with ClientSession() as http:
        for item in items[25:]:  # page 2, oldest first: the last two
            async with http.post(
                f"{console.url}/operator/reviews/{item}/cancel",
                json={},
                headers={"Authorization": f"Bearer {console.org.key}"},
            ) as resp:
                assert resp.status == 200, await resp.text()
    await expect(page.locator(".pager span")).to_have_text("Page 1", timeout=LIVE_MS)
    await expect(page.locator("#queue tbody tr")).to_have_count(25)
    await expect(page.locator("#queue-empty")).to_have_count(0)

    await page.goto(f"{console.url}/console/#/review/wi_nosuch")
    await expect(page.get_by_role("heading", name="No such work item")).to_be_visible()
    await expect(page.get_by_role("alert")).to_be_visible()
    await expect(page.locator("#queue")).to_have_count(0)
    await page.get_by_role("link", name="Back to Lead Reviews").click()
    await expect(page.locator("#queue tbody tr").first).to_be_visible()
    await expect(page.get_by_role("alert")).to_be_hidden()
