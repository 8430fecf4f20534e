"""The open-files budget of ``leadgate serve`` (:mod:`leadgate.web.runner`)."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

import pytest

from leadgate.core.config import Settings
from leadgate.web.runner import connection_budget, raise_open_files_limit, reserved_files


def test_a_limit_that_fits_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    assert connection_budget(4096, 20_000, 266) == 4096
    assert connection_budget(734, 1000, 266) == 734
    assert caplog.records == []


def test_a_limit_that_does_not_fit_is_lowered_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    assert connection_budget(4096, 1024, 266) == 758
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("[server] max_connections = 4096 lowered to 758: this process")
    assert "RLIMIT_NOFILE" in line
    # Never below one: the listener still answers (and the warning says why it is tiny).
    assert connection_budget(10, 100, 266) == 1


def test_the_smtp_bound_is_kept_only_where_mail_is_received() -> None:
    base = Settings.model_validate({"database": {"pool_size": 10}})
    assert reserved_files(base, "all") == 256 + 10
    # An outbound-only relay (smtp_host alone) opens no listener: nothing kept for it.
    outbound = Settings.model_validate({"email": {"smtp_host": "127.0.0.1"}})
    assert outbound.email.on
    assert reserved_files(outbound, "all") == reserved_files(base, "all")
    inbound = Settings.model_validate(
        {"email": {"listen_port": 2525, "max_connections": 40}, "server": {"metrics_host": "x"}}
    )
    assert reserved_files(inbound, "api") == 256 + 10 + 40 + 64
    # A worker mounts no surfaces, so it runs no SMTP listener; the metrics one it does.
    assert reserved_files(inbound, "worker") == 256 + 10 + 64


@pytest.fixture
def soft_limit() -> Iterator[tuple[int, int]]:
    """This process's open-files limits, restored after the test (raising a soft limit
    back up to the hard one is always allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_open_files_limit_is_raised_to_the_hard_one(
    soft_limit: tuple[int, int],
) -> None:
    _, hard = soft_limit
    lowered = min(hard, 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    # An unlimited hard limit is left alone: the soft one cannot pass the kernel's nr_open.
    expected = hard if hard != resource.RLIM_INFINITY else lowered
    assert raise_open_files_limit() == expected
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == expected
