"""Helpers for the channel acceptance tests (``test_channels_*.py``, ``test_schedules.py``).

Everything here talks to processes over 127.0.0.1, synchronously:

* :class:`Standin` runs a stand-in (``python -m tests.standins.<name> --port 0``) in a
  subprocess, reads its ``LISTENING <port>`` (and ``HTTP <port>``) lines and stops it with
  SIGTERM. Its records are read through the stand-in's ``/_standin/...`` endpoints.
* :func:`http` / :func:`get_json` are tiny urllib wrappers that never raise for a status.
* :func:`wait_until` polls with a deadline; :func:`stays` checks that something remains
  true for a short while ("posts nothing").
* :class:`Operator` is the operator JSON API with the demo Owner key.
* :func:`turn_counts` parses ``leadgate_turns_total`` from ``/metrics``.
* :func:`prepared_service` copies the demo template and runs admin commands *before*
  ``leadgate serve`` starts (routes, schedules).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tests.service_proc import (
    REPO_ROOT,
    DemoTemplate,
    ServiceProcess,
    clone_sqlite,
)

T = TypeVar("T")
HOST = "127.0.0.1"
#: how long the tests wait for something that should happen (generous for slow CI)
DEADLINE_S = 20.0
#: how long "nothing happens" is watched
QUIET_S = 0.8
#: short runner polls so that tests are quick
FAST_RUNNERS = {"runners": {"poll_interval_s": 0.2}}


# --------------------------------------------------------------------------- HTTP


def http(
    method: str,
    url: str,
    *,
    json_body: Any = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """One HTTP request; returns ``(status, body)`` for every status (no raise)."""
    hdrs = dict(headers or {})
    if json_body is not None:
        data = json.dumps(json_body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    """GET ``url`` and decode JSON (asserting 200)."""
    status, body = http("GET", url, headers=headers)
    assert status == 200, f"GET {url} -> {status}: {body[:500]!r}"
    return json.loads(body)


# --------------------------------------------------------------------------- polling


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float = DEADLINE_S,
    interval: float = 0.05,
    what: str = "",
) -> T:
    """Call ``probe`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what or probe}; last: {last!r}"
            )
        time.sleep(interval)


def stays(probe: Callable[[], bool], *, seconds: float = QUIET_S, what: str = "") -> None:
    """Assert that ``probe`` is true now and stays true for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        assert probe(), f"no longer true: {what or probe}"
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


# --------------------------------------------------------------------------- stand-ins


def end_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a helper process: SIGTERM, then SIGKILL after 10 s; close its stdout pipe."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


class Standin:
    """A stand-in in a subprocess (``python -m tests.standins.<module> --port 0 ...``).

    ``port`` is the port it printed (``LISTENING <port>``); for the SMTP sink, started
    with ``--http-port 0``, ``http_port`` is its control port (``HTTP <port>``).
    """

    def __init__(self, module: str, *args: str, log_dir: Path, timeout: float = 20.0) -> None:
        self.module = module
        self.args = list(args)
        self.log_path = Path(log_dir) / f"standin-{module}.log"
        self.timeout = timeout
        self.port = 0
        self.http_port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    @property
    def control_url(self) -> str:
        """Base URL of the ``/_standin/...`` endpoints."""
        return f"http://{HOST}:{self.http_port or self.port}"

    def start(self) -> Standin:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        want_http = "--http-port" in self.args
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", f"tests.standins.{self.module}", "--port", "0", *self.args],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self._proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self._proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.timeout
        buf = b""
        try:
            while not self.port or (want_http and not self.http_port):
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(
                        f"stand-in {self.module} did not start; output {buf!r}; "
                        f"log {self.log_path.read_text(errors='replace')[-2000:]}"
                    )
                if not sel.select(timeout=0.1):
                    continue
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                buf += chunk
                text = buf.decode(errors="replace")
                if m := re.search(r"^LISTENING (\d+)$", text, re.M):
                    self.port = int(m.group(1))
                if m := re.search(r"^HTTP (\d+)$", text, re.M):
                    self.http_port = int(m.group(1))
        finally:
            sel.close()
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_process(proc)

    def __enter__(self) -> Standin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control endpoints ------------------------------------------------------------

    def records(self, name: str) -> list[dict[str, Any]]:
        """``GET /_standin/<name>`` (posts, requests, activities, messages, ...)."""
        return list(get_json(f"{self.control_url}/_standin/{name}"))

    def control(self, path: str, body: Any = None) -> Any:
        """``POST /_standin/<path>`` with a JSON body; returns the decoded answer."""
        status, raw = http("POST", f"{self.control_url}/_standin/{path}", json_body=body or {})
        assert status == 200, f"stand-in control {path} -> {status}: {raw[:300]!r}"
        return json.loads(raw)


# --------------------------------------------------------------------------- service


def admin_batch(proc: ServiceProcess, commands: Sequence[Sequence[str]]) -> list[Any]:
    """:meth:`ServiceProcess.batch`: the commands in one child process, their JSON
    outputs; raises on the first command that exits non-zero."""
    return proc.batch(commands)


def prepared_service(
    template: DemoTemplate,
    workdir: Path,
    *,
    admin: Sequence[Sequence[str]] = (),
    **kwargs: Any,
) -> ServiceProcess:
    """A (not yet started) service on a copy of the demo template, after ``admin``
    commands (run concurrently; e.g. ``route add``) have been applied."""
    proc = ServiceProcess(workdir, **kwargs)
    assert proc.sqlite_file is not None
    clone_sqlite(template.database, proc.sqlite_file)
    proc.demo = template.demo
    if admin:
        admin_batch(proc, admin)
    return proc


def route(org: str, agent: str, channel: str, *match: str, silent: bool = False) -> list[str]:
    """The arguments of ``leadgate route add``."""
    args = ["route", "add", "--org", org, "--agent", agent, "--channel", channel]
    for pair in match:
        args += ["--match", pair]
    if silent:
        args.append("--silent")
    return args


# The routes of every channel module, made once per test session through the CLI (each
# ``leadgate route add`` is a process start): modules then start from a copy.
SLACK_WORK = "C0WORK"
SLACK_SILENT = "C0SILENT"
DISCORD_WORK_GUILD = "900000000000000001"
DISCORD_SILENT = "910000000000000003"
TEAMS_WORK_TENANT = "tenant-work"
TEAMS_SILENT = "19:silent@thread.tacv2"
MAIL_PLAIN = "plain@leadgate.test"
MAIL_WORK = "worker@leadgate.test"
MAIL_SILENT = "silent@leadgate.test"
MAIL_STRICT = "strict@leadgate.test"
MAIL_ALLOWED = "*@allowed.example"


def channel_routes(org: str) -> list[list[str]]:
    """Per channel: ``plain`` (no lead), ``worker`` (lead) and a silent ``worker`` route.

    Slack, Discord and Teams send everything else to ``plain`` (a route without match
    keys, the least specific). Discord and Teams sessions are per channel/conversation,
    so their ``worker`` routes match the whole guild/tenant: each test takes a fresh
    channel there. Email routes name their recipient, and ``strict@`` only accepts
    senders of ``allowed.example``.
    """
    return [
        route(org, "plain", "slack"),
        route(org, "worker", "slack", f"channel={SLACK_WORK}"),
        route(org, "worker", "slack", f"channel={SLACK_SILENT}", silent=True),
        route(org, "plain", "discord"),
        route(org, "worker", "discord", f"guild={DISCORD_WORK_GUILD}"),
        route(
            org,
            "worker",
            "discord",
            f"guild={DISCORD_WORK_GUILD}",
            f"channel={DISCORD_SILENT}",
            silent=True,
        ),
        route(org, "plain", "teams"),
        route(org, "worker", "teams", f"tenant={TEAMS_WORK_TENANT}"),
        route(
            org,
            "worker",
            "teams",
            f"tenant={TEAMS_WORK_TENANT}",
            f"conversation={TEAMS_SILENT}",
            silent=True,
        ),
        route(org, "plain", "email", f"address={MAIL_PLAIN}"),
        route(org, "worker", "email", f"address={MAIL_WORK}"),
        route(org, "worker", "email", f"address={MAIL_SILENT}", silent=True),
        route(org, "plain", "email", f"address={MAIL_STRICT}", f"sender={MAIL_ALLOWED}"),
    ]


_TEMPLATES: dict[Path, DemoTemplate] = {}


def channel_template(demo: DemoTemplate, workdir_factory: Callable[[], Path]) -> DemoTemplate:
    """The demo template plus :func:`channel_routes` (made once per test session)."""
    cached = _TEMPLATES.get(demo.database)
    if cached is None:
        proc = ServiceProcess(workdir_factory())
        assert proc.sqlite_file is not None
        clone_sqlite(demo.database, proc.sqlite_file)
        admin_batch(proc, channel_routes(demo.demo.org))
        cached = _TEMPLATES[demo.database] = DemoTemplate(proc.sqlite_file, demo.demo)
    return cached


_METRIC = re.compile(r'^leadgate_turns_total\{outcome="([^"]+)"\}\s+([0-9.eE+-]+)$', re.M)


def turn_counts(proc: ServiceProcess) -> dict[str, float]:
    """``leadgate_turns_total`` by outcome, from ``GET /metrics``."""
    status, body = http("GET", f"{proc.url}/metrics")
    assert status == 200
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(body.decode())}


def total_turns(proc: ServiceProcess) -> float:
    """Every turn outcome summed (plain, gated, busy, duplicate, error)."""
    return sum(turn_counts(proc).values())


class Operator:
    """The operator JSON API with the demo organization's Owner key."""

    def __init__(self, proc: ServiceProcess) -> None:
        assert proc.demo is not None
        self.proc = proc
        self.headers = {"Authorization": f"Bearer {proc.demo.key}"}
        self._found: dict[str, str] = {}
        self._seen: set[str] = set()

    def get(self, path: str) -> Any:
        return get_json(f"{self.proc.url}{path}", self.headers)

    def reviews(self) -> list[dict[str, Any]]:
        """The actionable queue (first page)."""
        return list(self.get("/operator/reviews?limit=200")["items"])

    def activity(self) -> list[dict[str, Any]]:
        """Agent Activity (recent work items)."""
        return list(self.get("/operator/activity")["items"])

    def detail(self, item_id: str) -> dict[str, Any]:
        return dict(self.get(f"/operator/reviews/{item_id}"))

    def decide(self, item_id: str, action: str, body: Any = None) -> dict[str, Any]:
        status, raw = http(
            "POST",
            f"{self.proc.url}/operator/reviews/{item_id}/{action}",
            json_body=body if body is not None else {},
            headers=self.headers,
        )
        assert status == 200, f"{action} {item_id} -> {status}: {raw[:500]!r}"
        return dict(json.loads(raw))

    def item_with(self, marker: str) -> dict[str, Any] | None:
        """The detail of the work item whose task context contains ``marker``.

        Items are matched on their first message: an item seen once without the marker
        is not fetched again (the tests put each marker in a session's first message).
        """
        item_id = self._found.get(marker)
        if item_id is not None:
            return self.detail(item_id)
        for row in self.activity():
            if row["id"] in self._seen:
                continue
            detail = self.detail(row["id"])
            self._seen.add(row["id"])
            if marker in (detail["taskContext"] or ""):
                self._found[marker] = row["id"]
                return detail
        return None

    def wait_item(self, marker: str, status: str, *, timeout: float = DEADLINE_S) -> dict[str, Any]:
        """Wait until the item with ``marker`` in its task context has ``status``."""

        def probe() -> dict[str, Any] | None:
            detail = self.item_with(marker)
            return detail if detail is not None and detail["status"] == status else None

        return wait_until(
            probe, timeout=timeout, interval=0.1, what=f"work item {marker!r} to be {status}"
        )


@contextlib.contextmanager
def logs_on_failure(*procs: ServiceProcess) -> Iterator[None]:
    """Print the services' log tails when the block fails (for unguarded services)."""
    try:
        yield
    except BaseException:
        for proc in procs:
            print(proc.log_tail(80))
        raise


@contextlib.contextmanager
def standins(*items: Standin) -> Iterator[tuple[Standin, ...]]:
    """Start several stand-ins; stop them all afterwards."""
    started: list[Standin] = []
    try:
        for item in items:
            started.append(item.start())
        yield tuple(started)
    finally:
        for item in reversed(started):
            item.stop()
