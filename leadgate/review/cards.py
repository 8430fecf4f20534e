"""Review cards: written through the outbox when an item starts waiting for a human,
updated in place once it is decided.

An **episode** is one stretch of waiting: an item enters ``awaitingHuman``, or its
gating delivery becomes ``deliveryUnknown``. :meth:`ReviewNotifier.open` runs inside the
transaction that caused it (through :meth:`outbox.store.Outbox.on_review_needed`): it
writes the episode (with its reminder, escalation and expiry times) and one card
delivery per destination, so a card is never lost (the transition commits it) and never
doubled (the relay's fenced claims). Cards are ``card`` deliveries, never ``gating``
ones: the actionable queue and the item's completion ignore them.

:func:`close_for_item` runs inside every decision's transaction (human decisions,
delivery recovery, expiry; see :mod:`leadgate.review.decisions`): it closes the open
episode and, for each of its cards, cancels a card not yet sent or queues a
``cardUpdate`` delivery that edits the posted card to show the outcome (email cards
cannot be edited: a sent one is left alone, one whose send was uncertain is cancelled).
A card being sent is left to its send: posted, it is edited; refused for now or maybe
posted, it ends ``cancelled`` as a card not yet sent does, and its edit with it
(:meth:`outbox.outcomes.OutcomeCommitter._commit_one`).

An opened episode's earliest timer is signalled on :data:`TIMERS_TOPIC` once its
transaction commits (in process, no statement): the SLA runner wakes when it is sooner
than the timer it sleeps toward (:meth:`leadgate.review.sla.SlaRunner.timers_opened`).
On PostgreSQL the episode's ``INSERT`` also sends it to the other replicas
(``RETURNING pg_notify``: :attr:`leadgate.domain.wakes.Wake.sla`), whose SLA runners
weigh it the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.config import ReviewSettings
from leadgate.core.limits import EVENT_ID_LIMIT, bounded, cut
from leadgate.database import schema as t
from leadgate.database.db import Conn, signal_after_commit
from leadgate.database.sql import insert_ignore_stmt
from leadgate.domain import wakes
from leadgate.domain.rows import Delivery
from leadgate.review.destinations import Destination, destinations_for, effective_sla
from leadgate.review.facts import ReviewFacts, review_facts
from leadgate.review.replies import (
    ReplyCard,
    TokenFactory,
    instructions,
    new_token,
    reply_address,
    token_hash,
)
from outbox.channel import Card, CardOutcome
from outbox.store import (
    CARD,
    CARD_CLOSED_AT,
    CARD_UPDATE,
    ENDED,
    DeliveryStatus,
    Outbox,
    count_cancelled,
)

log = logging.getLogger("leadgate.review.cards")

E = t.review_episodes.c
RC = t.review_cards.c
D = t.deliveries.c
U = t.users.c

#: :meth:`leadgate.database.db.Database.on_commit_payloads` topic: the earliest timer
#: (``due_at``, ms) of each episode the transaction opened.
TIMERS_TOPIC = "review-timers"

#: The plain-text form of a card cuts the summary here (email and fallback texts).
TEXT_SUMMARY_LIMIT = 4_000
#: What a decision's verb looks like on a card.
OUTCOME_TITLES = {
    "approve": "Approved",
    "reject": "Rejected",
    "return": "Returned to the worker",
    "cancel": "Cancelled",
    "confirm": "Delivery confirmed",
    "retry": "Delivery retried",
    "expire": "Expired (rejected)",
}


def plain_text(card: Card, *, summary_limit: int = TEXT_SUMMARY_LIMIT) -> str:
    """The card as plain text (email body, chat fallback text)."""
    lines = [card.title, ""]
    if card.outcome is not None:
        lines += [outcome_text(card.outcome), ""]
    lines += [
        f"Agent: {card.agent}",
        f"From: {card.source}",
        f"Why: {card.why}",
        f"Waiting since: {iso(card.waiting_since_ms)}",
        f"Revision: {card.revision} of {card.rounds}",
        "",
        "Summary:",
        cut(card.summary or "(no summary)", summary_limit),
        "",
        f"Review it: {card.link}",
    ]
    return "\n".join(lines)


def outcome_line(outcome: CardOutcome) -> str:
    """``Approved by alice@example.com (slack) at 2026-...``: who decided, never the
    decision's reason (each surface shows that quoted in its own markup, under it)."""
    where = f" ({outcome.surface})" if outcome.surface else ""
    return f"{outcome.title} by {outcome.by}{where} at {iso(outcome.at_ms)}"


def quoted(said: str) -> str:
    """A decision's reason or feedback as plain text quoted line by line (``> ``), as a
    mail quotes: appended to the outcome's line as typed, a second line of it ran on
    as if it were the answer's own."""
    return "\n".join(f"> {line}" for line in said.splitlines() or [""])


def outcome_text(outcome: CardOutcome, line: str | None = None) -> str:
    """The outcome in plain text (email, fallback texts): ``line`` (its
    :func:`outcome_line` unless given) and the decision's reason, if any, quoted
    under it."""
    line = outcome_line(outcome) if line is None else line
    return f"{line}\n{quoted(outcome.text)}" if outcome.text else line


async def who(conn: Conn, actor: str) -> str:
    """An audit actor in words: a user's email, ``API key key_...``, ``the lead``."""
    kind, _, ref = actor.partition(":")
    if kind == "user":
        email = (await conn.execute(sa.select(U.email).where(U.id == ref))).scalar()
        return str(email) if email else actor
    if kind == "key":
        return f"API key {ref}"
    if kind == "lead":
        return "the lead"
    if actor == "system:expiry":
        return "expiry"
    return actor


class ReviewNotifier:
    """Opens episodes and writes their cards (see the module docstring).

    ``public_url`` makes the console link; ``defaults`` are the ``[review]`` timers.
    """

    def __init__(
        self,
        clock: Clock,
        ids: IdFactory,
        outbox: Outbox,
        *,
        public_url: str,
        defaults: ReviewSettings,
        reply_address: str = "",
        tokens: TokenFactory = new_token,
    ) -> None:
        self.clock = clock
        self.ids = ids
        self.outbox = outbox
        self.public_url = public_url.rstrip("/")
        self.defaults = defaults
        #: ``[email] review_reply_address`` ("": email cards are not answerable by reply)
        self.reply_address = reply_address
        self.tokens = tokens

    async def open(
        self, conn: Conn, item_id: str, reason: str, delivery_id: str | None = None
    ) -> str | None:
        """Open an episode for ``item_id`` and queue its cards; the episode id (``None``
        when one is already open: nothing is written twice)."""
        open_already = (await conn.execute(_OPEN_EPISODES, {"p_item": item_id})).scalar()
        if open_already is not None:
            log.warning("work item %s already has an open review episode", item_id)
            return None
        facts = (await review_facts(conn, [item_id])).get(item_id)
        if facts is None:
            return None
        sla = await effective_sla(conn, facts.org_id, facts.agent_id, self.defaults)
        now = self.clock.now_ms()
        remind_at = now + sla.remind_after_ms if sla.remind_after_ms else None
        escalate_at = now + sla.escalate_after_ms if sla.escalate_after_ms else None
        # deliveryUnknown is reminded about, never expired: a human must say what happened.
        expire_after = sla.expire_after_ms if reason == "awaitingHuman" else None
        expire_at = now + expire_after if expire_after else None
        episode_id = self.ids.new("rep")
        due_at = earliest(remind_at, escalate_at, expire_at)
        insert = t.review_episodes.insert().values(
            id=episode_id,
            org_id=facts.org_id,
            work_item_id=item_id,
            agent_id=facts.agent_id,
            reason=reason,
            delivery_id=delivery_id or facts.delivery_id,
            started_at=now,
            due_at=due_at,
            next_remind_at=remind_at,
            remind_every_ms=sla.remind_every_ms,
            reminders=0,
            escalate_at=escalate_at,
            escalated_at=None,
            expire_at=expire_at,
            expire_after_ms=expire_after,
            closed_at=None,
            outcome=None,
            created_at=now,
        )
        if due_at is not None and conn.dialect.name == "postgresql":
            # Other replicas' SLA runners hear the timer at commit (NOTIFY), sent by
            # this INSERT itself: no statement is added to the transaction.
            insert = insert.returning(
                sa.func.pg_notify(wakes.CHANNEL, wakes.timer_payload(conn, due_at))
            )
        await conn.execute(insert)
        if due_at is not None:
            signal_after_commit(conn, TIMERS_TOPIC, due_at)
        await self.post(conn, episode_id, facts, "notify")
        return episode_id

    async def post(self, conn: Conn, episode_id: str, facts: ReviewFacts, purpose: str) -> int:
        """Queue one card per destination of the tier ``purpose`` implies (``notify``
        and ``reminder``: the notify tier; ``escalation``: the escalate tier)."""
        tier = "escalate" if purpose == "escalation" else "notify"
        sent = 0
        for destination in await destinations_for(conn, facts.org_id, facts.agent_id, tier):
            await self._post_one(conn, episode_id, facts, purpose, destination)
            sent += 1
        return sent

    async def post_again(self, conn: Conn, episode: Any, purpose: str) -> int:
        """A reminder or an escalation of an open episode (the SLA runner)."""
        facts = (await review_facts(conn, [episode.work_item_id])).get(episode.work_item_id)
        if facts is None or facts.reason is None:
            return 0
        return await self.post(conn, episode.id, facts, purpose)

    async def _post_one(
        self, conn: Conn, episode_id: str, facts: ReviewFacts, purpose: str, dest: Destination
    ) -> None:
        # The card names its own delivery (a click on it then names it exactly), so the
        # id is made before the row.
        card_id = self.ids.new("dlv")
        card = Card(
            card_id=card_id,
            item_id=facts.item_id,
            episode_id=episode_id,
            purpose=purpose,
            reason=facts.reason or "awaitingHuman",
            delivery_id=facts.delivery_id,
            agent=facts.agent_name,
            source=facts.source,
            why=facts.why,
            summary=facts.summary,
            revision=facts.revision,
            rounds=facts.rounds,
            waiting_since_ms=facts.waiting_since_ms,
            link=f"{self.public_url}{facts.detail_path}",
        )
        address: dict[str, Any] = {**dest.address, "card": card.to_json()}
        text = plain_text(card)
        token_digest: str | None = None
        if dest.channel == "email":
            lines = facts.summary.strip().splitlines()
            address["subject"] = cut(f"{card.title}: {lines[0] if lines else facts.item_id}", 200)
            if self.reply_address:
                # Answerable by reply: the token is in the mail only; the row keeps its hash.
                token = self.tokens()
                token_digest = token_hash(token)
                address["reply_to"] = reply_address(self.reply_address, token)
                text += "\n\n" + instructions(card.reason)
        delivery = await self.outbox.enqueue_card(
            conn,
            org_id=facts.org_id,
            work_item_id=facts.item_id,
            channel=dest.channel,
            address=address,
            text=text,
            delivery_id=card_id,
        )
        await conn.execute(
            t.review_cards.insert().values(
                id=self.ids.new("rcard"),
                org_id=facts.org_id,
                episode_id=episode_id,
                work_item_id=facts.item_id,
                delivery_id=delivery.id,
                channel=dest.channel,
                purpose=purpose,
                created_at=self.clock.now_ms(),
                reply_token_hash=token_digest,
            )
        )


def earliest(*times: int | None) -> int | None:
    """The earliest of the given times that are set."""
    present = [x for x in times if x is not None]
    return min(present) if present else None


# A decision's card bookkeeping, built once (the plan cache keys on the statement object).
_OPEN_EPISODES = sa.select(E.id).where(
    E.work_item_id == sa.bindparam("p_item"), E.closed_at.is_(None)
)
#: Closes the item's open episode (one at most: ``open`` never opens a second) and
#: names it; the cards are then read per episode. Neither takes a list of ids: an
#: expanding parameter is compiled again on every execution (over half of this
#: bookkeeping's time in a profile of approvals).
_CLOSE_EPISODES = (
    t.review_episodes.update()
    .where(E.work_item_id == sa.bindparam("p_item"), E.closed_at.is_(None))
    .returning(E.id)
)
_CARDS_OF = (
    sa.select(D.id, D.status, D.channel, D.address, D.org_id, D.work_item_id)
    .select_from(t.review_cards.join(t.deliveries, D.id == RC.delivery_id))
    .where(RC.episode_id == sa.bindparam("p_episode"), D.kind == CARD)
    .order_by(D.created_at, D.id)
)


async def close_for_item(conn: Conn, outbox: Outbox, item_id: str, outcome: CardOutcome) -> int:
    """Close the item's open episode and update its cards to ``outcome`` (inside the
    decision's transaction); returns the number of card updates queued."""
    clock = outbox.clock
    now = clock.now_ms()
    closed = await conn.execute(
        _CLOSE_EPISODES,
        {"p_item": item_id, "closed_at": now, "due_at": None, "outcome": outcome.title[:40]},
    )
    cards = [
        card
        for episode in [str(r) for r in closed.scalars()]
        for card in (await conn.execute(_CARDS_OF, {"p_episode": episode})).all()
    ]
    queued = 0
    for c in cards:
        status = c.status
        if status == DeliveryStatus.pending.value:
            if await _cancel_card(conn, c.id, status, now):
                count_cancelled(conn, [c.channel])
                continue  # never posted: nothing to edit
            status = DeliveryStatus.sending.value  # claimed meanwhile (another replica)
        if c.channel == "email":
            if status == DeliveryStatus.deliveryUnknown.value:
                # Maybe mailed: it cannot be edited, nor answered any more, and sent again
                # it would offer a decision already made. It ends here, and its Reply-To
                # (the plain token) with it. Not counted again: its send was counted
                # deliveryUnknown as it ended.
                await _cancel_card(conn, c.id, status, now)
            # A sent mail cannot be edited. One being sent is left to its send, which
            # ends its row and its Reply-To whatever the outcome (outbox.outcomes).
            continue
        if status not in (DeliveryStatus.sent.value, DeliveryStatus.sending.value):
            # failed, cancelled, or maybe posted (deliveryUnknown): no id to edit; a click
            # that proves an uncertain card posted queues its edit then (settled_card).
            continue
        # Being posted: the edit waits for the post. A post refused for now or uncertain
        # ends the card cancelled, one refused for good fails it, and either way its edit
        # ends cancelled, never sent (outbox.outcomes).
        queued += await _queue_update(conn, outbox, c, outcome)
    return queued


async def _cancel_card(conn: Conn, card_id: str, status: str, now: int) -> bool:
    """Cancel card delivery ``card_id``, fenced on its ``status``; whether it was. An
    ended row keeps nothing only its send needed (:data:`outbox.store.ENDED`)."""
    res = await conn.execute(
        t.deliveries.update()
        .where(D.id == card_id, D.status == status)
        .values(status=DeliveryStatus.cancelled.value, updated_at=now, **ENDED)
    )
    return bool(res.rowcount)


async def _queue_update(conn: Conn, outbox: Outbox, c: Any, outcome: CardOutcome) -> int:
    """Queue the ``cardUpdate`` that edits card delivery ``c`` to show ``outcome`` (1),
    or nothing when its address holds no card (0)."""
    raw = (c.address or {}).get("card")
    if not isinstance(raw, dict):
        return 0
    decided = Card.from_json(raw).decided(outcome)
    address = {**c.address, "card": decided.to_json(), "card_delivery_id": c.id}
    await outbox.enqueue_card(
        conn,
        org_id=c.org_id,
        work_item_id=c.work_item_id,
        channel=c.channel,
        address=address,
        text=plain_text(decided),
        kind=CARD_UPDATE,
    )
    return 1


async def settled_card(conn: Conn, outbox: Outbox, card: Delivery) -> int:
    """A card delivery whose uncertain post was just confirmed with its message's id
    (a click on the card itself; inside the confirmation's transaction): when its
    episode was already closed by a decision, queue the update every other card of that
    episode got then (the decision found no id to edit on this one). Returns the number
    of updates queued (0 or 1)."""
    if (
        card.kind != CARD
        or not card.external_id
        or card.channel == "email"
        or card.work_item_id is None
    ):
        return 0
    closed_at = await conn.scalar(CARD_CLOSED_AT, {"p_item": card.work_item_id, "p_card": card.id})
    if closed_at is None:
        return 0  # still waiting: the decision, when it comes, edits it
    outcome = await last_outcome(conn, card.work_item_id, until_ms=int(closed_at))
    if outcome is None:
        return 0
    return await _queue_update(conn, outbox, card, outcome)


#: Audit actions that decide an item (or its delivery), with their card verb.
DECISION_ACTIONS = {
    "approve": "approve",
    "reject": "reject",
    "return": "return",
    "cancel": "cancel",
    "expire": "expire",
    "deliveryConfirmed": "confirm",
    "deliveryRetried": "retry",
}


async def last_outcome(
    conn: Conn, item_id: str, *, until_ms: int | None = None
) -> CardOutcome | None:
    """The latest decision on ``item_id`` as a card shows it (``None``: none yet);
    ``until_ms``: the latest made by then (the one that closed an earlier episode)."""
    a = t.audit.c
    query = (
        sa.select(a.action, a.actor, a.surface, a.text, a.created_at)
        .select_from(t.audit.outerjoin(t.deliveries, D.id == a.delivery_id))
        .where(
            a.work_item_id == item_id,
            a.action.in_(list(DECISION_ACTIONS)),
            # Recovering a card's own uncertain post decides nothing about the item.
            sa.or_(a.delivery_id.is_(None), D.kind == "gating"),
        )
        .order_by(a.created_at.desc(), a.id.desc())
        .limit(1)
    )
    if until_ms is not None:
        query = query.where(a.created_at <= until_ms)
    row = (await conn.execute(query)).first()
    if row is None:
        return None
    verb = DECISION_ACTIONS[row.action]
    return CardOutcome(
        title=OUTCOME_TITLES[verb],
        by=await who(conn, row.actor),
        surface=row.surface,
        at_ms=int(row.created_at),
        text=cut(row.text, 500)
        if row.text and verb in ("reject", "return", "cancel", "expire")
        else None,
    )


async def posted_card(
    conn: Conn, item_id: str, channel: str, external_id: str | None, card_id: str | None = None
) -> Card | None:
    """The card of ``item_id`` posted on ``channel``: delivery ``card_id`` when the
    clicked card names itself, else the one posted as message ``external_id`` (the newest
    card there when neither is known). By its own id, a card clicked before its post's
    message id was recorded (the outbox records it after the platform's answer) is found:
    by the message id it was not, and the clicker's card was not shown decided."""
    query = (
        sa.select(D.address)
        .where(D.work_item_id == item_id, D.kind == CARD, D.channel == channel)
        .order_by(D.created_at.desc(), D.id.desc())
        .limit(1)
    )
    if card_id:
        query = query.where(D.id == card_id)
    elif external_id:
        query = query.where(D.external_id == external_id)
    raw = (await conn.execute(query)).scalar()
    card = raw.get("card") if isinstance(raw, dict) else None
    return Card.from_json(card) if isinstance(card, dict) else None


def conversation_of(channel: str, address: dict[str, Any]) -> str | None:
    """The conversation a card delivery's ``address`` posts to on ``channel`` (a Slack
    channel id, a Discord channel id, a Teams conversation id), as a click on the card is
    compared with it (:func:`same_conversation`)."""
    if channel == "slack":
        found = address.get("channel")
    elif channel == "discord":
        found = address.get("channel_id")
    elif channel == "teams":
        reference = address.get("reference")
        conversation = reference.get("conversation") if isinstance(reference, dict) else None
        found = conversation.get("id") if isinstance(conversation, dict) else None
    else:
        found = None
    return same_conversation(channel, str(found)) if found else None


def same_conversation(channel: str, conversation: str) -> str:
    """``conversation`` as a click and a card's address are compared on ``channel``.

    A Teams channel names every activity of a reply chain by the channel's id with
    ``;messageid=<the chain's first message>`` after it: a card posted into the channel
    starts its own chain, so a click on it names ``<channel>;messageid=<the card>``
    while the card was posted to ``<channel>`` (and a card posted into a chain names
    that chain's first message, not its own). The part before ``;messageid=`` is the
    conversation; other platforms' ids are compared as they are."""
    if channel == "teams":
        return conversation.split(";messageid=", 1)[0]
    return conversation


#: The item's cards whose post was uncertain (the caller adds the item and channel), by
#: the item's deliveries and each card's ``review_cards`` row (``delivery_id``, indexed:
#: migration 0020; a click naming no wait read every card ever posted).
_UNCERTAIN_CARDS = (
    sa.select(D.id, D.address)
    .select_from(t.review_cards.join(t.deliveries, D.id == RC.delivery_id))
    .where(
        D.kind == CARD,
        D.status == DeliveryStatus.deliveryUnknown.value,
        D.external_id.is_(None),
    )
)


async def uncertain_card(
    conn: Conn,
    item_id: str,
    channel: str,
    conversation: str,
    message_id: str,
    episode_id: str | None,
    card_id: str | None = None,
) -> str | None:
    """The card delivery a click on message ``message_id`` in ``conversation`` proves
    posted, when its post was uncertain: the one ``deliveryUnknown`` card of
    ``item_id`` on ``channel`` to that conversation (of ``episode_id``, when the click
    names one; the card delivery ``card_id`` itself, when the clicked card names it).
    ``None`` when the message is a known card of the item (a click is never matched to
    a second card), or when no card, or more than one, fits: a click that cannot say
    which card it is settles nothing. Reads only the item's deliveries (by its index):
    a click costs no scan of the table."""
    known = await conn.scalar(
        sa.select(D.id)
        .where(D.work_item_id == item_id, D.channel == channel, D.external_id == message_id)
        .limit(1)
    )
    if known is not None:
        return None
    query = _UNCERTAIN_CARDS.where(D.work_item_id == item_id, D.channel == channel)
    if episode_id:
        query = query.where(RC.episode_id == episode_id)
    if card_id:
        query = query.where(D.id == card_id)
    clicked = same_conversation(channel, conversation)
    fits = [
        str(r.id)
        for r in (await conn.execute(query)).all()
        if conversation_of(channel, r.address or {}) == clicked
    ]
    return fits[0] if len(fits) == 1 else None


_ITEM: sa.BindParameter[str] = sa.bindparam("p_item")
_ORG: sa.BindParameter[str] = sa.bindparam("p_org")
#: A card's wait by its delivery id, fenced to the item's episodes and cards.
_CARD_EPISODE = (
    sa.select(RC.episode_id)
    .select_from(t.review_episodes.join(t.review_cards, RC.episode_id == E.id))
    .where(
        E.work_item_id == _ITEM,
        E.org_id == _ORG,
        RC.work_item_id == _ITEM,
        RC.org_id == _ORG,
        RC.delivery_id == sa.bindparam("p_card"),
    )
    .limit(1)
)


async def card_episode(conn: Conn, card_id: str, item_id: str, org_id: str) -> str | None:
    """The episode (wait) whose card is delivery ``card_id``, read from the card's
    ``review_cards`` row; ``None`` unless that card is one of ``item_id``'s in
    ``org_id`` (a card of another item or organization names no wait of this one).
    One read, by the item's episodes' index: a click costs no scan."""
    found = await conn.scalar(
        _CARD_EPISODE, {"p_item": item_id, "p_org": org_id, "p_card": card_id}
    )
    return None if found is None else str(found)


async def open_episode(conn: Conn, item_id: str) -> str | None:
    """The id of the item's open episode, if any."""
    found = (
        await conn.execute(sa.select(E.id).where(E.work_item_id == item_id, E.closed_at.is_(None)))
    ).scalar()
    return None if found is None else str(found)


async def reply_card(conn: Conn, token: str) -> ReplyCard | None:
    """The card whose email reply token is ``token`` (found by its hash, one indexed
    read), with its wait's reason; ``None``: no card has it."""
    row = (
        await conn.execute(
            sa.select(
                RC.id,
                RC.org_id,
                RC.work_item_id,
                RC.episode_id,
                E.agent_id,
                E.reason,
                E.delivery_id,
            )
            .select_from(t.review_cards.join(t.review_episodes, E.id == RC.episode_id))
            .where(RC.reply_token_hash == token_hash(token))
        )
    ).first()
    if row is None:
        return None
    return ReplyCard(
        org_id=str(row.org_id),
        item_id=str(row.work_item_id),
        episode_id=str(row.episode_id),
        reason=str(row.reason),
        delivery_id=None if row.delivery_id is None else str(row.delivery_id),
        card_id=str(row.id),
        agent_id=str(row.agent_id),
    )


#: The inbound event of a reviewer's mail to a card (see :func:`reply_taken`).
REPLY_EVENT = "reviewReply"
_EVENT_SEEN = sa.select(t.inbound_events.c.id).where(
    t.inbound_events.c.external_event_id == sa.bindparam("p_event")
)


def reply_event_id(card: ReplyCard, message_id: str) -> str:
    """The de-duplication key (``inbound_events.external_event_id``) of the mail
    ``message_id`` to ``card``: one per card it names (a routed recipient's own key is
    ``email:<address>:<sender>:<Message-ID>``)."""
    return bounded(f"email-review:{card.card_id}:{message_id}", EVENT_ID_LIMIT)


async def reply_seen(conn: Conn, event_id: str) -> bool:
    """Whether the mail of ``event_id`` (:func:`reply_event_id`) was taken before."""
    return await conn.scalar(_EVENT_SEEN, {"p_event": event_id}) is not None


async def reply_taken(
    conn: Conn, clock: Clock, ids: IdFactory, card: ReplyCard, event_id: str, content: str
) -> bool:
    """Record, in ``conn``'s transaction (the one that writes the mail's answer), that
    the mail of ``event_id`` to ``card`` was taken, as every inbound message is
    (``inbound_events``, outcome :data:`REPLY_EVENT`): the sending server's retry of the
    same mail (its routed part met a ``451``) is then known and answered no second time.
    False, with nothing written, when it was recorded already (a concurrent try)."""
    insert = insert_ignore_stmt(conn.dialect.name, t.inbound_events)
    values = {
        "id": ids.new("evt"),
        "org_id": card.org_id,
        "agent_id": card.agent_id,
        "session_id": None,
        "work_item_id": card.item_id,
        "outcome": REPLY_EVENT,
        "content": content,
        "external_event_id": event_id,
        "created_at": clock.now_ms(),
    }
    return bool((await conn.execute(insert, values)).rowcount)
