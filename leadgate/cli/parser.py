"""The ``leadgate`` command line: its arguments, one function per command group."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from leadgate.cli.output import check_stdout
from leadgate.cli.review_parser import add_notify_parser, add_user_link_parsers
from leadgate.core.auth import Role
from leadgate.core.errors import ValidationError

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

DESCRIPTION = """leadgate: serve, the admin commands and the operator commands (JSON on stdout,
or --format table; errors on stderr).

Exit codes: 0 success, 2 a rule was broken (the message names it: not found, wrong status,
bad input, missing permission, the database cannot be reached), 3 a write whose COMMIT
was in doubt ([cli.in_doubt]), 130 Ctrl-C, 141 the output's reader went away (| head),
1 anything else ([internal])."""

#: A cursor is a place in one filtered list: the next page is asked with the same filters.
CURSOR_HELP = (
    "the next page: the cursor the previous page printed, given with the same --org and "
    "filters as that page"
)

#: The rule of a usage error (bad arguments; exit code 2).
USAGE_RULE = "cli.usage"

# argparse has no public name for the object add_subparsers() returns.
Sub = argparse._SubParsersAction


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors end with a rule like every other error
    (``[cli.usage]``), so a script reads one format; exit code 2 as before. Subcommand
    parsers are of this class too (argparse builds them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        if sys.stderr is not None:  # closed (2>&-): argparse prints the usage on stdout
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} [{USAGE_RULE}]\n")

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """argparse's, but a reader gone (``--help | head -0``) raises
        :class:`BrokenPipeError`, which ``leadgate`` turns into exit 141 as for any
        output: argparse drops an error writing its help, and unbuffered
        (``PYTHONUNBUFFERED=1``) the help was lost with exit 0. With standard output
        closed (``>&-``), refused as ``--version`` is (exit 2 ``[cli.stdout]``): argparse
        printed the help on stderr with exit 0, the same success as when it was read."""
        if file is None:
            check_stdout()
        out = sys.stdout if file is None else file
        out.write(self.format_help())


class _Version(argparse.Action):
    """``--version``: the installed release and the schema revision it needs, so an
    operator can tell before ``db upgrade`` which schema a release brings."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        from leadgate.database.revision import HEAD

        try:
            release = version("leadgate")
        except PackageNotFoundError:  # run from a checkout that was never installed
            release = "unknown"
        # (closed, print() printed it nowhere and the exit was 0: refused, exit 2)
        check_stdout()
        print(f"leadgate {release} (schema {HEAD})")  # stdout, as argparse's own version
        parser.exit(0)


def _with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # --config and --format are accepted before and after the subcommand.
    p.add_argument("--config", default=argparse.SUPPRESS, help=CONFIG_HELP)
    p.add_argument(
        "--format", default=argparse.SUPPRESS, choices=["json", "table"], help=FORMAT_HELP
    )
    return p


CONFIG_HELP = "TOML config file (default: $LEADGATE_CONFIG, else ./config.toml, else built-in)"
FORMAT_HELP = "output: json (default) or table"


def _group(
    sub: Sub[argparse.ArgumentParser], name: str, help_: str
) -> Callable[[str, str], argparse.ArgumentParser]:
    """A command group (``leadgate NAME ...``); returns a maker of its subcommands."""
    group = sub.add_parser(name, help=help_, epilog=EPILOG[0], formatter_class=_FORMATTER)
    subs = group.add_subparsers(dest=f"{name}_command", required=True)

    def command(cmd: str, help_text: str) -> argparse.ArgumentParser:
        return _with_config(
            subs.add_parser(cmd, help=help_text, epilog=EPILOG[0], formatter_class=_FORMATTER)
        )

    return command


def _lead_options(p: argparse.ArgumentParser, no_lead: bool = False) -> None:
    lead: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup = p
    if no_lead:
        # Setting a lead and clearing it in one command is refused (exit 2), not decided
        # by which flag the code happened to look at first.
        lead = p.add_mutually_exclusive_group()
        lead.add_argument("--no-lead", action="store_true", help="clear the worker's own lead")
    lead.add_argument("--lead")
    p.add_argument("--completion-policy")
    p.add_argument("--max-revision-rounds", type=int)


def _agent_options(p: argparse.ArgumentParser, no_lead: bool = False) -> None:
    p.add_argument("--preset")
    p.add_argument("--model")
    p.add_argument("--instructions")
    _lead_options(p, no_lead)


def _orgs_keys_users(sub: Sub[argparse.ArgumentParser]) -> None:
    org = _group(sub, "org", "organizations")
    org("create", "create an organization + Owner key").add_argument("name")
    org("list", "list the organizations on this database")

    key = _group(sub, "key", "API keys")
    kc = key("create", "create a scoped API key")
    kc.add_argument("--org", required=True)
    kc.add_argument("--scope", action="append", required=True, dest="scopes")
    kc.add_argument("--name", help="a label shown by key list and in the audit trail")
    key("list", "list the organization's keys (never their secrets)").add_argument(
        "--org", required=True
    )
    kr = key("revoke", "revoke a key (refused everywhere within 5 seconds)")
    kr.add_argument("--org", required=True)
    kr.add_argument("key_id", metavar="KEY_ID")

    user = _group(sub, "user", "console users")
    uc = user("create", "create a console user")
    uc.add_argument("--org", required=True)
    uc.add_argument("--email", required=True)
    uc.add_argument(
        "--role",
        required=True,
        type=_role,
        metavar="{" + ",".join(r.value for r in Role) + "}",
        help="any case: member = Member",
    )
    uc.add_argument("--name", help="display name shown in the console's audit trail")
    uc.add_argument(
        "--password",
        help="shown in ps and kept in shell history (a warning says so): leave it out to "
        "read $LEADGATE_PASSWORD, else to be asked without echo on a terminal, else the "
        "first line of standard input",
    )
    user("list", "list the organization's console users").add_argument("--org", required=True)
    uu = user(
        "update",
        "change a console user: role, name, password; disable (offboarding) or enable; "
        "end their console sessions",
    )
    uu.add_argument("--org", required=True)
    uu.add_argument("email", metavar="EMAIL")
    uu.add_argument("--role", type=_role, metavar="{" + ",".join(r.value for r in Role) + "}")
    uu.add_argument("--name", help="display name shown in the console's audit trail")
    password = uu.add_mutually_exclusive_group()
    password.add_argument(
        "--password",
        help="a new password (ends the user's sessions); shown in ps and kept in shell "
        "history: --reset-password reads it instead",
    )
    password.add_argument(
        "--reset-password",
        action="store_true",
        help="read a new password as user create does ($LEADGATE_PASSWORD, a terminal, "
        "standard input); ends the user's sessions",
    )
    state = uu.add_mutually_exclusive_group()
    state.add_argument(
        "--disable",
        action="store_true",
        help="no login, no console session, no chat decision (the audit keeps the user)",
    )
    state.add_argument("--enable", action="store_true")
    uu.add_argument(
        "--end-sessions", action="store_true", help="log the user out of every console session"
    )
    add_user_link_parsers(user)


def _agents_presets_policy(sub: Sub[argparse.ArgumentParser]) -> None:
    agent = _group(sub, "agent", "agents")
    ac = agent("create", "create an agent")
    ac.add_argument("--org", required=True)
    ac.add_argument("--name", required=True)
    _agent_options(ac)
    agent("list", "list the organization's agents (not deleted) with their leads").add_argument(
        "--org", required=True
    )
    au = agent("update", "update an agent")
    au.add_argument("agent")
    au.add_argument("--org", required=True)
    au.add_argument("--name")
    _agent_options(au, no_lead=True)
    state = au.add_mutually_exclusive_group()
    state.add_argument("--deactivate", action="store_true")
    state.add_argument("--activate", action="store_true")
    state.add_argument("--delete", action="store_true")

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
    policy("list", "the rules, in the order they apply").add_argument("--org", required=True)
    pr = policy("remove", "delete a rule (the next turn no longer applies it)")
    pr.add_argument("--org", required=True)
    pr.add_argument("rule_id", metavar="RULE_ID")


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
    schedule("list", "the organization's schedules and their next firing").add_argument(
        "--org", required=True
    )
    sr = schedule("remove", "delete a schedule")
    sr.add_argument("--org", required=True)
    sr.add_argument("schedule_id", metavar="SCHEDULE_ID")

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


def _role(value: str) -> str:
    try:
        return Role.parse(value).value
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _operators(sub: Sub[argparse.ArgumentParser]) -> None:
    """``review ...`` and ``delivery ...``: every operator action, for operators
    without a browser."""
    review = _group(sub, "review", "the Lead Reviews queue and human decisions")
    rl = review("list", "the actionable queue, waiting longest first")
    rl.add_argument("--org", required=True)
    rl.add_argument("--agent", help="only this agent (id, slug or name)")
    rl.add_argument("--channel", help="only this channel (api, slack, discord, teams, email, ...)")
    rl.add_argument(
        "--reason",
        help="escalated, roundsExhausted, incompleteProvenance, leaseExpired, deliveryUnknown",
    )
    rl.add_argument("--order", choices=["oldest", "newest"], default="oldest")
    rl.add_argument("--limit", type=int, default=50)
    rl.add_argument("--cursor", help=CURSOR_HELP)
    rs = review("show", "a work item's review detail")
    rs.add_argument("--org", required=True)
    rs.add_argument("item", metavar="WORK_ITEM_ID")
    for action, help_text in (
        ("approve", "approve an awaitingHuman item (its delivery is queued)"),
        ("reject", "reject an awaitingHuman item with a reason"),
        ("return", "return an awaitingHuman item to the worker with feedback"),
        ("cancel", "cancel any non-terminal item"),
    ):
        p = _acting(review(action, help_text), "item", "WORK_ITEM_ID")
        if action == "reject":
            p.add_argument("--reason", required=True, help="1..2,000 characters; - reads stdin")
        if action == "cancel":
            p.add_argument("--reason", help="optional, why: 1..2,000 characters; - reads stdin")
        if action == "return":
            p.add_argument("--feedback", required=True, help="1..10,000 characters; - reads stdin")
    delivery = _group(sub, "delivery", "recovery of uncertain (deliveryUnknown) deliveries")
    dl = delivery(
        "list",
        "every deliveryUnknown delivery, gating or not (plain replies, notices and cards "
        "are in no review queue), longest uncertain first",
    )
    dl.add_argument("--org", required=True)
    dl.add_argument("--limit", type=int, default=50)
    dl.add_argument("--cursor", help=CURSOR_HELP)
    for action, help_text in (
        ("confirm", "the message did arrive: delivery sent, item completed"),
        ("retry", "it did not: send again"),
    ):
        _acting(delivery(action, help_text), "delivery", "DELIVERY_ID")


def _acting(p: argparse.ArgumentParser, target: str, metavar: str) -> argparse.ArgumentParser:
    """A decision command: ``--org``, the target id and ``--as``."""
    p.add_argument("--org", required=True)
    p.add_argument(target, metavar=metavar)
    p.add_argument(
        "--as",
        dest="as_email",
        metavar="EMAIL",
        help="audit the decision as this console user (needs a role with agent:review); "
        "default: the command line, as cli:<your operating-system user>",
    )
    return p


_FORMATTER = argparse.RawDescriptionHelpFormatter
#: The ``--help`` footer naming the config and database (set by :func:`build_parser`).
EPILOG = [""]


def build_parser(epilog: str = "") -> argparse.ArgumentParser:
    """The ``leadgate`` argument parser (subcommand names match
    :data:`leadgate.cli.commands.COMMANDS`); ``epilog`` ends every ``--help``."""
    EPILOG[0] = epilog
    parser: argparse.ArgumentParser = Parser(
        prog="leadgate", description=DESCRIPTION, epilog=epilog, formatter_class=_FORMATTER
    )
    parser.add_argument("--version", action=_Version)
    parser.add_argument("--config", default=None, help=CONFIG_HELP)
    parser.add_argument("--format", default="json", choices=["json", "table"], help=FORMAT_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = _with_config(
        sub.add_parser("serve", help="run the service", epilog=epilog, formatter_class=_FORMATTER)
    )
    serve.add_argument("--role", choices=["api", "worker", "all"], default="all")
    serve.add_argument(
        "--check-ports",
        action="store_true",
        help="only check that the HTTP (and inbound SMTP) ports are free, then exit",
    )
    _group(sub, "db", "database commands")("upgrade", "migrate to the newest schema")
    _orgs_keys_users(sub)
    _agents_presets_policy(sub)
    _routes_schedules_flows(sub)
    add_notify_parser(sub, _group)
    _operators(sub)
    demo = _with_config(
        sub.add_parser(
            "demo",
            help="create the demo organization (idempotent)",
            epilog=epilog,
            formatter_class=_FORMATTER,
        )
    )
    demo.add_argument("--name", default="demo")
    demo.add_argument(
        "--key-file",
        help="reuse the Owner key kept in this file while it is valid; a new key is "
        "written there (mode 0600) otherwise",
    )
    demo.add_argument(
        "--rotate-key", action="store_true", help="revoke the kept key and mint a new one"
    )
    return parser
