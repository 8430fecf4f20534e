"""A flood of idle connections does not stall the service (``[server] max_connections``),
and a client that reads nothing of its answers does not keep them (``send_timeout_s``).

The real ``leadgate serve`` under an open-files limit of its own (``prlimit``, 600: below
the default ``max_connections``, as under a service manager's 1,024), then 500 idle
connections, more than it has room for: the limit is lowered at start to what fits, the
longest-idle connections are closed to make room, and the official ``openai`` client
still gets its answer at once. Before the limit, 1,100 idle connections against 1,024
files left ``/healthz`` unanswered for 10 s and wrote 122,881 log lines.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.acceptance.channel_kit import http
from tests.reliability.conftest import figures
from tests.service_proc import ServiceProcess, clone_sqlite

OPEN_FILES = 600
IDLE = 500


def test_idle_connections_beyond_the_open_files_limit_do_not_stall_it(
    rel_template: Any, tmp_path: Path
) -> None:
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "util-linux prlimit is needed for this test"
    proc = ServiceProcess(
        tmp_path / "svc", serve_prefix=(prlimit, f"--nofile={OPEN_FILES}:{OPEN_FILES}")
    )
    assert proc.sqlite_file is not None and rel_template.demo is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    proc.demo = rel_template.demo
    host, port = "127.0.0.1", int(proc.url.rsplit(":", 1)[1])
    idle: list[socket.socket] = []
    with proc.start():
        assert proc.pid is not None
        # 600 files less the 266 kept for the database, channels and SMTP.
        assert "max_connections = 4096 lowered to 334" in proc.log_text()
        try:
            for _ in range(IDLE):
                idle.append(socket.create_connection((host, port), timeout=5))
            client = OpenAI(base_url=f"{proc.url}/v1", api_key=proc.demo.key, max_retries=0)
            started = time.monotonic()
            reply = client.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "still there?"}]
            )
            answered_s = time.monotonic() - started
            assert reply.choices[0].message.content == "Echo: still there?"
            assert answered_s < 2.0
            open_files = len(os.listdir(f"/proc/{proc.pid}/fd"))
            assert open_files < OPEN_FILES - 200
            status, metrics = http("GET", f"{proc.url}/metrics")
            assert status == 200
            evicted = next(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.decode().splitlines()
                if line.startswith("leadgate_http_connections_closed_total{")
                and 'reason="evicted"' in line
                and 'listener="main"' in line
            )
            assert evicted >= IDLE - 334
            client.close()
        finally:
            for sock in idle:
                sock.close()
        log = proc.log_text()
        assert "out of system resource" not in log
        assert log.count("to make room for new ones") == 1  # one line, within 10 s
        figures(
            "connection_flood",
            idle=IDLE,
            open_files_limit=OPEN_FILES,
            evicted=int(evicted),
            answered_ms=round(answered_s * 1000, 1),
            service_fds=open_files,
            log_lines=len(log.splitlines()),
        )


def closed_by(proc: ServiceProcess, reason: str) -> float:
    """``leadgate_http_connections_closed_total`` of the main listener for ``reason``."""
    status, metrics = http("GET", f"{proc.url}/metrics")
    assert status == 200
    for line in metrics.decode().splitlines():
        if (
            line.startswith("leadgate_http_connections_closed_total{")
            and f'reason="{reason}"' in line
            and 'listener="main"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_reads_nothing_is_reset_after_the_send_timeout(
    rel_template: Any, tmp_path: Path
) -> None:
    """Twelve transcript pages of about 1 MB (five long turns) pipelined on one
    connection whose client reads none of them: the service stops answering it once its
    buffer is full, and resets it after ``send_timeout_s`` instead of holding the answers
    for as long as the client stays."""
    proc = ServiceProcess(tmp_path / "svc", config={"server": {"send_timeout_s": 1.0}})
    assert proc.sqlite_file is not None and rel_template.demo is not None
    clone_sqlite(rel_template.database, proc.sqlite_file)
    proc.demo = rel_template.demo
    key = proc.demo.key
    with proc.start():
        long_turn = {"model": "plain", "messages": [{"role": "user", "content": "x" * 99_000}]}
        for _ in range(5):
            status, _ = http(
                "POST",
                f"{proc.url}/v1/chat/completions",
                json_body=long_turn,
                headers={"Authorization": f"Bearer {key}", "X-Session-Id": "long"},
            )
            assert status == 200
        host, port = "127.0.0.1", int(proc.url.rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        request = (
            "GET /v1/agents/plain/sessions/long/messages HTTP/1.1\r\n"
            f"Host: x\r\nAuthorization: Bearer {key}\r\n\r\n"
        ).encode()
        started = time.monotonic()
        sock.sendall(request * 12)
        deadline = started + 10
        while closed_by(proc, "send_timeout") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        reset_s = time.monotonic() - started
        assert closed_by(proc, "send_timeout") == 1
        assert 1.0 <= reset_s < 5.0
        sock.close()
        log = proc.log_text()
        assert "took nothing of the answer for [server] send_timeout_s = 1.0" in log
        assert "Traceback" not in log  # the reset handler ends quietly
        figures("unread_answers", pipelined=12, send_timeout_s=1.0, reset_s=round(reset_s, 2))
