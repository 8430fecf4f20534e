"""Waking runners for rarer committed work: in this process at commit, on every other
replica by PostgreSQL ``NOTIFY``.

A runner loop sleeps on its wake event with a slow poll as the safety net
(:func:`leadgate.core.runners.run_loop`). The frequent kinds of work already wake their
runners everywhere: a submission (``leadgate_reviews``), a delivery (``leadgate_outbox``).
This module is for the rarer ones, whose runner often runs in another process than the
change (an ``api`` replica, or the command line, decides; a ``worker`` replica runs the
runners):

* :attr:`Wake.revision`: a person returned an item to its worker; the revision
  dispatcher has an internal turn to run;
* :attr:`Wake.flow`: an approval wrote a flow continuation; the flow resumer has a run to
  resume (or a flow node's item was cancelled, rejected, expired or abandoned: a run to
  end);
* :attr:`Wake.leases`: processes known dead were reaped, or this one shut down; what they
  held (review, revision, send and turn-run leases) can be taken back at once;
* :attr:`Wake.schedule`: a schedule was added (``leadgate schedule add``); its first
  firing may be sooner than the one the schedule runner sleeps toward.
* :attr:`Wake.sla`: a review episode was opened on another replica; its earliest timer
  (carried in the payload, :func:`timer_payload`) may be sooner than the one the SLA
  runner sleeps toward. Sent by the episode's own ``INSERT`` (``RETURNING pg_notify``,
  no statement added), and only to other replicas: in process the episode's timer
  reaches the SLA runner at commit (:data:`leadgate.review.cards.TIMERS_TOPIC`).

The writer calls :func:`after_commit` inside its transaction. In process, the signal
reaches the :data:`TOPIC` listeners of :meth:`leadgate.database.db.Database.on_commit_payloads`
(the composition root maps it onto wake events) once the transaction commits, never for
one that rolled back. On PostgreSQL the same transaction sends one ``pg_notify`` on
:data:`CHANNEL` per kind, however many rows it wrote (delivered at commit, dropped on
rollback), payload ``"<kind> <sender tag>"``; the sender's own listener skips it, as its
process was woken at commit. SQLite has no NOTIFY: another process sharing the file (the
command line) is seen by the runner's poll.
"""

from __future__ import annotations

import enum

import sqlalchemy as sa

from leadgate.database.db import Conn, notify_sender, signal_once

#: PostgreSQL NOTIFY channel of these wake-ups (payload ``"<kind> <sender tag>"``).
CHANNEL = "leadgate_wakes"
#: :meth:`leadgate.database.db.Database.on_commit_payloads` topic; payloads are
#: :class:`Wake` members.
TOPIC = "wakes"


class Wake(enum.StrEnum):
    """What kind of work a committed change made (see the module docstring)."""

    revision = "revision"
    flow = "flow"
    leases = "leases"
    schedule = "schedule"
    sla = "sla"


_NOTIFY = sa.text(f"SELECT pg_notify('{CHANNEL}', :payload)")


async def after_commit(conn: Conn, wake: Wake) -> None:
    """Wake the runners of ``wake`` once this transaction commits: in process through
    :data:`TOPIC`, on other replicas through one ``NOTIFY`` per transaction (PostgreSQL)."""
    if signal_once(conn, TOPIC, wake) and conn.dialect.name == "postgresql":
        await conn.execute(_NOTIFY, {"payload": f"{wake.value} {notify_sender(conn)}"})


def timer_payload(conn: Conn, due_at: int) -> str:
    """The :data:`CHANNEL` payload announcing an episode opened by ``conn``'s transaction
    whose earliest timer is ``due_at`` (ms): ``"sla <sender tag> <due_at>"``."""
    return f"{Wake.sla.value} {notify_sender(conn)} {due_at}"


def parse(payload: str) -> tuple[Wake, str] | None:
    """``(kind, sender tag)`` of a notification on :data:`CHANNEL`; None for a payload
    this version does not know (a newer replica's kind during a rolling upgrade). What
    follows the sender tag (a timer's ``due_at``) is read by :func:`parse_due`."""
    kind, _, rest = payload.partition(" ")
    sender = rest.partition(" ")[0]
    try:
        return Wake(kind), sender
    except ValueError:
        return None


def parse_due(payload: str) -> int | None:
    """The ``due_at`` (ms) a :func:`timer_payload` carries; None when there is none."""
    parts = payload.split(" ")
    try:
        return int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        return None
