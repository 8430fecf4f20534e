"""What the CLI says about its database: never a password, wherever the URL holds one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from leadgate.cli.context import safe_url
from leadgate.core.errors import ConfigError
from leadgate.database.db import Database, upgrade


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql+asyncpg://u:pw-1@127.0.0.1:5432/db?password=pw-2&sslmode=require",
            "postgresql+asyncpg://u:***@127.0.0.1:5432/db?password=***&sslmode=require",
        ),
        (
            "postgresql+asyncpg://u@h/db?sslpassword=pw-3&application_name=a&application_name=b",
            "postgresql+asyncpg://u@h/db?sslpassword=***&application_name=a&application_name=b",
        ),
        (
            "sqlite+aiosqlite:////var/lib/leadgate/lg.db",
            "sqlite+aiosqlite:////var/lib/leadgate/lg.db",
        ),
        ("not a url pw-4", "(unparsable database url)"),
        # An unescaped @ in the password: SQLAlchemy reads the rest as part of the host.
        ("postgresql+asyncpg://u:pw@7@db.example/db", "postgresql+asyncpg://u:***@db.example/db"),
    ],
)
def test_a_database_url_is_shown_without_its_secrets(url: str, shown: str) -> None:
    assert safe_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://u:pw-5@h:port/db",
        "postgresql+asyncpg://u:pw-5@h:5x/db",
        # Unescaped: the "port" (w) and the "host" (pw-5@h) are pieces of the password.
        "postgresql+asyncpg://u:p@s:w/pw-5@h/db",
        "postgresql+asyncpg://u:p@pw-5@h/db",
    ],
)
def test_a_url_that_does_not_parse_is_a_config_error_without_the_url(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        Database(url)
    assert "pw-5" not in info.value.message and "'w'" not in info.value.message
    assert "percent-encode" in info.value.message or "percent-encoded" in info.value.message
    assert info.value.message.startswith("database.url")
    assert info.value.rule == "database.url"


@pytest.mark.parametrize("url", ["mysql://u:pw-6@h/db", "postgresql+asyncpg://u:pw-6@h:5x/db"])
def test_db_upgrade_refuses_a_url_it_cannot_migrate_before_loading_a_driver(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        upgrade(url)
    assert "pw-6" not in info.value.message
    assert info.value.rule == "database.url"


@pytest.mark.parametrize(
    ("url", "ending"),
    [
        # InvalidRequestError "The asyncio extension requires an async driver", exit 1
        ("sqlite:///./plain.db", "not sqlite://: write sqlite+aiosqlite:///./plain.db"),
        (
            "sqlite+pysqlite:////v/lg.db",
            "not sqlite+pysqlite://: write sqlite+aiosqlite:////v/lg.db",
        ),
        # ModuleNotFoundError: No module named 'psycopg', exit 1
        ("postgresql://u:pw-7@h/db", "not postgresql://: start it with postgresql+asyncpg://"),
        ("postgresql+psycopg://u:pw-7@h/db", "start it with postgresql+asyncpg://"),
        ("postgres://u:pw-7@h/db?password=pw-7", "start it with postgresql+asyncpg://"),
        ("mysql+aiomysql://u:pw-7@h/db", "(PostgreSQL), not mysql+aiomysql://"),
    ],
)
def test_a_url_with_another_driver_is_refused_naming_the_accepted_forms(
    url: str, ending: str
) -> None:
    for check in (Database, upgrade):
        with pytest.raises(ConfigError) as info:
            check(url)
        assert info.value.rule == "database.url"
        message = info.value.message.removesuffix(" instead (the rest as it is)")
        assert message.startswith(
            "database.url must start with sqlite+aiosqlite:/// (a SQLite file) or "
            "postgresql+asyncpg:// (PostgreSQL), not "
        )
        assert message.endswith(ending) and "pw-7" not in message


@pytest.mark.parametrize(
    "url",
    [
        "sqlite+aiosqlite://",
        "sqlite+aiosqlite:///:memory:",
        "sqlite+aiosqlite:///",
        "sqlite+aiosqlite:///file:lg?mode=memory&uri=true",
    ],
)
def test_an_in_memory_sqlite_database_is_refused(url: str) -> None:
    # `db upgrade` migrated it, and every other command found a database of its own: empty.
    for check in (Database, upgrade):
        with pytest.raises(ConfigError) as info:
            check(url)
        assert info.value.rule == "database.url"
        assert info.value.message.startswith("database.url names no SQLite file but a database")


def test_a_file_that_is_not_a_sqlite_database_is_refused(tmp_path: Path) -> None:
    # "file is not a database" with the statement's SQL and a sqlalche.me link, exit 1.
    bad = tmp_path / "bad.db"
    bad.write_text("hello\n")
    url = f"sqlite+aiosqlite:///{bad}"

    async def check() -> None:
        db = Database(url)
        try:
            await db.check_migrated()
        finally:
            await db.close()

    for attempt in (lambda: asyncio.run(check()), lambda: upgrade(url)):
        with pytest.raises(ConfigError) as info:
            attempt()
        assert info.value.rule == "database.file"
        assert info.value.message.startswith(f"{bad} is not a SQLite database")
        assert info.value.__cause__ is None and info.value.__suppress_context__
    assert bad.read_text() == "hello\n"
    # An empty file is an empty database, as SQLite reads it.
    empty = tmp_path / "empty.db"
    empty.touch()
    assert upgrade(f"sqlite+aiosqlite:///{empty}")
