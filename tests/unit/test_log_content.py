"""DEBUG logs never carry message text or tokens unless ``[log] include_content``; nor do
database errors (their statements' parameters are hidden)."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from slack_sdk.web.async_client import AsyncWebClient

from leadgate.core.config import Settings
from leadgate.core.logs import LEVEL_TESTED_LOGGERS, setup_logging
from leadgate.database import schema as t
from leadgate.database.db import Database


@pytest.fixture
def restore_logging() -> object:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in LEVEL_TESTED_LOGGERS}
    yield None
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in levels.items():
        logging.getLogger(name).setLevel(was)


@pytest.mark.parametrize(
    ("level", "include", "built"),
    [("WARNING", False, False), ("DEBUG", False, False), ("DEBUG", True, True)],
)
def test_slack_sdk_builds_its_debug_lines_only_when_they_can_be_shown(
    level: str, include: bool, built: bool, restore_logging: object
) -> None:
    # slack_sdk formats its request and response lines when ``logger.level <= DEBUG``
    # (the logger's own level; an unset one is 0), on every Web API call.
    logging.getLogger("slack_sdk.web.async_base_client").setLevel(logging.NOTSET)
    setup_logging(Settings.model_validate({"log": {"level": level, "include_content": include}}))
    client = AsyncWebClient(token="xoxb-test")
    assert (client.logger.level <= logging.DEBUG) is built
    shown = logging.DEBUG if built else max(getattr(logging, level), logging.INFO)
    assert client.logger.getEffectiveLevel() == shown


@pytest.mark.parametrize("include", [False, True])
def test_library_payload_logs_stay_out_unless_asked_for(
    include: bool, capsys: pytest.CaptureFixture[str], restore_logging: object
) -> None:
    settings = Settings.model_validate({"log": {"level": "DEBUG", "include_content": include}})
    setup_logging(settings)
    names = (
        "slack_sdk.web.base_client",
        "discord.webhook.async_",
        "openai._base_client",
        "sse_starlette.sse",
    )
    for name in names:  # other tests may have set levels on these
        logging.getLogger(name).setLevel(logging.DEBUG)
    # What the SDKs log at DEBUG: request bodies (message text, withheld output) and
    # webhook URLs holding interaction tokens.
    logging.getLogger("slack_sdk.web.base_client").debug("body: {'text': 'SECRET-TEXT'}")
    logging.getLogger("discord.webhook.async_").debug("PATCH /webhooks/1/TOKEN-123/messages")
    logging.getLogger("openai._base_client").debug("Request options: SECRET-PROMPT")
    # The MCP transport's SSE layer logs every event it sends: a tool's answer, a transcript.
    logging.getLogger("sse_starlette.sse").debug("chunk: Echo: SECRET-ANSWER")
    for name in ("bots.slack", "outbox.relay", "binding.bindings"):
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).debug(f"ours too: {name}")
    ours = logging.getLogger("leadgate.test_log_content")
    ours.setLevel(logging.DEBUG)  # other tests may have raised the package's level
    ours.debug("a turn of ours")
    logging.getLogger("discord.http").warning("rate limited")
    err = capsys.readouterr().err
    for secret in ("SECRET-TEXT", "TOKEN-123", "SECRET-PROMPT", "SECRET-ANSWER"):
        assert (secret in err) is include
    assert "a turn of ours" in err and "rate limited" in err
    assert all(f"ours too: {n}" in err for n in ("bots.slack", "outbox.relay", "binding.bindings"))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_tracebacks_never_show_frame_locals(
    fmt: str, capsys: pytest.CaptureFixture[str], restore_logging: object
) -> None:
    setup_logging(Settings.model_validate({"log": {"format": fmt}}))

    def fail(text: str) -> None:
        raise RuntimeError("boom")

    secret = "-".join(("SECRET", "IN", "A", "LOCAL"))  # not in any source line shown
    try:
        fail(secret)
    except RuntimeError:
        logging.getLogger("leadgate.test_log_content").exception("it failed")
    err = capsys.readouterr().err
    assert "it failed" in err and "RuntimeError: boom" in err and "fail" in err
    assert "SECRET-IN-A-LOCAL" not in err


def test_a_request_aiohttp_could_not_parse_is_one_info_line_without_what_was_sent(
    restore_logging: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiohttp.http_exceptions import InvalidURLError
    from aiohttp.web import RequestPayloadError

    setup_logging(Settings.model_validate({"log": {"level": "INFO"}}))
    server = logging.getLogger("aiohttp.server")
    try:
        raise InvalidURLError("Invalid char in url path: b'GET /x\\xffsecret'")
    except InvalidURLError as exc:
        # What aiohttp's RequestHandler.handle_error does with a parse error.
        server.exception("Error handling request from %s", "10.0.0.7", exc_info=exc)
    server.error("something else broke")
    try:
        raise RequestPayloadError("Can not decode content-encoding: gzip")
    except RequestPayloadError as exc:
        # What aiohttp logs when draining a body that broke after the route answered.
        server.exception("Unhandled exception", exc_info=exc)
    err = capsys.readouterr().err
    assert "malformed request from 10.0.0.7 (InvalidURLError)" in err
    assert "malformed request body, connection closed (RequestPayloadError)" in err
    assert "gzip" not in err
    assert "[info" in err and "secret" not in err and "Traceback" not in err
    assert "something else broke" in err  # other aiohttp errors still show

    setup_logging(Settings.model_validate({"log": {"level": "WARNING"}}))
    try:
        raise InvalidURLError("x")
    except InvalidURLError as exc:
        server.exception("Error handling request from %s", "10.0.0.7", exc_info=exc)
    assert "malformed" not in capsys.readouterr().err


async def test_database_errors_never_carry_the_statements_parameters(migrated_url: str) -> None:
    """The parameters of a failed statement are what clients sent (names, message text):
    a database error's text, which reaches logs and tracebacks, leaves them out on both
    backends' fast paths, as the SQLAlchemy engine is made to (``hide_parameters``)."""
    db = Database(migrated_url)
    secret = "a-secret-organization-name"
    row = {"id": "org_1", "name": secret, "created_at": 1}
    try:
        async with db.tx() as conn:
            await conn.execute(sa.insert(t.organizations).values(**row))
        with pytest.raises(sa.exc.IntegrityError) as info:
            async with db.tx() as conn:
                await conn.execute(sa.insert(t.organizations).values(**row))
    finally:
        await db.close()
    assert secret not in str(info.value)
    assert "hidden due to hide_parameters" in str(info.value)


def test_failed_accepts_are_one_warning_not_a_traceback_each(
    restore_logging: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio
    import errno

    from leadgate.core.logs import ACCEPT_FAILED, AcceptFailureFilter

    loop_logger = logging.getLogger("asyncio")
    for old in [f for f in loop_logger.filters if isinstance(f, AcceptFailureFilter)]:
        loop_logger.removeFilter(old)  # a fresh 10-s window for this test
    setup_logging(Settings.model_validate({"log": {"level": "INFO"}}))
    loop = asyncio.new_event_loop()
    try:
        # How the loop reports each connection it could not accept (asyncio's
        # selector_events), here 300 times as a descriptor flood did.
        for _ in range(300):
            loop.call_exception_handler(
                {
                    "message": ACCEPT_FAILED,
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )
        loop.call_exception_handler({"message": "Task exception was never retrieved"})
    finally:
        loop.close()
    err = capsys.readouterr().err
    assert err.count("accept failed") == 1
    assert "http: accept failed 1 time(s) (Too many open files)" in err
    assert ACCEPT_FAILED not in err and "Traceback" not in err
    assert "Task exception was never retrieved" in err  # the loop's other errors still show
    [installed] = [f for f in loop_logger.filters if isinstance(f, AcceptFailureFilter)]
    assert installed.failures.total == 300


async def test_a_url_s_user_and_password_never_reach_the_log(
    restore_logging: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """httpx2, under the openai SDK, logs every request's URL at INFO: a model's
    ``base_url`` with a user and password (a gateway behind basic auth) put the password
    in the log on every turn."""
    import httpx2

    setup_logging(Settings.model_validate({"log": {"level": "INFO"}}))
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, json={}))
    async with httpx2.AsyncClient(transport=transport) as client:
        await client.post("https://gw:s3cret-password@models.example:8443/v1/chat/completions")
    err = capsys.readouterr().err
    assert "HTTP Request: POST https://models.example:8443/v1/chat/completions" in err
    assert "s3cret-password" not in err and "gw:" not in err
