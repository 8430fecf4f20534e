"""Channel messages that break a message rule, replays, idle sockets, /metrics: through
the real service.

* Slack: a message over 100,000 characters and one with a NUL are acknowledged and
  answered in their thread with a reply saying why (nothing dropped in silence), and a
  redelivery of them sends no second notice.
* Discord: a replayed ``/ask`` interaction (same id, freshly signed) is a duplicate: it
  runs no turn and never touches the earlier reply.
* Slow-loris: connections that never finish their request headers, and idle keep-alive
  connections, are closed after ``[server] idle_timeout_s``.
* ``/metrics`` with ``[server] metrics_token`` needs that bearer token.
* A bearer token with bytes that are not UTF-8 is 401 on every surface, never a 500.
* A NUL in the URL (``%00``) is 400 ``url.nul`` on PostgreSQL, whose text cannot hold it.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from tests.acceptance.channel_kit import Standin, http, wait_until
from tests.reliability.conftest import (
    C_PLAIN,
    Sent,
    SlackRig,
    figures,
    new_ts,
    slack_config,
    sqlite_service,
)
from tests.service_proc import ServiceProcess, clone_sqlite
from tests.standins.discord_api import interaction_headers


def test_slack_messages_breaking_a_rule_get_a_reply_saying_why(
    rel_template: Any, slack_api: Standin, tmp_path: Path
) -> None:
    proc = sqlite_service(rel_template, tmp_path / "svc", slack_config(slack_api))
    with proc.start():
        rig = SlackRig(proc, slack_api)
        long_ts, nul_ts = new_ts(), new_ts()
        rig.sent = [
            rig.post(Sent(C_PLAIN, "x" * 100_001, long_ts)),
            rig.post(Sent(C_PLAIN, "before\x00after", nul_ts)),
        ]
        assert [m.status for m in rig.sent] == [200, 200]

        def notices() -> dict[str, str]:
            return {
                p["thread_ts"]: p["text"]
                for p in rig.posts()
                if str(p["text"]).startswith("Your message was not processed")
            }

        got = wait_until(lambda: notices() if len(notices()) == 2 else None, what="two notices")
        assert "100,000 characters" in got[long_ts]
        assert "NUL" in got[nul_ts]
        # Slack's redelivery of the same message: a duplicate, no second notice.
        rig.post(Sent(C_PLAIN, "before\x00after", nul_ts))
        time.sleep(1.0)
        assert len([p for p in rig.posts() if p["thread_ts"] == nul_ts]) == 1
        assert "Traceback" not in proc.log_text()


def test_a_replayed_discord_interaction_never_touches_the_earlier_reply(
    rel_template: Any, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with Standin("discord_api", "--token", "bot-rel", log_dir=tmp_path) as discord_api:
        proc = ServiceProcess(
            tmp_path / "svc",
            config={
                "runners": {"poll_interval_s": 0.2},
                "discord": {
                    "public_key": key.verify_key.encode().hex(),
                    "api_url": f"{discord_api.url}/api/v10",
                },
            },
        )
        assert proc.sqlite_file is not None
        clone_sqlite(rel_template.database, proc.sqlite_file)
        proc.demo = rel_template.demo
        from tests.acceptance.channel_kit import admin_batch, route

        admin_batch(proc, [route(proc.demo.org, "plain", "discord")])
        payload = {
            "id": "910000000000000111",
            "application_id": "1100000000000000001",
            "type": 2,
            "token": "itoken-replayed",
            "channel_id": "920000000000000222",
            "guild_id": "930000000000000333",
            "data": {"name": "ask", "options": [{"name": "message", "value": "hello"}]},
        }
        body = json.dumps(payload).encode()
        with proc.start():
            url = f"{proc.url}/discord/interactions"
            status, first = http("POST", url, data=body, headers=interaction_headers(key, body))
            assert (status, json.loads(first)) == (200, {"type": 5})
            # The outbox fills the deferred response with the plain reply.
            wait_until(
                lambda: [r for r in discord_api.records("posts") if r.get("op") == "edit_original"],
                what="the reply",
            )
            before = discord_api.records("posts")
            # The same interaction again, signed afresh (a replay inside the window).
            status, again = http("POST", url, data=body, headers=interaction_headers(key, body))
            assert status == 200
            answer = json.loads(again)
            assert answer["type"] == 4 and answer["data"]["flags"] == 64
            time.sleep(1.0)
            assert discord_api.records("posts") == before  # nothing deleted or edited
            stale = interaction_headers(key, body, timestamp=str(int(time.time()) - 3600))
            assert http("POST", url, data=body, headers=stale)[0] == 401


def test_idle_and_half_sent_connections_are_closed(rel_template: Any, tmp_path: Path) -> None:
    proc = ServiceProcess(tmp_path / "svc", config={"server": {"idle_timeout_s": 1.0}})
    assert proc.sqlite_file is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    with proc.start():
        assert proc.port is not None
        sockets = []
        for i in range(40):
            sock = socket.create_connection(("127.0.0.1", proc.port), timeout=5)
            if i % 2:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends
            sockets.append(sock)
        started = time.monotonic()
        closed = 0
        for sock in sockets:
            sock.settimeout(10)
            try:
                data = sock.recv(1024)
            except (ConnectionResetError, TimeoutError):
                data = b""
            closed += data == b""
            sock.close()
        took = time.monotonic() - started
        figures("slow-loris", sockets=len(sockets), closed=closed, within_s=round(took, 2))
        assert closed == len(sockets)
        assert took < 8
        assert proc.healthy()


def test_metrics_need_the_token_when_one_is_set(rel_template: Any, tmp_path: Path) -> None:
    proc = ServiceProcess(tmp_path / "svc", config={"server": {"metrics_token": "m-secret"}})
    assert proc.sqlite_file is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    with proc.start():
        assert http("GET", f"{proc.url}/metrics")[0] == 401
        assert http("GET", f"{proc.url}/metrics", headers={"Authorization": "Bearer x"})[0] == 401
        status, body = http(
            "GET", f"{proc.url}/metrics", headers={"Authorization": "Bearer m-secret"}
        )
        assert status == 200 and b"leadgate_turns_total" in body


def test_a_bearer_token_with_bytes_that_are_not_utf8_is_401_everywhere(
    rel_template: Any, tmp_path: Path
) -> None:
    """aiohttp hands such bytes over as surrogate escapes; they reached the key lookup's
    SQL and the metrics token's compare, and each answered 500."""
    proc = ServiceProcess(tmp_path / "svc", config={"server": {"metrics_token": "m-secret"}})
    assert proc.sqlite_file is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    chat = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    with proc.start():
        # http.client sends "\xff" as that one byte.
        for token in ("\xff", "lg.\xff.x", "lg.key_1.secret\xff"):
            headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
            for method, path, body in [
                ("GET", "/metrics", None),
                ("POST", "/v1/chat/completions", chat),
                ("GET", "/v1/agents", None),
                ("GET", "/operator/reviews", None),
                ("POST", "/mcp", {}),
            ]:
                status, _ = http(method, f"{proc.url}{path}", json_body=body, headers=headers)
                assert status == 401, (token, path, status)
        assert proc.healthy()


def test_a_nul_in_the_url_is_400_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL text cannot hold a NUL: a path parameter or query value with one failed
    in the driver (500 on every route that looks one up) until the URL was checked."""
    proc = ServiceProcess(tmp_path / "svc", database_url=pg_url)
    demo = proc.upgrade_and_seed_demo()
    headers = {"Authorization": f"Bearer {demo.key}", "Accept": "application/json"}
    with proc.start():
        for method, path in [
            ("GET", "/operator/reviews/%00"),
            ("POST", "/operator/reviews/wi%00x/approve"),
            ("POST", "/operator/deliveries/%00/retry"),
            ("GET", "/v1/agents/%00"),
            ("GET", "/v1/models/%00"),
            ("GET", "/v1/agents/plain/sessions/%00/messages"),
            ("GET", "/operator/activity?q=a%00b"),
            ("GET", "/operator/reviews?agent=%00"),
        ]:
            status, body = http(method, f"{proc.url}{path}", headers=headers)
            assert status == 400, (path, status, body[:200])
            assert json.loads(body)["error"]["rule"] == "url.nul", path
        # The same routes still answer ids that merely do not exist.
        status, _ = http("GET", f"{proc.url}/operator/reviews/wi_nope", headers=headers)
        assert status == 404
        assert proc.healthy()
    assert "Traceback" not in proc.log_text()
