"""Fixtures shared by the integration tests of chat channels and reviews."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nacl.signing import SigningKey

from tests.standins.slack_api import SlackApiStandin
from tests.standins.smtp import SmtpSink


@pytest.fixture
def key() -> SigningKey:
    """A Discord application's Ed25519 key: the service verifies interactions with its
    public half, the tests sign them with it."""
    return SigningKey.generate()


@pytest.fixture
async def slack_api() -> AsyncIterator[SlackApiStandin]:
    """The Slack Web API stand-in, for a bot token ``xoxb-x``."""
    async with SlackApiStandin(token="xoxb-x") as standin:
        yield standin


@pytest.fixture
async def sink() -> AsyncIterator[SmtpSink]:
    """The outbound SMTP stand-in (an email channel's relay), on 127.0.0.1."""
    server = SmtpSink()
    await server.start()
    try:
        yield server
    finally:
        await server.close()
