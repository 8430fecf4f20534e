"""Stand-in for the Bot Framework's token signing keys (``login.botframework.com``).

The SDK verifies a channel token against OpenID metadata it fetches with ``requests``:
``GET <metadata url>`` answers ``{"jwks_uri": ...}`` and the JWKS document lists RSA keys
by ``kid``, each with the channels it is ``endorsements`` for. This serves both documents
on 127.0.0.1 for one generated key and signs tokens with it the way the Bot Connector
does (RS256; ``iss`` ``https://api.botframework.com``, ``aud`` the bot's app id,
``serviceurl`` the activity's ``serviceUrl``). Point the SDK at it with
``ChannelValidation.open_id_metadata_endpoint`` (the SDK's own setting for it).
"""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

ISSUER = "https://api.botframework.com"


def rsa_key() -> rsa.RSAPrivateKey:
    """A fresh 2048-bit signing key."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


class BotFrameworkKeys:
    """OpenID metadata and a JWKS with one key, served on 127.0.0.1; :meth:`token` signs."""

    def __init__(
        self, *, kid: str = "standin-key-1", endorsements: tuple[str, ...] = ("msteams",)
    ) -> None:
        self.kid = kid
        self.endorsements = endorsements
        self.key = rsa_key()
        self.fetches = 0
        self._runner: web.AppRunner | None = None
        self.metadata_url = ""

    async def start(self) -> None:
        """Listen on a free loopback port."""
        app = web.Application()
        app.router.add_get("/v1/.well-known/openidconfiguration", self._metadata)
        app.router.add_get("/v1/.well-known/keys", self._keys)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.metadata_url = f"http://127.0.0.1:{port}/v1/.well-known/openidconfiguration"

    async def close(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metadata(self, request: web.Request) -> web.Response:
        self.fetches += 1
        jwks = str(request.url.with_path("/v1/.well-known/keys"))
        return web.json_response({"issuer": ISSUER, "jwks_uri": jwks})

    async def _keys(self, request: web.Request) -> web.Response:
        jwk: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(self.key.public_key()))
        jwk.update(kid=self.kid, use="sig", endorsements=list(self.endorsements))
        return web.json_response({"keys": [jwk]})

    def token(
        self,
        *,
        app_id: str,
        service_url: str,
        issuer: str = ISSUER,
        lifetime_s: float = 3600,
        key: rsa.RSAPrivateKey | None = None,
    ) -> str:
        """A channel token as the Bot Connector signs it (``key``: sign with another key
        under the same ``kid``, a forgery)."""
        now = int(time.time())
        claims = {
            "iss": issuer,
            "aud": app_id,
            "serviceurl": service_url,
            "nbf": now - 60,
            "exp": int(now + lifetime_s),
        }
        return jwt.encode(claims, key or self.key, algorithm="RS256", headers={"kid": self.kid})
