"""Who is calling: API keys (with a short in-process cache) and console sessions."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

from leadgate.core.auth import Principal
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.limits import PASSWORD_MAX
from leadgate.database.db import Database
from leadgate.domain import orgs
from leadgate.operations.logins import LoginGuard

#: How long a valid API key's principal is cached in process: a key revoked meanwhile is
#: refused at the latest this many seconds later (see :meth:`Access.principal`).
PRINCIPAL_TTL_S = 5.0
PRINCIPAL_CACHE_SIZE = 1024
_TTL_MS = int(PRINCIPAL_TTL_S * 1000)
#: A console session lasts this long.
CONSOLE_SESSION_TTL_S = 12 * 3600


class Access:
    """Authentication for every surface."""

    def __init__(self, db: Database, clock: Clock, ids: IdFactory) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        # SHA-256 of a raw API key -> (expiry on self.clock in ms, principal); see principal().
        self._principals: OrderedDict[bytes, tuple[int, Principal]] = OrderedDict()
        self.logins = LoginGuard(clock)

    async def principal(self, token: str | None, session: str | None) -> Principal | None:
        """Principal of a bearer key or console session token.

        Valid API keys are cached in process for :data:`PRINCIPAL_TTL_S` seconds (at most
        :data:`PRINCIPAL_CACHE_SIZE` keys, by SHA-256 of the raw key: the key itself is
        never stored), so **a revoked key keeps working for up to that long** in a process
        that saw it just before. Unknown, malformed and revoked keys are not cached (each
        attempt is checked against the database), nor are console sessions (a logout
        takes effect at once).
        """
        if token:
            return await self._key_principal(token)
        if session:
            async with self.db.read() as conn:
                return await orgs.authenticate_session(conn, self.clock, session)
        return None

    async def key_principal(self, token: str) -> Principal | None:
        """:meth:`principal` of a bearer key alone (MCP)."""
        return await self._key_principal(token)

    async def _key_principal(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        now = self.clock.now_ms()
        hit = self._principals.get(digest)
        if hit is not None:
            # The service's clock (injectable: tests move it); an entry whose expiry lies
            # further ahead than the cache's lifetime means the clock was set back, and
            # is as stale as an expired one.
            if now < hit[0] <= now + _TTL_MS:
                return hit[1]
            del self._principals[digest]
        async with self.db.read() as conn:
            principal = await orgs.authenticate_key(conn, token)
        if principal is not None:
            self._principals[digest] = (now + _TTL_MS, principal)
            while len(self._principals) > PRINCIPAL_CACHE_SIZE:
                self._principals.popitem(last=False)  # the oldest entry
        return principal

    async def login(self, email: str, password: str, *, address: str = "unknown") -> str | None:
        """Check a console password; a new session token, or ``None``.

        The attempt is counted per address and per account before anything else
        (:class:`~leadgate.operations.logins.LoginGuard`: 429 with Retry-After past the
        limit, 503 when too many checks wait); the user is read in a read transaction,
        argon2 runs in a worker thread in a bounded slot, and only a correct password
        writes, in a short transaction of its own.
        """
        ticket = self.logins.admit(address, email)
        if len(email) > 320 or len(password) > PASSWORD_MAX:
            return None
        async with self.db.read() as conn:
            found = await orgs.login_user(conn, email)
        async with self.logins.check_slot():
            ok = await asyncio.to_thread(
                orgs.verify_password, found[1] if found else None, password
            )
        if found is None or not ok:
            return None
        self.logins.succeeded(ticket)
        async with self.db.tx() as conn:
            return await orgs.create_console_session(
                conn, self.clock, self.ids, found[0], CONSOLE_SESSION_TTL_S * 1000
            )

    async def logout(self, token: str) -> None:
        """End a console session (no-op when it is unknown)."""
        async with self.db.tx() as conn:
            await orgs.delete_session(conn, token)

    async def console_user(self, token: str | None) -> orgs.ConsoleUserView | None:
        """The console user of a session token (``None``: no, unknown or expired session)."""
        principal = await self.principal(None, token) if token else None
        if principal is None or principal.user_id is None:
            return None
        async with self.db.read() as conn:
            return await orgs.get_user(conn, principal.user_id)
