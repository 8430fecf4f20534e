"""Teams review cards: Adaptive Cards with ``Action.Execute``, and the invokes that decide.

A card (:class:`outbox.channel.Card`) becomes an Adaptive Card (version 1.4, what
``Action.Execute`` needs): its facts and the summary, shown as typed (``TextRun``s:
Teams reads a ``TextBlock``'s and a fact set's text as markdown), and

* awaitingHuman: ``Action.Execute`` ``approve``; ``Action.ShowCard`` Reject and Return
  to worker, each revealing an ``Input.Text`` (``reason`` up to 2,000 characters,
  ``feedback`` up to 10,000) and its own ``Action.Execute`` (``reject`` / ``return``);
* deliveryUnknown: ``Action.Execute`` ``confirm`` and ``retry``;
* always ``Action.OpenUrl`` to the console (opened by the client: nothing decides on GET).

A click arrives as an ``invoke`` activity named ``adaptiveCard/action`` on
``/api/messages``, verified like every Bot Framework activity. The clicker is
``from.aadObjectId`` (what ``leadgate user link --teams`` takes). The invoke is answered
in its HTTP response (the adapter's own route, not ``CloudAdapter.process``, whose
4.17.1 serialisation of invoke answers is broken, see interactivity.md): the decided
card (Teams replaces the clicked card with it), or a message only the clicker sees
(not allowed, already decided, a missing reason). Every card of the item, in every
conversation, is replaced by the outbox (``PUT .../activities/{id}``) after any decision.

:class:`ReviewingBot` also remembers the conversation reference of every other activity
it receives, so that an operator can name a Teams conversation by its id in
``leadgate notify add --channel teams --to 19:...``.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import Any

from botbuilder.core import Bot, InvokeResponse, TurnContext
from botbuilder.schema import Activity, ActivityTypes

from bots.review_base import (
    FEEDBACK_MAX,
    REASON_MAX,
    Answer,
    ChatReviewBackend,
)
from leadgate.core.clock import iso
from leadgate.core.limits import cut
from outbox.channel import Card
from outbox.relay import longest_fitting

log = logging.getLogger(__name__)

PLATFORM = "teams"
CARD_TYPE = "application/vnd.microsoft.card.adaptive"
MESSAGE_TYPE = "application/vnd.microsoft.activity.message"
#: Teams refuses an activity over about 28 KB (413). It counts bytes of the JSON the SDK
#: posts (msrest's ``json.dumps``: a non-ASCII character is a 6-byte ``\uXXXX`` escape,
#: one outside the BMP 12), so text is measured that way (:func:`text_size`), with about
#: 2 KB left for the rest of the activity: 26,000 ASCII characters, 4,333 CJK ones.
MAX_TEXT_BYTES = 26_000


def text_size(text: str) -> int:
    """The bytes ``text`` takes in the posted activity's JSON (quotes not counted)."""
    return len(json.dumps(text)) - 2


#: A card's free texts, cut by that same measure so the whole card stays inside the
#: limit whatever their script: the summary, the lead's "why", a decision's text.
SUMMARY_BYTES = 10_000
WHY_BYTES = 3_000
OUTCOME_BYTES = 6_000
_REMEMBERED_MAX = 4096


def _cut_bytes(text: str, limit: int) -> str:
    """``text`` cut so that its JSON takes at most ``limit`` bytes, the cut marked."""
    if text_size(text) <= limit:
        return text
    return text[: longest_fitting(text, limit - 6, text_size)].rstrip() + "…"  # "…" is 6


def _iso(ms: int) -> str:
    return iso(ms) or ""


def summary_text(card: Card) -> str:
    """The activity's ``summary`` (what notifications show)."""
    return cut(f"{card.title}: {card.summary}", 200)


def adaptive_card(card: Card) -> dict[str, Any]:
    """The card as Adaptive Card JSON (decided cards: the outcome instead of actions)."""
    body: list[dict[str, Any]] = [
        as_typed(card.title, weight="Bolder", size="Medium"),
        *facts(card),
        {"type": "TextBlock", "text": "Summary", "weight": "Bolder", "wrap": True},
        # As typed: a TextBlock reads markdown, and a masked link in it showed its words,
        # not where it led (Teams documents no escape).
        as_typed(_cut_bytes(card.summary or "(no summary)", SUMMARY_BYTES)),
    ]
    actions: list[dict[str, Any]] = []
    # "card": the card's own delivery (a click names its card exactly); absent on
    # cards posted before.
    mine = {"card": card.card_id} if card.card_id else {}
    data = {"item": card.item_id, "episode": card.episode_id, **mine}
    if card.outcome is not None:
        o = card.outcome
        where = f" ({o.surface})" if o.surface else ""
        line = f"{o.title} by {o.by}{where} at {_iso(o.at_ms)}"
        good = o.title.startswith(("Approved", "Delivery"))
        body.append(as_typed(line, weight="Bolder", color="Good" if good else "Attention"))
        if o.text:
            body.append(said_block(o.text))
    elif card.reason == "deliveryUnknown" and card.delivery_id:
        recovery = {"delivery": card.delivery_id, "episode": card.episode_id, **mine}
        actions += [
            _execute("confirm", "Confirm delivered", recovery, "positive"),
            _execute("retry", "Retry delivery", recovery, None),
        ]
    else:
        actions += [
            _execute("approve", "Approve", data, "positive"),
            _with_input("reject", "Reject…", "reason", "Reason", REASON_MAX, data),
            _with_input("return", "Return to worker…", "feedback", "Feedback", FEEDBACK_MAX, data),
        ]
    actions.append({"type": "Action.OpenUrl", "title": "Open in the console", "url": card.link})
    return {
        "type": "AdaptiveCard",
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "version": "1.4",
        "body": body,
        "actions": actions,
    }


def facts(card: Card) -> list[dict[str, Any]]:
    """The card's facts, one line each: its label bold, then its value in a ``TextRun``,
    shown as typed (see :func:`as_typed`).
    (A ``FactSet``'s values are markdown in Teams: a masked link in the lead's "why"
    hid where it led, and a name's ``*`` or ``_`` restyled it.)"""
    labelled = [
        ("Agent", card.agent),
        ("From", card.source),
        ("Why", _cut_bytes(card.why, WHY_BYTES)),
        ("Waiting since", _iso(card.waiting_since_ms)),
        ("Revision", f"{card.revision} of {card.rounds}"),
    ]
    return [
        {
            "type": "RichTextBlock",
            "inlines": [
                {"type": "TextRun", "text": f"{label}: ", "weight": "Bolder"},
                {"type": "TextRun", "text": value},
            ],
            # (one block of facts, as the fact set was: no gap between its lines)
            **({"spacing": "None"} if i else {}),
        }
        for i, (label, value) in enumerate(labelled)
    ]


def as_typed(text: str, **style: Any) -> dict[str, Any]:
    """``text`` shown as it is, styled (``weight``, ``size``, ``color``, ``italic``): a
    ``RichTextBlock`` of one ``TextRun``, whose text Teams never reads as markdown (a
    ``TextBlock`` does: ``**``, ``_`` or ``- `` in a name restyled the card)."""
    return {"type": "RichTextBlock", "inlines": [{"type": "TextRun", "text": text, **style}]}


def said_block(said: str) -> dict[str, Any]:
    """A decision's reason or feedback under the outcome, in quotation marks,
    :func:`as_typed` (it was appended to the outcome's bold line as typed)."""
    return as_typed(in_quotes(said), italic=True)


def in_quotes(said: str) -> str:
    """A decision's reason or feedback in quotation marks (cut to fit): how a card's
    :func:`said_block` and a late click's words show it."""
    return f"“{_cut_bytes(said, OUTCOME_BYTES)}”"


def _execute(verb: str, title: str, data: dict[str, Any], style: str | None) -> dict[str, Any]:
    action: dict[str, Any] = {"type": "Action.Execute", "title": title, "verb": verb, "data": data}
    if style:
        action["style"] = style
    return action


def _with_input(
    verb: str, title: str, field: str, label: str, max_length: int, data: dict[str, Any]
) -> dict[str, Any]:
    return {
        "type": "Action.ShowCard",
        "title": title,
        "card": {
            "type": "AdaptiveCard",
            "body": [
                {
                    "type": "Input.Text",
                    "id": field,
                    "label": label,
                    "isMultiline": True,
                    "isRequired": True,
                    "maxLength": max_length,
                    "errorMessage": f"{label} is required (at most {max_length:,} characters)",
                }
            ],
            "actions": [_execute(verb, title.rstrip("…"), data, None)],
        },
    }


def card_answer(card: Card) -> dict[str, Any]:
    """An invoke answer that replaces the clicked card."""
    return {"statusCode": 200, "type": CARD_TYPE, "value": adaptive_card(card)}


def click_answer(answer: Answer) -> dict[str, Any]:
    """The invoke answer to a click: the decided card in place of the clicked one, or a
    line for the clicker only. A click on an item no longer waiting, with no outcome to
    show (the card as posted), is answered in words: that card in place would offer its
    buttons again, with nothing said."""
    card = answer.card
    if card is not None and (
        answer.kind == "decided" or (answer.kind == "closed" and card.outcome is not None)
    ):
        return card_answer(card)
    said = f"\n{in_quotes(answer.said)}" if answer.said else ""
    return message_answer(answer.text + said)


def message_answer(text: str) -> dict[str, Any]:
    """An invoke answer that shows ``text`` to the clicker only."""
    return {"statusCode": 200, "type": MESSAGE_TYPE, "value": text}


class ReviewingBot(Bot):  # type: ignore[misc]
    """Answers review-card invokes; hands every other activity to ``inner``."""

    def __init__(self, inner: Bot, backend: ChatReviewBackend, spawn: Callable[..., None]) -> None:
        self.inner = inner
        self.backend = backend
        self.spawn = spawn
        # conversation id -> serviceUrl last remembered (saves a write per message)
        self._remembered: collections.OrderedDict[str, str] = collections.OrderedDict()

    async def on_turn(self, context: TurnContext) -> None:
        """An ``adaptiveCard/action`` invoke is a review click; anything else is
        remembered (its conversation) and passed on."""
        activity = context.activity
        if activity.type == ActivityTypes.invoke and activity.name == "adaptiveCard/action":
            body = await self.on_card_action(activity)
            await context.send_activity(
                Activity(
                    type=ActivityTypes.invoke_response,
                    value=InvokeResponse(status=200, body=body),
                )
            )
            return
        self._remember(activity)
        await self.inner.on_turn(context)

    async def on_card_action(self, activity: Activity) -> dict[str, Any]:
        """The invoke answer for one ``Action.Execute`` click."""
        value: dict[str, Any] = activity.value if isinstance(activity.value, dict) else {}
        action: dict[str, Any] = value.get("action") or {}
        if not isinstance(action, dict) or action.get("type") != "Action.Execute":
            return message_answer("This action is not supported.")
        verb = str(action.get("verb") or "")
        data: dict[str, Any] = action.get("data") or {}
        if not isinstance(data, dict):
            data = {}
        sender = activity.from_property
        who = str(getattr(sender, "aad_object_id", None) or "")
        message_id = activity.reply_to_id or None
        conversation = getattr(activity.conversation, "id", None) or None
        answer: Answer
        if verb in ("approve", "reject", "return"):
            field = {"reject": "reason", "return": "feedback"}.get(verb)
            answer = await self.backend.decide(
                PLATFORM,
                who,
                str(data.get("item") or ""),
                verb,
                data.get(field) if field else None,
                episode_id=data.get("episode"),
                message_id=message_id,
                conversation=conversation,
                card_id=data.get("card"),
            )
        elif verb in ("confirm", "retry"):
            answer = await self.backend.recover(
                PLATFORM,
                who,
                str(data.get("delivery") or ""),
                verb,
                episode_id=data.get("episode"),
                message_id=message_id,
                conversation=conversation,
                card_id=data.get("card"),
            )
        else:
            return message_answer("This action is not supported.")
        return click_answer(answer)

    def _remember(self, activity: Activity) -> None:
        conversation = activity.conversation
        if conversation is None or not conversation.id or not activity.service_url:
            return
        if self._remembered.get(conversation.id) == activity.service_url:
            return
        self._remembered[conversation.id] = activity.service_url
        while len(self._remembered) > _REMEMBERED_MAX:
            self._remembered.popitem(last=False)
        reference = TurnContext.get_conversation_reference(activity).serialize()
        tenant = _tenant(activity)
        if tenant and isinstance(reference.get("conversation"), dict):
            reference["conversation"].setdefault("tenantId", tenant)
        self.spawn(
            self._keep(conversation.id, activity.service_url, reference),
            name=f"teams-remember {conversation.id}",
        )

    async def _keep(
        self, conversation_id: str, service_url: str, reference: dict[str, Any]
    ) -> None:
        """Write ``reference``; when the write fails (the database down), forget that it
        was kept, so the conversation's next activity writes it again: the app added to
        a channel (its ``conversationUpdate``) may be the only activity it ever sends."""
        try:
            await self.backend.remember_teams_conversation(reference)
        except BaseException:
            if self._remembered.get(conversation_id) == service_url:
                del self._remembered[conversation_id]
            raise


def _tenant(activity: Activity) -> str:
    channel_data = activity.channel_data
    if isinstance(channel_data, dict):
        tenant = channel_data.get("tenant")
        if isinstance(tenant, dict) and tenant.get("id"):
            return str(tenant["id"])
    conversation = activity.conversation
    return str(getattr(conversation, "tenant_id", None) or "")
