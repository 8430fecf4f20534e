"""One function per admin subcommand: each calls the operations layer and returns JSON.

:data:`COMMANDS` maps ``(command, subcommand)`` to its function; ``leadgate.cli.main``
parses the arguments, builds the :class:`~leadgate.operations.admin.Admin` and prints
what the function returns.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import io
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from binding import routes
from leadgate.cli.output import say
from leadgate.cli.review_commands import REVIEW_COMMANDS
from leadgate.core.auth import Principal
from leadgate.core.config import Settings
from leadgate.core.decoding import decode_json
from leadgate.core.errors import Unavailable, ValidationError
from leadgate.core.limits import PASSWORD_MAX, PASSWORD_MIN
from leadgate.domain import orgs, policy
from leadgate.domain.agents import PresetView
from leadgate.operations.admin import (
    Admin,
    AdminAgentView,
    DemoView,
    ListedAgentView,
    NamedRouteView,
    ShownKeyView,
)
from leadgate.operations.reviews import DECISIONS, RECOVERIES, RecoveredView, Reviews
from leadgate.review.queue import QueueView, ReviewDetailView, UncertainView
from outbox.store import Outbox

if TYPE_CHECKING:
    # The runners pull in the turn path, which these commands import on first use.
    from leadgate.flows.runs import NewFlowView, RunView
    from leadgate.runners.schedules import NewScheduleView, RemovedScheduleView, ScheduleView

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


async def org_create(admin: Admin, args: argparse.Namespace, _: Settings) -> orgs.NewOrgView:
    """``leadgate org create NAME``."""
    return await admin.create_org(args.name)


async def org_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[orgs.OrgView]:
    """``leadgate org list``."""
    return await admin.list_orgs()


async def agent_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[ListedAgentView]:
    """``leadgate agent list --org ORG``."""
    return await admin.list_agents(args.org)


async def key_create(admin: Admin, args: argparse.Namespace, _: Settings) -> ShownKeyView:
    """``leadgate key create --org ORG --scope S ... [--name LABEL]``."""
    return await admin.create_key(args.org, args.scopes, args.name)


async def key_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[orgs.KeyView]:
    """``leadgate key list --org ORG``."""
    return await admin.list_keys(args.org)


async def key_revoke(admin: Admin, args: argparse.Namespace, _: Settings) -> orgs.RevokedKeyView:
    """``leadgate key revoke --org ORG KEY_ID``."""
    return await admin.revoke_key(args.org, args.key_id)


def read_password(given: str | None) -> str:
    """``--password``, else ``$LEADGATE_PASSWORD``, else asked twice without echo on a
    terminal, else the first line of standard input."""
    if given is not None:
        return _typed_password(given)
    if os.environ.get("LEADGATE_PASSWORD"):
        return _utf8(os.environ["LEADGATE_PASSWORD"], "$LEADGATE_PASSWORD")
    if _stdin().isatty():
        with interruptible():
            first = _utf8(getpass.getpass("Password for the console user: "), "the password")
            again = getpass.getpass("Repeat the password: ")
        if again != first:
            raise ValidationError("the two passwords differ", rule="user.password")
        return first
    with interruptible():
        # Bounded: a longer line is refused by the length check below, read or not
        # (`< /dev/zero` has no line break, and was read until memory ran out).
        line = _stdin().readline(PASSWORD_MAX + 2)
    if not line:
        # Standard input ended before a line: said "password must be 8 to 1,024
        # characters", as if one had been given.
        raise ValidationError(
            "no password given: run it on a terminal to be asked for it, write it on the "
            "first line of standard input, set $LEADGATE_PASSWORD, or pass --password",
            rule="user.password",
        )
    return _utf8(line, "standard input").rstrip("\r\n")


def _stdin() -> TextIO:
    """Standard input, or an empty one when it is closed (``<&-``): Python has no
    ``sys.stdin`` then, and reading it was ``AttributeError`` exit 1 ``[internal]``; it
    is no password given, or an empty ``--reason -``, as ``< /dev/null`` is."""
    return io.StringIO() if sys.stdin is None else sys.stdin


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C stops the command at once while it waits for what a person types (a
    password prompt, ``--reason -`` on a terminal). Commands run in ``asyncio.run``,
    whose SIGINT handler only cancels the command's task, which a blocking read never
    gets back to: the first Ctrl-C was ignored, and the command went on to fail once
    the input was typed after all. Python's own handler (KeyboardInterrupt) is put back
    for the read, asyncio's after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are the main thread's (a test may call a command elsewhere)
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    except KeyboardInterrupt:
        if _stdin().isatty():  # the error's line below the prompt, not after it
            say()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


#: Printed on stderr when ``--password`` is used (never the password itself).
PASSWORD_FLAG_WARNING = (
    "leadgate: warning: --password shows the password to every user of this machine "
    "(ps) and leaves it in your shell history; leave it out (user update: "
    "--reset-password) to type it at the prompt, or to pass it on the first line of "
    "standard input or in $LEADGATE_PASSWORD"
)


def _typed_password(given: str) -> str:
    """``--password``'s value, refused when empty (``--password ""``): an empty value
    fell through to ``$LEADGATE_PASSWORD``, the prompt or standard input, so the user
    was made with some other password than the one typed (or none was asked for)."""
    if not given:
        raise ValidationError(
            f"--password is empty: a console password is {PASSWORD_MIN} to "
            f"{PASSWORD_MAX:,} characters; leave "
            "--password out to be asked for it or to read $LEADGATE_PASSWORD or standard input",
            rule="user.password",
        )
    # Kept for the scripts that pass it; a password on the command line is readable by
    # every user of the machine (ps) and stays in the shell's history.
    say(PASSWORD_FLAG_WARNING)
    return given


async def user_create(admin: Admin, args: argparse.Namespace, _: Settings) -> orgs.NewUserView:
    """``leadgate user create --org ORG --email E --role R [--name N] [--password P]``."""
    return await admin.create_user(
        args.org, args.email, args.role, read_password(args.password), args.name
    )


async def user_list(
    admin: Admin, args: argparse.Namespace, _: Settings
) -> list[orgs.ListedUserView]:
    """``leadgate user list --org ORG``."""
    return await admin.list_users(args.org)


async def user_update(admin: Admin, args: argparse.Namespace, _: Settings) -> orgs.UpdatedUserView:
    """``leadgate user update --org ORG EMAIL [--role R] [--name N] [--password P |
    --reset-password] [--disable | --enable] [--end-sessions]``."""
    if args.reset_password:
        password: str | None = read_password(args.password)
    else:
        password = None if args.password is None else _typed_password(args.password)
    disabled = True if args.disable else False if args.enable else None
    if (args.role, args.name, password, disabled) == (None, None, None, None) and not (
        args.end_sessions
    ):
        raise ValidationError(
            "nothing to change: give --role, --name, --password, --reset-password, "
            "--disable, --enable or --end-sessions",
            rule="user.update",
        )
    return await admin.update_user(
        args.org,
        args.email,
        role=args.role,
        name=args.name,
        password=password,
        disabled=disabled,
        end_sessions=args.end_sessions,
    )


async def agent_create(admin: Admin, args: argparse.Namespace, _: Settings) -> AdminAgentView:
    """``leadgate agent create --org ORG --name NAME [...]``."""
    return await admin.save_agent(args.org, **_agent_fields(args))


async def agent_update(admin: Admin, args: argparse.Namespace, _: Settings) -> AdminAgentView:
    """``leadgate agent update --org ORG AGENT [...] [--deactivate|--activate|--delete]``."""
    fields = _agent_fields(args)
    if args.deactivate:
        fields["active"] = False
    if args.activate:
        fields["active"] = True
    return await admin.save_agent(args.org, ref=args.agent, delete=args.delete, **fields)


async def preset_create(admin: Admin, args: argparse.Namespace, _: Settings) -> PresetView:
    """``leadgate preset create (--org ORG | --platform) --name NAME [lead options]``."""
    if args.platform == bool(args.org):
        raise ValidationError("give exactly one of --org ORG or --platform", rule="preset.kind")
    return await admin.create_preset(
        None if args.platform else args.org, args.name, args.lead, _review_config(args)
    )


async def policy_add(admin: Admin, args: argparse.Namespace, _: Settings) -> policy.RuleView:
    """``leadgate policy add --org ORG --pattern REGEX --action block|redact``."""
    return await admin.add_policy_rule(args.org, args.pattern, args.action)


async def policy_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[policy.RuleView]:
    """``leadgate policy list --org ORG``."""
    return await admin.list_policy_rules(args.org)


async def policy_remove(
    admin: Admin, args: argparse.Namespace, _: Settings
) -> policy.RemovedRuleView:
    """``leadgate policy remove --org ORG RULE_ID``."""
    return await admin.remove_policy_rule(args.org, args.rule_id)


async def route_add(admin: Admin, args: argparse.Namespace, _: Settings) -> routes.NewRouteView:
    """``leadgate route add --org ORG --agent NAME --channel C [--match K=V ...] [--silent]``."""
    return await admin.add_route(args.org, args.agent, args.channel, args.match, args.silent)


async def route_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[NamedRouteView]:
    """``leadgate route list --org ORG``."""
    return await admin.list_routes(args.org)


async def route_disable(admin: Admin, args: argparse.Namespace, _: Settings) -> routes.RouteView:
    """``leadgate route disable --org ORG ROUTE_ID``."""
    return await admin.disable_route(args.org, args.route)


async def schedule_add(admin: Admin, args: argparse.Namespace, _: Settings) -> NewScheduleView:
    """``leadgate schedule add --org ORG --agent NAME --cron EXPR --message TEXT``."""
    return await admin.add_schedule(args.org, args.agent, args.cron, args.message)


async def schedule_list(admin: Admin, args: argparse.Namespace, _: Settings) -> list[ScheduleView]:
    """``leadgate schedule list --org ORG``."""
    return await admin.list_schedules(args.org)


async def schedule_remove(
    admin: Admin, args: argparse.Namespace, _: Settings
) -> RemovedScheduleView:
    """``leadgate schedule remove --org ORG SCHEDULE_ID``."""
    return await admin.remove_schedule(args.org, args.schedule_id)


def _read_nodes(value: str) -> Any:
    """``--nodes``: a JSON list, or ``@FILE`` holding one."""
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as fh:
                value = _at_most(fh.read, value[1:], "flow.nodes")
        except OSError as exc:
            raise ValidationError(
                f"cannot read {value[1:]}: {exc.strerror}", rule="flow.nodes"
            ) from exc
        except UnicodeDecodeError:
            raise ValidationError(f"{value[1:]} is not UTF-8 text", rule="flow.nodes") from None
    try:
        # The service's own JSON reading: depth-bounded, no lone surrogates or NUL.
        return decode_json(value)
    except ValidationError as exc:
        what = exc.message.removeprefix("the body ")
        raise ValidationError(f"--nodes {what}", rule="flow.nodes") from None


async def flow_create(admin: Admin, args: argparse.Namespace, _: Settings) -> NewFlowView:
    """``leadgate flow create --org ORG --name NAME --nodes JSON|@FILE``."""
    return await admin.create_flow(args.org, args.name, _read_nodes(args.nodes))


async def flow_show(admin: Admin, args: argparse.Namespace, _: Settings) -> RunView:
    """``leadgate flow show --org ORG RUN_ID``."""
    return await admin.show_run(args.org, args.run)


async def flow_run(admin: Admin, args: argparse.Namespace, settings: Settings) -> RunView:
    """``leadgate flow run --org ORG FLOW``: runs turns, so it needs the whole service."""
    # Imported here: the composition root pulls in every SDK (about 3 s), which the
    # other commands do not need.
    from leadgate.app import App

    org_id = await admin.org_id(args.org)
    # The start's COMMIT in doubt is settled as every command's write is (the app's
    # database asks the server, settle_doubt); the run's id is made by the command's
    # ids, so that when the server cannot say, exit 3 names the run to look for.
    app = App(settings, ids=admin.ids, enable_adapters=False, settle_doubt=True)
    try:
        # Registered (role ``cli``) and beating, as a serve process is, so that what it
        # leaves behind is taken back at once: the run and its node's turn are leased to
        # it, and it runs no recovery. Its row is removed at exit (a Ctrl-C, a turn
        # stopped by a database fault: a worker continues the run and runs the turn
        # again at once), or found dead when it is killed. Unregistered, its leases
        # named no owner, and workers waited them out: 2 minutes for the run, 15 for
        # the turn. Not registered when the database refuses (the start then says why).
        with contextlib.suppress(Unavailable):
            await app.start_liveness("cli")
        run_id = await app.flows.start(org_id, args.flow)
        return await Admin(app.db, app.clock, app.ids, app.model_names).show_run(org_id, run_id)
    finally:
        await app.stop()


class KeptDemoView(DemoView):
    """``demo --key-file FILE``'s output: with the file the Owner key is kept in."""

    keyFile: str


async def demo(admin: Admin, args: argparse.Namespace, _: Settings) -> DemoView:
    """``leadgate demo [--name demo] [--key-file FILE [--rotate-key]]``: the quick-start
    organization (idempotent); with ``--key-file`` the Owner key is kept in that file
    (mode 0600, never in the database) and reused while it is valid."""
    if args.rotate_key and not args.key_file:
        # There is no kept key to revoke: a new one would be minted and the old ones
        # left working, which is not what "rotate" promises.
        raise ValidationError(
            "--rotate-key replaces the key kept in --key-file FILE: give that file",
            rule="demo.rotate_key",
        )
    path = Path(args.key_file) if args.key_file else None
    kept = None
    if path is not None and path.is_file():
        try:
            kept = path.read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            raise _key_file_error(path, exc) from None
    # The file is made ready before the database is touched: a key minted (and the kept
    # one revoked) with nowhere to keep it would be lost.
    pending = _SecretFile.open(path) if path is not None else None
    try:
        result = await admin.demo(args.name, key=kept, rotate=args.rotate_key)
        if pending is not None and not result["keyReused"]:
            pending.commit(result["apiKey"])
    finally:
        if pending is not None:
            pending.discard()
    if path is None:
        return result
    kept_in: KeptDemoView = {**result, "keyFile": str(path)}
    return kept_in


def _key_file_error(path: Path, exc: Exception) -> ValidationError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return ValidationError(f"cannot use --key-file {path}: {reason}", rule="demo.key_file")


class _SecretFile:
    """A secret's file, written readable by its owner only (0600 from the start) through a
    temporary file beside it that :meth:`open` creates and :meth:`commit` moves in place."""

    def __init__(self, path: Path, tmp: Path, fd: int) -> None:
        self.path, self.tmp, self.fd = path, tmp, fd

    @classmethod
    def open(cls, path: Path) -> _SecretFile:
        """Check that ``path`` can be written now (rule ``demo.key_file`` otherwise)."""
        tmp = path.with_name(path.name + ".tmp")
        if path.exists() and not path.is_file() and not path.is_dir():
            # Moving the key's file in place would replace it: `--key-file /dev/null`
            # made the system's /dev/null (run as root) a file holding the key.
            not_a_file = ValueError("not a regular file (a device, a pipe or a socket)")
            raise _key_file_error(path, not_a_file)
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "Is a directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise _key_file_error(path, exc) from None
        return cls(path, tmp, fd)

    def commit(self, secret: str) -> None:
        """Write ``secret`` and move it in place; if that fails, the error carries the
        secret (it exists only here now), for the operator to keep by hand."""
        try:
            with os.fdopen(self.fd, "w", encoding="utf-8") as fh:
                self.fd = -1
                fh.write(secret + "\n")
            os.chmod(self.tmp, 0o600)
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise ValidationError(
                f"the new key could not be written to {self.path} ({exc.strerror or exc}); "
                f"it is valid, keep it now: {secret}",
                rule="demo.key_file",
            ) from None

    def discard(self) -> None:
        """Remove the temporary file if it was not moved in place."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------- operator commands


def _reviews(admin: Admin) -> Reviews:
    # No relay in this process: an approval's delivery row is left pending for the
    # service's relay (woken by NOTIFY on PostgreSQL, by its poll on SQLite).
    return Reviews(admin.db, admin.clock, admin.ids, Outbox(admin.clock, admin.ids))


def os_user() -> str:
    """The operating-system user running the command (audited as ``cli:<user>``)."""
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment or the password database
        return f"uid{os.getuid()}"


async def _principal(admin: Admin, args: argparse.Namespace) -> Principal:
    return await admin.reviewer(args.org, getattr(args, "as_email", None), f"cli:{os_user()}")


def _identity() -> str:
    return f"os:{os_user()}@{socket.gethostname()}"


#: What a command reads from standard input (``--reason -``) or an ``@FILE`` (``--nodes``)
#: at most, in characters: far above any text it takes (a decision's feedback is at most
#: 10,000); ``yes | leadgate review reject ... --reason -`` was read until memory ran out.
INPUT_MAX_CHARS = 1024 * 1024


def _at_most(read: Callable[[int], str], what: str, rule: str) -> str:
    """``read(n)``'s text, refused (``rule``) when longer than :data:`INPUT_MAX_CHARS`."""
    text = read(INPUT_MAX_CHARS + 1)
    if len(text) > INPUT_MAX_CHARS:
        raise ValidationError(f"{what} is longer than {INPUT_MAX_CHARS:,} characters", rule=rule)
    return text


def _text(value: str, rule: str) -> str:
    """``value``, or with ``-`` standard input's text (``rule``: when it is too long)."""
    if value != "-":
        return value
    with interruptible():
        read = _at_most(_stdin().read, "standard input", rule)
    return _utf8(read, "standard input").strip()


def _utf8(text: str, where: str) -> str:
    """``text`` read from the environment or a stream, which Python decodes with surrogate
    escapes: bytes that are not UTF-8 are exit 2 ``cli.utf8`` here, not an encoding error
    where the text is used."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{where} is not valid UTF-8 text", rule="cli.utf8") from None
    return text


async def review_list(admin: Admin, args: argparse.Namespace, _: Settings) -> QueueView:
    """``leadgate review list --org ORG [--agent A] [--channel C] [--reason R] ...``."""
    return await _reviews(admin).queue(
        await _principal(admin, args),
        limit=args.limit,
        cursor=args.cursor,
        agent=args.agent,
        channel=args.channel,
        reason=args.reason,
        order=args.order,
    )


async def delivery_list(admin: Admin, args: argparse.Namespace, _: Settings) -> UncertainView:
    """``leadgate delivery list --org ORG [--limit N] [--cursor X]``."""
    return await _reviews(admin).uncertain(
        await _principal(admin, args), limit=args.limit, cursor=args.cursor
    )


async def review_show(admin: Admin, args: argparse.Namespace, _: Settings) -> ReviewDetailView:
    """``leadgate review show --org ORG WORK_ITEM_ID``."""
    return await _reviews(admin).detail(await _principal(admin, args), args.item)


def _decision(action: str) -> Command:
    async def decide(admin: Admin, args: argparse.Namespace, _: Settings) -> ReviewDetailView:
        text = None
        if action == "reject" or (action == "cancel" and args.reason is not None):
            text = _text(args.reason, "decision.reason")
        elif action == "return":
            text = _text(args.feedback, "decision.feedback")
        return await _reviews(admin).decide(
            await _principal(admin, args),
            args.item,
            action,
            text,
            surface="cli",
            identity=_identity(),
        )

    decide.__doc__ = f"``leadgate review {action} --org ORG WORK_ITEM_ID [--as EMAIL]``."
    return decide


def _recovery(action: str) -> Command:
    async def recover(admin: Admin, args: argparse.Namespace, _: Settings) -> RecoveredView:
        return await _reviews(admin).recover(
            await _principal(admin, args),
            args.delivery,
            action,
            surface="cli",
            identity=_identity(),
        )

    recover.__doc__ = f"``leadgate delivery {action} --org ORG DELIVERY_ID [--as EMAIL]``."
    return recover


COMMANDS: dict[tuple[str, str | None], Command] = {
    ("org", "create"): org_create,
    ("org", "list"): org_list,
    ("key", "create"): key_create,
    ("key", "list"): key_list,
    ("key", "revoke"): key_revoke,
    ("user", "create"): user_create,
    ("user", "list"): user_list,
    ("user", "update"): user_update,
    ("agent", "create"): agent_create,
    ("agent", "list"): agent_list,
    ("agent", "update"): agent_update,
    ("preset", "create"): preset_create,
    ("policy", "add"): policy_add,
    ("policy", "list"): policy_list,
    ("policy", "remove"): policy_remove,
    ("route", "add"): route_add,
    ("route", "list"): route_list,
    ("route", "disable"): route_disable,
    ("schedule", "add"): schedule_add,
    ("schedule", "list"): schedule_list,
    ("schedule", "remove"): schedule_remove,
    ("flow", "create"): flow_create,
    ("flow", "run"): flow_run,
    ("flow", "show"): flow_show,
    ("demo", None): demo,
    ("review", "list"): review_list,
    ("review", "show"): review_show,
    **{("review", action): _decision(action) for action in DECISIONS},
    ("delivery", "list"): delivery_list,
    **{("delivery", action): _recovery(action) for action in RECOVERIES},
}
COMMANDS.update(REVIEW_COMMANDS)
