"""The admin CLI's operations: organizations, keys, users, agents, presets, policy,
routes, schedules, flows and the demo organization.

Whoever can read the configuration can run these (they talk to the database the config
names), so they take no principal. Each is one transaction calling the domain; no rule
is checked here that the domain already checks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypedDict

from binding import routes
from leadgate.core.auth import ROLE_SCOPES, Principal, Role, Scope
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import NotFound, PermissionDenied
from leadgate.database.db import Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs, policy
from leadgate.domain.agents import UNSET
from leadgate.domain.rows import Agent

if TYPE_CHECKING:
    from leadgate.flows.runs import NewFlowView, RunView
    from leadgate.runners.schedules import NewScheduleView, RemovedScheduleView, ScheduleView

DEMO_AGENTS = ("worker", "lead", "plain")


def _flows() -> Any:
    """:mod:`leadgate.flows.runs`, imported on first use: it pulls in the turn path and
    the model SDKs (about a second), which every other admin command can do without."""
    from leadgate.flows import runs

    return runs


class ShownKeyView(orgs.NewKeyView):
    """A new key as ``key create`` shows it: its secret as ``apiKey`` too."""

    apiKey: str


class DemoView(TypedDict):
    """The demo organization: its Owner key, reused or new (``revokedKeyId``: the key
    ``--rotate-key`` revoked, else ``None``)."""

    org: str
    orgId: str
    apiKey: str
    agents: list[str]
    keyReused: bool
    revokedKeyId: str | None


class LeadView(TypedDict):
    """A worker's resolved lead (``source``: ``preset`` or ``agent``), which admin output
    shows and the public API never does."""

    leadAgentId: str
    completionPolicy: str
    maxRevisionRounds: int
    source: str


class AdminAgentView(agents_mod.AgentView):
    """An agent as ``agent create`` and ``agent update`` show it: with its resolved lead
    (``None``: it has none)."""

    lead: LeadView | None


class ListedAgentView(AdminAgentView):
    """An agent as ``agent list`` shows it: with its lead's name too (``None``: no lead,
    or the lead was deleted)."""

    leadName: str | None


class NamedRouteView(routes.RouteView):
    """A route as ``route list`` shows it: with its agent's name (``None``: the agent
    was deleted)."""

    agent: str | None


class Admin:
    """Admin operations on the database ``db`` (see the module docstring)."""

    def __init__(
        self, db: Database, clock: Clock, ids: IdFactory, model_names: frozenset[str]
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.model_names = model_names

    async def _org_id(self, conn: Any, ref: str) -> str:
        return (await orgs.find_org(conn, ref))["id"]

    async def create_org(self, name: str) -> orgs.NewOrgView:
        """An organization with an Owner key carrying every scope."""
        async with self.db.tx() as conn:
            return await orgs.create_org(conn, self.clock, self.ids, name)

    async def list_orgs(self) -> list[orgs.OrgView]:
        """Every organization on this database."""
        async with self.db.read() as conn:
            return await orgs.list_orgs(conn)

    async def create_key(
        self, org: str, scopes: list[str], name: str | None = None
    ) -> ShownKeyView:
        """A key with exactly ``scopes`` and an optional label, its secret shown once as
        ``apiKey`` (as ``org create`` and ``demo`` show theirs). ``key`` carries the same
        secret: a deprecated alias, kept for scripts written against earlier releases,
        which printed it there alone."""
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            created = await orgs.create_key(
                conn, self.clock, self.ids, org_id, orgs.parse_scopes(scopes), name=name
            )
        return {"id": created["id"], "apiKey": created["key"], **created}

    async def list_keys(self, org: str) -> list[orgs.KeyView]:
        """The organization's keys (ids, labels, scopes, revoked or not; never secrets)."""
        async with self.db.read() as conn:
            return await orgs.list_keys(conn, await self._org_id(conn, org))

    async def revoke_key(self, org: str, key_id: str) -> orgs.RevokedKeyView:
        """Revoke a key (refused everywhere within the 5 s principal cache time)."""
        async with self.db.tx() as conn:
            return await orgs.revoke_key(conn, self.clock, await self._org_id(conn, org), key_id)

    async def create_user(
        self, org: str, email: str, role: str, password: str, name: str | None = None
    ) -> orgs.NewUserView:
        """A console user (role in any case). The password is hashed first, so argon2
        never holds the write transaction."""
        password_hash = await asyncio.to_thread(orgs.hash_password, password)
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            return await orgs.create_user(
                conn, self.clock, self.ids, org_id, email, role, password_hash, name=name
            )

    async def list_users(self, org: str) -> list[orgs.ListedUserView]:
        """The organization's console users (role, disabled or not, open sessions)."""
        async with self.db.read() as conn:
            return await orgs.list_users(conn, self.clock, await self._org_id(conn, org))

    async def update_user(
        self, org: str, email: str, *, password: str | None = None, **changes: Any
    ) -> orgs.UpdatedUserView:
        """Change a console user (see :func:`leadgate.domain.orgs.update_user`); a new
        password is hashed first, so argon2 never holds the write transaction."""
        password_hash = (
            None if password is None else await asyncio.to_thread(orgs.hash_password, password)
        )
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            return await orgs.update_user(
                conn, self.clock, org_id, email, password_hash=password_hash, **changes
            )

    async def reviewer(self, org: str, as_email: str | None, name: str) -> Principal:
        """Who a command-line decision is made as: the console user ``as_email`` (who
        must hold ``agent:review``), or, without one, the command line itself, audited
        as ``name`` (``cli:<operating-system user>``). Whoever can read the config can
        reach the database anyway; this is about an honest audit trail."""
        async with self.db.read() as conn:
            org_id = await self._org_id(conn, org)
            if as_email is None:
                return Principal(org_id=org_id, scopes=frozenset({Scope.review}), name=name)
            user = await orgs.find_user(conn, org_id, as_email)
        scopes = ROLE_SCOPES[Role(user["role"])]
        if Scope.review not in scopes:
            raise PermissionDenied(
                f"{user['email']} is a {user['role']}: that role cannot review "
                "(Owner, Admin and Member can)",
                rule="scope.agent:review",
            )
        return Principal(org_id=org_id, scopes=scopes, user_id=user["id"])

    async def save_agent(
        self, org: str, *, ref: str | None = None, delete: bool = False, **fields: Any
    ) -> AdminAgentView:
        """Create (``ref`` None) or update an agent; the admin view shows the resolved lead."""
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            agent = await agents_mod.save_agent(
                conn,
                self.clock,
                self.ids,
                org_id,
                agent_ref=ref,
                delete=delete,
                known_models=self.model_names,
                **fields,
            )
            return await self._admin_view(conn, agent)

    async def list_agents(self, org: str) -> list[ListedAgentView]:
        """The organization's agents (not deleted), oldest first, each with its resolved
        lead (as ``agent create`` shows it) and that lead's name."""
        async with self.db.read() as conn:
            agents = await agents_mod.list_agents(conn, await self._org_id(conn, org))
            names = {agent.id: agent.name for agent in agents}
            views = [await self._admin_view(conn, agent) for agent in agents]
        listed: list[ListedAgentView] = []
        for view in views:
            lead = view["lead"]
            lead_name = None if lead is None else names.get(lead["leadAgentId"])
            listed.append({**view, "leadName": lead_name})
        return listed

    async def _admin_view(self, conn: Any, agent: Agent) -> AdminAgentView:
        lead = await agents_mod.resolve_lead(conn, agent)
        # Admin output shows the resolved lead; the public API never does.
        return {
            **agents_mod.public_agent(agent),
            "lead": (
                None
                if lead is None
                else LeadView(
                    leadAgentId=lead.lead_agent_id,
                    completionPolicy=lead.completion_policy.value,
                    maxRevisionRounds=lead.max_revision_rounds,
                    source=lead.source,
                )
            ),
        }

    async def create_preset(
        self,
        org: str | None,
        name: str,
        lead: str | None,
        review_config: dict[str, Any] | None,
    ) -> agents_mod.PresetView:
        """An organization preset (``org``), or a platform preset (``org`` None)."""
        async with self.db.tx() as conn:
            org_id = None if org is None else await self._org_id(conn, org)
            return await agents_mod.create_preset(
                conn,
                self.clock,
                self.ids,
                org_id=org_id,
                name=name,
                lead=lead,
                review_config=review_config,
            )

    async def add_policy_rule(self, org: str, pattern: str, action: str) -> policy.RuleView:
        """Append an output policy rule."""
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            return await policy.add_rule(conn, self.clock, self.ids, org_id, pattern, action)

    async def list_policy_rules(self, org: str) -> list[policy.RuleView]:
        """The output policy's rules, in the order they apply."""
        async with self.db.read() as conn:
            return await policy.list_rules(conn, await self._org_id(conn, org))

    async def remove_policy_rule(self, org: str, rule_id: str) -> policy.RemovedRuleView:
        """Delete an output policy rule (the next turn no longer applies it)."""
        async with self.db.tx() as conn:
            return await policy.remove_rule(conn, await self._org_id(conn, org), rule_id)

    async def add_route(
        self, org: str, agent: str, channel: str, match: list[str], silent: bool
    ) -> routes.NewRouteView:
        """Route a channel (``KEY=VALUE`` match keys) to an agent."""
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            found = await agents_mod.find_agent(conn, org_id, agent)
            return await routes.add_route(
                conn,
                self.clock,
                self.ids,
                org_id=org_id,
                agent_id=found.id,
                channel=channel,
                match=routes.parse_match(channel, match),
                silent=silent,
            )

    async def list_routes(self, org: str) -> list[NamedRouteView]:
        """The organization's routes, each with its agent's name (as schedules show)."""
        async with self.db.read() as conn:
            org_id = await self._org_id(conn, org)
            listed = await routes.list_routes(conn, org_id)
            names = {a.id: a.name for a in await agents_mod.list_agents(conn, org_id)}
        return [{**route, "agent": names.get(route["agentId"])} for route in listed]

    async def disable_route(self, org: str, route_id: str) -> routes.RouteView:
        """Deactivate a route."""
        async with self.db.tx() as conn:
            return await routes.disable_route(conn, await self._org_id(conn, org), route_id)

    async def add_schedule(self, org: str, agent: str, cron: str, message: str) -> NewScheduleView:
        """Run an agent on a cron schedule."""
        from leadgate.runners.schedules import add_schedule  # see _flows()

        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            found = await agents_mod.find_agent(conn, org_id, agent)
            if not found.active:
                # It would fail at every firing.
                raise agents_mod.inactive_agent(found)
            return await add_schedule(
                conn,
                self.clock,
                self.ids,
                org_id=org_id,
                agent_id=found.id,
                cron=cron,
                message=message,
            )

    async def list_schedules(self, org: str) -> list[ScheduleView]:
        """The organization's schedules."""
        from leadgate.runners.schedules import list_schedules  # see _flows()

        async with self.db.read() as conn:
            return await list_schedules(conn, await self._org_id(conn, org))

    async def remove_schedule(self, org: str, schedule_id: str) -> RemovedScheduleView:
        """Delete a schedule."""
        from leadgate.runners.schedules import remove_schedule  # see _flows()

        async with self.db.tx() as conn:
            return await remove_schedule(conn, await self._org_id(conn, org), schedule_id)

    async def create_flow(self, org: str, name: str, nodes: Any) -> NewFlowView:
        """A flow from its node list."""
        async with self.db.tx() as conn:
            org_id = await self._org_id(conn, org)
            flow: NewFlowView = await _flows().create_flow(
                conn, self.clock, self.ids, org_id, name, nodes
            )
            return flow

    async def show_run(self, org: str, run_id: str) -> RunView:
        """A flow run with its events and continuations."""
        async with self.db.read() as conn:
            run: RunView = await _flows().run_view(conn, await self._org_id(conn, org), run_id)
            return run

    async def org_id(self, org: str) -> str:
        """The id of an organization given by name or id."""
        async with self.db.read() as conn:
            return await self._org_id(conn, org)

    async def demo(self, name: str, *, key: str | None = None, rotate: bool = False) -> DemoView:
        """A demo organization: ``worker`` reviewed by ``lead``, and ``plain``; idempotent.

        ``key`` is the Owner key a previous run printed (``scripts/run.sh`` keeps it in a
        file): while it is valid for this organization it is reused (``keyReused``);
        otherwise, or with ``rotate``, a new Owner key is minted, and ``rotate`` revokes
        the old one. Without ``key`` every run mints a new key."""
        async with self.db.tx() as conn:
            try:
                org_id = await self._org_id(conn, name)
            except NotFound:
                org = await orgs.create_org(conn, self.clock, self.ids, name)
                org_id, fresh = org["id"], org["apiKey"]
                for agent, lead in (("lead", UNSET), ("worker", "lead"), ("plain", UNSET)):
                    await agents_mod.save_agent(
                        conn, self.clock, self.ids, org_id, name=agent, model="script", lead=lead
                    )
                return self._demo_out(name, org_id, fresh, reused=False, revoked=None)
            known = await orgs.key_status(conn, key) if key else None
            valid = known is not None and known[1] == org_id
            if valid and not rotate:
                return self._demo_out(name, org_id, str(key), reused=True, revoked=None)
            revoked = None
            if valid and known is not None:
                await orgs.revoke_key(conn, self.clock, org_id, known[0])
                revoked = known[0]
            created = await orgs.create_key(
                conn, self.clock, self.ids, org_id, ROLE_SCOPES[Role.owner], name="demo owner"
            )
        return self._demo_out(name, org_id, created["key"], reused=False, revoked=revoked)

    @staticmethod
    def _demo_out(
        name: str, org_id: str, key: str, *, reused: bool, revoked: str | None
    ) -> DemoView:
        return {
            "org": name,
            "orgId": org_id,
            "apiKey": key,
            "agents": list(DEMO_AGENTS),
            "keyReused": reused,
            "revokedKeyId": revoked,
        }
