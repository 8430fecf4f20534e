"""Deciding from a chat card (Slack, Teams, Discord) or a reply to an email card: who
may, and what they are told.

The chat adapters map a click (or a modal's submission) onto :meth:`ChatReviews.decide`
or :meth:`ChatReviews.recover` with the platform and the clicker's platform identity.
Only a platform user linked (``leadgate user link``) to a user of the item's
organization whose role grants ``agent:review`` decides; anyone else is told
:data:`FORBIDDEN` and nothing changes. Every decision goes through
:meth:`leadgate.operations.reviews.Reviews.decide` / ``recover`` (the fenced commit
path, audited with ``surface`` = the platform and ``identity`` = ``platform:id``), so
two simultaneous clicks make one decision, and the other clicker is told who decided.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass

import sqlalchemy as sa

from leadgate.core.auth import Scope
from leadgate.core.clock import Clock
from leadgate.core.errors import (
    DatabaseDamaged,
    NotFound,
    PermissionDenied,
    TransitionError,
    Unavailable,
    ValidationError,
)
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import links
from leadgate.domain.links import Reviewer
from leadgate.domain.workitems import Status
from leadgate.operations.reviews import InDecision, Reviews
from leadgate.review import cards, replies
from leadgate.review.destinations import remember_teams_conversation
from leadgate.review.replies import AnswerTo, ReplyCard
from outbox.channel import Card
from outbox.store import IN_FLIGHT_RULE, DeliveryStatus

log = logging.getLogger(__name__)

FORBIDDEN = "You cannot review in this organization."
GONE = "This review no longer exists."
STALE = "This card is out of date: the item is waiting for a decision again. Use its newest card."


def _unreadable(identity: object, *ids: object) -> ChatAnswer | None:
    """The answer to a click whose ids no card of ours carries (a NUL, say, which
    PostgreSQL text cannot hold: the lookup failed there, a 500; or a number or an object
    where a card puts a string), else ``None``."""
    if not isinstance(identity, str) or not identity.isprintable():
        return ChatAnswer("forbidden", FORBIDDEN)
    if any(
        value is not None and (not isinstance(value, str) or not value.isprintable())
        for value in ids
    ):
        return ChatAnswer("closed", GONE)
    return None


def _not_recorded(platform: str, exc: Unavailable | DatabaseDamaged) -> ChatAnswer:
    """The answer to a click that met a database fault: nothing may have been recorded,
    and no platform sends a click again, so the clicker is told in words, naming the rule
    (never the driver's message); one log line, no traceback. Answered here once for
    every adapter, which renders it as any other answer."""
    log.warning("%s review click met a database fault (%s)", platform, exc.rule)
    return ChatAnswer(
        "unavailable",
        "Your decision may not have been recorded: the service cannot reach its database "
        f"right now ({exc.rule}). Please try again in a moment.",
    )


@dataclass(frozen=True)
class ChatAnswer:
    """What became of a click.

    ``kind``: ``open`` (may decide: e.g. open the modal), ``decided`` (this click
    decided), ``closed`` (already decided: ``text`` says by whom), ``forbidden``,
    ``invalid`` (the text broke a rule: ``text`` says which), ``stale`` (an older
    card), ``unavailable`` (a database fault: nothing may have been recorded),
    ``repeated`` (email: the same mail was taken before, and answered then).
    ``card`` is the clicked card as it looks now (decided cards: the outcome).
    ``said`` is the decision's reason or feedback when ``text`` names a decision that
    had one: each surface shows it under ``text`` quoted in its own markup
    (:meth:`in_words` for plain text), never run on into ``text``.
    """

    kind: str
    text: str
    card: Card | None = None
    said: str | None = None

    def in_words(self) -> str:
        """``text`` with ``said`` quoted under it, as plain text (email)."""
        return f"{self.text}\n{cards.quoted(self.said)}" if self.said else self.text

    @property
    def decided(self) -> bool:
        """Whether this click made the decision."""
        return self.kind == "decided"


@dataclass(frozen=True)
class _ReplyMail:
    """A reviewer's mail to an email card, as an inbound event (de-duplicated by its
    ``Message-ID``; one without, which the listener never hands over, is not)."""

    chat: ChatReviews
    card: ReplyCard
    message_id: str | None
    content: str

    async def seen(self) -> bool:
        """Whether this mail to this card was taken before."""
        if self.message_id is None:
            return False
        async with self.chat.db.read() as conn:
            return await cards.reply_seen(conn, cards.reply_event_id(self.card, self.message_id))

    async def taken(self, conn: Conn) -> bool:
        """Record it as taken in ``conn``'s transaction; False when it was already."""
        if self.message_id is None:
            return True
        event_id = cards.reply_event_id(self.card, self.message_id)
        chat = self.chat
        return await cards.reply_taken(
            conn, chat.clock, chat.reviews.ids, self.card, event_id, self.content
        )


class ChatReviews:
    """Chat decisions for the Slack, Teams and Discord adapters."""

    def __init__(self, db: Database, clock: Clock, reviews: Reviews) -> None:
        self.db = db
        self.clock = clock
        self.reviews = reviews

    async def check(
        self,
        platform: str,
        identity: str,
        item_id: str,
        episode_id: str | None = None,
        *,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
    ) -> ChatAnswer:
        """Whether ``identity`` may decide ``item_id`` now (``kind`` ``open``): the
        click that opens a Reject / Return form. It decides nothing, but it proves the
        clicked card posted (``message_id`` in ``conversation``, see
        :meth:`_settle_clicked`)."""
        try:
            answer, _ = await self._opened(
                platform, identity, item_id, episode_id, message_id, conversation, card_id
            )
            return answer
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded(platform, exc)

    async def decide(
        self,
        platform: str,
        identity: str,
        item_id: str,
        action: str,
        text: object = None,
        *,
        episode_id: str | None = None,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
        then: InDecision | None = None,
    ) -> ChatAnswer:
        """Approve, reject (``text``: reason) or return (``text``: feedback) ``item_id``
        as the leadgate user linked to ``identity`` on ``platform`` (``message_id`` in
        ``conversation``: the clicked card's message, see :meth:`_settle_clicked`;
        ``episode_id`` and ``card_id``: the wait and the delivery the card names, see
        :meth:`_stale`; ``then``: runs in the decision's transaction, when there is
        one)."""
        try:
            answer, reviewer = await self._opened(
                platform, identity, item_id, episode_id, message_id, conversation, card_id
            )
            if answer.kind != "open" or reviewer is None:
                return answer
            return await self._commit(
                self.reviews.decide(
                    reviewer.principal(),
                    item_id,
                    action,
                    text,
                    surface=platform,
                    identity=f"{platform}:{identity}",
                    then=then,
                ),
                item_id,
                platform,
                message_id,
                card_id,
            )
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded(platform, exc)

    async def recover(
        self,
        platform: str,
        identity: str,
        delivery_id: str,
        action: str,
        *,
        episode_id: str | None = None,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
        then: InDecision | None = None,
    ) -> ChatAnswer:
        """Confirm delivered / retry a ``deliveryUnknown`` gating delivery from its card
        (``episode_id``: the card's; a card of an earlier stretch of waiting is stale;
        ``message_id``, ``conversation``, ``card_id``, ``then``: as :meth:`decide`)."""
        try:
            unreadable = _unreadable(
                identity, delivery_id, episode_id, message_id, conversation, card_id
            )
            if unreadable is not None:
                return unreadable
            d = t.deliveries.c
            async with self.db.read() as conn:
                gated = await conn.scalar(
                    sa.select(d.work_item_id).where(d.id == delivery_id, d.kind == "gating")
                )
            if gated is not None:
                await self._settle_clicked(
                    platform, identity, str(gated), episode_id, message_id, conversation, card_id
                )
            async with self.db.read() as conn:
                row = (
                    await conn.execute(
                        sa.select(d.work_item_id, d.status, d.org_id, d.kind).where(
                            d.id == delivery_id
                        )
                    )
                ).first()
                if row is None or row.kind != "gating" or row.work_item_id is None:
                    return ChatAnswer("closed", GONE)
                reviewer = await self._reviewer(conn, row.org_id, platform, identity)
                if reviewer is None:
                    return ChatAnswer("forbidden", FORBIDDEN)
                item_id = str(row.work_item_id)
                if row.status != DeliveryStatus.deliveryUnknown.value:
                    return await self._closed_in(conn, item_id, platform, message_id, card_id)
                if await self._stale(conn, item_id, row.org_id, episode_id, card_id):
                    # A retry that ended unknown again opened a new card: this one is old.
                    return ChatAnswer("stale", STALE)
            return await self._commit(
                self.reviews.recover(
                    reviewer.principal(),
                    delivery_id,
                    action,
                    surface=platform,
                    identity=f"{platform}:{identity}",
                    then=then,
                ),
                item_id,
                platform,
                message_id,
                card_id,
            )
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded(platform, exc)

    async def reply_card(self, token: str) -> ReplyCard | None:
        """The email card whose reply token is ``token`` (``None``: none has it). Raises
        :class:`Unavailable` / :class:`DatabaseDamaged` on a database fault (the listener
        asks the sender to retry)."""
        async with self.db.read() as conn:
            return await cards.reply_card(conn, token)

    async def email_reply(
        self,
        token: str,
        sender: str,
        envelope_sender: str,
        action: str,
        text: str,
        answer_to: AnswerTo,
    ) -> ChatAnswer:
        """A reply to an email card (``[email] review_reply_address``): ``action`` its
        first word, ``text`` the rest (the reason or feedback). The token names the card;
        the sender (the ``From`` header, and the envelope sender when it differs) must be
        a user of the card's organization whose role grants ``agent:review``: neither the
        token nor the address alone decides. The decision then goes through
        :meth:`decide` / :meth:`recover` with the card's wait, as a click does (surface
        ``email``, identity ``email:<address>``). An action the card does not offer is
        answered ``invalid`` saying what it accepts, after the sender is checked.

        The answer mail to ``answer_to`` is an outbox row (:data:`outbox.store.ANSWER`),
        sent by the relay with its retries: written in the decision's transaction when
        the reply decided, in one of its own otherwise; so when this returns, whatever
        it says is committed (``unavailable``: nothing was, the listener answers 451).

        The mail (its ``Message-ID``, ``answer_to.in_reply_to``) is recorded as taken
        with its answer (:func:`leadgate.review.cards.reply_taken`): the sending
        server's retry of the same mail, sent again because another recipient of it met
        a 451, is answered ``repeated``: it neither decides nor is answered again."""
        try:
            card = await self.reply_card(token)
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded("email", exc)
        if card is None:
            # Only between RCPT and DATA: no organization to answer under.
            log.info("email: a reply's card went away before its DATA; not answered")
            return ChatAnswer("closed", GONE)
        mail = _ReplyMail(self, card, answer_to.in_reply_to, f"{action} {text}".strip())
        try:
            if await mail.seen():
                # Checked before deciding too: what its first try found (its sender not
                # a reviewer yet, say) is what the mail said, once.
                log.info("email: a reply to a card was taken before (same Message-ID)")
                return ChatAnswer("repeated", "")
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded("email", exc)

        async def answered(conn: Conn) -> None:
            # (Were a concurrent try of the same mail recorded first, it decided nothing:
            # this one did, and its answer is due all the same.)
            await mail.taken(conn)
            outcome = await cards.last_outcome(conn, card.item_id)
            line = cards.outcome_text(outcome) if outcome else "Done."
            await self._queue_answer(conn, card, answer_to, replies.decided_text(line))

        answer = await self._email_decision(card, sender, envelope_sender, action, text, answered)
        if answer.kind in ("decided", "unavailable"):
            return answer  # the answer was written with the decision / nothing was
        try:
            async with self.db.tx() as conn:
                if not await mail.taken(conn):
                    return ChatAnswer("repeated", "")  # a concurrent try answered it
                await self._queue_answer(conn, card, answer_to, answer.in_words())
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded("email", exc)
        return answer

    async def _email_decision(
        self,
        card: ReplyCard,
        sender: str,
        envelope_sender: str,
        action: str,
        text: str,
        then: InDecision,
    ) -> ChatAnswer:
        """What :meth:`email_reply` decides (``then`` runs in the decision's
        transaction)."""
        try:
            async with self.db.read() as conn:
                for address in {sender, envelope_sender}:
                    if await self._reviewer(conn, card.org_id, "email", address) is None:
                        return ChatAnswer("forbidden", FORBIDDEN)
        except (Unavailable, DatabaseDamaged) as exc:
            return _not_recorded("email", exc)
        if action not in replies.VERBS.get(card.reason, ()):
            return ChatAnswer("invalid", f"Nothing was decided. {replies.accepted(card.reason)}")
        if card.reason == "deliveryUnknown":
            if card.delivery_id is None:
                return ChatAnswer("closed", GONE)
            return await self.recover(
                "email", sender, card.delivery_id, action, episode_id=card.episode_id, then=then
            )
        answer = await self.decide(
            "email",
            sender,
            card.item_id,
            action,
            text or None,
            episode_id=card.episode_id,
            then=then,
        )
        if answer.kind == "invalid":
            # A chat form keeps the text to correct; a mail is written again from scratch.
            return ChatAnswer(
                "invalid", f"Nothing was decided: {answer.text}. {replies.accepted(card.reason)}"
            )
        return answer

    async def _queue_answer(
        self, conn: Conn, card: ReplyCard, answer_to: AnswerTo, text: str
    ) -> None:
        """Queue the answer mail to a reviewer's reply to ``card`` in ``conn``'s
        transaction."""
        await self.reviews.outbox.enqueue_answer(
            conn,
            org_id=card.org_id,
            work_item_id=card.item_id,
            channel="email",
            address=answer_to.address(),
            text=text,
        )

    async def remember_teams_conversation(self, reference: dict[str, object]) -> None:
        """Keep a Teams conversation's reference (so ``notify add --channel teams``
        can name the conversation by its id)."""
        async with self.db.tx() as conn:
            await remember_teams_conversation(conn, self.clock, dict(reference))

    # ------------------------------------------------------------------- helpers

    async def _settle_clicked(
        self,
        platform: str,
        identity: str,
        item_id: str,
        episode_id: str | None,
        message_id: str | None,
        conversation: str | None,
        card_id: str | None = None,
    ) -> None:
        """A click on a card whose post was uncertain (``deliveryUnknown``, no message id
        kept) proves the post landed: the card's delivery is confirmed delivered with the
        clicked message's id, through the operator's recovery path (fenced on
        ``deliveryUnknown``, audited ``deliveryConfirmed`` with the clicker), so the click
        is answered on that card and every later update edits it. Only the one uncertain
        card of the item on this platform and conversation (and episode, and the card's
        own delivery ``card_id``, when the click names them) matches; a click by someone
        who may not review settles nothing; a replayed click finds the message known and
        does nothing."""
        if not message_id or not conversation:
            return
        w = t.work_items.c
        async with self.db.read() as conn:
            delivery_id = await cards.uncertain_card(
                conn, item_id, platform, conversation, message_id, episode_id, card_id
            )
            if delivery_id is None:
                return  # the usual case: a known card (one indexed read)
            org_id = await conn.scalar(sa.select(w.org_id).where(w.id == item_id))
            reviewer = (
                None
                if org_id is None
                else await self._reviewer(conn, str(org_id), platform, identity)
            )
        if reviewer is None:
            return
        try:
            await self.reviews.recover(
                reviewer.principal(),
                delivery_id,
                "confirm",
                surface=platform,
                identity=f"{platform}:{identity}",
                external_id=message_id,
            )
        except (TransitionError, NotFound):
            pass  # settled meanwhile (the same click replayed, another replica): done

    async def _commit(
        self,
        decision: Awaitable[object],
        item_id: str,
        platform: str,
        message_id: str | None,
        card_id: str | None,
    ) -> ChatAnswer:
        """Await the decision (the fenced commit path) and say what became of it (on the
        clicked card: delivery ``card_id``, else message ``message_id``)."""
        try:
            await decision
        except ValidationError as exc:
            return ChatAnswer("invalid", exc.message)
        except PermissionDenied:
            return ChatAnswer("forbidden", FORBIDDEN)
        except TransitionError as exc:
            if exc.rule == IN_FLIGHT_RULE:
                # Nobody decided: the Retry waits for a lapsed send (the seconds left).
                return ChatAnswer("invalid", exc.message)
            # Someone else decided first: say who and what.
            return await self._closed(item_id, platform, message_id, card_id)
        except NotFound:
            # The item went away: say what became of it.
            return await self._closed(item_id, platform, message_id, card_id)
        return await self._after(item_id, platform, message_id, card_id, "decided")

    async def _opened(
        self,
        platform: str,
        identity: str,
        item_id: str,
        episode_id: str | None,
        message_id: str | None,
        conversation: str | None,
        card_id: str | None,
    ) -> tuple[ChatAnswer, Reviewer | None]:
        """What :meth:`check` and :meth:`decide` do before any decision: refuse what
        cannot be read, settle the clicked card if its post was uncertain, then
        :meth:`_gate` (``kind`` ``open`` with the reviewer when the click may decide)."""
        odd = _unreadable(identity, item_id, episode_id, message_id, conversation, card_id)
        if odd is not None:
            return odd, None
        await self._settle_clicked(
            platform, identity, item_id, episode_id, message_id, conversation, card_id
        )
        async with self.db.read() as conn:
            return await self._gate(conn, platform, identity, item_id, episode_id, card_id)

    async def _gate(
        self,
        conn: Conn,
        platform: str,
        identity: str,
        item_id: str,
        episode_id: str | None,
        card_id: str | None = None,
    ) -> tuple[ChatAnswer, Reviewer | None]:
        w = t.work_items.c
        item = (await conn.execute(sa.select(w.org_id, w.status).where(w.id == item_id))).first()
        if item is None:
            return ChatAnswer("closed", GONE), None
        # Who may review comes first: an outsider learns nothing about the item.
        reviewer = await self._reviewer(conn, item.org_id, platform, identity)
        if reviewer is None:
            return ChatAnswer("forbidden", FORBIDDEN), None
        if item.status != Status.awaitingHuman.value:
            return await self._closed_in(conn, item_id, platform, None, card_id), reviewer
        if await self._stale(conn, item_id, item.org_id, episode_id, card_id):
            return ChatAnswer("stale", STALE), reviewer
        return ChatAnswer("open", ""), reviewer

    @staticmethod
    async def _stale(
        conn: Conn, item_id: str, org_id: str, episode_id: str | None, card_id: str | None
    ) -> bool:
        """Whether a card of episode ``episode_id`` is older than the item's open one. A
        card that names only itself (``card_id``, no episode: Discord's, whose
        ``custom_id`` has no room for both) is of the episode of its ``review_cards``
        row, read fenced to the item and organization: a card of another item or
        organization names no wait of this one and is refused as out of date."""
        if not episode_id and card_id:
            episode_id = await cards.card_episode(conn, card_id, item_id, org_id)
            if episode_id is None:
                return True
        if not episode_id:
            return False
        current = await cards.open_episode(conn, item_id)
        return current is not None and episode_id != current

    async def _reviewer(
        self, conn: Conn, org_id: str, platform: str, identity: str
    ) -> Reviewer | None:
        reviewer = await links.reviewer(conn, org_id, platform, identity)
        if reviewer is None or Scope.review not in reviewer.principal().scopes:
            return None
        return reviewer

    async def _closed(
        self, item_id: str, platform: str, message_id: str | None, card_id: str | None
    ) -> ChatAnswer:
        async with self.db.read() as conn:
            return await self._closed_in(conn, item_id, platform, message_id, card_id)

    async def _closed_in(
        self,
        conn: Conn,
        item_id: str,
        platform: str,
        message_id: str | None,
        card_id: str | None = None,
    ) -> ChatAnswer:
        outcome = await cards.last_outcome(conn, item_id)
        card = await cards.posted_card(conn, item_id, platform, message_id, card_id)
        if outcome is None:
            return ChatAnswer("closed", "This item is not waiting for a decision.", card)
        line = cards.outcome_line(outcome)
        text = f"Already {line[:1].lower()}{line[1:]}."
        return ChatAnswer("closed", text, card.decided(outcome) if card else None, outcome.text)

    async def _after(
        self,
        item_id: str,
        platform: str,
        message_id: str | None,
        card_id: str | None,
        kind: str,
    ) -> ChatAnswer:
        async with self.db.read() as conn:
            outcome = await cards.last_outcome(conn, item_id)
            card = await cards.posted_card(conn, item_id, platform, message_id, card_id)
        text = cards.outcome_line(outcome) if outcome else "Done."
        decided = card.decided(outcome) if card and outcome else None
        return ChatAnswer(kind, text, decided, outcome.text if outcome else None)
