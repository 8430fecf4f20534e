"""Fixtures shared by the integration tests of chat channels and reviews."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def demo_cli_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite file of ``tests.integration.test_review_cli.seed_demo_cli`` (the demo
    organization and two console users, through the CLI entry point), made once per
    session; copy it (``clone_sqlite``), never write to it."""
    from tests.integration.test_review_cli import seed_demo_cli

    # The commands' setup_logging replaces the root logger's handlers (with one bound to
    # this moment's captured stderr): put them back, as tests/conftest.py does per test.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return seed_demo_cli(tmp_path_factory.mktemp("demo-cli"))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
