"""The one decoding path: every bad body is a 400 naming its rule, never a crash; the
body-size limit and the body timeout; client text headers; the login guard's counting;
a 503's log line."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from leadgate.core.bodies import BODY_TIMEOUT_KEY
from leadgate.core.clock import FakeClock
from leadgate.core.decoding import (
    INT64_MAX,
    MAX_DEPTH,
    bearer_token,
    check_value,
    decimal_int,
    decode_json,
    header_text,
    json_object,
    refuse_unknown_fields,
)
from leadgate.core.errors import RateLimited, Unavailable, ValidationError
from leadgate.core.metrics import METRICS
from leadgate.operations.agents import changes_from_body
from leadgate.operations.logins import LoginGuard
from leadgate.web.common import (
    UNAVAILABLE_ANSWERS,
    UnavailableAnswers,
    error_middleware,
    json_body,
)

BAD_BODIES = [
    (b"\xff\xfe", "body.utf8"),
    (b'"\xed\xa0\x80"', "body.utf8"),  # an encoded surrogate is not UTF-8
    (b"{", "body.json"),
    (b"NaN", "body.json"),
    (b'{"a": Infinity}', "body.json"),
    (b'{"a": 1e999}', "body.number"),  # an infinity, which JSON cannot write back
    (b"[-1.5e400]", "body.number"),
    (b"1" * 5000, "body.json"),  # past Python's int digit limit
    (b"[" * 2000 + b"]" * 2000, "body.depth"),  # RecursionError in json
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "body.depth"),
    (b'{"a": "x\\ud800"}', "body.surrogate"),
    (b'{"\\udfff": 1}', "body.surrogate"),
    (b'{"a": "x\\u0000y"}', "body.nul"),
    (b'{"a\\u0000": 1}', "body.nul"),
]


@pytest.mark.parametrize(("raw", "rule"), BAD_BODIES)
def test_bad_bodies_are_400s_naming_the_rule(raw: bytes, rule: str) -> None:
    with pytest.raises(ValidationError) as info:
        decode_json(raw)
    assert info.value.status == 400
    assert info.value.rule == rule


def test_the_limits_themselves_are_fine() -> None:
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert decode_json(deep) is not None
    assert decode_json('{"a": "é \\u00e9 😀"}') == {"a": "é é 😀"}
    # Channels keep a NUL inside text (the message rule answers it with a notice) ...
    assert decode_json(b'{"text": "a\\u0000b"}', allow_nul=True) == {"text": "a\x00b"}
    # ... but never a lone surrogate, which cannot be stored at all.
    with pytest.raises(ValidationError):
        decode_json(b'{"text": "a\\ud800"}', allow_nul=True)
    with pytest.raises(ValidationError) as info:
        json_object(b"[1, 2]")
    assert info.value.rule == "body.object"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_decode_json_only_ever_raises_validation_errors(raw: bytes) -> None:
    try:
        value = decode_json(raw)
    except ValidationError as exc:
        assert exc.rule.startswith("body.")
        return
    # What passes is re-encodable as strict UTF-8 (storable anywhere).
    json.dumps(value, ensure_ascii=False).encode("utf-8")


deep_values = st.recursive(
    st.text(alphabet=st.sampled_from("ab\x00\ud800\udfff{[\\u")),
    lambda children: (
        st.lists(children, max_size=2) | st.dictionaries(st.text(max_size=2), children)
    ),
    max_leaves=MAX_DEPTH + 8,
)


@settings(max_examples=300, deadline=None)
@given(deep_values, st.booleans(), st.booleans())
def test_a_body_is_refused_exactly_when_its_full_walk_refuses_it(
    value: Any, ascii_only: bool, allow_nul: bool
) -> None:
    """decode_json skips the walk of a body from bytes with no \\u escape and no more
    brackets than MAX_DEPTH; the answer is the walk's all the same."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate only travels as an escape
    try:
        check_value(json.loads(text), allow_nul=allow_nul)
        walked: str | None = None
    except ValidationError as exc:
        walked = exc.rule
    try:
        decode_json(raw, allow_nul=allow_nul)
        decoded: str | None = None
    except ValidationError as exc:
        decoded = exc.rule
    assert decoded == walked


async def _client(app: web.Application) -> TestClient[Any, Any]:
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_size_limit_and_body_timeout_through_the_http_path() -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await json_body(request))

    app = web.Application(middlewares=[error_middleware], client_max_size=1024)
    app[BODY_TIMEOUT_KEY] = 0.3
    app.router.add_post("/echo", echo)
    client = await _client(app)
    try:
        ok = await client.post("/echo", json={"a": 1})
        assert ok.status == 200
        big = await client.post("/echo", data=b"x" * 4096)
        assert big.status == 413
        assert (await big.json())["error"]["rule"] == "body.size"
        deep = await client.post("/echo", data=b"[" * 900 + b"]" * 900)
        assert deep.status in (400, 413)

        async def slow() -> Any:
            yield b'{"a":'
            await asyncio.sleep(1.0)
            yield b"1}"

        late = await client.post("/echo", data=slow())
        assert late.status == 408
        assert "Traceback" not in await late.text()
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("Basic dXNlcjpwdw==", None),
        ("Bearer", None),
        ("Bearer    ", None),
        ("Bearer lg.id.secret", "lg.id.secret"),
        ("bearer  lg.id.secret ", "lg.id.secret"),
        # Not ASCII (bytes that are not UTF-8 arrive as surrogate escapes, refused the same
        # way: tests/reliability/test_channel_inputs.py sends them to every surface).
        ("Bearer caf\u00e9", None),
        ("Bearer a\x7fb", None),
    ],
)
def test_a_bearer_token_is_printable_ascii_or_none(header: str | None, token: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    assert bearer_token(make_mocked_request("GET", "/", headers=headers)) == token


def test_two_authorization_headers_are_no_token() -> None:
    # Which one was meant is anybody's guess (a proxy's and the client's): a 401.
    headers = CIMultiDict([("Authorization", "Bearer lg.a.b"), ("Authorization", "Bearer lg.c.d")])
    assert bearer_token(make_mocked_request("GET", "/", headers=headers)) is None


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("0", 0),
        ("0042", 42),
        (str(INT64_MAX), INT64_MAX),
        (str(INT64_MAX + 1), None),  # no database column holds it
        ("9" * 5000, None),  # past int()'s digit limit: refused before int() sees it
        ("\u00b2", None),  # "²": str.isdigit says yes, int() raises
        ("\u0661", None),  # Arabic-Indic one: int() would take it
        ("-1", None),
        ("+1", None),
        (" 1", None),
        ("1.0", None),
        ("", None),
    ],
)
def test_a_client_number_is_ascii_digits_within_64_bits(raw: str, value: int | None) -> None:
    assert decimal_int(raw) == value


@given(st.text(max_size=25) | st.integers(min_value=-(2**80), max_value=2**80).map(str))
def test_decimal_int_never_raises(raw: str) -> None:
    value = decimal_int(raw)
    assert value is None or (0 <= value <= INT64_MAX and int(raw) == value)


async def test_client_text_headers_are_printable_ascii() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(header_text(request, "X-Session-Id"))
        return web.json_response({})

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/h", handler)
    client = await _client(app)
    try:
        assert (await client.get("/h", headers={"X-Session-Id": "abc-1"})).status == 200
        bad = await client.get(
            "/h", headers={"X-Session-Id": "caf\u00e9".encode().decode("latin-1")}
        )
        assert bad.status == 400
        assert (await bad.json())["error"]["rule"] == "header.x-session-id"
    finally:
        await client.close()
    assert seen == ["abc-1"]


async def test_login_guard_counts_before_the_check_and_says_when() -> None:
    clock = FakeClock()
    guard = LoginGuard(clock, limit=3, window_ms=60_000)
    tickets = [guard.admit("10.0.0.1", "ann@example.com") for _ in range(3)]
    # In-flight attempts count: the 4th is refused before any password was checked.
    with pytest.raises(RateLimited) as info:
        guard.admit("10.0.0.1", "ann@example.com")
    assert info.value.retry_after_s == 60
    # Per account too, from another address; and the wait shrinks with time.
    clock.advance(20_000)
    with pytest.raises(RateLimited) as info:
        guard.admit("10.9.9.9", "ANN@example.com ")
    assert info.value.retry_after_s == 40
    # A success gives its slot back.
    guard.succeeded(tickets[0])
    guard.admit("10.0.0.1", "ann@example.com")
    clock.advance(40_001)
    guard.admit("10.0.0.1", "ann@example.com")


async def test_password_check_slots_are_bounded() -> None:
    guard = LoginGuard(FakeClock(), slots=1, queue=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with guard.check_slot():
            await release.wait()

    first = asyncio.create_task(hold())
    second = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    with pytest.raises(Unavailable):
        async with guard.check_slot():
            pass
    release.set()
    await asyncio.gather(first, second)


async def test_a_503_is_spread_counted_and_logged_per_rule_every_10_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every 503, whatever its rule: the wait it names is the rule's own plus up to 2 s
    drawn at random (whole seconds in Retry-After, exact in retry-after-ms, which the
    OpenAI clients read first), so refused clients do not all come back at once; one
    WARNING per rule every 10 s with their count, the latest request and what the
    database said, which the client is never told (nor are the statement's parameters
    logged); never an ERROR."""
    clock = [50.0]
    draws = iter([0.0, 0.25, 0.9995, 0.5, 0.0])

    async def locked(request: web.Request) -> web.Response:
        # SQLAlchemy's text of it carries the statement and its parameters (what a client
        # sent): the log gets what SQLite said, nothing more.
        raise sa.exc.OperationalError(
            "INSERT INTO messages (content) VALUES (?)",
            ("a secret message",),
            sqlite3.OperationalError("database is locked"),
        )

    async def busy(request: web.Request) -> web.Response:
        raise Unavailable("too many live event streams", rule="events.limit", retry_after_s=5)

    app = web.Application(middlewares=[error_middleware])
    app[UNAVAILABLE_ANSWERS] = UnavailableAnswers(now=lambda: clock[0], jitter=lambda: next(draws))
    app.router.add_post("/locked", locked)
    app.router.add_get("/busy", busy)
    client = await _client(app)
    caplog.set_level(logging.INFO, logger="leadgate.web")
    before = METRICS.unavailable.labels("service.unavailable")._value.get()
    answers = []
    try:
        for _ in range(3):
            answers.append(await client.post("/locked"))
        answers.append(await client.get("/busy"))
        clock[0] += 10.0
        answers.append(await client.post("/locked"))
        bodies = [await a.json() for a in answers]
    finally:
        await client.close()
    assert [(a.status, a.headers["Retry-After"], a.headers["retry-after-ms"]) for a in answers] == [
        (503, "2", "2000"),
        (503, "3", "2500"),
        (503, "4", "3999"),
        (503, "6", "6000"),
        (503, "2", "2000"),
    ]
    assert [b["error"]["rule"] for b in bodies] == ["service.unavailable"] * 3 + [
        "events.limit",
        "service.unavailable",
    ]
    assert "locked" not in json.dumps(bodies)  # what the database said stays in the log
    assert METRICS.unavailable.labels("service.unavailable")._value.get() == before + 4
    records = [r for r in caplog.records if r.name == "leadgate.web"]
    assert {r.levelname for r in records} == {"WARNING"}
    assert [r.getMessage() for r in records] == [
        "1 request(s) answered 503 [service.unavailable]"
        " (the latest: POST /locked: database is locked)",
        "1 request(s) answered 503 [events.limit] (the latest: GET /busy)",
        "3 request(s) answered 503 [service.unavailable]"
        " (the latest: POST /locked: database is locked)",
    ]


def test_an_unknown_field_is_refused_naming_what_the_request_takes() -> None:
    """One check for every JSON body with a fixed set of fields (the agents API, the
    operator's decisions and recoveries): the unknown names, cut to 200 characters
    (the agents API echoed a thousand made-up names whole), and the fields it takes."""
    refuse_unknown_fields({"revision": 1}, {"revision"}, rule="decision.unknown_field")
    with pytest.raises(ValidationError) as refused:
        refuse_unknown_fields(
            {"revison": 1, "name": "x"}, {"revision", "name"}, rule="decision.unknown_field"
        )
    assert refused.value.rule == "decision.unknown_field"
    assert refused.value.message == "unknown fields: revison (this request takes name, revision)"
    many = {f"field{n:04d}": n for n in range(1_000)}
    with pytest.raises(ValidationError) as refused:
        changes_from_body(many)
    assert refused.value.rule == "agent.unknown_field"
    said = refused.value.message
    assert said.startswith("unknown agent fields: field0000, field0001") and len(said) < 400
    assert said.endswith(
        "(this request takes active, instructions, leadAgentId, "
        "leadReviewConfig, model, name, presetId)"
    )
