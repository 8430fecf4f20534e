"""What a failed heartbeat's line says (leadgate.app._what_failed): what the database
said, not what clients are told (the line was ``heartbeat failed: the service cannot
store this request right now; nothing was stored, please retry shortly``)."""

from __future__ import annotations

import sqlite3

import sqlalchemy as sa

from leadgate.app import _what_failed
from leadgate.core.errors import NotFound


def test_a_database_fault_says_what_the_database_said() -> None:
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = sqlite3.SQLITE_FULL
    said = _what_failed(sa.exc.OperationalError("UPDATE processes", None, full))
    assert said == "the database is unavailable (database or disk is full)"


def test_a_refusal_says_its_rule_and_a_bug_its_type() -> None:
    assert _what_failed(NotFound("no such process", rule="process.id")) == (
        "no such process [process.id]"
    )
    assert _what_failed(KeyError("x")) == "KeyError: 'x'"
