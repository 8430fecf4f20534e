"""The Bot Connector's access token for Teams sends: fetched with a bound, kept until
shortly before it expires, and shared by every send.

The Bot Framework SDK makes new credentials, each with a token cache of its own, for
every Connector client, so each send asked the Microsoft identity platform for a token
(msal, through requests, with no timeout). Here one :class:`ConnectorTokens` keeps the
token of each (app, authority, scope) and fetches it on the Teams send pool, within
:data:`TOKEN_TIMEOUT_S`; several sends needing it at the same moment share one fetch.

The SDK's own Connector calls (the replies it posts while an inbound activity is
handled) take theirs from the same place: :class:`HeldTokenCredentialsFactory` makes
the credentials the SDK hands its Connector clients, and they wait (``await``, the fetch
on the pool) for the shared token where the SDK's would have asked msal for one on the
event loop (msrest's credentials policy calls them synchronously).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import msal
from botframework.connector.auth import AppCredentials, ServiceClientCredentialsFactory
from msrest.pipeline import Request, Response
from msrest.pipeline.async_abc import AsyncHTTPPolicy

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

    @property
    def pool(self) -> concurrent.futures.Executor:
        """The threads the tokens are fetched on (the Teams send pool)."""
        return self._pool

    def held(self, source: TokenSource) -> str | None:
        """The held token while it is fresh (None: it must be fetched, :meth:`token`)."""
        held = self._held.get(source)
        if held is not None and self._clock.now_ms() < held.fresh_until_ms:
            return held.token
        return None

    async def token(self, source: TokenSource) -> str:
        """The held token, or a fresh one (raises :class:`NoToken`)."""
        held = self.held(source)
        if held is not None:
            return held
        # One send giving up (its deadline) does not end the fetch the others wait for.
        return await asyncio.shield(self._fetch_shared(source))

    def fetch_ahead(self, source: TokenSource) -> None:
        """Start the fetch :meth:`token` would wait for, when no fresh token is held, and
        return at once: a send that may come with a short bound (the "not taken in"
        notice) then finds it held, or under way since. A failed fetch is only
        forgotten (the next :meth:`token` asks again)."""
        if self.held(source) is None:
            self._fetch_shared(source)

    def _fetch_shared(self, source: TokenSource) -> asyncio.Future[str]:
        """The fetch of ``source``'s token under way, or a new one."""
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
        return fetching

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


class HeldTokenCredentials(AppCredentials, AsyncHTTPPolicy[Any, Any]):  # type: ignore[misc]
    """The SDK's credentials for one Connector client, carrying the token ``tokens``
    holds for ``source``.

    msrest puts credentials that are an async policy into the client's pipeline as
    they are: each request waits there for the shared token (fetched on the pool,
    within its bound; none got: :class:`NoToken`, nothing sent). The SDK's credentials
    asked msal for a new token on the event loop instead, with no timeout."""

    def __init__(self, sdk: Any, source: TokenSource, tokens: ConnectorTokens) -> None:
        AppCredentials.__init__(
            self,
            app_id=sdk.microsoft_app_id,
            channel_auth_tenant=sdk.tenant,
            oauth_scope=sdk.oauth_scope,
        )
        AsyncHTTPPolicy.__init__(self)
        # (what TokenSource.of reads, as the SDK's credentials had it)
        self.microsoft_app_password = source.password
        self.oauth_endpoint = sdk.oauth_endpoint
        self.source = source
        self._tokens = tokens

    async def send(self, request: Request[Any], **kwargs: Any) -> Response[Any, Any]:
        """Send ``request`` with the shared token (raises :class:`NoToken`)."""
        token = await self._tokens.token(self.source)
        request.http_request.headers["Authorization"] = f"Bearer {token}"
        assert self.next is not None  # (set by the pipeline)
        return await self.next.send(request, **kwargs)

    def get_access_token(self, force_refresh: bool = False) -> str:
        """(synchronous: the SDK's callers outside a pipeline) The held token; never a
        request of its own, which would block the event loop."""
        token = None if force_refresh else self._tokens.held(self.source)
        if token is None:
            raise NoToken("no access token is held (it is fetched before a Connector call)")
        return token


class HeldTokenCredentialsFactory(ServiceClientCredentialsFactory):  # type: ignore[misc]
    """``inner`` (the SDK's factory for the app's settings), its credentials handing out
    the tokens of ``tokens`` (:class:`HeldTokenCredentials`); the local no-auth mode's
    credentials, which carry no token, as they are."""

    def __init__(self, inner: ServiceClientCredentialsFactory, tokens: ConnectorTokens) -> None:
        self._inner = inner
        self._tokens = tokens

    async def is_valid_app_id(self, app_id: str) -> bool:
        """As the SDK's factory answers it."""
        return bool(await self._inner.is_valid_app_id(app_id))

    async def is_authentication_disabled(self) -> bool:
        """As the SDK's factory answers it."""
        return bool(await self._inner.is_authentication_disabled())

    async def create_credentials(
        self, app_id: str, oauth_scope: str, login_endpoint: str, validate_authority: bool
    ) -> Any:
        """The SDK's credentials for ``app_id`` and ``oauth_scope``, made to carry the
        shared token (no token is fetched here: only a Connector call waits for one)."""
        sdk = await self._inner.create_credentials(
            app_id, oauth_scope, login_endpoint, validate_authority
        )
        source = TokenSource.of(sdk)
        return sdk if source is None else HeldTokenCredentials(sdk, source, self._tokens)
