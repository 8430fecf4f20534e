"""A relay process killed mid-send: nothing lost, nothing posted twice.

A real relay process (``python -m tests.relay_proc``: Database, SlackChannel, Relay)
drains approved deliveries to the Slack stand-in running as its own process. The
stand-in answers the first posts and then holds requests open (``hang``); the relay is
SIGKILLed while those sends are in flight. A second relay (same short send lease) takes
over: every delivery must end either posted exactly once (by the stand-in's own record)
and ``sent``, or ``deliveryUnknown`` (and posted at most once); none pending or sending,
none posted twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from leadgate.core.clock import RandomIds, SystemClock
from leadgate.database import schema as t
from leadgate.database.db import Database
from tests.helpers import eventually
from tests.outbox_support import (
    MigratedTemplates,
    RelayProcess,
    StandinProcess,
    delivery_counts,
    seed_items,
)

N = 40
OK_FIRST = 10
HANGING = 6
RELAY = {"lease_ms": 1500, "concurrency": HANGING, "batch": 10, "poll_s": 0.05}


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplates:
    return MigratedTemplates(tmp_path_factory.mktemp("outbox-crash-templates"))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, templates: MigratedTemplates, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return templates.sqlite_url(tmp_path / "crash.db")
    return templates.pg_url(request.getfixturevalue("postgres_server"))


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    proc = StandinProcess()
    yield proc
    proc.stop()


async def test_sigkill_mid_send_loses_nothing_and_posts_nothing_twice(
    url: str, standin: StandinProcess
) -> None:
    db = Database(url)
    try:
        seeded = await seed_items(db, SystemClock(), RandomIds(), N)
        standin.queue(*(["ok"] * OK_FIRST + ["hang"] * HANGING))
        first = RelayProcess(url, standin.api_url, timeout_s=60, **RELAY)
        survivor: RelayProcess | None = None
        try:
            first.wait_ready()
            await eventually(
                lambda: len(standin.requests()) >= OK_FIRST + HANGING,
                30,
                what="the first relay having every concurrency slot hanging",
            )
            assert first.proc.poll() is None
            first.kill()

            survivor = RelayProcess(url, standin.api_url, timeout_s=5, **RELAY)
            survivor.wait_ready()

            async def settled() -> bool:
                counts = await delivery_counts(db)
                return not counts.get("pending") and not counts.get("sending")

            await eventually(settled, 30, what="the deliveries settled")
            stats = survivor.stop()
        finally:
            for proc in (first, survivor):
                if proc is not None and proc.proc.poll() is None:
                    proc.kill()

        posted = Counter(p["text"] for p in standin.posts())
        async with db.read() as conn:
            rows = (
                await conn.execute(
                    sa.select(
                        t.deliveries.c.text,
                        t.deliveries.c.status,
                        t.work_items.c.status.label("item_status"),
                    ).join(t.work_items, t.work_items.c.id == t.deliveries.c.work_item_id)
                )
            ).all()
        assert len(rows) == N
        assert max(posted.values()) == 1, "a message was posted twice"
        assert set(posted) <= {r.text for r in rows}
        by_status = Counter(r.status for r in rows)
        assert set(by_status) <= {"sent", "deliveryUnknown"}, by_status
        for r in rows:
            if r.status == "sent":
                assert posted[r.text] == 1 and r.item_status == "completed"
            else:
                assert posted[r.text] <= 1 and r.item_status == "approved"
        # The hanging sends cannot have been confirmed by anyone: uncertain.
        assert by_status["deliveryUnknown"] >= HANGING
        # The survivor posted what the first relay never claimed.
        assert stats.get("sent", 0) >= 1
        assert by_status["sent"] >= OK_FIRST
        assert len(seeded.deliveries) == N
    finally:
        await db.close()
