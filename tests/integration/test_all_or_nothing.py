"""All or nothing, by enumeration: a database fault at each statement of each write path.

The README promises nothing half-written and nothing accepted lost: every state change is
one transaction, its audit rows in it. For each write path below, on SQLite and on
PostgreSQL (there, but for the plain REST turn, in the long form: ``-m long``):

1. the operation runs once on a fresh copy of a prepared database, its statements
   counted (n) and the committed state taken at each transaction boundary;
2. for each k in 1..n, on a fresh copy, statement k fails as a real I/O error does
   (:mod:`tests.statement_faults`: the driver's own error, from its ``execute``; inside
   a SQLite write transaction once more with the transaction rolled back first; on
   PostgreSQL each statement that commits once more, carried out and its answer lost:
   a commit in doubt): the operation must fail the documented way, and every table must
   then hold the state of one of the clean run's boundaries (before it, or after one of
   its commits), never something in between;
3. the operation then runs again without the fault and must end where the clean run
   ended (nothing lost, nothing doubled, nothing left under a lease), or, after a commit
   in doubt, may find its work done and say so (``WritePath.found_done``).

The default suite runs the bounded form of step 2 (:func:`_bounded`: every commit, each
statement of a write transaction in one of its two ways, every other read; about half
the runs); ``-m long`` fails every statement every way (``-m "long or not long"``: on
both backends, every path).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from aiohttp import ClientResponse

from leadgate.app import App
from leadgate.core.errors import Conflict, Unavailable
from leadgate.core.runners import Runner, drain
from leadgate.core.types import BUSY_RULE, Gated
from leadgate.database import schema as t
from leadgate.operations.admin import Admin
from leadgate.review import destinations
from leadgate.runners.recovery import TurnRecovery
from tests.helpers import (
    Anonymizer,
    Org,
    item_audit,
    item_row,
    make_agent,
    make_org,
    make_route,
    session_item,
    slack_trigger,
)
from tests.pg import PostgresServer
from tests.serving import Client, served_app
from tests.standins.slack_api import SlackApiStandin, signed_headers
from tests.statement_faults import PgFaults, SqliteFaults

#: Every path runs on SQLite, and on PostgreSQL too (a database made per run costs
#: ~0.1 s there). A Slack event's turn tries its last transaction again after back-offs
#: (up to 5 s each) that its test makes instant (``WritePath.sleep``).
BOTH = pytest.mark.parametrize(
    "db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
#: The other paths' PostgreSQL runs are the long form (``-m long``): 5-17 s each there,
#: about 80 s in all on two CPUs, while the SQLite runs take every path in CI and the
#: plain turn's PostgreSQL run keeps the injector on that backend checked.
BOTH_LONG = pytest.mark.parametrize(
    "db_url",
    ["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.long])],
    indirect=True,
)

#: Columns equal in no two runs: a hash of a random secret; the ``ts`` the Slack
#: stand-in gave a post (from its wall clock; the posts it took are counted instead).
_RANDOM = {("api_keys", "secret_hash"), ("deliveries", "external_id")}

Dump = dict[str, list[tuple[Any, ...]]]


class CountedIds:
    """Ids in creation order from ``start`` (16 hex digits, as :class:`Anonymizer`
    knows them): every run of one operation makes the same ids in the same order."""

    def __init__(self, start: int) -> None:
        self.next = start

    def new(self, prefix: str) -> str:
        self.next += 1
        return f"{prefix}_{self.next:016x}"


#: A stored completion's ``created``: the wall clock's seconds (not the service's clock).
_CREATED = re.compile(r'"created": [0-9]+')


#: asyncpg names a transaction's savepoints after an object's id: another in each run.
_SAVEPOINT = re.compile(r"__asyncpg_savepoint_[0-9a-f]+__")


def _same_sql(sql: str | None) -> str | None:
    return None if sql is None else _SAVEPOINT.sub("__asyncpg_savepoint__", sql)


def _same_second(value: Any) -> Any:
    return _CREATED.sub('"created": 0', value) if isinstance(value, str) else value


def dump(connect: Callable[..., sqlite3.Connection], path: str) -> Dump:
    """Every row of every table of the schema, in insertion order."""
    conn = connect(path)
    try:
        out: Dump = {}
        for table in t.metadata.sorted_tables:
            cols = [c.name for c in table.columns if (table.name, c.name) not in _RANDOM]
            names = ", ".join(f'"{c}"' for c in cols)
            rows = conn.execute(f'SELECT {names} FROM "{table.name}" ORDER BY rowid')
            out[table.name] = [tuple(map(_same_second, row)) for row in rows]
        return out
    finally:
        conn.close()


def comparable(state: Dump) -> dict[str, list[Any]]:
    """``state`` with its ids numbered by first appearance (in strings too), for
    comparing two runs that made different ids."""
    anonymize = Anonymizer()
    return {
        name: [tuple(anonymize.within(v) for v in row) for row in rows]
        for name, rows in state.items()
    }


def differences(a: Dump, b: Dump) -> str:
    """The tables where ``a`` and ``b`` differ, for an assertion's message."""
    lines = []
    for name in a:
        if a[name] != b[name]:
            lines.append(f"{name}:\n  {a[name]}\n  {b[name]}")
    return "\n".join(lines)


@dataclass
class Served:
    """One run's service, its client and the faults of its database."""

    app: App
    client: Client
    faults: SqliteFaults | PgFaults
    url: str
    ctx: Any


Operation = Callable[[Served], Awaitable[Any]]


@dataclass
class WritePath:
    """A write path: ``prepare`` once (on the template), then ``operation`` per run;
    ``failed`` checks what a run that met the fault answered; ``again`` is what the
    client (or the runner's next pass) does afterwards (default: ``operation``)."""

    prepare: Callable[[Served], Awaitable[Any]]
    operation: Operation
    succeeded: Callable[[Any], None]
    failed: Callable[[Any], None]
    again: Operation | None = None
    config: dict[str, Any] = field(default_factory=dict)
    #: whether a failure is one the client is told not to retry (the work was taken in
    #: and the rest of it given up, as documented): the operation again must then answer
    #: the same and change nothing
    final: Callable[[Any], bool] = lambda _outcome: False
    #: what an answer kept beside the work writes (an Idempotency-Key's stored answer:
    #: a plain 200 in the work's own last transaction, an error after the work, in a
    #: transaction of its own), taken out of both sides
    #: when a state at the fault is compared with the clean run's
    answer: Callable[[Dump], Dump] = lambda state: state
    #: after a final failure: what the service does next by itself (a runner's pass),
    #: and the check of the state it leaves
    recover: Operation | None = None
    recovered: Callable[[Dump, Dump], None] = lambda _before, _after: None
    #: what the operation did outside the database (posts a stand-in took), counted:
    #: each run with its fault and the run again must do what the clean run did, once
    effects: Callable[[], int] = lambda: 0
    #: extra ``served_app`` arguments (``adapters``)
    adapters: bool = False
    #: after a commit in doubt: whether the operation again found its work done and
    #: said so (a documented answer naming its rule); it must then have changed nothing
    #: (nothing taken in or done twice)
    found_done: Callable[[Any], bool] = lambda _outcome: False
    #: PostgreSQL: whether each commit is also run with its answer lost (in doubt); off
    #: where the enumeration cannot tell the documented outcome from a wrong one yet
    doubt: bool = True
    #: the turn path's back-off between tries of a recorded turn's last transaction
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


class SqliteFiles:
    """Each run's database: a copy of a file prepared once (from the migrated template)."""

    whole_transactions = True
    #: (SQLite's COMMIT is a call into the same process: its answer is never lost)
    commits_in_doubt = False
    #: False: the bounded form (see :func:`_bounded`)
    every_statement = True

    def __init__(self, template: str, tmp: Path) -> None:
        self.template, self.tmp = template, tmp

    def database(self, name: str) -> str:
        """The URL of a copy of the prepared file (``base``: the prepared file itself,
        copied from the template)."""
        path = str(self.tmp / f"{name}.db")
        shutil.copyfile(self.template if name == "base" else str(self.tmp / "base.db"), path)
        return f"sqlite+aiosqlite:///{path}"

    def faults(self, url: str, patch: pytest.MonkeyPatch) -> SqliteFaults:
        return SqliteFaults(_path(url), patch)

    async def dump(self, url: str) -> Dump:
        return dump(sqlite3.connect, _path(url))

    def watch(self, faults: SqliteFaults | PgFaults, url: str, settled: list[Dump]) -> None:
        """Keep the state after each commit in ``settled``, taken as it commits."""
        assert isinstance(faults, SqliteFaults)

        def on_settled() -> None:
            state = dump(faults.real_connect, _path(url))
            if state != settled[-1]:
                settled.append(state)

        faults.on_settled = on_settled

    def drop(self, url: str) -> None:
        """Nothing: the files go with the test's directory."""


def _path(url: str) -> str:
    return url.removeprefix("sqlite+aiosqlite:///")


class PgDatabases:
    """Each run's database: a PostgreSQL database made from a prepared one (``CREATE
    DATABASE ... TEMPLATE``), dropped after the run."""

    whole_transactions = False  # (a dropped connection always loses the transaction)
    commits_in_doubt = True
    every_statement = True

    def __init__(self, server: PostgresServer, migrated: str) -> None:
        self.server = server
        self.migrated = migrated.rsplit("/", 1)[1].split("?")[0]
        self.prefix = f"aon_{uuid.uuid4().hex[:8]}"

    def database(self, name: str) -> str:
        source = self.migrated if name == "base" else f"{self.prefix}_base"
        target = f"{self.prefix}_{name}"
        self.server.psql(
            f'CREATE DATABASE "{target}" TEMPLATE "{source}" STRATEGY = FILE_COPY',
            database=self.server.database,
        )
        return self.server.url_for(target)

    def faults(self, url: str, patch: pytest.MonkeyPatch) -> PgFaults:
        return PgFaults(patch)

    async def dump(self, url: str) -> Dump:
        conn = await asyncpg.connect(self.server.dsn(url.rsplit("/", 1)[1].split("?")[0]))
        try:
            out: Dump = {}
            for table in t.metadata.sorted_tables:
                cols = [c.name for c in table.columns if (table.name, c.name) not in _RANDOM]
                names = ", ".join(f'"{c}"' for c in cols)
                order = ", ".join(f'"{c.name}"' for c in table.primary_key.columns)
                rows = await conn.fetch(f'SELECT {names} FROM "{table.name}" ORDER BY {order}')
                out[table.name] = [tuple(map(_same_second, row)) for row in rows]
            return out
        finally:
            await conn.close()

    def watch(self, faults: SqliteFaults | PgFaults, url: str, settled: list[Dump]) -> None:
        """Keep the state after each commit (and each statement outside a
        transaction) in ``settled``."""
        assert isinstance(faults, PgFaults)

        async def on_settled() -> None:
            state = await self.dump(url)
            if state != settled[-1]:
                settled.append(state)

        faults.on_settled = on_settled

    def drop(self, url: str) -> None:
        self.server.drop_database(url.rsplit("/", 1)[1].split("?")[0])


Backend = SqliteFiles | PgDatabases


@asynccontextmanager
async def serve(
    backend: Backend, name: str, write: WritePath, monkeypatch: pytest.MonkeyPatch, ctx: Any
) -> AsyncIterator[Served]:
    url = backend.database(name)
    try:
        with monkeypatch.context() as patch:
            faults = backend.faults(url, patch)
            async with served_app(
                url,
                config=write.config,
                # The runs' ids never meet the prepared ones.
                ids=CountedIds((1 if ctx is None else 2) << 40),
                adapters=write.adapters,
                sleep=write.sleep,
            ) as (app, client):
                yield Served(app, client, faults, url, ctx)
    finally:
        if name != "base":
            backend.drop(url)


def _bounded(
    runs: list[tuple[int, str]], statements: list[str], in_write: list[bool]
) -> list[tuple[int, str]]:
    """The runs of the bounded form (the default suite; ``-m long`` takes every run):
    every commit, in doubt or failed, and every statement of a write transaction once
    (an odd one failed alone, an even one with its transaction rolled back), but of the
    statements outside a write transaction (reads, where a fault is the plainest case)
    only every other one. About half the runs, and every way a write can end."""

    def kept(k: int, mode: str) -> bool:
        sql = statements[k - 1]
        if mode == "d" or _commits(sql, in_write[k - 1]):
            return True
        if not in_write[k - 1]:
            return k % 2 == 1
        whole = any(m == "w" and j == k for j, m in runs)
        return (k % 2 == 0) == (mode == "w") if whole else True

    return [(k, mode) for k, mode in runs if kept(k, mode)]


async def enumerate_faults(
    write: WritePath, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> int:
    """Steps 1 to 3 of the module's docstring for ``write``; the statements counted (in
    the bounded form, ``every_statement`` false, a part of them is failed: see
    :func:`_bounded`)."""
    async with serve(backend, "base", write, monkeypatch, None) as served:
        ctx = await write.prepare(served)

    # 1. The clean run: its statements and its boundaries.
    async with serve(backend, "clean", write, monkeypatch, ctx) as run:
        boundaries = [await backend.dump(run.url)]
        backend.watch(run.faults, run.url, boundaries)
        run.faults.arm(None)
        effects = write.effects()
        write.succeeded(await write.operation(run))
        effects = write.effects() - effects
        run.faults.disarm()
        n = run.faults.count
        statements, in_write = run.faults.statements, run.faults.in_write
        end = await backend.dump(run.url)
    assert end == boundaries[-1], differences(end, boundaries[-1])
    shapes = [comparable(write.answer(b)) for b in boundaries]
    assert n > 0
    # 2. and 3. A fault at each statement, then the operation again.
    shrugged: list[int] = []
    given_up: list[int] = []
    found: list[int] = []
    # Inside a write transaction, the fault fails the statement alone, and then (a
    # second run) rolls the whole transaction back first, as SQLite does by itself
    # after some I/O errors and a full disk (at COMMIT the service rolls back anyway).
    runs = [(k, "") for k in range(1, n + 1)]
    runs += [
        (k, "w")
        for k in range(1, n + 1)
        if backend.whole_transactions and in_write[k - 1] and statements[k - 1] != "COMMIT"
    ]
    # PostgreSQL: each statement that commits (a COMMIT, a write outside a transaction
    # block) once more, now carried out and its answer lost: a commit in doubt.
    runs += [
        (k, "d")
        for k in range(1, n + 1)
        if backend.commits_in_doubt and write.doubt and _commits(statements[k - 1], in_write[k - 1])
    ]
    if not backend.every_statement:
        runs = _bounded(runs, statements, in_write)
    for k, mode in runs:
        async with serve(backend, f"k{k}{mode}", write, monkeypatch, ctx) as run:
            before = write.effects()
            run.faults.arm(k, whole_transaction=mode == "w", after_commit=mode == "d")
            outcome = await write.operation(run)
            run.faults.disarm()
            where = f"fault at statement {k}/{n}: {statements[k - 1]}"
            if mode == "w":
                where += " (the whole transaction rolled back)"
            elif mode == "d":
                where += " (committed, its answer lost)"
            assert _same_sql(run.faults.fired) == _same_sql(statements[k - 1]), where
            state = await backend.dump(run.url)
            try:
                write.failed(outcome)
            except AssertionError as exc:
                # A fault the operation shrugs off (ending a read; a write it tries
                # again) must leave all of its work done: success with less is work
                # lost. (Storing a REST answer under its Idempotency-Key may fail: the
                # key lapses instead, see ``answer``.)
                try:
                    write.succeeded(outcome)
                except AssertionError:
                    raise AssertionError(f"{where}: {exc}") from exc
                done, want = comparable(write.answer(state)), comparable(write.answer(end))
                assert done == want, f"{where}: succeeded, not done\n" + differences(done, want)
                assert write.effects() - before == effects, where
                shrugged.append(k)
                continue
            # Up to ids: a pass may have tried again within itself, with new ids.
            seen = comparable(write.answer(state))
            assert seen in shapes, f"{where}: half-written\n" + "\n".join(
                f"-- vs boundary {i}:\n{differences(seen, b)}" for i, b in enumerate(shapes)
            )
            if write.final(outcome):
                again = await (write.again or write.operation)(run)
                try:
                    write.failed(again)
                except AssertionError:
                    # In doubt, what committed stands: an Idempotency-Key's retry replays
                    # the answer stored with the turn (told "interrupted", it had landed).
                    if mode != "d":
                        raise
                    write.succeeded(again)
                after = await backend.dump(run.url)
                assert after == state, f"{where}: again\n" + differences(after, state)
                if write.recover is not None:
                    await write.recover(run)
                    try:
                        write.recovered(state, await backend.dump(run.url))
                    except AssertionError as exc:
                        raise AssertionError(f"{where}: recovered: {exc}") from exc
                given_up.append(k)
                continue
            effects_before = write.effects()
            again = await (write.again or write.operation)(run)
            if mode == "d" and write.found_done(again):
                after = comparable(write.answer(await backend.dump(run.url)))
                assert after == seen, f"{where}: found done, and again\n" + differences(after, seen)
                assert write.effects() == effects_before, f"{where}: done again"
                found.append(k)
                continue
            try:
                write.succeeded(again)
            except AssertionError as exc:
                raise AssertionError(f"{where}: again: {exc}: {_body(again)}") from exc
            final = comparable(await backend.dump(run.url))
            assert final == comparable(end), f"{where}: not the clean end\n" + differences(
                final, comparable(end)
            )
            assert write.effects() - before == effects, f"{where}: done twice or never"
    # (Shown with -s: which faults the operation shrugged off, which it gave up on as
    # documented, which ran inside a write transaction.)
    print(f"{n} statements (ok: succeeded all the same; final: told not to retry; done: in")
    print("doubt, and its retry found it done; w: in a write transaction)")
    for k, sql in enumerate(statements, 1):
        mark = "ok   " if k in shrugged else "final" if k in given_up else "     "
        mark = "done " if k in found else mark
        mark += " w" if in_write[k - 1] else "  "
        print(f"{k:3} {mark} {' '.join(sql.split())[:150]}")
    return n


def _body(outcome: Any) -> Any:
    """What an answer said (a response's body), for an assertion's message."""
    return getattr(outcome, "_body", outcome)


#: What starts a statement that writes (outside a transaction block it commits alone).
_WRITES = ("INSERT", "UPDATE", "DELETE", "WITH")


def _commits(sql: str, in_write: bool) -> bool:
    """Whether ``sql`` ends a write transaction: a COMMIT, or a write run outside a
    transaction block (a ``WITH`` that only reads counts too: losing its answer is
    harmless, as for any read)."""
    text = sql.lstrip().upper()
    if in_write:
        return text.rstrip("; ") == "COMMIT"
    return text.startswith(_WRITES)


@pytest.fixture
def backend(migrated_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Backend:
    """Where each run's database comes from: copies of a SQLite file, or PostgreSQL
    databases made from a template."""
    made: Backend
    if migrated_url.startswith("sqlite"):
        made = SqliteFiles(_path(migrated_url), tmp_path)
    else:
        made = PgDatabases(request.getfixturevalue("postgres_server"), migrated_url)
    # The default suite runs the bounded form; ``-m long`` fails every statement.
    made.every_statement = "long" in (request.config.getoption("-m") or "")
    return made


# ------------------------------------------------------------------ REST turns


def chat(text: str, session: str, idem: str, *, model: str = "plain") -> Operation:
    async def run(served: Served) -> ClientResponse:
        org: Org = served.ctx
        headers = {
            "Authorization": f"Bearer {org.key}",
            "X-Session-Id": session,
            "Idempotency-Key": idem,
        }
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        resp = await served.client.post("/v1/chat/completions", json=body, headers=headers)
        await resp.read()
        return resp

    return run


def refused(rule: str) -> Callable[[Any], bool]:
    """409 naming ``rule``: the retry of a decision whose commit landed in doubt finds
    it done (the item or the delivery moved on) and says so."""

    def check(resp: Any) -> bool:
        return bool(resp.status == 409 and json.loads(resp._body)["error"]["rule"] == rule)

    return check


def status(code: int) -> Callable[[Any], None]:
    def check(resp: Any) -> None:
        assert resp.status == code, resp.status

    return check


def unavailable(resp: Any) -> None:
    """503 naming the rule, with Retry-After when a retry is safe."""
    assert resp.status == 503, resp.status
    body = json.loads(resp._body)
    rule = body["error"]["rule"]
    assert rule in ("service.unavailable", "turn.interrupted"), body
    if rule == "service.unavailable":
        assert int(resp.headers["Retry-After"]) >= 1


def interrupted(resp: Any) -> bool:
    """A 503 ``turn.interrupted``: the message was taken in, "do not send it again"."""
    return bool(json.loads(resp._body)["error"]["rule"] == "turn.interrupted")


def without_stored_answer(state: Dump) -> Dump:
    """``state`` with the answers stored under Idempotency-Keys taken out (the keys as
    claimed), and their leases (a claim whose intake's commit was in doubt lapses at
    once)."""
    keys = t.idempotency_keys
    names = [c.name for c in keys.columns]
    gone = {names.index("response"), names.index("lease_expires_at")}
    rows = [tuple(None if i in gone else v for i, v in enumerate(row)) for row in state[keys.name]]
    return {**state, keys.name: rows}


def answer_lost(resp: Any) -> bool:
    """409 ``idempotency.lost``: the key's first request took the message in, its answer
    is lost."""
    return bool(
        resp.status == 409 and json.loads(resp._body)["error"]["rule"] == "idempotency.lost"
    )


async def plain_agent(served: Served) -> Org:
    org = await make_org(served.app)
    await make_agent(served.app, org, "plain")
    return org


@BOTH
async def test_a_plain_rest_turn(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    write = WritePath(
        prepare=plain_agent,
        operation=chat("hello", "s1", "k-1"),
        succeeded=status(200),
        failed=unavailable,
        final=interrupted,
        answer=without_stored_answer,
        found_done=answer_lost,
    )
    n = await enumerate_faults(write, backend, monkeypatch)
    assert n > 5


async def lead_and_worker(served: Served) -> Org:
    org = await make_org(served.app)
    await make_agent(served.app, org, "lead")
    await make_agent(served.app, org, "worker", lead="lead")
    return org


def gated(resp: Any) -> None:
    """409 LEAD_REVIEW_PENDING: the work item waits for its lead (reviewQueued)."""
    assert resp.status == 409, resp.status
    assert json.loads(resp._body)["error"]["code"] == "LEAD_REVIEW_PENDING"


async def recover_turns(served: Served) -> None:
    """The ``turn-recovery`` runner's passes (the request's own run is an orphan)."""
    await drain(TurnRecovery(served.app.turns))


def column(state: Dump, table: sa.Table, name: str) -> list[Any]:
    """The values of one column of ``table`` in ``state``."""
    at = [c.name for c in table.columns if (table.name, c.name) not in _RANDOM].index(name)
    return [row[at] for row in state[table.name]]


def handed_to_a_human(before: Dump, after: Dump) -> None:
    """A REST turn cut by a fault in its live process (503 ``turn.interrupted``: the
    client sends nothing again) is taken by the recovery: a committed ``complete_task``
    signal goes to a human (README, the table of cut turns); without one the turn runs
    again and submits the item to its lead (it was closed, the item left ``inProgress``
    with nothing running it)."""
    signalled = column(before, t.work_items, "signal_turn_id") != [None]
    want = "awaitingHuman" if signalled else "reviewQueued"
    if column(before, t.work_items, "status") == ["reviewQueued"]:
        want = "reviewQueued"  # its submission committed, the answer lost: for the lead
    assert column(after, t.work_items, "status") == [want]
    assert after[t.turn_runs.name] == []


@BOTH_LONG
async def test_a_gated_rest_turn_up_to_review_queued(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = WritePath(
        prepare=lead_and_worker,
        operation=chat("ship it #complete", "g1", "k-g", model="worker"),
        succeeded=gated,
        failed=unavailable,
        final=interrupted,
        answer=without_stored_answer,
        found_done=answer_lost,
        recover=recover_turns,
        recovered=handed_to_a_human,
    )
    await enumerate_faults(write, backend, monkeypatch)


def busy(resp: Any) -> None:
    """409 LEAD_REVIEW_PENDING, rule ``turn.busy``: the session's item waits for its
    lead; the message is recorded (a ``rejectedBusy`` inbound event), not taken in."""
    assert resp.status == 409, resp.status
    assert json.loads(resp._body)["error"]["rule"] == BUSY_RULE


@BOTH_LONG
async def test_a_busy_rest_turn(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its one transaction records the rejected event: in doubt, it is read back (the
    # retry with its key took the event for a duplicate: idempotency.lost).
    write = WritePath(
        prepare=queued_for_review,
        operation=chat("and one more thing", "g1", "k-b", model="worker"),
        succeeded=busy,
        failed=unavailable,
        answer=without_stored_answer,
    )
    await enumerate_faults(write, backend, monkeypatch)


# ------------------------------------------------------------------ runners


@dataclass
class Pass:
    """How a runner's passes ended: their rounds of work, or the fault they raised."""

    worked: int = 0
    fault: Unavailable | None = None


def passes(runner_of: Callable[[App], Runner]) -> Operation:
    """The runner's passes until it finds nothing (``drain``), or until one meets a
    fault."""

    async def run(served: Served) -> Pass:
        try:
            return Pass(worked=await drain(runner_of(served.app)))
        except Unavailable as fault:
            return Pass(fault=fault)

    return run


def worked(outcome: Any) -> None:
    """No fault (a pass that commits a verdict kept in memory, or gives back a claim,
    may find nothing else to do: the state tells whether the work was done)."""
    assert isinstance(outcome, Pass) and outcome.fault is None, outcome


def met_the_fault(outcome: Any) -> None:
    assert isinstance(outcome, Pass) and outcome.fault is not None, outcome
    assert outcome.fault.rule == "service.unavailable"


async def queued_for_review(served: Served) -> Org:
    org = await lead_and_worker(served)
    resp = await chat("ship it #complete", "g1", "k-g", model="worker")(
        Served(served.app, served.client, served.faults, served.url, org)
    )
    gated(resp)
    return org


@BOTH_LONG
async def test_the_review_runners_claim_and_verdict(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = WritePath(
        prepare=queued_for_review,
        operation=passes(lambda app: app.lead_runner),
        succeeded=worked,
        failed=met_the_fault,
    )
    await enumerate_faults(write, backend, monkeypatch)


@pytest.mark.postgres
@pytest.mark.parametrize("read_back", ["works", "fails"])
async def test_a_review_claim_in_doubt_is_read_back(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, read_back: str
) -> None:
    """PostgreSQL (the default suite's form of the enumeration's claim in doubt): the
    claim lands with its answer lost. The runner reads back whether its lease token
    holds the item: it does, and the review carries on in the same pass, one ``claim``
    row (it was given back on the next pass, a ``leaseReleased`` and a second claim).
    When the read-back fails too, the pass fails and the next one gives it back."""
    faults = PgFaults(monkeypatch)
    async with served_app(migrated_pg) as (app, client):
        served = Served(app, client, faults, migrated_pg, None)
        served.ctx = await queued_for_review(served)
        item = await session_item(app, "h:g1")
        faults.arm_on(
            "WITH head AS",
            after_commit=True,
            and_on="work_items.lease_token = " if read_back == "fails" else None,
        )
        outcome = await passes(lambda app: app.lead_runner)(served)
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("WITH head AS")
        if read_back == "works":
            worked(outcome)
        else:
            met_the_fault(outcome)
            worked(await passes(lambda app: app.lead_runner)(served))
        audited = await item_audit(app, item)
        actions = [a["action"] for a in audited]
        assert actions.count("approve") == 1, actions
        if read_back == "works":
            assert actions.count("claim") == 1 and "leaseReleased" not in actions, actions
        else:
            assert actions.count("claim") == 2, actions
            released = [a["text"] for a in audited if a["action"] == "leaseReleased"]
            assert released == [
                "the claim met a database fault at its commit (it landed); the review runs again"
            ]


# ------------------------------------------------------------------ the operator API


@dataclass
class Target:
    """An organization and the id of what an operator acts on (a work item the lead
    escalated, a delivery)."""

    org: Org
    id: str


async def escalated(served: Served) -> Target:
    """An item the lead escalated, its review card posted in the review channel (a
    decision settles the card)."""
    org = await queued_with_a_review_channel(served)
    await drain(served.app.lead_runner)
    await drain(served.app.relay)
    item = await session_item(served.app, "h:e1")
    assert (await item_row(served.app, item))["status"] == "awaitingHuman"
    return Target(org, item)


def operator(route: str, action: str, body: dict[str, str] | None = None) -> Operation:
    """``POST /operator/{route}/{id}/{action}`` with the Owner key."""

    async def run(served: Served) -> ClientResponse:
        ctx: Target = served.ctx
        resp = await served.client.post(
            f"/operator/{route}/{ctx.id}/{action}",
            json=body or {},
            headers={"Authorization": f"Bearer {ctx.org.key}"},
        )
        await resp.read()
        return resp

    return run


@pytest.mark.parametrize(
    ("action", "body", "db_url"),
    [
        ("approve", None, "sqlite"),
        ("reject", {"reason": "not this way"}, "sqlite"),
        ("return", {"feedback": "once more, with sources"}, "sqlite"),
        ("cancel", None, "sqlite"),
        pytest.param("approve", None, "postgres", marks=[pytest.mark.postgres, pytest.mark.long]),
    ],
    indirect=["db_url"],
)
async def test_an_operators_decision(
    action: str,
    body: dict[str, str] | None,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    slack_api: SlackApiStandin,
) -> None:
    write = WritePath(
        prepare=escalated,
        operation=operator("reviews", action, body),
        succeeded=status(200),
        failed=unavailable,
        found_done=refused("workItem.status"),
        config=review_channel_config(slack_api),
        adapters=True,
    )
    await enumerate_faults(write, backend, monkeypatch)


# ------------------------------------------------------------------ Slack


SLACK_SECRET = "slack-signing-secret"


def slack_config(standin: SlackApiStandin) -> dict[str, Any]:
    """``[slack]`` for the Web API stand-in (token ``xoxb-x``), with no catch-up: the
    adapter's read-back at its start stores a read point (``catch_up_points``) in the
    background, which the snapshots around an operation would count as its write."""
    return {
        "slack": {
            "signing_secret": SLACK_SECRET,
            "bot_token": "xoxb-x",
            "api_url": standin.api_url,
            "catch_up_s": 0,
        }
    }


async def approved_for_slack(served: Served) -> Org:
    """A work item of a Slack thread its lead approved: its gating delivery (a post in
    the thread) is pending."""
    org = await make_org(served.app)
    await make_agent(served.app, org, "lead")
    worker = await make_agent(served.app, org, "worker", lead="lead")
    trigger = slack_trigger(org, worker, "ship it #complete", "1700000000.000100")
    assert isinstance(await served.app.turns.run(trigger), Gated)
    await drain(served.app.lead_runner)
    return org


@BOTH_LONG
async def test_the_relays_claim_and_outcome_of_a_slack_delivery(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    slack_api: SlackApiStandin,
) -> None:
    write = WritePath(
        prepare=approved_for_slack,
        operation=passes(lambda app: app.relay),
        succeeded=worked,
        failed=met_the_fault,
        config=slack_config(slack_api),
        adapters=True,
        effects=lambda: len(slack_api.posts),
    )
    await enumerate_faults(write, backend, monkeypatch)


def unknown_slack_delivery(standin: SlackApiStandin) -> Callable[[Served], Awaitable[Target]]:
    """A gating Slack delivery whose post is uncertain (the connection reset under it):
    ``deliveryUnknown``."""

    async def prepare(served: Served) -> Target:
        org = await approved_for_slack(served)
        standin.queue("reset")
        await drain(served.app.relay)
        d = t.deliveries.c
        async with served.app.db.read() as conn:
            row = (await conn.execute(sa.select(d.id, d.status))).one()
        assert row.status == "deliveryUnknown"
        return Target(org, row.id)

    return prepare


@pytest.mark.parametrize("action", ["confirm", "retry"])
@BOTH_LONG
async def test_an_operators_recovery_of_an_uncertain_delivery(
    action: str,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    slack_api: SlackApiStandin,
) -> None:
    write = WritePath(
        prepare=unknown_slack_delivery(slack_api),
        operation=operator("deliveries", action),
        succeeded=status(200),
        failed=unavailable,
        found_done=refused("delivery.status"),
        config=slack_config(slack_api),
        adapters=True,
        effects=lambda: len(slack_api.posts),
    )
    await enumerate_faults(write, backend, monkeypatch)


# ------------------------------------------------------------------ the admin CLI's keys


@dataclass
class Done:
    """How an admin command ended: its output, or the fault it stopped with."""

    output: Mapping[str, object] | None = None
    fault: Unavailable | None = None
    #: what it refused to do (a key already revoked)
    refused: Conflict | None = None


def admin(command: Callable[[Admin, Target], Awaitable[Mapping[str, object]]]) -> Operation:
    """An admin CLI command, on the service's database (the CLI's own code path:
    ``leadgate.operations.admin``)."""

    async def run(served: Served) -> Done:
        try:
            return Done(output=await command(admin_of(served), served.ctx))
        except Unavailable as fault:
            return Done(fault=fault)
        except Conflict as refusal:
            return Done(refused=refusal)

    return run


def done(outcome: Any) -> None:
    assert isinstance(outcome, Done) and outcome.output is not None, outcome


def stopped(outcome: Any) -> None:
    """``[service.unavailable]``, exit 2 (nothing written)."""
    assert isinstance(outcome, Done) and outcome.fault is not None, outcome
    assert outcome.fault.rule == "service.unavailable"


async def a_key(served: Served) -> Target:
    org = await make_org(served.app)
    return Target(org, (await admin_of(served).create_key(org.id, ["agent:review"]))["id"])


def admin_of(served: Served) -> Admin:
    app = served.app
    return Admin(app.db, app.clock, app.ids, frozenset())


@BOTH_LONG
async def test_key_create(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    write = WritePath(
        prepare=a_key,
        operation=admin(lambda a, ctx: a.create_key(ctx.org.id, ["agent:trigger"], name="ci")),
        succeeded=done,
        failed=stopped,
        # Its commit in doubt is not this Admin's to settle: the `leadgate key create`
        # command asks the server whether it landed (Database settle_doubt; tested in
        # test_cli_database_faults), and run again here it would make a second key.
        doubt=False,
    )
    await enumerate_faults(write, backend, monkeypatch)


@BOTH_LONG
async def test_key_revoke(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    write = WritePath(
        prepare=a_key,
        operation=admin(lambda a, ctx: a.revoke_key(ctx.org.id, ctx.id)),
        succeeded=done,
        failed=stopped,
        found_done=lambda outcome: (
            outcome.refused is not None and outcome.refused.rule == "key.revoked"
        ),
    )
    await enumerate_faults(write, backend, monkeypatch)


# ------------------------------------------------------------------ a Slack event


@dataclass
class Asked:
    """How a Slack message went: the answer Slack got, whether its turn was cut (left
    to ``turn-recovery``), and the fault the relay's passes met."""

    status: int
    cut: bool
    fault: Unavailable | None


def slack_event(*, retry: int | None) -> Operation:
    """Slack delivers a message in a thread (again: ``retry``); then its turn runs to
    its end in the background, the ``turn-recovery`` runner takes what a fault cut, and
    the relay posts the reply."""

    async def run(served: Served) -> Asked:
        body = json.dumps(
            {
                "type": "event_callback",
                "team_id": "T0STANDIN",
                "event_id": "Ev0000000001",
                "event": {
                    "type": "message",
                    "channel": "C0ASK",
                    "user": "U0HUMAN",
                    "text": "hello there",
                    "ts": "1700000000.000100",
                },
            }
        )
        headers = signed_headers(SLACK_SECRET, body, retry_num=retry)
        resp = await served.client.post("/slack/events", data=body.encode(), headers=headers)
        await resp.read()
        app = served.app
        # The turn's task alone: on PostgreSQL the process's own loops (its LISTEN
        # connection, the watched sessions' renewal) run in the background until it
        # stops, and waiting for them cost each run 10 s and cancelled them.
        turns = [task for task in asyncio.all_tasks() if task.get_name().startswith("slack-turn:")]
        if turns:
            await asyncio.wait(turns, timeout=10)
        cut = bool(app.turns.orphans)
        try:
            if retry is not None:
                await drain(TurnRecovery(app.turns))
                # What is cut after the recovery: a run an intake in doubt left to it
                # was taken (or, not recorded after all, forgotten).
                cut = bool(app.turns.orphans)
            await drain(app.relay)
        except Unavailable as fault:
            return Asked(resp.status, cut, fault)
        return Asked(resp.status, cut, None)

    return run


def answered(outcome: Any) -> None:
    assert isinstance(outcome, Asked), outcome
    assert (outcome.status, outcome.cut, outcome.fault) == (200, False, None), outcome


def not_taken_or_cut(outcome: Any) -> None:
    """503 (Slack delivers it again), a turn cut (recovery's), or a relay pass that met
    the fault."""
    assert isinstance(outcome, Asked), outcome
    assert outcome.status == 503 or outcome.cut or outcome.fault is not None, outcome


async def routed_to_plain(served: Served) -> Org:
    org = await make_org(served.app)
    plain = await make_agent(served.app, org, "plain")
    await make_route(served.app, org, plain["id"], "slack")
    return org


class Waits:
    """The turn path's back-off, instant: the waits it asked for, in order."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)


@BOTH_LONG
async def test_a_slack_events_intake_turn_and_reply(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    slack_api: SlackApiStandin,
) -> None:
    # The turn's last transaction is tried again after a fault (README, Reliability):
    # its back-offs (0.5 s doubling, up to 5 s; two minutes in all on PostgreSQL, where
    # each try after a dropped connection meets the next fault) are asked for, not
    # waited.
    waits = Waits()
    write = WritePath(
        prepare=routed_to_plain,
        operation=slack_event(retry=None),
        succeeded=answered,
        failed=not_taken_or_cut,
        # Slack's redelivery (a duplicate once recorded), the recovery, the relay.
        again=slack_event(retry=1),
        config=slack_config(slack_api),
        adapters=True,
        effects=lambda: len(slack_api.posts),
        sleep=waits,
    )
    await enumerate_faults(write, backend, monkeypatch)
    assert waits.asked, "no fault met the turn's last transaction"
    assert set(waits.asked) <= {0.5, 1.0, 2.0, 4.0, 5.0}, waits.asked


@pytest.mark.postgres
async def test_a_slack_redelivery_whose_commit_is_in_doubt_is_a_duplicate(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, slack_api: SlackApiStandin
) -> None:
    """PostgreSQL: Slack delivers a message taken in already, and the COMMIT of the
    transaction that found it a duplicate lands with its answer lost. A duplicate is one
    whether that commit landed or not (the event it met was committed before): Slack
    gets its 200 and nothing is done twice. It was a 503, and Slack delivered it again."""
    faults = PgFaults(monkeypatch)
    async with served_app(migrated_pg, config=slack_config(slack_api), adapters=True) as (
        app,
        client,
    ):
        served = Served(app, client, faults, migrated_pg, None)
        served.ctx = await routed_to_plain(served)
        answered(await slack_event(retry=None)(served))
        faults.arm_on("INSERT INTO inbound_events", then="COMMIT", after_commit=True)
        again = await slack_event(retry=1)(served)
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("COMMIT")
        answered(again)
        assert len(slack_api.posts) == 1


def review_channel_config(standin: SlackApiStandin) -> dict[str, Any]:
    """Slack on the stand-in, and the public URL review cards link to."""
    return {**slack_config(standin), "server": {"public_url": "https://lg.example"}}


async def queued_with_a_review_channel(served: Served) -> Org:
    """A submission the lead will escalate, in an organization whose reviews are
    announced in a Slack channel (review cards)."""
    org = await lead_and_worker(served)
    app = served.app
    async with app.db.tx() as conn:
        await destinations.add_destination(
            conn,
            app.clock,
            app.ids,
            org_id=org.id,
            agent_id=None,
            channel="slack",
            target="T0001:C0REVIEW",
        )
    with_org = Served(app, served.client, served.faults, served.url, org)
    gated(await chat("hard #escalate #complete", "e1", "k-e", model="worker")(with_org))
    return org


@BOTH_LONG
async def test_the_review_runners_escalation_and_its_review_card(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, slack_api: SlackApiStandin
) -> None:
    write = WritePath(
        prepare=queued_with_a_review_channel,
        operation=passes(lambda app: app.lead_runner),
        succeeded=worked,
        failed=met_the_fault,
        config=review_channel_config(slack_api),
        adapters=True,
    )
    await enumerate_faults(write, backend, monkeypatch)
