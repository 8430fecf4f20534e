"""Scheduled triggers: run a worker on a cron expression with the ``scheduled`` binding.

A due firing is taken in first and the schedule advanced after: the turn's intake
records its message under the inbound event id ``schedule:<id>:<due>`` (unique), so
across replicas exactly one takes the firing in and every other gets a duplicate; the
turn is recorded as a run that crash recovery runs again; and only then is
``next_fire_at`` moved on, fenced (``WHERE id = :id AND next_fire_at = :due``). A process
that dies in between leaves the firing due: the next poll takes it in, or finds it was
(by its id, before any intake: whatever its worker's lead or activity is now), and
advances it. (Advancing first lost the day's firing to a crash between the two; and the
intake, which reads the worker first, deactivated the schedule of a firing taken in
when its worker was deactivated or deleted since.)

Each pass reads the earliest active schedule, due or not: when it is not due yet, its
time tells the runner loop how long it may sleep (:meth:`ScheduleRunner.due_in_s`), so a
firing happens at its time rather than up to a poll late, at no extra query. Adding a
schedule wakes the schedule runners at commit (:attr:`leadgate.domain.wakes.Wake.schedule`:
in process, and on PostgreSQL every other replica by NOTIFY), so a schedule whose first
firing is sooner than the one they sleep toward fires at its time too.

A clock ahead (a jump forward, put right later; a replica's clock) moves a schedule it
fires on to a cron time after that clock: once the clock is right again nothing would
fire until it caught up. The first pass, and the first after the clock is seen going
back, check the schedules (a batch a pass) and bring such a firing back to the cron's
next time after now (:meth:`ScheduleRunner._bring_back`); one taken in already is a
duplicate then, never a second turn.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Any, TypedDict

import sqlalchemy as sa
from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.errors import DatabaseDamaged, NotFound, Unavailable, ValidationError, quoted
from leadgate.core.limits import validate_message
from leadgate.core.logs import loggable
from leadgate.core.types import BindingKind, BindingSpec, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import wakes
from leadgate.turns.intake import taken_in
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.schedules")
S = t.schedules.c


#: The earliest active schedule, due or not (``next_fire_at`` is indexed). Built once: the
#: plan cache keys on the statement object (see leadgate.database.plans).
_NEXT = sa.select(t.schedules).where(S.active).order_by(S.next_fire_at).limit(1)
#: The same but for the schedules in ``p_firing`` (whose firing another pass of this
#: runner is running).
_NEXT_BUT = _NEXT.where(S.id.not_in(sa.bindparam("p_firing", expanding=True)))
#: How many loops run the schedule runner in one process: a slow or blocked turn of one
#: firing holds up only its own loop, not every other due schedule (it did, one loop).
SCHEDULE_LOOPS = 4

#: The longest cron expression stored (``schedules.cron``).
CRON_LIMIT = 100
#: Each cron field's name and how many values it has (the largest sensible step).
_FIELDS = (("minute", 60), ("hour", 24), ("day", 31), ("month", 12), ("weekday", 7))
_STEP = re.compile(r"/(\d+)")


def next_fire(cron: str, after_ms: int) -> int:
    """The first firing strictly after ``after_ms`` (UTC); rule ``schedule.cron`` for an
    expression that is not five fields (croniter would read a sixth as seconds) or that
    never fires (``0 0 31 2 *``)."""
    if len(cron) > CRON_LIMIT:  # the column's size; the text is not quoted back
        raise ValidationError(
            f"invalid cron expression: at most {CRON_LIMIT} characters", rule="schedule.cron"
        )
    fields = cron.split()
    if len(fields) != 5:
        raise ValidationError(
            f"invalid cron expression {quoted(cron)}: five fields (minute hour day month weekday)",
            rule="schedule.cron",
        )
    for field, (name, values) in zip(fields, _FIELDS, strict=True):
        for step in _STEP.findall(field):
            # croniter takes any step, and one beyond the field's values means only its
            # first value: almost certainly not what was meant.
            if not 1 <= int(step) <= values:
                raise ValidationError(
                    f"invalid cron expression {quoted(cron)}: step {step} of the {name} field"
                    f" must be 1 to {values}",
                    rule="schedule.cron",
                )
    try:
        it = croniter(cron, datetime.fromtimestamp(after_ms / 1000, tz=UTC))
        nxt: datetime = it.get_next(datetime)
    except CroniterBadDateError:
        raise ValidationError(
            f"cron expression {quoted(cron)} never fires", rule="schedule.cron"
        ) from None
    except (CroniterBadCronError, ValueError, KeyError) as exc:
        raise ValidationError(
            f"invalid cron expression {quoted(cron)}: {exc}", rule="schedule.cron"
        ) from None
    return int(nxt.timestamp() * 1000)


class NewScheduleView(TypedDict):
    """A new schedule and its first firing."""

    id: str
    agentId: str
    cron: str
    nextFireAt: str | None


async def add_schedule(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    agent_id: str,
    cron: str,
    message: str,
) -> NewScheduleView:
    """Store a schedule; its first firing is the next cron time after now. The schedule
    runners are woken once the transaction commits (they learn its firing time)."""
    validate_message(message)
    first = next_fire(cron, clock.now_ms())
    schedule_id = ids.new("sch")
    await conn.execute(
        t.schedules.insert().values(
            id=schedule_id,
            org_id=org_id,
            agent_id=agent_id,
            cron=cron,
            message=message,
            next_fire_at=first,
            active=True,
            created_at=clock.now_ms(),
        )
    )
    await wakes.after_commit(conn, wakes.Wake.schedule)
    return {"id": schedule_id, "agentId": agent_id, "cron": cron, "nextFireAt": iso(first)}


#: How many schedules one pass checks for a firing stranded by a clock that went back
#: (:meth:`ScheduleRunner._bring_back`): a check of many takes a few passes.
CHECK_BATCH = 100
#: The active schedules whose next firing is after ``p_now``, by id after ``p_after``.
_LATER = (
    sa.select(S.id, S.cron, S.next_fire_at)
    .where(S.active, S.next_fire_at > sa.bindparam("p_now"), S.id > sa.bindparam("p_after"))
    .order_by(S.id)
    .limit(sa.bindparam("p_limit"))
)


class ScheduleRunner:
    """Fires due schedules, each firing exactly once across replicas."""

    name = "schedules"

    def __init__(self, db: Database, clock: Clock, turns: TurnService) -> None:
        self.db = db
        self.clock = clock
        self.turns = turns
        #: ``next_fire_at`` of the earliest active schedule at the last pass (None: none)
        self._next_fire: int | None = None
        #: the clock at the last pass (None: no pass yet)
        self._last_now: int | None = None
        #: a check for stranded firings under way: the schedule id it goes on after
        #: ("": from the first; the first pass checks); None: none under way
        self._check_after: str | None = ""
        #: schedules checked per pass (:data:`CHECK_BATCH`)
        self.check_batch = CHECK_BATCH
        #: the schedules whose firing a pass of this runner is running (its loops run
        #: passes side by side: :data:`SCHEDULE_LOOPS`); the others pass them over
        self._firing: set[str] = set()
        #: a check for stranded firings is running in one of the passes
        self._checking = False

    def due_in_s(self) -> float | None:
        """Seconds (by the runner's clock) until the earliest firing the last pass saw, or
        None when it saw no active schedule. The runner loop sleeps no longer than this
        (:func:`leadgate.core.runners.run_loop`), so a schedule fires at its time, not at
        the next poll. Read from the database, so it holds across replicas: a firing
        another replica took meanwhile makes this one wake early and find the next; a
        schedule added since wakes the loop at its commit (``Wake.schedule``), which
        then reads its firing."""
        if self._next_fire is None:
            return None
        return max(0.0, (self._next_fire - self.clock.now_ms()) / 1000)

    async def run_once(self) -> bool:
        """Take in and run one due firing, then advance its schedule (after bringing
        back, at the first pass and when the clock went back, firings a clock ahead
        stranded: :meth:`_bring_back`). Passes run side by side (the runner's loops):
        each takes the earliest due schedule no other pass is firing, so one slow turn
        holds up no other schedule; a firing two replicas take is still one turn (its
        inbound event id)."""
        now = self.clock.now_ms()
        if self._last_now is not None and now < self._last_now:
            self._check_after = ""  # the clock went back: check every schedule again
        self._last_now = now
        if self._check_after is not None and not self._checking:
            self._checking = True
            try:
                await self._bring_back(now)
            finally:
                self._checking = False
        firing = sorted(self._firing)
        async with self.db.read() as conn:
            if firing:
                row = (await conn.execute(_NEXT_BUT, {"p_firing": firing})).first()
            else:
                row = (await conn.execute(_NEXT)).first()
        self._next_fire = None if row is None else row.next_fire_at
        if row is None or row.next_fire_at > now:
            # (A check under way goes on at once, in the pass that runs it.)
            return self._check_after is not None and not self._checking
        if row.id in self._firing:
            return True  # another pass took it while this one read: read the next
        self._firing.add(row.id)
        try:
            await self._fire(row, now)
        finally:
            self._firing.discard(row.id)
        return True

    async def _fire(self, row: Any, now: int) -> None:
        """Take in and run the due firing of schedule ``row``, then advance it."""
        try:
            advance: dict[str, Any] = {
                "next_fire_at": next_fire(row.cron, max(now, row.next_fire_at))
            }
        except ValidationError as exc:
            # Checked when it was added; croniter looks only so many years ahead, so
            # a rare date can still run out, and a stored expression may be refused by
            # rules newer than it. This firing runs, and it is the last; the warning
            # says which it was (a cron that "has no next firing" read as a bug).
            log.warning(
                "schedule %s is deactivated after this firing: %s [%s]",
                row.id,
                exc.message,
                exc.rule,
            )
            advance = {"active": False}
        event_id = f"schedule:{row.id}:{row.next_fire_at}"
        trigger = Trigger(
            org_id=row.org_id,
            agent_id=row.agent_id,
            session_key=f"schedule:{row.id}",
            text=row.message,
            binding=BindingSpec(BindingKind.scheduled, {"scheduleId": row.id}),
            external_event_id=event_id,
        )
        try:
            async with self.db.read() as conn:
                taken = await taken_in(conn, row.org_id, event_id)
            # Taken in already (a process died before moving the schedule on): the
            # firing is done, whatever its worker is now. The intake reads the worker
            # first, and one deactivated or deleted since deactivated the schedule (for
            # good, though the worker could be active again by the next firing).
            if taken is None:
                await self.turns.run(trigger)
        except (Unavailable, DatabaseDamaged):
            # Perhaps not taken in: the firing stays due, and a later poll takes it in
            # (or finds it was, a duplicate) and advances it; the loop backs off (and
            # says what a damaged file is in one line: it was a traceback per firing,
            # and the firing was skipped).
            raise
        except (NotFound, ValidationError) as exc:
            # Its agent was deleted or deactivated: every later firing would fail the
            # same way (a traceback a minute, for a schedule nobody could see).
            log.warning("schedule %s is deactivated: %s [%s]", row.id, exc.message, exc.rule)
            advance = {"active": False}
        except Exception as exc:
            log.error("scheduled run %s failed", row.id, exc_info=loggable(exc))
        async with self.db.tx() as conn:
            await conn.execute(
                t.schedules.update()
                .where(S.id == row.id, S.next_fire_at == row.next_fire_at)
                .values(**advance)
            )

    async def _bring_back(self, now: int) -> None:
        """Bring back the next firing of schedules (a batch of :data:`CHECK_BATCH`, by id)
        that a clock ahead of ``now`` put off: a firing taken in while the clock was
        ahead (a jump forward, a replica's clock) moved its schedule on to a cron time
        after that clock, and once the clock was put right nothing fired until it caught
        up (a year, for a clock a year ahead). Its stored firing is then later than the
        cron's next time after ``now``, which no clock going forward makes (each is the
        next cron time after a moment before now). Fenced by the firing read; a firing
        brought back that was taken in already is a duplicate then (its inbound event
        id), never a second turn. Other replicas' runners are woken (they sleep toward
        the later time)."""
        async with self.db.read() as conn:  # (mostly nothing to bring back: a read)
            rows = (
                await conn.execute(
                    _LATER,
                    {"p_now": now, "p_after": self._check_after, "p_limit": self.check_batch},
                )
            ).all()
        back: list[tuple[Any, int]] = []
        for row in rows:
            try:
                sooner = next_fire(row.cron, now)
            except ValidationError:
                continue  # its own next firing deactivates it
            if sooner < row.next_fire_at:
                back.append((row, sooner))
        if back:
            async with self.db.tx() as conn:
                for row, sooner in back:
                    await conn.execute(
                        t.schedules.update()
                        .where(S.id == row.id, S.next_fire_at == row.next_fire_at)
                        .values(next_fire_at=sooner)
                    )
                await wakes.after_commit(conn, wakes.Wake.schedule)
            for row, sooner in back:
                log.warning(
                    "schedule %s: its next firing %s was set by a clock ahead of this one; "
                    "brought back to %s",
                    row.id,
                    iso(row.next_fire_at),
                    iso(sooner),
                )
        self._check_after = rows[-1].id if len(rows) == self.check_batch else None


class ScheduleView(TypedDict):
    """A schedule as listed: its agent's name, and its next firing (``None`` while it is
    inactive)."""

    id: str
    agent: str
    cron: str
    active: bool
    nextFireAt: str | None
    message: str


class RemovedScheduleView(TypedDict):
    """A schedule just deleted."""

    id: str
    removed: bool


async def list_schedules(conn: Conn, org_id: str) -> list[ScheduleView]:
    """The organization's schedules, with their agents' names and next firing."""
    a = t.agents.c
    rows = await conn.execute(
        sa.select(S.id, S.cron, S.message, S.active, S.next_fire_at, a.name.label("agent"))
        .select_from(t.schedules.join(t.agents, a.id == S.agent_id))
        .where(S.org_id == org_id)
        .order_by(S.created_at, S.id)
    )
    return [
        {
            "id": r.id,
            "agent": r.agent,
            "cron": r.cron,
            "active": bool(r.active),
            "nextFireAt": iso(r.next_fire_at) if r.active else None,
            "message": r.message,
        }
        for r in rows
    ]


async def remove_schedule(conn: Conn, org_id: str, schedule_id: str) -> RemovedScheduleView:
    """Delete a schedule of the organization (404 ``schedule.not_found`` otherwise); a
    firing already under way still runs."""
    result = await conn.execute(t.schedules.delete().where(S.org_id == org_id, S.id == schedule_id))
    if not result.rowcount:
        raise NotFound(
            f"no schedule {quoted(schedule_id)} in this organization", rule="schedule.not_found"
        )
    return {"id": schedule_id, "removed": True}
