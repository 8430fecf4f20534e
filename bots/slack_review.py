"""Slack review cards: Block Kit rendering, and the buttons and modals that decide.

A card (:class:`outbox.channel.Card`) becomes a Block Kit message: the facts (the
agent, source and "why" as ``plain_text`` fields, shown as typed; a decided card's
outcome line and reason, and the answers to a click, are ``rich_text``: mrkdwn has no
escape for ``*``, ``_``, ``~`` or a backquote in a name or reason), the summary (cut
to Slack's 3,000-character section limit, never dropped), a link to the console (a
plain mrkdwn link, never a button: Slack sends an interaction for a URL
button, and nothing reached by GET decides anything), and an ``actions`` block whose
``block_id`` carries the card's episode and its own delivery id
(``lg_review:<episode>:<card>``; cards posted before it carried the card are
``lg_review:<episode>``), so a click names its card exactly:

* awaitingHuman: buttons ``approve``, ``reject``, ``return`` (``value`` = work item id);
  Reject and Return open a modal (``views.open`` with the click's ``trigger_id``)
  asking for the reason (1..2,000 characters) or the feedback (1..3,000 here: Slack's
  limit for a text input; the rule itself allows 10,000), with field errors answered as
  ``response_action: errors``;
* deliveryUnknown: ``confirm`` (Confirm delivered) and ``retry`` (``value`` = delivery id).

Interactions arrive on ``/slack/events`` (its handler verifies the signing secret first:
a forged one is 401). Each click is decided before it is acknowledged (one short
transaction); whoever may not decide, and whoever came second, is told so ephemerally
through the interaction's ``response_url``. The card itself is edited by the outbox
(``chat.update``) for every decision, wherever it was made.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from slack_bolt.async_app import AsyncApp
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.webhook.async_client import AsyncWebhookClient

from bots.review_base import Answer, ChatReviewBackend, obj
from bots.review_base import text as text_of
from leadgate.core.clock import iso
from leadgate.core.limits import cut
from outbox.channel import Card, CardOutcome
from outbox.relay import longest_fitting

log = logging.getLogger(__name__)

PLATFORM = "slack"
#: Slack's limits: section text, header text, a text input, the message's ``text``.
SECTION_MAX = 3_000
HEADER_MAX = 150
INPUT_MAX = 3_000
TEXT_MAX = 3_000
#: A section field's limit (and at most ten fields: the facts take ten).
FIELD_MAX = 2_000
BLOCK_PREFIX = "lg_review:"
#: Modals: callback id -> (decision, input block id, input action id, label, max length)
MODALS = {
    "lg_reject": ("reject", "reason_b", "reason", "Reason", 2_000),
    "lg_return": ("return", "feedback_b", "feedback", "Feedback for the worker", INPUT_MAX),
}

Spawn = Callable[..., None]
#: The proxy to take for a URL (``None``: none); :func:`bots.slack.env_proxy`.
ProxyFor = Callable[[str], str | None]

#: What answering a click through its ``response_url`` raises when the answer cannot be
#: posted: Slack's error, the connection's, or aiohttp's for a URL it cannot use.
_ANSWER_FAILED = (ValueError, SlackApiError, OSError, aiohttp.ClientError)
#: What ``views.open`` raises when the form cannot be opened: any slack_sdk error
#: (Slack's answer, one that is not Slack's), the connection's (refused, reset, a
#: timeout; closed without an answer is aiohttp's ``ServerDisconnectedError``, which is
#: no ``OSError``), and a click without a ``trigger_id`` (``KeyError``).
_OPEN_FAILED = (SlackClientError, OSError, aiohttp.ClientError, ValueError, KeyError)


def _answer_failed(exc: BaseException) -> None:
    """Log an answer to a click that could not be posted, naming the error's class only:
    aiohttp's errors quote the URL they were given (a connect timeout, a URL it cannot
    use), and a ``response_url`` is a secret: whoever holds it can post in the channel."""
    log.info("slack: could not answer a review click (%s)", type(exc).__name__)


class Respond:
    """Bolt's ``respond`` for one click, posting to its ``response_url`` with the proxy
    ``proxy_for`` picks.

    Bolt's own builds slack_sdk's webhook client with the Web API client's proxy, and
    that client, given none, takes ``HTTPS_PROXY`` for every URL: ``NO_PROXY`` never
    applied to a click's answer. The client reads ``proxy`` at each call, so it is set
    after the constructor has filled it in from the environment.

    Only a replacement of the clicked card is sent again after a lost connection
    (slack_sdk's default connection-error retry, once): posting the same card in its
    place twice shows what once does. Any other answer posts a new message (an ephemeral
    line), and a request that reached Slack and lost its reply would be posted twice, so
    it goes once, as Web API posts do (:class:`bots.slack.SlackChannel`)."""

    def __init__(self, response_url: str | None, proxy_for: ProxyFor) -> None:
        self._url = response_url
        self._proxy_for = proxy_for

    async def __call__(
        self,
        *,
        text: str,
        blocks: list[dict[str, Any]] | None = None,
        response_type: str | None = None,
        replace_original: bool | None = None,
    ) -> None:
        """Post the answer (raises one of the errors of ``_ANSWER_FAILED``)."""
        if not self._url:
            raise ValueError("the interaction has no response_url")
        client = AsyncWebhookClient(url=self._url, retry_handlers=None if replace_original else [])
        client.proxy = self._proxy_for(self._url)
        await client.send(
            text=text,
            blocks=blocks,
            response_type=response_type,
            replace_original=replace_original,
        )


def _esc(text: str) -> str:
    """Escape text for mrkdwn (Slack's three control characters)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _esc_cut(text: str, limit: int) -> str:
    """``text`` escaped by :func:`_esc` and cut to ``limit`` characters, the cut marked,
    never inside an entity (``&am…`` would show as typed)."""
    escaped = _esc(text)
    if len(escaped) <= limit:
        return escaped
    head = text[: longest_fitting(text, limit - 1, lambda part: len(_esc(part)))]
    return _esc(head).rstrip() + "…"


#: How a card shows a time (Slack formats it in the reader's own time zone).
WHEN = "{date_short_pretty} at {time}"
#: How much of who decided (and where) a decided card's outcome line shows.
OUTCOME_WHO_MAX = 500


def _when(ms: int) -> str:
    seconds = ms // 1000
    return f"<!date^{seconds}^{WHEN}|{seconds}>"


#: How much of a decision's reason a notification text shows (on one line).
FALLBACK_REASON_MAX = 200


def fallback_text(card: Card) -> str:
    """The message's ``text`` (with blocks present, Slack shows it in notifications and
    to screen readers only: unstyled, so a name's ``*`` shows as typed), ``&<>``
    escaped: a decided card's outcome, who decided and the decision's reason on one
    line, cut short, in quotation marks (it said who cancelled, never why)."""
    head = card.title
    if card.outcome is not None:
        o = card.outcome
        said = _in_quotes(o.text)
        head += f" ({o.title} by {o.by}{f': {said}' if said else ''})"
    return _esc_cut(f"{head}: {card.summary}", TEXT_MAX)


def _in_quotes(said: str | None) -> str:
    """A decision's reason or feedback for a notification text: on one line, cut to
    :data:`FALLBACK_REASON_MAX`, in quotation marks (``""``: none). Unescaped."""
    reason = " ".join(said.split()) if said else ""
    return f"“{cut(reason, FALLBACK_REASON_MAX)}”" if reason else ""


def facts(card: Card) -> dict[str, Any]:
    """The card's facts as a section of ``fields``: each label in mrkdwn, and the agent,
    source and "why" as ``plain_text``, which Slack shows as typed (in one mrkdwn line,
    a name's ``*``, ``_``, ``~`` or a backquote restyled the card)."""
    labelled = [
        ("Agent", _typed(card.agent)),
        ("From", _typed(card.source)),
        ("Why", _typed(card.why)),
        ("Waiting since", {"type": "mrkdwn", "text": _when(card.waiting_since_ms)}),
        ("Revision", _typed(f"{card.revision} of {card.rounds}")),
    ]
    fields: list[dict[str, Any]] = []
    for label, value in labelled:
        fields += [{"type": "mrkdwn", "text": f"*{label}*"}, value]
    return {"type": "section", "fields": fields}


def _typed(text: str) -> dict[str, Any]:
    """A ``plain_text`` field: never read as mrkdwn, cut to a field's limit (Slack
    refuses an empty text: a dash stands for none)."""
    return {"type": "plain_text", "text": cut(text, FIELD_MAX) or "-", "emoji": False}


def blocks(card: Card) -> list[dict[str, Any]]:
    """The card as Block Kit blocks (decided cards: the outcome instead of buttons)."""
    summary_head = "*Summary*\n"
    out: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": cut(card.title, HEADER_MAX)}},
        facts(card),
        {
            "type": "section",
            "text": {
                "type": "mrkdwn",
                "text": summary_head
                + _esc_cut(card.summary or "(no summary)", SECTION_MAX - len(summary_head)),
            },
        },
        {
            "type": "context",
            "elements": [{"type": "mrkdwn", "text": f"<{card.link}|Open in the leadgate console>"}],
        },
    ]
    if card.outcome is not None:
        out.append(outcome(card.outcome))
        return out
    if card.reason == "deliveryUnknown" and card.delivery_id:
        buttons = [
            _button("confirm", "Confirm delivered", card.delivery_id, "primary"),
            _button("retry", "Retry delivery", card.delivery_id, None),
        ]
    else:
        buttons = [
            _button("approve", "Approve", card.item_id, "primary"),
            _button("reject", "Reject", card.item_id, "danger"),
            _button("return", "Return to worker", card.item_id, None),
        ]
    block_id = BLOCK_PREFIX + card.episode_id + (f":{card.card_id}" if card.card_id else "")
    out.append({"type": "actions", "block_id": block_id, "elements": buttons})
    return out


def outcome(o: CardOutcome) -> dict[str, Any]:
    """A decided card's outcome line ("*Rejected* by NAME (surface) at ...") and its
    reason quoted under it, as a ``rich_text`` block: who decided and why are ``text``
    elements, which Slack shows as written (in mrkdwn, a name's or reason's ``*``, ``_``,
    ``~`` or backquote restyled them, and mrkdwn has no escape for them); only the
    service's own word (the outcome) is bold. Cut as the mrkdwn section was: 3,000."""
    where = f" ({o.surface})" if o.surface else ""
    who = cut(f" by {o.by}{where} ", OUTCOME_WHO_MAX)
    seconds = o.at_ms // 1000
    line: list[dict[str, Any]] = [
        {"type": "text", "text": o.title, "style": {"bold": True}},
        {"type": "text", "text": who},
        {"type": "date", "timestamp": seconds, "format": WHEN, "fallback": iso(o.at_ms)},
    ]
    room = SECTION_MAX - len(o.title) - len(who)
    return rich_text(line, cut(o.text, room) if o.text else None)


def rich_text(line: list[dict[str, Any]], said: str | None) -> dict[str, Any]:
    """A ``rich_text`` block: ``line`` (rich text elements), and ``said`` (a decision's
    reason or feedback) as a quote under it, shown as written."""
    elements: list[dict[str, Any]] = [{"type": "rich_text_section", "elements": line}]
    if said:
        elements.append({"type": "rich_text_quote", "elements": [_text(said)]})
    return {"type": "rich_text", "elements": elements}


def _text(text: str) -> dict[str, Any]:
    """An unstyled rich text ``text`` element (never read as mrkdwn, no mention in it:
    mentions are elements of their own)."""
    return {"type": "text", "text": text}


def _button(action_id: str, label: str, value: str, style: str | None) -> dict[str, Any]:
    button: dict[str, Any] = {
        "type": "button",
        "action_id": action_id,
        "text": {"type": "plain_text", "text": label},
        "value": value,
    }
    if style:
        button["style"] = style
    return button


def modal(callback_id: str, item_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The Reject / Return modal; ``private_metadata`` carries what the submission needs
    (a ``view_submission`` has no channel of its own)."""
    action, block_id, action_id, label, max_length = MODALS[callback_id]
    title = "Reject" if action == "reject" else "Return to worker"
    return {
        "type": "modal",
        "callback_id": callback_id,
        "title": {"type": "plain_text", "text": title},
        "submit": {"type": "plain_text", "text": title},
        "close": {"type": "plain_text", "text": "Cancel"},
        "private_metadata": json.dumps({"item": item_id, **meta}),
        "blocks": [
            {
                "type": "input",
                "block_id": block_id,
                "label": {"type": "plain_text", "text": label},
                "element": {
                    "type": "plain_text_input",
                    "action_id": action_id,
                    "multiline": True,
                    "min_length": 1,
                    "max_length": max_length,
                },
            }
        ],
    }


def told(answer: Answer) -> str:
    """An answer's notification text (the message's ``text``; :func:`told_blocks` is
    what the clicker sees), plain as a card's (:func:`fallback_text`): its line and the
    decision's reason after it (a late click: "Already cancelled by ..." and why), on
    one line in quotation marks, cut short, ``&<>`` escaped (who decided is a person's
    or key's name, ``<!channel>`` in it was read). A notification shows no mrkdwn: the
    ``>`` quote marker it had showed there as typed."""
    said = _in_quotes(answer.said)
    return _esc_cut(answer.text + (f" {said}" if said else ""), TEXT_MAX)


def told_blocks(answer: Answer) -> list[dict[str, Any]]:
    """An answer's words for its clicker as a ``rich_text`` block: its line and the
    decision's reason quoted under it, shown as written (as mrkdwn, a ``*`` or ``_`` in
    who decided or in the reason restyled them)."""
    said = cut(answer.said, SECTION_MAX) if answer.said else None
    return [rich_text([_text(cut(answer.text, SECTION_MAX) or "-")], said)]


def notice(answer: Answer) -> dict[str, Any]:
    """A modal that only says ``answer`` (the item was decided meanwhile)."""
    return {
        "type": "modal",
        "title": {"type": "plain_text", "text": "leadgate"},
        "close": {"type": "plain_text", "text": "Close"},
        "blocks": told_blocks(answer),
    }


def api_failure(exc: BaseException) -> str:
    """A failed Web API call in the words a log may carry: a :class:`SlackApiError` by
    its HTTP status and Slack's error code only. Its text holds Slack's whole answer,
    whose ``response_metadata.messages`` may quote the view or blocks sent (a card's
    text); any other error (no answer: a connection's, a payload's missing key) as it
    is."""
    if not isinstance(exc, SlackApiError):
        return repr(exc)
    response = exc.response
    status = getattr(response, "status_code", None) or getattr(response, "status", None)
    data = getattr(response, "data", None)
    code = data.get("error") if isinstance(data, dict) else None
    return f"SlackApiError HTTP {status} {code or '(no error code)'}"


def identity_of(body: dict[str, Any]) -> str:
    """``TEAM:USER`` of whoever clicked (the form ``leadgate user link --slack`` takes)."""
    user = obj(body.get("user"))
    team = text_of(user.get("team_id")) or text_of(obj(body.get("team")).get("id")) or ""
    return f"{team}:{text_of(user.get('id')) or ''}"


def _episode(block_id: Any) -> str | None:
    """The episode an actions block's ``block_id`` names."""
    if isinstance(block_id, str) and block_id.startswith(BLOCK_PREFIX):
        return block_id[len(BLOCK_PREFIX) :].partition(":")[0] or None
    return None


def _card(block_id: Any) -> str | None:
    """The card delivery an actions block's ``block_id`` names (``None``: a card posted
    before cards named themselves)."""
    if isinstance(block_id, str) and block_id.startswith(BLOCK_PREFIX):
        return block_id[len(BLOCK_PREFIX) :].partition(":")[2] or None
    return None


def register(
    bolt: AsyncApp, backend: ChatReviewBackend, spawn: Spawn, *, proxy_for: ProxyFor
) -> None:
    """Add the review listeners to ``bolt`` (same endpoint: verified by
    :meth:`bots.slack.SlackAdapter.handle` before Bolt sees it). Clicks are answered
    through their ``response_url`` with the proxy ``proxy_for`` picks."""

    def respond_to(body: dict[str, Any]) -> Respond:
        return Respond(text_of(body.get("response_url")), proxy_for)

    def tell(respond: Respond, text: str, shown: list[dict[str, Any]] | None = None) -> None:
        """Answer the clicker alone: ``text``, or ``shown`` (``text`` its notification)."""

        async def say() -> None:
            try:
                await respond(
                    text=text, blocks=shown, response_type="ephemeral", replace_original=False
                )
            except _ANSWER_FAILED as exc:
                _answer_failed(exc)

        spawn(say(), name="slack-review-answer")

    def tell_closed(respond: Respond, answer: Answer, message_ts: str | None) -> None:
        """Answer a click on a decided item: the clicked card shows the outcome at once
        (its update by the outbox may still be on its way, or may never come for a card
        whose post was uncertain), then the clicker is told who decided."""
        card = answer.card
        # (without the clicked message's ts, the card found may be another message)
        if answer.kind != "closed" or card is None or card.outcome is None or not message_ts:
            tell(respond, told(answer), told_blocks(answer))
            return

        async def say() -> None:
            try:
                await respond(text=fallback_text(card), blocks=blocks(card), replace_original=True)
                await respond(
                    text=told(answer),
                    blocks=told_blocks(answer),
                    response_type="ephemeral",
                    replace_original=False,
                )
            except _ANSWER_FAILED as exc:
                _answer_failed(exc)

        spawn(say(), name="slack-review-answer")

    async def on_decision(
        ack: Callable[..., Awaitable[None]],
        body: dict[str, Any],
        action: dict[str, Any],
        client: Any,
    ) -> None:
        respond = respond_to(body)
        action = obj(action)
        verb = str(action.get("action_id"))
        item_id = text_of(action.get("value")) or ""
        episode = _episode(action.get("block_id"))
        card = _card(action.get("block_id"))
        container = obj(body.get("container"))
        message_ts = text_of(container.get("message_ts"))
        channel = text_of(container.get("channel_id")) or text_of(
            obj(body.get("channel")).get("id")
        )
        who = identity_of(body)
        if verb == "approve":
            answer = await backend.decide(
                PLATFORM,
                who,
                item_id,
                "approve",
                episode_id=episode,
                message_id=message_ts,
                conversation=channel,
                card_id=card,
            )
            await ack()
            if not answer.decided:
                tell_closed(respond, answer, message_ts)
            return
        # Opening the form decides nothing, but the click proves the card was posted.
        answer = await backend.check(
            PLATFORM,
            who,
            item_id,
            episode,
            message_id=message_ts,
            conversation=channel,
            card_id=card,
        )
        if answer.kind != "open":
            await ack()
            tell(respond, told(answer), told_blocks(answer))
            return
        callback = "lg_reject" if verb == "reject" else "lg_return"
        meta = {
            "episode": episode,
            "channel": channel,
            "ts": message_ts,
            "card": card,
        }
        try:
            await client.views_open(
                trigger_id=body["trigger_id"], view=modal(callback, item_id, meta)
            )
        except _OPEN_FAILED as exc:
            log.warning("slack: could not open the %s modal: %s", verb, api_failure(exc))
            await ack()
            tell(respond, "Could not open the form; please try again.")
            return
        await ack()

    async def on_recovery(
        ack: Callable[..., Awaitable[None]],
        body: dict[str, Any],
        action: dict[str, Any],
    ) -> None:
        respond = respond_to(body)
        action = obj(action)
        container = obj(body.get("container"))
        message_ts = text_of(container.get("message_ts"))
        channel = text_of(container.get("channel_id")) or text_of(
            obj(body.get("channel")).get("id")
        )
        answer = await backend.recover(
            PLATFORM,
            identity_of(body),
            text_of(action.get("value")) or "",
            str(action.get("action_id")),
            episode_id=_episode(action.get("block_id")),
            message_id=message_ts,
            conversation=channel,
            card_id=_card(action.get("block_id")),
        )
        await ack()
        if not answer.decided:
            tell_closed(respond, answer, message_ts)

    async def on_submit(
        ack: Callable[..., Awaitable[None]], body: dict[str, Any], view: dict[str, Any]
    ) -> None:
        verdict, block_id, action_id, _, _ = MODALS[str(view.get("callback_id"))]
        try:
            meta = obj(json.loads(text_of(view.get("private_metadata")) or "{}"))
        except ValueError:
            meta = {}
        values = obj(obj(obj(view.get("state")).get("values")).get(block_id))
        given = obj(values.get(action_id)).get("value")
        answer = await backend.decide(
            PLATFORM,
            identity_of(body),
            text_of(meta.get("item")) or "",
            verdict,
            given if isinstance(given, str) else None,
            episode_id=text_of(meta.get("episode")),
            message_id=text_of(meta.get("ts")),
            conversation=text_of(meta.get("channel")),
            card_id=text_of(meta.get("card")),
        )
        if answer.kind in ("invalid", "unavailable"):  # the form stays open, saying why
            await ack(response_action="errors", errors={block_id: answer.text})
        elif answer.decided:
            await ack()
        else:
            await ack(response_action="update", view=notice(answer))

    for verb in ("approve", "reject", "return"):
        bolt.action(verb)(on_decision)
    for verb in ("confirm", "retry"):
        bolt.action(verb)(on_recovery)
    for callback in MODALS:
        bolt.view(callback)(on_submit)
