"""schemathesis against the document the service publishes (``GET /openapi.json``).

Every documented operation (REST, agents, operator, console) is called with requests
schemathesis generates from the served document, valid and invalid (wrong types,
missing fields, odd strings), with the demo Owner key: no 5xx, no traceback in any
response, and a refused request (4xx) writes nothing. ``409`` from a chat completion is
a turn held for review (it was accepted), not a refusal. Both forms, the bounded one and
the long one (``-m long``), run on SQLite and on PostgreSQL.

(schemathesis' own pytest plugin does not run under this pytest version, so each
operation is driven through its hypothesis strategy, ``APIOperation.as_strategy``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from leadgate.web.openapi import OPERATIONS
from tests.fuzz.conftest import FUZZ_EXAMPLES, LONG_EXAMPLES, Fuzzed

# (An event stream never ends by itself: a call would wait out its timeout.)
LABELS = [f"{op.method.upper()} {op.path}" for op in OPERATIONS if not op.stream]
#: Event streams never end: documented, not fuzzed.
STREAMS = {f"{op.method.upper()} {op.path}" for op in OPERATIONS if op.stream}
SESSION = requests.Session()


@pytest.fixture(scope="module")
def api_schema(fuzz_service: Fuzzed) -> Any:
    # The document as the running service publishes it (not the module's own copy).
    return schemathesis.openapi.from_url(f"{fuzz_service.proc.url}/openapi.json")


def _is_refusal(case: Any, status: int) -> bool:
    if not 400 <= status < 500:
        return False
    return not (status == 409 and case.path == "/v1/chat/completions")


def fuzz_operation(fuzz_service: Fuzzed, api_schema: Any, label: str, count: int) -> int:
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
        GenerationMode.NEGATIVE
    )
    auth = {"Authorization": f"Bearer {fuzz_service.key}", "X-Leadgate-Console": "1"}
    statuses: list[int] = []

    @settings(
        max_examples=count,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        before = fuzz_service.quiet_fingerprint()
        headers = dict(auth)
        for name, value in (case.headers or {}).items():
            if name.lower() != "authorization":
                headers[name] = value
        response = case.call(
            base_url=fuzz_service.proc.url, session=SESSION, headers=headers, timeout=20
        )
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        assert "Traceback" not in response.text
        if _is_refusal(case, response.status_code):
            assert fuzz_service.fingerprint() == before, case.as_curl_command()

    run()
    return len(statuses)


@pytest.mark.parametrize("label", LABELS)
def test_no_5xx_no_traceback_no_write_on_refusal(
    each_backend: Fuzzed, api_schema: Any, label: str
) -> None:
    assert fuzz_operation(each_backend, api_schema, label, FUZZ_EXAMPLES) > 0


@pytest.mark.long
@pytest.mark.parametrize("label", LABELS)
def test_long_form(each_backend: Fuzzed, api_schema: Any, label: str) -> None:
    assert fuzz_operation(each_backend, api_schema, label, LONG_EXAMPLES) > 0


def test_every_route_is_documented(fuzz_service: Fuzzed, api_schema: Any) -> None:
    served = {f"{m.upper()} {p}" for p, ops in api_schema.raw_schema["paths"].items() for m in ops}
    assert served == set(LABELS) | STREAMS
    assert fuzz_service.log_problems() == []
