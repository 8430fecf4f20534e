from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.pg import PostgresServer, start_postgres

if TYPE_CHECKING:
    from engine.service import Service


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Anything that uses the real PostgreSQL carries the `postgres` marker, so that
    # `-m "not postgres"` runs the rest without starting a server.
    for item in items:
        if "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL 15 (started on first use; see tests/pg.py)."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy async URL of a fresh, empty PostgreSQL database for this test."""
    name = f"t_{uuid.uuid4().hex[:20]}"
    url = postgres_server.create_database(name)
    yield url
    try:
        postgres_server.drop_database(name)
    except Exception as exc:  # best effort: the whole cluster goes away at session end
        print(f"warning: could not drop test database {name}: {exc}")


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database on each backend: `sqlite+aiosqlite:///...` or PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/t.db"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def migrated_url(db_url: str) -> str:
    """``db_url`` (sqlite and postgres) migrated to the newest schema."""
    from engine.db import upgrade

    upgrade(db_url)
    return db_url


@pytest.fixture
async def service(migrated_url: str) -> AsyncIterator[Service]:
    """A real Service on a migrated database with a FakeClock; no channel adapters and no
    background loops (drive runners with ``engine.runners.drain``)."""
    from engine.clock import FakeClock
    from engine.config import Settings
    from engine.service import Service

    settings = Settings.model_validate({"database": {"url": migrated_url}})
    svc = Service(settings, clock=FakeClock(), enable_adapters=False)
    yield svc
    await svc.stop()
