"""An unauthenticated console login flood does not stall the service.

200 concurrent bad logins for one account (the real ``leadgate serve``, SQLite) while a
plain REST turn is timed over and over from another process: the turns stay under
100 ms (95th percentile; see the assertion for the tail), the flood ends in 429s with a
Retry-After that says when there is room again, and the right password sent inside the
flood, after the limit, is refused too.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.acceptance.channel_kit import admin_batch, http
from tests.reliability.conftest import figures
from tests.service_proc import ServiceProcess, clone_sqlite

FLOOD = 200
PASSWORD = "correct horse battery"
TURN_LIMIT_S = 0.100


TIMER = """
import json, os, sys, time, urllib.request
url, key, stop = sys.argv[1:4]
body = json.dumps({"model": "plain", "messages": [{"role": "user", "content": "ping"}]}).encode()
headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
times = []
print("ready", flush=True)
while not os.path.exists(stop):
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        resp.read()
    times.append(time.perf_counter() - started)
print(json.dumps(times))
"""


def plain_turn(proc: ServiceProcess) -> float:
    assert proc.demo is not None
    started = time.perf_counter()
    status, _ = http(
        "POST",
        f"{proc.url}/v1/chat/completions",
        json_body={"model": "plain", "messages": [{"role": "user", "content": "ping"}]},
        headers={"Authorization": f"Bearer {proc.demo.key}"},
    )
    assert status == 200
    return time.perf_counter() - started


async def login(session: aiohttp.ClientSession, url: str, password: str) -> tuple[int, Any]:
    async with session.post(
        f"{url}/console/login",
        json={"email": "ann@example.com", "password": password},
        headers={"X-Leadgate-Console": "1"},
    ) as resp:
        return resp.status, resp.headers.get("Retry-After")


def test_login_flood_is_refused_fast_and_does_not_slow_turns(
    rel_template: Any, tmp_path: Path
) -> None:
    proc = ServiceProcess(tmp_path / "svc")
    assert proc.sqlite_file is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    proc.demo = rel_template.demo
    admin_batch(
        proc,
        [
            [
                "user",
                "create",
                "--org",
                proc.demo.org,
                "--email",
                "ann@example.com",
                "--role",
                "Member",
                "--password",
                PASSWORD,
            ]
        ],
    )
    with proc.start():
        baseline = statistics.median(plain_turn(proc) for _ in range(10))
        # The turns are timed from a process of their own, so that the flood client in
        # this one (its event loop holds this interpreter's GIL) does not skew them.
        stop = tmp_path / "stop"
        timer = subprocess.Popen(
            [sys.executable, "-c", TIMER, proc.url, proc.demo.key, str(stop)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert timer.stdout is not None
        assert timer.stdout.readline().strip() == "ready"

        async def flood() -> tuple[list[tuple[int, Any]], tuple[int, Any], float]:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                started = time.perf_counter()
                bad = await asyncio.gather(
                    *(login(session, proc.url, f"wrong guess {i}") for i in range(FLOOD))
                )
                elapsed = time.perf_counter() - started
                right = await login(session, proc.url, PASSWORD)
            return bad, right, elapsed

        try:
            bad, right, elapsed = asyncio.run(flood())
            time.sleep(0.3)  # a few more timed turns after the flood
        finally:
            stop.touch()
            out, _ = timer.communicate(timeout=30)
        during = [float(x) for x in json.loads(out)]
        statuses = [status for status, _ in bad]
        assert set(statuses) <= {401, 429, 503}, statuses
        # Counted before the password check: at most the limit got as far as argon2.
        assert statuses.count(401) <= 10
        assert statuses.count(429) >= FLOOD - 10 - statuses.count(503)
        waits = [int(value) for status, value in bad if status == 429]
        assert waits and all(1 <= w <= 60 for w in waits)
        # The right password inside the flood, after the limit: refused too.
        assert right[0] == 429 and 1 <= int(right[1]) <= 60
        assert during, "no turn was timed during the flood"
        worst = max(during)
        figures(
            "login-flood",
            logins=FLOOD,
            refused_429=statuses.count(429),
            checked_401=statuses.count(401),
            busy_503=statuses.count(503),
            flood_s=round(elapsed, 3),
            turn_baseline_ms=round(baseline * 1000, 1),
            turn_p95_during_ms=round(statistics.quantiles(during, n=20)[-1] * 1000, 1),
            turn_worst_during_ms=round(worst * 1000, 1),
            turns_timed=len(during),
        )
        p95 = statistics.quantiles(during, n=20)[-1]
        # The bound holds for the turns as a whole (95th percentile); the single worst
        # one is bounded loosely, because this 2-core machine is shared and its load
        # (not the flood) decides the tail. Before the fix a turn waited 20.9 s.
        assert p95 < TURN_LIMIT_S, sorted(during)[-20:]
        assert worst < 5 * TURN_LIMIT_S, sorted(during)[-20:]
        # The service still takes a right login once the window has room (not waited for
        # here: a minute); and it never answered 500 (the statuses above).
        assert json.loads(http("GET", f"{proc.url}/healthz")[1])["status"] == "ok"
