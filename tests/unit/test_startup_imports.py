"""A service loads only the SDKs its configuration uses.

Importing every platform SDK and the openai client took the service's import from
117 MB to 162 MB and about a third of its startup (``python -X importtime``). Each
case builds the ``App`` in a fresh interpreter (this test process has imported
everything already) and lists which of those modules it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Module -> what loads it: a channel section turned on, a model of the openai kind,
#: or the console's first chart.
OPTIONAL = ("slack_bolt", "discord", "botbuilder.core", "aiosmtpd", "openai", "pygal")

_PROBE = """
import json, sys
from leadgate.app import App
from leadgate.core.config import Settings
settings = Settings.model_validate(json.loads(sys.argv[1]))
App(settings, enable_adapters=True)
if sys.argv[2] == "chart":
    from leadgate.web import charts
    charts.render("rounds", {"roundsUsed": []})
print(json.dumps([m for m in json.loads(sys.argv[3]) if m in sys.modules]))
"""


def loaded(tmp_path: Path, config: dict[str, Any], chart: bool = False) -> set[str]:
    settings = {"database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"}, **config}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            json.dumps(settings),
            "chart" if chart else "-",
            json.dumps(OPTIONAL),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_a_service_with_no_channel_and_script_models_loads_none_of_them(
    tmp_path: Path,
) -> None:
    config = {"models": {"script": {"provider": "script"}}}
    assert loaded(tmp_path, config) == set()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"slack": {"signing_secret": "s", "bot_token": "xoxb-1"}}, {"slack_bolt"}),
        ({"discord": {"public_key": "ab" * 32}}, {"discord"}),
        ({"teams": {"enabled": True}}, {"botbuilder.core"}),
        ({"email": {"smtp_host": "127.0.0.1"}}, {"aiosmtpd"}),
        (
            {
                "models": {
                    "gpt": {"provider": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1"}
                }
            },
            {"openai"},
        ),
    ],
    ids=["slack", "discord", "teams", "email", "openai-model"],
)
def test_a_channel_or_model_loads_its_own_sdk_only(
    tmp_path: Path, config: dict[str, Any], expected: set[str]
) -> None:
    assert loaded(tmp_path, config) == expected


def test_the_first_chart_loads_pygal(tmp_path: Path) -> None:
    assert loaded(tmp_path, {}, chart=True) == {"pygal"}
