"""Recorded turn runs: a turn taken in before its platform was answered, until it ends.

A channel message (and a gated api turn) is recorded in its intake transaction together
with a ``turn_runs`` row leased to the process that took it in; the turn's last
transaction (reply queued, text withheld, submission, failure notice) deletes the row.
A row that outlives its process (SIGKILL, power loss) is found by the recovery runner
(:mod:`leadgate.runners.recovery`) as soon as the process is known dead (or the lease
expired) and is claimed under a new lease token; :func:`claim` decides what happens:

* the dead turn had already committed its ``complete_task`` signal (the handoff
  happened, its withheld text was lost): the signal is submitted exactly once, to a human
  (``inProgress -> awaitingHuman``, audit ``turnInterrupted``; it is in the actionable
  queue); re-running the model would make a second, different handoff. A keyed REST
  request's key gets, in that transaction, the answer of a live turn that ended gated
  (``surfaced``, :data:`SurfacedAnswer`);
* ``rerun`` (channels, schedules, a flow's lead-reviewed node: nobody else will ask
  again): the turn runs again from the stored message; its reply is queued fenced by
  the run's lease token, so at most one run commits; several recorded messages of one
  session are answered by one turn;
* ``client`` (REST/MCP: the official clients retry a turn cut by a lost connection, and
  their retry is a new message): a dead process's run waits :data:`RESEND_GRACE_MS`
  (:data:`AWAIT`, unowned) for that retry, then is closed when it came (the first
  message stays in the transcript and the item's task context as it was stored), or
  rerun when no message of the session came after it: its process may have told its
  client not to resend and died before it could mark the run (see
  :func:`_client_resent_or_not`). A REST retry with the request's ``Idempotency-Key``
  is no new message (the intake takes it for a duplicate): it claims the run itself,
  in the wait or before recovery found it (:func:`claim_for_retry`), and runs the turn;
  a rerun stores its answer under that key (``external_event_ids``). A live owner's
  lapsed run is closed at once (its client is still connected; the lease of a run
  whose turn still runs is renewed by its process's heartbeat, so such a run's turn is
  gone). Not so for a run
  whose client its own process told not to send the message again (an orphan: its
  turn stopped on a database fault, 503 ``turn.interrupted``, or its intake's
  read-back failed, ``intake.in_doubt``; see
  :class:`RunLook`): nobody would ask again and the item would sit ``inProgress`` with
  nothing running it. Such a run is rerun, and its row says so from the claim on
  (``policy`` ``rerun``): a process that dies rerunning it leaves it to be run again,
  not closed. A run of an intake in doubt whose read-back found nothing (its client
  told to send it again) is closed when found, without the wait: it will resend; so
  whatever other runs of its session the claim holds (rerun with them, its message was
  answered twice), and their rerun does not show the model that message (its resend's
  turn answers it: :attr:`Claimed.not_answered`). Unless it was taken in under an
  external event id (a keyed REST request): that client's resend is its retry with the
  key, a duplicate of this message that runs no turn of its own, so the run is rerun
  (its answer stored under the key), its row saying why (``policy`` :data:`RESEND`).
  The claim writes the messages it closed on the runs it reruns or leaves waiting
  (``not_answered``), in its transaction: a claim after the rerunning process died
  (or a keyed retry's) knows both, nobody holding the old tokens any more;
* after :data:`MAX_ATTEMPTS` runs that never finished (a message that kills its process)
  the person gets a failure notice and the run is closed. A flow node's turn has no
  person to tell and nobody retries it: its work item is abandoned
  (:func:`abandon_given_up`, audit :data:`GAVE_UP_ACTION`), which ends the paused flow
  run ``failed`` saying why (:class:`leadgate.flows.runs.FlowResumer`). A REST/MCP/Studio
  run rerun because its client was told not to resend has no conversation to post in
  and nobody retries it either: given up, or its model failing in the rerun, the notice
  is stored as the session's answer and its item abandoned likewise
  (:data:`CLIENT_GAVE_UP_TEXT`, :data:`CLIENT_FAILED_TEXT`); so is a keyed run's rerun
  because its intake was in doubt (:data:`KEYED_RESEND_FAILED_TEXT`,
  :data:`KEYED_RESEND_GAVE_UP_TEXT`).

A claim (:func:`claim`, :func:`claim_for_retry`) locks its runs' work item before it
looks for a later user message of the session (:func:`_resent`), and waits for that
lock (PostgreSQL; bounded by ``[database] busy_timeout_s``, past it a database fault and
the claim rolls back, taken again later). An intake of the session takes the item's row
lock (``FOR UPDATE``) before it stores its message and holds it to its commit, so a
resend (or follow-up) being taken in on another connection or replica when the claim
begins has committed by the time the check runs, which (READ COMMITTED: each statement
sees what committed before it) sees it. Unlocked, the check missed it: the run was rerun
and the message's own turn ran too, the resend answered twice. So does the transaction
of a REST/MCP/Studio message to a worker whose lead was removed after the item was
opened (a plain turn now: its message is not appended to the item, but the item is
locked all the same; it was not, and such a follow-up was answered beside the rerun).
(The session row is no such lock: the intake takes it only in its last statement, after
the message.) One lock order: the runs, then the item, as the turn's last transaction
takes them; the intake locks the item and inserts a run of its own, waiting for no run.
SQLite has one writer at a time: the intake's transaction ends before the claim's
begins, or begins after it ends.

A plain turn's intake run as one statement (PostgreSQL: no external event id, the
session's binding unchanged; :meth:`leadgate.turns.intake.Intake._take_plain`) takes no
lock: its message counts from that statement's commit, and one that commits after the
check is a later message as any. So is a message whose intake begins after the claim
decided, whatever its path: a resend of a rerun run's message, sent after the claim (a
cut turn's client later than :data:`RESEND_GRACE_MS`, or one told not to send it again
that does), is answered by its own turn and by the rerun. Nothing but its text tells
such a resend from a new message that says the same, so it is not joined to the rerun;
under an ``Idempotency-Key`` it is the key's retry, a duplicate that waits for the
rerun's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.core.clock import MINUTE_MS, Clock, IdFactory
from leadgate.core.errors import DatabaseDamaged, TransitionError, Unavailable
from leadgate.core.logs import loggable
from leadgate.core.runners import Lost, LostClaims
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.sql import bound_lock_waits, insert_ignore_stmt
from leadgate.domain import wakes, workitems
from leadgate.domain.processes import owner_gone
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import Status

log = logging.getLogger("leadgate.turns")

R = t.turn_runs.c
W = t.work_items.c

RERUN = "rerun"
CLIENT = "client"
#: A dead process's ``client`` run left for :data:`RESEND_GRACE_MS` to see whether its
#: client sends the message again (:func:`claim`).
AWAIT = "await"
#: A run rerun because it is a keyed REST request's whose client was told nothing was
#: stored (its intake in doubt, not found by its read-back): a rerun as :data:`RERUN` is,
#: saying why, so that a claim after its rerunning process died still knows
#: (:attr:`Claimed.keyed_resend`). It was ``rerun``, and that claim's failure or give-up
#: said its client was told not to send the message again.
RESEND = "resend"
#: The policies of a run that is rerun whatever its client does.
_RERUNS = (RERUN, RESEND)
#: How long a dead process's REST/MCP run waits for its client's resend before it is
#: rerun: the official clients resend a turn cut by a lost connection within seconds
#: (two retries, backing off up to 8 s each); a client told 503 ``turn.interrupted``
#: ("do not send it again") by a process that died before it could mark the run never
#: does.
RESEND_GRACE_MS = MINUTE_MS
#: A claim's action that left its runs :data:`AWAIT` (nothing to carry out yet).
WAITING = "waiting"
#: A claim's action that submitted the dead turn's committed ``complete_task`` signal to
#: a human instead of running the turn again.
SURFACED = "surfaced"
#: What a claim that surfaced a dead turn's handoff (:data:`SURFACED`) writes in its own
#: transaction for the external event ids the runs' messages were taken in under: a
#: keyed REST request's retry is answered as a live request whose turn ended gated.
SurfacedAnswer = Callable[[Conn, tuple[str, ...]], Awaitable[None]]
#: How long a recorded run's lease lasts: from its intake or claim, and from each
#: heartbeat of its live process while a turn of that process runs it (:func:`renew`).
#: Lapsed, the run is stalled (its process beats but runs no turn for it, or stopped
#: beating) and another may take it over.
RUN_LEASE_MS = 15 * MINUTE_MS
MAX_ATTEMPTS = 3
FAILURE_NOTICE = "Sorry, I could not answer your message (the agent failed). Please try again."
#: The audit action of a flow node's work item abandoned because turn recovery gave its
#: turn up (the flow resumer names the reason when it fails the run).
GAVE_UP_ACTION = "turnGaveUp"
#: The audit text of that move: why the item ended.
GAVE_UP_TEXT = (
    f"turn recovery gave the worker's turn up after {MAX_ATTEMPTS} attempts that each "
    "stopped before it finished (its process died); a flow node's turn is retried by "
    "nobody"
)
#: The audit text of a REST/MCP/Studio turn's item abandoned because turn recovery,
#: which ran it because its client was told not to send the message again (or, its
#: process dead, sent nothing again: :data:`AWAIT`), gave it up.
CLIENT_GAVE_UP_TEXT = (
    f"turn recovery gave the worker's turn up after {MAX_ATTEMPTS} attempts that each "
    "stopped before it finished (its process died); its client was told not to send the "
    "message again, or sent nothing again, so nobody retries it"
)
#: The rule of the 502 a keyed REST request's retry is answered when turn recovery gave
#: its turn up (:data:`CLIENT_GAVE_UP_TEXT`): the model error a request gets whose turn
#: failed, as the first request would have had it.
GAVE_UP_RULE = "turn.gave_up"
#: Its message.
GAVE_UP_MESSAGE = (
    f"the worker's turn was given up after {MAX_ATTEMPTS} attempts that each stopped "
    "before it finished (its process died); the message is in the transcript with a "
    "failure notice, and its work item was abandoned"
)
#: The same when the model failed in the turn recovery ran.
CLIENT_FAILED_TEXT = (
    "the worker's turn, run again by turn recovery because its client was told not to "
    "send the message again (or sent nothing again), failed (the model failed); nobody "
    "retries it"
)
#: The same for a keyed REST request's turn that recovery ran because its intake was
#: in doubt (:attr:`Claimed.keyed_resend`): its client was told nothing was stored and
#: to send it again, and did, or will, under the same key.
KEYED_RESEND_FAILED_TEXT = (
    "the worker's turn, run again by turn recovery because its client was told that "
    "nothing was stored (its intake was in doubt) and its resend with the same "
    "Idempotency-Key is a duplicate of the message that runs no turn of its own, failed "
    "(the model failed); that retry is answered the failure"
)
#: The same when turn recovery gave that turn up (:data:`MAX_ATTEMPTS`).
KEYED_RESEND_GAVE_UP_TEXT = (
    f"turn recovery gave the worker's turn up after {MAX_ATTEMPTS} attempts that each "
    "stopped before it finished (its process died); it ran it because its client was "
    "told that nothing was stored (its intake was in doubt), and its resend with the same "
    "Idempotency-Key is a duplicate of the message that runs no turn of its own; that "
    "retry is answered the failure"
)

_INSERT = t.turn_runs.insert()
_FINISH = t.turn_runs.delete().where(R.lease_token == sa.bindparam("p_token"))
#: The recovery runner's check, one read: whether any run is takeable by time or by a
#: dead holder (as :func:`claim` takes them, orphans aside), and when the earliest lease
#: not lapsed yet will. ``turn_runs`` holds the turns in flight only (a run's row is
#: deleted by the turn's last transaction). Built once: the plan cache keys on it.
_LEASE_CHECK = sa.select(
    sa.exists()
    .where(sa.or_(R.lease_expires_at < sa.bindparam("p_now"), owner_gone(R.lease_owner)))
    .label("takeable"),
    sa.select(sa.func.min(R.lease_expires_at))
    .where(R.lease_expires_at >= sa.bindparam("p_now"))
    .scalar_subquery()
    .label("next_lapse"),
)


async def record(conn: Conn, values: dict[str, Any]) -> None:
    """Insert a run row (inside the intake transaction)."""
    await conn.execute(_INSERT, values)


#: An owed run not recorded (:func:`record_owed`): a later user message of its session
#: was taken in, whose turn answers it.
ANSWERED_LATER = "later"
#: An owed run not recorded: its message is not in the transcript (an intake in doubt
#: that did not land; its client was told to send the message only if it is not there).
NOT_TAKEN_IN = "absent"
#: An owed run recorded.
RECORDED = "recorded"

_M = t.messages.c
#: A message with its session and the session's active binding (what a run records).
_WITH_SESSION = t.messages.join(t.sessions, t.sessions.c.id == _M.session_id).join(
    t.bindings, (t.bindings.c.session_id == _M.session_id) & t.bindings.c.active
)
#: An owed run's message in doubt (``session_id`` None in its values): the session, its
#: agent and its active binding, read when the run is recorded.
_OWED_SESSION = (
    sa.select(
        _M.org_id,
        _M.session_id,
        t.sessions.c.agent_id,
        t.bindings.c.id.label("binding_id"),
    )
    .select_from(_WITH_SESSION)
    .where(_M.id == sa.bindparam("p_id"))
)


def later_message(session_id: Any, messages: Any) -> sa.Exists:
    """Whether session ``session_id`` took in a user message after every one of
    ``messages`` (ids, or a select of them): by the order of their session events
    (``seq``, numbered under the session row's lock, so in commit order and never
    tied). Their timestamps tie within a millisecond: a later message of the same
    millisecond was missed, or an earlier one counted."""
    e = t.session_events.c
    later = t.session_events.alias("later")
    theirs = (
        sa.select(sa.func.max(e.seq))
        .where(e.session_id == session_id, e.message_id.in_(messages))
        .scalar_subquery()
    )
    return sa.exists().where(
        later.c.session_id == session_id,
        later.c.seq > theirs,
        _M.id == later.c.message_id,
        _M.role == "user",
    )


def _after(session_id: Any, message_id: Any) -> tuple[Any, Any, sa.ColumnElement[bool]]:
    """The session's events after message ``message_id``'s (by ``seq``, a walk of the
    session's event log by its primary key) and the messages they name: the aliases
    and the conditions joining them."""
    e = t.session_events.c
    later = t.session_events.alias("after_event")
    reply = t.messages.alias("after_message")
    # Its event by a backward walk from the session's last that stops at it (not max(),
    # which SQLite computes over the whole log): the events after it, and no more.
    theirs = (
        sa.select(e.seq)
        .where(e.session_id == session_id, e.message_id == message_id)
        .order_by(e.seq.desc())
        .limit(1)
        # (The message asked about may be an outer query's row: :data:`_TAKEN`'s.)
        .correlate_except(t.session_events)
        .scalar_subquery()
    )
    return (
        later,
        reply,
        sa.and_(
            later.c.session_id == session_id,
            later.c.seq > theirs,
            reply.c.id == later.c.message_id,
        ),
    )


def _answer_to(reply: Any, message_id: Any) -> sa.ColumnElement[bool]:
    """Whether ``reply`` (an alias of ``messages``) is an assistant message naming plain
    message ``message_id`` as the one it answers (``messages.answers``)."""
    return sa.and_(reply.c.role == "assistant", reply.c.answers == message_id)


def answered(session_id: Any, message_id: Any) -> sa.Exists:
    """Whether plain message ``message_id`` of session ``session_id`` is answered: an
    assistant message naming it (``messages.answers``) came after it, or a later user
    message (by ``seq``) whose turn was shown it (a resend, a follow-up). An answer to
    another message does not count: two plain turns of one session in flight (parallel
    MCP tool calls, REST calls without ``user``), the first one's answer stored after
    the second message was taken in, hid the second when its process died. An assistant
    message that names none (stored before migration 0029, by a replica of an older
    release, or by a turn that is neither a plain REST/MCP/Studio turn nor a rerun: a
    reviewed answer, say) counts for what came before it, as any did. (A rerun's answer
    and its failure notice name the newest of its messages, keyed or not.)"""
    _later, reply, joined = _after(session_id, message_id)
    return sa.exists().where(
        joined,
        sa.or_(
            reply.c.role == "user",
            sa.and_(
                reply.c.role == "assistant",
                sa.or_(reply.c.answers.is_(None), reply.c.answers == message_id),
            ),
        ),
    )


def _stored_answer() -> sa.Select[tuple[str]]:
    """:data:`_STORED_ANSWER`, built once."""
    session_id = sa.bindparam("p_session", type_=t.messages.c.session_id.type)
    message_id = sa.bindparam("p_message", type_=t.messages.c.id.type)
    later, reply, joined = _after(session_id, message_id)
    return (
        sa.select(reply.c.content)
        .where(joined, _answer_to(reply, message_id))
        .order_by(later.c.seq)
        .limit(1)
    )


#: The text of the first assistant message naming plain message ``p_message`` of session
#: ``p_session`` (``messages.answers``): a walk of the session's events after it.
_STORED_ANSWER = _stored_answer()


async def stored_answer(conn: Conn, session_id: str, message_id: str) -> str | None:
    """The text of the assistant message that answers plain message ``message_id``
    (names it: ``messages.answers``), the first stored, or None."""
    found = await conn.scalar(_STORED_ANSWER, {"p_session": session_id, "p_message": message_id})
    return None if found is None else str(found)


async def answered_later(
    conn: Conn, session_id: str, token: str, answers: str | None = None
) -> bool:
    """Whether session ``session_id`` took in a user message after every message of the
    runs leased under ``token`` (:func:`later_message`), read in a rerun's last
    transaction: that message's own turn, shown the runs' messages unanswered, answers
    them. Or, ``answers`` given (the message the rerun answers), an assistant message
    naming it was stored (``messages.answers``): its own turn answered it after all,
    its process alive though thought dead and not knowing it yet (its clock behind the
    reaper's, or its answer's statement held past the reap), after turn recovery's
    search recorded the run; the rerun answered it a second time. One statement."""
    theirs = sa.select(R.message_id).where(R.lease_token == token)
    later: sa.ColumnElement[bool] = later_message(session_id, theirs)
    if answers is not None:
        _later, reply, joined = _after(session_id, answers)
        named = sa.exists().where(joined, _answer_to(reply, answers))
        later = sa.or_(later, named)
    return bool(await conn.scalar(sa.select(later)))


#: Keys of an owed run's values that are no column of ``turn_runs``: an intake in
#: doubt's worker and session key (:meth:`leadgate.turns.intake.Intake.owed_in_doubt`),
#: and the session's last event ``seq`` at the first look that found its message absent
#: (:func:`record_owed`).
LOOK_AGENT, LOOK_KEY, LOOK_SEQ = "look_agent_id", "look_key", "look_seq"
_LOOK_KEYS = (LOOK_AGENT, LOOK_KEY, LOOK_SEQ)
_E = t.session_events.c
#: The last event ``seq`` of the session of (agent, key), 0 when it has none (or is none).
_SESSION_SEQ = (
    sa.select(sa.func.coalesce(sa.func.max(_E.seq), 0))
    .select_from(t.session_events.join(t.sessions, t.sessions.c.id == _E.session_id))
    .where(
        t.sessions.c.agent_id == sa.bindparam("p_agent"),
        t.sessions.c.key == sa.bindparam("p_key"),
    )
)


async def record_owed(db: Database, values: dict[str, Any], now: int) -> str:
    """Record, in a transaction of its own, the run (``values``, leased from ``now``) of
    a plain REST/MCP/Studio turn that stopped on a database fault after its intake: it
    recorded none (a plain chat message has only its transcript row), and its client
    was told not to send the message again. The process that owes it records it once
    the database is back, then its turn recovery reruns it as an orphan
    (:meth:`leadgate.turns.path.TurnService.record_owed`). Tried again with the same
    row after a failure: a try whose ``COMMIT`` was in doubt and landed inserts nothing
    the second time. :data:`RECORDED` then.

    ``values`` without a session (``session_id`` None): the message's intake was in
    doubt and its read-back failed (``intake.in_doubt``, its client told to send it
    only if the transcript lacks it); its session, agent and binding are read from the
    message here. :data:`NOT_TAKEN_IN`, recording nothing, when it is not there; the
    first such look notes in ``values`` the session's last event ``seq``
    (:data:`LOOK_SEQ`), so a later look knows which messages came after it.

    :data:`ANSWERED_LATER`, recording nothing, when the session took in a user message
    after the owed one (:func:`later_message`; the database back, its client sent its
    next message, or its resend, first): that message's turn saw the owed one in its
    history and answered, and a rerun, shown the whole session, answered that turn's
    message a second time. So too, for an intake in doubt, when its resend came before
    it (:func:`_resent_since`): the server applied the intake after a look found it
    absent, its client having resent it meanwhile."""
    async with db.tx() as conn:
        later = None
        if values["session_id"] is None:
            found = (await conn.execute(_OWED_SESSION, {"p_id": values["message_id"]})).first()
            if found is None:
                if values.get(LOOK_SEQ) is None and values.get(LOOK_AGENT) is not None:
                    params = {"p_agent": values[LOOK_AGENT], "p_key": values[LOOK_KEY]}
                    values[LOOK_SEQ] = await conn.scalar(_SESSION_SEQ, params)
                return NOT_TAKEN_IN
            seen = values.get(LOOK_SEQ)
            values = {**values, **found._asdict()}
            later = _resent_since(
                values["session_id"], values["message_id"], seen, values["created_at"]
            )
        # Its process may have been reaped since it owed the run (thought dead: a
        # partition, a starved loop), and that reap's note made turn recovery's search
        # record the message's run under this same id (run_id_of), rerun it and delete
        # it: that rerun's answer names the message, so it is answered (this insert made
        # it a second run, answered twice, when only later user messages counted).
        after = answered(values["session_id"], values["message_id"])
        if await conn.scalar(sa.select(after if later is None else sa.or_(after, later))):
            return ANSWERED_LATER
        row = {k: v for k, v in values.items() if k not in _LOOK_KEYS}
        insert = insert_ignore_stmt(conn.dialect.name, t.turn_runs)
        await conn.execute(insert, {**row, "lease_expires_at": now + RUN_LEASE_MS})
    return RECORDED


_G = t.gone_processes.c
#: The processes known gone whose plain messages no search has looked at yet (a reap, or
#: a stop, noted them: :func:`leadgate.domain.processes.Liveness.reap`).
_GONE = sa.select(_G.id, _G.heartbeat_at, _G.turns_since).where(
    ~sa.exists().where(t.processes.c.id == _G.id)
)
_I = t.inbound_events.c
#: The prefix of :func:`event_id_of`.
_EVENT_OF = "evt."


def event_id_of(message_id: str) -> str:
    """The id of the inbound event of a plain REST/MCP/Studio turn's user message
    ``message_id`` taken in under an external event id (a keyed REST request's
    ``Idempotency-Key``; the intake writes no event for an unkeyed one). Derived from
    the message's id, so that turn recovery's search (:func:`record_taken`) reads the
    event id by the primary key of ``inbound_events`` (never pruned: an index of its
    own, or a scan by session and time, was the other way), and the intake writes
    nothing more: the row it wrote with a new id has this one."""
    return f"{_EVENT_OF}{message_id}"


#: The user messages a gone process (``p_process``) took in for a plain REST/MCP/Studio
#: turn (``taken_by``) since ``p_since`` that nothing answered (:func:`answered`: no
#: assistant message naming them, no later user message of their session, whose turn
#: was shown them: a resend, a follow-up) and no run is recorded for them (one its
#: process recorded owing it, or a search before). The answer to another message of the
#: session stored after them (its turn in flight beside theirs) is no answer of theirs.
#: With what their run records: the session's worker and active binding, and the
#: external event id a keyed request's message was taken in under (its event's id is
#: :func:`event_id_of` the message's: one primary-key look-up each), so that the key's
#: retry claims the run (:func:`claim_for_retry`) and a rerun's answer is stored under
#: the key (:attr:`Claimed.external_event_ids`). "After" is the session's event order:
#: by the stamps, a follow-up taken in by a replica whose clock is behind looked older
#: (the message was rerun beside the follow-up's turn: answered twice), and an earlier
#: message stamped by one ahead looked later (the message never answered).
_TAKEN = (
    sa.select(
        _M.id,
        _M.org_id,
        _M.session_id,
        _M.created_at,
        t.sessions.c.agent_id,
        t.bindings.c.id.label("binding_id"),
        sa.select(_I.external_event_id)
        .where(_I.id == sa.literal(_EVENT_OF, sa.String) + _M.id)
        .scalar_subquery()
        .label("external_event_id"),
    )
    .select_from(_WITH_SESSION)
    .where(
        _M.taken_by == sa.bindparam("p_process"),
        _M.created_at >= sa.bindparam("p_since"),
        _M.role == "user",
        ~sa.exists().where(R.message_id == _M.id),
        ~answered(_M.session_id, _M.id),
    )
    .order_by(_M.created_at, _M.id)
)


def run_id_of(message_id: str) -> str:
    """The id of the run recorded late for the plain turn of message ``message_id``
    (by the process that owes it, :func:`record_owed`, or by turn recovery once that
    process is gone, :func:`record_taken`): one id, so that the two insert one row."""
    return f"run.{message_id}"


async def record_taken(db: Database, ids: IdFactory, now: int) -> int:
    """Record the runs of the plain REST/MCP/Studio messages that processes known gone
    took in and nothing answered (``messages.taken_by``; a plain turn records no run to
    keep its path cheap): its process died (a crash, a kill, a stop that cut it) before
    the answer was stored, or after it told its client 503 ``turn.interrupted`` and
    owed the turn in memory alone. Each such process is searched once, in a transaction
    of its own that deletes its note (``gone_processes``) first, so two replicas never
    both record its messages; within :func:`search_since` (its last heartbeat less
    :data:`RUN_LEASE_MS`, or its oldest plain turn then in flight, when earlier).

    Each run is a ``client`` run of the gone process (as a gated turn of theirs records
    in its intake), so turn recovery treats it as a dead process's: it waits
    :data:`RESEND_GRACE_MS` for the client's resend (an OpenAI client retries a cut
    turn, a new message whose turn answers both), and reruns it when none came (an MCP
    client, or one told not to send it again). How many were recorded."""
    async with db.read() as conn:
        gone = (await conn.execute(_GONE)).all()
    recorded = 0
    for process in gone:
        try:
            since = search_since(process.heartbeat_at, process.turns_since)
            recorded += await _record_taken_of(db, ids, process.id, since, now)
        except (Unavailable, DatabaseDamaged):
            raise
        except Exception as exc:
            # A bug, or a row the database refuses: tried again it fails the same way at
            # every pass, and the turn recovery's claims, which come after this, would
            # never run. Its note is dropped (its messages stay unanswered), as an owed
            # run whose record fails so is given up.
            log.error(
                "could not record the runs of gone process %s's plain turns (their "
                "messages stay unanswered)",
                process.id,
                exc_info=loggable(exc),
            )
            async with db.tx() as conn:
                await conn.execute(t.gone_processes.delete().where(_G.id == process.id))
    return recorded


def search_since(heartbeat_at: int, turns_since: int | None) -> int:
    """From when :func:`record_taken` searches the messages of a gone process whose last
    heartbeat was at ``heartbeat_at``: that beat less :data:`RUN_LEASE_MS` (room for a
    message taken in after it, and for a process of an older release, which wrote no
    ``turns_since``), or, when earlier, ``turns_since``, when the oldest plain turn it
    had in flight at that beat began (:meth:`leadgate.turns.path.TurnService.turns_since`).
    No limit bounds a whole turn (the model's timeout bounds each wait for its next
    bytes), so the run lease alone missed a turn that ran longer; from the process's
    start instead, the search read every message it ever took in (answered ones keep
    ``taken_by``) and walked each one's session."""
    since = heartbeat_at - RUN_LEASE_MS
    return since if turns_since is None else min(since, turns_since)


async def _record_taken_of(
    db: Database, ids: IdFactory, process_id: str, since: int, now: int
) -> int:
    """:func:`record_taken` of one gone process, its messages since ``since``."""
    async with db.tx() as conn:
        noted = await conn.execute(t.gone_processes.delete().where(_G.id == process_id))
        if not noted.rowcount:
            return 0  # another search took it
        params = {"p_process": process_id, "p_since": since}
        taken = (await conn.execute(_TAKEN, params)).all()
        insert = insert_ignore_stmt(conn.dialect.name, t.turn_runs)
        for m in taken:
            run = {
                "id": run_id_of(m.id),
                "org_id": m.org_id,
                "agent_id": m.agent_id,
                "session_id": m.session_id,
                "binding_id": m.binding_id,
                "work_item_id": None,
                "message_id": m.id,
                "policy": CLIENT,
                "turn_id": ids.new("turn"),
                # Its holder gone (owner_gone): takeable at once.
                "lease_owner": process_id,
                "lease_token": ids.new("lease"),
                "lease_expires_at": now + RUN_LEASE_MS,
                "attempts": 1,
                "created_at": m.created_at,
                "external_event_id": m.external_event_id,
            }
            await conn.execute(insert, run)
    return len(taken)


#: How far apart replicas' clocks may be for a resend to be told by its time
#: (:func:`_resent_since`): a message stamped this much after an in-doubt intake began
#: was taken in after it, whichever replica's clock stamped it.
RESEND_CLOCK_SLACK_MS = 5_000


def _resent_since(session_id: Any, message_id: Any, seen: Any, since: Any) -> sa.Exists:
    """Whether session ``session_id`` took in, after the in-doubt message
    ``message_id``'s intake began, another user message saying what it says: the resend
    of a message whose intake was in doubt. Its client, told to send it only if the
    transcript lacks it, looked before the server applied that intake (PostgreSQL can
    apply a statement whose connection dropped after a read on another connection
    found nothing), and sent it again; the resend's turn answered it, and the first
    copy, landed after it (a later ``seq``: :func:`later_message` misses it), is no
    message of its own to answer again.

    "After", told two ways, either enough:
    - by the session's event order (``seq``, the database's): after event ``seen``, the
      session's last when a look found the message absent (``None``: it was found at
      the first look). A message taken in before that look is no resend by this test,
      whatever its time: the resend and the intake are stamped by the clocks of
      different replicas, and going by time alone, 2 s of skew either way missed the
      resend (answered twice) or took an earlier message saying the same for one (the
      owed message never answered).
    - by time, with :data:`RESEND_CLOCK_SLACK_MS` to spare: stamped that much after
      ``since`` (when the intake began, on its replica's clock). This catches the
      resend taken in before the first look (the client looked, and sent it again,
      before the process did), which the order above cannot place; an earlier message
      passes it only on a replica whose clock is that far ahead.
    A resend taken in before the first look within the slack looks, in the database,
    like an earlier message saying the same: the owed message is answered, twice rather
    than never."""
    other = t.messages.alias("resent")
    own = t.messages.alias("owed")
    ev = t.session_events.alias("resent_event")
    by_time = other.c.created_at > sa.literal(since) + RESEND_CLOCK_SLACK_MS
    return sa.exists().where(
        ev.c.session_id == session_id,
        by_time if seen is None else sa.or_(ev.c.seq > seen, by_time),
        other.c.id == ev.c.message_id,
        other.c.role == "user",
        other.c.id != message_id,
        own.c.id == message_id,
        other.c.content == own.c.content,
    )


async def take_back(conn: Conn, message_id: str) -> None:
    """Delete the run turn recovery may have recorded for plain message ``message_id``
    (:func:`run_id_of`), in the last transaction of the live turn that answers it when
    its process may have been reaped while the turn ran (thought dead, alive): that
    reap's note made recovery's search record the message, unanswered then, and rerun
    it after the resend wait. Deleted here, a wait finds nothing to rerun, and a rerun
    in flight fails its fenced :func:`finish` and rolls its answer back: the message is
    answered once, by this turn. (A rerun that committed first is not undone: both
    answers stand. It takes the resend wait and the rerun's whole model call within
    this turn's one.)"""
    await conn.execute(t.turn_runs.delete().where(R.id == run_id_of(message_id)))


async def end_retaken(conn: Conn, token: str, session_id: str, message_id: str) -> str | None:
    """End the run (lease ``token``) of a keyed retry's takeover (:func:`claim_for_retry`)
    of plain message ``message_id``, in its turn's last transaction, before its answer is
    stored: the text of the answer naming the message when one was stored meanwhile
    (:func:`stored_answer`), which the retry answers instead of storing its own, else
    None. The process that took the message in, only thought dead, may still run its
    own turn of it: knowing it may have been reaped, that turn's last transaction takes
    the run back (:func:`take_back`) with its answer; not knowing it yet, it stores its
    answer and leaves the run. Either way its answer, under the key too, was the
    message's; the retry's fenced end rolled its own back and answered 409 ``run`` (the
    first case), or stored a second answer over the key's (the second).

    The run is deleted first: on PostgreSQL that delete waits for a take-back in flight
    (it holds the row), so the read after it sees that turn's answer. A run lost with no
    answer naming the message (another process took it over) is
    :class:`~leadgate.core.errors.TransitionError`, as a fenced :func:`finish` is."""
    res = await conn.execute(_FINISH, {"p_token": token})
    stored = await stored_answer(conn, session_id, message_id)
    if stored is None and not res.rowcount:
        raise TransitionError("this turn's run was taken over by another process", rule="run")
    return stored


async def finish(conn: Conn, token: str | None, *, fenced: bool, held: int = 1) -> None:
    """Delete the runs of lease ``token`` (in the turn's last transaction). ``fenced``:
    the turn would post, so a lost lease (another process re-ran it) rolls it back, as
    does one of the ``held`` runs the turn holds gone (a recovery claim's runs of one
    session: :attr:`Claimed.run_ids`): the live turn of a thought-dead process took its
    run back (:func:`take_back`) with its own answer, after this turn's last look for
    one (:func:`answered_later` names the newest message only), and this turn, shown
    that message unanswered, answered it a second time. The next claim reruns the
    runs left."""
    if token is None:
        return
    res = await conn.execute(_FINISH, {"p_token": token})
    if fenced and res.rowcount < held:
        raise TransitionError("this turn's run was taken over by another process", rule="run")


#: A live process's renewal of the runs its turns are running (:func:`renew`). Built
#: once: the plan cache keys on it.
_RENEW = (
    t.turn_runs.update()
    .where(
        R.lease_owner == sa.bindparam("p_owner"),
        R.lease_token.in_(sa.bindparam("p_tokens", expanding=True)),
        R.lease_expires_at >= sa.bindparam("p_now"),
        R.lease_expires_at < sa.bindparam("p_half"),
    )
    .values(lease_expires_at=sa.bindparam("p_until"))
)


async def renew(conn: Conn, owner: str, tokens: Sequence[str], now: int) -> int:
    """Renew for :data:`RUN_LEASE_MS` from ``now`` the leases of the runs under
    ``tokens`` that ``owner`` (this live process, in its heartbeat's transaction) holds:
    those its turns are running. A turn's model calls may take longer than a lease in
    all; unrenewed, its run was taken over by turn recovery while the turn ran, and run
    again. Fenced by owner and token: a run taken over (its token changed) or of a
    process reaped meanwhile (its owner's row gone) is not renewed. A lease already
    lapsed stays lapsed: recovery may be taking it now, and the turn's fenced last
    transaction then finds it gone. Only a lease with less than half of it left is
    written: each beat (every few seconds) rewrote every running turn's row, where one
    write in half a lease keeps it as well. How many runs were renewed."""
    if not tokens:
        return 0
    params = {"p_owner": owner, "p_tokens": list(tokens), "p_now": now}
    half = now + RUN_LEASE_MS // 2
    res = await conn.execute(_RENEW, {**params, "p_half": half, "p_until": now + RUN_LEASE_MS})
    return int(res.rowcount or 0)


@dataclass(frozen=True)
class Claimed:
    """Runs of one session claimed under one lease token, and what to do with them."""

    action: str  # rerun | surfaced | closed | gaveUp | waiting
    token: str
    org_id: str
    agent_id: str
    session_id: str
    binding_id: str
    work_item_id: str | None
    turn_id: str
    run_ids: tuple[str, ...]
    #: The external event ids the runs' messages were taken in under (REST's
    #: ``Idempotency-Key`` events among them): a rerun stores its answer under such a key.
    external_event_ids: tuple[str, ...] = ()
    #: The messages of the session's runs this claim, or an earlier claim of these runs,
    #: closed because their clients send them again (see :func:`_resending`; stored on
    #: the runs, ``not_answered``): a rerun does not answer them (its model is not shown
    #: them), the resend's own turn does.
    not_answered: tuple[str, ...] = ()
    #: Every run rerun is a keyed REST request's whose client was told nothing was
    #: stored (its intake in doubt, not found by its read-back): its resend is the key's
    #: retry, a duplicate that runs no turn. A failure's or a give-up's audit says so
    #: (:data:`KEYED_RESEND_FAILED_TEXT`, :data:`KEYED_RESEND_GAVE_UP_TEXT`), not that
    #: its client was told not to resend. Stored on the runs (``policy``
    #: :data:`RESEND`): a later claim, after the process rerunning them died, knows it.
    keyed_resend: bool = False
    #: The newest run's message: the one its rerun's answer names (``messages.answers``).
    message_id: str | None = None

    @classmethod
    def of(
        cls,
        action: str,
        token: str,
        rows: Sequence[sa.Row[Any]],
        turn_id: str,
        item_id: str | None,
        *,
        keyed: bool,
        not_answered: tuple[str, ...] = (),
        keyed_resend: bool = False,
    ) -> Claimed:
        """The claim of ``rows`` (one session's, oldest first), as the newest names it;
        with their external event ids when a rerun's answer is to be stored under their
        keys (``keyed``)."""
        newest = rows[-1]
        return cls(
            action=action,
            token=token,
            org_id=newest.org_id,
            agent_id=newest.agent_id,
            session_id=newest.session_id,
            binding_id=newest.binding_id,
            work_item_id=item_id,
            turn_id=turn_id,
            run_ids=tuple(r.id for r in rows),
            external_event_ids=_event_ids(rows) if keyed else (),
            not_answered=not_answered,
            keyed_resend=keyed_resend,
            message_id=newest.message_id,
        )


#: :func:`claim_for_retry`: the run is not this request's to take now (a live process
#: runs it, or turn recovery has it to close, surface or give up).
RUN_BUSY = "busy"


async def lease_check(db: Database, now: int) -> tuple[bool, int | None]:
    """Whether a run is takeable at ``now`` (its lease lapsed, or its holder is known
    dead; orphans aside), and when the earliest lease not lapsed yet lapses (None: no
    run holds one). One read, no write lock: an idle recovery pass need not claim."""
    async with db.read() as conn:
        row = (await conn.execute(_LEASE_CHECK, {"p_now": now})).one()
    return bool(row.takeable), row.next_lapse


class RunLook(NamedTuple):
    """A run's lease token that the recovery looks for again (``lost``, a
    :class:`~leadgate.core.runners.LostClaims`), and what its client was told. ``rerun``:
    not to send the message again (an orphan's: its turn stopped on a fault, or its
    intake's read-back failed), so a ``client`` run found under it is rerun, as an
    orphan's is. Otherwise nothing was stored, send it again (an intake in doubt whose
    read-back found nothing): a ``client`` run found is closed (whatever else its claim
    reruns), the client's retry being its turn; rerun, the message was answered twice.
    Not one whose message was taken in under an external event id (REST's
    Idempotency-Key): its retry is a duplicate of that message, no turn of its own, so
    it is rerun."""

    token: str
    rerun: bool


async def claim(
    db: Database,
    clock: Clock,
    ids: IdFactory,
    *,
    owner: str | None,
    orphans: set[str],
    lost: LostClaims[RunLook],
    surfaced: SurfacedAnswer | None = None,
    own_only: bool = False,
) -> Claimed | None:
    """Claim the oldest takeable run and every takeable run of its session.

    Takeable: its lease expired, its holder is known dead (:func:`owner_gone`), or it is
    one of ``orphans`` (this process's runs whose turn stopped on a database fault, or
    whose intake or recovery claim was in doubt), or of the tokens in ``lost`` whose look
    is due. Orphans no run holds go to ``lost`` (see :func:`_watch`). A claim that
    surfaces the dead turn's handoff (:data:`SURFACED`) calls ``surfaced`` in its
    transaction, with the runs' external event ids: the handoff and the answer stored
    for a keyed request commit together.

    ``own_only`` (the turn recovery of a process that runs no runners, ``serve --role
    api``): the session claimed is one of an orphan's or a due look's run, never one
    that only a lapsed lease or a dead holder makes takeable (the worker replicas'
    recovery takes those); its other takeable runs are claimed with it all the same, so
    the session still gets one recovered turn. None at once when nothing is asked.
    """
    now = clock.now_ms()
    takeable = sa.or_(R.lease_expires_at < now, owner_gone(R.lease_owner))
    looks = lost.take_due(now) if lost else []
    asked = sorted(orphans.union(look.token.token for look in looks) if looks else orphans)
    if own_only and not asked:
        return None
    # The tokens whose client was told not to send the message again (RunLook), and
    # those whose client was told to send it again (nothing was stored, it said).
    no_resend = orphans.union(look.token.token for look in looks if look.token.rerun)
    resend = {look.token.token for look in looks if not look.token.rerun}
    if asked:
        takeable = sa.or_(takeable, R.lease_token.in_(asked))
    pick = R.lease_token.in_(asked) if own_only else takeable
    token = ids.new("lease")
    updated: list[str] = []  # the token, once the claim's UPDATE ran
    taken: set[str] = set()  # the tokens the claimed runs held, once it committed
    try:
        claimed = await _claim_in(
            db,
            clock,
            ids,
            takeable,
            now,
            token,
            pick=pick,
            owner=owner,
            no_resend=no_resend,
            resend=resend,
            updated=updated,
            taken=taken,
            surfaced=surfaced,
        )
    except BaseException:  # (cancelled too: the looks taken stay watched)
        # The claim's COMMIT may or may not have landed: the runs hold either their old
        # tokens (still in ``orphans``: discarded only after the commit) or this one.
        # Either way the next pass takes them, instead of after the run lease (minutes).
        orphans.update(updated)
        lost.put_back(looks)
        raise
    if claimed is None:
        _watch(asked, looks, orphans, lost, now)
        return None
    orphans.difference_update(taken)  # committed: these tokens are gone
    if looks:
        # Those of another session's runs are looked for at the next pass (due still).
        lost.put_back([look for look in looks if look.token.token not in taken])
    return claimed


def _watch(
    asked: list[str],
    looks: list[Lost[RunLook]],
    orphans: set[str],
    lost: LostClaims[RunLook],
    now: int,
) -> None:
    """A claim that asked for the tokens ``asked`` (``looks``: those ``lost`` was
    watching) found no takeable run: no run holds them now. Each may hold one later all
    the same: an intake or a recovery claim in doubt that was not found landed can still
    be applied by the server after this claim raced it (its rows locked meanwhile, which
    ``SKIP LOCKED`` passes by, or not written yet). Dropped, such a run would wait under
    a token nobody holds until its lease lapsed (:data:`RUN_LEASE_MS`), its message
    unanswered. So each is watched (:class:`~leadgate.core.runners.LostClaims`: looked
    for again a second on, then at doubling gaps) until that lease would have lapsed;
    the recovery runner claims with the due ones only (no claim between looks)."""
    watched = {look.token.token: look for look in looks}
    for token in asked:
        orphans.discard(token)
        look = watched.get(token)
        if look is not None:
            lost.not_found(look, now)
        else:
            # An orphan (its client told not to send it again). (The run's lease was set
            # at or before now: it lapses by then.) Not woken: this is the recovery's own
            # pass, and its loop sleeps toward the look.
            lost.watch(
                RunLook(token, rerun=True),
                due=now + lost.first_ms,
                lapses=now + RUN_LEASE_MS,
                wake=False,
            )


def session_runs(takeable: Any, session_id: Any) -> sa.Select[Any]:
    """The takeable runs of one session in the session's order: by their messages'
    ``created_at`` (then id), the order the server took them in on both backends (see
    the README's ``createdAt``). Not by the runs' own ``created_at``: an owed run's is
    its intake's clock reading, a run the gone-process search records takes its
    message's time, which PostgreSQL keeps after the session's previous message; so
    the older message's run could sort last, and the claim's rerun name it, its answer
    the newest (the session's run index, then each message by its primary key; only the
    runs are locked, ``FOR UPDATE OF turn_runs``)."""
    return (
        sa.select(t.turn_runs)
        .select_from(t.turn_runs.join(t.messages, _M.id == R.message_id))
        .where(takeable, R.session_id == session_id)
        .order_by(_M.created_at, _M.id, R.id)
    )


async def _claim_in(
    db: Database,
    clock: Clock,
    ids: IdFactory,
    takeable: Any,
    now: int,
    token: str,
    *,
    pick: sa.ColumnElement[bool],
    owner: str | None,
    no_resend: set[str],
    resend: set[str],
    updated: list[str],
    taken: set[str],
    surfaced: SurfacedAnswer | None,
) -> Claimed | None:
    async with db.tx() as conn:
        first = (
            await conn.execute(
                db.skip_locked(sa.select(R.session_id).where(pick).order_by(R.created_at).limit(1))
            )
        ).first()
        if first is None:
            return None
        rows = (
            await conn.execute(
                db.skip_locked(session_runs(takeable, first.session_id), of=t.turn_runs)
            )
        ).all()
        if not rows:
            return None
        turn_id = ids.new("turn")
        # Runs whose client sends the message again (a new message, with a turn of its
        # own) are closed first, whatever else the claim holds: rerun with the others
        # (a keyed run, an orphan), the message was answered by the rerun and again by
        # its resend's turn.
        closing = [r for r in rows if _resending(r, resend)]
        if closing:
            await _close_resending(conn, closing)
            if len(closing) == len(rows):
                taken.update(r.lease_token for r in rows)
                item_id = rows[-1].work_item_id
                return Claimed.of("closed", token, rows, turn_id, item_id, keyed=False)
            rows = [r for r in rows if not _resending(r, resend)]
        # A client run whose client was answered "do not send it again" (see the module
        # docstring): nobody retries it, so it is rerun. So is one told to send it again
        # that is left (its message was taken in under an external event id, REST's
        # Idempotency-Key): its resend is its retry with the key, a duplicate of this
        # very message, which no new turn answers.
        # (A run an earlier claim reran so says so, RESEND: its process may have died
        # rerunning it, and nobody holds its old token any more.)
        keyed_resend = [
            r.policy == RESEND or (r.lease_token in resend and r.policy not in _RERUNS)
            for r in rows
        ]
        rerun = any(keyed_resend) or any(
            r.policy in _RERUNS or r.lease_token in no_resend for r in rows
        )
        # Kept on the runs, so that a claim after their rerun's process died does not
        # show them to the model either.
        not_answered = _not_answered(rows, closing)
        action = RERUN if rerun else CLIENT
        item_id = next((r.work_item_id for r in reversed(rows) if r.work_item_id), None)
        if item_id is not None:
            # Waited for (PostgreSQL), so that a message whose intake holds it is seen
            # by the check for a later message below (see the module docstring).
            await bound_lock_waits(conn, db.busy_timeout_s)
            item = await workitems.get(conn, item_id, lock=True)
            dead_turns = {r.turn_id for r in rows}
            if item.status != Status.inProgress.value:
                action = "closed"  # it moved on (cancelled, or submitted by another turn)
            elif item.signal_turn_id in dead_turns and item.signal_summary:
                await _surface(conn, clock, ids, item.id, item.signal_summary)
                if surfaced is not None:
                    await surfaced(conn, _event_ids(rows))
                action = SURFACED
        if action == CLIENT:
            rerun, wait = await _client_resent_or_not(conn, rows, now)
            action = WAITING if wait else RERUN if rerun else CLIENT
        updated.append(token)
        res = await conn.execute(
            t.turn_runs.update()
            .where(R.id.in_([r.id for r in rows]), R.lease_token.in_({r.lease_token for r in rows}))
            .values(
                _claim_values(
                    rows,
                    token,
                    owner,
                    turn_id,
                    now,
                    action=action,
                    rerun=rerun,
                    keyed_resend=all(keyed_resend),
                    not_answered=not_answered,
                )
            )
        )
        if res.rowcount != len(rows):
            raise TransitionError("turn runs changed while being claimed", rule="run")
        if action == RERUN and max(r.attempts for r in rows) >= MAX_ATTEMPTS:
            action = "gaveUp"
        if action in ("closed", SURFACED, CLIENT):
            await finish(conn, token, fenced=False)
            action = "closed" if action == CLIENT else action
    taken.update(row.lease_token for row in [*closing, *rows])
    return Claimed.of(
        action,
        token,
        rows,
        turn_id,
        item_id,
        keyed=True,
        not_answered=not_answered,
        keyed_resend=all(keyed_resend),
    )


def _resending(row: sa.Row[Any], resend: set[str]) -> bool:
    """Whether ``row`` is a REST/MCP/Studio run whose client was told nothing was stored
    (an intake in doubt whose read-back found nothing: ``resend``, see :class:`RunLook`)
    and that was taken in under no external event id: that client sends the message
    again, a new message whose own turn answers it, so the run is closed, never rerun.
    (Under an ``Idempotency-Key`` the resend is the key's retry, a duplicate that runs no
    turn: that run is rerun. A channel's run is rerun as any: its platform's redelivery
    is a duplicate.)"""
    return row.policy not in _RERUNS and row.lease_token in resend and not row.external_event_id


def _not_answered(rows: Sequence[sa.Row[Any]], closing: Sequence[sa.Row[Any]]) -> tuple[str, ...]:
    """The messages a rerun of ``rows`` is not to show its model: those an earlier claim
    of theirs closed (stored on them) and those of ``closing`` (closed by this claim)."""
    stored = (message for r in rows for message in r.not_answered or ())
    return tuple(dict.fromkeys([*stored, *(r.message_id for r in closing)]))


async def _close_resending(conn: Conn, rows: Sequence[sa.Row[Any]]) -> None:
    """Delete the runs ``rows`` (:func:`_resending`), fenced by their lease tokens."""
    res = await conn.execute(
        t.turn_runs.delete().where(
            R.id.in_([r.id for r in rows]), R.lease_token.in_({r.lease_token for r in rows})
        )
    )
    if res.rowcount != len(rows):
        raise TransitionError("turn runs changed while being claimed", rule="run")


def _event_ids(rows: Sequence[sa.Row[Any]]) -> tuple[str, ...]:
    """The external event ids the runs' messages were taken in under."""
    return tuple(r.external_event_id for r in rows if r.external_event_id)


async def claim_for_retry(
    db: Database,
    clock: Clock,
    ids: IdFactory,
    *,
    external_event_id: str,
    owner: str | None,
    doubted: Callable[[str], None] = lambda token: None,
) -> Claimed | str | None:
    """The run of the message taken in under ``external_event_id``, claimed by its
    client's own retry: a REST request with an ``Idempotency-Key`` that took the key
    over (its first request's process died) and found that message taken in already.

    Taken when turn recovery would run it again: it waits for its client's resend
    (:data:`AWAIT`), or its holder is known dead and recovery has not claimed it yet.
    The claim is recovery's own, fenced by the run's lease token (one of the two wins),
    and the run stays the client's (``client``, leased to ``owner``): the retry runs the
    turn from the stored message and answers it, and a process that dies doing so leaves
    it to wait for the next retry as before. :data:`RUN_BUSY` when the run is not the
    retry's to take (a live process runs it; its item moved on; its ``complete_task``
    signal was committed; its attempts are spent; a later message of its session came,
    whose turn answers it: recovery decides those); None when
    no run of that message is left (its turn ended, or was never recorded), or when an
    answer naming the message was stored (``messages.answers``: its own turn's, its
    process thought dead and alive), whose run is then closed here: the retry gets the
    answer stored under its key with it, and runs no second turn.

    The turn such a claim runs ends by :func:`end_retaken`.

    A claim whose ``COMMIT`` is in doubt hands its token to ``doubted`` (the turn
    path's orphans) before the fault is raised: landed, the run is leased to this live
    process with no turn running it, and recovery reruns it (its answer stored under
    the key) instead of closing it when the lease lapses."""
    now = clock.now_ms()
    token = ids.new("lease")
    try:
        return await _claim_for_retry(db, ids, external_event_id, owner, token, now)
    except Unavailable as fault:
        if fault.in_doubt:
            doubted(token)
        raise


async def _claim_for_retry(
    db: Database,
    ids: IdFactory,
    external_event_id: str,
    owner: str | None,
    token: str,
    now: int,
) -> Claimed | str | None:
    """:func:`claim_for_retry`'s transaction, under the lease ``token``."""
    async with db.tx() as conn:
        query = sa.select(t.turn_runs).where(R.external_event_id == external_event_id)
        if db.is_postgres:
            query = query.with_for_update()
        row = (await conn.execute(query)).first()
        if row is None:
            return None
        gone = row.lease_owner is not None and not await conn.scalar(
            sa.select(sa.exists().where(t.processes.c.id == row.lease_owner))
        )
        if not (row.policy == AWAIT or gone) or row.attempts >= MAX_ATTEMPTS:
            return RUN_BUSY
        if row.work_item_id is not None:
            # Locked before the check for a later message below, waited for: a message
            # whose intake holds it is committed by then (see the module docstring).
            await bound_lock_waits(conn, db.busy_timeout_s)
            item = await workitems.get(conn, row.work_item_id, lock=True)
            if item.status != Status.inProgress.value or (
                item.signal_turn_id == row.turn_id and item.signal_summary
            ):
                return RUN_BUSY
        if await stored_answer(conn, row.session_id, row.message_id) is not None:
            # Its own turn answered it after all (its process, thought dead, alive and not
            # knowing it yet: no take-back), and stored that answer under the key in the
            # same transaction: the retry's route replays it. Run here, the message was
            # answered twice and the key's answer replaced by another text.
            await conn.execute(
                t.turn_runs.delete().where(R.id == row.id, R.lease_token == row.lease_token)
            )
            log.info("run of session %s closed: its message was answered", row.session_id)
            return None
        if row.policy not in _RERUNS and await _resent(conn, [row]):
            # A later message of the session answers it: recovery closes the run (the
            # retry is then told its answer was lost); run here, the message was
            # answered a second time, after that later one.
            return RUN_BUSY
        turn_id = ids.new("turn")
        res = await conn.execute(
            t.turn_runs.update()
            .where(R.id == row.id, R.lease_token == row.lease_token)
            .values(_claim_values([row], token, owner, turn_id, now, action=CLIENT, rerun=False))
        )
        if not res.rowcount:
            return RUN_BUSY
    # (Not keyed: the retry answers its own request, as the turn's caller.) The messages
    # a recovery claim closed beside it stay unshown (and stored: its column is kept).
    return Claimed.of(
        RERUN,
        token,
        [row],
        turn_id,
        row.work_item_id,
        keyed=False,
        not_answered=_not_answered([row], []),
    )


def _claim_values(
    rows: Sequence[sa.Row[Any]],
    token: str,
    owner: str | None,
    turn_id: str,
    now: int,
    *,
    action: str,
    rerun: bool,
    keyed_resend: bool = False,
    not_answered: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The claimed runs' new lease. :data:`WAITING`: left, unowned and not counted as
    an attempt, until the client's resend is due (taken by any process's recovery then).
    ``rerun``: marked so, a process that dies rerunning them leaves them to be rerun
    (:data:`RESEND` when ``keyed_resend``: why, for a failure's audit). ``not_answered``
    (:attr:`Claimed.not_answered`) is stored when there are any, in the same statement;
    left out, the column keeps what it holds."""
    values: dict[str, Any] = {"not_answered": list(not_answered)} if not_answered else {}
    if action == WAITING:
        parked = [r.lease_expires_at for r in rows if r.policy == AWAIT]
        return {
            **values,
            "lease_owner": None,
            "lease_token": token,
            "lease_expires_at": min(parked) if parked else now + RESEND_GRACE_MS,
            "policy": AWAIT,
        }
    return {
        **values,
        "lease_owner": owner,
        "lease_token": token,
        "lease_expires_at": now + RUN_LEASE_MS,
        "attempts": R.attempts + 1,
        "turn_id": turn_id,
        "policy": (RESEND if keyed_resend else RERUN) if rerun else CLIENT,
    }


async def _client_resent_or_not(
    conn: Conn, rows: Sequence[sa.Row[Any]], now: int
) -> tuple[bool, bool]:
    """For ``client`` runs no process told their client anything durable about: whether
    to rerun them, or to wait (``(rerun, wait)``; neither: close them).

    A process that answered 503 ``turn.interrupted`` keeps the runs it owes a rerun in
    memory only: the fault that stopped the turn is what refused the write of their
    mark. If it dies before the database is back, what is stored is the same as for a
    turn cut by its process dying (a user message with no answer, a ``client`` run of a
    dead owner); the difference shows only in what the client does next. A cut turn's
    client sends the message again, a new message in the session; one told "do not send
    it again" sends nothing. So a dead owner's run is closed once the session has a user
    message after the runs' own (the resend, which runs the turn), and otherwise waits
    :data:`RESEND_GRACE_MS` (:data:`AWAIT`), then is rerun. A run whose live owner let
    its lease lapse (a stalled turn) is closed at once, as before: its client is still
    there to answer."""
    if await _resent(conn, rows):
        return False, False
    if any(r.policy == AWAIT for r in rows):
        # Left to wait already: rerun once the wait is over (taken early, by a dead
        # claimer's owner check, it waits on).
        over = min(r.lease_expires_at for r in rows if r.policy == AWAIT) <= now
        return over, not over
    owners = {r.lease_owner for r in rows if r.lease_owner is not None}
    alive = (
        set(
            (
                await conn.execute(sa.select(t.processes.c.id).where(t.processes.c.id.in_(owners)))
            ).scalars()
        )
        if owners
        else set()
    )
    dead = any(r.lease_owner is not None and r.lease_owner not in alive for r in rows)
    return False, dead


async def _resent(conn: Conn, rows: Sequence[sa.Row[Any]]) -> bool:
    """Whether the session of ``rows`` has a user message after theirs: the client's
    resend, or a follow-up, whose turn answers them (see :func:`_client_resent_or_not`)."""
    later = later_message(rows[0].session_id, [r.message_id for r in rows])
    return bool(await conn.scalar(sa.select(later)))


async def _surface(conn: Any, clock: Clock, ids: IdFactory, item_id: str, summary: str) -> None:
    """The dead turn's handoff, submitted once, to a human (its text was never stored)."""
    await workitems.transition(
        conn,
        clock,
        ids,
        item_id,
        src=Status.inProgress,
        dst=Status.awaitingHuman,
        actor="system:recovery",
        action="turnInterrupted",
        text=(
            "the worker's turn was cut off after complete_task (its process died); the "
            "summary was kept, the reply text was not stored"
        ),
        values={
            "summary": summary,
            "snapshot": "",
            "signal_summary": None,
            "signal_turn_id": None,
            "last_activity_at": clock.now_ms(),
        },
    )


async def abandon_given_up(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item_id: str,
    *,
    text: str = GAVE_UP_TEXT,
    flow: bool = True,
) -> bool:
    """Abandon the ``inProgress`` work item of a turn recovery gave up (audit
    :data:`GAVE_UP_ACTION`, ``text`` saying why): a flow node's (``flow``: the flow
    resumer is woken, its paused run waits on that item and no approval will ever come),
    or a REST/MCP/Studio turn's that recovery ran because its client was told not to send
    it again (:data:`CLIENT_GAVE_UP_TEXT`, :data:`CLIENT_FAILED_TEXT`). Left
    ``inProgress``, nobody would ask again and the abandonment sweeper would end it only
    after a week of silence. False when the item had moved on already."""
    try:
        await workitems.transition(
            conn,
            clock,
            ids,
            item_id,
            src=Status.inProgress,
            dst=Status.abandoned,
            actor="system:recovery",
            action=GAVE_UP_ACTION,
            text=text,
        )
    except TransitionError:
        return False
    if flow:
        await wakes.after_commit(conn, Wake.flow)
    return True
