"""Closed-loop load on ``POST /v1/chat/completions`` of the real service vs a bare endpoint.

Starts, on 127.0.0.1 and in separate processes:

* the real service (``leadgate serve``, SQLite in a temp dir, or with ``--postgres`` a
  throwaway PostgreSQL from ``tests/pg.py``; ``script`` model; the demo organization from
  ``leadgate demo``), through ``tests/service_proc.py``;
* a bare aiohttp endpoint returning a fixed chat.completion (``bench/bare_server.py``).

Then drives each with a bounded closed loop (``--concurrency`` clients, each sending its
next request when the previous answer arrived) from one aiohttp client, for
``--duration`` seconds after a short warm-up, and prints requests/s and p50/p99 latency:

* ``bare``: the bare endpoint (the ceiling of this machine + client);
* ``plain``: the ``plain`` agent (no lead): 200 ``Echo: ...``; one session per client;
* ``gated``: the ``worker`` with ``#complete``, each on a fresh session (so gated, not
  busy): 409 with the gated body; lead reviews then run in the background;
* ``busy``: the ``worker`` on one session whose item is under review (the lead escalated):
  409 busy, rejected at intake;
* ``unknown`` (only with ``--only unknown``; given with ``bare`` and ``plain``, the three
  alternate): a model the organization does not have: 404 ``agent.not_found`` from the
  intake, what a refused request costs;
* ``floor`` (only with ``--only floor``, alternating the same way): the plain turn's
  writes with nothing around them, aiohttp and ``sqlite3`` on the same schema
  (``bench/floor_server.py``): how close to the bare endpoint any SQLite plain turn could
  come on this machine. Prints floor/bare per round.

and the ratio plain/bare (target >= 0.30 in every round; 0.15 on PostgreSQL): bare and
plain alternate for ``--rounds`` rounds (default 5) and the median of the per-round
ratios is the figure. Usage::

    .venv/bin/python -m bench.bench_rest [--duration 5] [--concurrency 16] [--rounds 5]
        [--requests N] [--profile serve.prof] [--postgres]

``--profile`` runs the service under cProfile for the whole run (startup included; combine
with ``--only plain`` to focus) and prints its top functions (cumulative, internal time).
``/proc`` CPU time of the server process per request is printed with every scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.service_proc import ServiceProcess, free_port  # noqa: E402

Request = Callable[[int, int], tuple[bytes, dict[str, str]]]
FLOOR_AUTH = {"Authorization": "Bearer floor", "Content-Type": "application/json"}


@dataclass
class Result:
    """One scenario's measurements."""

    name: str
    duration: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    unexpected: int = 0
    server_cpu: float = math.nan
    #: PostgreSQL's backends over the scenario (``--postgres``; NaN otherwise)
    postgres_cpu: float = math.nan
    warmup_count: int = 0

    @property
    def count(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.count / self.duration if self.duration else 0.0

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        if not data:
            return math.nan
        return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))] * 1000

    def line(self) -> str:
        statuses = " ".join(f"{code}x{n}" for code, n in sorted(self.statuses.items()))
        return (
            f"{self.name:<6} {self.rps:9.1f} req/s   p50 {self.pct(0.50):7.2f} ms   "
            f"p99 {self.pct(0.99):7.2f} ms   n={self.count:<6} [{statuses}]"
            + f"   server CPU {self.cpu_per_request():.2f} ms/req"
            + (
                ""
                if math.isnan(self.postgres_cpu)
                else f" + {self.per_request(self.postgres_cpu):.2f} in PostgreSQL"
            )
            + (f"  UNEXPECTED={self.unexpected}" if self.unexpected else "")
        )

    def cpu_per_request(self) -> float:
        return self.per_request(self.server_cpu)

    def per_request(self, seconds: float) -> float:
        """``seconds`` of CPU per request (warm-up included), in ms."""
        total = self.count + self.warmup_count
        return seconds / total * 1000 if total else math.nan


async def closed_loop(
    http: aiohttp.ClientSession,
    name: str,
    url: str,
    make: Request,
    check: Callable[[int, bytes], bool],
    *,
    concurrency: int,
    duration: float,
    requests: int | None,
    warmup: float,
) -> Result:
    """``concurrency`` clients in a closed loop for ``duration`` s (or ``requests`` total)."""
    result = Result(name)
    sequence = [0] * concurrency

    async def one(client: int, record: bool) -> None:
        body, headers = make(client, sequence[client])
        sequence[client] += 1
        start = time.perf_counter()
        async with http.post(url, data=body, headers=headers) as resp:
            data = await resp.read()
            status = resp.status
        elapsed = time.perf_counter() - start
        if not record:
            result.warmup_count += 1
        else:
            result.latencies.append(elapsed)
            result.statuses[status] += 1
            if not check(status, data):
                result.unexpected += 1

    async def client_loop(client: int, until: float, record: bool, budget: list[int]) -> None:
        while time.perf_counter() < until:
            if budget[0] <= 0:
                return
            budget[0] -= 1
            await one(client, record)

    if warmup > 0:
        until = time.perf_counter() + warmup
        await asyncio.gather(*(client_loop(c, until, False, [1 << 30]) for c in range(concurrency)))
    budget = [requests if requests is not None else 1 << 30]
    start = time.perf_counter()
    until = start + (duration if requests is None else 3600)
    await asyncio.gather(*(client_loop(c, until, True, budget) for c in range(concurrency)))
    result.duration = time.perf_counter() - start
    return result


def start_endpoint(workdir: Path, module: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m <module> --port N <args>`` (``bench.bare_server`` or
    ``bench.floor_server``) and wait until it answers; (process, completions URL)."""
    port = free_port()
    log = (workdir / f"{module.rsplit('.', 1)[-1]}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", str(port), *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    deadline = time.monotonic() + 30
    while True:
        try:
            req = urllib.request.Request(url, data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=1):
                return proc, url
        except urllib.error.HTTPError:  # it answered (the floor wants its token)
            return proc, url
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{module} did not start") from None
            time.sleep(0.05)


def start_bare(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The bare endpoint (``bench/bare_server.py``)."""
    return start_endpoint(workdir, "bench.bare_server")


async def start_floor(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The floor (``bench/floor_server.py``) on a SQLite file of its own, migrated."""
    from leadgate.database.db import upgrade

    database = workdir / "floor.db"
    # Alembic's env refuses a running loop in its thread; a worker thread has none.
    await asyncio.to_thread(upgrade, f"sqlite+aiosqlite:///{database}")
    return start_endpoint(workdir, "bench.floor_server", "--database", str(database))


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all its threads), from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def postgres_cpu_seconds() -> float:
    """CPU seconds of every ``postgres`` process on this machine (backends included)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(postgres)" in text:
            total += cpu_seconds(int(stat.parent.name))
    return total


def metric_sum(proc: ServiceProcess, name: str, labels: str = "") -> float:
    """Sum of a Prometheus counter of the service (series containing ``labels``)."""
    with urllib.request.urlopen(f"{proc.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line
    )


def wait_reviews(proc: ServiceProcess, expected: float, timeout: float = 120.0) -> float:
    """Wait until the lead runner reviewed ``expected`` items; returns seconds waited."""
    start = time.monotonic()
    while metric_sum(proc, "leadgate_reviews_total") < expected:
        if time.monotonic() - start > timeout:
            break
        time.sleep(0.1)
    return time.monotonic() - start


def body(model: str, text: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


async def run(args: argparse.Namespace) -> int:
    """Run the scenarios and print them; the exit code."""
    return (await measure(args))[0]


async def measure(args: argparse.Namespace) -> tuple[int, list[float]]:
    """Run the scenarios and print them; (exit code, plain/bare ratio per round)."""
    workdir = Path(tempfile.mkdtemp(prefix="leadgate-bench-"))
    print(
        f"bench_rest: {args.concurrency} concurrent clients, "
        + (f"{args.requests} requests" if args.requests else f"{args.duration:g} s")
        + f" per scenario after {args.warmup:g} s warm-up; {os.cpu_count()} CPUs; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    serve_args: tuple[str, ...] = ()
    if args.profile:
        serve_args = ("-m", "cProfile", "-o", args.profile)
    database_url = None
    pg = None
    if args.postgres:
        from tests.pg import start_postgres

        pg = start_postgres()
        database_url = pg.create_database(f"bench_{uuid.uuid4().hex[:12]}")
    proc = ServiceProcess(
        workdir / "service",
        database_url=database_url,
        config={"log": {"level": "WARNING"}},
        serve_python_args=serve_args,
    )
    proc.upgrade()
    demo = proc.seed_demo()
    bare, bare_url = start_bare(workdir)
    floor = floor_url = None
    if args.only and "floor" in args.only:
        floor, floor_url = await start_floor(workdir)
    proc.start()
    url = f"{proc.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {demo.key}", "Content-Type": "application/json"}
    plain_body = body("plain", "hello")
    gated_body = body("worker", "do the task #complete")
    busy_body = body("worker", "are you done yet?")
    unknown_body = body("no-such-agent", "hello")
    run_id = uuid.uuid4().hex[:8]

    def is_ok(status: int, data: bytes) -> bool:
        return status == 200 and b'"Echo: hello"' in data

    def is_gated(status: int, data: bytes) -> bool:
        return status == 409 and b'"workItemId": null' in data

    def is_busy(status: int, data: bytes) -> bool:
        return status == 409 and b"LEAD_REVIEW_PENDING" in data and b"workItemId" not in data

    def is_unknown_model(status: int, data: bytes) -> bool:
        return status == 404 and b"agent.not_found" in data

    scenarios: list[tuple[str, str, Request, Callable[[int, bytes], bool]]] = [
        ("bare", bare_url, lambda c, i: (plain_body, {"Content-Type": "application/json"}), is_ok),
        (
            "plain",
            url,
            lambda c, i: (plain_body, {**auth, "X-Session-Id": f"p{run_id}-{c}"}),
            is_ok,
        ),
        (
            "gated",
            url,
            lambda c, i: (gated_body, {**auth, "X-Session-Id": f"g{run_id}-{c}-{i}"}),
            is_gated,
        ),
        ("busy", url, lambda c, i: (busy_body, {**auth, "X-Session-Id": f"b{run_id}"}), is_busy),
        (
            "unknown",
            url,
            lambda c, i: (unknown_body, {**auth, "X-Session-Id": f"s{run_id}-{c}"}),
            is_unknown_model,
        ),
        (
            "floor",
            floor_url or "",
            lambda c, i: (
                plain_body,
                {**FLOOR_AUTH, "X-Session-Id": f"f{run_id}-{c}"},
            ),
            is_ok,
        ),
    ]
    by_name = {scenario[0]: scenario for scenario in scenarios}
    # bare and plain alternate for --rounds rounds: the machine is shared and noisy, and
    # the ratio of each adjacent pair is less exposed to a slow spell than one long run.
    order = [name for _ in range(args.rounds) for name in ("bare", "plain")] + ["gated", "busy"]
    # unknown and floor are opt-in (not the rows); given, they go between the two.
    extras = [name for name in ("unknown", "floor") if args.only and name in args.only]
    if extras:
        order = [name for _ in range(args.rounds) for name in ("bare", *extras, "plain")]
    results: dict[str, list[Result]] = {}
    connector = aiohttp.TCPConnector(limit=args.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    code = 0
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            # The busy session: its item goes to awaitingHuman (the lead escalates) and stays.
            async with http.post(
                url,
                data=body("worker", "#escalate #complete"),
                headers={**auth, "X-Session-Id": f"b{run_id}"},
            ) as resp:
                assert resp.status == 409, await resp.text()
            for name in order:
                if args.only and name not in args.only:
                    continue
                _, target, make, check = by_name[name]
                reviews_before = metric_sum(proc, "leadgate_reviews_total")
                pid = {"bare": bare.pid, "floor": floor.pid if floor else None}.get(name, proc.pid)
                gated_before = metric_sum(proc, "leadgate_turns_total", 'outcome="gated"')
                cpu_before = cpu_seconds(pid)
                pg_before = postgres_cpu_seconds() if args.postgres and name != "bare" else None
                result = await closed_loop(
                    http,
                    name,
                    target,
                    make,
                    check,
                    concurrency=args.concurrency,
                    duration=args.duration,
                    requests=args.requests,
                    warmup=args.warmup,
                )
                # Includes the warm-up requests: an estimate of server CPU per request.
                result.server_cpu = cpu_seconds(pid) - cpu_before
                if pg_before is not None:
                    result.postgres_cpu = postgres_cpu_seconds() - pg_before
                results.setdefault(name, []).append(result)
                print(result.line(), flush=True)
                if result.unexpected:
                    code = 1
                if name == "gated":
                    # Warm-up turns were gated too: wait for every review to finish so
                    # the next scenario does not compete with the lead runner.
                    gated = metric_sum(proc, "leadgate_turns_total", 'outcome="gated"')
                    waited = await asyncio.to_thread(
                        wait_reviews, proc, reviews_before + gated - gated_before
                    )
                    print(f"       (lead reviews of the gated turns drained {waited:.1f}s later)")
    finally:
        for endpoint in (bare, floor):
            if endpoint is not None:
                endpoint.terminate()
                endpoint.wait(timeout=10)
        proc.stop()
        if pg is not None:
            pg.stop()
    ratios = to_bare(results, "plain")
    if ratios:
        ratio = statistics.median(ratios)
        goal = 0.15 if args.postgres else 0.30  # the row for the backend
        verdict = "OK" if min(ratios) >= goal else "BELOW TARGET"
        rounds = ", ".join(f"{r:.3f}" for r in ratios)
        print(f"plain/bare per round: {rounds}")
        print(
            f"plain/bare = {ratio:.3f} (median of {len(ratios)})  "
            f"(target >= {goal:.2f} in every round: {verdict})"
        )
    floors = to_bare(results, "floor")
    if floors:
        print("floor/bare per round: " + ", ".join(f"{r:.3f}" for r in floors))
    if args.profile:
        stats = pstats.Stats(args.profile)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(30)
    if args.keep or code:
        print(f"(service log: {proc.log_path})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code, ratios


def to_bare(results: dict[str, list[Result]], name: str) -> list[float]:
    """``name``'s rate over the bare endpoint's, round by round (each pair alternated)."""
    pairs = zip(results.get("bare", []), results.get(name, []), strict=False)
    return [other.rps / bare.rps for bare, other in pairs if bare.rps]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    parser.add_argument("--requests", type=int, help="requests per scenario instead")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds, not measured")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating bare/plain rounds (median ratio)"
    )
    parser.add_argument("--only", action="append", help="run only these scenarios")
    parser.add_argument("--profile", help="cProfile output file for the service")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    parser.add_argument(
        "--postgres", action="store_true", help="PostgreSQL (tests/pg.py) instead of SQLite"
    )
    args = parser.parse_args()
    if args.postgres and args.only and "floor" in args.only:
        parser.error("the floor is SQLite's plain turn: drop --postgres or --only floor")
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
