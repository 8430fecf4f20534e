"""The Bot Connector's access token for Teams sends: fetched with a bound, kept until
shortly before it expires, and shared by every send.

The Bot Framework SDK makes new credentials, each with a token cache of its own, for
every Connector client, so each send asked the Microsoft identity platform for a token
(msal, through requests, with no timeout). Here one :class:`ConnectorTokens` keeps the
token of each (app, authority, scope) and fetches it on the Teams send pool, within
:data:`TOKEN_TIMEOUT_S`; several sends needing it at the same moment share one fetch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import msal

from leadgate.core.clock import Clock

#: How long the token's request (msal's discovery of the authority included) may take.
TOKEN_TIMEOUT_S = 10.0
#: How long before its expiry a token is fetched anew (at most half its lifetime).
REFRESH_MARGIN_S = 300.0


class NoToken(Exception):
    """No access token could be got (nothing was sent to the Connector); the message
    says why."""


@dataclass(frozen=True)
class TokenSource:
    """Who asks for a token, where and for what: read off the SDK's credentials."""

    app_id: str
    password: str = field(repr=False)
    authority: str
    scope: str

    @classmethod
    def of(cls, credentials: Any) -> TokenSource | None:
        """The source of the SDK's ``MicrosoftAppCredentials`` (None: no app id, the
        local no-auth mode, where the Connector calls carry no token)."""
        app_id = getattr(credentials, "microsoft_app_id", None)
        if not app_id or not isinstance(app_id, str):
            return None
        scope = str(credentials.oauth_scope)
        return cls(
            app_id=app_id,
            password=str(credentials.microsoft_app_password),
            authority=str(credentials.oauth_endpoint),
            # (as the SDK's credentials ask for it)
            scope=scope if scope.endswith("/.default") else scope + "/.default",
        )


@dataclass(frozen=True)
class _Held:
    token: str
    fresh_until_ms: int


class ConnectorTokens:
    """Access tokens for the Connector, kept per :class:`TokenSource` until
    :data:`REFRESH_MARGIN_S` before they expire (``clock``'s time), fetched on ``pool``
    within ``timeout_s``."""

    def __init__(
        self,
        *,
        clock: Clock,
        pool: concurrent.futures.Executor,
        timeout_s: float = TOKEN_TIMEOUT_S,
    ) -> None:
        self._clock = clock
        self._pool = pool
        self._timeout_s = timeout_s
        self._held: dict[TokenSource, _Held] = {}
        self._fetching: dict[TokenSource, asyncio.Future[str]] = {}
        # One msal application per source (its authority discovered once); used on the
        # pool's threads only.
        self._apps: dict[TokenSource, msal.ConfidentialClientApplication] = {}

    async def token(self, source: TokenSource) -> str:
        """The held token, or a fresh one (raises :class:`NoToken`)."""
        held = self._held.get(source)
        if held is not None and self._clock.now_ms() < held.fresh_until_ms:
            return held.token
        fetching = self._fetching.get(source)
        if fetching is None:
            fetching = asyncio.ensure_future(self._fetch(source))
            self._fetching[source] = fetching

            def done(future: asyncio.Future[str]) -> None:
                if self._fetching.get(source) is future:
                    del self._fetching[source]
                if not future.cancelled():
                    future.exception()  # (read: every waiter may have given up)

            fetching.add_done_callback(done)
        # One send giving up (its deadline) does not end the fetch the others wait for.
        return await asyncio.shield(fetching)

    def drop(self, source: TokenSource, token: str) -> None:
        """Forget ``token`` (the Connector refused it), unless a newer one is held."""
        held = self._held.get(source)
        if held is not None and held.token == token:
            del self._held[source]

    async def _fetch(self, source: TokenSource) -> str:
        asked_ms = self._clock.now_ms()
        loop = asyncio.get_running_loop()
        try:
            token, expires_in_s = await asyncio.wait_for(
                loop.run_in_executor(self._pool, self._grant, source), self._timeout_s
            )
        except TimeoutError:
            raise NoToken(
                f"the Microsoft identity platform gave no access token within {self._timeout_s:g} s"
            ) from None
        # Counted from the request, not its answer: never held past its expiry.
        margin_s = min(REFRESH_MARGIN_S, expires_in_s / 2)
        held = _Held(token, asked_ms + int((expires_in_s - margin_s) * 1000))
        self._held[source] = held
        return token

    def _grant(self, source: TokenSource) -> tuple[str, float]:
        """(pool thread) A new token and its lifetime in seconds."""
        try:
            app = self._apps.get(source)
            if app is None:
                app = msal.ConfidentialClientApplication(
                    client_id=source.app_id,
                    client_credential=source.password,
                    authority=source.authority,
                    # each socket operation's bound (the whole fetch: timeout_s, above)
                    timeout=self._timeout_s,
                )
                self._apps[source] = app
            # msal would answer from its own cache: the token wanted is a new one.
            app.remove_tokens_for_client()
            answer = app.acquire_token_for_client(scopes=[source.scope])
        except Exception as exc:  # requests' errors, a page that is not JSON, ...
            raise NoToken(f"the access token's request failed: {exc!r}") from None
        token = answer.get("access_token")
        if not isinstance(token, str) or not token:
            raise NoToken(
                f"no access token: {answer.get('error', 'unknown error')}: "
                f"{answer.get('error_description', '')}"
            )
        try:
            expires_in_s = float(answer.get("expires_in", 0))
        except (TypeError, ValueError):
            expires_in_s = 0.0
        return token, max(0.0, expires_in_s)
