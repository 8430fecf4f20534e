"""Configuration (SPEC 12): TOML file, ``LEADGATE_<SECTION>__<KEY>`` overrides, errors that
name the offending key."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from leadgate.core.config import CONFIG_MAX_BYTES, Settings, load_settings
from leadgate.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "leadgate.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_a_file() -> None:
    settings = load_settings(None, environ={})
    assert settings.server.host == "127.0.0.1"
    assert settings.server.port == 8080
    assert settings.database.url == "sqlite+aiosqlite:///./leadgate.db"
    assert set(settings.models) == {"script"}
    assert settings.models["script"].provider == "script"


def test_toml_values_are_loaded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
host = "127.0.0.1"
port = 8123
public_url = "http://127.0.0.1:8123"

[database]
url = "sqlite+aiosqlite:///./other.db"

[slack]
signing_secret = "s3cret"

[email]
start_tls = true
smtp_port = 2525
""",
    )
    settings = load_settings(path, environ={})
    assert settings.server.port == 8123
    assert settings.server.public_url == "http://127.0.0.1:8123"
    assert settings.database.url == f"sqlite+aiosqlite:///{tmp_path}/other.db"  # the file's
    assert settings.slack.signing_secret == "s3cret"
    assert settings.email.start_tls is True
    assert settings.email.smtp_port == 2525
    # untouched sections keep their defaults
    assert settings.discord.public_key == ""


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("sqlite+aiosqlite:///./lg.db", "sqlite+aiosqlite:///{conf}/lg.db"),
        ("sqlite+aiosqlite:///data/lg.db", "sqlite+aiosqlite:///{conf}/data/lg.db"),
        ("sqlite+aiosqlite:///../lg.db", "sqlite+aiosqlite:///{top}/lg.db"),
        ("sqlite+aiosqlite:///./my%20lg.db", "sqlite+aiosqlite:///{conf}/my lg.db"),
        ("sqlite+aiosqlite:////srv/lg.db", "sqlite+aiosqlite:////srv/lg.db"),
        ("postgresql+asyncpg://u:pw@h/db", "postgresql+asyncpg://u:pw@h/db"),
        ("sqlite+aiosqlite://", "sqlite+aiosqlite://"),  # refused later, by checked_url
        (None, "sqlite+aiosqlite:///{conf}/leadgate.db"),  # the default, from a file
    ],
)
def test_a_relative_sqlite_path_in_a_config_file_is_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str | None, expected: str
) -> None:
    # It followed the current directory: `--config /srv/lg/config.toml` run from
    # elsewhere found no database, and `db upgrade` made a second one, empty.
    conf = tmp_path / "conf"
    conf.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = conf / "config.toml"
    path.write_text("" if written is None else f'[database]\nurl = "{written}"\n')
    want = expected.format(conf=conf, top=tmp_path)
    # The same whatever the current directory and however the file is named.
    assert load_settings(path, environ={}).database.url == want
    assert load_settings("../conf/config.toml", environ={}).database.url == want
    if written is not None:  # an override's path too: with a file, the file's folder
        other = conf / "other.toml"
        other.write_text('[log]\nlevel = "INFO"\n')
        environ = {"LEADGATE_DATABASE__URL": written}
        assert load_settings(other, environ=environ).database.url == want


def test_a_relative_sqlite_path_without_a_config_file_is_relative_to_the_current_dir() -> None:
    assert load_settings(None, environ={}).database.url == "sqlite+aiosqlite:///./leadgate.db"
    environ = {"LEADGATE_DATABASE__URL": "sqlite+aiosqlite:///lg.db"}
    assert load_settings(None, environ=environ).database.url == "sqlite+aiosqlite:///lg.db"


def test_config_example_toml_is_valid() -> None:
    settings = load_settings(REPO / "config.example.toml", environ={})
    assert "script" in settings.models
    assert settings.models["script"].provider == "script"


def test_config_example_toml_documents_every_key() -> None:
    """SPEC 12: every configuration key is documented in ``config.example.toml`` (a key
    added to a section without its line there fails here)."""
    with (REPO / "config.example.toml").open("rb") as f:
        example = tomllib.load(f)
    missing = [
        f"[{section}] {key}"
        for section, field in Settings.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        for key in field.annotation.model_fields
        if key not in example.get(section, {})
    ]
    assert missing == []


def test_env_override_wins_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 8123\n")
    settings = load_settings(path, environ={"LEADGATE_SERVER__PORT": "9000"})
    assert settings.server.port == 9000
    assert isinstance(settings.server.port, int)


def test_env_override_without_a_file_and_for_booleans() -> None:
    settings = load_settings(
        None,
        environ={
            "LEADGATE_SERVER__PORT": "9000",
            "LEADGATE_EMAIL__START_TLS": "true",
            "LEADGATE_DATABASE__URL": "postgresql+asyncpg://u@127.0.0.1/db",
        },
    )
    assert settings.server.port == 9000
    assert settings.email.start_tls is True
    assert settings.database.url == "postgresql+asyncpg://u@127.0.0.1/db"


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("LEADGATE_SERVER_PORT", "LEADGATE_SERVER__PORT"),
        ("LEADGATE_LOG_LEVEL", "LEADGATE_LOG__LEVEL"),
        ("LEADGATE_DATABASE_URL", "LEADGATE_DATABASE__URL"),
        ("LEADGATE_API_EVENTS_REAUTH_S", "LEADGATE_API__EVENTS_REAUTH_S"),
        ("LEADGATE_MODELS_GPT_API_KEY", "LEADGATE_MODELS__GPT__API_KEY"),
    ],
)
def test_an_override_with_one_underscore_is_refused_not_ignored(name: str, write: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ={name: "1"})
    assert info.value.rule == "config.unknown_key"
    assert f"is not an override: write {write} (two underscores" in info.value.message


@pytest.mark.parametrize(
    "name", ["LEADGATE_API_KEY", "LEADGATE_API", "LEADGATE_SERVER", "LEADGATE_SERVER_URL"]
)
def test_a_variable_that_names_no_setting_in_any_form_is_not_read(name: str) -> None:
    # LEADGATE_API_KEY (a client's key) stopped every command, told to write
    # LEADGATE_API__KEY: no setting either.
    assert load_settings(None, environ={name: "lg_live_x"}) == Settings()


def test_env_variables_that_are_not_overrides_are_ignored() -> None:
    # LEADGATE_CONFIG / LEADGATE_PASSWORD are read by the CLI, not section overrides;
    # other programs' variables are none of our business.
    settings = load_settings(
        None,
        environ={
            "LEADGATE_CONFIG": "/nonexistent.toml",
            "LEADGATE_PASSWORD": "hunter22",
            "PATH": "/usr/bin",
            "OTHER__THING": "x",
        },
    )
    assert settings == Settings()


def test_unknown_key_in_toml_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 8080\nbogus_key = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "server.bogus_key" in info.value.message
    assert info.value.rule == "config.unknown_key"


def test_unknown_section_in_toml_names_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[nonsense]\nx = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "nonsense" in info.value.message
    assert info.value.rule == "config.unknown_key"


def test_unknown_key_in_env_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"LEADGATE_SERVER__BOGUS_KEY": "1"})
    assert "server.bogus_key" in info.value.message
    assert info.value.rule == "config.unknown_key"


def test_unknown_section_in_env_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"LEADGATE_NOPE__PORT": "1"})
    assert "LEADGATE_NOPE__PORT" in info.value.message
    assert info.value.rule == "config.unknown_key"


def test_env_override_below_a_plain_value_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhost = "127.0.0.1"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={"LEADGATE_SERVER__HOST__X": "1"})
    assert "LEADGATE_SERVER__HOST__X" in info.value.message


def test_wrong_type_in_toml_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nport = "not a number"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "server.port" in info.value.message


@pytest.mark.parametrize(
    ("toml", "where"),
    [
        ("[server]\nport = true\n", "server.port"),  # was port 1
        ('[teams]\nenabled = "yes"\n', "teams.enabled"),  # was Teams on
        ('[server]\nmax_connections = "100"\n', "server.max_connections"),
        ("[database]\npool_size = 2.0\n", "database.pool_size"),
    ],
)
def test_a_file_value_of_the_wrong_type_is_not_coerced(
    tmp_path: Path, toml: str, where: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml), environ={})
    assert info.value.rule == "config.invalid" and where in info.value.message
    # An integer where a number with a fraction is asked for is still a number.
    settings = load_settings(write(tmp_path, "[runners]\npoll_interval_s = 2\n"), environ={})
    assert settings.runners.poll_interval_s == 2.0


def test_wrong_type_in_env_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"LEADGATE_SERVER__PORT": "eighty"})
    assert "server.port" in info.value.message


def test_out_of_range_value_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 70000\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "server.port" in info.value.message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[runners]\npoll_interval_s = inf\n", "runners.poll_interval_s: Input should be a finite"),
        ("[server]\nbody_timeout_s = inf\n", "server.body_timeout_s: Input should be a finite"),
        ("[runners]\ndead_after_s = inf\n", "runners.dead_after_s: Input should be a finite"),
        ("[api]\nmcp_session_idle_s = nan\n", "api.mcp_session_idle_s: Input should be a finite"),
        (
            "[runners]\nheartbeat_s = 60.0\ndead_after_s = 30.0\n",
            "dead_after_s (30 s) must be at least twice heartbeat_s (60 s)",
        ),
        ("[runners]\nheartbeat_s = 20.0\n", "dead_after_s (30 s) must be at least twice"),
    ],
)
def test_an_infinite_duration_or_a_process_dead_between_its_beats_is_refused(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), environ={})
    assert says in info.value.message and info.value.rule == "config.invalid"
    with pytest.raises(ConfigError):  # from the environment too
        load_settings(None, environ={"LEADGATE_RUNNERS__POLL_INTERVAL_S": "inf"})
    assert load_settings(write(tmp_path, "[runners]\nheartbeat_s = 15.0\n"), environ={})


def test_a_metrics_token_that_no_bearer_header_could_carry_is_refused() -> None:
    # A bearer token is read as printable ASCII without blanks (decoding.bearer_token).
    for token in ("two words", "caf\u00e9"):
        with pytest.raises(ConfigError) as info:
            load_settings(None, environ={"LEADGATE_SERVER__METRICS_TOKEN": token})
        assert "server.metrics_token" in info.value.message
    assert load_settings(None, environ={"LEADGATE_SERVER__METRICS_TOKEN": "m-Secret_1"})


def test_section_given_as_a_scalar_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, 'server = "127.0.0.1"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "server" in info.value.message


def test_bad_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nport = = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "not valid TOML" in info.value.message
    assert str(path) in info.value.message
    assert info.value.rule == "config.toml"


def test_a_file_that_is_not_utf8_or_an_empty_name_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[server]\nhost = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert info.value.message == f"config file {path} is not UTF-8 (byte 20): TOML files are UTF-8"
    assert info.value.rule == "config.encoding"
    with pytest.raises(ConfigError) as empty:  # `--config ""`: not the built-in defaults
        load_settings("", environ={})
    assert empty.value.message == "the config file name is empty"
    assert empty.value.rule == "config.file"


def test_a_config_file_is_read_up_to_its_bound(tmp_path: Path) -> None:
    """``--config /dev/zero`` (or a large file given by mistake) was read whole into
    memory; a pipe (``--config <(...)``) is still read."""
    with pytest.raises(ConfigError) as info:
        load_settings("/dev/zero", environ={})
    assert info.value.rule == "config.file" and "larger than 1,024 KiB" in info.value.message
    padded = "# padding\n" * (CONFIG_MAX_BYTES // 10 - 10) + "[server]\nport = 9\n"
    assert load_settings(write(tmp_path, padded), environ={}).server.port == 9
    read, written = os.pipe()
    os.write(written, b"[server]\nport = 7\n")
    os.close(written)
    assert load_settings(f"/dev/fd/{read}", environ={}).server.port == 7
    os.close(read)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(missing, environ={})
    assert str(missing) in info.value.message
    assert info.value.rule == "config.file"


def test_models_sections_are_dynamic(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[models.script]
provider = "script"

[models.gpt]
provider = "openai"
base_url = "http://127.0.0.1:9999/v1"
api_key = "from-file"
model = "gpt-4o-mini"
timeout_s = 5.5
""",
    )
    settings = load_settings(path, environ={"LEADGATE_MODELS__GPT__API_KEY": "from-env"})
    assert set(settings.models) == {"script", "gpt"}
    gpt = settings.models["gpt"]
    assert gpt.provider == "openai"
    assert gpt.base_url == "http://127.0.0.1:9999/v1"
    assert gpt.model == "gpt-4o-mini"
    assert gpt.timeout_s == 5.5
    assert gpt.api_key == "from-env"


def test_a_models_section_keeps_the_built_in_script_model(tmp_path: Path) -> None:
    # The default held only while `models` was absent: one [models.gpt] removed `script`.
    path = write(tmp_path, '[models.gpt]\nprovider = "openai"\nmodel = "gpt-4o-mini"\n')
    settings = load_settings(path, environ={})
    assert set(settings.models) == {"script", "gpt"}
    assert settings.models["script"].provider == "script"
    # A file's own [models.script] is the one used.
    path = write(tmp_path, '[models.script]\nprovider = "script"\ntimeout_s = 7.0\n')
    assert load_settings(path, environ={}).models["script"].timeout_s == 7.0


def test_models_section_can_come_from_env_alone() -> None:
    settings = load_settings(
        None,
        environ={
            "LEADGATE_MODELS__LOCAL__PROVIDER": "openai",
            "LEADGATE_MODELS__LOCAL__MODEL": "m",
        },
    )
    assert settings.models["local"].provider == "openai"
    assert settings.models["local"].model == "m"
    assert set(settings.models) == {"script", "local"}


def test_models_section_unknown_key_and_bad_provider(tmp_path: Path) -> None:
    path = write(tmp_path, '[models.gpt]\nprovider = "openai"\ntemperature = 0.2\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "models.gpt.temperature" in info.value.message

    path = write(tmp_path, '[models.gpt]\nprovider = "anthropic-direct"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "models.gpt.provider" in info.value.message


def test_an_openai_model_without_a_model_name_is_a_config_error(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[models.gpt]\nprovider = "openai"\nbase_url = "http://127.0.0.1:1/v1"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert info.value.rule == "config.invalid"
    assert "models.gpt" in info.value.message and "`model`" in info.value.message


@pytest.mark.parametrize(
    "environ",
    [
        {"LEADGATE_MODELS__GPT__API_KEY": "sk-1"},  # no [models.gpt]: no model of provider script
        {"LEADGATE_MODELS__GTP__API_KEY": "sk-1", "LEADGATE_MODELS__GPT__PROVIDER": "openai"},
    ],
)
def test_an_override_of_a_model_no_one_defines_is_refused(
    tmp_path: Path, environ: dict[str, str]
) -> None:
    # It made a [models.gpt] (or, misspelt, [models.gtp]) of provider `script` by itself.
    for path in (None, write(tmp_path, '[models.other]\nprovider = "script"\n')):
        with pytest.raises(ConfigError) as info:
            load_settings(path, environ={**environ, "LEADGATE_MODELS__GPT__MODEL": "m"})
        assert info.value.rule == "config.unknown_key"
        name = next(iter(environ))
        model = name.split("__")[1]
        assert f"environment variable {name} sets a key of model {model.lower()!r}" in (
            info.value.message
        )
        assert f"LEADGATE_MODELS__{model}__PROVIDER" in info.value.message


def test_an_override_of_a_model_of_the_file_or_the_environment_or_script_applies(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, '[models.Gpt]\nprovider = "openai"\nmodel = "m"\n')
    settings = load_settings(
        path,
        environ={
            "LEADGATE_MODELS__GPT__API_KEY": "sk-file",  # the file's [models.Gpt], any case
            "LEADGATE_MODELS__LOCAL__PROVIDER": "openai",
            "LEADGATE_MODELS__LOCAL__MODEL": "llama",
            "LEADGATE_MODELS__SCRIPT__TIMEOUT_S": "5",  # the built-in one
        },
    )
    assert set(settings.models) == {"Gpt", "local", "script"}
    assert settings.models["Gpt"].api_key == "sk-file"
    assert settings.models["local"].model == "llama"
    assert settings.models["script"].timeout_s == 5.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1", ["127.0.0.1"]),
        ("127.0.0.1, 10.0.0.0/8,", ["127.0.0.1", "10.0.0.0/8"]),
        ('["127.0.0.1", "::1"]', ["127.0.0.1", "::1"]),
        ("", []),
        ("[]", []),
    ],
)
def test_a_list_setting_is_read_from_a_json_array_or_commas(
    tmp_path: Path, value: str, expected: list[str]
) -> None:
    # Both forms were "should be a valid list": a list could not be set from the environment.
    path = write(tmp_path, '[server]\ntrusted_proxies = ["192.0.2.1"]\n')
    environ = {"LEADGATE_SERVER__TRUSTED_PROXIES": value, "LEADGATE_SLACK__BOT_TOKEN": "a,b"}
    settings = load_settings(path, environ=environ)
    assert settings.server.trusted_proxies == expected
    assert settings.slack.bot_token == "a,b"  # only list settings are split


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('["127.0.0.1",', "LEADGATE_SERVER__TRUSTED_PROXIES is not a JSON array"),
        ("127.0.0.1, proxy", "server.trusted_proxies: Value error, 'proxy' is not an IP"),
        ("[1]", "server.trusted_proxies.0: Input should be a valid string"),
    ],
)
def test_a_list_setting_from_the_environment_is_still_checked(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"LEADGATE_SERVER__TRUSTED_PROXIES": value})
    assert info.value.rule == "config.invalid"
    assert says in info.value.message


def test_a_review_timer_of_zero_in_any_unit_is_off(tmp_path: Path) -> None:
    # "0" was off and "0s" refused ("between 1s and 366d"): both are off now.
    path = write(tmp_path, '[review]\nremind_after = "0s"\nexpire_after = "0"\n')
    review = load_settings(path, environ={"LEADGATE_REVIEW__ESCALATE_AFTER": "0m"}).review
    assert review.ms("remind_after") is None and review.ms("expire_after") is None
    assert review.ms("escalate_after") is None
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, '[review]\nremind_after = "400d"\n'), environ={})
    assert info.value.rule == "config.invalid"
    assert "review.remind_after: Value error" in info.value.message
    assert "between 1s and 366d, or off (or 0)" in info.value.message


@pytest.mark.parametrize(
    "value",
    ["review", "review+cards@example.com", "review@localhost", "a b@example.com", "<r@x.io>"],
)
def test_review_reply_address_must_be_one_plain_address(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f'[email]\nreview_reply_address = "{value}"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert "review_reply_address" in info.value.message


def test_review_reply_address_is_read_in_lower_case(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[email]\nreview_reply_address = " Review@Reviews.Example.com "\n'
        'from_address = "leadgate@example.com"\n',
    )
    assert (
        load_settings(path, environ={}).email.review_reply_address == "review@reviews.example.com"
    )


def test_answerable_email_cards_need_a_from_address(tmp_path: Path) -> None:
    """Card mails and the answers to replies have no routed address to be sent from:
    without ``from_address`` each one failed for good at its send, and the file loaded
    without a word. A file or a variable that sets the reply address needs it."""
    reply = 'review_reply_address = "review@reviews.example.com"\n'
    for contents, environ in (
        (f"[email]\n{reply}", {}),
        (f'[email]\n{reply}from_address = " "\n', {}),
        ("", {"LEADGATE_EMAIL__REVIEW_REPLY_ADDRESS": "review@reviews.example.com"}),
    ):
        with pytest.raises(ConfigError) as info:
            load_settings(write(tmp_path, contents), environ=environ)
        says = info.value.message
        assert info.value.rule == "config.invalid"
        assert "email: Value error, review_reply_address needs from_address" in says
    loaded = load_settings(
        write(tmp_path, f"[email]\n{reply}"),
        environ={"LEADGATE_EMAIL__FROM_ADDRESS": "Leadgate <leadgate@example.com>"},
    )
    assert loaded.email.from_address == "Leadgate <leadgate@example.com>"
    # Without the reply address it is optional (a reply goes from the address written to).
    assert load_settings(write(tmp_path, '[email]\nsmtp_host = "relay"\n'), environ={})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("ftp://127.0.0.1/api/v10", "not a URL starting with http:// or https://"),
        ("127.0.0.1:8080/api/v10", "not a URL starting with http:// or https://"),
        ("http://127.0.0.1:99999/api/v10", "Port out of range"),
        ("https:///api/v10", "has no host"),
        ("https://bot:secret@discord.example/api/v10", "carries a user or password"),
        ("https://discord.example/api/v10?x=1", "has a query, a fragment or a brace"),
        # A query's token is not quoted back, whichever rule the URL breaks.
        ("https://discord.example/api?token=secret", "'https://discord.example/api...' has a"),
        ("ftp://discord.example/api?token=secret", "not a URL starting with http:// or https://"),
        ("https://discord.example/api v10?token=secret", "is not a URL"),
        ("https://discord.example/api/v10#top", "has a query, a fragment or a brace"),
        ("https://discord.example/{api}", "has a query, a fragment or a brace"),
        ("", "is not a URL"),
        ("https://discord.example/api v10", "is not a URL"),
        ("https://bot:secret@discord.example/api v10", "is not a URL"),
        ("ftp://bot:secret@discord.example/api", "not a URL starting with http:// or https://"),
    ],
)
@pytest.mark.parametrize("section", ["discord", "slack"])
def test_a_channel_api_url_its_sdk_cannot_use_is_refused_at_load(
    tmp_path: Path, section: str, value: str, says: str
) -> None:
    """``[discord] api_url`` (and ``[slack] api_url``, through the same check) must be a
    plain http(s) base: before, a wrong one loaded and each delivery failed on it."""
    for source in ("file", "env"):
        with pytest.raises(ConfigError) as info:
            if source == "file":
                load_settings(write(tmp_path, f'[{section}]\napi_url = "{value}"\n'), environ={})
            else:
                load_settings(environ={f"LEADGATE_{section.upper()}__API_URL": value})
        assert info.value.rule == "config.invalid"
        assert f"{section}.api_url: Value error" in info.value.message
        assert says in info.value.message
        assert "secret" not in info.value.message


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("ftp://gateway.example/", "not a URL starting with ws://, wss://, http:// or https://"),
        ("wss:///", "has no host"),
        ("wss://bot:secret@gateway.example/", "carries a user or password"),
        ("wss://gateway.example/?v=10", "discord.py sets the query itself"),
        ("wss://gateway.example/?token=secret", "'wss://gateway.example/...' has a query"),
        (" ", "is not a URL"),
    ],
)
def test_a_discord_gateway_url_it_cannot_use_is_refused_at_load(value: str, says: str) -> None:
    """Before, such a ``[discord] gateway_url`` loaded and the gateway never connected."""
    with pytest.raises(ConfigError) as info:
        load_settings(environ={"LEADGATE_DISCORD__GATEWAY_URL": value})
    assert "discord.gateway_url: Value error" in info.value.message
    assert says in info.value.message
    assert "secret" not in info.value.message


@pytest.mark.parametrize(
    "value", ["", "wss://gateway.discord.gg/", "ws://127.0.0.1:8765", "https://gateway.example/"]
)
def test_an_empty_or_plain_ws_gateway_url_loads(value: str) -> None:
    settings = load_settings(environ={"LEADGATE_DISCORD__GATEWAY_URL": value})
    assert settings.discord.gateway_url == value


@pytest.mark.parametrize(
    "value", ["https://discord.com/api/v10", "http://127.0.0.1:8080/api/v10/", "http://[::1]:80"]
)
def test_a_plain_http_api_url_loads(value: str) -> None:
    settings = load_settings(
        environ={"LEADGATE_DISCORD__API_URL": value, "LEADGATE_SLACK__API_URL": value}
    )
    assert settings.discord.api_url == settings.slack.api_url == value
