"""Database tables (SQLAlchemy Core). Migrations in ``migrations/`` mirror this file.

Times are epoch milliseconds (``BigInteger``); ids are prefixed random strings.
"""

from __future__ import annotations

import sqlalchemy as sa

from leadgate.core.limits import EVENT_ID_LIMIT
from leadgate.core.types import DISCORD_MESSAGE_EVENT, SLACK_MESSAGE_EVENT

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

ID = sa.String(40)
MS = sa.BigInteger()

organizations = sa.Table(
    "organizations",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("created_at", MS, nullable=False),
)

users = sa.Table(
    "users",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, sa.ForeignKey("organizations.id"), nullable=False),
    sa.Column("email", sa.String(320), nullable=False, unique=True),
    sa.Column("role", sa.String(20), nullable=False),
    sa.Column("password_hash", sa.String(200), nullable=False),
    sa.Column("created_at", MS, nullable=False),
    # Display name for audit actors in the console (optional; the email is shown too).
    sa.Column("name", sa.String(200)),
    # Set: disabled (no login, no session, no chat decision); the row stays for the audit.
    sa.Column("disabled_at", MS),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, sa.ForeignKey("organizations.id"), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),
    sa.Column("scopes", sa.JSON, nullable=False),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("revoked_at", MS),
    # Optional label (``leadgate key create --name``), shown by ``key list`` and the audit.
    sa.Column("name", sa.String(200)),
)

presets = sa.Table(
    "presets",
    metadata,
    sa.Column("id", ID, primary_key=True),
    # NULL org = platform preset (never carries a lead).
    sa.Column("org_id", ID, sa.ForeignKey("organizations.id")),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("lead_agent_id", ID),
    sa.Column("completion_policy", sa.String(40)),
    sa.Column("max_revision_rounds", sa.Integer),
    sa.Column("created_at", MS, nullable=False),
)

agents = sa.Table(
    "agents",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, sa.ForeignKey("organizations.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("slug", sa.String(200), nullable=False),
    sa.Column("model", sa.String(100), nullable=False),
    sa.Column("instructions", sa.Text, nullable=False, default=""),
    sa.Column("preset_id", ID, sa.ForeignKey("presets.id")),
    sa.Column("lead_agent_id", ID),
    sa.Column("completion_policy", sa.String(40)),
    sa.Column("max_revision_rounds", sa.Integer),
    sa.Column("active", sa.Boolean, nullable=False, default=True),
    sa.Column("deleted_at", MS),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    sa.UniqueConstraint("org_id", "slug"),
)

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("key", sa.String(500), nullable=False),
    sa.Column("created_at", MS, nullable=False),
    sa.UniqueConstraint("agent_id", "key"),
    # The last sequence number of the session's public event log (session_events), on
    # PostgreSQL: its row lock orders concurrent writers (see domain/session_events.py).
    sa.Column("event_seq", sa.BigInteger, nullable=False, default=0, server_default="0"),
    # PostgreSQL: until when (ms since the epoch, the server's clock) some replica has a
    # reader of the session's events; its writers NOTIFY only until then (0: never).
    sa.Column("watched_until", sa.BigInteger, nullable=False, default=0, server_default="0"),
)

bindings = sa.Table(
    "bindings",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("session_id", ID, nullable=False, index=True),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("address", sa.JSON, nullable=False),
    sa.Column("silent", sa.Boolean, nullable=False, default=False),
    sa.Column("route_id", ID),
    sa.Column("active", sa.Boolean, nullable=False, default=True),
    sa.Column("created_at", MS, nullable=False),
)

#: The plain turns' user messages' partial index's predicate (``ix_messages_taken_by``,
#: migration 0028), literally: the messages a plain REST/MCP/Studio turn took in.
TAKEN_BY_PREDICATE = "taken_by IS NOT NULL"

messages = sa.Table(
    "messages",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("session_id", ID, nullable=False),
    sa.Column("work_item_id", ID),
    sa.Column("role", sa.String(20), nullable=False),  # user | assistant | tool | internal
    sa.Column("content", sa.Text, nullable=False),
    sa.Column("lead_gated", sa.Boolean, nullable=False, default=False),
    sa.Column("tool_name", sa.String(100)),
    sa.Column("created_at", MS, nullable=False),
    # The history read (newest 50 of a session by created_at, then id) walks this index
    # in order and stops; it also serves every other lookup by session.
    sa.Index("ix_messages_session_created_id", "session_id", "created_at", "id"),
    # SQLite only: (session_id, rowid), the history cache's read of new rows
    # (engine/history.py). PostgreSQL has no rowid and no such cache.
    sa.Index("ix_messages_session_rowid", "session_id").ddl_if(dialect="sqlite"),
    # The process (processes.id) whose plain REST/MCP/Studio turn took this user message
    # in, until the message is settled (migration 0028): turn recovery reruns such a
    # message of a process known gone that nothing answered (leadgate.turns.runs).
    sa.Column("taken_by", ID),
    sa.Index(
        "ix_messages_taken_by",
        "taken_by",
        "created_at",
        sqlite_where=sa.text(TAKEN_BY_PREDICATE),
        postgresql_where=sa.text(TAKEN_BY_PREDICATE),
    ),
    # The user message an assistant message of a plain REST/MCP/Studio turn (or of turn
    # recovery's rerun of one) answers (migration 0029): turn recovery tells an answered
    # message by it, not by whatever message of its session came after it. No index: it
    # is read on the rows of a session's events after the message asked about.
    sa.Column("answers", ID),
)

#: The partial index's predicate, literally: a query can use the index only when its own
#: WHERE repeats this text (with bound parameters in its place neither SQLite nor a
#: generic PostgreSQL plan can prove the implication, and they scan instead).
ACTIVE_ITEM_PREDICATE = (
    "status IN ('inProgress','reviewQueued','reviewing','awaitingHuman','approved')"
)


work_items = sa.Table(
    "work_items",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("session_id", ID, nullable=False),
    sa.Column("lead_agent_id", ID, nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("completion_policy", sa.String(40), nullable=False),
    sa.Column("max_revision_rounds", sa.Integer, nullable=False),
    sa.Column("revision", sa.Integer, nullable=False, default=0),
    sa.Column("extra_allowance", sa.Integer, nullable=False, default=0),
    sa.Column("task_context", sa.Text, nullable=False),
    # complete_task writes the pending signal; the end of the turn consumes it.
    sa.Column("signal_summary", sa.Text),
    sa.Column("signal_turn_id", ID),
    sa.Column("summary", sa.Text),
    sa.Column("snapshot", sa.Text),
    sa.Column("gated_message_id", ID),
    sa.Column("binding_id", ID),
    sa.Column("pending_feedback", sa.Text),
    sa.Column("last_feedback", sa.Text),
    sa.Column("lease_token", ID),
    sa.Column("lease_expires_at", MS),
    sa.Column("lease_expiries", sa.Integer, nullable=False, default=0),
    sa.Column("last_activity_at", MS, nullable=False),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    # The process (``processes.id``) holding the review or revision lease, if known.
    sa.Column("lease_owner", ID),
    # The lead runner's claim order (updated_at, id) read straight off the index.
    sa.Index("ix_work_items_status_updated", "status", "updated_at", "id"),
    # Agent Activity: an organization's items, newest first.
    sa.Index("ix_work_items_org_updated", "org_id", "updated_at"),
    # One active work item per (worker, session), enforced by the database itself.
    sa.Index(
        "uq_work_items_active",
        "agent_id",
        "session_id",
        unique=True,
        sqlite_where=sa.text(ACTIVE_ITEM_PREDICATE),
        postgresql_where=sa.text(ACTIVE_ITEM_PREDICATE),
    ),
)


def catch_up_predicate(prefix: str) -> str:
    """The predicate of the partial index of the events whose external id starts with
    ``prefix`` (a catch-up's: :data:`leadgate.core.types.CATCH_UP_EVENTS`), literally
    (as :data:`ACTIVE_ITEM_PREDICATE`: the catch-up's read repeats this text to use it).
    Not ``LIKE 'discord:message:%'``: PostgreSQL in the C collation makes that a range of
    the unique index on ``external_event_id`` too, every such event ever, and may prefer
    it; a prefix by ``substr`` is this index's alone on both backends."""
    return f"substr(external_event_id, 1, {len(prefix)}) = '{prefix}'"


#: The Discord gateway messages' partial index's predicate (its catch-up at each READY).
GATEWAY_EVENT_PREDICATE = catch_up_predicate(DISCORD_MESSAGE_EVENT)
#: Slack's messages' partial index's predicate (its catch-up at each start).
SLACK_EVENT_PREDICATE = catch_up_predicate(SLACK_MESSAGE_EVENT)

inbound_events = sa.Table(
    "inbound_events",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("session_id", ID),
    sa.Column("work_item_id", ID),
    # accepted | rejectedBusy | reviewReply (a reviewer's mail to an email review card)
    sa.Column("outcome", sa.String(30), nullable=False),
    sa.Column("content", sa.Text, nullable=False),
    sa.Column("external_event_id", sa.String(EVENT_ID_LIMIT), unique=True),
    sa.Column("created_at", MS, nullable=False),
    # The Discord catch-up at each gateway READY (binding.bindings.recorded_since): its
    # channels and their recent messages from the gateway's events alone (the table is
    # never pruned), and no other channel's intake writes to it.
    sa.Index(
        "ix_inbound_events_gateway",
        "session_id",
        "created_at",
        "external_event_id",
        sqlite_where=sa.text(GATEWAY_EVENT_PREDICATE),
        postgresql_where=sa.text(GATEWAY_EVENT_PREDICATE),
    ),
    # The same for the Slack catch-up at each start: Slack's events alone.
    sa.Index(
        "ix_inbound_events_slack",
        "session_id",
        "created_at",
        "external_event_id",
        sqlite_where=sa.text(SLACK_EVENT_PREDICATE),
        postgresql_where=sa.text(SLACK_EVENT_PREDICATE),
    ),
)

#: Where the next catch-up of each channel starts (Discord's at each READY, Slack's at
#: each start: ``bots.base``), kept apart from ``inbound_events`` so that a live
#: message's intake writes nothing here. Moved only forward (a catch-up that read a
#: channel through, or one starting to read it); migrations 0024, 0025.
catch_up_points = sa.Table(
    "catch_up_points",
    metadata,
    # The binding kind (discord, slack) and its channel (Discord's channel id, Slack's
    # TEAM:CHANNEL).
    sa.Column("channel", sa.String(20), primary_key=True),
    sa.Column("conversation", sa.String(EVENT_ID_LIMIT), primary_key=True),
    # Epoch ms, the service's clock: every message posted before it was read.
    sa.Column("start_ms", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    # Whether the last catch-up that stored a point here read the channel through: the
    # next one then starts no earlier than the newest message taken in there since
    # (less the overlap), not the hour again. False while one reads it (stored as it
    # starts), and after it failed: the next starts from the point itself (migration 0025).
    sa.Column("read_through", sa.Boolean, nullable=False, default=False, server_default=sa.false()),
)

audit = sa.Table(
    "audit",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("work_item_id", ID, index=True),
    sa.Column("delivery_id", ID),
    sa.Column("actor", sa.String(100), nullable=False),
    sa.Column("action", sa.String(60), nullable=False),
    sa.Column("from_status", sa.String(20)),
    sa.Column("to_status", sa.String(20)),
    sa.Column("text", sa.Text),
    sa.Column("created_at", MS, nullable=False),
    # Where a human decision was made (console, api, cli, slack, teams, discord, email)
    # and the platform identity that made it (e.g. "slack:T1:U2"), beside ``actor``.
    sa.Column("surface", sa.String(20)),
    sa.Column("identity", sa.String(300)),
    # The console's change cursor: an organization's newest audit rows (operator events).
    sa.Index("ix_audit_org_created", "org_id", "created_at"),
)

#: The gating deliveries' partial index's predicate, literally (as
#: :data:`ACTIVE_ITEM_PREDICATE`: the insights' count repeats this text to use it).
GATING_DELIVERY_PREDICATE = "kind = 'gating'"
#: The email replies' partial index's predicate, literally (its read repeats this text):
#: the mails we sent in a conversation (a plain turn's reply, a gated turn's answer: both
#: name their binding; cards and card answers name none), whose Message-IDs a person's
#: answer may name.
EMAIL_REPLY_PREDICATE = "channel = 'email' AND binding_id IS NOT NULL"

deliveries = sa.Table(
    "deliveries",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("work_item_id", ID, index=True),
    sa.Column("kind", sa.String(20), nullable=False),  # gating | reply
    # reveal | post | silent | scheduled | continuation
    sa.Column("action", sa.String(20), nullable=False),
    sa.Column("channel", sa.String(20), nullable=False),
    sa.Column("binding_id", ID),
    sa.Column("address", sa.JSON, nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("next_attempt_at", MS, nullable=False),
    sa.Column("lease_token", ID),
    sa.Column("lease_expires_at", MS),
    sa.Column("error", sa.Text),
    sa.Column("external_id", sa.String(200)),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    # The process (``processes.id``) holding the send lease, if known.
    sa.Column("lease_owner", ID),
    # The relay's claim order (next_attempt_at, id) read straight off the index.
    sa.Index("ix_deliveries_status_due", "status", "next_attempt_at", "id"),
    # Insights' deliveries count: an organization's gating deliveries in a window
    # (review.insights.delivery_counts), read without scanning every organization's.
    # Gating rows alone (a plain turn's reply writes no entry), and none of its columns
    # changes after the insert (SQLite never touches it again; migration 0026).
    sa.Index(
        "ix_deliveries_org_gating_created",
        "org_id",
        "created_at",
        sqlite_where=sa.text(GATING_DELIVERY_PREDICATE),
        postgresql_where=sa.text(GATING_DELIVERY_PREDICATE),
    ),
    # An answer naming one of our email replies in In-Reply-To alone, sent before its
    # Message-ID carried the thread: that reply found by its Message-ID, one seek
    # (binding.bindings.email_reply_session_key; migration 0027). Email replies alone,
    # and external_id is written once, when the mail is sent.
    sa.Index(
        "ix_deliveries_email_reply_external",
        "external_id",
        sqlite_where=sa.text(EMAIL_REPLY_PREDICATE),
        postgresql_where=sa.text(EMAIL_REPLY_PREDICATE),
    ),
)

policy_rules = sa.Table(
    "policy_rules",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False, index=True),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("pattern", sa.Text, nullable=False),
    sa.Column("action", sa.String(10), nullable=False),
    sa.Column("created_at", MS, nullable=False),
)

routes = sa.Table(
    "routes",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("channel", sa.String(20), nullable=False, index=True),
    sa.Column("match", sa.JSON, nullable=False),
    sa.Column("silent", sa.Boolean, nullable=False, default=False),
    sa.Column("active", sa.Boolean, nullable=False, default=True),
    sa.Column("created_at", MS, nullable=False),
)

schedules = sa.Table(
    "schedules",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("cron", sa.String(100), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("next_fire_at", MS, nullable=False, index=True),
    sa.Column("active", sa.Boolean, nullable=False, default=True),
    sa.Column("created_at", MS, nullable=False),
)

console_sessions = sa.Table(
    "console_sessions",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("user_id", ID, nullable=False),
    sa.Column("expires_at", MS, nullable=False),
    sa.Column("created_at", MS, nullable=False),
)

flows = sa.Table(
    "flows",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("nodes", sa.JSON, nullable=False),
    sa.Column("created_at", MS, nullable=False),
    sa.UniqueConstraint("org_id", "name"),
)

flow_runs = sa.Table(
    "flow_runs",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("flow_id", ID, nullable=False, index=True),
    # running | waitingForHitl | completed | failed
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("outputs", sa.JSON, nullable=False),
    sa.Column("start_index", sa.Integer, nullable=False),
    sa.Column("resumed_from", ID),
    sa.Column("error", sa.Text),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    # The lease of the process executing a ``running`` run (migration 0015); cleared when
    # the run leaves ``running``. Recovery continues a run whose lease lapsed.
    sa.Column("lease_token", ID),
    sa.Column("lease_expires_at", MS),
    sa.Column("lease_owner", ID),
    # Recovery claims since the run last kept a node's output (migration 0017): after
    # flows.recovery.MAX_RECOVERIES of them the run fails (flow.unrecoverable).
    sa.Column("recovery_attempts", sa.Integer, nullable=False, default=0, server_default="0"),
    sa.Index("ix_flow_runs_status_lease", "status", "lease_expires_at"),
)

flow_run_events = sa.Table(
    "flow_run_events",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("run_id", ID, nullable=False, index=True),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("created_at", MS, nullable=False),
)

continuations = sa.Table(
    "continuations",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    # Looked up by run through uq_continuations_run_node below (its leading column): the
    # index of its own (migration 0015) was dropped as redundant (migration 0018).
    sa.Column("run_id", ID, nullable=False),
    sa.Column("node_index", sa.Integer, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("session_key", sa.String(500), nullable=False),
    sa.Column("work_item_id", ID, index=True),
    # waiting | resumed | closed
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("summary", sa.Text),
    sa.Column("resumed_run_id", ID),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    # One continuation per agent node of a run (migration 0016): a second one of a node
    # could resume the flow twice. The executor inserts it ON CONFLICT DO NOTHING.
    sa.Index("uq_continuations_run_node", "run_id", "node_index", unique=True),
)

# --- Review destinations, reviewer links, review SLAs, episodes and cards (migration 0006)

review_destinations = sa.Table(
    "review_destinations",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False, index=True),
    # NULL: the whole organization; else only this agent's items (agent-level
    # destinations of a tier replace the organization's for that agent).
    sa.Column("agent_id", ID),
    sa.Column("channel", sa.String(20), nullable=False),  # slack | teams | discord | email
    # notify: cards when an item starts waiting (and reminders); escalate: escalate_after
    sa.Column("tier", sa.String(20), nullable=False),
    sa.Column("target", sa.String(500), nullable=False),  # as the operator wrote it
    sa.Column("address", sa.JSON, nullable=False),  # the channel address cards go to
    sa.Column("created_at", MS, nullable=False),
)

user_links = sa.Table(
    "user_links",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("user_id", ID, nullable=False, index=True),
    sa.Column("platform", sa.String(20), nullable=False),  # slack | teams | discord
    # slack "TEAM:USER", teams the AAD object id, discord the user id
    sa.Column("identity", sa.String(300), nullable=False),
    sa.Column("created_at", MS, nullable=False),
    sa.UniqueConstraint("org_id", "platform", "identity"),
)

review_sla = sa.Table(
    "review_sla",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),  # "" = the organization's own override
    # Milliseconds; NULL inherits (agent -> organization -> [review] config), 0 is off.
    sa.Column("remind_after_ms", MS),
    sa.Column("remind_every_ms", MS),
    sa.Column("escalate_after_ms", MS),
    sa.Column("expire_after_ms", MS),
    sa.Column("created_at", MS, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
    sa.UniqueConstraint("org_id", "agent_id"),
)

review_episodes = sa.Table(
    "review_episodes",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("work_item_id", ID, nullable=False, index=True),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("reason", sa.String(20), nullable=False),  # awaitingHuman | deliveryUnknown
    sa.Column("delivery_id", ID),  # the gating delivery, for deliveryUnknown
    sa.Column("started_at", MS, nullable=False),
    # The earliest of the timers below (NULL when closed or nothing is left to fire).
    sa.Column("due_at", MS, index=True),
    sa.Column("next_remind_at", MS),
    sa.Column("remind_every_ms", MS),
    sa.Column("reminders", sa.Integer, nullable=False, default=0),
    sa.Column("escalate_at", MS),
    sa.Column("escalated_at", MS),
    sa.Column("expire_at", MS),
    sa.Column("expire_after_ms", MS),
    sa.Column("closed_at", MS),
    sa.Column("outcome", sa.String(40)),
    sa.Column("created_at", MS, nullable=False),
    # At most one open episode per work item.
    sa.Index(
        "uq_review_episodes_open",
        "work_item_id",
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    ),
)

review_cards = sa.Table(
    "review_cards",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("episode_id", ID, nullable=False, index=True),
    sa.Column("work_item_id", ID, nullable=False),
    # The outbox row that posts the card (indexed: migration 0020).
    sa.Column("delivery_id", ID, nullable=False, index=True),
    sa.Column("channel", sa.String(20), nullable=False),
    sa.Column("purpose", sa.String(20), nullable=False),  # notify | reminder | escalation
    sa.Column("created_at", MS, nullable=False),
    # An email card answerable by reply ([email] review_reply_address): the SHA-256 (hex)
    # of the random token in its Reply-To address; the token itself is kept only in the
    # card mail's outbox row, until it is sent (outbox.channel.UNTIL_SENT; migration 0019).
    sa.Column("reply_token_hash", sa.String(64)),
    sa.Index("uq_review_cards_reply_token_hash", "reply_token_hash", unique=True),
)

teams_conversations = sa.Table(
    "teams_conversations",
    metadata,
    # The conversation id ("19:...@thread.tacv2"); the reference is the last one seen.
    sa.Column("conversation_id", sa.String(300), primary_key=True),
    sa.Column("tenant_id", sa.String(100)),
    sa.Column("reference", sa.JSON, nullable=False),
    sa.Column("updated_at", MS, nullable=False),
)

session_events = sa.Table(
    "session_events",
    metadata,
    # The public, per-session event log read by the review-status SSE stream (and MCP
    # resource subscriptions): "message" (a visible message stored or revealed) and
    # "review" (the held work's public status). Written in the transaction of the change
    # it reports; (session_id, seq) is its order (domain/session_events.py).
    sa.Column("session_id", ID, primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("kind", sa.String(10), nullable=False),
    sa.Column("message_id", ID),
    sa.Column("status", sa.String(20)),
    sa.Column("created_at", MS, nullable=False),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    # Idempotency-Key of POST /v1/chat/completions: only a SHA-256 of (org, key) is kept,
    # with a SHA-256 of the request it was first used with and that request's answer.
    sa.Column("org_id", ID, primary_key=True),
    sa.Column("key_hash", sa.String(64), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("created_at", MS, nullable=False, index=True),
    # While the first request runs: when it counts as dead (its process crashed).
    sa.Column("lease_expires_at", MS, nullable=False),
    sa.Column("response", sa.JSON(none_as_null=True)),
    # The claim's token (migration 0014): renewals and the release are fenced by it.
    sa.Column("owner", sa.String(40)),
)

# Live service processes (migration 0007). A row is written at startup and refreshed by a
# heartbeat; the row of a process known dead (same host and its pid gone, or a heartbeat
# missed for ``[runners] dead_after_s``) is deleted, and a lease whose owner has no row
# here is taken back at once.
processes = sa.Table(
    "processes",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("host", sa.String(200), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    # Distinguishes a reused pid: the process's start time as the kernel reports it.
    sa.Column("start_token", sa.String(40), nullable=False),
    sa.Column("role", sa.String(20), nullable=False),
    sa.Column("started_at", MS, nullable=False),
    sa.Column("heartbeat_at", MS, nullable=False),
    # When the oldest plain REST/MCP/Studio turn in flight at the last heartbeat took its
    # message in (migration 0030; NULL: none): written by the heartbeat's UPDATE, so that
    # turn recovery's search of the process once it is gone reaches back to it.
    sa.Column("turns_since", MS),
)

# Processes known gone (reaped, or stopped) whose plain REST/MCP/Studio messages
# (messages.taken_by) turn recovery has not searched yet (migration 0028): one row per
# such process, deleted by the search that records their unanswered messages' runs
# (leadgate.turns.runs.record_taken). ``heartbeat_at``: its last, the search's window.
gone_processes = sa.Table(
    "gone_processes",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("heartbeat_at", MS, nullable=False),
    # Its ``processes.turns_since`` (migration 0030): the window reaches back to it.
    sa.Column("turns_since", MS),
)

# Turns recorded before their platform was answered (migration 0007): written in the
# intake transaction, deleted in the turn's last one. A row left by a process that died
# is re-run, closed or surfaced by the recovery runner (leadgate.runners.recovery).
turn_runs = sa.Table(
    "turn_runs",
    metadata,
    sa.Column("id", ID, primary_key=True),
    sa.Column("org_id", ID, nullable=False),
    sa.Column("agent_id", ID, nullable=False),
    sa.Column("session_id", ID, nullable=False, index=True),
    sa.Column("binding_id", ID, nullable=False),
    sa.Column("work_item_id", ID),
    sa.Column("message_id", ID, nullable=False),
    # rerun (channels: nobody else will ask again) | client (api: the client retries)
    # | await (a dead process's client run waiting for a resend) | resend (rerun: a keyed
    # REST request's, its client told nothing was stored; leadgate.turns.runs.RESEND)
    sa.Column("policy", sa.String(10), nullable=False),
    sa.Column("turn_id", ID, nullable=False),
    sa.Column("lease_owner", ID),
    sa.Column("lease_token", ID, nullable=False, index=True),
    sa.Column("lease_expires_at", MS, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=1),
    sa.Column("created_at", MS, nullable=False),
    # The intake's external event id (migration 0021): an Idempotency-Key's retry finds
    # its message's run by it, and a rerun stores its answer under that key.
    sa.Column("external_event_id", sa.String(EVENT_ID_LIMIT)),
    # The messages of the session's runs that a recovery claim closed beside this run
    # (their clients send them again): a JSON list of message ids, or NULL for none
    # (migration 0022). Its rerun, and any later one, does not show them to the model.
    sa.Column("not_answered", sa.JSON(none_as_null=True)),
)
