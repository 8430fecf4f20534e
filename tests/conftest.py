from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.pg import PostgresServer, start_postgres

if TYPE_CHECKING:
    from leadgate.app import App
    from leadgate.database.db import Database
    from tests.fakes import ClaimInDoubt, CommitLandsLater
    from tests.stack import Stack
    from tests.standins.discord_api import DiscordApiStandin


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Anything that uses the real PostgreSQL carries the `postgres` marker, so that
    # `-m "not postgres"` runs the rest without starting a server.
    for item in items:
        if "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
    # The long form of the reliability and fuzz suites runs only when asked for
    # (`-m long`): deselected otherwise, never skipped.
    if "long" not in (config.getoption("-m") or ""):
        dropped = [i for i in items if i.get_closest_marker("long") is not None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i in items if i.get_closest_marker("long") is None]


@pytest.fixture(autouse=True)
def _root_log_handlers_restored() -> Iterator[None]:
    """What ``leadgate.cli.main.main`` run in process leaves behind is taken away after
    the test: ``setup_logging`` puts a ``StreamHandler`` on the root logger, bound to the
    ``sys.stderr`` of that moment (the test's capture, closed after it). Left there,
    every later record met "I/O operation on closed file" and printed a traceback of its
    own into the output of whichever test failed next. (pytest's own handlers are
    subclasses it removes itself: only plain stream handlers are taken.)"""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    left = [h for h in root.handlers if type(h) is logging.StreamHandler and h not in before]
    for handler in left:
        root.removeHandler(handler)
    if left:
        root.setLevel(level)


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


@pytest.fixture
def migrated_pg(pg_url: str) -> str:
    """``pg_url`` migrated to the newest schema (for tests of PostgreSQL alone, such as
    two replicas sharing one database)."""
    from leadgate.database.db import upgrade

    upgrade(pg_url)
    return pg_url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database on each backend: `sqlite+aiosqlite:///...` or PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/t.db"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to the newest schema, made once per session: copy it
    (``shutil.copyfile``) rather than run ``db upgrade`` on a fresh file again (an Alembic
    run costs about a second, a ``leadgate db upgrade`` process two). Never write to it."""
    from leadgate.database.db import upgrade

    path = tmp_path_factory.mktemp("template") / "t.db"
    upgrade(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture
def migrated_url(db_url: str, request: pytest.FixtureRequest) -> str:
    """``db_url`` (sqlite and postgres) migrated to the newest schema. SQLite files are
    copies of :func:`sqlite_template`."""
    from leadgate.database.db import upgrade

    if not db_url.startswith("sqlite"):
        upgrade(db_url)
        return db_url
    template: Path = request.getfixturevalue("sqlite_template")
    shutil.copyfile(template, db_url.removeprefix("sqlite+aiosqlite:///"))
    return db_url


@pytest.fixture
async def service(migrated_url: str) -> AsyncIterator[App]:
    """The real composition root on a migrated database with a FakeClock; no channel
    adapters and no background loops (drive runners with ``leadgate.core.runners.drain``).
    Integration tests use it; unit tests use ``stack``."""
    from leadgate.app import App
    from leadgate.core.clock import FakeClock
    from leadgate.core.config import Settings

    settings = Settings.model_validate({"database": {"url": migrated_url}})
    app = App(settings, clock=FakeClock(), enable_adapters=False)
    yield app
    await app.stop()


@pytest.fixture
async def discord_api() -> AsyncIterator[DiscordApiStandin]:
    """The Discord stand-in (REST API and gateway on 127.0.0.1) for the bot token
    ``bot-token``; :func:`tests.standins.discord_api.config_section` points the service at
    it. ``discord.http.Route.BASE``, which the adapter sets for the whole process, is put
    back after."""
    import discord.http

    from tests.standins.discord_api import DiscordApiStandin

    base = discord.http.Route.BASE
    async with DiscordApiStandin(token="bot-token") as standin:
        yield standin
    discord.http.Route.BASE = base


@pytest.fixture
async def make_stack(migrated_url: str) -> AsyncIterator[Callable[..., Stack]]:
    """Build :class:`tests.stack.Stack` objects on ``migrated_url`` (keyword arguments as
    :func:`tests.stack.build_stack`); each is stopped at teardown."""
    from tests.stack import build_stack

    made: list[Stack] = []

    def make(**kwargs: Any) -> Stack:
        made.append(build_stack(migrated_url, **kwargs))
        return made[-1]

    yield make
    for stack in made:
        await stack.stop()


@pytest.fixture
def stack(make_stack: Callable[..., Stack]) -> Stack:
    """A :class:`tests.stack.Stack` with the script model (unit tests)."""
    return make_stack()


@pytest.fixture
async def commit_lands_later(
    make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[[Database], CommitLandsLater]]:
    """Make ``db.tx`` a :class:`tests.fakes.CommitLandsLater` (returned). When the test
    ends, however it ends, a transaction still held is rolled back before the stacks
    close (this fixture is torn down before ``make_stack``, which it asks for): a test
    that failed before its ``land()`` hung at teardown, the pool waiting for it."""
    from tests.fakes import CommitLandsLater

    made: list[CommitLandsLater] = []

    def make(db: Database) -> CommitLandsLater:
        made.append(CommitLandsLater(db.tx))
        monkeypatch.setattr(db, "tx", made[-1])
        return made[-1]

    yield make
    for late in made:
        await late.abandon()


@pytest.fixture(params=["at its commit", "after the next look"])
def claim_in_doubt(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    commit_lands_later: Callable[[Database], CommitLandsLater],
) -> ClaimInDoubt:
    """A runner's next claim in doubt, landed at its commit or after the next look
    (:class:`tests.fakes.ClaimInDoubt`): each test that asks runs once per case."""
    from tests.fakes import ClaimInDoubt

    return ClaimInDoubt(request.param, monkeypatch, commit_lands_later)


@pytest.fixture
async def listening_stack(make_stack: Callable[..., Stack]) -> Stack:
    """:func:`stack` that, on PostgreSQL, LISTENs for changes of the notifying tables as
    the service does (so what is kept under ``TableChanges`` is kept); SQLite needs
    nothing."""
    built = make_stack()
    await built.listen_for_changes()
    return built
