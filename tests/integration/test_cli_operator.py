"""The operator side of the real ``leadgate`` command (issue 15), as subprocesses (a
process each, or independent commands one after the other in one, :func:`batch`): config
discovery (``--config``, ``$LEADGATE_CONFIG``, ``./config.toml``, defaults; named on
``--help`` and in errors), ``key list|revoke``, case-insensitive roles and password
prompts (stdin, environment, a real pseudo-terminal without echo), ``review ...`` and
``delivery ...`` with JSON and ``--format table``, clear errors and exit codes, the demo
key file and the port check.

Work items are made in-process through the real turn path on the same SQLite file."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from leadgate.app import App
from leadgate.core.clock import RandomIds, SystemClock
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.database.db import Database
from leadgate.domain import links, orgs
from outbox.store import CARD_DECIDED_ERROR
from tests.helpers import api_trigger, make_agent, make_org, session_item
from tests.integration.test_cli import LEADGATE, TIMEOUT, Run, _env, write_config
from tests.integration.test_operator_api import TimeoutChannel
from tests.review_support import add_destination
from tests.service_proc import cli_batch, free_port

ME = getpass.getuser()


def lg(
    cwd: Path,
    *args: str,
    stdin: str = "",
    env: dict[str, str] | None = None,
    runner: list[str] = LEADGATE,
) -> Run:
    """``leadgate args...`` in ``cwd`` (``runner=[]``: ``args`` is the whole command)."""
    proc = subprocess.run(
        [*runner, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**_env(), **(env or {})},
        cwd=cwd,
        input=stdin,
    )
    return Run(tuple(args), proc.returncode, proc.stdout.strip(), proc.stderr.strip())


def par(cwd: Path, *calls: tuple[str, ...] | tuple[tuple[str, ...], dict[str, Any]]) -> list[Run]:
    """Independent commands at once (each is a fresh process): ``(args...)`` or
    ``((args...), {"stdin": ..., "env": ...})``."""
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = []
        for call in calls:
            if len(call) == 2 and isinstance(call[1], dict):
                args, kwargs = call
                futures.append(pool.submit(lg, cwd, *args, **kwargs))
            else:
                futures.append(pool.submit(lg, cwd, *call))
        return [f.result() for f in futures]


def batch(cwd: Path, *calls: tuple[str, ...]) -> list[Run]:
    """Independent commands (no standard input, no environment of their own) one after
    the other in one child process, in ``cwd`` with no ``--config`` as :func:`lg` runs
    them (:func:`tests.service_proc.cli_batch`: a ``leadgate`` start costs most of a
    second of CPU, a dozen of them most of a test's time)."""
    done = cli_batch(sys.executable, None, calls, env=_env(), cwd=cwd, timeout=TIMEOUT * 3)
    return [Run(tuple(run.args), run.code, run.out.strip(), run.err.strip()) for run in done]


def _timing_out_app(url: str) -> App:
    """The service on ``url`` in process, its Slack posts timing out (``deliveryUnknown``)."""
    return App(
        Settings.model_validate({"database": {"url": url}}),
        enable_adapters=False,
        channels={"slack": TimeoutChannel()},
    )


async def _seed(url: str) -> dict[str, Any]:
    app = _timing_out_app(url)
    try:
        org = await make_org(app, "acme")
        other = await make_org(app, "globex")
        await make_agent(app, org, "lead")
        worker = await make_agent(app, org, "worker", lead="lead")
        items = []
        for n in range(4):
            out = await app.turns.run(
                Trigger(
                    org.id,
                    worker["id"],
                    f"s{n}",
                    f"task {n} #complete #escalate",
                    BindingSpec(BindingKind.api),
                )
            )
            assert isinstance(out, Gated)
            items.append(out.work_item_id)
        slack = BindingSpec(BindingKind.slack, {"team": "T", "channel": "C", "thread_ts": "1"})
        out = await app.turns.run(Trigger(org.id, worker["id"], "u", "post #complete", slack))
        assert isinstance(out, Gated)
        await drain(app.lead_runner)
        await drain(app.relay)  # the slack send times out: deliveryUnknown
        async with app.db.tx() as conn:
            for email, role in (("mia@example.com", "Member"), ("vic@example.com", "Viewer")):
                await orgs.create_user(
                    conn, app.clock, app.ids, org.id, email, role, orgs.hash_password("x" * 12)
                )
        detail = await app.reviews.detail(org.principal, str(out.work_item_id))
        return {
            "items": items,
            "unknown": out.work_item_id,
            "delivery": detail["deliveries"][0]["id"],
            "other_key": other.key,
            "key": org.key,
        }
    finally:
        await app.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cli-operator")
    db = root / "lg.db"
    # ./config.toml in the working directory: the commands below carry no --config.
    write_config(root / "config.toml", db)
    shutil.copyfile(sqlite_template, db)  # what `db upgrade` makes (tested in test_cli)
    seeded = asyncio.run(_seed(f"sqlite+aiosqlite:///{db}"))
    return {"root": root, "db": db, **seeded}


def rows(world: dict[str, Any], sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(world["db"]) as conn:
        return conn.execute(sql).fetchall()


# ------------------------------------------------------------------ config discovery


def test_config_discovery_order_is_named_on_help_and_in_errors(
    world: dict[str, Any], tmp_path: Path
) -> None:
    root: Path = world["root"]
    other = write_config(tmp_path / "other.toml", tmp_path / "other.db")
    pg = write_config(tmp_path / "pg.toml", tmp_path / "x.db")
    pg.write_text(
        pg.read_text().replace(
            f'url = "sqlite+aiosqlite:///{tmp_path / "x.db"}"',
            'url = "postgresql+asyncpg://leadgate:hunter2@127.0.0.1:1/leadgate"',
        )
    )
    via_env = {"env": {"LEADGATE_CONFIG": str(other)}}
    helped, listed, missing, from_env, explicit, bare, secret = par(
        root,
        ("review", "list", "--help"),
        ("review", "list", "--org", "acme"),  # ./config.toml is used without --config
        ("review", "show", "--org", "acme", "wi_nope"),
        (("review", "list", "--org", "acme"), via_env),
        (("review", "list", "--org", "acme", "--config", str(root / "config.toml")), via_env),
        (("--config", str(tmp_path / "absent.toml"), "key", "list", "--org", "acme"), {}),
        ("key", "list", "--org", "acme", "--config", str(pg)),
    )
    assert helped.code == 0
    assert "./config.toml (found in the current directory)" in helped.out
    assert f"database: sqlite+aiosqlite:///{world['db']}" in helped.out
    assert listed.json()["total"] == 5
    missing.rule_error("workItem.not_found")
    assert "config: ./config.toml (found in the current directory)" in missing.err
    assert f"database: sqlite+aiosqlite:///{world['db']}" in missing.err
    from_env.rule_error("db.not_migrated")  # the env file wins over ./config.toml
    assert f"config: {other} (from $LEADGATE_CONFIG)" in from_env.err
    assert explicit.json()["total"] == 5  # --config wins over the environment
    assert bare.code == 2 and "cannot read config file" in bare.err
    assert "absent.toml (from --config)" in bare.err
    defaults = lg(tmp_path, "key", "list", "--org", "acme")
    defaults.rule_error("db.not_migrated")
    assert "built-in defaults" in defaults.err
    assert "sqlite+aiosqlite:///./leadgate.db" in defaults.err
    # (Nothing listens on port 1: the database cannot be reached, said as such.)
    secret.rule_error("service.unavailable")
    assert "hunter2" not in secret.err and "***" in secret.err


# ---------------------------------------------------------------------------- keys


def test_key_list_and_revoke(world: dict[str, Any]) -> None:
    root: Path = world["root"]
    made = lg(root, "key", "create", "--org", "acme", "--scope", "agent:review", "--name", "ci")
    key = made.json()
    listing, table = batch(
        root,
        ("key", "list", "--org", "acme"),
        ("key", "list", "--org", "acme", "--format", "table"),
    )
    listed = {k["id"]: k for k in listing.json()}
    assert listed[key["id"]] == {
        "id": key["id"],
        "name": "ci",
        "scopes": ["agent:review"],
        "createdAt": listed[key["id"]]["createdAt"],
        "revokedAt": None,
        "active": True,
    }
    secret = key["apiKey"].split(".")[2]
    assert "secret" not in json.dumps(listed) and secret not in json.dumps(listed)
    assert table.code == 0 and table.out.splitlines()[0].split()[:3] == ["ID", "NAME", "SCOPES"]
    revoked = lg(root, "key", "revoke", "--org", "acme", key["id"]).json()
    assert revoked["active"] is False and revoked["revokedAt"]
    twice, elsewhere, listing = batch(
        root,
        ("key", "revoke", "--org", "acme", key["id"]),
        ("key", "revoke", "--org", "globex", key["id"]),
        ("key", "list", "--org", "acme"),
    )
    twice.rule_error("key.revoked")
    elsewhere.rule_error("key.not_found")
    after = {k["id"]: k for k in listing.json()}
    assert after[key["id"]]["active"] is False
    [(revoked_at,)] = rows(world, f"SELECT revoked_at FROM api_keys WHERE id = '{key['id']}'")
    assert revoked_at is not None  # authenticate_key refuses revoked keys


def test_a_reader_that_goes_away_is_a_broken_pipe_not_a_failure(world: dict[str, Any]) -> None:
    # `leadgate ... | head -0`: the command completes, its output has nowhere to go.
    proc = subprocess.Popen(
        [*LEADGATE, "key", "list", "--org", "acme"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=world["root"],
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT) == 141, err
    assert "the command completed" in err and "broken pipe" in err
    assert "Traceback" not in err and "Exception ignored" not in err


def test_serve_goes_on_serving_when_its_output_reader_goes_away(
    world: dict[str, Any], tmp_path: Path
) -> None:
    # `leadgate serve | head -1` (with [server] metrics_host, the metrics line is the
    # first): the listening line's print met a broken pipe, and the service, listening
    # already, stopped with tracebacks and "[service.unavailable] nothing was stored".
    port = free_port()
    config = write_config(tmp_path / "serve.toml", world["db"])
    config.write_text(config.read_text().replace("port = 0", f"port = {port}"))
    proc = subprocess.Popen(
        [*LEADGATE, "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the child, still starting, prints
        seen = []
        for raw in proc.stderr:  # until the warning, or the end of a service that stopped
            seen.append(raw.decode())
            if "reader went away; serving on" in seen[-1]:
                break
        else:
            raise AssertionError("".join(seen))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=TIMEOUT) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        err = "".join(seen) + proc.stderr.read().decode()
        assert proc.wait(timeout=TIMEOUT) == 0, err
        assert "Traceback" not in err and "Exception ignored" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)


def test_version_to_a_reader_gone_and_a_closed_stdout_are_one_line_not_a_traceback(
    world: dict[str, Any],
) -> None:
    # `leadgate --version | head -0`: it was a traceback (BrokenPipeError), exit 1.
    proc = subprocess.Popen(
        [*LEADGATE, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child, still starting, prints
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    # `leadgate key create ... >&-`: the key was made, its secret printed nowhere, and
    # the command said AttributeError [internal].
    [(keys,)] = rows(world, "SELECT count(*) FROM api_keys")
    closed = lg(world["root"], "sh", "-c", 'exec "$0" "$@" >&-', *LEADGATE,
                "key", "create", "--org", "acme", "--scope", "agent:trigger",
                runner=[])  # fmt: skip
    closed.rule_error("cli.stdout")
    assert "standard output is closed" in closed.err
    assert rows(world, "SELECT count(*) FROM api_keys") == [(keys,)]


def test_version_and_help_with_standard_output_closed_are_refused(tmp_path: Path) -> None:
    # `leadgate --version >&-`: print() printed it nowhere, and the exit was 0.
    # `leadgate --help >&-` (and a subcommand's): argparse put the help on stderr, exit 0.
    closed = ("sh", "-c", 'exec "$0" "$@" >&-', *LEADGATE)
    runs = par(
        tmp_path,
        ((*closed, "--version"), {"runner": []}),
        ((*closed, "--help"), {"runner": []}),
        ((*closed, "-h"), {"runner": []}),
        ((*closed, "review", "--help"), {"runner": []}),
        ((*closed, "review", "list", "--help"), {"runner": []}),
        # Every command's output goes through the one check in main(), the read-only ones
        # too: refused before the configuration is read, nothing lost with exit 0.
        ((*closed, "key", "list", "--org", "acme"), {"runner": []}),
        ((*closed, "review", "list", "--org", "acme"), {"runner": []}),
        ((*closed, "review", "show", "--org", "acme", "wi_1"), {"runner": []}),
        ((*closed, "delivery", "list", "--org", "acme"), {"runner": []}),
        ((*closed, "db", "upgrade"), {"runner": []}),
    )
    for run in runs:
        run.rule_error("cli.stdout")
        assert "standard output is closed" in run.err and run.err.count("\n") == 0, run


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_output_to_a_full_disk_is_one_line_not_a_traceback(
    world: dict[str, Any], unbuffered: str
) -> None:
    # `leadgate ... > /dev/full` (ENOSPC): --help and --version were a traceback (exit 1,
    # or 120 from Python's flush at exit), a command's result `OSError [internal]`.
    full = ("sh", "-c", 'exec "$0" "$@" > /dev/full', *LEADGATE)
    env = {"env": {"PYTHONUNBUFFERED": unbuffered}, "runner": []}
    runs = par(
        world["root"],
        ((*full, "--help"), env),
        ((*full, "user", "create", "--help"), env),
        ((*full, "--version"), env),
        ((*full, "key", "list", "--org", "acme"), env),
    )
    for run in runs:
        run.rule_error("cli.stdout")
        assert "could not be written" in run.err and run.err.count("\n") == 0, run
    assert "the command completed" in runs[-1].err


def test_errors_with_standard_error_closed_never_land_on_standard_output(
    world: dict[str, Any],
) -> None:
    # `leadgate ... 2>&-`: Python has no sys.stderr then, and print(file=None) printed
    # the error line on stdout, among the data a script parses. The exit code tells.
    closed = ("sh", "-c", 'exec "$0" "$@" 2>&-', *LEADGATE)
    missing, usage = par(
        world["root"],
        ((*closed, "key", "list", "--org", "nosuch"), {"runner": []}),
        ((*closed, "key", "list"), {"runner": []}),
    )
    assert (missing.code, missing.out, missing.err) == (2, "", ""), missing
    assert (usage.code, usage.out, usage.err) == (2, "", ""), usage


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_help_to_a_reader_gone_is_141_and_silent(unbuffered: str) -> None:
    # `leadgate user create --help | head -0`: argparse drops an error writing its help,
    # so unbuffered (PYTHONUNBUFFERED=1, as container images set) it was exit 0 with the
    # help lost; buffered, the flush after it said 141 already.
    for args in (["--help"], ["user", "create", "--help"]):
        proc = subprocess.Popen(
            [*LEADGATE, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**_env(), "PYTHONUNBUFFERED": unbuffered},
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the child, still starting, prints
        err = proc.stderr.read().decode()
        assert (proc.wait(timeout=TIMEOUT), err) == (141, ""), args


# --------------------------------------------------------------- users and passwords


def test_roles_are_case_insensitive_and_passwords_come_from_stdin_or_the_environment(
    world: dict[str, Any],
) -> None:
    root: Path = world["root"]
    common = ("user", "create", "--org", "acme")
    piped, env, short, long, bad, latin, empty = par(
        root,
        ((*common, "--email", "a@example.com", "--role", "member"), {"stdin": "pw from stdin\n"}),
        (
            (*common, "--email", "b@example.com", "--role", "ADMIN"),
            {"env": {"LEADGATE_PASSWORD": "pw from env!"}},
        ),
        ((*common, "--email", "c@example.com", "--role", "viewer"), {"stdin": ""}),
        # Login refuses a password over 1,024 characters unread: it could never log in.
        ((*common, "--email", "g@example.com", "--role", "viewer"), {"stdin": "p" * 1_025}),
        ((*common, "--email", "d@example.com", "--role", "boss"), {"stdin": "x" * 10}),
        # Bytes that are not UTF-8 (b"\xe9t\xe9..."), as the environment hands them over.
        (
            (*common, "--email", "e@example.com", "--role", "member"),
            {"env": {"LEADGATE_PASSWORD": "\udce9t\udce9 password"}},
        ),
        # --password "" is refused as typed: it made the user with $LEADGATE_PASSWORD's.
        (
            (*common, "--email", "h@example.com", "--role", "member", "--password", ""),
            {"env": {"LEADGATE_PASSWORD": "pw from env!"}},
        ),
    )
    assert piped.json()["role"] == "Member"
    assert env.json()["role"] == "Admin"
    short.rule_error("user.password")
    long.rule_error("user.password")
    assert bad.code == 2 and "unknown role 'boss'" in bad.err and "Traceback" not in bad.err
    latin.rule_error("cli.utf8")
    empty.rule_error("user.password")
    assert "--password is empty" in empty.err
    piped_latin = subprocess.run(
        [*LEADGATE, *common, "--email", "f@example.com", "--role", "member"],
        capture_output=True,
        env=_env(),
        cwd=root,
        input=b"\xe9t\xe9 password\n",
        timeout=TIMEOUT,
    )
    assert piped_latin.returncode == 2, piped_latin
    assert b"[cli.utf8]" in piped_latin.stderr and b"Traceback" not in piped_latin.stderr
    [(count,)] = rows(world, "SELECT count(*) FROM users WHERE email LIKE '_@example.com'")
    assert count == 2


def test_a_closed_standard_input_is_no_input_not_an_internal_error(
    world: dict[str, Any],
) -> None:
    # `leadgate ... <&-` (a job started with no standard input): Python has no
    # sys.stdin, and the password's or --reason -'s read was AttributeError [internal].
    closed = ("sh", "-c", 'exec "$0" "$@" <&-', *LEADGATE)
    password, reason = par(
        world["root"],
        ((*closed, "user", "create", "--org", "acme", "--email", "closed@example.com",
          "--role", "member"), {"runner": []}),
        ((*closed, "review", "reject", "--org", "acme", "wi_nosuch", "--reason", "-"),
         {"runner": []}),
    )  # fmt: skip
    password.rule_error("user.password")
    assert "no password given" in password.err
    reason.rule_error("workItem.not_found")  # standard input was read (empty) first


def test_a_password_on_the_command_line_is_warned_about_never_echoed(
    world: dict[str, Any],
) -> None:
    # --password is kept for the scripts that pass it, but shows the password in `ps`
    # and the shell's history: said on stderr, with the ways that do not.
    secret = "s3cret-on-the-command-line"
    acme = ("--org", "acme")
    made, updated, piped = batch(
        world["root"],
        ("user", "create", *acme, "--email", "flag@example.com", "--role", "member",
         "--password", secret),
        ("user", "update", *acme, "flag@example.com", "--password", secret + "2"),
        ("user", "create", *acme, "--email", "env@example.com", "--role", "member"),
    )  # fmt: skip
    assert made.json()["email"] == "flag@example.com"
    assert updated.json()["email"] == "flag@example.com"
    for run in (made, updated):
        assert "warning: --password shows the password" in run.err, run
        assert "$LEADGATE_PASSWORD" in run.err and "standard input" in run.err, run
        assert secret not in run.err + run.out, run
    # Without the flag (here: no line on standard input): no warning.
    piped.rule_error("user.password")
    assert "warning" not in piped.err, piped


@contextlib.contextmanager
def on_a_terminal(world: dict[str, Any], *args: str) -> Iterator[tuple[int, bytearray]]:
    """``leadgate args...`` in a child whose controlling terminal is a new pty (TERM=dumb),
    in the world's directory: the pty's file descriptor, and what it showed (see
    :func:`read_until`). On leaving, the pty is closed (a child still running ends on
    its SIGHUP) and the child reaped."""
    env = {**_env(), "TERM": "dumb"}
    command = [*LEADGATE, *args]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        os.chdir(world["root"])
        os.execve(command[0], command, env)
    try:
        yield fd, bytearray()
    finally:
        os.close(fd)
        with contextlib.suppress(ChildProcessError):  # (reaped by exit_code)
            os.waitpid(pid, 0)


def exit_code(fd: int, out: bytearray) -> int:
    """The exit code of the child on the pty ``fd``, once it has closed the terminal."""
    read_until(fd, out, None)
    _, status = os.wait()
    return os.waitstatus_to_exitcode(status)


def read_until(fd: int, out: bytearray, marker: bytes | None) -> None:
    """Add what the pty ``fd`` shows to ``out`` until ``marker`` is in it (None: until
    the child has closed the terminal, at its exit); fails after :data:`TIMEOUT`."""
    deadline = time.monotonic() + TIMEOUT
    while marker is None or marker not in out:
        assert time.monotonic() < deadline, out
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                read = os.read(fd, 4096)
            except OSError:  # EIO: the child is gone
                read = b""
            if not read:
                assert marker is None, out
                return
            out += read


def test_on_a_terminal_the_password_is_asked_twice_without_echo(world: dict[str, Any]) -> None:
    with on_a_terminal(
        world, "user", "create", "--org", "acme", "--email", "tty@example.com", "--role",
        "Member", "--name", "Tia",
    ) as (fd, out):  # fmt: skip
        read_until(fd, out, b"Password for the console user: ")
        os.write(fd, b"typed on a tty\n")
        read_until(fd, out, b"Repeat the password: ")
        os.write(fd, b"typed on a tty\n")
        read_until(fd, out, b'"role": "Member"')
        assert exit_code(fd, out) == 0, out
    assert b"typed on a tty" not in out  # no echo
    assert rows(world, "SELECT name FROM users WHERE email = 'tty@example.com'") == [("Tia",)]


def test_one_ctrl_c_stops_a_command_waiting_for_a_password(world: dict[str, Any]) -> None:
    """asyncio's SIGINT handler only cancels the command's task, which a blocking read
    never gets back to: the first Ctrl-C at the prompt was ignored (as at ``--reason -``
    read from a terminal, which reads through the same guard)."""
    with on_a_terminal(
        world, "user", "create", "--org", "acme", "--email", "ctrlc@example.com", "--role",
        "Member",
    ) as (fd, out):  # fmt: skip
        read_until(fd, out, b"Password for the console user: ")
        os.write(fd, b"\x03")  # the terminal's interrupt character: SIGINT
        assert exit_code(fd, out) == 130, out
    said = out.decode().strip().splitlines()[-1]
    assert said.startswith("leadgate: error: interrupted (Ctrl-C)"), out
    assert said.endswith("[cli.interrupted]") and b"Traceback" not in out, out
    assert rows(world, "SELECT count(*) FROM users WHERE email = 'ctrlc@example.com'") == [(0,)]


#: The console script's own code (``from leadgate.cli.main import main``), whose process
#: sends itself SIGINT as the import of the module named first on its command line
#: starts (Python raises KeyboardInterrupt there): Ctrl-C at a fixed point of the
#: command's start, not a race with its timing.
CTRL_C_AT_IMPORT = """
import os, signal, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == AT:
            os.kill(os.getpid(), signal.SIGINT)
        return None

# Python's own SIGINT handler, which it installs at start unless SIGINT is ignored: a
# suite started in the background (`cmd &` in a script) passes SIGINT on ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
AT = sys.argv.pop(1)
sys.meta_path.insert(0, CtrlC())
from leadgate.cli.main import main
sys.exit(main())
"""


@pytest.mark.parametrize("module", ["argparse", "leadgate.cli.context", "leadgate.core.logs"])
def test_ctrl_c_while_the_command_loads_its_modules_is_one_line_and_130(
    tmp_path: Path, module: str
) -> None:
    """Ctrl-C in a command's first tenths of a second, while ``leadgate.cli.main``
    loads its modules (before ``main()`` runs), was a KeyboardInterrupt traceback."""
    run = lg(tmp_path, sys.executable, "-c", CTRL_C_AT_IMPORT, module, "org", "list", runner=[])
    assert (run.code, run.out) == (130, ""), run
    assert run.err.startswith("leadgate: error: interrupted (Ctrl-C)"), run
    assert run.err.endswith("[cli.interrupted]") and "\n" not in run.err, run
    assert "(config:" not in run.err  # (before the command knew its configuration)


def _console(world: dict[str, Any], *steps: tuple[str, str, str]) -> list[Any]:
    """In-process console steps on the CLI's database: ``("login", email, password)`` is
    a session token or None; ``("reviewer", platform, identity)`` the linked reviewer of
    acme, or None."""

    async def run() -> list[Any]:
        db = Database(f"sqlite+aiosqlite:///{world['db']}")
        clock, ids = SystemClock(), RandomIds()
        out: list[Any] = []
        try:
            for step, a, b in steps:
                async with db.tx() as conn:
                    if step == "login":
                        out.append(await orgs.login(conn, clock, ids, a, b, 3_600_000))
                    else:
                        [(org_id,)] = rows(world, "SELECT id FROM organizations WHERE name='acme'")
                        out.append(await links.reviewer(conn, org_id, a, b))
        finally:
            await db.close()
        return out

    return asyncio.run(run())


def test_users_are_listed_updated_disabled_and_enabled(world: dict[str, Any]) -> None:
    root: Path = world["root"]
    acme = ("--org", "acme")
    email = "leaver@example.com"
    made = lg(
        root, "user", "create", *acme, "--email", email, "--role", "admin", stdin="first pw 1\n"
    )
    assert made.json()["role"] == "Admin"
    assert lg(root, "user", "link", *acme, "--email", email, "--slack", "T1:ULEAVER").code == 0
    first, second = _console(world, ("login", email, "first pw 1"), ("login", email, "first pw 1"))
    assert first and second

    listed, table, elsewhere = batch(
        root,
        ("user", "list", *acme),
        ("user", "list", *acme, "--format", "table"),
        ("user", "list", "--org", "globex"),
    )
    [me] = [u for u in listed.json() if u["email"] == email]
    assert (me["role"], me["disabled"], me["sessions"]) == ("Admin", False, 2)
    assert "password" not in json.dumps(listed.json()) and "hash" not in json.dumps(listed.json())
    assert table.out.splitlines()[0].split()[:4] == ["EMAIL", "NAME", "ROLE", "DISABLED"]
    assert email not in elsewhere.out  # another organization's users are not listed

    # A role change applies to open sessions at their next request: they stay.
    demoted = lg(root, "user", "update", *acme, email, "--role", "VIEWER", "--name", "Lee")
    assert demoted.json() | {"createdAt": None} == {
        "id": me["id"],
        "email": email,
        "name": "Lee",
        "role": "Viewer",
        "disabled": False,
        "createdAt": None,
        "sessionsEnded": 0,
    }
    disabled = lg(root, "user", "update", *acme, email, "--disable").json()
    assert (disabled["disabled"], disabled["sessionsEnded"]) == (True, 2)
    login, reviewer = _console(
        world, ("login", email, "first pw 1"), ("reviewer", "slack", "T1:ULEAVER")
    )
    assert login is None and reviewer is None
    lg(root, "review", "cancel", *acme, world["items"][3], "--as", email).rule_error(
        "user.disabled"
    )

    enabled = lg(
        root,
        "user",
        "update",
        *acme,
        email,
        "--enable",
        "--role",
        "member",
        "--reset-password",
        stdin="second pw 2\n",
    ).json()
    assert (enabled["disabled"], enabled["role"]) == (False, "Member")
    old, new, reviewer = _console(
        world,
        ("login", email, "first pw 1"),
        ("login", email, "second pw 2"),
        ("reviewer", "slack", "T1:ULEAVER"),
    )
    assert old is None and new and reviewer is not None  # the link came back with the user
    ended = lg(root, "user", "update", *acme, email, "--end-sessions").json()
    assert ended["sessionsEnded"] == 1

    nothing, both, other_org, short, no_input, empty = batch(
        root,
        ("user", "update", *acme, email),
        ("user", "update", *acme, email, "--disable", "--enable"),
        ("user", "update", "--org", "globex", email, "--disable"),
        ("user", "update", *acme, email, "--password", "short"),
        ("user", "update", *acme, email, "--reset-password"),  # standard input: empty
        ("user", "update", *acme, email, "--password", ""),
    )
    nothing.rule_error("user.update")
    assert both.code == 2 and "[cli.usage]" in both.err
    other_org.rule_error("user.not_found")
    short.rule_error("user.password")
    # Nothing on standard input is no password, said so (not "must be 8 to 1,024").
    no_input.rule_error("user.password")
    assert "no password given" in no_input.err
    empty.rule_error("user.password")
    assert "--password is empty" in empty.err
    [(disabled_at,)] = rows(world, f"SELECT disabled_at FROM users WHERE email = '{email}'")
    assert disabled_at is None


# ------------------------------------------------------------- reviews and deliveries


def test_review_commands_decide_through_the_one_commit_path(world: dict[str, Any]) -> None:
    root: Path = world["root"]
    first, second, third, fourth = world["items"]
    acme = ("--org", "acme")
    delivery = world["delivery"]
    uncertain, uncertain_table, listed, table, shown, *refused = batch(
        root,
        ("delivery", "list", *acme),
        ("delivery", "list", *acme, "--format", "table"),
        ("review", "list", *acme, "--reason", "escalated"),
        ("review", "list", *acme, "--format", "table"),
        ("review", "show", *acme, first, "--format", "table"),
        ("review", "cancel", *acme, fourth, "--as", "vic@example.com"),
        ("review", "cancel", *acme, fourth, "--as", "nobody@example.com"),
        ("review", "reject", *acme, fourth, "--reason", ""),
        ("review", "show", "--org", "globex", first),
        ("review", "show", "--org", "nope", first),
        ("review", "list", *acme, "--reason", "bored"),
        ("delivery", "confirm", "--org", "globex", delivery),
        ("review", "reject", *acme, second),
    )
    # Every uncertain delivery (a plain reply's or a card's too), with the id to act on.
    [unknown] = uncertain.json()["deliveries"]
    assert (unknown["id"], unknown["channel"], unknown["kind"]) == (delivery, "slack", "gating")
    # Where it was going, in words: the conversation to check before confirm or retry.
    assert unknown["to"] == "Slack channel C (team T), thread 1"
    assert uncertain_table.out, (uncertain_table.code, uncertain_table.err)
    assert uncertain_table.out.splitlines()[0].split()[:4] == ["ID", "KIND", "CHANNEL", "TO"]
    assert "Slack channel C (team T), thread 1" in uncertain_table.out
    assert delivery in uncertain_table.out
    assert [i["id"] for i in listed.json()["items"]][:1] == [first]
    assert table.code == 0
    header, *lines = table.out.splitlines()
    assert header.split()[:4] == ["ID", "AGENT", "CHANNEL", "REQUESTER"]
    assert any(first in line and "Summary: task 0" in line for line in lines)
    assert "Approval goes to: API: the stored answer is revealed" in shown.out
    assert "lead agent lead" in shown.out
    rules = [
        "scope.agent:review",
        "user.not_found",
        "decision.reason",
        "workItem.not_found",
        "org.not_found",
        "queue.reason",
        "delivery.not_found",
    ]
    for run, rule in zip(refused, rules, strict=False):
        run.rule_error(rule)
    usage = refused[-1]
    assert usage.code == 2 and "--reason" in usage.err

    approved, rejected, returned, cancelled, retried = par(
        root,
        ("review", "approve", *acme, first),
        (("review", "reject", *acme, second, "--reason", "-"), {"stdin": "Wrong numbers.\n"}),
        ("review", "return", *acme, third, "--feedback", "More detail.", "--as", "MIA@example.com"),
        ("review", "cancel", *acme, fourth, "--reason", "Duplicate of the 12th."),
        ("delivery", "retry", "--org", "acme", delivery),
    )
    assert approved.json()["status"] == "completed"  # an api item: nothing to send
    audit = approved.json()["audit"][-2]
    assert audit["action"] == "approve"
    assert (audit["actor"], audit["surface"]) == (f"cli:{ME}", "cli")
    assert audit["identity"] == f"os:{ME}@{socket.gethostname()}"
    assert audit["actorName"] == f"{ME} (command line)"
    assert rejected.json()["status"] == "rejected"
    assert rejected.json()["audit"][-1]["text"] == "Wrong numbers."
    assert returned.json()["status"] == "inProgress"
    last = returned.json()["audit"][-1]
    assert (last["actorName"], last["actorEmail"], last["surface"]) == (
        "mia@example.com",
        "mia@example.com",
        "cli",
    )
    assert cancelled.json()["status"] == "cancelled"
    # Why it was cancelled, in its audit entry (--reason was a usage error).
    last = cancelled.json()["audit"][-1]
    assert (last["action"], last["text"]) == ("cancel", "Duplicate of the 12th.")
    assert retried.json()["deliveries"][0]["status"] == "pending"

    again, confirm, cancel_rejected, reject_cancelled = batch(
        root,
        ("review", "approve", *acme, first),
        ("delivery", "confirm", "--org", "acme", delivery),
        ("review", "cancel", *acme, second),
        ("review", "reject", *acme, fourth, "--reason", "Late."),
    )
    # Cancel answers as approve and reject do: who decided (it was workItem.transition
    # "cannot go from rejected to cancelled", naming nobody).
    cancel_rejected.rule_error("workItem.status")
    assert f"work item {second} is rejected already, it cannot be cancelled: reject by " in (
        cancel_rejected.err
    )
    reject_cancelled.rule_error("workItem.status")
    assert f"work item {fourth} is cancelled, not awaitingHuman: cancel by " in (
        reject_cancelled.err
    )
    again.rule_error("workItem.status")  # 409: a decision happens once
    # The line says what the item is now; it said "is not awaitingHuman (or its lease
    # was lost)", and no lease is involved in a person's decision.
    assert f"work item {first} is completed, not awaitingHuman: approve by " in again.err
    # ... and who took it out of there, when: a decision run again after its answer was
    # lost (in doubt) reads that the first one landed.
    landed = r": approve by \S+ \(cli\) at \d{4}-\d\d-\d\dT[^;]*; nothing changed"
    assert re.search(landed, again.err), again.err
    assert "lease" not in again.err
    confirm.rule_error("delivery.status")  # no longer deliveryUnknown
    surfaces = rows(world, "SELECT action FROM audit WHERE surface = 'cli'")
    assert sorted(a for (a,) in surfaces) == [
        "approve",
        "cancel",
        "deliveryRetried",
        "reject",
        "return",
    ]


async def _seed_uncertain_cards(url: str) -> dict[str, str]:
    """Two escalated items whose review cards' posts (to a Slack review channel) timed
    out (``deliveryUnknown``); the first item approved since."""
    app = _timing_out_app(url)
    try:
        org = await make_org(app, "acme")
        await make_agent(app, org, "lead")
        worker = await make_agent(app, org, "worker", lead="lead")
        await add_destination(app, org.id, "slack", "C0R")
        for session in ("decided", "waiting"):
            await app.turns.run(api_trigger(org, worker, "hard #escalate #complete", session))
        await drain(app.lead_runner)
        await drain(app.relay)  # both cards' posts time out
        cards = {}
        for session in ("decided", "waiting"):
            item_id = await session_item(app, session)
            detail = await app.reviews.detail(org.principal, item_id)
            [card] = [d for d in detail["deliveries"] if d["kind"] == "card"]
            assert card["status"] == "deliveryUnknown"
            cards[session] = card["id"]
        await app.reviews.decide(org.principal, await session_item(app, "decided"), "approve")
        return cards
    finally:
        await app.stop()


def test_delivery_retry_of_a_card_whose_item_was_decided_cancels_it(
    tmp_path: Path, sqlite_template: Path
) -> None:
    """``delivery retry`` of a review card whose item was decided ends it ``cancelled``
    and says why (it was put back ``pending`` and posted after the decision); a card
    whose item still waits is retried as before."""
    db = tmp_path / "lg.db"
    write_config(tmp_path / "config.toml", db)
    shutil.copyfile(sqlite_template, db)
    cards = asyncio.run(_seed_uncertain_cards(f"sqlite+aiosqlite:///{db}"))
    acme = ("--org", "acme")
    decided = lg(tmp_path, "delivery", "retry", *acme, cards["decided"]).json()
    assert decided["delivery"] == {
        "id": cards["decided"],
        "kind": "card",
        "status": "cancelled",
        "error": CARD_DECIDED_ERROR,
    }
    assert decided["status"] == "completed"  # the item (an api one), approved
    shown = lg(tmp_path, "delivery", "retry", *acme, cards["waiting"], "--format", "table")
    assert shown.code == 0, shown
    assert f"Delivery {cards['waiting']} (card): pending" in shown.out
    lg(tmp_path, "delivery", "retry", *acme, cards["decided"]).rule_error("delivery.status")
    with sqlite3.connect(db) as conn:
        statuses = dict(conn.execute("SELECT id, status FROM deliveries WHERE kind = 'card'"))
    assert statuses == {cards["decided"]: "cancelled", cards["waiting"]: "pending"}


# ------------------------------------------------------------ demo key and ports


def test_the_demo_key_is_kept_in_a_private_file_reused_and_rotated(
    tmp_path: Path, sqlite_template: Path
) -> None:
    write_config(tmp_path / "config.toml", tmp_path / "demo.db")
    shutil.copyfile(sqlite_template, tmp_path / "demo.db")
    key_file = tmp_path / ".leadgate-demo-key"
    first = lg(tmp_path, "demo", "--key-file", str(key_file)).json()
    assert first["keyReused"] is False
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text().strip() == first["apiKey"]
    again = lg(tmp_path, "demo", "--key-file", str(key_file)).json()
    assert (again["keyReused"], again["apiKey"]) == (True, first["apiKey"])
    rotated = lg(tmp_path, "demo", "--key-file", str(key_file), "--rotate-key").json()
    assert rotated["keyReused"] is False and rotated["apiKey"] != first["apiKey"]
    assert rotated["revokedKeyId"] == first["apiKey"].split(".")[1]
    assert key_file.read_text().strip() == rotated["apiKey"]
    keys = {k["id"]: k["active"] for k in lg(tmp_path, "key", "list", "--org", "demo").json()}
    assert keys == {first["apiKey"].split(".")[1]: False, rotated["apiKey"].split(".")[1]: True}
    # A stale file (its key revoked elsewhere) gets a fresh key instead of a dead one.
    lg(tmp_path, "key", "revoke", "--org", "demo", rotated["apiKey"].split(".")[1]).json()
    fresh = lg(tmp_path, "demo", "--key-file", str(key_file)).json()
    assert fresh["keyReused"] is False and fresh["apiKey"] not in (
        first["apiKey"],
        rotated["apiKey"],
    )
    secret = fresh["apiKey"].split(".")[2]
    with sqlite3.connect(tmp_path / "demo.db") as conn:
        assert secret not in repr(conn.execute("SELECT * FROM api_keys").fetchall())


def test_a_key_file_that_cannot_be_written_stops_demo_before_any_key_changes(
    tmp_path: Path, sqlite_template: Path
) -> None:
    write_config(tmp_path / "config.toml", tmp_path / "demo.db")
    shutil.copyfile(sqlite_template, tmp_path / "demo.db")
    key_file = tmp_path / "kf" / "key"
    first = lg(tmp_path, "demo", "--key-file", str(key_file)).json()
    (tmp_path / "kf" / "key.tmp").mkdir()  # where the new key would be written first
    (tmp_path / "blocker").write_text("a file, not a directory")
    # A pipe (or a device: `--key-file /dev/null`) was replaced by the key's file.
    os.mkfifo(tmp_path / "pipe")
    for target in (key_file, tmp_path / "blocker" / "key", tmp_path / "kf", tmp_path / "pipe"):
        lg(tmp_path, "demo", "--key-file", str(target), "--rotate-key").rule_error("demo.key_file")
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)
    # The kept key is still the one valid Owner key of demo, and still in its file.
    keys = lg(tmp_path, "key", "list", "--org", "demo").json()
    assert [(k["id"], k["active"]) for k in keys] == [(first["apiKey"].split(".")[1], True)]
    assert key_file.read_text().strip() == first["apiKey"]


def test_commands_read_past_a_write_lock_and_wait_for_one_only_busy_timeout_s(
    tmp_path: Path, sqlite_template: Path
) -> None:
    """Another process's write transaction: a read command does not wait for it (it took
    the write lock itself, and waited 30 s whatever the config said), and a write command
    gives up after ``[database] busy_timeout_s`` with a clear error."""
    config = write_config(tmp_path / "config.toml", tmp_path / "lock.db")
    config.write_text(
        config.read_text().replace("[database]\n", "[database]\nbusy_timeout_s = 1.0\n", 1)
    )
    shutil.copyfile(sqlite_template, tmp_path / "lock.db")
    assert lg(tmp_path, "org", "create", "acme").code == 0  # the first connection sets WAL
    holder = sqlite3.connect(tmp_path / "lock.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        keys = lg(tmp_path, "key", "list", "--org", "acme")
        assert keys.code == 0 and [k["name"] for k in keys.json()] == ["owner"]
        started = time.monotonic()
        blocked = lg(tmp_path, "key", "create", "--org", "acme", "--scope", "agent:trigger")
        assert time.monotonic() - started < 15  # 1 s of waiting, plus the process's start
        blocked.rule_error("service.unavailable")
    finally:
        holder.close()
    assert [k["name"] for k in lg(tmp_path, "key", "list", "--org", "acme").json()] == ["owner"]


def test_a_port_in_use_is_a_clear_error_before_anything_is_written(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = tmp_path / "config.toml"
        write_config(config, tmp_path / "never.db")
        config.write_text(config.read_text().replace("port = 0", f"port = {port}"))
        checked = lg(tmp_path, "serve", "--check-ports")
        checked.rule_error("server.port_in_use")
        assert f"127.0.0.1:{port} is already in use" in checked.err
        served = lg(tmp_path, "serve")
        served.rule_error("server.port_in_use")
    assert not (tmp_path / "never.db").exists()
    assert lg(tmp_path, "serve", "--check-ports").json() == {"ports": "free"}
