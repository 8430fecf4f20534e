"""``leadgate``: serve, the admin and operator commands (JSON on stdout, or ``--format
table``; errors on stderr, each naming the config file and database in use).

Exit codes: 0 success, 2 a rule was broken (the message names it), 3 a write whose
``COMMIT`` was in doubt and could not be read back (the message says what tells whether
it was made: :mod:`leadgate.cli.doubt`), 130 Ctrl-C, 141 the reader of the output went
away (``| head``), 1 anything else.
"""

from __future__ import annotations

import sys

#: Ctrl-C (SIGINT): the shell's status for it (128 + 2), and the rule its line ends with.
INTERRUPTED_EXIT = 130
INTERRUPTED_RULE = "cli.interrupted"
INTERRUPTED = (
    "interrupted (Ctrl-C); a change the command was making is made whole or not at all: "
    "look (list or show) before running it again"
)


def _interrupted_line(using: str = "") -> int:
    """:data:`INTERRUPTED_EXIT`, with one line on stderr (nowhere when it is closed, as
    :func:`~leadgate.cli.output.say` prints): ``using``, the config and database once
    known (one line already). Needs nothing imported: Ctrl-C may come while this module
    loads its own imports."""
    if sys.stderr is not None:
        try:
            print(f"leadgate: error: {INTERRUPTED}{using} [{INTERRUPTED_RULE}]", file=sys.stderr)
        except OSError:
            pass
    return INTERRUPTED_EXIT


try:
    import argparse
    import contextlib
    import gc
    import json
    import logging
    import os
    import signal
    from typing import TYPE_CHECKING, Any

    from leadgate.cli.context import ConfigChoice, discover, help_epilog, where
    from leadgate.cli.doubt import IN_DOUBT_EXIT, WRITE_IN_DOUBT_RULE, MintedIds, write_in_doubt
    from leadgate.cli.output import STDOUT_RULE, check_stdout, one_line, render, say
    from leadgate.cli.parser import build_parser
    from leadgate.cli.ports import check_ports
    from leadgate.core.clock import RandomIds, SystemClock
    from leadgate.core.errors import (
        ConfigError,
        DatabaseDamaged,
        LeadgateError,
        Unavailable,
        ValidationError,
        when_reading,
    )
    from leadgate.core.logs import error_text, loggable, setup_logging
except KeyboardInterrupt:
    # Ctrl-C while the command's modules load (its first few tenths of a second, before
    # main() runs): one line and 130, as at any later moment; it was a KeyboardInterrupt
    # traceback. (Raised out of the import of this module, SystemExit ends the console
    # script and `python -m leadgate` quietly.)
    sys.exit(_interrupted_line())

if TYPE_CHECKING:
    from leadgate.core.config import Settings

log = logging.getLogger("leadgate")

#: The rule an unexpected error's line ends with (exit 1), as the HTTP surfaces' 500.
INTERNAL_RULE = "internal"
#: The rule of a database URL whose user, password or database the server refuses.
LOGIN_RULE = "database.login"


async def _admin(settings: Settings, args: argparse.Namespace) -> Any:
    """Run one admin subcommand against the configured database."""
    # Imported per command, as the service's modules are in _serve: `--version`, `--help`
    # and a config error answer without loading the database and operations layers.
    from leadgate.cli.commands import COMMANDS
    from leadgate.database.db import Database
    from leadgate.operations.admin import Admin

    command = COMMANDS[(args.command, getattr(args, f"{args.command}_command", None))]
    # The service's own bounds: [database] busy_timeout_s is how long a command waits for
    # another process's write lock before it says so. A COMMIT in doubt is asked about
    # (settle_doubt): the command exits on an error, so nothing would look later.
    db = Database(
        settings.database.url,
        pool_size=settings.database.pool_size,
        busy_timeout_s=settings.database.busy_timeout_s,
        settle_doubt=True,
    )
    ids = MintedIds(RandomIds())
    try:
        await db.check_migrated()
        admin = Admin(db, SystemClock(), ids, frozenset(settings.models))
        return await command(admin, args, settings)
    except Unavailable as fault:
        if not fault.in_doubt:
            raise
        raise write_in_doubt(fault, args, ids.minted) from fault
    finally:
        await db.close()


async def _serve(settings: Settings, role: str) -> None:
    """``leadgate serve``: the HTTP surfaces and (worker, all) the runners, until SIGTERM."""
    check_ports(settings, role)  # before anything starts: a clear error, nothing half-done
    # Imported here: the composition root pulls in every SDK (about 3 s), which the admin
    # and operator commands do not need.
    import asyncio

    from aiohttp import web

    from leadgate.app import App
    from leadgate.web.runner import (
        METRICS_CONNECTIONS,
        ConnectionLimit,
        SendBounds,
        ServiceRunner,
        connection_budget,
        raise_open_files_limit,
        reserved_files,
    )

    open_files = raise_open_files_limit()
    reserved = reserved_files(settings, role)
    max_connections = connection_budget(settings.server.max_connections, open_files, reserved)

    # Every role builds the channel adapters: a worker's relay posts through their
    # outbound halves (the inbound halves are mounted for api/all only).
    app = App(settings)
    await app.db.check_migrated()
    runner = ServiceRunner(
        app.web_app(role, run_runners=role in ("worker", "all"), register=True),
        handle_signals=False,
        access_log=None,
        # Idle connections, and connections that never finish sending their request
        # headers (slow-loris), are closed after this; bodies have their own timeout.
        keepalive_timeout=settings.server.idle_timeout_s,
        limit=ConnectionLimit(max_connections),
        sends=SendBounds(settings.server.send_timeout_s, settings.server.max_unsent_bytes),
        # aiohttp waits this long for handlers to end, then as long again for them to
        # end once told (a request body read is cancelled), and only then cancels them:
        # half the grace each.
        shutdown_timeout=settings.server.shutdown_grace_s / 2,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
    await site.start()
    metrics_runner: web.AppRunner | None = None
    if settings.server.metrics_host:
        metrics_runner = ServiceRunner(
            app.metrics_app(),
            handle_signals=False,
            access_log=None,
            keepalive_timeout=5,
            limit=ConnectionLimit(METRICS_CONNECTIONS, listener="metrics"),
        )
        await metrics_runner.setup()
        metrics_site = web.TCPSite(
            metrics_runner, settings.server.metrics_host, settings.server.metrics_port
        )
        await metrics_site.start()
        host, mport = metrics_runner.addresses[0][:2]
        _announce({"metrics": f"http://{host}:{mport}/metrics"})
    # Everything built so far (modules, the app) lives as long as the process: keep it out
    # of later garbage collections, whose full passes over it took hundreds of ms each.
    gc.freeze()
    port = runner.addresses[0][1] if runner.addresses else settings.server.port
    log.info(
        "leadgate listening on http://%s:%s (role %s, at most %d connections, %d open files)",
        settings.server.host,
        port,
        role,
        max_connections,
        open_files,
    )
    _announce({"listening": f"http://{settings.server.host}:{port}", "role": role})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info(
        "shutting down (requests in flight get %g s to finish)", settings.server.shutdown_grace_s
    )
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()


def _announce(line: dict[str, str]) -> None:
    """One of ``serve``'s lines on stdout (where it listens). A reader that went away
    (``serve | head -1``) does not stop the service, which is serving already: a WARNING
    says so, and stdout points at /dev/null from then on. It stopped with tracebacks,
    "[service.unavailable] nothing was stored", and exit 1 or 120."""
    try:
        print(json.dumps(line), flush=True)
    except BrokenPipeError:
        _reader_gone()
        log.warning("standard output's reader went away; serving on, printing nothing more")


#: Arguments that name files: any bytes the file system takes are fine there.
PATH_ARGUMENTS = frozenset({"config", "key_file"})


def check_text_arguments(args: argparse.Namespace) -> None:
    """Every argument but a path must be text: Python hands command-line bytes that are
    not UTF-8 over as surrogate escapes, which no database stores (exit 1 with a
    ``UnicodeEncodeError`` until this check)."""
    for dest, value in sorted(vars(args).items()):
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, str) or dest in PATH_ARGUMENTS:
                continue
            if dest == "nodes" and item.startswith("@"):
                continue  # @FILE: a path too
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                name = dest.replace("_", "-")
                raise ValidationError(
                    f"the {name} argument is not valid UTF-8 text", rule="cli.utf8"
                ) from None


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except (KeyboardInterrupt, RuntimeError) as exc:
        # Ctrl-C while the command starts (its arguments parsed, its configuration's
        # modules loaded), before it knows its configuration: a traceback until now.
        if not _by_ctrl_c(exc):
            raise
        return _interrupted(None, None)


def _by_ctrl_c(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C, or an error it caused: pydantic reports one met while
    it builds a model class (a module being loaded) as a ``RuntimeError`` from it."""
    return isinstance(exc, KeyboardInterrupt) or isinstance(exc.__cause__, KeyboardInterrupt)


def _interrupted(choice: ConfigChoice | None, settings: Settings | None) -> int:
    """:data:`INTERRUPTED_EXIT`, with one line on stderr (:func:`_interrupted_line`)."""
    # Said, not left to the shell's "^C": a write the command was making may have
    # landed just before (its result was never printed).
    return _interrupted_line(one_line(_using(choice, settings)))


def _using(choice: ConfigChoice | None, settings: Settings | None) -> str:
    """`` (config: ...; database: ...)`` for an error's line; empty before the command
    knew its configuration (``choice`` None)."""
    return "" if choice is None else f" ({where(choice, settings)})"


def _main(raw: list[str]) -> int:
    """:func:`main` for the arguments ``raw``."""
    epilog = help_epilog(raw) if {"-h", "--help"} & set(raw) else ""
    try:
        args = build_parser(epilog).parse_args(raw)
    except SystemExit:  # --help, --version, a usage error: printed, to be flushed now
        try:
            if sys.stdout is not None:
                sys.stdout.flush()
        except BrokenPipeError:
            return _reader_gone()
        except OSError as exc:
            return _unwritable(exc, completed=False)
        raise
    except BrokenPipeError:  # their text was longer than the pipe's buffer
        return _reader_gone()
    except OSError as exc:  # written unbuffered (PYTHONUNBUFFERED=1) to a full disk
        return _unwritable(exc, completed=False)
    except LeadgateError as exc:  # `--version >&-`, `--help >&-`: nowhere to print (check_stdout)
        return _refused(exc, None, None)
    # Imported once the arguments parsed: `--version` and a usage error answer without
    # loading asyncio, and pydantic and SQLAlchemy (the configuration's checks).
    import asyncio

    from leadgate.core.config import load_settings

    choice = discover(args.config)
    settings: Settings | None = None
    try:
        check_stdout()
        check_text_arguments(args)
        settings = load_settings(choice.path)
        setup_logging(settings)
        if args.command == "db":
            from leadgate.database.db import upgrade

            revision = {
                "revision": upgrade(
                    settings.database.url, busy_timeout_s=settings.database.busy_timeout_s
                )
            }
            return _emit(render(revision, args.format, ("db", "upgrade")))
        if args.command == "serve" and args.check_ports:
            check_ports(settings, args.role)
            return _emit(render({"ports": "free"}, args.format, ("serve", None)))
        if args.command == "serve":
            asyncio.run(_serve(settings, args.role))
            return 0
        result = asyncio.run(_admin(settings, args))
        command = (args.command, getattr(args, f"{args.command}_command", None))
        return _emit(render(result, args.format, command))
    except LeadgateError as exc:
        if isinstance(exc, Unavailable) and _only_reads(args):
            exc = when_reading(exc)
        return _refused(exc, choice, settings)
    except KeyboardInterrupt:
        return _interrupted(choice, settings)
    except Exception as exc:
        if _by_ctrl_c(exc):
            return _interrupted(choice, settings)
        from leadgate.database.db import damaged_file
        from leadgate.database.faults import login_refused, unavailable

        damaged = None if settings is None else damaged_file(exc, settings.database.url)
        if damaged is not None:
            return _refused(damaged, choice, settings)
        login = login_refused(exc)
        if login is not None:
            refusal = ConfigError(
                f"the database server refused the connection ({login}): correct "
                "[database] url (or LEADGATE_DATABASE__URL)",
                rule=LOGIN_RULE,
            )
            return _refused(refusal, choice, settings)
        # A fault met outside a transaction (the schema check that opens every command,
        # `db upgrade`): the database cannot be reached, as a fault inside one says. It
        # was exit 1 `[internal]`, the driver's error named as a bug.
        fault = unavailable(exc)
        if fault is not None:
            told = when_reading(fault) if _only_reads(args) else fault
            return _refused(told, choice, settings, cause=exc)
        with contextlib.suppress(Exception):
            log.debug("command failed", exc_info=loggable(exc))
        # stderr is the service's log for `serve`: a database error's text (PostgreSQL's
        # DETAIL, a trigger's message) quotes the statement's values, so it is named by
        # its types and codes (error_text) as a logged traceback names it.
        say(
            one_line(
                f"leadgate: error: {error_text(exc)} ({where(choice, settings)}) [{INTERNAL_RULE}]"
            )
        )
        return 1


def _only_reads(args: argparse.Namespace) -> bool:
    """Whether the command only reads (``... list``, ``... show``): a database fault is
    told as such, not as "nothing was stored"."""
    return getattr(args, f"{args.command}_command", None) in ("list", "show")


def _refused(
    exc: LeadgateError,
    choice: ConfigChoice | None,
    settings: Settings | None,
    cause: BaseException | None = None,
) -> int:
    """Exit 2 (:data:`IN_DOUBT_EXIT` for :data:`WRITE_IN_DOUBT_RULE`) with one line, the rule
    last (scripts look for "[rule]" at the end); ``cause``: the driver's error it was
    made of, named too."""
    # A damaged file's message is the one for HTTP clients; an operator gets the file.
    message = exc.detail if isinstance(exc, DatabaseDamaged) else exc.message
    if cause is not None:
        # Which of a refused connection, a host that does not resolve or a timeout it
        # was, in the words a log line may carry (a database error's types and codes).
        message = f"{message} ({error_text(cause)})"
    say(one_line(f"leadgate: error: {message}{_using(choice, settings)} [{exc.rule}]"))
    return IN_DOUBT_EXIT if exc.rule == WRITE_IN_DOUBT_RULE else 2


#: The shell's status for a process that SIGPIPE ended (128 + 13), as ``| head`` gives
#: any other tool; not 1, which says the command failed.
BROKEN_PIPE_EXIT = 141


def _emit(text: str) -> int:
    """Print the result: exit 0, or :data:`BROKEN_PIPE_EXIT` with one line on stderr
    when the reader went away (``| head``) after the command itself completed."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            say("leadgate: the command completed; its output was not all read (broken pipe)")
        return _reader_gone()
    except OSError as exc:
        return _unwritable(exc, completed=True)
    return 0


def _unwritable(exc: OSError, *, completed: bool) -> int:
    """Exit 2 ``[cli.stdout]`` with one line on stderr when stdout cannot take the output
    (``> /dev/full``, a full disk: ENOSPC): it was a traceback for ``--help`` and
    ``--version`` (exit 1, or 120 from Python's flush at exit), ``[internal]`` for a
    command, which may have completed (``key create``: its key made, the secret lost)."""
    what = "the command completed; its output" if completed else "the output"
    with contextlib.suppress(OSError):
        say(
            one_line(
                f"leadgate: error: {what} could not be written ({error_text(exc)}) [{STDOUT_RULE}]"
            )
        )
    _reader_gone()  # Python's flush at exit must not fail again
    return 2


def _reader_gone() -> int:
    """:data:`BROKEN_PIPE_EXIT`, once stdout points at /dev/null: Python flushes stdout
    again at exit, which must not raise a second time (the Python docs' recipe for
    SIGPIPE; ``--version | head -0`` ended in a traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)  # (stdout's descriptor holds /dev/null now; `serve` runs on)
    return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
