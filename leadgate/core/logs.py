"""Process logging: structlog's renderers over the standard library's handlers."""

from __future__ import annotations

import logging
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leadgate.core.config import Settings

#: Our own packages: they never log message text at any level (a review checks it), so
#: their DEBUG lines are kept. Every other logger's DEBUG is a library's, and libraries log
#: request and response payloads there (message text, lead-gated output, interaction
#: tokens in webhook URLs, bearer headers): slack_sdk, discord.py, openai, httpx, msrest,
#: aiosmtplib, the mcp SDK and the SSE transport under it, SQLAlchemy's parameters...
#: A list of those to drop missed one (``sse_starlette``); this is the list to keep.
OWN_LOGGERS = ("leadgate", "bots", "outbox", "binding")

#: slack_sdk's clients decide whether to build their DEBUG request and response lines
#: (params, headers, body) from their logger's *own* level (``logger.level <=
#: logging.DEBUG``), not its effective one, and a logger with no level of its own has
#: level 0. So every Web API call formatted both lines for the logging module to drop
#: them: 12-14 us of CPU per ``chat.postMessage`` (about 150 us in all) on the bench's
#: VM. :func:`setup_logging` sets these loggers' levels explicitly.
LEVEL_TESTED_LOGGERS = (
    "slack_sdk.web.async_base_client",
    "slack_sdk.web.base_client",
    "slack_sdk.webhook.async_client",
    "slack_sdk.webhook.client",
)


class ContentFilter(logging.Filter):
    """Drops records below INFO from every logger but :data:`OWN_LOGGERS` (``[log]
    include_content = false``, the default): at DEBUG, libraries log message text and
    tokens."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.INFO:
            return True
        name = record.name
        return any(name == p or name.startswith(p + ".") for p in OWN_LOGGERS)


class Tally:
    """Like events (requests shed, connections refused) counted and logged as one WARNING
    (or ``level``) every ``every_s`` at most, with how many there were since the last
    line: a line per event would feed the flood it reports. ``message`` takes that number
    first, then the arguments of :meth:`add`."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        *,
        every_s: float = 10.0,
        now: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
    ) -> None:
        self.total = 0
        self._logger = logger
        self._message = message
        self._every_s = every_s
        self._now = now
        self._level = level
        self._logged = 0
        self._next = 0.0

    def add(self, *args: object) -> None:
        """Count one event; log the line when the interval has passed."""
        self.total += 1
        now = self._now()
        if now >= self._next:
            self._logger.log(self._level, self._message, self.total - self._logged, *args)
            self._logged, self._next = self.total, now + self._every_s


class MalformedRequestFilter(logging.Filter):
    """aiohttp's server logs a request it could not parse (a bad request line, header or
    body framing; it answers 400) at ERROR, with a traceback that quotes the offending
    bytes: any client could fill the log with errors and with what it sent. Such a record
    becomes one INFO line naming the error's class and the peer, nothing the client wrote.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        # Imported here: the filter sits on aiohttp's own logger (aiohttp is loaded when
        # it runs), and the CLI's commands, which set logging up, never load aiohttp.
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            if isinstance(record.args, tuple) and record.args:
                record.msg = "malformed request from %s (%s)"
                record.args = (record.args[0], type(exc).__name__)
            else:
                # aiohttp draining a broken body after the answer ("Unhandled exception"):
                # the request was already answered 400 and logged by its route.
                record.msg = "malformed request body, connection closed (%s)"
                record.args = (type(exc).__name__,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
            # The logger let the ERROR through; the INFO line obeys ``[log] level``.
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


#: The ``scheme://user:password@`` that starts a URL with credentials.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#@]*@")

#: The HTTP client that logs every request's URL at INFO: httpx2, under the openai SDK
#: (a model's ``base_url``).
URL_LOGGING_LOGGERS = ("httpx2",)


class UrlCredentialsFilter(logging.Filter):
    """httpx2 logs every request's URL at INFO (``HTTP Request: POST <url> ...``) as it
    was given, user and password included: a model's ``base_url`` with credentials (a
    gateway behind basic auth, ``https://user:password@host/v1``) put the password in the
    log on every turn. A URL argument of such a record loses its user and password."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_without_userinfo(arg) for arg in record.args)
        return True


def _without_userinfo(arg: object) -> object:
    if isinstance(arg, int | float | bytes) or arg is None:
        return arg  # a status code, a length: kept as they are for %d
    text = str(arg)
    bare = _USERINFO.sub(r"\1", text)
    return arg if bare == text else bare


#: How asyncio's loop reports a listening socket's ``accept`` failing for want of
#: descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM).
ACCEPT_FAILED = "socket.accept() out of system resource"


class AcceptFailureFilter(logging.Filter):
    """asyncio logs every failed ``accept`` at ERROR with its traceback, and Python 3.11
    retries the rest of the backlog at once, so a process out of descriptors wrote
    122,881 log lines while 1,100 idle connections lasted (session 33's probe, before
    ``[server] max_connections`` bounded the listener). Such records become one WARNING
    every 10 s with their count; the listener's bound keeps the service from getting
    there."""

    def __init__(self, *, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.failures = Tally(
            logging.getLogger("leadgate.web"),
            "http: accept failed %d time(s) (%s): the process is out of descriptors or "
            "memory; see [server] max_connections and RLIMIT_NOFILE",
            now=now,
        )

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(ACCEPT_FAILED):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        self.failures.add(exc.strerror if isinstance(exc, OSError) else "unknown error")
        return False


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: a SQLAlchemy error's ``orig`` (the driver's error),
    causes and contexts, each once (at most 13)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen) or len(seen) > 12:
            continue
        seen.append(item)
        todo.extend((getattr(item, "orig", None), item.__cause__, item.__context__))
    return seen


#: Where a database error comes from: SQLAlchemy and the drivers under it.
_DATABASE_MODULES = ("sqlalchemy", "asyncpg", "sqlite3", "aiosqlite", "psycopg")


def _from_database(item: BaseException) -> bool:
    module = type(item).__module__
    return any(module == m or module.startswith(m + ".") for m in _DATABASE_MODULES)


class DatabaseErrorText(Exception):
    """What a log record shows in place of an error whose chain holds a database
    driver's error (:func:`loggable`): the error's type and the database's codes, the
    original's frames, none of its text."""


def loggable(exc: BaseException) -> BaseException:
    """``exc`` as a log record's ``exc_info`` may carry it: itself, or when its chain
    (:func:`exception_chain`) holds SQLAlchemy's or a driver's error, a
    :class:`DatabaseErrorText` with the same frames (the traceback still says where)
    whose text names the types, SQLSTATE or SQLite error name, and the constraint,
    table and column, never what the database said: PostgreSQL's ``DETAIL`` (``Failing
    row contains (...)``, ``Key (...)=(...)``) and ``CONTEXT``, a value quoted in a
    primary message (``invalid input syntax for type json``), a trigger's ``RAISE``
    text and SQLAlchemy's ``[parameters: ...]`` quote the statement's values: message
    text, an answer, a token."""
    chain = exception_chain(exc)
    found = [item for item in chain if _from_database(item)]
    if not found:
        return exc
    codes: list[str] = []
    for item in found:
        for name in (
            "sqlstate",
            "sqlite_errorname",
            "constraint_name",
            "table_name",
            "column_name",
        ):
            value = getattr(item, name, None)
            if isinstance(value, str) and value and f"{name} {value}" not in codes:
                codes.append(f"{name} {value}")
    names = " <- ".join(dict.fromkeys(type(item).__name__ for item in chain))
    text = f"{names} ({', '.join(codes) or 'no code'}): the database's own text left out"
    return DatabaseErrorText(text).with_traceback(exc.__traceback__)


def error_text(exc: BaseException) -> str:
    """``exc`` in words a log line may carry without its traceback (and an error stored
    from the same failure): its type and text, or when its chain holds a database error,
    what :func:`loggable` says of it instead (the types and codes, never the database's
    text: PostgreSQL's ``DETAIL`` quotes the row, message text among it)."""
    shown = loggable(exc)
    return str(shown) if shown is not exc else f"{type(exc).__name__}: {exc}"


def raised_at(exc: BaseException) -> str:
    """The file and line ``exc`` was raised at (its innermost frame), for an error
    logged without its traceback, whose last line is the error's text; empty when it
    was never raised."""
    if exc.__traceback__ is None:
        return ""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"


class LineFormatter(logging.Formatter):
    """structlog's renderer for a record: text, or with ``json_lines`` one JSON object
    per line. Made at the first record this formatter formats, so a process that logs
    nothing (most ``leadgate`` commands) never imports structlog and the rich modules it
    loads (about 60 ms of each command's start); the service logs from its start."""

    def __init__(self, *, json_lines: bool) -> None:
        super().__init__()
        self.json_lines = json_lines
        self._made: logging.Formatter | None = None

    def format(self, record: logging.LogRecord) -> str:
        if self._made is None:
            self._made = _processor_formatter(self.json_lines)
        return self._made.format(record)


def _processor_formatter(json_lines: bool) -> logging.Formatter:
    import structlog

    # Tracebacks are plain: no frame locals, which would carry message text, prompts
    # and tokens into the log (rich's pretty tracebacks show them).
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    )
    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([structlog.processors.format_exc_info] if json_lines else []),
            renderer,
        ],
        foreign_pre_chain=[
            # The request id (and whatever else a surface binds) on every line.
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
    )


def setup_logging(settings: Settings) -> None:
    """Log to stderr at ``[log] level``, as text or (``format = "json"``) JSON lines.

    Message text, tokens and payloads stay out of the log unless ``[log]
    include_content = true`` (see :class:`ContentFilter`)."""
    level = getattr(logging, settings.log.level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(json_lines=settings.log.format == "json"))
    if not settings.log.include_content:
        handler.addFilter(ContentFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The level a record of theirs is shown at: the root's, and at least INFO while
    # their DEBUG lines (payloads) are filtered out anyway.
    shown = level if settings.log.include_content else max(level, logging.INFO)
    for name in LEVEL_TESTED_LOGGERS:
        logging.getLogger(name).setLevel(shown)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestFilter) for f in server.filters):
        server.addFilter(MalformedRequestFilter())
    for name in URL_LOGGING_LOGGERS:
        url_logger = logging.getLogger(name)
        if not any(isinstance(f, UrlCredentialsFilter) for f in url_logger.filters):
            url_logger.addFilter(UrlCredentialsFilter())
    loop_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptFailureFilter) for f in loop_logger.filters):
        loop_logger.addFilter(AcceptFailureFilter())
    logging.getLogger("alembic").setLevel(logging.WARNING)
