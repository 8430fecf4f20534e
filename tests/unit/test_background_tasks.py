"""Background tasks (``leadgate.core.tasks.Background``): how a failure is logged."""

from __future__ import annotations

import logging

import pytest

from leadgate.core.errors import Unavailable
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
