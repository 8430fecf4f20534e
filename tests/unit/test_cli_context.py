"""What the CLI says about its database: never a password, wherever the URL holds one."""

from __future__ import annotations

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
