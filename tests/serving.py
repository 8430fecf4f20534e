"""The real composition root served on 127.0.0.1 for integration tests (aiohttp's test
client), on a migrated database, with a FakeClock and no channel adapters (unless asked for) or
background loops (drive runners with ``leadgate.core.runners.drain``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from nacl.signing import SigningKey

from leadgate.app import App
from leadgate.core.clock import FakeClock, IdFactory
from leadgate.core.config import Settings
from leadgate.turns.providers.base import Provider

Client = TestClient[web.Request, web.Application]


class ServedLikeProduction(TestServer):
    """aiohttp's test server cancels a request's handler when its client goes away;
    ``leadgate serve`` does not (aiohttp's default): a handler runs to its end."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


def webhook_channels(key: SigningKey) -> dict[str, Any]:
    """Config sections that mount the Slack, Discord (verified with ``key``) and Teams
    webhooks (nothing is sent: their APIs are never called by requests to them)."""
    return {
        "slack": {
            "signing_secret": "s3cret",
            "bot_token": "xoxb-1",
            "api_url": "http://127.0.0.1:9/",
        },
        "discord": {"public_key": key.verify_key.encode().hex()},
        "teams": {"enabled": True, "app_id": "app-id", "app_password": "app-password"},
    }


@asynccontextmanager
async def served_app(
    url: str,
    *,
    config: dict[str, Any] | None = None,
    providers: dict[str, Provider] | None = None,
    like_production: bool = False,
    adapters: bool = False,
    ids: IdFactory | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: FakeClock | None = None,
) -> AsyncIterator[tuple[App, Client]]:
    """``App`` on ``url`` (extra config sections in ``config``) and a client of it
    (``like_production``: handlers are not cancelled when their client goes away;
    ``adapters``: the channel adapters ``config`` turns on are mounted and run; ``ids``:
    the id factory, random ids by default; ``sleep``: the turn path's back-off;
    ``clock``: a clock shared with another instance on ``url``, a new one by default)."""
    settings = Settings.model_validate({"database": {"url": url}, **(config or {})})
    service = App(
        settings,
        clock=clock or FakeClock(),
        ids=ids,
        providers=providers,
        enable_adapters=adapters,
        sleep=sleep,
    )
    server = (ServedLikeProduction if like_production else TestServer)(
        service.web_app(), host="127.0.0.1"
    )
    client: Client = TestClient(server)
    await client.start_server()
    try:
        yield service, client
    finally:
        await client.close()
        await service.stop()
