"""StreamSlots: the per-process bound on open event streams (session events, the operator
feed), counted from the check itself; Inflight's shedding (counted, logged now and then)."""

from __future__ import annotations

import json
import logging

import pytest
from aiohttp.test_utils import make_mocked_request

from leadgate.core.errors import Unavailable
from leadgate.core.metrics import METRICS
from leadgate.web.common import Inflight, StreamSlots


def test_a_slot_is_held_for_the_block_and_given_back_however_it_ends() -> None:
    slots = StreamSlots(2)
    with slots.take(), slots.take():
        assert slots.taken == 2
        with pytest.raises(Unavailable) as refused, slots.take():
            pass
        assert (refused.value.status, refused.value.rule) == (503, "events.limit")
        assert refused.value.retry_after_s == 5
        assert slots.taken == 2  # a refusal takes nothing
    assert slots.taken == 0
    with pytest.raises(ConnectionResetError), slots.take():
        raise ConnectionResetError
    assert slots.taken == 0


def test_shed_requests_are_counted_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [100.0]
    draws = iter([0.0, 0.25, 0.9995, 0.5])
    inflight = Inflight(2, now=lambda: clock[0], jitter=lambda: next(draws))
    shed_before = METRICS.unavailable.labels("server.busy")._value.get()
    caplog.set_level(logging.WARNING, logger="leadgate.web")
    answers = []
    for path in ("/v1/chat/completions", "/mcp", "/v1/agents"):
        answers.append(inflight.refuse(make_mocked_request("POST", path)))
    clock[0] += 10.0
    answers.append(inflight.refuse(make_mocked_request("GET", "/v1/models")))
    # The waits asked for are spread over 1-3 s, so refused clients do not all return
    # at once: whole seconds in Retry-After, exact in retry-after-ms (OpenAI's clients).
    assert [(a.status, a.headers["Retry-After"], a.headers["retry-after-ms"]) for a in answers] == [
        (503, "1", "1000"),
        (503, "2", "1500"),
        (503, "3", "2999"),
        (503, "2", "2000"),
    ]
    assert json.loads(answers[0].text or "")["error"]["rule"] == "server.busy"
    assert inflight.shed == 4
    assert METRICS.unavailable.labels("server.busy")._value.get() == shed_before + 4
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "1 request(s) shed with 503 [server.busy] at [server] max_inflight = 2"
        " (the latest: POST /v1/chat/completions)",
        "3 request(s) shed with 503 [server.busy] at [server] max_inflight = 2"
        " (the latest: GET /v1/models)",
    ]
