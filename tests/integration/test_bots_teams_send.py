"""Outbound half of the Teams adapter: the real botbuilder SDK against the Connector stand-in.

The SDK runs in no-auth mode (empty app id and password), where the Connector calls
carry no Authorization header (asserted below), but for the tests of the access token's
request: with an app id the SDK first fetches a token from the Microsoft identity
platform, here its stand-in (:mod:`tests.standins.microsoft_login`) behind its proxy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestServer
from botbuilder.schema import Activity

from bots import teams
from bots.teams import TeamsAdapter, TeamsChannel, parse_message
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings, TeamsSettings
from leadgate.core.errors import Unavailable
from leadgate.core.runners import drain
from leadgate.core.types import Inbound, Recorded, RouteMatch
from leadgate.database import schema as t
from leadgate.domain.workitems import Status
from outbox.channel import OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain
from outbox.store import SEND_DEADLINE_S, SEND_LEASE_MS
from tests.fakes import FakeCore, mount_adapter
from tests.helpers import (
    PHISH,
    decided_card,
    eventually,
    make_agent,
    make_org,
    make_route,
    marked_card,
    ours,
)
from tests.integration.test_chat_review_faults import no_tracebacks
from tests.standins.common import PORTAL_SESSION, TRICKLE_S
from tests.standins.connector import (
    TRICKLE_BYTES,
    ConnectorStandin,
    message_activity,
    post_activity,
)
from tests.standins.microsoft_login import MicrosoftLogin, _certificates
from tests.standins.proxy import ProxyStandin

CONVERSATION = "19:abc@thread.tacv2;messageid=1700000000001"
ACTIVITY_ID = "1700000000001"


@pytest.fixture
async def connector() -> AsyncIterator[ConnectorStandin]:
    standin = ConnectorStandin()
    await standin.start()
    try:
        yield standin
    finally:
        await standin.close()


@pytest.fixture
def adapter() -> TeamsAdapter:
    return TeamsAdapter(TeamsSettings(enabled=True), FakeCore(), send_timeout_s=0.5)


def _address(service_url: str) -> dict[str, Any]:
    activity = Activity().deserialize(
        message_activity(
            service_url=service_url,
            text="hi",
            activity_id=ACTIVITY_ID,
            conversation_id=CONVERSATION,
        )
    )
    inbound = parse_message(activity)
    assert inbound is not None
    return inbound.address


def _message(address: dict[str, Any], kind: str, text: str = "Echo: hi") -> OutboundMessage:
    return OutboundMessage(
        delivery_id="d-1", idempotency_key="delivery-d-1", address=address, text=text, kind=kind
    )


async def test_reply_goes_to_the_triggering_activity(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    outcome = await adapter.channel.send(_message(_address(connector.url), "reply"))
    assert outcome == Sent("activity-1")
    [posted] = connector.requests
    assert posted["path"] == f"/v3/conversations/{CONVERSATION}/activities/{ACTIVITY_ID}"
    assert posted["reply_to_id"] == ACTIVITY_ID
    body = posted["activity"]
    assert body["type"] == "message" and body["text"] == "Echo: hi"
    assert body["replyToId"] == ACTIVITY_ID
    assert body["conversation"]["id"] == CONVERSATION
    assert body["from"]["id"] == "28:leadgate-bot" and body["recipient"]["id"] == "29:user-1"
    # no-auth mode: no token on the Connector call
    assert posted["authorization"] is None
    # The SDK clears the activity id we set from the idempotency key: not on the wire.
    assert "id" not in body


async def test_gating_output_is_posted_proactively_into_the_conversation(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    outcome = await adapter.channel.send(
        _message(_address(connector.url), "gating", "Approved: report")
    )
    assert isinstance(outcome, Sent) and outcome.external_id
    [posted] = connector.requests
    assert posted["path"] == f"/v3/conversations/{CONVERSATION}/activities"
    assert posted["reply_to_id"] is None
    assert posted["activity"]["text"] == "Approved: report"
    assert "replyToId" not in posted["activity"]


async def test_service_url_with_trailing_slash(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    outcome = await adapter.channel.send(_message(_address(connector.url + "/"), "reply"))
    assert isinstance(outcome, Sent)
    assert connector.requests[0]["path"].startswith("/v3/conversations/")


async def test_inbound_address_round_trip(connector: ConnectorStandin) -> None:
    """The address the inbound half stores is what the outbound half needs."""
    core = FakeCore(lambda channel, attrs: RouteMatch("r", "o", "a", silent=False))
    adapter = TeamsAdapter(TeamsSettings(enabled=True), core, send_timeout_s=0.5)
    app = web.Application()
    mount_adapter(app, adapter)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/api/messages"
        activity = message_activity(service_url=connector.url, text="hi", activity_id="77")
        assert (await post_activity(url, activity))[0] == 202
        await core.drain()
        [trigger] = core.triggers
        outcome = await adapter.channel.send(_message(trigger.binding.address, "reply"))
        assert isinstance(outcome, Sent)
        assert connector.requests[0]["reply_to_id"] == "77"
        assert (
            connector.requests[0]["activity"]["conversation"]["id"]
            == activity["conversation"]["id"]
        )
    finally:
        await runner.cleanup()


async def test_429_is_retry_with_retry_after(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    connector.fail_next("429", retry_after=7)
    outcome = await adapter.channel.send(_message(_address(connector.url), "reply"))
    assert isinstance(outcome, Retry)
    assert outcome.delay_s == 7
    assert len(connector.requests) == 1  # the SDK did not retry on its own


@pytest.mark.parametrize("mode", ["408", "412", "503"])
async def test_not_processed_is_retry(
    adapter: TeamsAdapter, connector: ConnectorStandin, mode: str
) -> None:
    # (412: Microsoft's rate-limit guidance for Teams bots names it among the answers
    # to retry, with 429; it was a permanent failure, and the approved output dropped.)
    connector.fail_next(mode)
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Retry)
    assert len(connector.requests) == 1  # msrest's retry policy is switched off


@pytest.mark.parametrize("mode", ["500", "502", "504"])
async def test_a_5xx_that_may_come_after_the_post_is_uncertain(
    adapter: TeamsAdapter, connector: ConnectorStandin, mode: str
) -> None:
    """The Connector has no idempotency key: sending again after a 500 or a gateway's
    502/504 could post twice, so a person decides (these were retried)."""
    connector.fail_next(mode)
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Uncertain)
    assert mode in outcome.error
    assert len(connector.requests) == 1


@pytest.mark.parametrize("kind", ["reply", "gating"])
async def test_a_post_answered_200_with_a_web_page_is_uncertain(
    adapter: TeamsAdapter,
    connector: ConnectorStandin,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 2xx that is not the Connector's JSON (a captive portal's or a proxy's page) may
    or may not have followed a post the Connector took: a person decides, as on Slack
    and Discord. The error, and a WARNING line as Discord's, quote the start of the page
    and name what to check: the service URL comes with the conversation's activities, so
    what an operator can set is a proxy on the way. The error was msrest's,
    ``DeserializationError('Cannot deserialize content-type: text/html')``. The quote
    leaves out the session id in the page's login link, as Slack's does (it was quoted
    whole)."""
    connector.fail_next("portal")
    with caplog.at_level(logging.WARNING, logger="bots.teams"):
        outcome = await adapter.channel.send(_message(_address(connector.url), kind))
    assert isinstance(outcome, Uncertain), outcome
    assert outcome.error == (
        "teams: HTTP 200 that is not the Bot Connector's answer (text/html; charset=utf-8:"
        ' <html> <h1>Sign in to the guest network</h1> <a href="/login?sid=…">Sign in</a>'
        " </html>): the post may or may not have reached Teams; check any proxy on the way"
        f" to the conversation's service URL {connector.url} (HTTPS_PROXY, HTTP_PROXY,"
        " NO_PROXY)"
    )
    assert [(r.levelno, r.getMessage()) for r in ours(caplog)] == [(logging.WARNING, outcome.error)]
    assert PORTAL_SESSION not in caplog.text
    assert connector.activities == [] and len(connector.requests) == 1


@pytest.mark.parametrize(
    ("mode", "outcome_class"),
    [("proxy503", Retry), ("proxy502", Uncertain), ("proxy404", Permanent)],
)
async def test_another_status_answered_with_a_web_page_means_what_the_status_means(
    adapter: TeamsAdapter,
    connector: ConnectorStandin,
    mode: str,
    outcome_class: type[SendOutcome],
) -> None:
    """A proxy's page with a status the Connector answers too is classed by the status,
    as the Connector's JSON error would be (a 503 is retried, a 502 uncertain, a 404
    permanent), and the error names the page and what to check. msrest reads the body
    before it looks at the status, so each was ``Uncertain`` with its
    ``DeserializationError``: a proxy's 503 was never sent again."""
    connector.fail_next(mode)
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, outcome_class) and not isinstance(outcome, Sent), outcome
    status = mode.removeprefix("proxy")
    assert outcome.error == (
        f"teams: HTTP {status} that is not the Bot Connector's answer (text/html;"
        " charset=utf-8: <html>Proxy Error</html>); check any proxy on the way to the"
        f" conversation's service URL {connector.url} (HTTPS_PROXY, HTTP_PROXY, NO_PROXY)"
    )
    assert len(connector.requests) == 1


async def test_a_cards_facts_and_summary_reach_teams_as_typed(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    """The summary was a ``TextBlock`` and the facts a ``FactSet``, both markdown in
    Teams: a masked link showed its words only, a name's ``*`` or ``_`` restyled it.
    Posted through the Bot Framework SDK, they are ``TextRun``s (never markdown)."""
    post = dataclasses.replace(_message(_address(connector.url), "card", ""), card=marked_card())
    assert isinstance(await adapter.channel.send(post), Sent)
    [posted] = connector.requests
    [attachment] = posted["activity"]["attachments"]
    body = attachment["content"]["body"]
    assert "FactSet" not in json.dumps(body)
    assert [b["text"] for b in body if b["type"] == "TextBlock"] == ["Summary"]
    runs = [r["text"] for b in body if b["type"] == "RichTextBlock" for r in b["inlines"]]
    why = f"The lead escalated it: {PHISH}"
    assert runs[1:7] == ["Agent: ", "*helper*_x_", "From: ", "`src` ~y~", "Why: ", why]
    assert runs[-1] == f"**Done.** {PHISH}"


def _edit(address: dict[str, Any]) -> OutboundMessage:
    """The edit of the review card posted as activity ``activity-9``: it shows the outcome."""
    return OutboundMessage(
        delivery_id="d-2",
        idempotency_key="delivery-d-2",
        address=address,
        text="",
        kind="cardUpdate",
        card=decided_card(),
    )


async def test_a_card_edit_answered_200_with_a_web_page_is_tried_again(
    adapter: TeamsAdapter, connector: ConnectorStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Replacing a card again is harmless, so an edit answered 2xx by something that is
    not the Connector is retried, not left to a person; its error and WARNING line quote
    the page, as a post's do, and say the edit is tried again (they said "the post may or
    may not have reached Teams", and the relay sent it again all the same)."""
    connector.fail_next("portal")
    with caplog.at_level(logging.WARNING, logger="bots.teams"):
        outcome = await adapter.channel.update(_edit(_address(connector.url)), "activity-9")
    assert isinstance(outcome, Retry) and outcome.delay_s is None, outcome
    assert outcome.error == (
        "teams: HTTP 200 that is not the Bot Connector's answer (text/html; charset=utf-8:"
        ' <html> <h1>Sign in to the guest network</h1> <a href="/login?sid=…">Sign in</a>'
        " </html>): the card edit may or may not have reached Teams, and is sent again"
        " (editing twice shows what once does); check any proxy on the way to the"
        f" conversation's service URL {connector.url} (HTTPS_PROXY, HTTP_PROXY, NO_PROXY)"
    )
    assert [(r.levelno, r.getMessage()) for r in ours(caplog)] == [(logging.WARNING, outcome.error)]
    [put] = connector.requests
    assert put["path"].endswith("/activities/activity-9") and connector.updates == []
    assert await adapter.channel.update(_edit(_address(connector.url)), "activity-9") == Sent(
        "activity-9"
    )
    assert len(connector.updates) == 1


@pytest.mark.parametrize("mode", ["hang", "reset", "500", "502", "504", "proxy502"])
async def test_a_card_edit_that_may_have_landed_is_tried_again(
    adapter: TeamsAdapter, connector: ConnectorStandin, mode: str
) -> None:
    """An edit whose outcome is unknown (no answer, the connection lost, a 5xx that may
    follow the change) is sent again: editing twice shows what once does."""
    connector.fail_next(mode)
    outcome = await adapter.channel.update(_edit(_address(connector.url)), "activity-9")
    assert isinstance(outcome, Retry), outcome
    assert len(connector.requests) == 1 and connector.updates == []


@pytest.mark.parametrize(
    ("mode", "delay_s"), [("429", 7.0), ("503", 7.0), ("408", None), ("proxy503", None)]
)
async def test_a_card_edit_not_processed_is_retried_after_its_retry_after(
    adapter: TeamsAdapter, connector: ConnectorStandin, mode: str, delay_s: float | None
) -> None:
    """A card edit is a PUT, which urllib3 (under msrest) answers itself for a 408, 500,
    502, 503 or 504 when retries are off: a ``MaxRetryError``, so the Connector's status
    and its ``Retry-After`` never reached the relay (a 503 asking for 7 s was sent again
    at once, as 'teams connector request failed: ... too many 503 error responses')."""
    connector.fail_next(mode, retry_after=7)
    outcome = await adapter.channel.update(_edit(_address(connector.url)), "activity-9")
    assert isinstance(outcome, Retry), outcome
    assert outcome.delay_s == delay_s
    assert f"HTTP {mode.removeprefix('proxy')}" in outcome.error
    assert "too many" not in outcome.error
    assert len(connector.requests) == 1


@pytest.mark.parametrize("mode", ["401", "403", "404"])
async def test_auth_and_missing_conversation_are_permanent(
    adapter: TeamsAdapter, connector: ConnectorStandin, mode: str
) -> None:
    connector.fail_next(mode)
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Permanent)
    assert mode in outcome.error


async def test_hang_after_the_request_was_read_is_uncertain(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    connector.fail_next("hang")
    outcome = await adapter.channel.send(_message(_address(connector.url), "reply"))
    assert isinstance(outcome, Uncertain)
    assert len(connector.requests) == 1


async def test_reset_after_the_request_was_read_is_uncertain(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    connector.fail_next("reset")
    outcome = await adapter.channel.send(_message(_address(connector.url), "reply"))
    assert isinstance(outcome, Uncertain)
    assert len(connector.requests) == 1


async def test_a_tls_error_after_the_request_was_read_is_uncertain(
    adapter: TeamsAdapter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS record that does not decrypt while the answer is read may follow a post the
    Connector took: uncertain. requests names it as it names a handshake's failure, and
    it was a Retry: the relay posted the message again. A handshake's failure (nothing
    written) is still a Retry, and a card edit so answered is sent again."""
    standin = ConnectorStandin(ssl_context=_certificates(tmp_path / "ca.pem", ips=("127.0.0.1",)))
    await standin.start()
    try:
        address = _address(standin.url)
        # The certificate not trusted yet: the handshake fails before the request.
        outcome = await adapter.channel.send(_message(address, "gating"))
        assert isinstance(outcome, Retry), outcome
        assert standin.requests == []

        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
        standin.fail_next("badrecord")
        outcome = await adapter.channel.send(_message(address, "gating"))
        assert isinstance(outcome, Uncertain), outcome
        assert "after the request was sent" in outcome.error
        [read] = standin.requests
        assert read["activity"]["text"] == "Echo: hi"

        standin.fail_next("badrecord")
        assert isinstance(await adapter.channel.update(_edit(address), "activity-9"), Retry)
        assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    finally:
        await standin.close()


async def test_a_proxy_that_cannot_be_reached_is_retry(
    adapter: TeamsAdapter, connector: ConnectorStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy on the way that refuses the connection: nothing was written, so the send
    is retried. It was "connection lost after the request was sent" (deliveryUnknown):
    every Teams delivery while the proxy was down waited for an operator."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert connector.requests == []


async def test_connection_refused_is_retry(adapter: TeamsAdapter) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outcome = await adapter.channel.send(_message(_address(f"http://127.0.0.1:{port}"), "reply"))
    assert isinstance(outcome, Retry)
    assert outcome.delay_s is None


@pytest.mark.parametrize(
    "address",
    [{}, {"reference": "nope"}, {"reference": {"conversation": {"id": "c"}}}],
)
async def test_unusable_address_is_permanent(
    adapter: TeamsAdapter, connector: ConnectorStandin, address: dict[str, Any]
) -> None:
    outcome = await adapter.channel.send(_message(address, "reply"))
    assert isinstance(outcome, Permanent)
    assert connector.requests == []


async def test_recovers_after_a_failure(adapter: TeamsAdapter, connector: ConnectorStandin) -> None:
    connector.fail_next("503")
    address = _address(connector.url)
    assert isinstance(await adapter.channel.send(_message(address, "gating")), Retry)
    assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    assert [r["mode"] for r in connector.requests] == ["503", "ok"]
    assert len(connector.activities) == 1


async def test_a_connector_trickling_its_answer_is_given_up_on_within_the_send_deadline(
    connector: ConnectorStandin,
) -> None:
    """requests bounds each socket operation alone: a Connector (or a proxy) answering a
    byte at a time, each within the read timeout, kept a send past its lease, whose
    lapse took the delivery back as deliveryUnknown and threw the send's own outcome
    away. Now the request and its answer get timeout_s, within the send's deadline:
    uncertain (the post was taken), and the connection is let go at once."""
    assert SEND_DEADLINE_S <= SEND_LEASE_MS / 2000  # two rounds of sends per lease
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True), FakeCore(), send_timeout_s=1.0, send_deadline_s=2.0
    )
    connector.fail_next("trickle")
    started = time.monotonic()
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Uncertain), outcome
    assert "no answer within 1 s after the request was sent" in outcome.error
    assert time.monotonic() - started < 1.0 + TRICKLE_S * TRICKLE_BYTES / 2
    [posted] = connector.requests
    # The thread reading the answer ends with the send (the socket is shut down), not
    # at the trickle's end.
    await eventually(lambda: posted["cut"], what="the connection let go")
    assert posted["trickled"] < TRICKLE_BYTES
    assert isinstance(await adapter.channel.send(_message(_address(connector.url), "gating")), Sent)


async def test_a_part_with_too_little_of_its_deliverys_deadline_left_is_not_sent(
    connector: ConnectorStandin,
) -> None:
    """A later part of a long text had the channel's whole deadline, whatever earlier
    parts took of the delivery's: with less left (``within_s``) than its request and
    answer may take, it is not sent (a retry, no request made); with more, it is."""
    adapter = TeamsAdapter(TeamsSettings(enabled=True), FakeCore(), send_timeout_s=1.0)
    message = _message(_address(connector.url), "gating")
    outcome = await adapter.channel.send(dataclasses.replace(message, within_s=0.5))
    assert outcome == Retry(
        "teams connector: 0.5 s left of the delivery's send deadline, less than the 1 s "
        "the request and its answer may take; nothing was sent"
    )
    assert connector.requests == []
    assert isinstance(await adapter.channel.send(dataclasses.replace(message, within_s=2.0)), Sent)


@pytest.fixture
async def tls_connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ConnectorStandin]:
    """The Connector stand-in over TLS (an ``https`` service URL), its CA trusted."""
    standin = ConnectorStandin(ssl_context=_certificates(tmp_path / "ca.pem", ips=("127.0.0.1",)))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    await standin.start()
    try:
        yield standin
    finally:
        await standin.close()


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ProxyStandin]:
    """A CONNECT proxy on the way (HTTPS_PROXY)."""
    standin = ProxyStandin()
    await standin.start()
    for name in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(name, standin.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield standin
    finally:
        await standin.close()


async def test_a_proxy_trickling_its_tunnel_is_given_up_on_before_the_request(
    tls_connector: ConnectorStandin, proxy: ProxyStandin
) -> None:
    """A proxy answering CONNECT a byte at a time (each within the read timeout) kept
    the send waiting for the tunnel past its lease. Now the connection must be made
    within deadline_s - timeout_s: past it, nothing was sent (a retry), the request is
    never written on the tunnel, and the connection is let go at once."""
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True), FakeCore(), send_timeout_s=1.0, send_deadline_s=2.0
    )
    proxy.slow_s = 0.1  # the tunnel's 200 takes about 4 s
    started = time.monotonic()
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert "the connection took longer than 1 s" in outcome.error
    assert time.monotonic() - started < 3.0
    await eventually(lambda: proxy.ended == 1, what="the tunnel let go")
    assert tls_connector.requests == []
    proxy.slow_s = 0.0
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Sent), outcome
    assert len(proxy.connects) == 2


@pytest.mark.parametrize(
    ("mode", "said"), [("403", "403 Forbidden"), ("407", "407 Proxy Authentication Required")]
)
async def test_a_proxy_refusing_the_tunnel_is_retry(
    adapter: TeamsAdapter,
    tls_connector: ConnectorStandin,
    proxy: ProxyStandin,
    mode: str,
    said: str,
) -> None:
    """A proxy that answers CONNECT with a refusal: no tunnel, nothing reached the
    Connector, so the send is retried, with the proxy's answer named. A 407 too: the
    proxy's credentials (HTTPS_PROXY) are an operator's to fix, and a retry keeps the
    output until then (a permanent failure would drop it)."""
    proxy.mode = mode
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert f"the proxy refused the tunnel ({said}): nothing was sent" in outcome.error
    assert proxy.connects and tls_connector.requests == []


async def test_a_connection_lost_through_a_proxy_after_the_request_was_read_is_uncertain(
    adapter: TeamsAdapter, tls_connector: ConnectorStandin, proxy: ProxyStandin
) -> None:
    """Through a proxy, urllib3 names a connection lost after the request was written
    ProxyError ('Unable to connect to proxy', as for a proxy that cannot be reached:
    http.client closes the connection, which resets urllib3's "connected to the
    proxy"), and it was retried: a post the Connector had taken was posted again. What
    the connection wrote decides now: uncertain."""
    tls_connector.fail_next("reset")
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Uncertain), outcome
    assert "after the request was sent" in outcome.error
    [read] = tls_connector.requests
    assert read["activity"]["text"] == "Echo: hi"


async def test_a_request_given_up_on_in_its_tls_handshake_is_never_written(
    tls_connector: ConnectorStandin, proxy: ProxyStandin
) -> None:
    """The send gives up (a retry) while the TLS handshake is under way; should the
    handshake complete on the thread still (its answer already on the way), the
    request must not be written then: a retry of a request that was posted after all
    would post it twice."""
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True), FakeCore(), send_timeout_s=3.0, send_deadline_s=4.0
    )
    proxy.hold_s = 1.5  # the server's handshake answer: past the 1 s for the connection
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert "the connection took longer than 1 s" in outcome.error
    # The handshake completes; the thread finds the send given up and writes nothing.
    await eventually(
        lambda: proxy.ended == 1 or tls_connector.requests, what="the thread done with it"
    )
    assert tls_connector.requests == []
    assert proxy.ended == 1


async def test_a_send_waiting_for_a_send_thread_past_its_connection_window_is_never_written(
    connector: ConnectorStandin,
) -> None:
    """More sends than the Teams send pool has threads wait for one, within the window
    for the connection: past it a retry, and the request is never written later."""
    adapter = TeamsAdapter(TeamsSettings(enabled=True), FakeCore(), send_timeout_s=5.0)
    channel = TeamsChannel(adapter.cloud_adapter, "", timeout_s=5.0, deadline_s=6.0, send_threads=1)
    connector.fail_next("hang")
    first = asyncio.ensure_future(channel.send(_message(_address(connector.url), "gating")))
    await eventually(lambda: connector.requests, what="the first request under way")
    outcome = await channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert "took longer than 1 s (a free send thread, the access token's" in outcome.error
    connector.release_hangs()  # (the hanging request answered 503: the thread is free)
    assert isinstance(await first, Retry)
    assert isinstance(await channel.send(_message(_address(connector.url), "gating")), Sent)
    # The second send's request was never written, then or after the thread came free.
    assert [r["mode"] for r in connector.requests] == ["hang", "ok"]


async def test_a_send_still_finishing_at_shutdown_is_not_refused(
    adapter: TeamsAdapter, connector: ConnectorStandin
) -> None:
    """The service closes its channels after waiting a while for the relay: a send
    (or its retry with a new token) still under way then must find the send pool
    open; one refused would fail the delivery for good ('failed before posting')."""
    await adapter.channel.close()
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Sent), outcome


async def test_a_tls_handshake_given_up_on_ends_at_once(
    tls_connector: ConnectorStandin, proxy: ProxyStandin
) -> None:
    """A send given up on in its TLS handshake (a server that never answers it) let
    its thread wait out the socket timeout (30 s here, as in service), a thread of the
    loop's default executor then: the TLS layer had taken the socket over where the
    give-up could not shut it down. It is shut down now through a handle of its own:
    the connection ends with the give-up, and nothing was written."""
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True), FakeCore(), send_timeout_s=30.0, send_deadline_s=31.0
    )
    proxy.hold_s = 3600.0  # the server's handshake answer, held for good
    outcome = await adapter.channel.send(_message(_address(tls_connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert "the connection took longer than 1 s" in outcome.error
    await eventually(lambda: proxy.ended == 1, within=10.0, what="the handshake let go")
    assert tls_connector.requests == []
    await adapter.channel.close()


@pytest.fixture
def login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MicrosoftLogin]:
    """Microsoft's login stand-in (app ``app``, password ``pw``) behind its CONNECT proxy,
    named by the environment (the Connector stand-in on 127.0.0.1 reached directly). It
    runs on an event loop of its own thread: the SDK may wait for it on the caller's."""
    login = MicrosoftLogin(app_id="app", app_password="pw", access_token="at")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="login-standin", daemon=True)
    thread.start()
    tls = web.AppRunner(login.tls_app())

    async def serve() -> asyncio.Server:
        await tls.setup()
        context = _certificates(tmp_path / "login-ca.pem")
        await web.TCPSite(tls, "127.0.0.1", 0, ssl_context=context).start()
        login._tls_port = tls.addresses[0][1]
        return await asyncio.start_server(login.tunnel, "127.0.0.1", 0)

    proxy = asyncio.run_coroutine_threadsafe(serve(), loop).result(30)
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "login-ca.pem"))
    try:
        yield login
    finally:

        async def stop() -> None:
            proxy.close()
            # (the tunnels msal's kept-alive connections still hold)
            await login.close_tunnels()
            await tls.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_the_access_token_is_fetched_off_the_event_loop_within_the_send_deadline(
    connector: ConnectorStandin, login: MicrosoftLogin
) -> None:
    """With an app id the SDK fetches the Connector's access token (msal, through
    requests, with no timeout) from inside msrest's credentials policy, on the event
    loop: a slow identity platform (or a proxy on the way) stopped the whole service
    for as long as it took, and the send's deadline with it. The token is fetched on a
    thread now, within the send's deadline: past it, a retry with nothing sent, while
    the loop runs on; the token that comes later serves the next send."""
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True, app_id="app", app_password="pw"),
        FakeCore(),
        send_timeout_s=1.0,
        send_deadline_s=2.0,
    )
    login.token_hold_s = 3.0
    started = time.monotonic()
    async with _loop_watched():
        outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert "nothing was sent" in outcome.error
    assert time.monotonic() - started < 1.5
    assert connector.requests == []
    await eventually(lambda: bool(login.grants), what="the token answered")
    login.token_hold_s = 0.0
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Sent), outcome
    [posted] = connector.requests
    assert posted["authorization"] == "Bearer at"
    # The token the first send gave up on was kept: it served the second.
    assert [grant["ok"] for grant in login.grants] == [True]


@contextlib.asynccontextmanager
async def _loop_watched() -> AsyncIterator[None]:
    """Fail unless the event loop kept running through the block: a task that sleeps
    20 ms at a time must never find half a second gone (something blocking ran on the
    loop, as msal's token request did)."""
    loop = asyncio.get_running_loop()
    gaps: list[float] = [0.0]

    async def tick() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.02)
            gaps.append(loop.time() - last)
            last = loop.time()

    ticking = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        ticking.cancel()
    assert max(gaps) < 0.5, f"the event loop stood still for {max(gaps):.1f} s"


def _app_adapter(**kwargs: Any) -> TeamsAdapter:
    """An adapter with an app id (``app``/``pw``, as the login stand-in knows it)."""
    return TeamsAdapter(
        TeamsSettings(enabled=True, app_id="app", app_password="pw"),
        FakeCore(),
        send_timeout_s=kwargs.pop("send_timeout_s", 5.0),
        send_deadline_s=kwargs.pop("send_deadline_s", 10.0),
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["hang", "reset", "page"])
async def test_an_access_token_that_cannot_be_got_is_a_retry_with_nothing_sent(
    connector: ConnectorStandin, login: MicrosoftLogin, mode: str
) -> None:
    """The token's request is bounded on its own, and whatever stops it, nothing was
    sent to the Connector: a retry naming the token. Before, a proxy's page answering
    it was a permanent failure (the approved output dropped), a reset was named as a
    proxy that cannot be reached, and an identity platform that took the request and
    never answered held the send for its whole connection window (and a thread of the
    default executor for good)."""
    adapter = _app_adapter(token_timeout_s=0.3)
    login.token_mode = mode
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Retry), outcome
    assert outcome.error.startswith("teams: "), outcome.error
    assert "nothing was sent" in outcome.error
    if mode == "hang":
        assert "gave no access token within 0.3 s" in outcome.error
    else:
        assert "the access token's request failed" in outcome.error
    assert connector.requests == []
    if mode != "page":  # (msal holds back a request its platform answered 5xx for 5 s)
        login.release_tokens()
        outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
        assert isinstance(outcome, Sent), outcome
    await adapter.channel.close()


async def test_the_access_token_is_kept_until_shortly_before_it_expires(
    connector: ConnectorStandin, login: MicrosoftLogin
) -> None:
    """One token serves every send until 5 minutes before its expires_in (the adapter's
    clock); the SDK fetched one for each send."""
    clock = FakeClock()
    adapter = _app_adapter(clock=clock)
    login.token_expires_in = 3600
    address = _address(connector.url)
    for _ in range(3):
        assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    assert len(login.grants) == 1
    clock.advance((3600 - 300) * 1000 - 1)
    assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    assert len(login.grants) == 1
    clock.advance(1)
    login.access_token = "at-2"
    assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    assert len(login.grants) == 2
    assert [r["authorization"] for r in connector.requests] == ["Bearer at"] * 4 + ["Bearer at-2"]
    await adapter.channel.close()


async def test_sends_needing_a_token_at_once_share_one_request(
    connector: ConnectorStandin, login: MicrosoftLogin
) -> None:
    adapter = _app_adapter()
    login.token_mode = "hang"
    address = _address(connector.url)
    sends = [
        asyncio.ensure_future(adapter.channel.send(_message(address, "gating"))) for _ in range(3)
    ]
    await eventually(lambda: login.asked == 1, what="the token asked for")
    login.release_tokens()
    outcomes = await asyncio.gather(*sends)
    assert all(isinstance(outcome, Sent) for outcome in outcomes), outcomes
    assert login.asked == 1 and len(login.grants) == 1
    assert len(connector.activities) == 3
    await adapter.channel.close()


async def test_a_401_from_the_connector_drops_the_token_and_sends_once_more(
    connector: ConnectorStandin, login: MicrosoftLogin
) -> None:
    """A token the Connector refuses (revoked, or its keys rolled before its expiry) is
    dropped and the post made once more with a new one: a 401 is answered before
    anything is posted. Before, the delivery failed for good. A second 401 stays a
    permanent failure (the app's credentials are wrong)."""
    adapter = _app_adapter()
    address = _address(connector.url)
    assert isinstance(await adapter.channel.send(_message(address, "gating")), Sent)
    login.access_token = "at-2"
    connector.fail_next("401")
    outcome = await adapter.channel.send(_message(address, "gating"))
    assert isinstance(outcome, Sent), outcome
    assert [(r["mode"], r["authorization"]) for r in connector.requests] == [
        ("ok", "Bearer at"),
        ("401", "Bearer at"),
        ("ok", "Bearer at-2"),
    ]
    assert len(login.grants) == 2
    connector.fail_next("401", count=2)
    outcome = await adapter.channel.send(_message(address, "gating"))
    assert isinstance(outcome, Permanent), outcome
    assert "HTTP 401" in outcome.error
    assert len(connector.requests) == 5 and len(login.grants) == 3
    await adapter.channel.close()


async def test_a_stuck_send_holds_none_of_the_default_executors_threads(
    connector: ConnectorStandin,
) -> None:
    """msrest sent each Connector request on the event loop's default executor (a few
    threads on a small machine, shared with DNS look-ups and every other blocking call
    of the service): a send stuck where no give-up reaches held one. Teams sends run on
    a pool of their own now; here the default executor has one thread, and it stays
    free while a send waits for an answer."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True), FakeCore(), send_timeout_s=5.0, send_deadline_s=6.0
    )
    connector.fail_next("hang")
    send = asyncio.ensure_future(adapter.channel.send(_message(_address(connector.url), "reply")))
    await eventually(lambda: connector.requests, what="the request under way")
    assert await loop.run_in_executor(None, threading.current_thread) is not None
    assert not send.done()  # (the default executor's thread was free while it waited)
    connector.release_hangs()  # (the hanging request answered 503)
    assert isinstance(await send, Retry)
    await adapter.channel.close()


class _DatabaseDown(FakeCore):
    """A core whose database cannot take a message in (the one case the SDK posts a reply
    of its own while an inbound activity is handled: the "not taken in" notice)."""

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        raise Unavailable("the database is unreachable", rule="service.unavailable")


@contextlib.asynccontextmanager
async def _served(adapter: TeamsAdapter) -> AsyncIterator[str]:
    """``adapter`` served as the app serves it (inbound tokens checked on its threads):
    the URL of its ``/api/messages``."""
    app = web.Application()
    mount_adapter(app, adapter)
    async with TestServer(app) as server:
        yield str(server.make_url("/api/messages"))


@pytest.mark.parametrize("token_mode", ["ok", "hang"])
async def test_a_reply_made_while_an_activity_is_handled_gets_its_token_off_the_event_loop(
    connector: ConnectorStandin,
    login: MicrosoftLogin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    token_mode: str,
) -> None:
    """The reply the SDK posts while it handles an inbound activity (here the "not taken
    in" notice) got its access token from the SDK's own credentials: msal, synchronous
    and with no timeout, on the event loop, so an identity platform that hung there
    stopped the whole service. The token now comes from the shared, bounded cache,
    fetched on the send pool: the loop runs on, one token serves the reply and later
    sends, and a token not got within its bound leaves the reply unposted (one WARNING)
    and the fault is the endpoint's answer (a 503 naming the rule)."""
    from botframework.connector.auth import JwtTokenExtractor

    # (the SDK caches the signing keys per URL for a day: these are this login's)
    monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True, app_id="app", app_password="pw"),
        _DatabaseDown(),
        token_timeout_s=0.3,
    )
    login.token_mode = token_mode
    # On the old code the event loop stood still in msal's request until this answered it.
    release = threading.Timer(2.0, login.release_tokens)
    activity = message_activity(service_url=connector.url, text="SECRET-TEAMS-TEXT")
    token = login.keys.token(app_id="app", service_url=connector.url)
    async with _served(adapter) as url, _loop_watched():
        release.start()
        try:
            with caplog.at_level(logging.INFO):
                status, body = await post_activity(url, activity, token=token)
        finally:
            release.cancel()
            login.release_tokens()  # (the stand-in ends once its requests are answered)
    no_tracebacks(caplog, "SECRET-TEAMS-TEXT")
    if token_mode == "hang":
        assert status == 503 and json.loads(body)["error"]["rule"] == "service.unavailable"
        assert connector.requests == []
        [unposted] = [r for r in ours(caplog) if "could not tell the author" in r.getMessage()]
        assert unposted.levelno == logging.WARNING and unposted.exc_info is None
        assert "gave no access token within 0.3 s" in unposted.getMessage()
        return
    assert status == 202
    [reply] = connector.requests
    assert reply["authorization"] == "Bearer at"
    assert reply["reply_to_id"] == activity["id"]
    # The token the reply got serves the channel's sends too.
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Sent), outcome
    assert login.asked == 1 and len(login.grants) == 1


async def test_the_not_taken_in_reply_has_what_recording_left_for_its_token(
    connector: ConnectorStandin, login: MicrosoftLogin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "not taken in" reply had REPLY_DEADLINE_S from the fault on, of which all but
    REPLY_TIMEOUT_S for its access token and connection (1.5 s in service): a token
    not held and slower to come than that (msal's discovery and request) left the
    reply unposted, and the message answered 503, which Teams does not send again.
    The reply now has what recording left of Teams' wait (here the database failed at
    once): the slow token comes, and the person is told. (The bounds here are cut
    down, the token's answer held longer than its old share.)"""
    from botframework.connector.auth import JwtTokenExtractor

    monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
    monkeypatch.setattr(teams, "REPLY_DEADLINE_S", 0.4)
    monkeypatch.setattr(teams, "REPLY_TIMEOUT_S", 0.2)
    adapter = TeamsAdapter(
        TeamsSettings(enabled=True, app_id="app", app_password="pw"), _DatabaseDown()
    )
    login.token_hold_s = 0.6
    activity = message_activity(service_url=connector.url, text="hello")
    token = login.keys.token(app_id="app", service_url=connector.url)
    async with _served(adapter) as url:
        status, body = await post_activity(url, activity, token=token)
    assert status == 202, body
    [reply] = connector.requests
    assert reply["authorization"] == "Bearer at"
    assert reply["reply_to_id"] == activity["id"]
    assert login.asked == 1


class _DatabaseDownOnceTokenCame(FakeCore):
    """A core whose database fails a message's intake once the login stand-in has
    answered a token request (recording is that slow), or after 3 s."""

    def __init__(self, login: MicrosoftLogin) -> None:
        super().__init__()
        self.login = login
        #: whether the token came while the message was being recorded
        self.token_came = False

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        with contextlib.suppress(AssertionError):
            await eventually(lambda: self.login.grants, within=3.0, what="a token answered")
            self.token_came = True
        raise Unavailable("the database is unreachable", rule="service.unavailable")


async def test_the_access_token_is_fetched_while_the_message_is_recorded(
    connector: ConnectorStandin, login: MicrosoftLogin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message whose recording is slow (past TOKEN_AHEAD_AFTER_S, cut down here) is
    likely to need a reply of the adapter's own (the "not taken in" notice, with what
    recording left of Teams' wait): the access token's fetch starts then, when none is
    held, and runs while the message is recorded, not only once recording failed, and
    the one token serves the notice (and later sends)."""
    from botframework.connector.auth import JwtTokenExtractor

    monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
    monkeypatch.setattr(teams, "TOKEN_AHEAD_AFTER_S", 0.05)
    core = _DatabaseDownOnceTokenCame(login)
    adapter = TeamsAdapter(TeamsSettings(enabled=True, app_id="app", app_password="pw"), core)
    activity = message_activity(service_url=connector.url, text="hello")
    token = login.keys.token(app_id="app", service_url=connector.url)
    async with _served(adapter) as url:
        status, body = await post_activity(url, activity, token=token)
    assert status == 202, body
    assert core.token_came  # (answered while recording, before the notice asked for it)
    assert [grant["ok"] for grant in login.grants] == [True]
    [reply] = connector.requests
    assert reply["authorization"] == "Bearer at"
    outcome = await adapter.channel.send(_message(_address(connector.url), "gating"))
    assert isinstance(outcome, Sent), outcome
    assert login.asked == 1


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_held_turn_asks_for_no_access_token_and_its_approved_reply_gets_one(
    migrated_url: str,
    connector: ConnectorStandin,
    login: MicrosoftLogin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message whose turn is held for Lead Review, then sent again (a duplicate),
    through the real service: nothing is sent, so no access token is asked for (the
    first message of a process asked for one as it came, whatever followed). Once the
    lead approves, the reply's send gets its token and the reply arrives, carrying it."""
    from botframework.connector.auth import JwtTokenExtractor

    monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "teams": {"enabled": True, "app_id": "app", "app_password": "pw"},
        }
    )
    service = App(settings, clock=FakeClock())
    try:
        org = await make_org(service)
        await make_agent(service, org, "lead")
        worker = await make_agent(service, org, "worker", lead="lead")
        await make_route(service, org, worker["id"], "teams")
        activity = message_activity(service_url=connector.url, text="ship it #complete")
        token = login.keys.token(app_id="app", service_url=connector.url)
        async with TestServer(service.web_app(), host="127.0.0.1") as server:
            url = str(server.make_url("/api/messages"))
            assert (await post_activity(url, activity, token=token))[0] == 202

            async def held() -> bool:
                async with service.db.read() as conn:
                    status = await conn.scalar(sa.select(t.work_items.c.status))
                return bool(status == Status.reviewQueued)

            await eventually(held)
            assert (await post_activity(url, activity, token=token))[0] == 202  # a duplicate
            await service.relay.run_once()
            assert (login.asked, connector.requests) == (0, [])
            await drain(service.lead_runner)

            async def replied() -> bool:
                await service.relay.run_once()
                return bool(connector.activities)

            await eventually(replied)
        [reply] = connector.requests
        assert reply["authorization"] == "Bearer at"
        assert login.asked == 1
    finally:
        await service.stop()


async def test_the_not_taken_in_reply_is_sent_as_the_channels_sends_are(
    connector: ConnectorStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """The "not taken in" reply went out through the SDK's own post, msrest's sender on
    the event loop's default executor: a Connector that took the request and never
    answered held one of that executor's few threads (DNS look-ups and the rest of the
    service wait for them) for msrest's socket timeout after the reply gave up, and its
    failure was a bare TimeoutError. It is now sent as the channel's sends are: on the
    Teams send pool, its connection shut down at its deadline, its outcome classified
    (the request was written: it may have been posted). Here the default executor has
    one thread, and it is free once the endpoint has answered."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    connector.fail_next("hang")
    activity = message_activity(service_url=connector.url, text="SECRET-TEAMS-TEXT")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(teams, "REPLY_DEADLINE_S", 1.0)
        mp.setattr(teams, "REPLY_TIMEOUT_S", 0.5)
        adapter = TeamsAdapter(TeamsSettings(enabled=True), _DatabaseDown())
        try:
            async with _served(adapter) as url:
                with caplog.at_level(logging.INFO):
                    status, body = await post_activity(url, activity)
                free = loop.run_in_executor(None, threading.current_thread)
                await eventually(free.done, what="the default executor's thread free")
        finally:
            connector.release_hangs()
    assert status == 503 and json.loads(body)["error"]["rule"] == "service.unavailable"
    [reply] = connector.requests
    assert reply["reply_to_id"] == activity["id"]
    no_tracebacks(caplog, "SECRET-TEAMS-TEXT")
    [unposted] = [r for r in ours(caplog) if "could not tell the author" in r.getMessage()]
    assert unposted.levelno == logging.WARNING
    # (the send's own lapse, or requests' read timeout of the same 0.5 s, whichever
    # comes first: the reply's deadline is seconds off, no longer clipping the lapse)
    said = unposted.getMessage()
    assert "0.5" in said and "after the request was sent" in said, said
