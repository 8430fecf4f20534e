"""Support for the outbox tests and the outbox benchmark.

* :class:`ScriptedChannel`: an in-test :class:`outbox.channel.Channel` that answers with
  scripted outcomes and records every :class:`OutboundMessage` it was given;
* :func:`seed_items`: bulk-creates approved work items (with their gating deliveries,
  exactly as an approval writes them: :meth:`outbox.store.Outbox.write_gating`) or items
  awaiting a human, thousands per second, for the relay tests, the replica and crash
  tests and the bench;
* :class:`MigratedTemplates`: databases migrated once per test session and copied
  (SQLite) or truncated (PostgreSQL) per test: a fresh migration costs about a second.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.types import BindingKind
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs
from leadgate.domain.rows import Binding
from outbox.channel import OutboundMessage, SendOutcome, Sent
from outbox.store import DeliveryStatus, action_for


def binding_row(
    binding_id: str,
    kind: str = "slack",
    address: dict[str, Any] | None = None,
    silent: bool = False,
) -> Binding:
    """An active binding row for enqueue tests (no session behind it)."""
    return Binding(binding_id, "org_x", "ses_x", kind, address or {}, silent, None, True, 0)


# --------------------------------------------------------------------------- channel

Script = SendOutcome | BaseException | Callable[[OutboundMessage], Any]


class ScriptedChannel:
    """A fake channel: each ``send`` takes the next scripted answer (``Sent`` with a
    made-up id when the script is empty). An answer may be an outcome, an exception to
    raise, or a callable (sync or async) given the message and returning the outcome.

    ``gate``: when set, every send waits for it first (to hold sends "in flight").
    ``delay_s``: every send sleeps this long (to exercise concurrency).
    """

    def __init__(
        self,
        name: str = "slack",
        *,
        max_chars: int = 40_000,
        script: Sequence[Script] = (),
        delay_s: float = 0.0,
    ) -> None:
        self.name = name
        self.max_chars = max_chars
        self.script: list[Script] = list(script)
        self.delay_s = delay_s
        self.calls: list[OutboundMessage] = []
        self.updates: list[tuple[str, OutboundMessage]] = []
        self.update_script: list[SendOutcome] = []
        self.gate: asyncio.Event | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    async def send(self, message: OutboundMessage) -> SendOutcome:
        self.calls.append(message)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            answer: Any = self.script.pop(0) if self.script else Sent(f"ext-{len(self.calls)}")
            if isinstance(answer, BaseException):
                raise answer
            if callable(answer):
                answer = answer(message)
                if asyncio.iscoroutine(answer):
                    answer = await answer
            return answer  # type: ignore[no-any-return]
        finally:
            self.in_flight -= 1

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """A card edit: recorded in ``updates`` (the edited id with the message);
        ``update_script`` answers like ``script`` (default ``Sent``)."""
        self.updates.append((external_id, message))
        answer: Any = self.update_script.pop(0) if self.update_script else Sent(external_id)
        return answer  # type: ignore[no-any-return]

    async def close(self) -> None:
        self.closed = True

    def texts(self) -> list[str]:
        return [m.text for m in self.calls]


# ----------------------------------------------------------------------------- seeding


@dataclass
class Seeded:
    """What :func:`seed_items` made."""

    org_id: str
    worker_id: str
    lead_id: str
    items: list[dict[str, Any]] = field(default_factory=list)
    deliveries: list[dict[str, Any]] = field(default_factory=list)


def slack_address(i: int) -> dict[str, Any]:
    """A Slack thread per item (channels spread over a few ids)."""
    return {"team": "T1", "channel": f"C{i % 7}", "thread_ts": f"1700000000.{i:06d}"}


async def make_org_and_agents(
    db: Database, clock: Clock, ids: IdFactory, name: str | None = None
) -> tuple[str, str, str]:
    """An organization with a lead and a worker reviewed by it: (org, worker, lead)."""
    async with db.tx() as conn:
        org = await orgs.create_org(conn, clock, ids, name or f"org-{uuid.uuid4().hex[:10]}")
        lead = await agents_mod.save_agent(conn, clock, ids, org["id"], name="lead", model="script")
        worker = await agents_mod.save_agent(
            conn, clock, ids, org["id"], name="worker", model="script", lead="lead"
        )
    return str(org["id"]), worker.id, lead.id


async def seed_items(
    db: Database,
    clock: Clock,
    ids: IdFactory,
    n: int,
    *,
    status: str = "approved",
    kind: BindingKind = BindingKind.slack,
    silent: bool = False,
    address: Callable[[int], dict[str, Any]] = slack_address,
    text: Callable[[int], str] = lambda i: f"approved output #{i}",
    org: tuple[str, str, str] | None = None,
    next_attempt_at: int | None = None,
    with_deliveries: bool = True,
    chunk: int = 500,
) -> Seeded:
    """``n`` work items in ``status`` (``approved`` or ``awaitingHuman``), one session
    and active binding each, with the gated assistant message; approved items get their
    gating delivery (action and channel from :func:`outbox.store.action_for`) unless
    ``with_deliveries`` is false."""
    org_id, worker_id, lead_id = org or await make_org_and_agents(db, clock, ids)
    seeded = Seeded(org_id, worker_id, lead_id)
    now = clock.now_ms()
    due = now if next_attempt_at is None else next_attempt_at
    for start in range(0, n, chunk):
        sessions, bindings, messages, items, deliveries = [], [], [], [], []
        for i in range(start, min(n, start + chunk)):
            session_id, binding_id = ids.new("ses"), ids.new("bnd")
            message_id, item_id = ids.new("msg"), ids.new("wi")
            body = text(i)
            binding = Binding(
                id=binding_id,
                org_id=org_id,
                session_id=session_id,
                kind=kind.value,
                address=address(i) if kind.is_channel else {},
                silent=silent,
                route_id=None,
                active=True,
                created_at=now,
            )
            sessions.append(
                {
                    "id": session_id,
                    "org_id": org_id,
                    "agent_id": worker_id,
                    "key": f"seed:{session_id}",
                    "created_at": now,
                }
            )
            bindings.append(binding._asdict())
            messages.append(
                {
                    "id": message_id,
                    "org_id": org_id,
                    "session_id": session_id,
                    "work_item_id": item_id,
                    "role": "assistant",
                    "content": body,
                    "lead_gated": True,
                    "tool_name": None,
                    "created_at": now,
                }
            )
            item = {
                "id": item_id,
                "org_id": org_id,
                "agent_id": worker_id,
                "session_id": session_id,
                "lead_agent_id": lead_id,
                "status": status,
                "completion_policy": "requestHumanApproval",
                "max_revision_rounds": 3,
                "revision": 0,
                "extra_allowance": 0,
                "task_context": f"task #{i}",
                "summary": f"Summary: task #{i}",
                "snapshot": body,
                "gated_message_id": message_id,
                "binding_id": binding_id,
                "lease_expiries": 0,
                "last_activity_at": now,
                "created_at": now,
                "updated_at": now,
            }
            items.append(item)
            if status == "approved" and with_deliveries:
                action, channel = action_for(binding)
                deliveries.append(
                    {
                        "id": ids.new("dlv"),
                        "org_id": org_id,
                        "work_item_id": item_id,
                        "kind": "gating",
                        "action": action,
                        "channel": channel,
                        "binding_id": binding_id,
                        "address": binding.address,
                        "text": body,
                        "status": (
                            DeliveryStatus.continuation
                            if action == "continuation"
                            else DeliveryStatus.pending
                        ).value,
                        "attempts": 0,
                        "next_attempt_at": due,
                        "created_at": now,
                        "updated_at": now,
                    }
                )
        async with db.tx() as conn:
            await conn.execute(t.sessions.insert(), sessions)
            await conn.execute(t.bindings.insert(), bindings)
            await conn.execute(t.messages.insert(), messages)
            await conn.execute(t.work_items.insert(), items)
            if deliveries:
                await conn.execute(t.deliveries.insert(), deliveries)
        seeded.items.extend(items)
        seeded.deliveries.extend(deliveries)
    return seeded


async def delivery_counts(db: Database) -> dict[str, int]:
    """Deliveries per status."""
    async with db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.deliveries.c.status, sa.func.count().label("n")).group_by(
                    t.deliveries.c.status
                )
            )
        ).all()
    return {str(r.status): int(r.n) for r in rows}


# ---------------------------------------------------------------- migrated templates


class MigratedTemplates:
    """Migrated databases for the outbox tests: a SQLite file migrated once and copied
    per test; a PostgreSQL database migrated once and truncated per test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._sqlite: Path | None = None
        self._pg_template: str | None = None

    def sqlite_url(self, target: Path) -> str:
        from leadgate.database.db import upgrade

        if self._sqlite is None:
            path = self.workdir / "template.db"
            upgrade(f"sqlite+aiosqlite:///{path}")
            self._sqlite = path
        shutil.copyfile(self._sqlite, target)
        return f"sqlite+aiosqlite:///{target}"

    def pg_url(self, server: Any) -> str:
        """A migrated PostgreSQL database, emptied for this test.

        One database per test session, truncated per test: creating a database from a
        template forces checkpoints and takes about a second on a busy machine.
        """
        from leadgate.database.db import upgrade

        if self._pg_template is None:
            name = f"outbox_{uuid.uuid4().hex[:8]}"
            upgrade(server.create_database(name))
            self._pg_template = name
        tables = ", ".join(f'"{table.name}"' for table in t.metadata.sorted_tables)
        server.psql(f"TRUNCATE {tables} RESTART IDENTITY CASCADE", database=self._pg_template)
        return str(server.url_for(self._pg_template))


# ------------------------------------------------------------------ subprocesses

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    return env


def _read_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line of ``proc`` starting with ``prefix`` (others are skipped)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{proc.args!r} printed no {prefix!r} line in {timeout} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.args!r} exited ({proc.wait()}) before {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


class StandinProcess:
    """``python -m tests.standins.slack_api`` in its own process, and its control API."""

    def __init__(self, *, latency_ms: int = 0, token: str = "xoxb-standin") -> None:
        self.token = token
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.standins.slack_api",
                "--port",
                "0",
                "--latency-ms",
                str(latency_ms),
                "--token",
                token,
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(_read_line(self.proc, "LISTENING ", 30))
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.base_url}/api/"

    def _call(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def posts(self) -> list[dict[str, Any]]:
        return list(self._call("/_standin/posts"))

    def requests(self) -> list[dict[str, Any]]:
        return list(self._call("/_standin/requests"))

    def queue(self, *modes: str) -> None:
        self._call("/_standin/modes", {"queue": list(modes)})

    def reset(self) -> None:
        self._call("/_standin/reset", {})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RelayProcess:
    """``python -m tests.relay_proc`` (see that module)."""

    def __init__(self, db_url: str, slack_url: str, **options: Any) -> None:
        args = [sys.executable, "-m", "tests.relay_proc", "--db", db_url, "--slack-url", slack_url]
        for key, value in options.items():
            args += ["--" + key.replace("_", "-"), str(value)]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
        self.stats: dict[str, int] | None = None

    def wait_ready(self, timeout: float = 60) -> None:
        _read_line(self.proc, "READY", timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30) -> dict[str, int]:
        """SIGTERM, then the process's own count of outcomes."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.stats = json.loads(_read_line(self.proc, "STATS ", timeout))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
        return self.stats or {}
