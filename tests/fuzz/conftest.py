"""The fuzz suite's service: the real ``leadgate serve`` with Slack, Discord (interactions)
and Teams (local no-auth mode) on, routes to the demo ``plain`` agent, on SQLite
(``fuzz_service``) and on PostgreSQL (``pg_fuzz_service``); ``each_backend`` runs a test
on both.

A :class:`Fuzzed` (session scope) is a service plus what the tests sign with and a way to
fingerprint the database (row counts of the tables a request could write): a request
that was refused must leave the fingerprint unchanged.

Bounded for CI (``FUZZ_EXAMPLES`` per operation or strategy); ``-m long`` runs the long
form (``LONG_EXAMPLES``).
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, settings
from nacl.signing import SigningKey

from tests.acceptance.channel_kit import admin_batch, route
from tests.pg import PostgresServer
from tests.service_proc import Demo, ServiceProcess, clone_sqlite, make_template

FUZZ_EXAMPLES = 12
LONG_EXAMPLES = 300
#: One HTTP session (keep-alive) for every fuzz test's requests.
SESSION = requests.Session()
#: Hypothesis settings of the strategies that are not schemathesis's: repeatable
#: (derandomized, no example database), no deadline (a real service answers).
SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES * 4,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
SLACK_SECRET = "fuzz-signing-secret"
#: Tables a request (not a background runner) writes; audit and deliveries are also
#: written by runners working on earlier accepted requests.
REQUEST_TABLES = (
    "agents",
    "api_keys",
    "bindings",
    "console_sessions",
    "inbound_events",
    "messages",
    "policy_rules",
    "routes",
    "sessions",
    "turn_runs",
    "users",
    "work_items",
)


def examples(config: pytest.Config) -> int:
    """How many examples per operation: the CI bound, or the long form's."""
    return LONG_EXAMPLES if "long" in (config.getoption("-m") or "") else FUZZ_EXAMPLES


@dataclass
class Fuzzed:
    """The service under fuzz and what the tests need to talk to it."""

    proc: ServiceProcess
    discord_key: SigningKey
    key: str
    #: the PostgreSQL server and database name, when the service runs on PostgreSQL
    postgres: tuple[PostgresServer, str] | None = None

    @property
    def db_path(self) -> Path:
        assert self.proc.sqlite_file is not None
        return self.proc.sqlite_file

    def fingerprint(self) -> dict[str, int]:
        """Row counts of :data:`REQUEST_TABLES`, read straight from the SQLite file or
        (on PostgreSQL) with one ``psql`` query."""
        if self.postgres is not None:
            server, database = self.postgres
            counts = ", ".join(f"(SELECT count(*) FROM {name})" for name in REQUEST_TABLES)
            row = server.psql(f"SELECT {counts}", database=database).strip().split("|")
            return dict(zip(REQUEST_TABLES, map(int, row), strict=True))
        with sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True) as conn:
            return {
                name: int(conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0])
                for name in REQUEST_TABLES
            }

    def quiet_fingerprint(self, within_s: float = 15.0) -> dict[str, int]:
        """:meth:`fingerprint` once no recorded turn is still running (channel turns of
        earlier accepted requests finish in the background and write their replies)."""
        deadline = time.monotonic() + within_s
        last = self.fingerprint()
        while True:
            time.sleep(0.02)
            now = self.fingerprint()
            if now == last and now["turn_runs"] == 0:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"the service did not settle: {now}")
            last = now

    def log_problems(self) -> list[str]:
        """Lines of the service log that mean a request crashed somewhere."""
        marks = ("unhandled error", "Error handling request", "Traceback")
        return [line for line in self.proc.log_text().splitlines() if any(m in line for m in marks)]


def _config(key: SigningKey) -> dict[str, Any]:
    return {
        "runners": {"poll_interval_s": 0.5},
        "slack": {
            "signing_secret": SLACK_SECRET,
            "bot_token": "xoxb-fuzz",
            # Nothing listens there: replies are retried later, harmlessly.
            "api_url": "http://127.0.0.1:9/api/",
        },
        "discord": {"public_key": key.verify_key.encode().hex()},
        "teams": {"enabled": True},
    }


def _serve(
    proc: ServiceProcess,
    key: SigningKey,
    demo: Demo,
    postgres: tuple[PostgresServer, str] | None = None,
) -> Iterator[Fuzzed]:
    org = demo.org
    admin_batch(
        proc,
        [
            route(org, "plain", "slack"),
            route(org, "plain", "discord"),
            route(org, "plain", "teams"),
        ],
    )
    proc.start()
    try:
        yield Fuzzed(proc, key, demo.key, postgres)
    finally:
        proc.stop(check=False)


@pytest.fixture(scope="session")
def fuzz_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    template = make_template(tmp_path_factory.mktemp("fuzz-template"))
    key = SigningKey.generate()
    proc = ServiceProcess(tmp_path_factory.mktemp("fuzz-svc"), config=_config(key))
    assert proc.sqlite_file is not None
    clone_sqlite(template.database, proc.sqlite_file)
    proc.demo = template.demo
    yield from _serve(proc, key, template.demo)


@pytest.fixture(scope="session")
def pg_fuzz_service(
    postgres_server: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """The same service on PostgreSQL: there a NUL or a number past 64 bits fails in the
    driver, and a channel id longer than its column in the database (session 31's probes
    found both where SQLite took them)."""
    key = SigningKey.generate()
    database = f"fuzz_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(database)
    proc = ServiceProcess(
        tmp_path_factory.mktemp("fuzz-pg-svc"), database_url=url, config=_config(key)
    )
    yield from _serve(proc, key, proc.upgrade_and_seed_demo(), (postgres_server, database))


@pytest.fixture(params=["sqlite", "postgres"])
def each_backend(request: pytest.FixtureRequest) -> Fuzzed:
    """:func:`fuzz_service` and :func:`pg_fuzz_service` in turn."""
    name = "fuzz_service" if request.param == "sqlite" else "pg_fuzz_service"
    service: Fuzzed = request.getfixturevalue(name)
    return service
