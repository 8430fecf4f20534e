"""Run a module with the time of every inline SQLite statement tallied (like cProfile).

::

    python -m bench.sqltrace -o stats.json -m leadgate.cli.main serve ...

Wraps :class:`leadgate.database.inline_sqlite.InlineConnection`'s ``run``, ``run_many`` and
``commit`` (the only ways the service's SQLite statements reach ``sqlite3``) and, at exit,
writes ``{statement: [calls, seconds]}`` to ``-o``: the time of each call includes the
plan's argument and row handling around ``sqlite3``, as the service pays it.
``bench.sqlite_costs`` starts the service under it. A bench tool only: the wrapper costs
about a microsecond per statement.
"""

from __future__ import annotations

import atexit
import json
import re
import runpy
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any


def install(stats: dict[str, list[float]]) -> None:
    """Wrap the inline connection's statement entry points, tallying into ``stats``."""
    from leadgate.database.inline_sqlite import InlineConnection

    # str(statement) compiles: once per statement object. Weak keys: a statement built
    # per call is collected, and an id() could be reused by another one.
    names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def name_of(statement: Any, prefix: str = "") -> str:
        name = names.get(statement)
        if name is None:
            text = " ".join(str(statement).split())
            # An UPDATE built without values prints every column in its SET list: the
            # WHERE clause is what tells two of them apart.
            text = re.sub(r"^(UPDATE \S+ SET) .*? (WHERE|RETURNING) ", r"\1 ... \2 ", text)
            name = names[statement] = prefix + text[:140]
        return name

    def tally(name: str, calls: int, started: float) -> None:
        entry = stats.setdefault(name, [0, 0.0])
        entry[0] += calls
        entry[1] += time.perf_counter() - started

    run, run_many, commit = InlineConnection.run, InlineConnection.run_many, InlineConnection.commit

    def timed_run(self: InlineConnection, statement: Any, parameters: Any = None) -> Any:
        started = time.perf_counter()
        result = run(self, statement, parameters)
        tally(name_of(statement), 1, started)
        return result

    def timed_run_many(self: InlineConnection, statement: Any, parameters: Any) -> Any:
        started = time.perf_counter()
        result = run_many(self, statement, parameters)
        tally(name_of(statement, "(many) "), len(parameters), started)
        return result

    def timed_commit(self: InlineConnection) -> None:
        started = time.perf_counter()
        commit(self)
        tally("COMMIT", 1, started)

    patches: dict[str, Callable[..., Any]] = {
        "run": timed_run,
        "run_many": timed_run_many,
        "commit": timed_commit,
    }
    for attr, fn in patches.items():
        setattr(InlineConnection, attr, fn)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "-o" or args[2] != "-m":
        raise SystemExit("usage: python -m bench.sqltrace -o OUT.json -m MODULE [ARGS...]")
    out, module = args[1], args[3]
    stats: dict[str, list[float]] = {}
    install(stats)

    def dump() -> None:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(stats, f)

    atexit.register(dump)
    sys.argv = [module, *args[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
