"""The error middleware (``leadgate.web.common.error_middleware``) on a real socket: a
client that went away while its answer was written is neither a database fault nor a
bug of ours, while the same error with the client still there stays a 503."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from leadgate.core.metrics import METRICS
from leadgate.web.common import error_middleware


def unavailable_count() -> float:
    labels = {"rule": "service.unavailable"}
    return METRICS.registry.get_sample_value("leadgate_unavailable_responses_total", labels) or 0


async def gone(request: web.Request) -> web.Response:
    assert request.transport is not None
    request.transport.close()  # the client is gone
    raise ConnectionResetError("Cannot write to closing transport")


async def database_reset(request: web.Request) -> web.Response:
    raise ConnectionResetError("connection reset by peer")  # the database's connection


async def test_a_client_gone_mid_answer_is_one_info_line_not_a_database_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/gone", gone)
    app.router.add_get("/reset", database_reset)
    async with TestClient(TestServer(app)) as client:
        before = unavailable_count()
        caplog.set_level(logging.INFO, logger="leadgate")
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.get("/gone")
        assert unavailable_count() == before  # it was counted as a database 503
        assert "GET /gone: the client went away" in caplog.text
        assert "Traceback" not in caplog.text and "unhandled error" not in caplog.text
        still_there = await client.get("/reset")
        assert still_there.status == 503
        assert (await still_there.json())["error"]["rule"] == "service.unavailable"
        assert unavailable_count() == before + 1
