"""Live service processes: who holds a lease, and which holders are known dead.

Every ``leadgate serve`` process registers a row in ``processes`` (host, pid, the pid's
start time) and refreshes its heartbeat every ``[runners] heartbeat_s``. A process is
known dead when

* it ran on this host (same hostname and boot) and its pid is gone, or now belongs to
  another program (the kernel's start time differs): found at once, e.g. at the restart
  after a SIGKILL; or
* its heartbeat is older than ``[runners] dead_after_s`` (another host, PostgreSQL).

:meth:`Liveness.reap` deletes the rows of dead processes. Review, revision, send and
turn-run leases name their holder (``lease_owner``); :func:`owner_gone` is the SQL
condition "its holder has no row any more", under which a runner takes a lease back at
once instead of waiting out its expiry. A process alive but stalled past
``dead_after_s`` loses its leases too; every commit is fenced by its lease token, so it
can no longer commit what it held (a post in flight then becomes ``deliveryUnknown``,
never a second post). When such a process notices its row is gone it registers anew.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.sql import insert_ignore_stmt
from leadgate.domain import wakes
from leadgate.domain.wakes import Wake

log = logging.getLogger("leadgate.processes")
P = t.processes.c


def host_key() -> str:
    """This machine as seen by pids: hostname plus the kernel's boot id (a pid is only
    meaningful within one boot of one host)."""
    boot = ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:36]
    except OSError:
        pass
    return f"{socket.gethostname()[:150]}/{boot}"


def start_token(pid: int) -> str | None:
    """The pid's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or
    ``None`` when there is no such process. Without /proc: "alive" by ``kill(pid, 0)``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    # The command name (field 2) is in parentheses and may contain spaces.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else "?"


#: A renewal run in the heartbeat's transaction (:attr:`Liveness.renewals`): the
#: connection, this process's id (the ``lease_owner`` of its leases) and the beat's time.
Renewal = Callable[[Conn, str, int], Awaitable[None]]


def owner_gone(column: Any) -> Any:
    """SQL: the lease in ``column`` names a process that is not registered (any more)."""
    return sa.and_(column.is_not(None), ~sa.exists().where(P.id == column))


class Liveness:
    """This process's row in ``processes``: register, heartbeat, reap the dead."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        *,
        role: str = "all",
        dead_after_ms: int = 30_000,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.role = role
        self.dead_after_ms = dead_after_ms
        self.host = host_key()
        self.pid = os.getpid()
        #: this process's id while registered (the ``lease_owner`` of what it claims)
        self.id: str | None = None
        #: when its row was last written (registered, or a heartbeat committed)
        self._beaten_at = 0
        #: when the oldest plain REST/MCP/Studio turn this process has in flight took its
        #: message in (None: none), written with each heartbeat (``turns_since``): set by
        #: the composition root to the turn service's
        #: (:meth:`leadgate.turns.path.TurnService.turns_since`)
        self.turns_since: Callable[[], int | None] = lambda: None
        #: run in each heartbeat's transaction once its row was refreshed, with this
        #: process's id and the beat's time: the renewal of the leases of work this
        #: live process is doing (the turn path's recorded runs), so that none lapses
        #: while the process beats (set by the composition root)
        self.renewals: list[Renewal] = []

    def owner(self) -> str | None:
        """The ``lease_owner`` to write on a claim (``None`` before registration)."""
        return self.id

    async def register(self) -> str:
        """Insert this process's row (then reap: a predecessor killed on this host is
        found dead at once)."""
        now = self.clock.now_ms()
        process_id = self.ids.new("prc")
        async with self.db.tx() as conn:
            await conn.execute(
                t.processes.insert().values(
                    id=process_id,
                    host=self.host,
                    pid=self.pid,
                    start_token=start_token(self.pid) or "?",
                    role=self.role,
                    started_at=now,
                    heartbeat_at=now,
                    turns_since=self.turns_since(),
                )
            )
        self.id = process_id
        self._beaten_at = now
        await self.reap()
        return process_id

    def maybe_reaped(self, process_id: str) -> bool:
        """Whether this process, registered as ``process_id`` when some work began, may
        have been reaped since (thought dead while alive: a partition from the database, a
        starved loop): it registered anew, or its last heartbeat committed longer ago
        than half ``dead_after`` (another replica, its clock ahead, may have reaped it
        already, and the next beat has not noticed yet). Known here in memory: a healthy
        process's work pays nothing for asking."""
        if process_id != self.id:
            return True
        return self.clock.now_ms() - self._beaten_at > self.dead_after_ms // 2

    async def beat(self) -> None:
        """Refresh the heartbeat, and with it when the oldest plain turn in flight took
        its message in (:attr:`turns_since`: turn recovery's search of this process, once
        it is gone, reaches back to it; in the UPDATE the beat runs anyway), and, in its
        transaction, renew what this process holds (:attr:`renewals`); re-register if
        another process reaped our row (what it held was taken back: nothing is renewed)."""
        process_id = self.id
        if process_id is None:
            await self.register()
            return
        now = self.clock.now_ms()
        values = {"heartbeat_at": now, "turns_since": self.turns_since()}
        async with self.db.tx() as conn:
            res = await conn.execute(t.processes.update().where(P.id == process_id).values(values))
            if res.rowcount:
                for renew in self.renewals:
                    await renew(conn, process_id, now)
        if res.rowcount:
            self._beaten_at = now
        else:
            log.error(
                "process %s was declared dead (heartbeat missed); its leases were taken "
                "back; registering again",
                self.id,
            )
            await self.register()

    async def reap(self) -> int:
        """Delete the rows of processes known dead (see the module docstring). What they
        held can be taken back at once: the commit wakes the runners that take leases
        back, here and on every replica (:attr:`leadgate.domain.wakes.Wake.leases`;
        rare, so one NOTIFY is nothing), rather than leave it to their next poll."""
        now = self.clock.now_ms()
        lapsed_before = now - self.dead_after_ms
        async with self.db.read() as conn:
            rows = (
                await conn.execute(sa.select(P.id, P.host, P.pid, P.start_token, P.heartbeat_at))
            ).all()
        others = [r for r in rows if r.id != self.id]
        dead = [r.id for r in others if r.host == self.host and _gone(r.pid, r.start_token)]
        if not dead and all(r.heartbeat_at >= lapsed_before for r in others):
            # Nobody is dead (every heartbeat): no write transaction (on SQLite the
            # writer's lock, on PostgreSQL a round trip and a commit, each beat of each
            # replica), nothing to note. A row that lapses after this read is found at
            # the next beat, as one that lapsed just after the write was.
            return 0
        async with self.db.tx() as conn:
            cond = P.heartbeat_at < lapsed_before
            if dead:
                cond = sa.or_(cond, P.id.in_(dead))
            if self.id is not None:
                cond = sa.and_(cond, P.id != self.id)
            await _note_gone(conn, cond)
            res = await conn.execute(t.processes.delete().where(cond))
            count = int(res.rowcount or 0)
            if count:
                await wakes.after_commit(conn, Wake.leases)
        if count:
            log.warning("%d dead process(es) found; their leases are taken back", count)
        return count

    async def unregister(self) -> None:
        """Clean shutdown: delete our row (what we still hold is free at once: the other
        replicas' runners are woken to take it, as after a reap)."""
        if self.id is None:
            return
        async with self.db.tx() as conn:
            await _note_gone(conn, P.id == self.id)
            await conn.execute(t.processes.delete().where(P.id == self.id))
            await wakes.after_commit(conn, Wake.leases)
        self.id = None


async def _note_gone(conn: Conn, cond: Any) -> None:
    """Note the processes ``cond`` is about to delete in ``gone_processes`` (with their
    last heartbeat and the oldest plain turn then in flight), in the deleting
    transaction: turn recovery searches each once for the plain REST/MCP/Studio messages
    it took in and nothing answered (:func:`leadgate.turns.runs.record_taken`). A stop
    notes its own too: a turn its stop cut is one such. (Two reapers of one process note
    it once.)"""
    noted = sa.select(P.id, P.heartbeat_at, P.turns_since).where(cond)
    insert = insert_ignore_stmt(conn.dialect.name, t.gone_processes)
    await conn.execute(insert.from_select(["id", "heartbeat_at", "turns_since"], noted))


def _gone(pid: int, token: str) -> bool:
    current = start_token(pid)
    if current is None:
        return True
    return token != "?" and current != "?" and current != token
