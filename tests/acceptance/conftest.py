"""Acceptance fixtures: the real service in a subprocess (see ``tests/service_proc.py``).

* ``leadgate`` (function scope): a started service (SQLite, ``script`` model) with the demo
  organization made by ``leadgate demo``: ``leadgate.demo.key`` (Owner key, every scope),
  agents ``lead``, ``worker`` (reviewed by ``lead``) and ``plain`` (no lead).
  ``leadgate.url``, ``leadgate.admin(...)``, ``leadgate.stop()``/``kill()`` as in
  :class:`~tests.service_proc.ServiceProcess`. It is stopped with SIGTERM afterwards and
  must exit 0 within 10 s (a test that already stopped or killed it is fine).
* ``leadgate_pg``: the same on a fresh PostgreSQL database (``pg_url``).
* ``demo_template``: the migrated + seeded SQLite database, made once per test session
  through the CLI; services start from copies of it, so a function-scoped service costs
  only the ``serve`` startup (about a second).
* ``node``: the Node runtime pinned in ``tests/node`` (see ``node_kit.py``).
* ``service_guard``: module-scoped services use it to be stopped cleanly and to print
  their log tail when a test of the module failed, e.g.::

      @pytest.fixture(scope="module")
      def svc(demo_template, tmp_path_factory, service_guard):
          proc = start_from_template(demo_template, tmp_path_factory.mktemp("svc"))
          with service_guard(proc):
              yield proc

On a failing test the service log tail is printed (pytest shows it with the failure).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.node_kit import node_runtime
from tests.service_proc import DemoTemplate, ServiceProcess, make_template, start_from_template


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"leadgate_rep_{report.when}", report)
    return report


def _test_failed(node: pytest.Item) -> bool:
    return any(
        getattr(getattr(node, f"leadgate_rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@contextlib.contextmanager
def _serving(proc: ServiceProcess, failed: Callable[[], bool]) -> Iterator[ServiceProcess]:
    try:
        yield proc
    finally:
        try:
            proc.stop()  # asserts exit code 0 within 10 s (or an earlier kill())
        finally:
            if failed():
                print(proc.log_tail(150))


@pytest.fixture(scope="session")
def demo_template(tmp_path_factory: pytest.TempPathFactory) -> DemoTemplate:
    """``leadgate db upgrade`` + ``leadgate demo`` once per session (through the CLI)."""
    return make_template(tmp_path_factory.mktemp("leadgate-template"))


@pytest.fixture(scope="session")
def node() -> Path:
    """The pinned Node runtime (fails, does not skip, when ``tests/node`` is not installed)."""
    return node_runtime()


@pytest.fixture
def leadgate(
    demo_template: DemoTemplate, tmp_path: Path, request: pytest.FixtureRequest
) -> Generator[ServiceProcess, None, None]:
    """A started service with the demo organization (function scope, SQLite)."""
    proc = start_from_template(demo_template, tmp_path / "leadgate")
    with _serving(proc, lambda: _test_failed(request.node)):
        yield proc


@pytest.fixture
def leadgate_pg(
    pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Generator[ServiceProcess, None, None]:
    """A started service with the demo organization on a fresh PostgreSQL database."""
    proc = ServiceProcess(tmp_path / "leadgate", database_url=pg_url)
    proc.upgrade_and_seed_demo()
    proc.start()
    with _serving(proc, lambda: _test_failed(request.node)):
        yield proc


@pytest.fixture(scope="module")
def service_guard(
    request: pytest.FixtureRequest,
) -> Callable[[ServiceProcess], contextlib.AbstractContextManager[ServiceProcess]]:
    """``with service_guard(proc): yield proc`` for module-scoped services: clean stop
    (exit 0) at the end of the module, log tail printed when any of its tests failed."""
    before = request.session.testsfailed

    def guard(proc: ServiceProcess) -> contextlib.AbstractContextManager[ServiceProcess]:
        return _serving(proc, lambda: request.session.testsfailed > before)

    return guard
