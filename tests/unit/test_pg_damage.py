"""Which PostgreSQL errors say the database is damaged (leadgate.database.faults.pg_damage):
only the corruption codes, whichever way they are wrapped, and without the statement's
text or parameters (tests/integration/test_damaged_postgres.py meets them over the wire);
and which connection errors are unavailability (``unavailable``) or a login the URL got
wrong (``login_refused``; tests/integration/test_cli_config.py meets them)."""

from __future__ import annotations

import socket

import asyncpg
import sqlalchemy as sa

from leadgate.database.faults import login_refused, pg_damage, unavailable


def server_error(cls: type[asyncpg.PostgresError], message: str, **fields: str) -> Exception:
    """As asyncpg makes it of the server's message (the class by its SQLSTATE)."""
    error: Exception = cls.new({"C": cls.sqlstate, "M": message, **fields})
    assert type(error) is cls
    return error


def test_corruption_codes_are_damage_and_say_what_to_do() -> None:
    page = server_error(
        asyncpg.exceptions.DataCorruptedError, "invalid page in block 7 of relation base/1/2"
    )
    said = pg_damage(sa.exc.DBAPIError("SELECT secret", ("message text",), page))
    assert said == (
        "SQLSTATE XX001 data_corrupted: invalid page in block 7 of relation base/1/2; "
        "restore the damaged data from a backup"
    )
    index = server_error(
        asyncpg.exceptions.IndexCorruptedError,
        'index "ix" contains unexpected zero page',
        H="Please REINDEX it.",
    )
    said = pg_damage(index)
    assert said is not None and said.startswith('SQLSTATE XX002 index_corrupted: index "ix"')
    assert "(hint: Please REINDEX it.)" in said and said.endswith("REINDEX the index it names")
    # Damage is no unavailability: retrying will not help.
    assert unavailable(page) is None and unavailable(index) is None


def test_other_errors_are_not_damage() -> None:
    internal = server_error(asyncpg.exceptions.InternalServerError, "cache lookup failed")
    assert pg_damage(internal) is None  # XX000: a server bug, not damage
    assert pg_damage(server_error(asyncpg.exceptions.UniqueViolationError, "dup")) is None
    assert pg_damage(ValueError("XX001")) is None


def test_an_unresolvable_host_is_unavailability_and_a_refused_login_is_the_urls() -> None:
    # The database's host name did not resolve: it was answered as a bug (500, exit 1).
    dns = unavailable(socket.gaierror(-2, "Name or service not known"))
    assert dns is not None and dns.rule == "service.unavailable"
    assert dns.detail == "[Errno -2] Name or service not known"
    password = server_error(
        asyncpg.exceptions.InvalidPasswordError, 'password authentication failed for user "lg"'
    )
    assert login_refused(password) == "SQLSTATE 28P01 invalid_password: the password is wrong"
    assert unavailable(password) is None and pg_damage(password) is None  # no retry helps
    assert login_refused(ConnectionRefusedError(111, "refused")) is None
