"""Input limits, in one place: every surface and every runner checks against these.

The operations layer validates what a person sent before anything is stored; the turn
path relies on that and applies the storage caps (task context, snapshot).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from leadgate.core.errors import ValidationError

#: An external message (REST, MCP, channels, schedules, flow prompts).
MESSAGE_LIMIT = 100_000
#: The task context a work item keeps (the first message, then appended ones).
TASK_CONTEXT_LIMIT = 50_000
#: The submission snapshot (the withheld assistant text) a lead reviews.
SNAPSHOT_LIMIT = 100_000
#: complete_task's summary.
SUMMARY_LIMIT = 2_000
#: A human's rejection reason and return feedback (SPEC 5).
REASON_LIMIT = 2_000
FEEDBACK_LIMIT = 10_000
#: A client's session name (X-Session-Id, ``user``, MCP ``session``).
SESSION_NAME_LIMIT = 200
#: ``sessions.key`` is VARCHAR(500): a stored session key, prefix included.
SESSION_KEY_LIMIT = 500
#: ``inbound_events.external_event_id`` is VARCHAR(300); a route attribute is held to it too.
EVENT_ID_LIMIT = 300
#: Console passwords: at least 8 characters; longer than 1,024 is refused at login unread
#: (argon2 would hash whatever it is given), so it is refused when set too.
PASSWORD_MIN = 8
PASSWORD_MAX = 1_024


def validate_message(text: Any) -> str:
    """External messages: non-empty, at most 100,000 characters, no NUL characters."""
    if not isinstance(text, str):
        raise ValidationError("the message must be a string", rule="message.type")
    if not text.strip():
        raise ValidationError("the message must not be empty", rule="message.empty")
    if len(text) > MESSAGE_LIMIT:
        raise ValidationError(
            f"the message is longer than {MESSAGE_LIMIT:,} characters", rule="message.too_long"
        )
    if "\x00" in text:
        raise ValidationError("the message contains a NUL character", rule="message.invalid")
    if not text.isascii() and SURROGATE.search(text):
        raise ValidationError(
            "the message contains a lone UTF-16 surrogate (not a character)",
            rule="message.invalid",
        )
    return text


#: A lone UTF-16 surrogate (not a character; no database stores one).
SURROGATE = re.compile("[\ud800-\udfff]")
#: What no database stores in text: NUL (PostgreSQL) and lone surrogates (both).
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def bounded(text: str, limit: int) -> str:
    """``text``, or when it is longer than ``limit`` its head and a digest of the whole.

    For keys built from what a platform sends (a ``Message-ID`` may run to nearly 1,000
    characters, a Teams conversation id has no documented bound): a message must not be
    refused for one long id after others were recorded, and the same input still gives
    the same key (retries de-duplicate, replies thread)."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{text[: limit - len(digest) - 1]}~{digest}"


def cut(text: str, limit: int, marker: str = "…") -> str:
    """``text`` cut to ``limit`` characters, the cut marked (never dropped)."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(marker))].rstrip() + marker


def validate_session_key(key: str) -> str:
    """A stored session key: 1..500 characters."""
    if not key or len(key) > SESSION_KEY_LIMIT:
        raise ValidationError(
            f"the session id must be 1..{SESSION_KEY_LIMIT} characters", rule="session.length"
        )
    if "\x00" in key or (not key.isascii() and SURROGATE.search(key)):
        raise ValidationError("the session id contains invalid characters", rule="session.text")
    return key


def check_text(value: Any, *, name: str, limit: int, rule: str) -> str:
    """Required decision text: 1..``limit`` characters after trimming, storable (no NUL,
    no lone surrogate: an HTTP body's JSON checks refuse those, and the CLI reads text
    from standard input, a chat modal from the platform)."""
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"{name} must be text", rule=rule)
    if not value or not value.strip():
        raise ValidationError(f"{name} is required", rule=rule)
    if len(value) > limit:
        raise ValidationError(f"{name} must be at most {limit:,} characters", rule=rule)
    if UNSTORABLE.search(value):
        raise ValidationError(
            f"{name} contains a NUL character or a lone UTF-16 surrogate", rule=rule
        )
    return value
