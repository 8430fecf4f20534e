"""Upgrading a database that holds data, on SQLite and PostgreSQL: rows written at an
earlier schema revision (raw SQL valid there) are upgraded to the newest one by
``leadgate db upgrade``'s own code, then the product works over them: the review queue
and detail list an item that was awaiting a person, approving it reveals it, the relay
sends a delivery that was pending, a key created before the upgrade authenticates, and
a flow run left running (before run leases) is recovered and finishes."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer
from alembic import command
from alembic.script import ScriptDirectory

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.database.db import alembic_config, upgrade
from leadgate.flows.recovery import FlowRecovery
from leadgate.flows.runs import run_view
from tests.outbox_support import ScriptedChannel
from tests.unit.test_migration_0016 import run as run_sql

SECRET = "old-secret"
KEY = f"lg.key_old.{SECRET}"
T = 1_700_000_000_000  # when the rows were written: before the FakeClock's start
ADDRESS = '{"team": "T1", "channel": "C1", "thread_ts": "1.1"}'
#: Rows as an earlier version wrote them: the columns every revision from 0001 on has
#: (later columns have defaults or are nullable).
ROWS = [
    f"INSERT INTO organizations (id, name, created_at) VALUES ('org_1', 'acme', {T})",
    *(
        "INSERT INTO agents (id, org_id, name, slug, model, instructions, preset_id, "
        "lead_agent_id, completion_policy, max_revision_rounds, active, deleted_at, "
        f"created_at, updated_at) VALUES ('{aid}', 'org_1', '{name}', '{name}', 'script', "
        f"'', NULL, {lead}, NULL, NULL, TRUE, NULL, {T}, {T})"
        for aid, name, lead in (("agt_lead", "lead", "NULL"), ("agt_w", "worker", "'agt_lead'"))
    ),
    "INSERT INTO api_keys (id, org_id, secret_hash, scopes, created_at, revoked_at) VALUES "
    f"('key_old', 'org_1', '{hashlib.sha256(SECRET.encode()).hexdigest()}', "
    f"""'["agent:review", "agent:trigger"]', {T}, NULL)""",
    "INSERT INTO sessions (id, org_id, agent_id, key, created_at) VALUES "
    f"('ses_1', 'org_1', 'agt_w', 'h:alice', {T})",
    "INSERT INTO bindings (id, org_id, session_id, kind, address, silent, route_id, active, "
    f"created_at) VALUES ('bnd_1', 'org_1', 'ses_1', 'slack', '{ADDRESS}', FALSE, NULL, TRUE, "
    f"{T})",
    "INSERT INTO messages (id, org_id, session_id, work_item_id, role, content, lead_gated, "
    f"tool_name, created_at) VALUES ('msg_1', 'org_1', 'ses_1', NULL, 'user', 'summarize Q3', "
    f"FALSE, NULL, {T}), ('msg_2', 'org_1', 'ses_1', 'wi_1', 'assistant', 'Q3 went well', "
    f"TRUE, NULL, {T + 1})",
    "INSERT INTO work_items (id, org_id, agent_id, session_id, lead_agent_id, status, "
    "completion_policy, max_revision_rounds, revision, extra_allowance, task_context, "
    "signal_summary, signal_turn_id, summary, snapshot, gated_message_id, binding_id, "
    "pending_feedback, last_feedback, lease_token, lease_expires_at, lease_expiries, "
    "last_activity_at, created_at, updated_at) VALUES ('wi_1', 'org_1', 'agt_w', 'ses_1', "
    "'agt_lead', 'awaitingHuman', 'requestHumanApproval', 3, 0, 0, 'summarize Q3', "
    "'Q3 summary', NULL, 'Q3 summary', 'Q3 went well', 'msg_2', 'bnd_1', NULL, NULL, NULL, "
    f"NULL, 0, {T}, {T}, {T})",
    "INSERT INTO audit (id, org_id, work_item_id, delivery_id, actor, action, from_status, "
    f"to_status, text, created_at) VALUES ('aud_1', 'org_1', 'wi_1', NULL, 'lead', "
    f"'escalated', 'reviewing', 'awaitingHuman', NULL, {T})",
    # A flow run the old version's process was executing when it stopped (no lease).
    "INSERT INTO flows (id, org_id, name, nodes, created_at) VALUES ('flw_1', 'org_1', "
    f"""'report', '[{{"type": "output", "value": 2}}]', {T})""",
    "INSERT INTO flow_runs (id, org_id, flow_id, status, outputs, start_index, resumed_from, "
    f"error, created_at, updated_at) VALUES ('run_1', 'org_1', 'flw_1', 'running', '[]', 0, "
    f"NULL, NULL, {T}, {T})",
    # A plain reply the relay had not sent yet when the old version stopped.
    "INSERT INTO deliveries (id, org_id, work_item_id, kind, action, channel, binding_id, "
    "address, text, status, attempts, next_attempt_at, lease_token, lease_expires_at, error, "
    "external_id, created_at, updated_at) VALUES ('dlv_1', 'org_1', NULL, 'reply', 'post', "
    f"'slack', 'bnd_1', '{ADDRESS}', 'hello from before', 'pending', 0, {T}, NULL, NULL, "
    f"NULL, NULL, {T}, {T})",
]


def write_at(url: str, revision: str) -> None:
    """Migrate an empty ``url`` to ``revision`` and write :data:`ROWS` there."""
    command.upgrade(alembic_config(url), revision)

    def insert(conn: sa.Connection) -> None:
        for sql in ROWS:
            conn.execute(sa.text(sql))

    run_sql(url, insert)


async def drive(url: str) -> None:
    slack = ScriptedChannel("slack")
    settings = Settings.model_validate({"database": {"url": url}})
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels={"slack": slack})
    client = TestClient(TestServer(service.web_app(), host="127.0.0.1"))
    await client.start_server()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        await service.db.check_migrated()

        async def get(path: str) -> Any:
            resp = await client.get(path, headers=auth)
            assert resp.status == 200, await resp.text()
            return await resp.json()

        page = await get("/operator/reviews")
        assert [(i["id"], i["status"]) for i in page["items"]] == [("wi_1", "awaitingHuman")]
        detail = await get("/operator/reviews/wi_1")
        assert detail["status"] == "awaitingHuman"
        assert "Q3 went well" in str(detail)

        # The pending reply from before the upgrade is sent; approving the item posts it.
        await drain(service.relay)
        assert [m.text for m in slack.calls] == ["hello from before"]
        resp = await client.post("/operator/reviews/wi_1/approve", headers=auth)
        assert resp.status == 200, await resp.text()
        await drain(service.relay)
        assert "Q3 went well" in slack.calls[-1].text, slack.calls
        async with service.db.read() as conn:
            status = (
                await conn.execute(sa.text("SELECT status FROM work_items WHERE id = 'wi_1'"))
            ).scalar_one()
        assert status == "completed"
        assert (await get("/operator/reviews"))["items"] == []

        # The flow run left running is taken over by recovery and finishes.
        await drain(FlowRecovery(service.flows))
        async with service.db.read() as conn:
            run = await run_view(conn, "org_1", "run_1")
        assert (run["status"], run["outputs"]) == ("completed", [{"data": 2, "success": True}])
    finally:
        await client.close()
        await service.stop()


@pytest.mark.parametrize("revision", ["0004", "0014"])
def test_rows_written_at_an_earlier_revision_work_after_db_upgrade(
    db_url: str, revision: str
) -> None:
    """0004: before session events (0005), review episodes and cards (0006), lease owners
    (0007) and key names (0008); 0014: before flow-run leases (0015) and the
    continuation and recovery changes after it."""
    write_at(db_url, revision)
    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    assert upgrade(db_url) == head
    assert upgrade(db_url) == head  # again: nothing to do
    asyncio.run(drive(db_url))


def test_an_upgrade_that_fails_midway_leaves_the_database_as_it_was(db_url: str) -> None:
    """Every pending revision is applied in one transaction, on SQLite too: 0005 adds
    ``sessions.event_seq`` and then meets a table in its way. On SQLite the column stayed
    (each DDL statement committed alone) with the revision still 0004, and every later
    ``db upgrade`` failed on it."""
    write_at(db_url, "0004")
    run_sql(db_url, lambda conn: conn.execute(sa.text("CREATE TABLE session_events (x INT)")))
    with pytest.raises(sa.exc.DBAPIError):
        upgrade(db_url)

    def state(conn: sa.Connection) -> tuple[Any, list[str]]:
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
        return version, [c["name"] for c in sa.inspect(conn).get_columns("sessions")]

    assert run_sql(db_url, state) == ("0004", ["id", "org_id", "agent_id", "key", "created_at"])
    run_sql(db_url, lambda conn: conn.execute(sa.text("DROP TABLE session_events")))
    upgrade(db_url)
    asyncio.run(drive(db_url))
