"""Scheduled triggers through the real service (``leadgate schedule add`` + ``serve``).

A cron firing cannot be waited for in a test, so schedules are added through the CLI with
a yearly cron (``0 0 1 1 *``, so that nothing fires again by itself during the test) and
their ``next_fire_at`` is then moved into the past directly in the database: the
schedule runner fires them on its next poll (``poll_interval_s = 0.2``).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.acceptance.channel_kit import (
    FAST_RUNNERS,
    Operator,
    Standin,
    admin_batch,
    logs_on_failure,
    prepared_service,
    stays,
    turn_counts,
    wait_until,
)
from tests.pg import PostgresServer
from tests.service_proc import Demo, DemoTemplate, ServiceProcess

YEARLY = "0 0 1 1 *"
SLACK_TOKEN = "xoxb-schedules"


def schedule(org: str, agent: str, message: str) -> list[str]:
    return [
        "schedule",
        "add",
        "--org",
        org,
        "--agent",
        agent,
        "--cron",
        YEARLY,
        "--message",
        message,
    ]


def now_ms() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------ SQLite, one process


class Db:
    """Read-only look into the service's SQLite file (WAL: safe while it runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            return list(conn.execute(sql, args).fetchall())
        finally:
            conn.close()

    def write(self, sql: str, *args: Any) -> None:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            with conn:
                conn.execute(sql, args)
        finally:
            conn.close()


@pytest.fixture(scope="module")
def slack_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    log_dir = tmp_path_factory.mktemp("slack")
    with Standin("slack_api", "--token", SLACK_TOKEN, log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def fired(
    demo_template: DemoTemplate,
    tmp_path_factory: pytest.TempPathFactory,
    service_guard: Any,
    slack_api: Standin,
) -> Iterator[tuple[ServiceProcess, dict[str, Any]]]:
    """A service whose three schedules were due when it started.

    Slack is configured (a stand-in) so that a scheduled delivery that wrongly posted
    would be seen there.
    """
    org = demo_template.demo.org
    marker = uuid.uuid4().hex[:10]
    messages = {
        "complete": f"nightly report {marker}-complete #complete",
        "escalate": f"weekly audit {marker}-escalate #complete #escalate",
        "plain": f"good morning {marker}-plain",
    }
    proc = prepared_service(
        demo_template,
        tmp_path_factory.mktemp("svc-schedules"),
        config={
            **FAST_RUNNERS,
            "slack": {
                "signing_secret": "unused-secret",
                "bot_token": SLACK_TOKEN,
                "api_url": f"{slack_api.url}/api/",
            },
        },
    )
    complete, escalate, plain = admin_batch(
        proc,
        [
            schedule(org, "worker", messages["complete"]),
            schedule(org, "worker", messages["escalate"]),
            schedule(org, "plain", messages["plain"]),
        ],
    )
    ids = {"complete": complete["id"], "escalate": escalate["id"], "plain": plain["id"]}
    assert proc.sqlite_file is not None
    db = Db(proc.sqlite_file)
    # Not due by themselves (next 1 January) ...
    assert all(row[0] > now_ms() for row in db.rows("SELECT next_fire_at FROM schedules"))
    # ... so make them due: the service fires them once it runs.
    db.write("UPDATE schedules SET next_fire_at = ?", now_ms() - 60_000)
    with service_guard(proc.start()):
        yield proc, {"db": db, "ids": ids, "marker": marker, "messages": messages}


def events_of(db: Db, schedule_id: str) -> list[tuple[Any, ...]]:
    return db.rows(
        "SELECT id, outcome, session_id, work_item_id FROM inbound_events "
        "WHERE external_event_id LIKE ?",
        f"schedule:{schedule_id}:%",
    )


def test_due_schedule_runs_the_worker_with_the_scheduled_binding(
    fired: tuple[ServiceProcess, dict[str, Any]], slack_api: Standin
) -> None:
    proc, ctx = fired
    op = Operator(proc)
    db: Db = ctx["db"]
    schedule_id = ctx["ids"]["complete"]

    detail = op.wait_item(f"{ctx['marker']}-complete", "completed")
    assert detail["taskContext"] == ctx["messages"]["complete"]
    assert detail["snapshot"] == f"Echo: {ctx['messages']['complete']}"
    # Marked sent, no channel message.
    assert [(d["action"], d["status"], d["channel"]) for d in detail["deliveries"]] == [
        ("scheduled", "sent", "scheduled")
    ]
    (session_key,) = db.rows(
        "SELECT s.key FROM sessions s JOIN work_items w ON w.session_id = s.id WHERE w.id = ?",
        detail["id"],
    )[0]
    assert session_key == f"schedule:{schedule_id}"
    kind, address, active = db.rows(
        "SELECT b.kind, b.address, b.active FROM bindings b "
        "JOIN work_items w ON w.session_id = b.session_id WHERE w.id = ?",
        detail["id"],
    )[0]
    assert (kind, json.loads(address), active) == ("scheduled", {"scheduleId": schedule_id}, 1)
    assert len(events_of(db, schedule_id)) == 1
    # The next firing is the next cron time (1 January), not another one now.
    (next_fire,) = db.rows("SELECT next_fire_at FROM schedules WHERE id = ?", schedule_id)[0]
    assert next_fire > now_ms()
    stays(lambda: not slack_api.records("requests"), what="nothing posted to Slack")


def test_escalated_scheduled_item_is_marked_sent_after_human_approval(
    fired: tuple[ServiceProcess, dict[str, Any]], slack_api: Standin
) -> None:
    proc, ctx = fired
    op = Operator(proc)
    item = op.wait_item(f"{ctx['marker']}-escalate", "awaitingHuman")
    assert item["id"] in [r["id"] for r in op.reviews()]
    op.decide(item["id"], "approve")
    detail = op.wait_item(f"{ctx['marker']}-escalate", "completed")
    assert [(d["action"], d["status"]) for d in detail["deliveries"]] == [("scheduled", "sent")]
    assert len(events_of(ctx["db"], ctx["ids"]["escalate"])) == 1
    assert not slack_api.records("requests")


def test_scheduled_plain_turn_posts_nothing(
    fired: tuple[ServiceProcess, dict[str, Any]], slack_api: Standin
) -> None:
    proc, ctx = fired
    db: Db = ctx["db"]
    schedule_id = ctx["ids"]["plain"]
    events = wait_until(lambda: events_of(db, schedule_id), what="the plain firing")
    assert [(e[1], e[3]) for e in events] == [("accepted", None)]  # no lead: no work item
    session_id = events[0][2]
    wait_until(
        lambda: (
            db.rows(
                "SELECT content FROM messages WHERE session_id = ? AND role = 'assistant'",
                session_id,
            )
            == [(f"Echo: {ctx['messages']['plain']}",)]
        ),
        what="the plain turn's reply",
    )
    assert db.rows("SELECT kind FROM bindings WHERE session_id = ?", session_id) == [("scheduled",)]
    # A plain reply on a scheduled binding is not queued anywhere.
    assert db.rows(
        "SELECT count(*) FROM deliveries WHERE binding_id IN "
        "(SELECT id FROM bindings WHERE session_id = ?)",
        session_id,
    ) == [(0,)]
    stays(
        lambda: len(events_of(db, schedule_id)) == 1 and not slack_api.records("requests"),
        what="one firing, nothing posted",
    )
    assert turn_counts(proc).get("duplicate", 0) == 0


# ------------------------------------------------------ PostgreSQL, two worker processes


def test_each_firing_runs_once_with_two_worker_processes(
    pg_url: str, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    database = make_url(pg_url).database
    assert database

    def sql(query: str) -> list[list[str]]:
        out = postgres_server.psql(query, database=database)
        return [line.split("|") for line in out.splitlines() if line.strip()]

    first = ServiceProcess(tmp_path / "worker-1", database_url=pg_url, config=FAST_RUNNERS)
    workers = [f"report {i} #complete" for i in range(4)]
    plains = [f"hello {i}" for i in range(2)]
    # db upgrade, demo and the schedules through the CLI code, in one child process.
    _, demo_out, *created = admin_batch(
        first,
        [["db", "upgrade"], ["demo", "--name", "demo"]]
        + [schedule("demo", "worker", m) for m in workers]
        + [schedule("demo", "plain", m) for m in plains],
    )
    demo = first.demo = Demo.from_cli(demo_out)
    worker_ids = [c["id"] for c in created[: len(workers)]]
    all_ids = [c["id"] for c in created]
    second = ServiceProcess(tmp_path / "worker-2", database_url=pg_url, config=FAST_RUNNERS)
    second.demo = demo

    def firings() -> dict[str, int]:
        rows = sql(
            "SELECT split_part(external_event_id, ':', 2), count(*) FROM inbound_events "
            "WHERE external_event_id LIKE 'schedule:%' GROUP BY 1"
        )
        return {r[0]: int(r[1]) for r in rows}

    def items() -> list[list[str]]:
        return sql(
            "SELECT w.id, w.status, s.key FROM work_items w "
            "JOIN sessions s ON s.id = w.session_id ORDER BY w.created_at"
        )

    def settled(rounds: int) -> bool:
        done = [i for i in items() if i[1] == "completed"]
        return firings() == {i: rounds for i in all_ids} and len(done) == rounds * len(workers)

    with first.start(role="worker"), second.start(role="worker"), logs_on_failure(first, second):
        for rounds in (1, 2):
            # Both processes poll every 0.2 s: they race for every due firing.
            sql(f"UPDATE schedules SET next_fire_at = {now_ms() - 1000}")
            wait_until(partial(settled, rounds), what=f"round {rounds} of firings")
            stays(partial(settled, rounds), seconds=1.0, what="no second run of a firing")

        # One work item per worker firing, each completed with one scheduled delivery.
        rows = items()
        assert sorted(r[2] for r in rows) == sorted(
            f"schedule:{i}" for i in worker_ids for _ in range(2)
        )
        deliveries = sql(
            "SELECT work_item_id, action, status, channel FROM deliveries ORDER BY work_item_id"
        )
        assert sorted(d[0] for d in deliveries) == sorted(r[0] for r in rows)
        assert {(d[1], d[2], d[3]) for d in deliveries} == {("scheduled", "sent", "scheduled")}
        # Across both processes: exactly one turn per firing. A firing is taken in before
        # its schedule moves on (so a crash cannot lose it): the other process may try
        # it once meanwhile, and its intake refuses it as a duplicate.
        totals: dict[str, float] = {}
        for proc in (first, second):
            for outcome, count in turn_counts(proc).items():
                totals[outcome] = totals.get(outcome, 0) + count
        assert totals.get("gated", 0) == 2 * len(workers)
        assert totals.get("plain", 0) == 2 * len(plains)
        assert totals.get("duplicate", 0) <= 2 * len(all_ids)
