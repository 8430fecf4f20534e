"""The reliability suite: the real service under crashes and faults, checked afterwards.

Run on its own: ``.venv/bin/python -m pytest tests/reliability -s`` (``-s`` shows the
figures); the long form: ``-m long``. Each scenario prints one ``FIGURES`` line:
accepted, answered, in queue, failed with a notice, lost, doubled, recovery time.

:class:`SlackRig` is a service with Slack pointed at the Slack Web API stand-in (a
subprocess), routes to ``plain`` (every channel) and ``worker`` (channel ``C0WORK``),
signed Events API posts, and the invariant check: every accepted message is answered (a
post in its thread), visible to operators (the actionable queue, or the list of uncertain
deliveries, `GET /operator/deliveries`), or failed with a notice; no
delivery posted twice; every work item's audit trail ends in its status.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from leadgate.turns.runs import FAILURE_NOTICE
from tests.acceptance.channel_kit import Standin, admin_batch, get_json, http, route
from tests.service_proc import ServiceProcess, clone_sqlite, make_template
from tests.standins.slack_api import signed_headers

SECRET = "reliability-signing-secret"
TOKEN = "xoxb-reliability"
TEAM = "T0REL"
C_PLAIN = "C0PLAIN"
C_WORK = "C0WORK"
_ts = itertools.count(1)


def new_ts() -> str:
    return f"{int(time.time())}.{next(_ts):06d}"


def figures(name: str, **values: Any) -> str:
    """Print (and return) one line of figures for the note."""
    line = "FIGURES " + name + " " + " ".join(f"{k}={v}" for k, v in values.items())
    print(line, flush=True)
    return line


@pytest.fixture(scope="session")
def rel_template(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_template(tmp_path_factory.mktemp("rel-template"))


@pytest.fixture
def slack_api(tmp_path: Path) -> Iterator[Standin]:
    with Standin("slack_api", "--token", TOKEN, log_dir=tmp_path) as standin:
        yield standin


def slack_config(slack_api: Standin, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "runners": {"poll_interval_s": 0.2, "heartbeat_s": 0.5, "dead_after_s": 3.0},
        "slack": {"signing_secret": SECRET, "bot_token": TOKEN, "api_url": f"{slack_api.url}/api/"},
    }
    for key, value in extra.items():
        config.setdefault(key, {}).update(value)
    return config


def routes_for(org: str) -> list[list[str]]:
    return [route(org, "plain", "slack"), route(org, "worker", "slack", f"channel={C_WORK}")]


def sqlite_service(template: Any, workdir: Path, config: dict[str, Any]) -> ServiceProcess:
    """A (not started) service on a copy of the demo template with the Slack routes."""
    proc = ServiceProcess(workdir, config=config)
    assert proc.sqlite_file is not None
    clone_sqlite(template.database, proc.sqlite_file)
    proc.demo = template.demo
    admin_batch(proc, routes_for(template.demo.org))
    return proc


def pg_service(url: str, workdir: Path, config: dict[str, Any]) -> ServiceProcess:
    """A (not started) service on a fresh PostgreSQL database with the Slack routes."""
    proc = ServiceProcess(workdir, database_url=url, config=config)
    proc.upgrade_and_seed_demo(then=routes_for("demo"))
    return proc


@dataclass
class Sent:
    """One Slack message sent to the service."""

    channel: str
    text: str
    ts: str
    status: int | None = None  # HTTP status; None: no answer (connection refused/reset)

    @property
    def accepted(self) -> bool:
        return self.status == 200


@dataclass
class SlackRig:
    """Drives a service through Slack and checks the invariants afterwards."""

    proc: ServiceProcess
    slack: Standin
    sent: list[Sent] = field(default_factory=list)

    def post(self, message: Sent, *, timeout: float = 10.0) -> Sent:
        body = json.dumps(
            {
                "type": "event_callback",
                "team_id": TEAM,
                "event_id": f"Ev{uuid.uuid4().hex[:10]}",
                "event": {
                    "type": "message",
                    "channel": message.channel,
                    "user": "U0HUMAN",
                    "text": message.text,
                    "ts": message.ts,
                },
            }
        )
        headers = signed_headers(SECRET, body)
        try:
            status, _ = http(
                "POST",
                f"{self.proc.url}/slack/events",
                data=body.encode(),
                headers=headers,
                timeout=timeout,
            )
        except OSError:
            status = None
        message.status = status
        return message

    def operator(self, path: str) -> Any:
        assert self.proc.demo is not None
        return get_json(f"{self.proc.url}{path}", {"Authorization": f"Bearer {self.proc.demo.key}"})

    def decide(self, item_id: str, action: str) -> int:
        assert self.proc.demo is not None
        status, _ = http(
            "POST",
            f"{self.proc.url}/operator/reviews/{item_id}/{action}",
            json_body={},
            headers={"Authorization": f"Bearer {self.proc.demo.key}"},
        )
        return status

    def queue(self) -> list[dict[str, Any]]:
        return list(self.operator("/operator/reviews?limit=200")["items"])

    def posts(self) -> list[dict[str, Any]]:
        return self.slack.records("posts")

    # -- the invariant ----------------------------------------------------------------

    def settle(self, *, within_s: float = 60.0, approve: bool = True) -> float:
        """Approve what waits for a human (escalations) until every accepted message is
        answered or shown in the queue as deliveryUnknown; returns the seconds taken."""
        started = time.monotonic()
        while True:
            if approve:
                for item in self.queue():
                    if item["status"] == "awaitingHuman":
                        self.decide(item["id"], "approve")
            report = self.check(final=False)
            if report["lost"] == 0:
                return time.monotonic() - started
            if time.monotonic() - started > within_s:
                return time.monotonic() - started
            time.sleep(0.3)

    def check(self, *, final: bool = True) -> dict[str, int]:
        """accepted / answered / in queue / notice / lost / doubled (see the module doc)."""
        posts = self.posts()
        by_thread: dict[str, list[str]] = {}
        for post in posts:
            by_thread.setdefault(str(post["thread_ts"]), []).append(str(post["text"]))
        queued_threads = self._queued_threads()
        counts = Counter[str]()
        lost: list[str] = []
        for message in self.sent:
            if not message.accepted:
                continue
            counts["accepted"] += 1
            texts = by_thread.get(message.ts, [])
            if FAILURE_NOTICE in texts:
                counts["notice"] += 1
            elif texts:
                counts["answered"] += 1
            elif message.ts in queued_threads:
                counts["in_queue"] += 1
            else:
                counts["lost"] += 1
                lost.append(message.ts)
        doubled = sum(n - 1 for n in Counter((p["thread_ts"], p["text"]) for p in posts).values())
        counts["doubled"] = doubled
        if final:
            assert counts["lost"] == 0, (counts, self._where(lost), self.proc.log_tail(40))
            assert doubled == 0, counts
            self.check_audit()
        return {
            k: counts[k] for k in ("accepted", "answered", "in_queue", "notice", "lost", "doubled")
        }

    def _queued_threads(self) -> set[str]:
        threads = set()
        for item in self.queue():
            detail = self.operator(f"/operator/reviews/{item['id']}")
            unknown = any(d["status"] == "deliveryUnknown" for d in detail["deliveries"])
            if unknown or item["status"] == "awaitingHuman":
                threads |= self._threads_of(detail)
        # Uncertain posts no work item gates (plain replies): the operators' list.
        for delivery in self.operator("/operator/deliveries?limit=200")["deliveries"]:
            thread = delivery["address"].get("thread_ts")
            if thread:
                threads.add(str(thread))
        return threads

    def _where(self, lost: list[str]) -> dict[str, Any]:
        """What became of the lost messages' work items (for the failure message)."""
        found: dict[str, Any] = {ts: "no work item" for ts in lost}
        for row in self.operator("/operator/activity?limit=200")["items"]:
            detail = self.operator(f"/operator/reviews/{row['id']}")
            for ts in self._threads_of(detail) & set(lost):
                found[ts] = {
                    "status": detail["status"],
                    "deliveries": [(d["status"], d.get("kind")) for d in detail["deliveries"]],
                    "audit": [(a["action"], a.get("to")) for a in detail["audit"]][-4:],
                }
        return found

    def _threads_of(self, detail: dict[str, Any]) -> set[str]:
        # The item's messages carry their Slack ts in the test's texts ("... ts=<ts>").
        context = detail.get("taskContext") or ""
        return {part.split("=", 1)[1] for part in context.split() if part.startswith("ts=")}

    def check_audit(self) -> None:
        """Every work item's audit trail ends in the item's status (nothing skipped)."""
        rows = self.operator("/operator/activity")["items"]
        for row in rows:
            detail = self.operator(f"/operator/reviews/{row['id']}")
            moves = [a for a in detail["audit"] if a.get("to")]
            assert moves and moves[0]["action"] == "create", detail["audit"][:3]
            assert moves[-1]["to"] == detail["status"], (detail["id"], detail["status"], moves[-3:])


def message_counts(db: Path) -> tuple[int, int]:
    """(user messages, assistant messages) in an SQLite file."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        users = conn.execute("SELECT count(*) FROM messages WHERE role = 'user'").fetchone()[0]
        replies = conn.execute("SELECT count(*) FROM messages WHERE role = 'assistant'").fetchone()[
            0
        ]
    return int(users), int(replies)
