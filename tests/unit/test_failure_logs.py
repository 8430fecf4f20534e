"""How a failure met with no caller to answer is logged (``leadgate.core.errors.log_failure``:
background tasks, the revision and recovery runners' passes)."""

from __future__ import annotations

import logging

import pytest

from leadgate.core.errors import DatabaseDamaged, Unavailable, log_failure
from leadgate.core.tasks import Background


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
