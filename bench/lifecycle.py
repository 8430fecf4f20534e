"""Gated lifecycles of the real service, side by side with plain turns.

A *gated lifecycle* is the whole life of one piece of gated work: the worker's turn that
calls ``complete_task`` (intake, model, signal, submission), the lead review (claim,
model, verdict, gating delivery in the verdict's transaction) and the delivery (reveal on
the api binding; a ``chat.postMessage`` to the Slack stand-in on a Slack binding), until
the item is ``completed``. Each lifecycle is on a fresh session.

Parts (each round interleaves plain turns and lifecycles in ``--slices`` slices, so
ratios are taken side by side in one run on a shared machine):

* ``sqlite``: plain REST turns/s, REST lifecycles/s (api binding), Slack lifecycles/s
  (signed Events API ``message`` events, each a new thread; the lifecycle ends when the
  stand-in records the post); the service's CPU per plain turn and per lifecycle (from
  /proc); the service's peak RSS (VmHWM);
* ``approve``: ``POST /operator/reviews/{id}/approve`` offered open-loop at ``--rate``/s
  on items the script lead escalated; request latency p50/p99;
* ``pg``: PostgreSQL, Slack binding, the stand-in answering after ``--pg-latency-ms``:
  lifecycles/s of one ``--role all`` process vs one ``--role api`` plus two
  ``--role worker`` processes.

Throughput of a lifecycle run = lifecycles submitted in ``--duration`` seconds (closed
loop, ``--concurrency`` clients) / time from the first submission to the last
completion: the backlog the runners still have when submission stops is included.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.bench_outbox import TOKEN, Standin
from bench.bench_rest import cpu_seconds, metric_sum, postgres_cpu_seconds
from tests.service_proc import REPO_ROOT, ServiceProcess

SIGNING_SECRET = "bench-signing-secret"
TEAM, CHANNEL = "TBENCH", "CBENCH"


@dataclass
class Round:
    """One round's figures."""

    plain_rps: float = math.nan
    plain_cpu_ms: float = math.nan
    rest_lps: float = math.nan
    rest_cpu_ms: float = math.nan
    slack_lps: float = math.nan
    slack_cpu_ms: float = math.nan


@dataclass
class Figures:
    """Everything the lifecycle parts measured."""

    rounds: list[Round] = field(default_factory=list)
    peak_rss_mb: float = math.nan
    approve_p50_ms: float = math.nan
    approve_p99_ms: float = math.nan
    approve_rate: float = math.nan
    #: service CPU during the approvals (their requests and what they set off: the
    #: reveals, the card updates) per approval
    approve_cpu_ms: float = math.nan
    pg_one: list[float] = field(default_factory=list)
    pg_split: list[float] = field(default_factory=list)


def peak_rss_mb(pid: int | None) -> float:
    """VmHWM (peak resident set) of a process, in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def chat_body(model: str, text: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def slack_event(text: str, ts: str) -> bytes:
    return json.dumps(
        {
            "type": "event_callback",
            "team_id": TEAM,
            "event_id": f"Ev{uuid.uuid4().hex[:12]}",
            "event": {
                "type": "message",
                "channel": CHANNEL,
                "user": "UBENCH",
                "text": text,
                "ts": ts,
            },
        }
    ).encode()


def slack_headers(body: bytes) -> dict[str, str]:
    from slack_sdk.signature import SignatureVerifier

    ts = str(int(time.time()))
    sig = SignatureVerifier(SIGNING_SECRET).generate_signature(timestamp=ts, body=body)
    return {
        "Content-Type": "application/json",
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": sig,
    }


async def closed_loop(
    clients: int, seconds: float, send: Callable[[int, int], Awaitable[None]]
) -> tuple[int, float]:
    """``clients`` loops calling ``send(client, i)`` for ``seconds``; (calls, elapsed)."""
    counts = [0] * clients
    start = time.perf_counter()
    until = start + seconds

    async def loop(c: int) -> None:
        while time.perf_counter() < until:
            await send(c, counts[c])
            counts[c] += 1

    await asyncio.gather(*(loop(c) for c in range(clients)))
    return sum(counts), time.perf_counter() - start


async def wait_for(predicate: Callable[[], bool], limit_s: float = 300.0) -> float:
    """Poll ``predicate`` (every 5 ms) until true; returns the time it became true."""
    deadline = time.perf_counter() + limit_s
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("the lifecycles did not complete in time")
        await asyncio.sleep(0.005)
    return time.perf_counter()


def completed(proc: ServiceProcess) -> float:
    return metric_sum(proc, "leadgate_work_item_transitions_total", 'to_status="completed"')


class Service:
    """A service process with the demo organization and a Slack route to the worker
    (``root``: the source tree it runs, e.g. another revision's for ``bench.ab``)."""

    def __init__(
        self,
        workdir: Path,
        standin: Standin,
        database_url: str | None = None,
        root: Path = REPO_ROOT,
    ) -> None:
        self.proc = ServiceProcess(
            workdir,
            database_url=database_url,
            root=root,
            config={
                "log": {"level": "WARNING"},
                "slack": {
                    "signing_secret": SIGNING_SECRET,
                    "bot_token": TOKEN,
                    "api_url": standin.api_url,
                },
            },
        )
        self.proc.upgrade()
        self.demo = self.proc.seed_demo()
        self.proc.admin(
            "route", "add", "--org", self.demo.org, "--agent", "worker", "--channel", "slack"
        )
        self.auth = {"Authorization": f"Bearer {self.demo.key}", "Content-Type": "application/json"}


@dataclass
class Tally:
    """What one kind of work did over a round's slices: count, wall time, service CPU."""

    n: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0

    def add(self, n: int, seconds: float, cpu_s: float = 0.0) -> None:
        self.n += n
        self.seconds += seconds
        self.cpu_s += cpu_s

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds else math.nan

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s / self.n * 1000 if self.n else math.nan


async def plain_slice(
    http: aiohttp.ClientSession, svc: Service, args: Any, tag: str, seconds: float
) -> tuple[int, float, float]:
    """Plain REST turns for ``seconds``: (turns, elapsed, service CPU seconds)."""
    proc, url = svc.proc, f"{svc.proc.url}/v1/chat/completions"
    plain = chat_body("plain", "hello")

    async def send_plain(c: int, i: int) -> None:
        headers = {**svc.auth, "X-Session-Id": f"p{tag}-{c}"}
        async with http.post(url, data=plain, headers=headers) as resp:
            assert resp.status == 200, await resp.text()

    cpu0 = cpu_seconds(proc.pid)
    n, elapsed = await closed_loop(args.concurrency, seconds, send_plain)
    return n, elapsed, cpu_seconds(proc.pid) - cpu0


async def rest_slice(
    http: aiohttp.ClientSession, svc: Service, args: Any, tag: str, seconds: float
) -> tuple[int, float, float]:
    """REST lifecycles submitted for ``seconds``, until every one is completed:
    (lifecycles, first submission to last completion, service CPU seconds)."""
    proc, url = svc.proc, f"{svc.proc.url}/v1/chat/completions"
    gated = chat_body("worker", "do the task #complete")
    done0 = completed(proc)

    async def send_gated(c: int, i: int) -> None:
        headers = {**svc.auth, "X-Session-Id": f"g{tag}-{c}-{i}"}
        async with http.post(url, data=gated, headers=headers) as resp:
            assert resp.status == 409, await resp.text()

    cpu0 = cpu_seconds(proc.pid)
    start = time.perf_counter()
    n, _ = await closed_loop(args.concurrency, seconds, send_gated)
    end = await wait_for(lambda: completed(proc) >= done0 + n)
    return n, end - start, cpu_seconds(proc.pid) - cpu0


async def slack_slice(
    http: aiohttp.ClientSession, url: str, standin: Standin, args: Any, tag: str, seconds: float
) -> tuple[int, float]:
    """Slack lifecycles (signed message events, each a new thread) submitted for
    ``seconds``, until every approved answer reached the stand-in: (lifecycles, elapsed)."""
    posts0 = standin.count()
    counter = [0]

    async def send(c: int, i: int) -> None:
        counter[0] += 1
        body = slack_event(f"task {tag}-{c}-{i} #complete", f"{time.time():.6f}{counter[0]:06d}")
        async with http.post(url, data=body, headers=slack_headers(body)) as resp:
            assert resp.status == 200, await resp.text()

    start = time.perf_counter()
    n, _ = await closed_loop(args.concurrency, seconds, send)
    end = await wait_for(lambda: standin.count() >= posts0 + n)
    return n, end - start


async def interleaved_round(
    http: aiohttp.ClientSession, svc: Service, standin: Standin, args: Any, tag: str
) -> Round:
    """One round: plain turns, REST lifecycles and Slack lifecycles, ``args.slices``
    times each in turn (``args.duration`` seconds of each in all), so that all three see
    the machine at the same speed: on a shared VM the speed drifts over seconds, and one
    long phase of each let a slow spell land on one side of a ratio."""
    plain, rest, slack = Tally(), Tally(), Tally()
    seconds = args.duration / args.slices
    events = f"{svc.proc.url}/slack/events"
    for k in range(args.slices):
        plain.add(*await plain_slice(http, svc, args, tag, seconds))
        rest.add(*await rest_slice(http, svc, args, f"{tag}.{k}", seconds))
        cpu0 = cpu_seconds(svc.proc.pid)
        n, elapsed = await slack_slice(http, events, standin, args, f"{tag}.{k}", seconds)
        slack.add(n, elapsed, cpu_seconds(svc.proc.pid) - cpu0)
    return Round(plain.rate, plain.cpu_ms, rest.rate, rest.cpu_ms, slack.rate, slack.cpu_ms)


async def approve_part(
    http: aiohttp.ClientSession, svc: Service, args: Any, figures: Figures
) -> None:
    """Open-loop approvals at ``args.rate``/s of items the lead escalated."""
    proc, url = svc.proc, f"{svc.proc.url}/v1/chat/completions"
    escalate = chat_body("worker", "hard one #escalate #complete")
    n = args.approve_n
    sem = asyncio.Semaphore(args.concurrency)

    async def submit(i: int) -> None:
        async with (
            sem,
            http.post(url, data=escalate, headers={**svc.auth, "X-Session-Id": f"esc-{i}"}) as resp,
        ):
            assert resp.status == 409

    await asyncio.gather(*(submit(i) for i in range(n)))
    ids: list[str] = []
    while len(ids) < n:
        async with http.get(
            f"{proc.url}/operator/reviews?limit=200&cursor=", headers=svc.auth
        ) as r:
            page = await r.json()
        ids = [item["id"] for item in page["items"] if item["status"] == "awaitingHuman"]
        cursor = page.get("next")
        while cursor and len(ids) < n:
            async with http.get(
                f"{proc.url}/operator/reviews?limit=200&cursor={cursor}", headers=svc.auth
            ) as r:
                page = await r.json()
            ids += [item["id"] for item in page["items"] if item["status"] == "awaitingHuman"]
            cursor = page.get("next")
        await asyncio.sleep(0.2)
    latencies: list[float] = []

    async def approve(item_id: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        began = time.perf_counter()
        async with http.post(
            f"{proc.url}/operator/reviews/{item_id}/approve", headers=svc.auth
        ) as resp:
            assert resp.status == 200, await resp.text()
        latencies.append((time.perf_counter() - began) * 1000)

    t0 = time.perf_counter() + 0.2
    started = time.perf_counter()
    cpu0 = cpu_seconds(proc.pid)
    await asyncio.gather(*(approve(i, t0 + k / args.rate) for k, i in enumerate(ids[:n])))
    figures.approve_cpu_ms = (cpu_seconds(proc.pid) - cpu0) / max(1, len(latencies)) * 1000
    latencies.sort()
    figures.approve_rate = len(latencies) / (time.perf_counter() - started)
    figures.approve_p50_ms = statistics.median(latencies)
    figures.approve_p99_ms = latencies[
        min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)
    ]


async def sqlite_parts(args: Any, figures: Figures, parts: set[str]) -> None:
    """The ``sqlite`` and ``approve`` parts on one service process."""
    workdir = Path(tempfile.mkdtemp(prefix="leadgate-bench-life-"))
    standin = Standin()
    svc = Service(workdir / "service", standin)
    svc.proc.start()
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            if "sqlite" in parts:
                for r in range(args.rounds):
                    one = await interleaved_round(http, svc, standin, args, f"{r}")
                    figures.rounds.append(one)
                    print(
                        f"   round {r}: plain {one.plain_rps:.0f}/s "
                        f"({one.plain_cpu_ms:.2f} ms CPU), "
                        f"REST lifecycles {one.rest_lps:.0f}/s ({one.rest_cpu_ms:.2f} ms CPU), "
                        f"Slack lifecycles {one.slack_lps:.0f}/s ({one.slack_cpu_ms:.2f} ms CPU)",
                        flush=True,
                    )
                figures.peak_rss_mb = peak_rss_mb(svc.proc.pid)
            if "approve" in parts:
                await approve_part(http, svc, args, figures)
                print(
                    f"   approvals at {args.rate}/s: p50 {figures.approve_p50_ms:.1f} ms, "
                    f"p99 {figures.approve_p99_ms:.1f} ms; "
                    f"{figures.approve_cpu_ms:.2f} ms of service CPU per approval",
                    flush=True,
                )
    finally:
        svc.proc.stop()
        standin.stop()


async def pg_part(args: Any, figures: Figures) -> None:
    """PostgreSQL, Slack binding, stand-in +latency: 1 all-in-one vs 1 api + 2 workers."""
    from tests.pg import start_postgres

    pg = start_postgres()
    standin = Standin(latency_ms=args.pg_latency_ms)
    workdir = Path(tempfile.mkdtemp(prefix="leadgate-bench-pg-"))
    try:
        for r in range(args.rounds):
            for layout in ("one", "split"):
                url = pg.create_database(f"bench_{uuid.uuid4().hex[:12]}")
                svc = Service(workdir / f"{layout}{r}", standin, database_url=url)
                procs = [svc.proc]
                svc.proc.start(role="all" if layout == "one" else "api")
                if layout == "split":
                    for w in range(2):
                        worker = ServiceProcess(
                            workdir / f"{layout}{r}-w{w}",
                            database_url=url,
                            config=svc.proc.config,
                        )
                        worker.start(role="worker")
                        procs.append(worker)
                database = url.rsplit("/", 1)[1].split("?")[0]
                xacts0, pg_cpu0 = _xacts(pg, database), postgres_cpu_seconds()
                cpu0 = sum(cpu_seconds(p.pid) for p in procs)
                try:
                    async with aiohttp.ClientSession() as http:
                        n, elapsed = await slack_slice(
                            http,
                            f"{svc.proc.url}/slack/events",
                            standin,
                            args,
                            f"pg{layout}{r}",
                            args.duration,
                        )
                    cpu = sum(cpu_seconds(p.pid) for p in procs) - cpu0
                    pg_cpu = postgres_cpu_seconds() - pg_cpu0
                finally:
                    for p in reversed(procs):
                        p.stop()
                # Read after the stop: a backend reports its counts when it exits.
                xacts = _xacts(pg, database) - xacts0
                lps = n / elapsed
                (figures.pg_one if layout == "one" else figures.pg_split).append(lps)
                print(
                    f"   round {r} {layout}: {lps:.0f} lifecycles/s; per lifecycle "
                    f"{xacts / n:.1f} transactions, CPU {cpu / n * 1000:.1f} ms in leadgate "
                    f"+ {pg_cpu / n * 1000:.1f} ms in PostgreSQL",
                    flush=True,
                )
    finally:
        standin.stop()
        pg.stop()


def _xacts(pg: Any, database: str) -> int:
    """Transactions committed and rolled back in ``database`` so far (pg_stat_database)."""
    out = pg.psql(
        f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{database}'"
    )
    return int(out.strip().splitlines()[-1].strip() or 0)


def cores_and_load() -> str:
    return f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())
