"""Every log call of the product that carries a traceback hands it through
:func:`leadgate.core.logs.loggable`, which keeps the frames but never a database's text
(PostgreSQL's ``DETAIL`` and SQLAlchemy's ``[parameters: ...]`` quote the statement's
values: message text, answers, tokens). A ``log.exception(...)`` or an ``exc_info=``
that is not ``loggable(...)`` is how such text reached the logs; this check finds the
next one before a user's text does."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("leadgate", "bots", "outbox", "binding")
#: (file, what the call logs): tracebacks that cannot hold a database's error, each
#: with why.
ALLOWED = {
    # closing the Bot Connector's HTTP client at shutdown: no statement runs there
    ("bots/teams.py", "teams: closing the connector client failed"),
    # QUIT after an accepted message: an SMTP exchange, no database
    ("bots/email_out.py", "email: QUIT failed"),
}


def _logged(call: ast.Call) -> str:
    first = call.args[0] if call.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""


def _wrapped(value: ast.expr) -> bool:
    """Whether an ``exc_info=`` value is ``loggable(...)`` or none (either way when
    chosen by a condition)."""
    if isinstance(value, ast.IfExp):
        return _wrapped(value.body) and _wrapped(value.orelse)
    if isinstance(value, ast.Constant):
        return value.value in (None, False)
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "loggable"
    )


def _offences(rel: str, source: str) -> list[tuple[str, int, str]]:
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "exception" and node.args and _logged(node):
            found.append((rel, node.lineno, _logged(node)))
            continue
        for keyword in node.keywords:
            if keyword.arg != "exc_info":
                continue
            if not _wrapped(keyword.value) and (rel, _logged(node)) not in ALLOWED:
                found.append((rel, node.lineno, _logged(node)))
    return found


def test_every_logged_traceback_goes_through_loggable() -> None:
    offences = [
        offence
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for offence in _offences(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert offences == [], (
        "log the error with exc_info=loggable(exc) (leadgate.core.logs), or add it to "
        "ALLOWED with why no database error can be under it"
    )


def test_the_check_finds_a_bare_traceback() -> None:
    # (So that the check above cannot pass by finding nothing at all.)
    probe = (
        "import logging\nlog = logging.getLogger()\n"
        "try:\n    pass\nexcept Exception as exc:\n"
        '    log.exception("x")\n    log.warning("y", exc_info=True)\n'
        '    log.error("z", exc_info=loggable(exc))\n'
        '    log.debug("email: QUIT failed", exc_info=True)\n'
    )
    assert [line for _, line, _ in _offences("bots/email_out.py", probe)] == [6, 7]
