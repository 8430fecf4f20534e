"""Typed settings from a TOML file with ``LEADGATE_<SECTION>__<KEY>`` overrides.

pydantic does the validation (types, ranges, unknown keys). The environment merge is
written here because the ``[models.NAME]`` sections are dynamic and the override syntax
is fixed by the spec; pydantic-settings' nested-delimiter source would need the same
custom code around it (an override defines no model by itself, list settings read a JSON
array or commas, a misspelt name is refused only when it names a setting).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from leadgate.core.durations import parse_duration
from leadgate.core.errors import ConfigError, LeadgateError

ENV_PREFIX = "LEADGATE_"
#: A configuration file is read up to this size; a larger one is refused (config.file).
CONFIG_MAX_BYTES = 1024 * 1024
#: The deterministic model every configuration has (README "Built-in `script` model").
BUILT_IN_MODEL = "script"
#: ``[email] review_reply_address``: one plain ASCII address, no "+" in its local part.
_REPLY_ADDRESS = re.compile(r"[a-z0-9!#$%&'*/=?^_`{|}~.-]{1,40}@[a-z0-9-]+(\.[a-z0-9-]+)+")


class _Section(BaseModel):
    # No `inf` or `nan` (TOML has both): `inf` passed every `gt=0` bound, turning a
    # timeout or a poll off, and `[runners] dead_after_s = inf` stopped the service's
    # start with an OverflowError.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _api_base_url(value: str) -> str:
    """A channel's API base URL (``[slack] api_url``, ``[discord] api_url``), checked as
    its SDK will use it: an ``http(s)`` URL with a host and at most a path. Each SDK
    appends a method's path to it (slack_sdk by ``urljoin``, dropping a query; discord.py
    by concatenation, then ``str.format_map``, so a query or fragment swallows the path
    and a brace breaks every call), and sends its own ``Authorization``, which aiohttp
    refuses to combine with a user or password in the URL. Refused here, the mistake is
    named at load instead of at each delivery."""
    return _plain_url(
        value,
        ("http", "https"),
        "method paths are appended to the URL, so give a plain base such as https://host/api",
    )


def _gateway_url(value: str) -> str:
    """``[discord] gateway_url``: empty (Discord's own gateway) or a ``ws(s)`` URL (or
    ``http(s)``, which aiohttp's WebSocket client takes as well) with a host and at most a
    path; discord.py sets the query itself (version, encoding), dropping any given."""
    if value == "":
        return value
    return _plain_url(
        value,
        ("ws", "wss", "http", "https"),
        "discord.py sets the query itself, so give wss://host/ alone",
    )


def _plain_url(value: str, schemes: tuple[str, ...], why_plain: str) -> str:
    """``value`` if it is a URL of one of ``schemes`` with a host, no user or password,
    and no query, fragment or brace (``why_plain`` says why not); else ValueError."""
    # Never echo a password, whichever rule the value breaks first, nor a query, which
    # may carry a token (`?token=...`): it was quoted whole.
    before_query = re.split("[?#]", value, maxsplit=1)[0]
    shown = (
        "the URL (it carries a user or password)"
        if "@" in value
        else repr(before_query + ("..." if before_query != value else ""))
    )
    if not value or any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError(f"{shown} is not a URL (empty, or with a blank or control character)")
    try:
        parts = urlsplit(value)
        _ = parts.port  # a port out of range or not a number raises here
    except ValueError as exc:
        raise ValueError(f"{shown} is not a usable URL: {exc}") from None
    if parts.scheme not in schemes:
        *others, last = (f"{scheme}://" for scheme in schemes)
        starts = f"{', '.join(others)} or {last}"
        raise ValueError(f"{shown} is not a URL starting with {starts}")
    if not parts.hostname:
        raise ValueError(f"{shown} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{parts.scheme}://{parts.hostname}... carries a user or password: the client "
            "sends its own Authorization (the bot token)"
        )
    if "?" in value or "#" in value or "{" in value or "}" in value:
        raise ValueError(f"{shown} has a query, a fragment or a brace: {why_plain}")
    return value


class ServerSettings(_Section):
    """``[server]``: where the HTTP surfaces listen."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    public_url: str = "http://127.0.0.1:8080"
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    #: A connection may stay idle (before its first request's headers are in, or between
    #: keep-alive requests) this long before it is closed: slow-loris and idle sockets.
    idle_timeout_s: float = Field(default=15.0, gt=0)
    #: A request body must arrive within this many seconds (408 otherwise).
    body_timeout_s: float = Field(default=30.0, gt=0)
    #: Requests one process answers at once; beyond, 503 ``server.busy`` with
    #: Retry-After, 1-3 s (event and MCP streams have their own bounds and do not count).
    max_inflight: int = Field(default=1000, ge=1)
    #: Connections the listener holds at once (about 5 KB each). At the limit a new one
    #: closes the longest-idle one; with none idle it is answered 503
    #: ``server.connections`` and closed. Lowered at start, with a WARNING, to what the
    #: process's open-files limit leaves room for.
    max_connections: int = Field(default=4096, ge=1)
    #: A connection whose client takes nothing of its answer for this long is reset
    #: (nginx's ``send_timeout``: a client that keeps reading, however slowly, stays).
    send_timeout_s: float = Field(default=30.0, gt=0)
    #: On SIGTERM, requests in flight get this long to finish; then their handlers are
    #: cancelled (a turn waiting on a model that hangs held the exit for 2 minutes, past
    #: a service manager's stop timeout: systemd 90 s, Kubernetes 30 s).
    shutdown_grace_s: float = Field(default=20.0, gt=0, le=600)
    #: Bytes of answers waiting for clients that do not read them, at most; beyond, the
    #: connections whose last progress is oldest are reset.
    max_unsent_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    #: ``GET /metrics`` needs ``Authorization: Bearer <metrics_token>`` when set
    #: (printable ASCII without blanks: a bearer token is read as nothing else).
    metrics_token: str = Field(default="", pattern=r"^[!-~]*$")
    #: Serve ``/metrics`` (and ``/healthz``) on a separate listener instead of the main
    #: port when set (``metrics_port`` 0 picks a free one); the main port then has none.
    metrics_host: str = ""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: Addresses or networks of the proxies in front (``["127.0.0.1", "10.0.0.0/8"]``).
    #: A request from one of them is counted (console login attempts) as coming from the
    #: right-most ``X-Forwarded-For`` hop that is not a trusted proxy; without this,
    #: everyone behind the proxy shares its address and its login limit. Empty (the
    #: default): ``X-Forwarded-For`` is never read (a client could write any address).
    trusted_proxies: list[str] = Field(default_factory=list, max_length=1000)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or network (CIDR)") from None
        return value


class DatabaseSettings(_Section):
    """``[database]``: SQLite file by default, PostgreSQL for several replicas."""

    url: str = "sqlite+aiosqlite:///./leadgate.db"
    pool_size: int = Field(default=10, ge=1, le=200)
    #: How long a request waits for the database (SQLite writer lock, PostgreSQL pool or
    #: connect) before it is answered 503 with Retry-After, nothing stored.
    busy_timeout_s: float = Field(default=5.0, gt=0, le=300)


class SlackSettings(_Section):
    """``[slack]``: the channel is on when ``signing_secret`` is set."""

    signing_secret: str = ""
    bot_token: str = ""
    api_url: str = "https://slack.com/api/"
    #: At each start, the messages of the last this-many seconds that no process took in
    #: (posted while the service was down, past Slack's retries) are read back and
    #: answered; 0: off.
    catch_up_s: float = Field(default=3600.0, ge=0, le=7 * 86400)
    #: The read-back answers, outside direct messages, only messages that mention the
    #: bot (an app subscribed to ``app_mention`` alone); false: every human message (an
    #: app subscribed to ``message.channels`` / ``message.groups`` / ``message.mpim``).
    catch_up_mentions_only: bool = True

    _api_url = field_validator("api_url")(_api_base_url)

    @property
    def on(self) -> bool:
        """Whether the service runs the Slack channel."""
        return bool(self.signing_secret)


class DiscordSettings(_Section):
    """``[discord]``: interactions are on when ``public_key`` is set; gateway with a token."""

    bot_token: str = ""
    public_key: str = ""
    application_id: str = ""
    api_url: str = "https://discord.com/api/v10"
    gateway_url: str = ""
    #: At each gateway READY, the messages of the last this-many seconds that no process
    #: took in (posted while the service was down) are read back and answered; 0: off.
    catch_up_s: float = Field(default=3600.0, ge=0, le=7 * 86400)

    _api_url = field_validator("api_url")(_api_base_url)
    _gateway = field_validator("gateway_url")(_gateway_url)

    @property
    def on(self) -> bool:
        """Whether the service runs the Discord channel (interactions, gateway or both)."""
        return bool(self.public_key.strip() or self.bot_token.strip())


class TeamsSettings(_Section):
    """``[teams]``: Bot Framework app credentials (empty id = local, unauthenticated)."""

    enabled: bool = False
    app_id: str = ""
    app_password: str = ""
    app_tenant_id: str = ""

    @property
    def on(self) -> bool:
        """Whether the service runs the Teams channel."""
        return self.enabled or bool(self.app_id)


class EmailSettings(_Section):
    """``[email]``: inbound SMTP listener and outbound relay."""

    listen_host: str = ""
    listen_port: int = Field(default=0, ge=0, le=65535)
    smtp_host: str = ""
    smtp_port: int = Field(default=25, ge=0, le=65535)
    smtp_username: str = ""
    smtp_password: str = ""
    start_tls: bool = False
    from_address: str = ""
    #: Inbound SMTP sessions open at once; a connection beyond gets ``421`` and is closed
    #: (the sending server retries later, as for Postfix's process limit).
    max_connections: int = Field(default=100, ge=1)
    #: Review cards by email are answered by replying when set: each card mail carries
    #: ``Reply-To: <local>+<token>@<domain>`` of this address, and the SMTP listener takes
    #: the reply as the reviewer's decision ("": card mails are not answerable).
    review_reply_address: str = ""

    @field_validator("review_reply_address")
    @classmethod
    def _plain_address(cls, value: str) -> str:
        # Plus-addressing appends "+<token>" to the local part: a "+" already there, or
        # anything but one plain address, would make the reply addresses ambiguous.
        value = value.strip().lower()
        if value and not _REPLY_ADDRESS.fullmatch(value):
            raise ValueError(
                "review_reply_address must be one plain address, local@domain, without "
                "'+' in the local part (e.g. review@reviews.example.com)"
            )
        return value

    @model_validator(mode="after")
    def _answerable_cards_have_a_sender(self) -> EmailSettings:
        # Card mails and the answers to reviewers' replies go to a reviewer, not back from
        # a routed address: with no from_address each one failed for good at its send
        # ("lacks a sender address"), and nothing said so before the first card.
        if self.review_reply_address and not self.from_address.strip():
            raise ValueError(
                "review_reply_address needs from_address, the sender of review card mails "
                "and of the answers to replies (e.g. leadgate@example.com)"
            )
        return self

    @property
    def on(self) -> bool:
        """Whether the service runs email: inbound when a listener is set, outbound with a relay."""
        return bool(self.listen_host or self.listen_port or self.smtp_host)

    @property
    def listens(self) -> bool:
        """Whether inbound SMTP is configured (``listen_port = 0`` with a host: any free port)."""
        return bool(self.listen_host or self.listen_port)


class ModelSettings(_Section):
    """``[models.NAME]``: a model provider an agent can name."""

    provider: Literal["script", "openai"] = "script"
    base_url: str = ""
    api_key: str = ""
    model: str = ""
    timeout_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _openai_names_its_model(self) -> ModelSettings:
        # Checked with the rest of the file, not when the provider is first built:
        # otherwise the service would stop at startup with a traceback.
        if self.provider == "openai" and not self.model.strip():
            raise ValueError("an openai model needs `model`, the model name to request")
        return self


class RunnerSettings(_Section):
    """``[runners]``: background loops (poll intervals are only the safety net)."""

    poll_interval_s: float = Field(default=2.0, gt=0)
    review_concurrency: int = Field(default=4, ge=1, le=64)
    relay_batch: int = Field(default=100, ge=1, le=1000)
    relay_concurrency: int = Field(default=64, ge=1, le=1024)
    #: Attempts after which a delivery that keeps meeting retryable failures is reported
    #: as stalled (WARNING, metric outcome ``stalled``); it goes on being retried (the
    #: name is kept so that existing files still load).
    delivery_max_attempts: int = Field(default=8, ge=1, le=100)
    #: Every process writes a heartbeat this often; leases of a process whose heartbeat
    #: is older than ``dead_after_s`` (or, on the same host, whose pid is gone) are taken
    #: back at once instead of waiting out the lease.
    heartbeat_s: float = Field(default=5.0, gt=0)
    dead_after_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _dead_after_missed_beats(self) -> RunnerSettings:
        # With beats further apart than dead_after_s, every process looked dead between
        # two of its beats: another took its leases back while it still worked on them,
        # and the work ran twice.
        if self.dead_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s:g} s) must be at least twice heartbeat_s "
                f"({self.heartbeat_s:g} s): a live process whose beat came late would be "
                "taken for dead, and its work run a second time"
            )
        return self


class LogSettings(_Section):
    """``[log]``: ``format = "json"`` for structured logs."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
    #: Message text, tokens and request bodies never reach the log unless this is true
    #: (even at DEBUG, where libraries log request payloads).
    include_content: bool = False


class ReviewSettings(_Section):
    """``[review]``: the default reminder, escalation and expiry times of review cards
    (per organization / agent overrides: ``leadgate notify sla``). Durations like
    ``30m``, ``2h``, ``1h30m``; ``off`` switches one off."""

    remind_after: str = "30m"
    remind_every: str = "off"
    escalate_after: str = "off"
    expire_after: str = "off"
    expire_action: Literal["reject"] = "reject"

    @field_validator("remind_after", "remind_every", "escalate_after", "expire_after")
    @classmethod
    def _duration(cls, value: str) -> str:
        try:
            parse_duration(value)
        except LeadgateError as exc:
            raise ValueError(exc.message) from None
        return value

    def ms(self, name: str) -> int | None:
        """One of the durations in milliseconds (``None``: off)."""
        value: str = getattr(self, name)
        return parse_duration(value, name=f"review.{name}")


class ApiSettings(_Section):
    """``[api]``: the session read surfaces (event streams) and hosted MCP sessions."""

    events_heartbeat_s: float = Field(default=15.0, gt=0, le=15)
    events_write_timeout_s: float = Field(default=30.0, gt=0)
    events_max_streams: int = Field(default=1000, ge=1)
    #: Open event streams (session, Studio, operator feed) and MCP streams check their
    #: key or console session again this often, and end once it is revoked or logged out.
    events_reauth_s: float = Field(default=5.0, gt=0, le=5)
    mcp_session_idle_s: float = Field(default=600.0, gt=0)
    mcp_max_sessions: int = Field(default=1000, ge=1)


class Settings(_Section):
    """The whole configuration."""

    server: ServerSettings = ServerSettings()
    database: DatabaseSettings = DatabaseSettings()
    slack: SlackSettings = SlackSettings()
    discord: DiscordSettings = DiscordSettings()
    teams: TeamsSettings = TeamsSettings()
    email: EmailSettings = EmailSettings()
    #: ``script`` is always among them (a file's own ``[models.script]`` replaces it).
    models: dict[str, ModelSettings] = Field(default_factory=dict, validate_default=True)
    runners: RunnerSettings = RunnerSettings()
    log: LogSettings = LogSettings()
    review: ReviewSettings = ReviewSettings()

    api: ApiSettings = ApiSettings()

    @field_validator("models")
    @classmethod
    def _script_is_built_in(cls, value: dict[str, ModelSettings]) -> dict[str, ModelSettings]:
        # A default for the whole dict held only while the key was absent: the first
        # `[models.gpt]` section took `script` away, and agents naming it stopped working.
        if BUILT_IN_MODEL in value:
            return value
        return {BUILT_IN_MODEL: ModelSettings(provider="script"), **value}


def _env_path(name: str) -> list[str]:
    """``LEADGATE_MODELS__GPT__API_KEY`` -> ``["models", "gpt", "api_key"]``."""
    return [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]


def _apply_env(data: dict[str, Any], environ: dict[str, str]) -> None:
    in_file = data.get("models")
    file_models = list(in_file) if isinstance(in_file, dict) else []
    # A model the environment defines names its provider: LEADGATE_MODELS__X__PROVIDER.
    env_models = {
        path[1]
        for name in environ
        if name.startswith(ENV_PREFIX)
        and (path := _env_path(name))[0] == "models"
        and path[2:] == ["provider"]
    }
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if "__" not in name:
            _check_not_a_misspelt_override(name)
            continue
        path = _env_path(name)
        if path[0] not in Settings.model_fields:
            raise ConfigError(
                f"unknown configuration section in environment variable {name}",
                rule="config.unknown_key",
            )
        if path[0] == "models" and len(path) > 2:
            path[1] = _env_model(name, path[1], file_models, env_models)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name} does not name a section", rule="config.unknown_key")
            node = child
        node[path[-1]] = _env_list(name, value) if _is_list(path) else value


def _is_section(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_list(path: list[str]) -> bool:
    """Whether the setting at ``path`` (``["server", "trusted_proxies"]``) is a list."""
    section = Settings.model_fields[path[0]].annotation
    keys = path[1:]
    if path[0] == "models":
        section, keys = ModelSettings, path[2:]
    if len(keys) != 1 or not _is_section(section):
        return False
    field = section.model_fields.get(keys[0])
    return field is not None and get_origin(field.annotation) is list


def _env_list(name: str, value: str) -> list[Any]:
    """A list setting's variable: a JSON array (``["127.0.0.1", "10.0.0.0/8"]``) or the
    values separated by commas (``127.0.0.1,10.0.0.0/8``; empty: no value). Pydantic
    reads neither from a string: the variable was always ``should be a valid list``."""
    text = value.strip()
    if not text.startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        items: list[Any] = json.loads(text)  # valid JSON that starts with "[" is an array
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"environment variable {name} is not a JSON array ({exc.msg}, character "
            f'{exc.pos + 1}): write one such as ["a", "b"], or the values separated '
            "by commas",
            rule="config.invalid",
        ) from None
    return items


def _env_model(name: str, model: str, file_models: list[str], env_models: set[str]) -> str:
    """The ``[models.NAME]`` section an override of one model's key goes to.

    Variable names are upper case: ``GPT`` is the file's ``[models.gpt]``, or its
    ``[models.Gpt]`` when that is the only one of that name in any case. A model neither
    the file nor a ``..__PROVIDER`` variable defines is refused: the override alone made
    a section of provider ``script`` (a typo, ``GTP``, became a model of its own).
    """
    if model in file_models:
        return model
    alike = [known for known in file_models if known.lower() == model]
    if len(alike) == 1:
        return alike[0]
    if model in env_models or model == BUILT_IN_MODEL:
        return model
    defined = ", ".join(sorted({*file_models, BUILT_IN_MODEL}))
    raise ConfigError(
        f"environment variable {name} sets a key of model {model!r}, which the configuration "
        f"does not define (its models: {defined}): correct the name, or define the model in "
        f"the environment too with {ENV_PREFIX}MODELS__{model.upper()}__PROVIDER",
        rule="config.unknown_key",
    )


def _check_not_a_misspelt_override(name: str) -> None:
    """``LEADGATE_SERVER_PORT`` (one underscore) names a setting but is no override:
    refused, rather than silently leaving the setting as it was.

    Only a name whose double-underscore form is a real setting is refused. Others are
    not the configuration's (``LEADGATE_CONFIG``, ``LEADGATE_PASSWORD``, a client's
    ``LEADGATE_API_KEY`` or ``LEADGATE_SERVER``): refusing every name that began with a
    section stopped every command, and told to write ``LEADGATE_API__KEY``, no setting
    either. They are not warned about: set for other programs, they would warn always.
    """
    rest = name[len(ENV_PREFIX) :].lower()
    for section, field in Settings.model_fields.items():
        if not rest.startswith(section + "_"):
            continue
        key = rest[len(section) + 1 :]
        if section == "models":
            # LEADGATE_MODELS_GPT_API_KEY: the model's name is what precedes a key.
            known = [k for k in ModelSettings.model_fields if key.endswith("_" + k)]
            setting = max(known, key=len, default="")
            model = key[: -len(setting) - 1] if setting else ""
            if not model:
                return
            override = f"{section}__{model}__{setting}"
        elif _is_section(field.annotation) and key in field.annotation.model_fields:
            override = f"{section}__{key}"
        else:
            return
        raise ConfigError(
            f"environment variable {name} is not an override: write "
            f"{ENV_PREFIX}{override.upper()} (two underscores after the section"
            f"{' and after the model' if section == 'models' else ''})",
            rule="config.unknown_key",
        )


def load_settings(
    path: str | Path | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Read ``path`` (optional), apply environment overrides and validate.

    A relative SQLite path in ``database.url`` (the default ``./leadgate.db`` included)
    is made absolute against the folder of ``path``; without a file it stays relative to
    the current directory.

    Raises :class:`ConfigError` naming the offending key for unknown keys, wrong types,
    unreadable files and TOML syntax errors.
    """
    data: dict[str, Any] = {}
    if path is not None:
        if not str(path).strip():
            # `--config ""` is a mistake, not a wish for the built-in defaults.
            raise ConfigError("the config file name is empty", rule="config.file")
        try:
            with open(path, "rb") as fh:
                raw = fh.read(CONFIG_MAX_BYTES + 1)
            if len(raw) > CONFIG_MAX_BYTES:
                # `--config /dev/zero` (or a log file given by mistake) was read whole
                # into memory, until the process ran out of it.
                raise ConfigError(
                    f"config file {path} is larger than {CONFIG_MAX_BYTES // 1024:,} KiB: "
                    "is it the configuration?",
                    rule="config.file",
                )
            data = tomllib.loads(raw.decode("utf-8"))
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {path}: {exc.strerror}", rule="config.file"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid TOML: {exc}", rule="config.toml"
            ) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not UTF-8 (byte {exc.start}): TOML files are UTF-8",
                rule="config.encoding",
            ) from None
        _check_types(data)
    _apply_env(data, dict(os.environ if environ is None else environ))
    try:
        settings = Settings.model_validate(data)
    except PydanticValidationError as exc:
        errors = exc.errors()
        # An unknown key is config.unknown_key wherever it is written (an unknown section
        # in a variable always was; in the file, or a variable's key, it was config.invalid).
        unknown = all(err["type"] == "extra_forbidden" for err in errors)
        raise ConfigError(
            f"invalid configuration: {_problems(errors)}",
            rule="config.unknown_key" if unknown else "config.invalid",
        ) from exc
    if path is not None:
        url = _anchored_url(settings.database.url, Path(path).absolute().parent)
        settings.database = settings.database.model_copy(update={"url": url})
    return settings


def _anchored_url(url: str, folder: Path) -> str:
    """``url`` with a relative SQLite file path made absolute against ``folder``.

    The path followed the current directory: ``leadgate --config /srv/lg/config.toml``
    run from elsewhere found no database (``db upgrade`` made a second, empty one). Any
    other URL is returned as it is (``checked_url`` judges it).
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return url
    database = parsed.database
    if parsed.get_backend_name().lower() != "sqlite" or not database:
        return url
    if database == ":memory:" or database.startswith("file:") or os.path.isabs(database):
        return url
    anchored = os.path.normpath(folder / database)
    return parsed.set(database=anchored).render_as_string(hide_password=False)


def _check_types(data: dict[str, Any]) -> None:
    """A file's values must have their keys' types: TOML has them, so ``port = true`` or
    ``enabled = "yes"`` is a mistake to name, not a value to coerce (to port 1, and to a
    channel turned on). Environment variables are text, so they are coerced after."""
    try:
        Settings.model_validate(data, strict=True)
    except PydanticValidationError as exc:
        wrong = [err for err in exc.errors() if str(err["type"]).endswith("_type")]
        if wrong:
            raise ConfigError(
                f"invalid configuration: {_problems(wrong)}", rule="config.invalid"
            ) from None


def _problems(errors: Any) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in errors)
