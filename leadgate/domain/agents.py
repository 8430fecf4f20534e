"""Agents and presets: the lead configuration rules and preset-first resolution (SPEC 2)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, TypedDict

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.errors import Conflict, NotFound, ValidationError, quoted
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain.orgs import validate_name
from leadgate.domain.rows import Agent, Preset


class CompletionPolicy(enum.StrEnum):
    """What the product promises after approval; stored on the item, never branched on."""

    completeAutomatically = "completeAutomatically"
    requestHumanApproval = "requestHumanApproval"


DEFAULT_POLICY = CompletionPolicy.requestHumanApproval
DEFAULT_ROUNDS = 3
MIN_ROUNDS, MAX_ROUNDS = 1, 5
UNSET: Any = object()


@dataclass(frozen=True)
class LeadConfig:
    """The resolved reviewer of a worker."""

    lead_agent_id: str
    completion_policy: CompletionPolicy
    max_revision_rounds: int
    source: str  # "preset" | "agent"


def validate_review_config(raw: Any) -> tuple[CompletionPolicy, int]:
    """Check ``leadReviewConfig``; unknown keys and out-of-range values are errors."""
    if raw is None:
        return DEFAULT_POLICY, DEFAULT_ROUNDS
    if not isinstance(raw, dict):
        raise ValidationError("leadReviewConfig must be an object", rule="leadReviewConfig.type")
    unknown = set(raw) - {"completionPolicy", "maxRevisionRounds"}
    if unknown:
        raise ValidationError(
            f"leadReviewConfig has unknown keys: {', '.join(sorted(unknown))}",
            rule="leadReviewConfig.unknown_key",
        )
    return (
        parse_policy(raw.get("completionPolicy", DEFAULT_POLICY.value)),
        parse_rounds(raw.get("maxRevisionRounds", DEFAULT_ROUNDS)),
    )


def parse_policy(value: Any) -> CompletionPolicy:
    """``completeAutomatically`` or ``requestHumanApproval``."""
    try:
        return CompletionPolicy(value)
    except (ValueError, TypeError):
        raise ValidationError(
            "completionPolicy must be completeAutomatically or requestHumanApproval",
            rule="leadReviewConfig.completionPolicy",
        ) from None


def parse_rounds(value: Any) -> int:
    """An integer 1..5 (booleans and floats are not integers here)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not MIN_ROUNDS <= value <= MAX_ROUNDS
    ):
        raise ValidationError(
            "maxRevisionRounds must be an integer from 1 to 5",
            rule="leadReviewConfig.maxRevisionRounds",
        )
    return value


def slugify(name: str) -> str:
    """URL-friendly agent slug."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "agent"


class AgentView(TypedDict):
    """An agent's public payload (REST API and admin CLI)."""

    id: str
    object: str
    name: str
    slug: str
    model: str
    instructions: str
    presetId: str | None
    active: bool
    createdAt: str | None
    updatedAt: str | None


def public_agent(agent: Agent) -> AgentView:
    """The public payload: never ``leadAgentId`` nor ``leadReviewConfig`` (SPEC 2)."""
    return {
        "id": agent.id,
        "object": "agent",
        "name": agent.name,
        "slug": agent.slug,
        "model": agent.model,
        "instructions": agent.instructions,
        "presetId": agent.preset_id,
        "active": bool(agent.active),
        "createdAt": iso(agent.created_at),
        "updatedAt": iso(agent.updated_at),
    }


def ref_params(ref: str) -> dict[str, str]:
    """The parameters :data:`REF_MATCH` binds for the reference ``ref``."""
    return {"p_ref": ref, "p_slug": slugify(ref)}


def unknown_agent(ref: str) -> NotFound:
    """The error for an agent ``ref`` names that ``ref``'s organization does not have."""
    return NotFound(f"no agent {quoted(ref)} in this organization", rule="agent.not_found")


def inactive_agent(agent: Agent) -> ValidationError:
    """The error for ``agent`` being deactivated (``agent.inactive``): it takes no
    messages and runs no turns."""
    return ValidationError(f"agent {quoted(agent.name)} is inactive", rule="agent.inactive")


_A = t.agents.c
_REF: sa.BindParameter[str] = sa.bindparam("p_ref")
_SLUG: sa.BindParameter[str] = sa.bindparam("p_slug")
#: An agent a reference names: its id, or its name in any case and spacing that gives the
#: same slug. Names are unique by slug, so "Worker", "worker" and "WORKER" are one agent
#: (looked up case-sensitively, "WORKER" was a 404 for an agent "Worker" that a second
#: agent "worker" could not be created beside). Bind with :func:`ref_params`.
REF_MATCH = sa.or_(_A.id == _REF, _A.slug == _SLUG, _A.name == _REF)
#: What a reference matches first: the id, then the name (the oldest agent among equals,
#: for agents from before slugs were unique). An id is always that agent's, whatever
#: another agent is named.
_REF_ORDER = (sa.case((_A.id == _REF, 0), else_=1), _A.created_at)
#: Built once: the plan cache keys on the statement object (see database.plans).
_FIND_ANY = (
    sa.select(t.agents).where(_A.org_id == sa.bindparam("p_org"), REF_MATCH).order_by(*_REF_ORDER)
)
_FIND = _FIND_ANY.where(_A.deleted_at.is_(None))


async def find_agent(conn: Conn, org_id: str, ref: str, *, include_deleted: bool = False) -> Agent:
    """An agent of ``org_id`` by id, slug or name (404 otherwise, also across orgs)."""
    query = _FIND_ANY if include_deleted else _FIND
    row = (await conn.execute(query, {"p_org": org_id, **ref_params(ref)})).first()
    if row is None:
        raise unknown_agent(ref)
    return Agent.from_row(row)


_P = t.presets.c
_PRESET_COLUMNS = {
    "preset_org_id": _P.org_id,
    "preset_lead_agent_id": _P.lead_agent_id,
    "preset_completion_policy": _P.completion_policy,
    "preset_max_revision_rounds": _P.max_revision_rounds,
}
# Built once: the turn path runs this on every intake, and building a statement (and its
# cache key) costs as much as executing it.
_AGENT_WITH_PRESET = (
    sa.select(t.agents, *(col.label(name) for name, col in _PRESET_COLUMNS.items()))
    .select_from(t.agents.outerjoin(t.presets, _P.id == t.agents.c.preset_id))
    .where(
        t.agents.c.org_id == sa.bindparam("p_org_id"),
        REF_MATCH,
        t.agents.c.deleted_at.is_(None),
    )
    .order_by(*_REF_ORDER)
)


async def find_agent_and_lead(conn: Conn, org_id: str, ref: str) -> tuple[Agent, LeadConfig | None]:
    """:func:`find_agent` (not deleted) and :func:`resolve_lead` in one statement."""
    row = (await conn.execute(_AGENT_WITH_PRESET, {"p_org_id": org_id, **ref_params(ref)})).first()
    if row is None:
        raise unknown_agent(ref)
    agent = Agent.from_row(row)
    mapping = row._mapping
    preset = {name[len("preset_") :]: mapping[name] for name in _PRESET_COLUMNS}
    return agent, _lead_of(agent, preset if agent.preset_id is not None else None)


async def find_preset(conn: Conn, org_id: str, ref: str) -> Preset:
    """An organization preset of ``org_id`` or a platform preset, by id, else by name
    (the organization's before the platform's). Two of one scope sharing the name
    (made before names were unique) are ``preset.ambiguous``: picking one could pick
    the one without a lead."""
    p = t.presets.c
    rows = (
        await conn.execute(
            sa.select(t.presets)
            .where(sa.or_(p.org_id == org_id, p.org_id.is_(None)))
            .where(sa.or_(p.id == ref, p.name == ref))
            .order_by(p.id != ref, p.org_id.is_(None), p.created_at)
        )
    ).all()
    if not rows:
        raise NotFound(f"no preset {quoted(ref)}", rule="preset.not_found")
    first = rows[0]
    if first.id != ref and any(r.org_id == first.org_id for r in rows[1:]):
        raise ValidationError(
            f"more than one preset is named {quoted(ref)}: name it by its id",
            rule="preset.ambiguous",
        )
    return Preset.from_row(first)


async def _check_lead(conn: Conn, org_id: str, lead_ref: str, worker_id: str | None) -> str:
    row = (
        await conn.execute(
            sa.select(t.agents).where(_A.org_id == org_id, REF_MATCH).order_by(*_REF_ORDER),
            ref_params(lead_ref),
        )
    ).first()
    if row is None:
        raise ValidationError(
            f"lead agent {quoted(lead_ref)} does not exist in this organization",
            rule="lead.not_found",
        )
    if worker_id is not None and row.id == worker_id:
        raise ValidationError("a worker cannot be its own lead", rule="lead.self")
    if row.deleted_at is not None:
        raise ValidationError(f"lead agent {quoted(lead_ref)} is deleted", rule="lead.deleted")
    if not row.active:
        raise ValidationError(f"lead agent {quoted(lead_ref)} is inactive", rule="lead.inactive")
    return str(row.id)


class ReviewConfigView(TypedDict):
    """A preset's lead review configuration."""

    completionPolicy: str
    maxRevisionRounds: int


class PresetView(TypedDict):
    """A new preset: ``kind`` is ``platform`` or ``organization``; the lead and its
    review configuration are ``None`` when it has no lead."""

    id: str
    name: str
    kind: str
    leadAgentId: str | None
    leadReviewConfig: ReviewConfigView | None


async def create_preset(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str | None,
    name: str,
    lead: str | None = None,
    review_config: dict[str, Any] | None = None,
) -> PresetView:
    """Create an organization preset (optionally with a lead) or a platform preset."""
    name = validate_name(name, "preset", id_prefix="pre")
    p = t.presets.c
    scope = p.org_id.is_(None) if org_id is None else p.org_id == org_id
    if await conn.scalar(sa.select(p.id).where(scope, p.name == name)):
        raise Conflict(f"a preset named {quoted(name)} already exists", rule="preset.name_taken")
    lead_id = None
    policy, rounds = validate_review_config(review_config)
    if org_id is None and (lead is not None or review_config):
        raise ValidationError("a platform preset never carries a lead", rule="preset.platform_lead")
    if lead is not None and org_id is not None:
        lead_id = await _check_lead(conn, org_id, lead, None)
    preset_id = ids.new("pre")
    values = {
        "id": preset_id,
        "org_id": org_id,
        "name": name,
        "lead_agent_id": lead_id,
        "completion_policy": policy.value if lead_id else None,
        "max_revision_rounds": rounds if lead_id else None,
        "created_at": clock.now_ms(),
    }
    await conn.execute(t.presets.insert().values(**values))
    return {
        "id": preset_id,
        "name": name,
        "kind": "platform" if org_id is None else "organization",
        "leadAgentId": lead_id,
        "leadReviewConfig": (
            {"completionPolicy": policy.value, "maxRevisionRounds": rounds} if lead_id else None
        ),
    }


async def save_agent(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    org_id: str,
    *,
    agent_ref: str | None = None,
    name: Any = UNSET,
    model: Any = UNSET,
    instructions: Any = UNSET,
    preset: Any = UNSET,
    lead: Any = UNSET,
    review_config: Any = UNSET,
    active: Any = UNSET,
    delete: bool = False,
    known_models: frozenset[str] | None = None,
) -> Agent:
    """Create (``agent_ref`` None) or update an agent, enforcing every save rule of SPEC 2.

    ``UNSET`` leaves a field as it is; ``lead=None`` clears the worker's own lead.
    Nothing is written unless every rule passes (the caller's transaction rolls back).
    Each rule is one function below; this one only collects their values.
    """
    now = clock.now_ms()
    current = None if agent_ref is None else await find_agent(conn, org_id, agent_ref)
    values: dict[str, Any] = {}
    values.update(await _name_values(conn, org_id, name, current))
    values.update(_model_values(model, current, known_models))
    values.update(_instructions_values(instructions))
    values.update(await _preset_values(conn, org_id, preset))
    preset_id = values.get("preset_id", current.preset_id if current else None)
    values.update(_activity_values(active, delete, now))
    values.update(await _lead_values(conn, org_id, lead, preset_id, current))
    values.update(_review_config_values(review_config))
    values["updated_at"] = now
    if current is None:
        agent_id = ids.new("agt")
        values.setdefault("instructions", "")
        values.setdefault("active", True)
        if "lead_agent_id" in values and "completion_policy" not in values:
            values["completion_policy"] = DEFAULT_POLICY.value
            values["max_revision_rounds"] = DEFAULT_ROUNDS
        await conn.execute(
            t.agents.insert().values(id=agent_id, org_id=org_id, created_at=now, **values)
        )
    else:
        agent_id = current.id
        if _unchanged(current, values):
            # A save that changes nothing writes nothing: on PostgreSQL every write to
            # agents NOTIFYs each replica, which drops its cached agents.
            return current
        await conn.execute(t.agents.update().where(t.agents.c.id == agent_id).values(**values))
    row = (await conn.execute(sa.select(t.agents).where(t.agents.c.id == agent_id))).one()
    return Agent.from_row(row)


def _unchanged(current: Agent, values: dict[str, Any]) -> bool:
    """True when ``values`` (column -> value, plus ``updated_at``) are what ``current``
    already holds."""
    stored = current._asdict()
    return all(
        column == "updated_at" or (column in stored and stored[column] == value)
        for column, value in values.items()
    )


async def _name_values(conn: Conn, org_id: str, name: Any, current: Agent | None) -> dict[str, Any]:
    """Rule ``agent.name`` (required, printable) and ``agent.name_taken`` (slug unique)."""
    if name is UNSET:
        if current is None:
            raise ValidationError("name is required", rule="agent.name")
        return {}
    if not isinstance(name, str):
        raise ValidationError("name must be a string", rule="agent.name")
    clean = validate_name(name, "agent", id_prefix="agt")
    slug = slugify(clean)
    clash = await conn.scalar(
        sa.select(t.agents.c.id).where(
            t.agents.c.org_id == org_id,
            t.agents.c.slug == slug,
            t.agents.c.id != (current.id if current else ""),
        )
    )
    if clash:
        raise Conflict(f"an agent named {quoted(clean)} already exists", rule="agent.name_taken")
    return {"name": clean, "slug": slug}


def _model_values(
    model: Any, current: Agent | None, known_models: frozenset[str] | None
) -> dict[str, Any]:
    """Rule ``agent.model``: a configured model; a new agent defaults to ``script``."""
    if model is UNSET:
        if current is not None:
            return {}
        if known_models is not None and "script" not in known_models:
            raise ValidationError(
                f"model is required; configured: {', '.join(sorted(known_models))}",
                rule="agent.model",
            )
        return {"model": "script"}
    if not isinstance(model, str) or not model:
        raise ValidationError("model must be a model name", rule="agent.model")
    if known_models is not None and model not in known_models:
        raise ValidationError(
            f"unknown model {quoted(model)}; configured: {', '.join(sorted(known_models))}",
            rule="agent.model",
        )
    return {"model": model}


def _instructions_values(instructions: Any) -> dict[str, Any]:
    """Rule ``agent.instructions``: a string of at most 100,000 characters."""
    if instructions is UNSET:
        return {}
    if not isinstance(instructions, str) or len(instructions) > 100_000:
        raise ValidationError(
            "instructions must be a string of at most 100,000 characters",
            rule="agent.instructions",
        )
    return {"instructions": instructions}


async def _preset_values(conn: Conn, org_id: str, preset: Any) -> dict[str, Any]:
    """Rule ``preset.not_found``: the preset is this organization's or a platform one."""
    if preset is UNSET:
        return {}
    if preset is None:
        return {"preset_id": None}
    return {"preset_id": (await find_preset(conn, org_id, str(preset))).id}


def _activity_values(active: Any, delete: bool, now: int) -> dict[str, Any]:
    """Activation and deletion (a deleted agent is inactive too)."""
    values: dict[str, Any] = {}
    if active is not UNSET:
        values["active"] = bool(active)
    if delete:
        values["deleted_at"] = now
        values["active"] = False
    return values


async def _lead_values(
    conn: Conn, org_id: str, lead: Any, preset_id: str | None, current: Agent | None
) -> dict[str, Any]:
    """Rules ``lead.preset_has_lead``, then ``lead.not_found`` / ``lead.self`` /
    ``lead.deleted`` / ``lead.inactive`` (:func:`_check_lead`); ``None`` clears."""
    if lead is UNSET:
        return {}
    if lead is None:
        return {"lead_agent_id": None}
    await _check_preset_has_no_lead(conn, preset_id)
    if not isinstance(lead, str):
        raise ValidationError("leadAgentId must be an agent id", rule="lead.not_found")
    return {"lead_agent_id": await _check_lead(conn, org_id, lead, current.id if current else None)}


async def _check_preset_has_no_lead(conn: Conn, preset_id: str | None) -> None:
    """Rule ``lead.preset_has_lead``: an organization preset with a lead decides."""
    if preset_id is None:
        return
    row = (await conn.execute(sa.select(t.presets).where(t.presets.c.id == preset_id))).one()
    if row.org_id is not None and row.lead_agent_id is not None:
        raise ValidationError(
            "this worker's organization preset already has a lead; it cannot set its own",
            rule="lead.preset_has_lead",
        )


def _review_config_values(review_config: Any) -> dict[str, Any]:
    """Rules ``leadReviewConfig.*`` (:func:`validate_review_config`)."""
    if review_config is UNSET:
        return {}
    policy, rounds = validate_review_config(review_config)
    return {"completion_policy": policy.value, "max_revision_rounds": rounds}


async def resolve_lead(conn: Conn, agent: Agent) -> LeadConfig | None:
    """Preset-first resolution. ``None`` = no gating at all for this worker."""
    preset = None
    if agent.preset_id is not None:
        preset = (
            await conn.execute(sa.select(t.presets).where(t.presets.c.id == agent.preset_id))
        ).first()
    return _lead_of(agent, None if preset is None else preset._mapping)


def _lead_of(agent: Agent, preset: Any) -> LeadConfig | None:
    """Preset-first resolution of ``agent`` given its preset row (mapping or ``None``)."""
    if preset is not None and preset["org_id"] is not None and preset["lead_agent_id"] is not None:
        return LeadConfig(
            lead_agent_id=preset["lead_agent_id"],
            completion_policy=CompletionPolicy(preset["completion_policy"] or DEFAULT_POLICY),
            max_revision_rounds=preset["max_revision_rounds"] or DEFAULT_ROUNDS,
            source="preset",
        )
    if agent.lead_agent_id is None:
        return None
    return LeadConfig(
        lead_agent_id=agent.lead_agent_id,
        completion_policy=CompletionPolicy(agent.completion_policy or DEFAULT_POLICY),
        max_revision_rounds=agent.max_revision_rounds or DEFAULT_ROUNDS,
        source="agent",
    )


async def list_agents(conn: Conn, org_id: str) -> list[Agent]:
    """The organization's agents (not deleted), oldest first."""
    a = t.agents.c
    rows = (
        await conn.execute(
            sa.select(t.agents)
            .where(a.org_id == org_id, a.deleted_at.is_(None))
            .order_by(a.created_at, a.id)
        )
    ).all()
    return [Agent.from_row(r) for r in rows]
