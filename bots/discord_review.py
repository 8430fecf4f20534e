"""Discord review cards: message components, a modal, and the interactions that decide.

A card (:class:`outbox.channel.Card`) becomes a bot message: the facts and the summary
in its content (cut to Discord's 2,000 characters, never dropped; the console link in
``<...>`` so Discord shows no preview of it), and buttons (``discord.ui``):

* awaitingHuman: Approve, Reject, Return to worker (``custom_id``
  ``lg:<verb>:<work item id>:c=<card>``); Reject and Return answer with a modal
  (type 9, ``lg:<verb>_modal:<work item id>:c=<card>``) asking for the reason
  (1..2,000) or the feedback (1..4,000 here: Discord's limit for a text input; the rule
  itself allows 10,000);
* deliveryUnknown: Confirm delivered and Retry (``lg:<verb>:<delivery id>:c=<card>``);
* a link button to the console (link buttons send no interaction).

``<card>`` is the card's own delivery id, so a click names its card exactly; the
server reads the card's wait (episode) from its ``review_cards`` row. A ``custom_id``
holds at most 100 characters, too few for the wait and the card both (ids are 29 to 30
characters); the longest, a modal's, is 78. Cards posted before they named themselves
carry the wait instead (``lg:<verb>:<target>:<episode id>``) and are read as before.

Clicks (type 3) and modal submissions (type 5) reach ``/discord/interactions``, verified
with Ed25519 before anything is parsed. A click that decides is answered with the
decided message (type 7, buttons removed); anything else (not allowed, already decided
and by whom, a bad reason) with an ephemeral message (type 4, flag 64). The outbox
edits every card of the item after any decision (``PATCH .../messages/{id}``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import discord

from bots.review_base import Answer, ChatReviewBackend, obj
from bots.review_base import text as text_of
from leadgate.core.clock import iso
from leadgate.core.limits import cut
from outbox.channel import Card

log = logging.getLogger(__name__)

PLATFORM = "discord"
CONTENT_MAX = 2_000
INPUT_MAX = 4_000
PREFIX = "lg"
_MODAL = "modal"
#: verb -> (text input custom id, label, max length, modal title)
_MODALS = {
    "reject": ("reason", "Reason", 2_000, "Reject"),
    "return": ("feedback", "Feedback for the worker", INPUT_MAX, "Return to worker"),
}
_COMPONENT, _MODAL_SUBMIT = 3, 5
_CHANNEL_MESSAGE, _UPDATE_MESSAGE, _OPEN_MODAL = 4, 7, 9
_EPHEMERAL = 1 << 6
#: Marks a ``custom_id``'s last part as the card's own delivery id (an episode id, on
#: cards posted before, never holds ``=``).
CARD_MARK = "c="
#: Discord's limit for a ``custom_id`` (buttons and modals).
CUSTOM_ID_MAX = 100
_NO_MENTIONS: dict[str, Any] = {"parse": []}


def content(card: Card) -> str:
    """The card as message content, at most 2,000 characters (the summary is cut)."""
    since = card.waiting_since_ms // 1000
    # Names and the lead's words are shown as written (a name's ``*`` or ``_`` restyled
    # the card, a ``#`` made a heading); the summary keeps its markdown. Nobody is
    # pinged either way: every post and edit allows no mentions.
    head = [
        f"**{escaped(card.title)}**",
        f"**Agent:** {escaped(card.agent)}",
        f"**From:** {escaped(card.source)}",
        f"**Why:** {escaped(card.why)}",
        f"**Waiting since:** <t:{since}:f> (<t:{since}:R>)",
        f"**Revision:** {card.revision} of {card.rounds}",
    ]
    if card.outcome is not None:
        o = card.outcome
        where = f" ({o.surface})" if o.surface else ""
        head.append(cut(f"**{o.title}** by {escaped(o.by)}{where} at {iso(o.at_ms)}", 600))
        if o.text:
            head.append(quote(o.text))
    top = "\n".join(head)
    tail = f"\n<{card.link}>"
    room = CONTENT_MAX - len(top) - len(tail) - len("\n**Summary**\n")
    if room < 50:
        top = cut(top, CONTENT_MAX - len(tail) - 80)
        room = CONTENT_MAX - len(top) - len(tail) - len("\n**Summary**\n")
    summary = links_shown(card.summary or "(no summary)")
    return f"{top}\n**Summary**\n{cut(summary, room)}{tail}"


#: How much of a decision's reason or feedback a card quotes (escaped, it may double).
QUOTE_MAX = 300


def escaped(text: str) -> str:
    """``text`` with Discord's markdown escaped, shown as it was written, every ``[``
    escaped: discord.py escapes a line's first masked link only, and a lone ``[`` (a
    requester's name, say) opened a link that a ``](url)`` further on closed, on a later
    line or in the summary (Discord's link words may span lines), the card then showing
    the words between, not where the link led."""
    return _OPENER.sub(r"\1\\[", discord.utils.escape_markdown(text))


#: A ``[`` not escaped already: after no backslash, or after pairs of them (``\\``
#: shows one backslash and leaves the ``[`` to open a link).
_OPENER = re.compile(r"(?<!\\)((?:\\\\)*)\[")


def links_shown(text: str) -> str:
    """``text`` whose masked links (``[words](url)``) show as typed, their URL in view:
    every ``[`` before the last ``](`` (where any link's words end) is escaped, the rest
    of its markdown left as it is. Shown as words, a link hid where it led from the
    reviewer it asked to decide."""
    end = text.rfind("](")
    if end < 0:
        return text
    return _OPENER.sub(r"\1\\[", text[:end]) + text[end:]


def quote(said: str) -> str:
    """A decision's reason or feedback as a block quote under the outcome, its markdown
    escaped: it was appended to the outcome's line as it was typed, so ``**`` or
    ``# `` in a reason restyled the card, and a second line ran on unquoted."""
    lines = escaped(cut(said, QUOTE_MAX)).splitlines() or [""]
    return "\n".join(f"> {line}" for line in lines)


def told(answer: Answer) -> str:
    """An answer's words for its clicker: its line, escaped (who decided is a person's
    or key's name: its ``*`` or ``_`` restyled the answer), and the decision's reason
    quoted under it by :func:`quote` (a late click: "Already cancelled by ..." and why)."""
    return escaped(answer.text) + (f"\n{quote(answer.said)}" if answer.said else "")


def _ref(card: Card) -> str:
    """The last part of the card's custom ids: the card's own delivery, marked (a card
    written before cards named themselves: its episode)."""
    return CARD_MARK + card.card_id if card.card_id else card.episode_id


def parse_ref(ref: str) -> tuple[str | None, str | None]:
    """``(episode id, card id)`` from a ``custom_id``'s last part: one of them is set;
    both ``None`` when it is the mark alone."""
    if ref.startswith(CARD_MARK):
        return None, ref[len(CARD_MARK) :] or None
    return ref, None


def view(card: Card) -> discord.ui.View:
    """The card's buttons (``None`` never: a decided card is edited with ``view=None``)."""
    buttons = discord.ui.View(timeout=None)
    if card.outcome is None:
        if card.reason == "deliveryUnknown" and card.delivery_id:
            target = card.delivery_id
            spec = [
                ("confirm", "Confirm delivered", discord.ButtonStyle.success),
                ("retry", "Retry delivery", discord.ButtonStyle.secondary),
            ]
        else:
            target = card.item_id
            spec = [
                ("approve", "Approve", discord.ButtonStyle.success),
                ("reject", "Reject", discord.ButtonStyle.danger),
                ("return", "Return to worker", discord.ButtonStyle.secondary),
            ]
        for verb, label, style in spec:
            buttons.add_item(
                discord.ui.Button(
                    label=label,
                    style=style,
                    custom_id=f"{PREFIX}:{verb}:{target}:{_ref(card)}",
                )
            )
    buttons.add_item(
        discord.ui.Button(
            label="Open in the console", style=discord.ButtonStyle.link, url=card.link
        )
    )
    return buttons


def ephemeral(text: str) -> dict[str, Any]:
    """An interaction response of a message only its person sees (type 4, flags 64),
    cut to Discord's limit and pinging nobody: the answer to a button, a form, an
    ``/ask`` refused or not taken in (``bots.discord``)."""
    return {
        "type": _CHANNEL_MESSAGE,
        "data": {
            "content": cut(text, CONTENT_MAX),
            "flags": _EPHEMERAL,
            "allowed_mentions": _NO_MENTIONS,
        },
    }


def _decided(card: Card) -> dict[str, Any]:
    return {
        "type": _UPDATE_MESSAGE,
        "data": {
            "content": content(card),
            "components": [c for c in view(card).to_components()],
            "allowed_mentions": _NO_MENTIONS,
        },
    }


def _modal(verb: str, item_id: str, ref: str) -> dict[str, Any]:
    """The Reject / Return form; its ``custom_id`` carries the clicked button's last
    part (``ref``: the card, or an older card's episode) through to the submission."""
    field, label, max_length, title = _MODALS[verb]
    return {
        "type": _OPEN_MODAL,
        "data": {
            "custom_id": f"{PREFIX}:{verb}_{_MODAL}:{item_id}:{ref}",
            "title": title,
            "components": [
                {
                    "type": 1,
                    "components": [
                        {
                            "type": 4,
                            "custom_id": field,
                            "style": 2,
                            "label": label,
                            "min_length": 1,
                            "max_length": max_length,
                            "required": True,
                        }
                    ],
                }
            ],
        },
    }


def is_review(payload: dict[str, Any]) -> bool:
    """Whether an interaction belongs to a review card (component or modal)."""
    custom_id = obj(payload.get("data")).get("custom_id")
    return (
        payload.get("type") in (_COMPONENT, _MODAL_SUBMIT)
        and isinstance(custom_id, str)
        and custom_id.startswith(f"{PREFIX}:")
    )


def _text_value(components: Any, wanted: str) -> str | None:
    """A modal's text input value; rows (type 1) and labels (type 18) both occur."""
    for row in components if isinstance(components, list) else []:
        if not isinstance(row, dict):
            continue
        inner = row.get("components") or ([row["component"]] if "component" in row else [])
        for item in inner if isinstance(inner, list) else []:
            if isinstance(item, dict) and item.get("custom_id") == wanted:
                value = item.get("value")
                return value if isinstance(value, str) else None
    return None


async def handle(payload: dict[str, Any], backend: ChatReviewBackend) -> dict[str, Any]:
    """The interaction response for one review click or modal submission."""
    data = obj(payload.get("data"))
    parts = str(data.get("custom_id")).split(":")
    if len(parts) != 4:
        return ephemeral("This button is not supported.")
    _, verb, target, ref = parts
    episode, card_id = parse_ref(ref)
    if episode is None and card_id is None:
        return ephemeral("This button is not supported.")
    user = obj(obj(payload.get("member")).get("user")) or obj(payload.get("user"))
    who = text_of(user.get("id")) or ""
    message = obj(payload.get("message"))
    message_id = text_of(message.get("id"))
    channel = text_of(payload.get("channel_id")) or text_of(message.get("channel_id"))
    submitted = payload.get("type") == _MODAL_SUBMIT
    if submitted or verb == "approve":
        text: object = None
        if submitted:
            verb = verb.removesuffix(f"_{_MODAL}")
            if verb not in _MODALS:
                return ephemeral("This form is not supported.")
            text = _text_value(data.get("components"), _MODALS[verb][0])
        answer = await backend.decide(
            PLATFORM,
            who,
            target,
            verb,
            text,
            episode_id=episode,
            message_id=message_id,
            conversation=channel,
            card_id=card_id,
        )
    elif verb in _MODALS:
        # Opening the form decides nothing, but the click proves the card was posted.
        answer = await backend.check(
            PLATFORM,
            who,
            target,
            episode,
            message_id=message_id,
            conversation=channel,
            card_id=card_id,
        )
        if answer.kind == "open":
            return _modal(verb, target, ref)
        # (check names no message: its card may be another message of the item)
        return ephemeral(told(answer))
    elif verb in ("confirm", "retry"):
        answer = await backend.recover(
            PLATFORM,
            who,
            target,
            verb,
            episode_id=episode,
            message_id=message_id,
            conversation=channel,
            card_id=card_id,
        )
    else:
        return ephemeral("This button is not supported.")
    if answer.decided and answer.card is not None:
        return _decided(answer.card)
    card = answer.card
    if answer.kind == "closed" and card is not None and card.outcome is not None and message_id:
        # A click on a decided item: the clicked card shows the outcome (who decided,
        # buttons gone) at once, as on Teams; its edit by the outbox may still be on
        # its way. It answered with an ephemeral line and left the buttons. (A card with
        # no outcome to show is answered in words: it would bring its buttons back.)
        return _decided(card)
    return ephemeral(told(answer))
