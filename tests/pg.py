"""A throwaway PostgreSQL 15 server for the test session.

``start_postgres()`` runs ``initdb`` + ``pg_ctl start`` in a fresh temporary directory,
listening on 127.0.0.1 only, on a free port, with durability switched off for speed and
trust authentication. When the process runs as root (CI does), the server binaries run as
the ``postgres`` system user, since ``initdb`` and ``postgres`` refuse to run as root.

If ``LEADGATE_TEST_PG_URL`` is set (an SQLAlchemy or libpq URL of a server where the user
may ``CREATE DATABASE``), that server is used instead and nothing is started or stopped.

Databases are created and dropped with ``psql`` in a subprocess, so this module is plain
synchronous code that does not care about any running event loop.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy.engine import URL, make_url

PG_BIN = Path(os.environ.get("LEADGATE_PG_BIN", "/usr/lib/postgresql/15/bin"))
HOST = "127.0.0.1"
SUPERUSER = "postgres"
TEST_DATABASE = "leadgate_test"
ASYNC_DRIVER = "postgresql+asyncpg"
ENV_URL = "LEADGATE_TEST_PG_URL"
STARTUP_TIMEOUT = 30.0

# Settings that would make the client tools talk to some other server.
_PG_CLIENT_ENV = (
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGPASSWORD",
    "PGDATABASE",
    "PGSERVICE",
    "PGSERVICEFILE",
    "PGPASSFILE",
    "PGOPTIONS",
    "PGSSLMODE",
    "PGDATA",
)


class PostgresError(RuntimeError):
    """The test PostgreSQL server could not be started or used."""


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _PG_CLIENT_ENV}
    env.setdefault("LC_ALL", "C.UTF-8")
    return env


class PostgresServer:
    """A PostgreSQL server usable by the tests.

    ``url`` is the SQLAlchemy async URL of the ``leadgate_test`` database (or of the
    database named in ``LEADGATE_TEST_PG_URL``); ``create_database(name)`` makes another,
    empty database and returns its URL; ``stop()`` stops the server and removes its files
    (a no-op for an external server).
    """

    def __init__(self, base_url: URL, *, tmpdir: Path | None = None) -> None:
        self._base = base_url.set(drivername=ASYNC_DRIVER)
        self.tmpdir = tmpdir
        self.datadir = tmpdir / "data" if tmpdir is not None else None
        self.logfile = tmpdir / "postgres.log" if tmpdir is not None else None
        self.external = tmpdir is None
        self._stopped = False

    # -- addresses -------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._base.host or HOST

    @property
    def port(self) -> int:
        return self._base.port or 5432

    @property
    def user(self) -> str:
        return self._base.username or SUPERUSER

    @property
    def database(self) -> str:
        return self._base.database or TEST_DATABASE

    @property
    def url(self) -> str:
        """SQLAlchemy async URL of the main test database."""
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        """SQLAlchemy async URL (``postgresql+asyncpg://...``) of a database here."""
        return self._base.set(database=database).render_as_string(hide_password=False)

    def dsn(self, database: str | None = None) -> str:
        """libpq-style URL (``postgresql://...``) for asyncpg.connect() or psql."""
        return self._base.set(
            drivername="postgresql", database=database or self.database
        ).render_as_string(hide_password=False)

    # -- SQL through psql --------------------------------------------------------------

    def psql(self, sql: str, *, database: str | None = None, timeout: float = 30.0) -> str:
        """Run SQL with psql (autocommit, stop on error); returns stdout (unaligned)."""
        env = _clean_env()
        if self._base.password:
            env["PGPASSWORD"] = self._base.password
        cmd = [
            str(_psql_binary()),
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            self.host,
            "-p",
            str(self.port),
            "-U",
            self.user,
            "-d",
            database or self.database,
            "-c",
            sql,
        ]
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise PostgresError(
                f"psql failed ({proc.returncode}) running {sql!r}:\n{proc.stderr.strip()}"
            )
        return proc.stdout

    def create_database(self, name: str) -> str:
        """Create an empty database owned by the connecting superuser; return its URL."""
        sql = f"CREATE DATABASE {_quote_ident(name)}"
        if not self.external:
            # Our own PostgreSQL 15 with fsync off: copying files is ~2x faster than the
            # default WAL_LOG strategy (about 40 ms instead of 80 ms).
            sql += " STRATEGY = FILE_COPY"
        self.psql(sql, database=self._maintenance_db())
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, closing any connection still open to it."""
        self.psql(
            f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)",
            database=self._maintenance_db(),
        )

    def _maintenance_db(self) -> str:
        # CREATE/DROP DATABASE cannot run while connected to the target; the main test
        # database is never the one created or dropped by the fixtures.
        return self.database

    # -- lifecycle -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the server and remove its directory. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        if self.external or self.tmpdir is None or self.datadir is None:
            return
        try:
            if (self.datadir / "postmaster.pid").exists():
                _run_pg(
                    [
                        str(PG_BIN / "pg_ctl"),
                        "stop",
                        "-D",
                        str(self.datadir),
                        "-m",
                        "immediate",
                        "-w",
                        "-t",
                        "30",
                    ],
                    cwd=self.tmpdir,
                    check=False,
                )
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        kind = "external" if self.external else f"local {self.tmpdir}"
        return f"<PostgresServer {self.host}:{self.port} {kind}>"


# -- starting a local server ------------------------------------------------------------


def _psql_binary() -> Path:
    local = PG_BIN / "psql"
    if local.exists():
        return local
    found = shutil.which("psql")
    if found is None:
        raise PostgresError(f"psql not found in {PG_BIN} nor on PATH")
    return Path(found)


def _is_root() -> bool:
    return os.geteuid() == 0


def _as_server_user(cmd: list[str]) -> list[str]:
    """Prefix a command so that it runs as the postgres user when we are root."""
    if not _is_root():
        return cmd
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    if Path(runuser).exists():
        return [runuser, "-u", SUPERUSER, "--", *cmd]
    su = shutil.which("su") or "/bin/su"
    return [su, SUPERUSER, "-s", "/bin/sh", "-c", subprocess.list2cmdline(cmd)]


def _run_pg(
    cmd: list[str], *, cwd: Path, check: bool = True, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        _as_server_user(cmd),
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise PostgresError(
            f"{Path(cmd[0]).name} failed ({proc.returncode}):\n"
            f"$ {subprocess.list2cmdline(cmd)}\n{proc.stdout}{proc.stderr}"
        )
    return proc


def _make_tmpdir() -> Path:
    if _is_root():
        # The postgres user must be able to reach the directory: use /tmp (world
        # traversable) rather than a TMPDIR that may live under /root.
        base = "/tmp" if os.path.isdir("/tmp") else None
        path = Path(tempfile.mkdtemp(prefix="leadgate-pg-", dir=base))
        try:
            pw = pwd.getpwnam(SUPERUSER)
        except KeyError:
            shutil.rmtree(path, ignore_errors=True)
            raise PostgresError(
                f"running as root but there is no {SUPERUSER!r} system user to run "
                "PostgreSQL as (install postgresql-15, which creates it)"
            ) from None
        os.chown(path, pw.pw_uid, pw.pw_gid)
        return path
    return Path(tempfile.mkdtemp(prefix="leadgate-pg-"))


def _read_log(logfile: Path) -> str:
    try:
        text = logfile.read_text(errors="replace")
    except OSError as exc:
        return f"(no server log: {exc})"
    return text[-8000:] or "(server log is empty)"


def _wait_ready(server: PostgresServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        proc = subprocess.run(
            [
                str(PG_BIN / "pg_isready"),
                "-q",
                "-h",
                server.host,
                "-p",
                str(server.port),
                "-U",
                server.user,
                "-d",
                "postgres",
                "-t",
                "2",
            ],
            env=_clean_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:
            return
        last = f"pg_isready exit {proc.returncode} {proc.stdout}{proc.stderr}".strip()
        if time.monotonic() > deadline:
            raise PostgresError(f"PostgreSQL not ready after {timeout:.0f}s: {last}")
        time.sleep(0.05)


def _start_local() -> PostgresServer:
    initdb = PG_BIN / "initdb"
    if not initdb.exists():
        raise PostgresError(
            f"{initdb} not found: install the PostgreSQL 15 server "
            "(apt-get install postgresql-15), or set LEADGATE_TEST_PG_URL"
        )
    tmpdir = _make_tmpdir()
    datadir = tmpdir / "data"
    sockdir = tmpdir / "sock"
    logfile = tmpdir / "postgres.log"
    server: PostgresServer | None = None
    try:
        _run_pg(
            [
                str(initdb),
                "-D",
                str(datadir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
                "--no-instructions",
            ],
            cwd=tmpdir,
        )
        sockdir.mkdir(mode=0o700)
        if _is_root():
            st = tmpdir.stat()
            os.chown(sockdir, st.st_uid, st.st_gid)
        options = " ".join(
            [
                f"-c listen_addresses={HOST}",
                f"-c unix_socket_directories={sockdir}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
                "-c shared_buffers=64MB",
                "-c log_min_messages=warning",
            ]
        )
        # The chosen port can be taken by someone else between probe and bind: retry.
        attempts = 3
        for attempt in range(1, attempts + 1):
            port = _free_port()
            proc = _run_pg(
                [
                    str(PG_BIN / "pg_ctl"),
                    "start",
                    "-D",
                    str(datadir),
                    "-l",
                    str(logfile),
                    "-w",
                    "-t",
                    str(int(STARTUP_TIMEOUT)),
                    "-o",
                    f"-p {port} {options}",
                ],
                cwd=tmpdir,
                check=False,
                timeout=STARTUP_TIMEOUT + 15,
            )
            if proc.returncode == 0:
                break
            log = _read_log(logfile)
            if attempt < attempts and "could not bind" in log:
                continue
            raise PostgresError(
                f"pg_ctl start failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}\n"
                f"--- server log {logfile} ---\n{log}"
            )
        server = PostgresServer(
            URL.create(
                ASYNC_DRIVER, username=SUPERUSER, host=HOST, port=port, database=TEST_DATABASE
            ),
            tmpdir=tmpdir,
        )
        atexit.register(server.stop)
        _wait_ready(server, STARTUP_TIMEOUT)
        server.psql(f"CREATE DATABASE {TEST_DATABASE} OWNER {SUPERUSER}", database="postgres")
        return server
    except BaseException as exc:
        log = _read_log(logfile)
        if server is not None:
            server.stop()
        else:
            with contextlib.suppress(Exception):
                if (datadir / "postmaster.pid").exists():
                    _run_pg(
                        [str(PG_BIN / "pg_ctl"), "stop", "-D", str(datadir), "-m", "immediate"],
                        cwd=tmpdir,
                        check=False,
                    )
            shutil.rmtree(tmpdir, ignore_errors=True)
        if isinstance(exc, PostgresError) and "--- server log" not in str(exc):
            raise PostgresError(f"{exc}\n--- server log ---\n{log}") from exc
        raise


def start_postgres() -> PostgresServer:
    """Start (or, with LEADGATE_TEST_PG_URL, connect to) the test PostgreSQL server."""
    external = os.environ.get(ENV_URL, "").strip()
    if external:
        url = make_url(external)
        if not url.drivername.startswith("postgresql"):
            raise PostgresError(f"{ENV_URL} is not a PostgreSQL URL: {url!r}")
        server = PostgresServer(url)
        try:
            server.psql("SELECT 1")
        except (PostgresError, subprocess.TimeoutExpired) as exc:
            raise PostgresError(f"cannot use {ENV_URL}={url!r}: {exc}") from exc
        return server
    return _start_local()
