"""The session-key scheme of the api and studio bindings (REST, MCP, Studio), in one place.

A client names its conversation with one public session name: ``X-Session-Id`` (REST),
else the body's ``user`` (REST), MCP's ``session`` argument, or Studio's session, and
the transcript and events routes take the same name in their path. The same name is the
same session whichever way it came (stored as ``h:<name>``; migration 0005 renamed the
older ``u:<name>`` keys of ``user`` sessions where that caused no collision). No name,
or the name ``default``, is the caller's default session with that agent: one per API
key (or console user), stored as ``default:<key id or user id>``.
"""

from __future__ import annotations

import re

from leadgate.core.auth import Principal
from leadgate.core.errors import ValidationError
from leadgate.core.limits import SESSION_NAME_LIMIT

#: The public name of the caller's default session.
DEFAULT_SESSION = "default"


def api_session_key(principal: Principal, *, session: str | None, user: str | None = None) -> str:
    """The stored session key of a public session name (``session`` wins over ``user``;
    neither, or ``default``, is the caller's default session)."""
    name = session or user
    if not name or name == DEFAULT_SESSION:
        return f"default:{principal.key_id or principal.user_id}"
    if len(name) > SESSION_NAME_LIMIT:
        raise ValidationError(
            f"the session id is longer than {SESSION_NAME_LIMIT} characters",
            rule="session.length",
        )
    if _CONTROL.search(name):
        # Checked here, where every surface's name becomes a key: reading or watching a
        # session stores it too (an empty session to wait on), and PostgreSQL text holds
        # no NUL.
        raise ValidationError(
            "the session id contains a control character or a lone surrogate",
            rule="session.text",
        )
    return f"h:{name}"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
