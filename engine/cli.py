"""``leadgate``: serve, and the admin commands (JSON on stdout, errors on stderr).

Exit codes: 0 success, 2 a rule was broken (the message names it), 1 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from typing import Any

from engine import agents as agents_mod
from engine import orgs, policy
from engine.auth import ROLE_SCOPES, Role
from engine.clock import RandomIds, SystemClock
from engine.config import Settings, load_settings
from engine.db import Database, upgrade
from engine.errors import LeadgateError, ValidationError

log = logging.getLogger("leadgate")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leadgate", description=__doc__)
    parser.add_argument(
        "--config", default=os.environ.get("LEADGATE_CONFIG"), help="TOML config file"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", default=argparse.SUPPRESS, help="TOML config file")
        return p

    serve = with_config(sub.add_parser("serve", help="run the service"))
    serve.add_argument("--role", choices=["api", "worker", "all"], default="all")

    db = sub.add_parser("db", help="database commands")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    with_config(dbsub.add_parser("upgrade", help="migrate to the newest schema"))

    org = sub.add_parser("org", help="organizations")
    orgsub = org.add_subparsers(dest="org_command", required=True)
    oc = with_config(orgsub.add_parser("create", help="create an organization + Owner key"))
    oc.add_argument("name")

    key = sub.add_parser("key", help="API keys")
    keysub = key.add_subparsers(dest="key_command", required=True)
    kc = with_config(keysub.add_parser("create", help="create a scoped API key"))
    kc.add_argument("--org", required=True)
    kc.add_argument("--scope", action="append", required=True, dest="scopes")

    user = sub.add_parser("user", help="console users")
    usersub = user.add_subparsers(dest="user_command", required=True)
    uc = with_config(usersub.add_parser("create", help="create a console user"))
    uc.add_argument("--org", required=True)
    uc.add_argument("--email", required=True)
    uc.add_argument("--role", required=True, choices=[r.value for r in Role])
    uc.add_argument("--password", help="default: $LEADGATE_PASSWORD")

    def lead_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--lead")
        p.add_argument("--completion-policy")
        p.add_argument("--max-revision-rounds", type=int)

    agent = sub.add_parser("agent", help="agents")
    agentsub = agent.add_subparsers(dest="agent_command", required=True)
    ac = with_config(agentsub.add_parser("create", help="create an agent"))
    ac.add_argument("--org", required=True)
    ac.add_argument("--name", required=True)
    ac.add_argument("--preset")
    ac.add_argument("--model")
    ac.add_argument("--instructions")
    lead_options(ac)
    au = with_config(agentsub.add_parser("update", help="update an agent"))
    au.add_argument("agent")
    au.add_argument("--org", required=True)
    au.add_argument("--name")
    au.add_argument("--preset")
    au.add_argument("--model")
    au.add_argument("--instructions")
    au.add_argument("--no-lead", action="store_true", help="clear the worker's own lead")
    lead_options(au)
    au.add_argument("--deactivate", action="store_true")
    au.add_argument("--activate", action="store_true")
    au.add_argument("--delete", action="store_true")

    preset = sub.add_parser("preset", help="presets")
    presetsub = preset.add_subparsers(dest="preset_command", required=True)
    pc = with_config(presetsub.add_parser("create", help="create a preset"))
    pc.add_argument("--org")
    pc.add_argument("--platform", action="store_true")
    pc.add_argument("--name", required=True)
    lead_options(pc)

    pol = sub.add_parser("policy", help="organization output policy")
    polsub = pol.add_subparsers(dest="policy_command", required=True)
    pa = with_config(polsub.add_parser("add", help="append a rule"))
    pa.add_argument("--org", required=True)
    pa.add_argument("--pattern", required=True)
    pa.add_argument("--action", required=True, choices=["block", "redact"])

    route = sub.add_parser("route", help="channel routes")
    routesub = route.add_subparsers(dest="route_command", required=True)
    ra = with_config(routesub.add_parser("add", help="route a channel to an agent"))
    ra.add_argument("--org", required=True)
    ra.add_argument("--agent", required=True)
    ra.add_argument("--channel", required=True, choices=["slack", "discord", "teams", "email"])
    ra.add_argument("--match", action="append", default=[])
    ra.add_argument("--silent", action="store_true")

    rl = with_config(routesub.add_parser("list", help="list the organization's routes"))
    rl.add_argument("--org", required=True)
    rd = with_config(routesub.add_parser("disable", help="deactivate a route"))
    rd.add_argument("--org", required=True)
    rd.add_argument("route")

    sched = sub.add_parser("schedule", help="scheduled triggers")
    schedsub = sched.add_subparsers(dest="schedule_command", required=True)
    sa_ = with_config(schedsub.add_parser("add", help="run an agent on a cron schedule"))
    sa_.add_argument("--org", required=True)
    sa_.add_argument("--agent", required=True)
    sa_.add_argument("--cron", required=True)
    sa_.add_argument("--message", required=True)

    flow = sub.add_parser("flow", help="ActionFlows")
    flowsub = flow.add_subparsers(dest="flow_command", required=True)
    fc = with_config(flowsub.add_parser("create", help="create a flow from a JSON node list"))
    fc.add_argument("--org", required=True)
    fc.add_argument("--name", required=True)
    fc.add_argument("--nodes", required=True, help="JSON list of nodes, or @FILE")
    fr = with_config(flowsub.add_parser("run", help="start a flow run"))
    fr.add_argument("--org", required=True)
    fr.add_argument("flow")
    fs = with_config(flowsub.add_parser("show", help="show a flow run"))
    fs.add_argument("--org", required=True)
    fs.add_argument("run")

    demo = with_config(sub.add_parser("demo", help="create the demo organization (idempotent)"))
    demo.add_argument("--name", default="demo")
    return parser


def _review_config(args: argparse.Namespace) -> dict[str, Any] | None:
    config: dict[str, Any] = {}
    if args.completion_policy is not None:
        config["completionPolicy"] = args.completion_policy
    if args.max_revision_rounds is not None:
        config["maxRevisionRounds"] = args.max_revision_rounds
    return config or None


async def _admin(settings: Settings, args: argparse.Namespace) -> Any:
    db = Database(settings.database.url)
    clock, ids = SystemClock(), RandomIds()
    try:
        await db.check_migrated()
        async with db.tx() as conn:
            cmd = args.command
            if cmd == "org":
                return await orgs.create_org(conn, clock, ids, args.name)
            if cmd == "demo":
                return await _demo(conn, clock, ids, args.name)
            if cmd == "preset":
                if args.platform == bool(args.org):
                    raise ValidationError(
                        "give exactly one of --org ORG or --platform", rule="preset.kind"
                    )
                org_id = None if args.platform else (await orgs.find_org(conn, args.org))["id"]
                if args.platform and (args.lead or _review_config(args)):
                    raise ValidationError(
                        "a platform preset never carries a lead", rule="preset.platform_lead"
                    )
                return await agents_mod.create_preset(
                    conn,
                    clock,
                    ids,
                    org_id=org_id,
                    name=args.name,
                    lead=args.lead,
                    review_config=_review_config(args),
                )
            org = await orgs.find_org(conn, args.org)
            if cmd == "key":
                return await orgs.create_key(
                    conn, clock, ids, org["id"], orgs.parse_scopes(args.scopes)
                )
            if cmd == "user":
                password = args.password or os.environ.get("LEADGATE_PASSWORD", "")
                return await orgs.create_user(
                    conn, clock, ids, org["id"], args.email, args.role, password
                )
            if cmd == "agent":
                return await _agent(conn, clock, ids, org["id"], args, frozenset(settings.models))
            if cmd == "policy":
                return await policy.add_rule(conn, clock, ids, org["id"], args.pattern, args.action)
            if cmd == "route" and args.route_command != "add":
                from binding.routes import disable_route, list_routes

                if args.route_command == "list":
                    return await list_routes(conn, org["id"])
                return await disable_route(conn, org["id"], args.route)
            if cmd == "route":
                from binding.routes import add_route, parse_match

                agent = await agents_mod.find_agent(conn, org["id"], args.agent)
                return await add_route(
                    conn,
                    clock,
                    ids,
                    org_id=org["id"],
                    agent_id=agent["id"],
                    channel=args.channel,
                    match=parse_match(args.channel, args.match),
                    silent=args.silent,
                )
            if cmd == "flow":
                return await _flow(db, conn, clock, ids, org["id"], args, settings)
            if cmd == "schedule":
                from binding.schedules import add_schedule

                agent = await agents_mod.find_agent(conn, org["id"], args.agent)
                return await add_schedule(
                    conn,
                    clock,
                    ids,
                    org_id=org["id"],
                    agent_id=agent["id"],
                    cron=args.cron,
                    message=args.message,
                )
            raise ValidationError(f"unknown command {cmd}", rule="cli.command")
    finally:
        await db.close()


async def _flow(
    db: Database,
    conn: Any,
    clock: Any,
    ids: Any,
    org_id: str,
    args: argparse.Namespace,
    settings: Settings,
) -> dict[str, Any]:
    from flows.runs import create_flow, run_view

    if args.flow_command == "create":
        try:
            nodes = json.loads(args.nodes)
        except ValueError:
            raise ValidationError("--nodes is not valid JSON", rule="flow.nodes") from None
        return await create_flow(conn, clock, ids, org_id, args.name, nodes)
    if args.flow_command == "show":
        return await run_view(conn, org_id, args.run)
    # Running a flow runs turns: it needs the whole service, outside this transaction.
    await conn.commit()
    from engine.service import Service

    service = Service(settings, enable_adapters=False)
    try:
        run_id = await service.flows.start(org_id, args.flow)
        async with service.db.read() as rconn:
            return await run_view(rconn, org_id, run_id)
    finally:
        await service.stop()


async def _agent(
    conn: Any, clock: Any, ids: Any, org_id: str, args: argparse.Namespace, models: frozenset[str]
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for field in ("name", "model", "instructions", "preset"):
        value = getattr(args, field, None)
        if value is not None:
            kwargs[field] = value
    if args.lead is not None:
        kwargs["lead"] = args.lead
    if getattr(args, "no_lead", False):
        kwargs["lead"] = None
    config = _review_config(args)
    if config is not None:
        kwargs["review_config"] = config
    if args.agent_command == "create":
        row = await agents_mod.save_agent(conn, clock, ids, org_id, known_models=models, **kwargs)
    else:
        if args.deactivate:
            kwargs["active"] = False
        if args.activate:
            kwargs["active"] = True
        row = await agents_mod.save_agent(
            conn,
            clock,
            ids,
            org_id,
            agent_ref=args.agent,
            delete=args.delete,
            known_models=models,
            **kwargs,
        )
    out = agents_mod.public_agent(row)
    lead = await agents_mod.resolve_lead(conn, row)
    # Admin output shows the resolved lead; the public API never does.
    out["lead"] = (
        None
        if lead is None
        else {
            "leadAgentId": lead.lead_agent_id,
            "completionPolicy": lead.completion_policy.value,
            "maxRevisionRounds": lead.max_revision_rounds,
            "source": lead.source,
        }
    )
    return out


async def _demo(conn: Any, clock: Any, ids: Any, name: str) -> dict[str, Any]:
    """A demo organization with a lead and a worker reviewed by it, and a fresh key."""
    import sqlalchemy as sa

    from engine import schema as t

    existing = await conn.scalar(
        sa.select(t.organizations.c.id).where(t.organizations.c.name == name)
    )
    if existing is None:
        org = await orgs.create_org(conn, clock, ids, name)
        org_id, key = org["id"], org["apiKey"]
        await agents_mod.save_agent(conn, clock, ids, org_id, name="lead", model="script")
        await agents_mod.save_agent(
            conn, clock, ids, org_id, name="worker", model="script", lead="lead"
        )
        await agents_mod.save_agent(conn, clock, ids, org_id, name="plain", model="script")
    else:
        org_id = existing
        key = (await orgs.create_key(conn, clock, ids, org_id, ROLE_SCOPES[Role.owner]))["key"]
    return {"org": name, "orgId": org_id, "apiKey": key, "agents": ["worker", "lead", "plain"]}


def _setup_logging(settings: Settings) -> None:
    import structlog

    level = getattr(logging, settings.log.level)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log.format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


async def _serve(settings: Settings, role: str) -> None:
    from aiohttp import web

    from engine.service import Service

    # Every role builds the channel adapters: a worker's relay posts through their
    # outbound halves (build_app mounts the inbound halves only for api/all).
    service = Service(settings)
    await service.db.check_migrated()
    app = service.build_app(role)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
    await site.start()
    if role in ("worker", "all"):
        service.start_runners()
    # Everything built so far (modules, the app) lives as long as the process: keep it out
    # of later garbage collections, whose full passes over it took hundreds of ms each.
    gc.freeze()
    server: Any = site._server
    port = server.sockets[0].getsockname()[1] if server is not None else settings.server.port
    log.info("leadgate listening on http://%s:%s (role %s)", settings.server.host, port, role)
    print(
        json.dumps({"listening": f"http://{settings.server.host}:{port}", "role": role}), flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    await service.stop()


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
        _setup_logging(settings)
        if args.command == "db":
            revision = upgrade(settings.database.url)
            print(json.dumps({"revision": revision}))
            return 0
        if args.command == "serve":
            asyncio.run(_serve(settings, args.role))
            return 0
        nodes = getattr(args, "nodes", None)
        if isinstance(nodes, str) and nodes.startswith("@"):
            try:
                with open(nodes[1:], encoding="utf-8") as fh:
                    args.nodes = fh.read()
            except OSError as exc:
                raise ValidationError(f"cannot read {nodes[1:]}: {exc.strerror}") from exc
        result = asyncio.run(_admin(settings, args))
        print(json.dumps(result, default=str))
        return 0
    except LeadgateError as exc:
        print(f"leadgate: error: {exc.message} [{exc.rule}]", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        with contextlib.suppress(Exception):
            log.debug("command failed", exc_info=True)
        print(f"leadgate: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
