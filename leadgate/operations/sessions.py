"""The session-key scheme of the api binding (REST and MCP), in one place.

A client names its conversation with ``X-Session-Id`` (REST), else the body's ``user``
(REST), or ``session`` (MCP, the same namespace as ``X-Session-Id``). Without one, each
API key (or console user) has one default session per agent.
"""

from __future__ import annotations

from leadgate.core.auth import Principal
from leadgate.core.errors import ValidationError
from leadgate.core.limits import SESSION_NAME_LIMIT


def api_session_key(principal: Principal, *, session: str | None, user: str | None = None) -> str:
    """The stored session key for an api-binding turn (``h:``, ``u:`` or ``default:``)."""
    if session:
        key = f"h:{session}"
    elif user:
        key = f"u:{user}"
    else:
        return f"default:{principal.key_id or principal.user_id}"
    if len(key) > SESSION_NAME_LIMIT + 2:
        raise ValidationError(
            f"the session id is longer than {SESSION_NAME_LIMIT} characters",
            rule="session.length",
        )
    return key
