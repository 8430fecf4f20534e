"""Values kept between transactions under a token that says whether they may be stale.

The caches of rows that change a few times a day (the intake's agents and policy rules,
the lead runner's lead agents, the channels' routes) each keep what they read with the
token their database gave at the time (:meth:`leadgate.database.db.Conn.cache_token`,
:meth:`leadgate.database.db.Database.committed_token`) and use it again only under an
equal token. This is that one mechanism; the tokens' meaning lives with the database.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """Values by key, each with the token it was read under.

    :meth:`get` gives a value back only under an equal token; a ``None`` token (nothing
    can be known: read every time) neither finds nor keeps anything. Past
    ``max_entries`` keys it starts over: the values are cheap to read again, and a
    bound matters more than which entries survive.
    """

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: dict[K, tuple[object, V]] = {}

    def __contains__(self, key: object) -> bool:
        """Whether a value is kept for ``key`` under any token (a cheap first look)."""
        return key in self._entries

    def get(self, token: object | None, key: K) -> V | None:
        """The value kept for ``key`` under ``token``, or None."""
        if token is None:
            return None
        known = self._entries.get(key)
        if known is None or known[0] != token:
            return None
        return known[1]

    def put(self, token: object | None, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` under ``token`` (nothing when it is None)."""
        if token is None:
            return
        if len(self._entries) >= self.max_entries and key not in self._entries:
            self._entries.clear()
        self._entries[key] = (token, value)
