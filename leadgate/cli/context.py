"""Which configuration file the ``leadgate`` command uses, and how it says so.

Discovery, first match wins: ``--config FILE``, then ``$LEADGATE_CONFIG``, then
``./config.toml`` in the current directory, else the built-in defaults. ``--help`` and
every error name the file and the database (a PostgreSQL password is never shown), so a
command can never silently write to a database the operator did not mean.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from leadgate.core.errors import LeadgateError

if TYPE_CHECKING:
    # Imported where a configuration is loaded or a URL shown: ``--version`` and a
    # usage error answer without pydantic and SQLAlchemy (most of a command's start).
    from leadgate.core.config import Settings

LOCAL_CONFIG = "config.toml"
ENV_CONFIG = "LEADGATE_CONFIG"


@dataclass(frozen=True)
class ConfigChoice:
    """The configuration file a command uses and why."""

    path: str | None
    source: str  # "--config", "$LEADGATE_CONFIG", "./config.toml", "defaults"

    def describe(self) -> str:
        """``config.toml (found in the current directory)``, and so on."""
        if self.path is None:
            return "built-in defaults (no --config, no $LEADGATE_CONFIG, no ./config.toml)"
        reason = {
            "--config": "from --config",
            "$LEADGATE_CONFIG": "from $LEADGATE_CONFIG",
            "./config.toml": "found in the current directory",
        }[self.source]
        return f"{self.path} ({reason})"


def discover(
    explicit: str | None, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> ConfigChoice:
    """The configuration file to use (see the module docstring)."""
    env = os.environ if environ is None else environ
    if explicit is not None:  # even "": load_settings refuses it (not the defaults)
        return ConfigChoice(explicit, "--config")
    if ENV_CONFIG in env:  # set but empty is the same mistake as `--config ""`
        return ConfigChoice(env[ENV_CONFIG], "$LEADGATE_CONFIG")
    local = (cwd or Path.cwd()) / LOCAL_CONFIG
    if local.is_file():
        return ConfigChoice(f"./{LOCAL_CONFIG}", "./config.toml")
    return ConfigChoice(None, "defaults")


def config_in_argv(argv: Sequence[str]) -> str | None:
    """The last ``--config`` value in ``argv`` (for ``--help``, before parsing)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.split("=", 1)[1]
    return found


def safe_url(url: str) -> str:
    """A database URL without its password, in its user part or in its query
    (``?password=``, ``?sslpassword=``...: any parameter whose name says secret)."""
    from sqlalchemy.engine import make_url  # see the imports

    try:
        parsed = make_url(url)
        if parsed.host and "@" in parsed.host:
            # An unescaped @ in the password: all before the host's last @ is secret.
            parsed = parsed.set(host=parsed.host.rpartition("@")[2], password="***")
        shown = parsed.set(query={}).render_as_string(hide_password=True)
        query = [
            f"{name}={'***' if _SECRET_PARAMETER.search(name) else value}"
            for name, values in parsed.query.items()
            for value in ((values,) if isinstance(values, str) else values)
        ]
        return shown + ("?" + "&".join(query) if query else "")
    except Exception:
        return "(unparsable database url)"


_SECRET_PARAMETER = re.compile(r"pass|secret|token|key", re.IGNORECASE)


def where(choice: ConfigChoice, settings: Settings | None) -> str:
    """``config: ... ; database: ...`` for help texts and error messages."""
    database = safe_url(settings.database.url) if settings is not None else "unknown"
    return f"config: {choice.describe()}; database: {database}"


def help_epilog(argv: Sequence[str]) -> str:
    """The ``--help`` footer: which file and database this command would use."""
    from leadgate.core.config import load_settings  # see the imports

    choice = discover(config_in_argv(argv))
    try:
        settings: Settings | None = load_settings(choice.path)
        problem = ""
    except LeadgateError as exc:
        settings, problem = None, f"\n  (the config cannot be loaded: {exc.message})"
    return (
        "Configuration, first match wins: --config FILE, $LEADGATE_CONFIG, ./config.toml, "
        f"built-in defaults.\nThis command would use {where(choice, settings)}{problem}"
    )
