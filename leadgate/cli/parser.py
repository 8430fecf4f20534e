"""The ``leadgate`` command line: its arguments, one function per command group."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from leadgate.cli.review_commands import add_notify_parser, add_user_link_parsers
from leadgate.core.auth import Role

DESCRIPTION = """leadgate: serve, and the admin commands (JSON on stdout, errors on stderr).

Exit codes: 0 success, 2 a rule was broken (the message names it), 1 anything else."""

# argparse has no public name for the object add_subparsers() returns.
Sub = argparse._SubParsersAction


def _with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # --config is accepted before and after the subcommand.
    p.add_argument("--config", default=argparse.SUPPRESS, help="TOML config file")
    return p


def _group(
    sub: Sub[argparse.ArgumentParser], name: str, help_: str
) -> Callable[[str, str], argparse.ArgumentParser]:
    """A command group (``leadgate NAME ...``); returns a maker of its subcommands."""
    group = sub.add_parser(name, help=help_)
    subs = group.add_subparsers(dest=f"{name}_command", required=True)

    def command(cmd: str, help_text: str) -> argparse.ArgumentParser:
        return _with_config(subs.add_parser(cmd, help=help_text))

    return command


def _lead_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lead")
    p.add_argument("--completion-policy")
    p.add_argument("--max-revision-rounds", type=int)


def _agent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset")
    p.add_argument("--model")
    p.add_argument("--instructions")
    _lead_options(p)


def _orgs_keys_users(sub: Sub[argparse.ArgumentParser]) -> None:
    org = _group(sub, "org", "organizations")
    org("create", "create an organization + Owner key").add_argument("name")

    key = _group(sub, "key", "API keys")
    kc = key("create", "create a scoped API key")
    kc.add_argument("--org", required=True)
    kc.add_argument("--scope", action="append", required=True, dest="scopes")

    user = _group(sub, "user", "console users")
    uc = user("create", "create a console user")
    uc.add_argument("--org", required=True)
    uc.add_argument("--email", required=True)
    uc.add_argument("--role", required=True, choices=[r.value for r in Role])
    uc.add_argument("--password", help="default: $LEADGATE_PASSWORD")
    add_user_link_parsers(user)


def _agents_presets_policy(sub: Sub[argparse.ArgumentParser]) -> None:
    agent = _group(sub, "agent", "agents")
    ac = agent("create", "create an agent")
    ac.add_argument("--org", required=True)
    ac.add_argument("--name", required=True)
    _agent_options(ac)
    au = agent("update", "update an agent")
    au.add_argument("agent")
    au.add_argument("--org", required=True)
    au.add_argument("--name")
    au.add_argument("--no-lead", action="store_true", help="clear the worker's own lead")
    _agent_options(au)
    au.add_argument("--deactivate", action="store_true")
    au.add_argument("--activate", action="store_true")
    au.add_argument("--delete", action="store_true")

    preset = _group(sub, "preset", "presets")
    pc = preset("create", "create a preset")
    pc.add_argument("--org")
    pc.add_argument("--platform", action="store_true")
    pc.add_argument("--name", required=True)
    _lead_options(pc)

    policy = _group(sub, "policy", "organization output policy")
    pa = policy("add", "append a rule")
    pa.add_argument("--org", required=True)
    pa.add_argument("--pattern", required=True)
    pa.add_argument("--action", required=True, choices=["block", "redact"])


def _routes_schedules_flows(sub: Sub[argparse.ArgumentParser]) -> None:
    route = _group(sub, "route", "channel routes")
    ra = route("add", "route a channel to an agent")
    ra.add_argument("--org", required=True)
    ra.add_argument("--agent", required=True)
    ra.add_argument("--channel", required=True, choices=["slack", "discord", "teams", "email"])
    ra.add_argument("--match", action="append", default=[])
    ra.add_argument("--silent", action="store_true")
    route("list", "list the organization's routes").add_argument("--org", required=True)
    rd = route("disable", "deactivate a route")
    rd.add_argument("--org", required=True)
    rd.add_argument("route")

    schedule = _group(sub, "schedule", "scheduled triggers")
    sa_ = schedule("add", "run an agent on a cron schedule")
    sa_.add_argument("--org", required=True)
    sa_.add_argument("--agent", required=True)
    sa_.add_argument("--cron", required=True)
    sa_.add_argument("--message", required=True)

    flow = _group(sub, "flow", "ActionFlows")
    fc = flow("create", "create a flow from a JSON node list")
    fc.add_argument("--org", required=True)
    fc.add_argument("--name", required=True)
    fc.add_argument("--nodes", required=True, help="JSON list of nodes, or @FILE")
    fr = flow("run", "start a flow run")
    fr.add_argument("--org", required=True)
    fr.add_argument("flow")
    fs = flow("show", "show a flow run")
    fs.add_argument("--org", required=True)
    fs.add_argument("run")


def build_parser() -> argparse.ArgumentParser:
    """The ``leadgate`` argument parser (subcommand names match
    :data:`leadgate.cli.commands.COMMANDS`)."""
    parser = argparse.ArgumentParser(prog="leadgate", description=DESCRIPTION)
    parser.add_argument(
        "--config", default=os.environ.get("LEADGATE_CONFIG"), help="TOML config file"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = _with_config(sub.add_parser("serve", help="run the service"))
    serve.add_argument("--role", choices=["api", "worker", "all"], default="all")
    _group(sub, "db", "database commands")("upgrade", "migrate to the newest schema")
    _orgs_keys_users(sub)
    _agents_presets_policy(sub)
    _routes_schedules_flows(sub)
    add_notify_parser(sub, _group)
    demo = _with_config(sub.add_parser("demo", help="create the demo organization (idempotent)"))
    demo.add_argument("--name", default="demo")
    return parser
