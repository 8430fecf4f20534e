"""How a failure met with no caller to answer is logged (``leadgate.core.errors.log_failure``:
background tasks, the revision and recovery runners' passes, the renewals of watched
sessions and of idempotency claims; a runner loop's back-off): a database fault is one
WARNING naming the rule."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from leadgate.core.auth import Principal
from leadgate.core.clock import FakeClock
from leadgate.core.errors import DatabaseDamaged, Unavailable, log_failure
from leadgate.core.runners import run_loop
from leadgate.core.tasks import Background
from leadgate.operations import idempotency
from leadgate.operations.event_hub import EventHub
from tests.fakes import DownFor
from tests.helpers import eventually


async def test_a_database_fault_is_one_line_and_a_bug_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fault() -> None:
        raise Unavailable("database down: SECRET driver text", rule="service.unavailable")

    async def bug() -> None:
        raise KeyError("x")

    background = Background()
    caplog.set_level(logging.INFO, logger="leadgate.tasks")
    background.spawn(fault(), name="remember")
    background.spawn(bug(), name="buggy")
    await background.wait(1.0)
    by_task = {r.getMessage().split()[2]: r for r in caplog.records}
    # A fault met in the background was a traceback quoting the driver; now one WARNING
    # naming the rule.
    fault_line = by_task["remember"]
    assert fault_line.levelno == logging.WARNING and fault_line.exc_info is None
    assert "(service.unavailable)" in fault_line.getMessage()
    assert "SECRET" not in fault_line.getMessage()
    assert by_task["buggy"].levelno == logging.ERROR and by_task["buggy"].exc_info is not None


def test_a_damaged_database_is_one_line_naming_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("leadgate.runners.revisions")
    caplog.set_level(logging.INFO)
    damaged = DatabaseDamaged("SECRET file path and driver text")
    log_failure(log, damaged, "revision turn for %s failed", "wi_1")
    [line] = caplog.records
    assert line.getMessage() == "revision turn for wi_1 failed: database fault (database.file)"
    assert line.exc_info is None and line.levelno == logging.WARNING
    # The record names where the failure was met, not the helper.
    assert line.funcName == "test_a_damaged_database_is_one_line_naming_the_caller"


class _Down:
    """A database whose every transaction meets a fault (the driver's text is secret)."""

    def tx(self) -> Any:
        return DownFor(lambda: None, 1, after_commit=False)()


def _faults(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


async def test_a_runner_pass_meeting_the_database_down_names_the_rule_and_stops_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The back-off after the database's fault (0.5 s at the first, then doubling) is
    cut short by stopping. The back-offs are asked of the loop's ``sleep``, not waited
    (this test waited the first one, 0.5 s, for real): the first ends at once, and the
    second (1 s) is the one stopped in, and never ends by itself, so a loop that waits
    its back-off out never returns."""
    stop, wake = asyncio.Event(), asyncio.Event()
    asked: list[float] = []

    async def back_off(seconds: float) -> None:
        asked.append(seconds)
        if len(asked) == 2:
            stop.set()  # asked to stop during this back-off
            await asyncio.Event().wait()

    class Down:
        name = "sweeper"
        passes = 0

        async def run_once(self) -> bool:
            self.passes += 1
            if self.passes == 1:
                wake.set()  # the next pass comes after the back-off, not at the poll
            raise Unavailable("database down", rule="service.unavailable")

    down = Down()
    caplog.set_level(logging.INFO)
    await asyncio.wait_for(run_loop(down, wake=wake, stop=stop, poll_s=60, sleep=back_off), 5.0)
    assert (asked, down.passes) == ([0.5, 1.0], 2)
    lines = _faults(caplog, "leadgate.runners")
    assert len(lines) == 2
    for line in lines:
        assert line.levelno == logging.WARNING and line.exc_info is None
        assert "runner sweeper: database unavailable (service.unavailable: " in line.getMessage()


async def test_a_runner_pass_meeting_a_bug_keeps_its_traceback_and_stops_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """README: a runner backs off after any failure, and stopping does not wait the
    back-off out. After a bug's (1 s at the first, up to 30 s) it did: a stopping
    service waited for it up to its shutdown bound, and left the runner running."""
    stop = asyncio.Event()

    class Buggy:
        name = "sweeper"

        async def run_once(self) -> bool:
            stop.set()  # asked to stop during the back-off that follows
            raise KeyError("x")

    caplog.set_level(logging.INFO)
    await asyncio.wait_for(run_loop(Buggy(), wake=asyncio.Event(), stop=stop, poll_s=60), 0.5)
    [line] = _faults(caplog, "leadgate.runners")
    assert line.levelno == logging.ERROR and line.exc_info is not None
    assert line.getMessage() == "runner sweeper failed (1 in a row)"


async def test_renewing_watched_sessions_with_the_database_down_names_the_rule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()

    async def mark(sessions: Sequence[str]) -> None:
        stop.set()
        raise Unavailable("SECRET driver text", rule="service.unavailable")

    hub = EventHub(mark, renew_s=0)
    hub.subscribe("s_1")
    caplog.set_level(logging.INFO)
    await asyncio.wait_for(hub.renew_forever(stop), 1.0)
    [line] = _faults(caplog, "leadgate.events")
    assert (
        line.getMessage()
        == "renewing watched sessions failed: database fault (service.unavailable)"
    )


async def test_renewing_an_idempotency_claim_with_the_database_down_names_the_rule(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idempotency, "RENEW_EVERY_S", 0)
    idem = idempotency.Idempotency(_Down(), FakeClock())  # type: ignore[arg-type]
    principal = Principal("org_1", frozenset())
    caplog.set_level(logging.INFO)
    async with idem.held(principal, idempotency.Claim("run", "hash", owner="o")):
        await eventually(lambda: bool(_faults(caplog, "leadgate.idempotency")))
    line = _faults(caplog, "leadgate.idempotency")[0]
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert line.getMessage() == (
        "renewing an Idempotency-Key claim failed: database fault (service.unavailable)"
    )
