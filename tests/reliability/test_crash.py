"""SIGKILL of ``leadgate serve`` during a burst of gated turns, approvals and deliveries,
on SQLite and on PostgreSQL; then a restart on the same database.

The burst is signed Slack messages, three kinds mixed: plain (``plain`` answers at
once), gated (``worker`` + ``#complete``: the lead approves, the approved text is posted)
and escalated (``#complete #escalate``: a human approves through the operator API, some
during the burst, the rest after the restart). The service is SIGKILLed once about half
of the burst was acknowledged; messages that got no answer are sent again (as Slack
redelivers them). Afterwards every acknowledged message must be answered in its thread,
visible in the actionable queue, or answered with a failure notice; nothing posted twice;
every item's audit trail ends in its status.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.channel_kit import Standin
from tests.reliability.conftest import (
    C_PLAIN,
    C_WORK,
    Sent,
    SlackRig,
    figures,
    new_ts,
    pg_service,
    slack_config,
    sqlite_service,
)

BURST = 45
LONG_BURST = 400


def burst(count: int) -> list[Sent]:
    messages = []
    for i in range(count):
        ts = new_ts()
        kind = i % 3
        if kind == 0:
            messages.append(Sent(C_PLAIN, f"hello {i} ts={ts}", ts))
        elif kind == 1:
            messages.append(Sent(C_WORK, f"task {i} ts={ts} #complete", ts))
        else:
            messages.append(Sent(C_WORK, f"task {i} ts={ts} #complete #escalate", ts))
    return messages


def run_crash(proc: Any, slack: Standin, count: int, name: str) -> dict[str, Any]:
    rig = SlackRig(proc, slack)
    proc.start()
    messages = burst(count)
    rig.sent = messages
    acked = 0
    killed_at = 0.0
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(rig.post, m, timeout=5.0) for m in messages]
        for done in concurrent.futures.as_completed(futures):
            if done.result().accepted:
                acked += 1
                if acked == 3:
                    # Approvals in flight too: whatever waits for a human now.
                    for item in rig.queue():
                        if item["status"] == "awaitingHuman":
                            pool.submit(rig.decide, item["id"], "approve")
            if acked >= count // 2 and not killed_at:
                proc.kill()
                killed_at = time.monotonic()
    assert killed_at, "the burst ended before the kill"
    at_kill = sum(m.accepted for m in messages)
    proc.start()
    restarted = time.monotonic()
    # Slack redelivers what was not acknowledged.
    for message in messages:
        if not message.accepted:
            rig.post(message)
    recovery_s = rig.settle(within_s=90)
    report = rig.check()
    result = {
        **report,
        "acked_before_kill": at_kill,
        "restart_s": round(restarted - killed_at, 2),
        "recovery_s": round(recovery_s, 2),
    }
    figures(name, **result)
    proc.stop()
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_sigkill_mid_burst_loses_and_doubles_nothing(
    backend: str, rel_template: Any, slack_api: Standin, tmp_path: Path, request: Any
) -> None:
    config = slack_config(slack_api)
    if backend == "sqlite":
        proc = sqlite_service(rel_template, tmp_path / "svc", config)
    else:
        proc = pg_service(request.getfixturevalue("pg_url"), tmp_path / "svc", config)
    result = run_crash(proc, slack_api, BURST, f"sigkill-{backend}")
    assert result["accepted"] == BURST  # every message was acknowledged in the end
    assert result["lost"] == 0 and result["doubled"] == 0


@pytest.mark.long
# Five services started, loaded and killed in turn: on PostgreSQL about 30 s each on a
# slow machine, past the suite's default timeout of 120 s for one test.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_sigkill_long_form(
    backend: str, rel_template: Any, slack_api: Standin, tmp_path: Path, request: Any
) -> None:
    config = slack_config(slack_api)
    for run in range(5):
        if backend == "sqlite":
            proc = sqlite_service(rel_template, tmp_path / f"svc{run}", config)
        else:
            proc = pg_service(request.getfixturevalue("pg_url"), tmp_path / f"svc{run}", config)
        result = run_crash(proc, slack_api, LONG_BURST, f"sigkill-long-{backend}-{run}")
        assert result["lost"] == 0 and result["doubled"] == 0
        slack_api.control("reset")


REST_TURNS = 40


@pytest.mark.timeout(300)
def test_sigkill_mid_rest_burst_leaves_no_item_stranded(rel_template: Any, tmp_path: Path) -> None:
    """REST ``#complete`` turns cut by a SIGKILL, retried by the client as the openai
    client does (a request that got no answer is sent again, same session): every item
    ends reviewed (``completed``) or with a human (``awaitingHuman``: a signal committed by
    a cut turn), none left ``inProgress`` for the 7-day sweeper. A retry that arrives
    after its cut turn's item was already delivered is a new message, with an item of
    its own (README, "Reliability and security")."""
    from tests.reliability.conftest import sqlite_service
    from tests.reliability.test_faults import chat, wait_all_completed

    proc = sqlite_service(rel_template, tmp_path / "svc", {"runners": {"poll_interval_s": 0.2}})
    proc.start()
    texts = [f"rest {i} #complete" for i in range(REST_TURNS)]
    answers: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        futures = {pool.submit(chat, proc, "worker", t, timeout=10): t for t in texts}
        done = 0
        for future in concurrent.futures.as_completed(futures):
            answers[futures[future]] = future.result()[0]
            done += 1
            if done == REST_TURNS // 4:
                proc.kill()
                killed_at = time.monotonic()
    cut = [t for t, status in answers.items() if status not in (200, 409)]
    proc.start()
    restarted = time.monotonic()
    retried = {t: chat(proc, "worker", t)[0] for t in cut}  # the client's retry
    final = wait_all_completed(proc, within_s=90)
    figures(
        "sigkill-rest",
        turns=REST_TURNS,
        answered_before_kill=REST_TURNS - len(cut),
        cut=len(cut),
        retry_statuses=dict(sorted(Counter(retried.values()).items())),
        items=final,
        restart_s=round(restarted - killed_at, 2),
    )
    proc.stop()
    assert cut, "the kill came after every answer"
    assert set(retried.values()) <= {409}, retried  # gated again, or busy (surfaced)
    assert set(final) <= {"completed", "awaitingHuman"}, final
    # Every turn made its item; a cut turn whose item was already reviewed and delivered
    # when the client's retry arrived makes a second one for the retry (a new message:
    # without an Idempotency-Key the service cannot tell it from a new request).
    assert REST_TURNS <= sum(final.values()) <= REST_TURNS + len(cut), final
