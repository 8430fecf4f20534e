"""Process logging: structlog's renderers over the standard library's handlers."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from leadgate.core.config import Settings


def setup_logging(settings: Settings) -> None:
    """Log to stderr at ``[log] level``, as text or (``format = "json"``) JSON lines."""
    level = getattr(logging, settings.log.level)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log.format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[
            # The request id (and whatever else a surface binds) on every line.
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
