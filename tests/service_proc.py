"""Run the REAL leadgate service as a subprocess, the way an operator does.

Acceptance tests and benchmarks use this to test the product from the outside: a TOML
config file, ``leadgate db upgrade``, the admin CLI (JSON on stdout) and
``leadgate serve``, all through ``python -m leadgate.cli.main`` in child processes. Nothing is
imported from the engine, so what is tested is exactly what ships.

Typical use::

    proc = ServiceProcess(tmp_path, config={"slack": {"signing_secret": "s3cret",
                                                      "api_url": stand_in.url}})
    proc.upgrade()                                  # leadgate db upgrade
    demo = proc.seed_demo()                         # leadgate demo -> Demo(key=..., ...)
    key = proc.admin("key", "create", "--org", demo.org, "--scope", "agent:review")["apiKey"]
    with proc.start():                              # leadgate serve; waits for /healthz
        ... talk to proc.url (e.g. f"{proc.url}/v1") ...
    # leaving the block = proc.stop(): SIGTERM, asserts exit code 0 within 10 s

Details:

* **Config.** :meth:`ServiceProcess.config_dict` is ``[server]`` (127.0.0.1, a free port,
  ``public_url``), ``[database] url`` (an SQLite file in ``workdir`` unless
  ``database_url`` is given, e.g. the ``pg_url`` fixture's PostgreSQL URL) and
  ``[models.script]``, deep-merged with ``config`` (any sections, e.g. ``[slack]``
  pointing at a stand-in or ``[models.gpt]`` with ``provider = "openai"``). It is written
  to ``workdir/leadgate.toml`` on construction and again by :meth:`write_config` (call
  it after changing ``config``).
* **Environment.** Children get the parent's environment minus any
  ``LEADGATE_<SECTION>__<KEY>`` override and ``LEADGATE_CONFIG`` (so a developer's shell
  cannot change a test), plus ``env`` given here (use it for overrides on purpose, e.g.
  ``{"LEADGATE_RUNNERS__POLL_INTERVAL_S": "0.2"}``), plus per-call ``env`` arguments.
* **Log.** The service's stdout and stderr go to ``workdir/service.log`` (appended across
  restarts). Every failure (no health in time, early exit, unclean stop) raises with the
  tail of that log; :meth:`log_tail` gives it on demand.
* **Ports.** The port is picked free on 127.0.0.1. If someone else takes it before the
  service binds, :meth:`start` picks another one (only when no ``port`` was given) and
  rewrites the config. Startup waits until the service printed its ``{"listening": ...}``
  line (so the answering process is ours) and ``/healthz`` answers 200.
* **Stopping.** :meth:`stop` sends SIGTERM and asserts a clean exit (code 0) within
  ``timeout`` (10 s); :meth:`kill` sends SIGKILL (crash tests) and returns at once after
  reaping. Both are idempotent. Processes still alive at interpreter exit are killed.
* :func:`make_template` / :func:`start_from_template`: migrate and seed the demo
  organization once (CLI), then start many services on private copies of that SQLite
  file (:func:`clone_sqlite`, consistent even in WAL mode): a service then costs only the
  ``serve`` startup.

The class is synchronous (subprocess + urllib) so it works from sync and async tests,
pytest fixtures of any scope, and plain scripts (``bench/``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
DEFAULT_STARTUP_TIMEOUT = 40.0
DEFAULT_STOP_TIMEOUT = 10.0
DEFAULT_ADMIN_TIMEOUT = 120.0

_ALIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:  # pragma: no cover - only when a test forgot to stop
    for proc in list(_ALIVE):
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(timeout=5)


class ServiceError(RuntimeError):
    """The service process could not be started, or did not behave."""


class AdminError(RuntimeError):
    """An admin CLI command exited non-zero (``returncode``, ``stderr``, ``rule``)."""

    def __init__(self, args: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.command = list(args)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        match = re.search(r"\[([^\]]+)\]\s*$", stderr.strip())
        # ``leadgate: error: <message> [<rule>]`` for rule violations (exit code 2).
        self.rule = match.group(1) if match else None
        super().__init__(
            f"leadgate {' '.join(args)} exited {returncode}:\n{stderr.strip() or stdout.strip()}"
        )


@dataclass(frozen=True)
class Demo:
    """What ``leadgate demo`` created: an organization, its Owner key and three agents.

    ``lead`` is a lead agent, ``worker`` a worker reviewed by ``lead``, ``plain`` a worker
    with no lead (all on the ``script`` model). Agent fields are names (= slugs), usable
    as the OpenAI ``model`` and as CLI arguments.
    """

    org: str
    org_id: str
    key: str
    lead: str = "lead"
    worker: str = "worker"
    plain: str = "plain"

    @classmethod
    def from_cli(cls, out: Mapping[str, Any]) -> Demo:
        """Build from the JSON that ``leadgate demo`` prints."""
        return cls(org=str(out["org"]), org_id=str(out["orgId"]), key=str(out["apiKey"]))


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def sqlite_url(path: Path) -> str:
    """SQLAlchemy async URL of an SQLite file (absolute path)."""
    return f"sqlite+aiosqlite:///{Path(path).resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file of an ``sqlite+aiosqlite:///`` URL (None for other databases)."""
    prefix = "sqlite+aiosqlite:///"
    return Path(url[len(prefix) :]) if url.startswith(prefix) else None


def clone_sqlite(src: Path, dst: Path) -> None:
    """Copy an SQLite database with the backup API (consistent, WAL content included)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{dst}{suffix}").unlink()
    source = sqlite3.connect(src)
    target = sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``extra``; nested tables merge key by key."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def toml_dumps(data: Mapping[str, Any]) -> str:
    """A small TOML writer for config files (tables, strings, numbers, bools, arrays)."""
    lines: list[str] = []

    def table(prefix: tuple[str, ...], node: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, Mapping)}
        tables = {k: v for k, v in node.items() if isinstance(v, Mapping)}
        if prefix and (scalars or not tables):
            lines.append(f"[{'.'.join(_toml_key(p) for p in prefix)}]")
        for key, value in scalars.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
        if prefix and (scalars or not tables):
            lines.append("")
        for key, value in tables.items():
            table((*prefix, key), value)

    table((), data)
    return "\n".join(lines).rstrip() + "\n"


def _child_env(*overrides: Mapping[str, str] | None, root: Path = REPO_ROOT) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("LEADGATE_") and "__" in k) and k != "LEADGATE_CONFIG"
    }
    env["PYTHONUNBUFFERED"] = "1"
    # The source tree on the path, whatever the caller's working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    for extra in overrides:
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
    return env


_BATCH = """
import contextlib, io, json, sys, traceback
from leadgate.cli.main import main
config, commands = sys.argv[1], json.loads(sys.argv[2])
for args in commands:
    # The pipes a `leadgate` process writes to: stdout strict UTF-8 (text it cannot
    # encode fails the command, as in a process), stderr UTF-8 with backslashes.
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(
        io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--config", config, *args] if config else args)
        except SystemExit as exc:  # argparse's usage errors: what the process exits with
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
    texts = [stream.buffer.getvalue().decode("utf-8") for stream in (out, err)]
    print(json.dumps({"args": args, "code": code, "out": texts[0], "err": texts[1]}))
"""


class CommandRun(NamedTuple):
    """One command of :func:`cli_batch`: its arguments, exit code, stdout and stderr."""

    args: list[str]
    code: int
    out: str
    err: str


def cli_batch(
    python: str,
    config: Path | None,
    commands: Sequence[Sequence[str]],
    *,
    env: dict[str, str],
    cwd: Path = REPO_ROOT,
    timeout: float = 120,
) -> list[CommandRun]:
    """Run ``leadgate --config CONFIG`` commands (no ``--config`` when ``config`` is None:
    the command finds its own) through ``leadgate.cli.main.main`` (what ``leadgate``
    runs) one after the other in a single child process: one interpreter start instead
    of one per command (each costs most of a second of CPU). Each gets its own stdout
    and stderr, standard input is empty; an argparse exit or an uncaught exception is
    its exit code and output, as a process of its own would show it."""
    result = subprocess.run(
        [python, "-c", _BATCH, str(config or ""), json.dumps([list(c) for c in commands])],
        input="",
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    runs = [CommandRun(**json.loads(line)) for line in result.stdout.splitlines()]
    if result.returncode != 0 or len(runs) != len(commands):
        raise RuntimeError(f"cli batch failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return runs


@dataclass
class ServiceProcess:
    """One leadgate service (config, database, admin CLI, ``serve`` subprocess).

    Arguments:
        workdir: a directory of its own (config, SQLite file, log).
        database_url: default ``sqlite+aiosqlite:///<workdir>/leadgate.db``; give a
            ``postgresql+asyncpg://`` URL (e.g. the ``pg_url`` fixture) for PostgreSQL.
        config: extra TOML sections, deep-merged over the generated ones.
        env: environment overrides for every child (admin commands and the service).
        role: default ``--role`` of :meth:`start` (``api``, ``worker`` or ``all``).
        port: fixed port (default: a free one, re-picked if taken at startup).
        python: interpreter for the children (default: this one, i.e. the venv's).
        serve_python_args: interpreter options for ``serve`` only, before ``-m leadgate.cli.main``
            (e.g. ``("-m", "cProfile", "-o", "serve.prof")`` to profile the service).
        serve_prefix: a command that runs ``serve`` (e.g. ``("prlimit", "--nofile=600:600")``
            for a process limit of its own).
        root: the source tree the children run (default: this checkout). It is their
            working directory: with ``-m``, that directory comes first on ``sys.path``,
            before ``PYTHONPATH`` and the venv's editable install (``bench.ab``).
    """

    workdir: Path
    database_url: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    role: str = "all"
    port: int | None = None
    python: str = sys.executable
    serve_python_args: tuple[str, ...] = ()
    serve_prefix: tuple[str, ...] = ()
    root: Path = REPO_ROOT
    demo: Demo | None = None

    _fixed_port: bool = field(init=False, default=False)
    _proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _log_offset: int = field(init=False, default=0)
    _killed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.database_url is None:
            self.database_url = sqlite_url(self.workdir / "leadgate.db")
        self._fixed_port = self.port is not None
        if self.port is None:
            self.port = free_port()
        self.write_config()

    # -- paths and addresses -------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        """The TOML file every child reads (``--config``)."""
        return self.workdir / "leadgate.toml"

    @property
    def log_path(self) -> Path:
        """stdout + stderr of the service process(es)."""
        return self.workdir / "service.log"

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (OpenAI base_url: ``url + "/v1"``)."""
        return f"http://{HOST}:{self.port}"

    @property
    def sqlite_file(self) -> Path | None:
        """The SQLite database file, or None on PostgreSQL."""
        assert self.database_url is not None
        return sqlite_path(self.database_url)

    # -- config ---------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """The full configuration that is written to :attr:`config_path`."""
        base: dict[str, Any] = {
            "server": {"host": HOST, "port": self.port, "public_url": self.url},
            "database": {"url": self.database_url},
            "models": {"script": {"provider": "script"}},
        }
        return deep_merge(base, self.config)

    def write_config(self) -> Path:
        """(Re)write the config file; returns its path."""
        self.config_path.write_text(toml_dumps(self.config_dict()), encoding="utf-8")
        return self.config_path

    # -- admin CLI ------------------------------------------------------------------------

    def cli(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_ADMIN_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``leadgate --config <file> ARGS...``; returns the completed process as is."""
        cmd = [self.python, "-m", "leadgate.cli.main", "--config", str(self.config_path), *args]
        return subprocess.run(
            cmd,
            cwd=self.root,
            env=_child_env(self.env, env, root=self.root),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def admin(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_ADMIN_TIMEOUT,
    ) -> Any:
        """Run an admin command and return its JSON output, e.g.
        ``admin("key", "create", "--org", "demo", "--scope", "agent:review")``.

        Raises :class:`AdminError` (with ``returncode``, ``stderr`` and the broken ``rule``)
        when the command exits non-zero.
        """
        done = self.cli(*args, env=env, timeout=timeout)
        if done.returncode != 0:
            raise AdminError(args, done.returncode, done.stdout, done.stderr)
        try:
            return json.loads(done.stdout)
        except ValueError:
            raise AdminError(
                args, done.returncode, done.stdout, f"output is not JSON:\n{done.stdout}"
            ) from None

    def admin_many(
        self, *commands: Sequence[str], timeout: float = DEFAULT_ADMIN_TIMEOUT
    ) -> list[Any]:
        """Run several admin commands concurrently (independent ones only; SQLite writers
        queue on the busy timeout); returns their JSON outputs in order."""
        base = [self.python, "-m", "leadgate.cli.main", "--config", str(self.config_path)]
        env = _child_env(self.env, root=self.root)
        procs = [
            (
                list(args),
                subprocess.Popen(
                    [*base, *args],
                    cwd=self.root,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for args in commands
        ]
        outputs: list[Any] = []
        errors: list[AdminError] = []
        deadline = time.monotonic() + timeout
        for args, proc in procs:
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += "\n(timed out)"
            if proc.returncode != 0:
                errors.append(AdminError(args, proc.returncode, out, err))
                outputs.append(None)
            else:
                outputs.append(json.loads(out))
        if errors:
            raise errors[0]
        return outputs

    def batch(self, commands: Sequence[Sequence[str]]) -> list[Any]:
        """Admin commands one after the other in one child process (:func:`cli_batch`:
        one interpreter start instead of one per command); returns their JSON outputs.
        Raises :class:`AdminError` on the first command that exits non-zero."""
        outputs: list[Any] = []
        env = _child_env(self.env, root=self.root)
        for run in cli_batch(self.python, self.config_path, commands, env=env, cwd=self.root):
            if run.code != 0:
                raise AdminError(run.args, run.code, run.out, run.err)
            outputs.append(json.loads(run.out))
        return outputs

    def upgrade(self) -> str:
        """``leadgate db upgrade``; returns the schema revision."""
        return str(self.admin("db", "upgrade")["revision"])

    def seed_demo(self, name: str = "demo") -> Demo:
        """``leadgate demo``: an organization with lead, worker and plain; sets ``demo``."""
        self.demo = Demo.from_cli(self.admin("demo", "--name", name))
        return self.demo

    def upgrade_and_seed_demo(self, then: Sequence[Sequence[str]] = ()) -> Demo:
        """:meth:`upgrade`, :meth:`seed_demo` and the admin commands ``then`` in one child
        process (:meth:`batch`); sets and returns ``demo``."""
        _, seeded, *_ = self.batch([["db", "upgrade"], ["demo", "--name", "demo"], *then])
        self.demo = Demo.from_cli(seeded)
        return self.demo

    # -- the service process ---------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the running service (None when not started)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the service process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(
        self,
        *,
        role: str | None = None,
        timeout: float = DEFAULT_STARTUP_TIMEOUT,
        env: Mapping[str, str] | None = None,
        attempts: int = 3,
    ) -> ServiceProcess:
        """Start ``leadgate serve`` and wait until it listens and ``/healthz`` answers 200.

        Returns ``self`` (usable as a context manager that stops it). Raises
        :class:`ServiceError` with the log tail when it does not come up.
        """
        if self.running:
            raise ServiceError(f"the service is already running (pid {self.pid})")
        role = role or self.role
        for attempt in range(1, attempts + 1):
            self._spawn(role, env)
            try:
                self._wait_ready(role, timeout)
                return self
            except ServiceError as exc:
                in_use = "address already in use" in self._new_log().lower()
                self._reap_after_failed_start()
                if in_use and not self._fixed_port and attempt < attempts:
                    self.port = free_port()
                    self.write_config()
                    continue
                raise ServiceError(f"{exc}\n{self.log_tail()}") from None
        raise AssertionError("unreachable")

    def _spawn(self, role: str, env: Mapping[str, str] | None) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"\n===== leadgate serve --role {role} (port {self.port}) =====\n".encode())
            self._killed = False
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                [
                    *self.serve_prefix,
                    self.python,
                    *self.serve_python_args,
                    "-m",
                    "leadgate.cli.main",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--role",
                    role,
                ],
                cwd=self.root,
                env=_child_env(self.env, env, root=self.root),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group: a Ctrl-C in the test runner does not reach it, so
                # stop() always exercises the SIGTERM path.
                start_new_session=True,
            )
        _ALIVE.add(self._proc)

    def _new_log(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _wait_ready(self, role: str, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        listening = f'"listening": "http://{HOST}:{self.port}"'
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServiceError(f"leadgate serve exited with code {code} during startup")
            if listening in self._new_log() and self.healthy():
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"leadgate serve did not become healthy within {timeout:.0f}s")
            time.sleep(0.05)

    def _reap_after_failed_start(self) -> None:
        if self._proc is None:
            return
        self._killed = True  # reported by start(); stop() need not report it again
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        _ALIVE.discard(self._proc)

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when ``GET /healthz`` answers 200 right now."""
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=timeout) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT, *, check: bool = True) -> int | None:
        """SIGTERM, then wait up to ``timeout`` seconds. Returns the exit code.

        With ``check`` (default) asserts a clean exit, code 0, in time; a process that does
        not exit in time is SIGKILLed and the assertion fails with the log tail. When the
        service is not running any more it returns the earlier exit code, and (``check``)
        asserts that it was 0 unless :meth:`kill` ended it: a service that died on its
        own fails the test.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is not None:
            _ALIVE.discard(proc)
            code = proc.returncode
            if check and code != 0 and not self._killed:
                raise AssertionError(
                    f"leadgate serve had already exited (crashed?) with code {code}\n"
                    f"{self.log_tail()}"
                )
            return code
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            _ALIVE.discard(proc)
            if check:
                raise AssertionError(
                    f"leadgate serve did not exit within {timeout:.0f}s of SIGTERM "
                    f"(killed)\n{self.log_tail()}"
                ) from None
            return proc.returncode
        _ALIVE.discard(proc)
        if check and code != 0:
            raise AssertionError(
                f"leadgate serve exited with code {code} after SIGTERM\n{self.log_tail()}"
            )
        return code

    def kill(self) -> int | None:
        """SIGKILL (simulated crash) and reap. Returns the exit code (-9), None if not started."""
        proc = self._proc
        if proc is None:
            return None
        self._killed = True
        if proc.poll() is None:
            proc.kill()
        code = proc.wait(timeout=10)
        _ALIVE.discard(proc)
        return code

    def restart(self, **start_kwargs: Any) -> ServiceProcess:
        """Stop cleanly (asserting exit 0), then start again on the same port and database."""
        self.stop()
        return self.start(**start_kwargs)

    # -- logs -------------------------------------------------------------------------------

    def log_text(self) -> str:
        """Everything the service processes printed so far."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the log, framed for an error message."""
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- tail of {self.log_path} ---\n{tail}\n--- end of log ---"

    # -- context manager --------------------------------------------------------------------

    def __enter__(self) -> ServiceProcess:
        if not self.running:
            self.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        # After a failure inside the block, do not mask it with a second assertion.
        self.stop(check=exc_type is None)


@contextlib.contextmanager
def running_service(workdir: Path, **kwargs: Any) -> Iterator[ServiceProcess]:
    """Upgrade, seed the demo organization and serve; stop cleanly on exit."""
    proc = ServiceProcess(workdir, **kwargs)
    proc.upgrade_and_seed_demo()
    with proc.start():
        yield proc


@dataclass(frozen=True)
class DemoTemplate:
    """A migrated SQLite database holding the demo organization (see :func:`make_template`)."""

    database: Path
    demo: Demo


def make_template(workdir: Path, **kwargs: Any) -> DemoTemplate:
    """``leadgate db upgrade`` + ``leadgate demo`` once, through the CLI, into an SQLite
    file that :func:`start_from_template` copies. Pay the CLI cost once per test session."""
    proc = ServiceProcess(workdir, **kwargs)
    demo = proc.upgrade_and_seed_demo()
    assert proc.sqlite_file is not None, "templates are SQLite files"
    return DemoTemplate(proc.sqlite_file, demo)


def start_from_template(template: DemoTemplate, workdir: Path, **kwargs: Any) -> ServiceProcess:
    """A started service on a private copy of ``template`` (``kwargs`` as ServiceProcess;
    the database must be the default SQLite file). ``proc.demo`` is the template's demo."""
    proc = ServiceProcess(workdir, **kwargs)
    assert proc.sqlite_file is not None, "templates are SQLite; use upgrade()/seed_demo()"
    clone_sqlite(template.database, proc.sqlite_file)
    proc.demo = template.demo
    return proc.start()
