"""What a client can put around a body: query values, headers, the request target and the
body's ``Content-Encoding``, against the real service.

Each case here answered 500 until session 31 (a throwaway probe of odd bytes and numbers
on every route found them): a count or time past 64 bits reached the SQLite driver
(``OverflowError``), ``"²"`` passed ``str.isdigit`` and failed ``int``, a cursor holding
``Infinity`` or a lone surrogate failed in its query, a gzip body that is not gzip failed
in aiohttp's reader, and ``/mcp?x=%E2%80%AE`` failed to encode for the SDK's scope. A
request line aiohttp cannot parse was answered 400 but logged at ERROR with a traceback
quoting the request; it is now one INFO line. Until session 32 that 400 was aiohttp's own
plain text, quoting the request line; it is now the JSON envelope (``http.malformed``).
"""

from __future__ import annotations

import base64
import gzip
import json
import socket
from typing import Any
from urllib.parse import quote

import pytest
import requests
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.conftest import SESSION, SETTINGS, Fuzzed
from tests.helpers import mcp_initialize

CHAT: dict[str, Any] = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
#: The routes that take counts, times and cursors in their query, and each one's rules.
PAGED = {
    "/operator/reviews": ("queue",),
    "/operator/activity": ("activity",),
    "/operator/deliveries": ("deliveries",),
    "/operator/insights": ("insights",),
    "/v1/agents/plain/sessions/s1/messages": ("transcript",),
}


def auth(svc: Fuzzed, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {svc.key}", "Accept": "application/json", **extra}


def get(svc: Fuzzed, target: str, **headers: str) -> requests.Response:
    response = SESSION.get(f"{svc.proc.url}{target}", headers=auth(svc, **headers), timeout=20)
    assert response.status_code < 500, (target, response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    return response


def rule_of(response: requests.Response) -> str:
    return str(response.json()["error"]["rule"])


def cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("/operator/activity?since=9223372036854775808", "activity.since"),
        ("/operator/activity?until=99999999999999999999999999", "activity.until"),
        (f"/operator/activity?since={quote('²')}", "activity.since"),
        (f"/operator/reviews?limit={quote('²')}", "queue.limit"),
        ("/operator/reviews?limit=99999999999999999999", "queue.limit"),
        (f"/operator/insights?days={quote('²')}", "insights.days"),
        (f"/v1/agents/plain/sessions/s1/messages?limit={quote('١')}", "transcript.limit"),
        (f"/operator/reviews?cursor={cursor([10**30, 'wi_1'])}", "queue.cursor"),
        (f"/operator/activity?cursor={quote(base64.b64encode(b'[1e400, 1]'))}", "activity.cursor"),
        (f"/operator/deliveries?cursor={cursor([1, chr(0xD800)])}", "deliveries.cursor"),
        (f"/operator/deliveries?cursor={cursor([1.5, 'dl_1'])}", "deliveries.cursor"),
        (f"/operator/activity?cursor={cursor([1, 'wi' + chr(0)])}", "activity.cursor"),
        (f"/operator/reviews?cursor={cursor(['[' * 600 + ']' * 600, 'x'])}", "queue.cursor"),
    ],
)
def test_numbers_no_database_holds_and_odd_cursors_are_400(
    each_backend: Fuzzed, target: str, rule: str
) -> None:
    response = get(each_backend, target)
    assert (response.status_code, rule_of(response)) == (400, rule)


def test_a_last_event_id_of_odd_digits_is_400(each_backend: Fuzzed) -> None:
    path = "/v1/agents/plain/sessions/s1/events"
    for value in ("²", "9" * 30):
        response = SESSION.get(
            f"{each_backend.proc.url}{path}",
            headers={**auth(each_backend), "Last-Event-ID": value.encode().decode("latin-1")},
            timeout=20,
        )
        assert (response.status_code, rule_of(response)) == (400, "events.last_event_id")


numbers = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.text(max_size=25),
    st.sampled_from(["²", "١٢٣", "1e400", "-0", " 1", "0x10", "9223372036854775807"]),
)


@SETTINGS
@given(name=st.sampled_from(["limit", "since", "until", "days", "cursor"]), value=numbers)
@example(name="since", value="9223372036854775808")
def test_any_query_value_is_an_answer_or_a_400_naming_its_rule(
    each_backend: Fuzzed, name: str, value: str
) -> None:
    for path, (prefix,) in PAGED.items():
        response = get(each_backend, f"{path}?{name}={quote(value)}")
        if response.status_code == 400:
            assert rule_of(response).startswith((prefix + ".", "activity.", "url.")), response.text


@SETTINGS
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(),
        lambda kids: st.lists(kids, max_size=3),
        max_leaves=6,
    )
)
def test_any_cursor_is_a_page_or_a_400(each_backend: Fuzzed, value: Any) -> None:
    encoded = base64.urlsafe_b64encode(json.dumps(value).encode()).decode()
    for path in ("/operator/reviews", "/operator/activity", "/operator/deliveries"):
        response = get(each_backend, f"{path}?cursor={encoded}")
        assert response.status_code in (200, 400), response.text


#: Routes that look a path parameter up (``{}`` is the parameter).
LOOKUPS = (
    "GET /v1/agents/{}",
    "GET /v1/models/{}",
    "GET /v1/agents/plain/sessions/{}/messages",
    "GET /operator/reviews/{}",
    "POST /operator/reviews/{}/approve",
    "POST /operator/deliveries/{}/retry",
)


@SETTINGS
@given(value=st.text(min_size=1, max_size=30) | st.binary(min_size=1, max_size=30))
@example(value="wi\x00x")
@example(value="9" * 30)
def test_any_path_parameter_is_an_answer_or_a_4xx_naming_its_rule(
    each_backend: Fuzzed, value: str | bytes
) -> None:
    """Any text or bytes where an id goes: found, 404, or a 400 naming the rule (a NUL is
    ``url.nul``), on both backends; never a 5xx."""
    for line in LOOKUPS:
        method, template = line.split(" ")
        target = template.format(quote(value, safe=""))
        response = SESSION.request(
            method, f"{each_backend.proc.url}{target}", headers=auth(each_backend), timeout=20
        )
        assert response.status_code < 500, (line, value, response.status_code, response.text[:300])
        if response.status_code >= 400:
            assert response.json()["error"]["rule"], (line, response.text[:300])
    assert each_backend.log_problems() == []


def test_a_body_that_does_not_decode_as_its_content_encoding_is_400(fuzz_service: Fuzzed) -> None:
    url = fuzz_service.proc.url
    headers = {
        **auth(fuzz_service),
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "X-Leadgate-Console": "1",
    }
    before = fuzz_service.quiet_fingerprint()
    for path in ("/v1/chat/completions", "/mcp", "/console/login", "/v1/agents"):
        response = SESSION.post(f"{url}{path}", data=b'{"not": "gzip"}', headers=headers)
        assert (response.status_code, rule_of(response)) == (400, "body.encoding"), path
        # aiohttp closes a connection whose body broke; the answer says so, or the next
        # request on it (this session's) was sent into the closing socket and reset.
        assert response.headers.get("Connection", "").lower() == "close", path
    assert fuzz_service.fingerprint() == before
    # A body that is gzip is read as what it decompresses to, and counts at that size.
    good = SESSION.post(
        f"{url}/v1/chat/completions", data=gzip.compress(json.dumps(CHAT).encode()), headers=headers
    )
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["message"]["content"]
    bomb = gzip.compress(b'{"a": "' + b"x" * (3 * 1_048_576) + b'"}')
    assert len(bomb) < 10_000
    big = SESSION.post(f"{url}/v1/chat/completions", data=bomb, headers=headers)
    assert (big.status_code, rule_of(big)) == (413, "body.size")


def test_a_method_a_path_does_not_take_is_405_saying_which_it_takes(
    fuzz_service: Fuzzed,
) -> None:
    """RFC 9110 15.5.6: a 405 carries ``Allow`` (the envelope dropped it)."""
    url = fuzz_service.proc.url
    for method, path in [("PUT", "/v1/chat/completions"), ("GET", "/v1/chat/completions"),
                         ("DELETE", "/v1/agents"), ("PUT", "/mcp")]:  # fmt: skip
        response = SESSION.request(method, f"{url}{path}", headers=auth(fuzz_service), timeout=20)
        assert response.status_code == 405, (method, path, response.text[:200])
        assert response.json()["error"]["rule"] == "http"
        allowed = {m.strip() for m in response.headers["Allow"].split(",")}
        assert allowed and method not in allowed, (path, allowed)


def test_mcp_takes_any_query_string(each_backend: Fuzzed) -> None:
    init = mcp_initialize()
    for query in ("x=%E2%80%AE", "x=%FF", "since=%D9%A1"):
        response = SESSION.post(
            f"{each_backend.proc.url}/mcp?{query}",
            json=init,
            headers=auth(each_backend, Accept="application/json, text/event-stream"),
            timeout=20,
        )
        assert response.status_code == 200, (query, response.status_code, response.text[:300])


def raw_exchange(svc: Fuzzed, head: bytes) -> bytes:
    """Send ``head`` as it is on a new connection; everything the service answers."""
    port = int(svc.proc.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


SECRET = b"secret-looking-bytes"
UNPARSEABLE = {
    "request target": b"GET /v1/agents/\xff" + SECRET + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header without a colon": b"GET /health HTTP/1.1\r\nHost: x\r\n" + SECRET + b"\r\n\r\n",
    "header line too long": b"GET /health HTTP/1.1\r\nX-A: " + SECRET * 600 + b"\r\n\r\n",
    "both body framings": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "not HTTP at all": b"\x16\x03\x01\x02\x00" + SECRET + b"\r\n\r\n",
}


@pytest.mark.parametrize("head", UNPARSEABLE.values(), ids=list(UNPARSEABLE))
def test_a_request_aiohttp_cannot_parse_is_a_json_400_and_one_quiet_log_line(
    fuzz_service: Fuzzed, head: bytes
) -> None:
    answer = raw_exchange(fuzz_service, head)
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status_line.split(b" ", 2)[1] == b"400", answer[:300]
    # The one error envelope, naming the rule; not aiohttp's text quoting the bytes back.
    assert b"application/json" in headers.lower(), answer[:300]
    assert b"\r\nserver: leadgate\r\n" in b"\r\n" + headers.lower() + b"\r\n", headers
    assert json.loads(body)["error"]["rule"] == "http.malformed"
    assert SECRET not in answer
    log = fuzz_service.proc.log_text()
    assert SECRET.decode() not in log
    assert fuzz_service.log_problems() == []


def test_a_malformed_request_is_logged_as_one_info_line(fuzz_service: Fuzzed) -> None:
    raw_exchange(fuzz_service, UNPARSEABLE["request target"])
    assert "malformed request from 127.0.0.1 (InvalidURLError)" in fuzz_service.proc.log_text()
