"""Reminders, escalation and expiry with two ``--role worker`` processes on one
PostgreSQL (plus an ``--role api`` process taking the requests): every firing happens
exactly once, whichever worker gets there first.

Real time here (three processes), so the timers are seconds: remind after 3 s,
escalate after 5 s, expire after 8 s. The fake-clock versions, including two runners at
once, are in ``tests/unit/test_review_sla.py``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.channel_kit import Operator, Standin, admin_batch, http, stays, wait_until
from tests.service_proc import Demo, ServiceProcess

TOKEN = "xoxb-sla"
ITEMS = 6


@pytest.fixture
def slack_api(tmp_path: Path) -> Iterator[Standin]:
    with Standin("slack_api", "--token", TOKEN, log_dir=tmp_path) as s:
        yield s


def _metric(proc: ServiceProcess, name: str) -> float:
    status, body = http("GET", f"{proc.url}/metrics")
    assert status == 200
    match = re.search(rf"^{name}\s+([0-9.eE+-]+)$", body.decode(), re.M)
    return float(match.group(1)) if match else 0.0


def test_two_workers_fire_each_reminder_escalation_and_expiry_once(
    pg_url: str, tmp_path: Path, slack_api: Standin
) -> None:
    config: dict[str, Any] = {
        "runners": {"poll_interval_s": 0.2},
        "slack": {"signing_secret": "s", "bot_token": TOKEN, "api_url": f"{slack_api.url}/api/"},
        "review": {"remind_after": "3s", "escalate_after": "5s", "expire_after": "8s"},
    }
    api = ServiceProcess(tmp_path / "api", database_url=pg_url, config=config, role="api")
    # One interpreter for the setup commands (each `leadgate` start costs seconds here).
    _, seeded, _, _ = admin_batch(
        api,
        [
            ["db", "upgrade"],
            ["demo", "--name", "demo"],
            ["notify", "add", "--org", "demo", "--channel", "slack", "--to", "C0REVIEW"],
            [
                "notify",
                "add",
                "--org",
                "demo",
                "--channel",
                "slack",
                "--to",
                "C0ESC",
                "--escalation",
            ],
        ],
    )
    demo = api.demo = Demo.from_cli(seeded)
    workers = [
        ServiceProcess(tmp_path / f"worker{i}", database_url=pg_url, config=config, role="worker")
        for i in range(2)
    ]
    started: list[ServiceProcess] = []
    try:
        for proc in (api, *workers):
            started.append(proc.start())
        marker = uuid.uuid4().hex[:8]
        for i in range(ITEMS):
            status, _ = http(
                "POST",
                f"{api.url}/v1/chat/completions",
                json_body={
                    "model": "worker",
                    "messages": [{"role": "user", "content": f"{marker}-{i} #escalate #complete"}],
                },
                headers={"Authorization": f"Bearer {demo.key}", "X-Session-Id": f"{marker}-{i}"},
            )
            assert status == 409  # gated: the lead escalates it in a worker

        op = Operator(api)

        def all_rejected() -> list[str] | None:
            details = [op.detail(row["id"]) for row in op.activity()]
            mine = [d for d in details if marker in d["taskContext"]]
            if len(mine) == ITEMS and all(d["status"] == "rejected" for d in mine):
                return [d["id"] for d in mine]
            return None

        items = wait_until(all_rejected, timeout=40, interval=0.5, what="every item expired")
        # Each item: one card, one reminder, one escalation; each card updated once.
        cards: dict[str, Counter[str]] = {i: Counter() for i in items}
        card_ts: list[str] = []

        def settled() -> bool:
            updated = Counter(
                c["ts"] for c in slack_api.records("calls") if c["method"] == "chat.update"
            )
            return len(card_ts) == 3 * ITEMS and all(updated[ts] == 1 for ts in card_ts)

        def read_cards() -> bool:
            cards.update({i: Counter() for i in items})
            card_ts.clear()
            for post in slack_api.records("posts"):
                values = {
                    e["value"]
                    for b in post.get("blocks") or []
                    if b["type"] == "actions"
                    for e in b["elements"]
                }
                for item_id in values & set(items):
                    header = post["blocks"][0]["text"]["text"]
                    cards[item_id][f"{post['channel']} {header.split(':')[0]}"] += 1
                    card_ts.append(post["ts"])
            return settled()

        wait_until(read_cards, timeout=30, interval=0.3, what="every card posted and updated")
        for item_id in items:
            assert cards[item_id] == {
                "C0REVIEW Review needed": 1,
                "C0REVIEW Reminder": 1,
                "C0ESC Escalation": 1,
            }, (item_id, cards[item_id])
            actions = [a["action"] for a in op.detail(item_id)["audit"]]
            assert actions.count("expire") == 1 and "reject" not in actions
        stays(read_cards, seconds=1.5, what="nothing fires twice")
        for name in (
            "leadgate_review_reminders_total",
            "leadgate_review_escalations_total",
            "leadgate_review_expiries_total",
        ):
            assert sum(_metric(w, name) for w in workers) == ITEMS, name
        assert json.loads(http("GET", f"{api.url}/healthz")[1])["role"] == "api"
    finally:
        for proc in reversed(started):
            proc.stop()
