"""One function per admin subcommand: each calls the operations layer and returns JSON.

:data:`COMMANDS` maps ``(command, subcommand)`` to its function; ``leadgate.cli.main``
parses the arguments, builds the :class:`~leadgate.operations.admin.Admin` and prints
what the function returns.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from leadgate.app import App
from leadgate.cli.review_commands import REVIEW_COMMANDS
from leadgate.core.config import Settings
from leadgate.core.errors import ValidationError
from leadgate.operations.admin import Admin

Command = Callable[[Admin, argparse.Namespace, Settings], Awaitable[Any]]


def _review_config(args: argparse.Namespace) -> dict[str, Any] | None:
    config: dict[str, Any] = {}
    if args.completion_policy is not None:
        config["completionPolicy"] = args.completion_policy
    if args.max_revision_rounds is not None:
        config["maxRevisionRounds"] = args.max_revision_rounds
    return config or None


def _agent_fields(args: argparse.Namespace) -> dict[str, Any]:
    """save_agent keywords of ``agent create`` / ``agent update`` (unset options omitted)."""
    fields: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("name", "model", "instructions", "preset")
        if getattr(args, name, None) is not None
    }
    if args.lead is not None:
        fields["lead"] = args.lead
    if getattr(args, "no_lead", False):
        fields["lead"] = None
    config = _review_config(args)
    if config is not None:
        fields["review_config"] = config
    return fields


async def org_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate org create NAME``."""
    return await admin.create_org(args.name)


async def key_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate key create --org ORG --scope S ...``."""
    return await admin.create_key(args.org, args.scopes)


async def user_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate user create --org ORG --email E --role R [--password P]``."""
    password = args.password or os.environ.get("LEADGATE_PASSWORD", "")
    return await admin.create_user(args.org, args.email, args.role, password)


async def agent_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate agent create --org ORG --name NAME [...]``."""
    return await admin.save_agent(args.org, **_agent_fields(args))


async def agent_update(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate agent update --org ORG AGENT [...] [--deactivate|--activate|--delete]``."""
    fields = _agent_fields(args)
    if args.deactivate:
        fields["active"] = False
    if args.activate:
        fields["active"] = True
    return await admin.save_agent(args.org, ref=args.agent, delete=args.delete, **fields)


async def preset_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate preset create (--org ORG | --platform) --name NAME [lead options]``."""
    if args.platform == bool(args.org):
        raise ValidationError("give exactly one of --org ORG or --platform", rule="preset.kind")
    return await admin.create_preset(
        None if args.platform else args.org, args.name, args.lead, _review_config(args)
    )


async def policy_add(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate policy add --org ORG --pattern REGEX --action block|redact``."""
    return await admin.add_policy_rule(args.org, args.pattern, args.action)


async def route_add(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate route add --org ORG --agent NAME --channel C [--match K=V ...] [--silent]``."""
    return await admin.add_route(args.org, args.agent, args.channel, args.match, args.silent)


async def route_list(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate route list --org ORG``."""
    return await admin.list_routes(args.org)


async def route_disable(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate route disable --org ORG ROUTE_ID``."""
    return await admin.disable_route(args.org, args.route)


async def schedule_add(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate schedule add --org ORG --agent NAME --cron EXPR --message TEXT``."""
    return await admin.add_schedule(args.org, args.agent, args.cron, args.message)


def _read_nodes(value: str) -> Any:
    """``--nodes``: a JSON list, or ``@FILE`` holding one."""
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as fh:
                value = fh.read()
        except OSError as exc:
            raise ValidationError(
                f"cannot read {value[1:]}: {exc.strerror}", rule="flow.nodes"
            ) from exc
    try:
        return json.loads(value)
    except ValueError:
        raise ValidationError("--nodes is not valid JSON", rule="flow.nodes") from None


async def flow_create(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate flow create --org ORG --name NAME --nodes JSON|@FILE``."""
    return await admin.create_flow(args.org, args.name, _read_nodes(args.nodes))


async def flow_show(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate flow show --org ORG RUN_ID``."""
    return await admin.show_run(args.org, args.run)


async def flow_run(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate flow run --org ORG FLOW``: runs turns, so it needs the whole service."""
    org_id = await admin.org_id(args.org)
    app = App(settings, enable_adapters=False)
    try:
        run_id = await app.flows.start(org_id, args.flow)
        return await Admin(app.db, app.clock, app.ids, app.model_names).show_run(org_id, run_id)
    finally:
        await app.stop()


async def demo(admin: Admin, args: argparse.Namespace, _: Settings) -> Any:
    """``leadgate demo [--name demo]``: the quick-start organization (idempotent)."""
    return await admin.demo(args.name)


COMMANDS: dict[tuple[str, str | None], Command] = {
    ("org", "create"): org_create,
    ("key", "create"): key_create,
    ("user", "create"): user_create,
    ("agent", "create"): agent_create,
    ("agent", "update"): agent_update,
    ("preset", "create"): preset_create,
    ("policy", "add"): policy_add,
    ("route", "add"): route_add,
    ("route", "list"): route_list,
    ("route", "disable"): route_disable,
    ("schedule", "add"): schedule_add,
    ("flow", "create"): flow_create,
    ("flow", "run"): flow_run,
    ("flow", "show"): flow_show,
    ("demo", None): demo,
}
COMMANDS.update(REVIEW_COMMANDS)
