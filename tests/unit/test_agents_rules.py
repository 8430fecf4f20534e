"""Lead configuration save rules and preset-first resolution (SPEC 2); organizations,
API keys, roles and scopes (SPEC 1)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.auth import ROLE_SCOPES, Principal, Role, Scope
from leadgate.core.clock import DAY_MS
from leadgate.core.errors import Conflict, NotFound, PermissionDenied, ValidationError
from leadgate.database import schema as t
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs
from leadgate.domain.agents import CompletionPolicy, validate_review_config
from leadgate.domain.rows import Agent
from tests.helpers import (
    Org,
    beside_a_locker_in_key_order,
    make_agent,
    make_key,
    make_org,
    seq_scans_only,
)
from tests.stack import Stack, build_stack

SaveCall = Callable[[Any], Awaitable[Any]]


async def table_rows(stack: Stack, *tables: sa.Table) -> dict[str, list[dict[str, Any]]]:
    """Every row of ``tables``, ordered by id (to compare before/after)."""
    out: dict[str, list[dict[str, Any]]] = {}
    async with stack.db.read() as conn:
        for table in tables:
            rows = (await conn.execute(sa.select(table).order_by(table.c.id))).all()
            out[table.name] = [dict(r._mapping) for r in rows]
    return out


async def save(stack: Stack, org: Org, **kwargs: Any) -> Agent:
    async with stack.db.tx() as conn:
        return await agents_mod.save_agent(conn, stack.clock, stack.ids, org.id, **kwargs)


async def preset(
    stack: Stack, org_id: str | None, name: str, **kwargs: Any
) -> agents_mod.PresetView:
    async with stack.db.tx() as conn:
        return await agents_mod.create_preset(
            conn, stack.clock, stack.ids, org_id=org_id, name=name, **kwargs
        )


async def resolved(stack: Stack, org: Org, ref: str) -> agents_mod.LeadConfig | None:
    async with stack.db.read() as conn:
        row = await agents_mod.find_agent(conn, org.id, ref)
        return await agents_mod.resolve_lead(conn, row)


# --------------------------------------------------------------------------- pure rules


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        ({"completionPolicy": "sometimes"}, "leadReviewConfig.completionPolicy"),
        ({"completionPolicy": None}, "leadReviewConfig.completionPolicy"),
        ({"completionPolicy": ["completeAutomatically"]}, "leadReviewConfig.completionPolicy"),
        ({"maxRevisionRounds": 0}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": 6}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": -1}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": "3"}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": True}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": 2.5}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": 3.0}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRevisionRounds": None}, "leadReviewConfig.maxRevisionRounds"),
        ({"maxRounds": 3}, "leadReviewConfig.unknown_key"),
        ({"completionPolicy": "requestHumanApproval", "x": 1}, "leadReviewConfig.unknown_key"),
        ("requestHumanApproval", "leadReviewConfig.type"),
        ([1, 2], "leadReviewConfig.type"),
    ],
)
def test_review_config_rejections(raw: Any, rule: str) -> None:
    with pytest.raises(ValidationError) as info:
        validate_review_config(raw)
    assert info.value.rule == rule
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, (CompletionPolicy.requestHumanApproval, 3)),
        ({}, (CompletionPolicy.requestHumanApproval, 3)),
        (
            {"completionPolicy": "completeAutomatically"},
            (CompletionPolicy.completeAutomatically, 3),
        ),
        ({"maxRevisionRounds": 1}, (CompletionPolicy.requestHumanApproval, 1)),
        (
            {"completionPolicy": "requestHumanApproval", "maxRevisionRounds": 5},
            (CompletionPolicy.requestHumanApproval, 5),
        ),
    ],
)
def test_review_config_accepted_values_and_defaults(raw: Any, expected: Any) -> None:
    assert validate_review_config(raw) == expected


# ------------------------------------------------------------------------ save rules


async def test_every_rejected_save_names_its_rule_and_changes_nothing(stack: Stack) -> None:
    org = await make_org(stack, "acme")
    other = await make_org(stack, "other")
    lead = await make_agent(stack, org, "lead")
    await make_agent(stack, org, "lead2")
    await make_agent(stack, org, "idle")
    await save(stack, org, agent_ref="idle", active=False)
    await make_agent(stack, org, "gone")
    await save(stack, org, agent_ref="gone", delete=True)
    foreign = await make_agent(stack, other, "foreign")
    await preset(stack, org.id, "with-lead", lead="lead")
    worker = await make_agent(stack, org, "w", lead="lead")
    await make_agent(stack, org, "pw", preset="with-lead")

    cases: list[tuple[str, SaveCall]] = [
        ("lead.self", lambda c: _save(stack, org, c, agent_ref="w", lead="w")),
        ("agent.name", lambda c: _save(stack, org, c, agent_ref="idle", name=worker["id"])),
        ("agent.name", lambda c: _save(stack, org, c, name="AGT_x")),
        ("lead.self", lambda c: _save(stack, org, c, agent_ref="w", lead=worker["id"])),
        ("lead.not_found", lambda c: _save(stack, org, c, name="x", lead="nosuch")),
        ("lead.not_found", lambda c: _save(stack, org, c, name="x", lead="foreign")),
        ("lead.not_found", lambda c: _save(stack, org, c, name="x", lead=foreign["id"])),
        ("lead.not_found", lambda c: _save(stack, org, c, agent_ref="w", lead="nosuch")),
        ("lead.inactive", lambda c: _save(stack, org, c, name="x", lead="idle")),
        ("lead.inactive", lambda c: _save(stack, org, c, agent_ref="w", lead="idle")),
        ("lead.deleted", lambda c: _save(stack, org, c, name="x", lead="gone")),
        ("lead.deleted", lambda c: _save(stack, org, c, agent_ref="w", lead="gone")),
        ("lead.preset_has_lead", lambda c: _save(stack, org, c, agent_ref="pw", lead="lead2")),
        (
            "lead.preset_has_lead",
            lambda c: _save(stack, org, c, name="x", preset="with-lead", lead="lead2"),
        ),
        (
            "lead.preset_has_lead",
            lambda c: _save(stack, org, c, agent_ref="w", preset="with-lead", lead="lead"),
        ),
        (
            "leadReviewConfig.completionPolicy",
            lambda c: _save(
                stack, org, c, name="x", lead="lead", review_config={"completionPolicy": "x"}
            ),
        ),
        (
            "leadReviewConfig.completionPolicy",
            lambda c: _save(
                stack, org, c, agent_ref="w", review_config={"completionPolicy": "never"}
            ),
        ),
        *[
            (
                "leadReviewConfig.maxRevisionRounds",
                _rounds_case(stack, org, bad),
            )
            for bad in (0, 6, "3", True, 2.5)
        ],
        (
            "leadReviewConfig.unknown_key",
            lambda c: _save(
                stack, org, c, agent_ref="w", review_config={"maxRevisionRounds": 2, "z": 1}
            ),
        ),
        (
            "preset.platform_lead",
            lambda c: agents_mod.create_preset(
                c, stack.clock, stack.ids, org_id=None, name="plat", lead="lead"
            ),
        ),
        (
            "preset.platform_lead",
            lambda c: agents_mod.create_preset(
                c,
                stack.clock,
                stack.ids,
                org_id=None,
                name="plat",
                review_config={"maxRevisionRounds": 2},
            ),
        ),
        (
            "lead.inactive",
            lambda c: agents_mod.create_preset(
                c, stack.clock, stack.ids, org_id=org.id, name="p2", lead="idle"
            ),
        ),
        (
            "leadReviewConfig.maxRevisionRounds",
            lambda c: agents_mod.create_preset(
                c,
                stack.clock,
                stack.ids,
                org_id=org.id,
                name="p3",
                lead="lead",
                review_config={"maxRevisionRounds": 9},
            ),
        ),
    ]
    stack.clock.advance(DAY_MS)
    for rule, call in cases:
        before = await table_rows(stack, t.agents, t.presets)
        with pytest.raises(ValidationError) as info:
            async with stack.db.tx() as conn:
                await call(conn)
        assert info.value.rule == rule, (rule, info.value.message)
        assert info.value.status == 400
        after = await table_rows(stack, t.agents, t.presets)
        assert after == before, f"a rejected save ({rule}) changed the database"
    # the worker still has its original lead and defaults
    config = await resolved(stack, org, "w")
    assert config is not None
    assert config.lead_agent_id == lead["id"]
    assert (config.completion_policy, config.max_revision_rounds) == (
        CompletionPolicy.requestHumanApproval,
        3,
    )


async def test_an_id_names_its_agent_before_any_name(stack: Stack) -> None:
    """A name like another agent's id (saved before names were checked) does not take
    over lookups by that id; the id, then the slug, then the name is matched."""
    org = await make_org(stack, "acme")
    gated = await make_agent(stack, org, "gated", lead=(await make_agent(stack, org, "l"))["id"])
    plain = await make_agent(stack, org, "plain")
    async with stack.db.tx() as conn:  # older than `gated` too, as it would be in a real clash
        await conn.execute(
            t.agents.update()
            .where(t.agents.c.id == plain["id"])
            .values(name=gated["id"], created_at=gated["created_at"] - 1)
        )
    async with stack.db.read() as conn:
        assert (await agents_mod.find_agent(conn, org.id, gated["id"])).id == gated["id"]
        agent, lead = await agents_mod.find_agent_and_lead(conn, org.id, gated["id"])
        assert agent.id == gated["id"] and lead is not None
        assert (await agents_mod.find_agent(conn, org.id, "plain")).id == plain["id"]


async def test_a_save_that_changes_nothing_writes_nothing(stack: Stack) -> None:
    """Nothing given, or every value as it is: no UPDATE (on PostgreSQL each write to
    agents NOTIFYs every replica, which drops its cached agents), updated_at kept."""
    org = await make_org(stack, "acme")
    lead = await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead=lead["id"])
    stack.clock.advance(DAY_MS)
    before = await table_rows(stack, t.agents)
    async with stack.db.tx() as conn:
        assert (await _save(stack, org, conn, agent_ref="worker")) == Agent(**worker)
        same = await _save(
            stack, org, conn, agent_ref="worker", name="worker", lead=lead["id"], active=True
        )
        assert same == Agent(**worker)
    assert await table_rows(stack, t.agents) == before
    async with stack.db.tx() as conn:
        changed = await _save(stack, org, conn, agent_ref="worker", instructions="be brief")
    assert changed.updated_at == worker["updated_at"] + DAY_MS


async def test_two_agents_may_lead_each_other(stack: Stack) -> None:
    """Peer review: a lead's review is a model call of its own, not a turn that is
    itself gated, so a pair of agents leading each other reviews each other's work and
    nothing loops."""
    org = await make_org(stack, "acme")
    first = await make_agent(stack, org, "first")
    second = await make_agent(stack, org, "second", lead=first["id"])
    await save(stack, org, agent_ref="first", lead=second["id"])
    first_lead = await resolved(stack, org, "first")
    second_lead = await resolved(stack, org, "second")
    assert first_lead is not None and first_lead.lead_agent_id == second["id"]
    assert second_lead is not None and second_lead.lead_agent_id == first["id"]


def _save(stack: Stack, org: Org, conn: Any, **kwargs: Any) -> Awaitable[Any]:
    return agents_mod.save_agent(conn, stack.clock, stack.ids, org.id, **kwargs)


def _rounds_case(stack: Stack, org: Org, bad: Any) -> SaveCall:
    return lambda c: _save(
        stack, org, c, name="x", lead="lead", review_config={"maxRevisionRounds": bad}
    )


async def test_lead_defaults_preset_first_resolution_and_public_payload(
    stack: Stack,
) -> None:
    org = await make_org(stack)
    lead = await make_agent(stack, org, "lead")
    own_lead = await make_agent(stack, org, "own-lead")

    # Defaults: requestHumanApproval / 3 when a lead is set without a config.
    worker = await make_agent(stack, org, "worker", lead="lead")
    assert worker["lead_agent_id"] == lead["id"]
    assert worker["completion_policy"] == "requestHumanApproval"
    assert worker["max_revision_rounds"] == 3
    # Public payloads never carry the lead fields.
    body = agents_mod.public_agent(Agent(**worker))
    assert body["id"] == worker["id"]
    for hidden in ("leadAgentId", "leadReviewConfig", "lead_agent_id", "completion"):
        assert hidden not in repr(body)

    tuned = await make_agent(
        stack,
        org,
        "tuned",
        lead=lead["id"],
        review_config={"completionPolicy": "completeAutomatically", "maxRevisionRounds": 5},
    )
    assert await resolved(stack, org, tuned["id"]) == agents_mod.LeadConfig(
        lead_agent_id=lead["id"],
        completion_policy=CompletionPolicy.completeAutomatically,
        max_revision_rounds=5,
        source="agent",
    )
    # lead=None clears the worker's own lead: no gating at all.
    await save(stack, org, agent_ref="tuned", lead=None)
    assert await resolved(stack, org, "tuned") is None
    # The boundary values 1 and 5 are accepted.
    for rounds in (1, 5):
        row = await save(
            stack, org, agent_ref="worker", review_config={"maxRevisionRounds": rounds}
        )
        assert row.max_revision_rounds == rounds

    org_preset = await preset(
        stack,
        org.id,
        "reviewed",
        lead="lead",
        review_config={"completionPolicy": "completeAutomatically", "maxRevisionRounds": 2},
    )
    assert org_preset["kind"] == "organization"
    assert org_preset["leadAgentId"] == lead["id"]
    plain_preset = await preset(stack, org.id, "plain-org-preset")
    platform = await preset(stack, None, "platform")
    assert platform["kind"] == "platform"
    assert platform["leadAgentId"] is None

    # A worker with its own lead that later moves onto the org preset: the preset wins.
    await make_agent(stack, org, "w1", lead="own-lead", review_config={"maxRevisionRounds": 4})
    await save(stack, org, agent_ref="w1", preset="reviewed")
    assert await resolved(stack, org, "w1") == agents_mod.LeadConfig(
        lead_agent_id=lead["id"],
        completion_policy=CompletionPolicy.completeAutomatically,
        max_revision_rounds=2,
        source="preset",
    )
    # Platform preset: the worker's own columns apply.
    await make_agent(stack, org, "w2", lead="own-lead", preset=platform["id"])
    config = await resolved(stack, org, "w2")
    assert config is not None
    assert (config.lead_agent_id, config.source, config.max_revision_rounds) == (
        own_lead["id"],
        "agent",
        3,
    )
    # Org preset without a lead: the worker's own columns apply too.
    await make_agent(stack, org, "w3", lead="own-lead", preset=plain_preset["id"])
    config = await resolved(stack, org, "w3")
    assert config is not None
    assert (config.lead_agent_id, config.source) == (own_lead["id"], "agent")
    # No lead anywhere: None.
    await make_agent(stack, org, "w4", preset=platform["id"])
    assert await resolved(stack, org, "w4") is None
    await make_agent(stack, org, "w5")
    assert await resolved(stack, org, "w5") is None


# ------------------------------------------------------------------- orgs and API keys


@pytest.mark.parametrize(
    ("values", "ok"),
    [
        (["agent:trigger"], True),
        (["agent:trigger", "agent:review", "agent:trigger"], True),
        (["agent:delete"], False),
        (["agent:trigger", "admin"], False),
        (["AGENT:TRIGGER"], False),
        ([], False),
    ],
)
def test_parse_scopes(values: list[str], ok: bool) -> None:
    if ok:
        assert orgs.parse_scopes(values) == frozenset(Scope(v) for v in values)
    else:
        with pytest.raises(ValidationError) as info:
            orgs.parse_scopes(values)
        assert info.value.rule == "key.scope"


def test_role_scope_mapping() -> None:
    assert Scope.review in ROLE_SCOPES[Role.owner]
    assert Scope.review in ROLE_SCOPES[Role.admin]
    assert Scope.review in ROLE_SCOPES[Role.member]
    assert Scope.review not in ROLE_SCOPES[Role.viewer]
    assert Scope.update in ROLE_SCOPES[Role.owner]
    assert Scope.update in ROLE_SCOPES[Role.admin]
    assert Scope.update not in ROLE_SCOPES[Role.member]
    assert Scope.update not in ROLE_SCOPES[Role.viewer]
    assert Scope.trigger in ROLE_SCOPES[Role.owner]
    assert Scope.trigger in ROLE_SCOPES[Role.admin]
    assert Scope.trigger in ROLE_SCOPES[Role.member]
    assert Scope.trigger not in ROLE_SCOPES[Role.viewer]
    viewer = Principal(org_id="o", scopes=ROLE_SCOPES[Role.viewer], user_id="u")
    with pytest.raises(PermissionDenied) as info:
        viewer.require(Scope.review)
    assert info.value.rule == "scope.agent:review"
    assert viewer.actor == "user:u"


async def test_keys_are_hashed_scoped_and_never_cross_organizations(stack: Stack) -> None:
    org = await make_org(stack, "acme")
    other = await make_org(stack, "other")
    prefix, key_id, secret = org.key.split(".")
    _, other_id, other_secret = other.key.split(".")
    assert prefix == "lg"
    assert len(secret) >= 40
    trigger_only = await make_key(stack, org, Scope.trigger)

    # Shown once, stored hashed: no raw secret anywhere in the tables.
    dump = await table_rows(stack, t.api_keys, t.organizations)
    assert len(dump["api_keys"]) == 3
    everything = repr(dump)
    for raw in (org.key, other.key, trigger_only):
        assert raw.split(".")[2] not in everything
    row = next(r for r in dump["api_keys"] if r["id"] == key_id)
    assert len(row["secret_hash"]) == 64
    assert sorted(row["scopes"]) == ["agent:review", "agent:trigger", "agent:update"]
    assert org.principal.org_id == org.id
    assert org.principal.scopes == ROLE_SCOPES[Role.owner]
    assert org.principal.key_id == key_id

    # Scopes are enforced.
    async with stack.db.read() as conn:
        principal = await orgs.authenticate_key(conn, trigger_only)
    assert principal is not None
    assert principal.org_id == org.id
    assert principal.scopes == frozenset({Scope.trigger})
    principal.require(Scope.trigger)
    for missing in (Scope.review, Scope.update):
        with pytest.raises(PermissionDenied) as denied:
            principal.require(missing)
        assert denied.value.rule == f"scope.{missing.value}"
        assert denied.value.status == 403

    # Malformed and mixed keys authenticate nobody.
    bad = [
        "",
        "lg",
        "lg.",
        f"lg.{key_id}",
        f"lg.{key_id}.",
        f"xx.{key_id}.{secret}",
        f"lg.{key_id}.{secret}x",
        f"lg.{key_id}.{secret}.extra",
        f"lg.{key_id}.{other_secret}",  # key id of one org, secret of another
        f"lg.{other_id}.{secret}",
        f"lg.nokey.{secret}",
        f"lg.{key_id}.{secret}" + "a" * 200,
        f"Bearer {org.key}",
    ]
    async with stack.db.read() as conn:
        for raw in bad:
            assert await orgs.authenticate_key(conn, raw) is None, raw
        assert await orgs.authenticate_key(conn, org.key) is not None

    # Revoked: None; the other organization's key is unaffected.
    async with stack.db.tx() as conn:
        await conn.execute(
            t.api_keys.update()
            .where(t.api_keys.c.id == key_id)
            .values(revoked_at=stack.clock.now_ms())
        )
    async with stack.db.read() as conn:
        assert await orgs.authenticate_key(conn, org.key) is None
        still = await orgs.authenticate_key(conn, other.key)
    assert still is not None and still.org_id == other.id

    # Nothing crosses organizations: the other org cannot see our agent.
    mine = await make_agent(stack, org, "mine")
    async with stack.db.read() as conn:
        for ref in (mine["id"], "mine"):
            with pytest.raises(NotFound):
                await agents_mod.find_agent(conn, other.id, ref)
        assert (await agents_mod.find_agent(conn, org.id, mine["id"])).id == mine["id"]

    # A duplicate organization or a bad name writes nothing.
    before = await table_rows(stack, t.organizations, t.api_keys)
    with pytest.raises(Conflict) as conflict:
        async with stack.db.tx() as conn:
            await orgs.create_org(conn, stack.clock, stack.ids, "acme")
    assert conflict.value.rule == "org.name_taken"
    for name in ("", "   ", "x" * 201, "tab\there"):
        with pytest.raises(ValidationError):
            async with stack.db.tx() as conn:
                await orgs.create_org(conn, stack.clock, stack.ids, name)
    assert await table_rows(stack, t.organizations, t.api_keys) == before


async def test_user_roles_map_to_scopes_through_console_sessions(stack: Stack) -> None:
    org = await make_org(stack)
    expected = {
        "Viewer": frozenset(),
        "Member": frozenset({Scope.trigger, Scope.review}),
        "Admin": frozenset({Scope.trigger, Scope.review, Scope.update}),
        "Owner": frozenset({Scope.trigger, Scope.review, Scope.update}),
    }
    now = stack.clock.now_ms()
    # Users and sessions are inserted directly (argon2 hashing is deliberately slow and
    # is not what this test is about); authenticate_session maps the role to scopes.
    async with stack.db.tx() as conn:
        for role in expected:
            await conn.execute(
                t.users.insert().values(
                    id=f"usr_{role}",
                    org_id=org.id,
                    email=f"{role.lower()}@example.com",
                    role=role,
                    password_hash="unused",
                    created_at=now,
                )
            )
            await conn.execute(
                t.console_sessions.insert().values(
                    id=f"cs_{role}",
                    token_hash=orgs._hash_secret(f"token-{role}"),
                    user_id=f"usr_{role}",
                    expires_at=now + DAY_MS,
                    created_at=now,
                )
            )
    async with stack.db.read() as conn:
        for role, scopes in expected.items():
            principal = await orgs.authenticate_session(conn, stack.clock, f"token-{role}")
            assert principal is not None, role
            assert principal.scopes == scopes, role
            assert (principal.org_id, principal.user_id) == (org.id, f"usr_{role}")
        assert await orgs.authenticate_session(conn, stack.clock, "token-nobody") is None
    stack.clock.advance(DAY_MS)
    async with stack.db.read() as conn:
        assert await orgs.authenticate_session(conn, stack.clock, "token-Member") is None
    with pytest.raises(ValidationError) as info:
        async with stack.db.tx() as conn:
            await orgs.create_user(
                conn,
                stack.clock,
                stack.ids,
                org.id,
                "x@example.com",
                "Boss",
                orgs.hash_password("long enough"),
            )
    assert info.value.rule == "user.role"


@pytest.mark.parametrize("delete", ["expired at a login", "a user's ended"])
async def test_console_sessions_are_deleted_in_id_order(migrated_pg: str, delete: str) -> None:
    """A login deleted the expired console sessions (anyone's), and a user's password
    change or disabling deleted theirs, in the order its scan found them: at size a
    sequential scan, physical order. Beside a transaction holding two of them in id
    order (another login's, or a user's sessions ended), it held the second while it
    waited for the first, and PostgreSQL ended one of the two (40P01). Each now locks
    its rows in id order first."""
    await seq_scans_only(migrated_pg)
    stack = build_stack(migrated_pg)
    try:
        org = await make_org(stack)
        now = stack.clock.now_ms()
        s = t.console_sessions.c
        async with stack.db.tx() as conn:
            await conn.execute(
                t.users.insert().values(
                    id="usr_1", org_id=org.id, email="u@example.com", role="Member",
                    password_hash="unused", created_at=now,
                )
            )  # fmt: skip
            for sid in ("cs_1", "cs_2"):
                await conn.execute(
                    t.console_sessions.insert().values(
                        id=sid, token_hash=orgs._hash_secret(sid), user_id="usr_1",
                        expires_at=now, created_at=now,
                    )
                )  # fmt: skip
        async with stack.db.tx() as conn:
            # The first session's newest version goes after the second's in the table:
            # a scan in physical order finds the second first.
            await conn.execute(
                t.console_sessions.update().where(s.id == "cs_1").values(expires_at=now)
            )

        async def deleting() -> None:
            async with stack.db.tx() as conn:
                if delete == "expired at a login":
                    await orgs.create_console_session(conn, stack.clock, stack.ids, "usr_1", DAY_MS)
                else:
                    await orgs.update_user(
                        conn, stack.clock, org.id, "u@example.com", end_sessions=True
                    )

        await beside_a_locker_in_key_order(
            stack.db, t.console_sessions, [("cs_1",), ("cs_2",)], deleting
        )
        async with stack.db.read() as conn:
            kept = (await conn.execute(sa.select(s.id))).scalars().all()
        assert not {"cs_1", "cs_2"} & set(kept)
    finally:
        await stack.stop()


async def test_preset_names_are_unique_and_an_ambiguous_name_is_refused(stack: Stack) -> None:
    # Two presets named alike: an agent made "with" it got the one without a lead, and
    # its work went out unreviewed.
    org = await make_org(stack)
    await save(stack, org, name="lead")
    first = await preset(stack, org.id, "pz")
    with pytest.raises(Conflict) as taken:
        await preset(stack, org.id, "pz", lead="lead")
    assert taken.value.rule == "preset.name_taken"
    with pytest.raises(ValidationError) as id_like:
        await preset(stack, org.id, "pre_0123")
    assert id_like.value.rule == "preset.name"
    # The same name in another scope is fine: the organization's is found first.
    platform = await preset(stack, None, "pz")
    async with stack.db.read() as conn:
        assert (await agents_mod.find_preset(conn, org.id, "pz")).id == first["id"]
        assert (await agents_mod.find_preset(conn, org.id, platform["id"])).id == platform["id"]
    # A duplicate made before names were unique: named, it is refused; by id, found.
    async with stack.db.tx() as conn:
        await conn.execute(
            t.presets.insert().values(
                id="pre_legacy", org_id=org.id, name="pz", created_at=stack.clock.now_ms()
            )
        )
    async with stack.db.read() as conn:
        with pytest.raises(ValidationError) as ambiguous:
            await agents_mod.find_preset(conn, org.id, "pz")
        assert ambiguous.value.rule == "preset.ambiguous"
        assert (await agents_mod.find_preset(conn, org.id, "pre_legacy")).id == "pre_legacy"
