"""The official MCP conformance suite against the real service's ``/mcp`` (SPEC 8, 13).

``@modelcontextprotocol/conformance``, pinned in ``tests/node/package-lock.json`` and run
on the Node runtime pinned there (``node`` fixture), runs its active ``server`` suite
against a started ``leadgate serve``. The suite cannot send headers, so it speaks to
``tests/node/bearer_proxy.mjs`` on 127.0.0.1, which adds the demo Owner key as the bearer
token and forwards everything else as sent (``/work/shared/tools/mcp-conformance`` does
the same by hand, against any server).

The suite writes one ``<output>/server-<scenario>-<time>/checks.json`` per scenario. A
scenario passes when none of its checks is a ``FAILURE`` or a ``WARNING``. Every scenario
passes except those in :data:`EXPECTED_FAILING`, and every one of those really fails, with
exactly the message it names, so the list cannot go stale (a scenario that starts passing
must leave it) nor hide a product bug behind a fixture (one failing for another reason
fails the test).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.acceptance.channel_kit import end_process
from tests.acceptance.node_kit import NODE_DIR
from tests.service_proc import ServiceProcess

SUITE_JS: Final = NODE_DIR / "node_modules/@modelcontextprotocol/conformance/dist/index.js"
PROXY_JS: Final = NODE_DIR / "bearer_proxy.mjs"
#: The whole active suite took 1.3-5 s (the latter with three runs on two busy CPUs); this
#: bounds a hung scenario.
SUITE_TIMEOUT_S: Final = 75.0
PROXY_START_S: Final = 20.0

NOT_FOUND: Final = "Failed: MCP error -32601: Method not found"
NO_ELICITATION: Final = "Server did not request elicitation from client"


def unknown(uri: str) -> str:
    """How a scenario reading one of the suite's fixture resources fails here."""
    return f"Failed: MCP error -32602: Unknown resource: {uri!r}"


# Scenario -> the one failing check's message. Each of these calls the suite's own
# reference fixtures, which a real product does not have and should not grow: tools named
# test_*, resources under test://, prompts, and server features leadgate does not offer
# (logging, completion, progress notifications, sampling and elicitation requests to the
# client). Our server answers them as the protocol says for what it lacks (-32601 for a
# method whose capability it does not advertise, -32602 for an unknown resource, a tool
# error result for an unknown tool), and the scenario fails on the missing fixture; the
# message is pinned so that a scenario failing for another reason (a product bug) is not
# hidden here. `tools-call-simple-text` and `tools-call-error` call fixture tools too
# (test_simple_text, test_error_handling) but pass: they check only that the answer has
# text content (and isError, for the error scenario), which the unknown-tool result has.
EXPECTED_FAILING: Final[dict[str, str]] = {
    # logging/setLevel: no `logging` capability.
    "logging-set-level": NOT_FOUND,
    # completion/complete: no `completions` capability.
    "completion-complete": NOT_FOUND,
    # Fixture tools test_image_content, test_audio_content, test_embedded_resource,
    # test_multiple_content_types: the unknown-tool error result is one text block.
    "tools-call-image": "No image content found",
    "tools-call-audio": "No audio content found",
    "tools-call-embedded-resource": "No resource content found",
    "tools-call-mixed-content": (
        "Expected multiple content items; Missing image content; Missing resource content"
    ),
    # Fixture tool test_tool_with_logging, after a logging/setLevel.
    "tools-call-with-logging": NOT_FOUND,
    # Fixture tool test_tool_with_progress: the unknown tool reports no progress.
    "tools-call-with-progress": "No progress notifications received",
    # Fixture tools that ask the client for sampling or elicitation: leadgate's tool never
    # asks its caller anything.
    "tools-call-sampling": "Server did not request sampling from client",
    "tools-call-elicitation": NO_ELICITATION,
    "elicitation-sep1034-defaults": NO_ELICITATION,
    "elicitation-sep1330-enums": NO_ELICITATION,
    # Fixture resources (resource.unknown).
    "resources-read-text": unknown("test://static-text"),
    "resources-read-binary": unknown("test://static-binary"),
    "resources-templates-read": unknown("test://template/123/data"),
    "resources-subscribe": unknown("test://watched-resource"),
    "resources-unsubscribe": unknown("test://watched-resource"),
    # Fixture prompts: no `prompts` capability.
    "prompts-list": NOT_FOUND,
    "prompts-get-simple": NOT_FOUND,
    "prompts-get-with-args": NOT_FOUND,
    "prompts-get-embedded-resource": NOT_FOUND,
    "prompts-get-with-image": NOT_FOUND,
}


@dataclass(frozen=True)
class Check:
    """One entry of a scenario's ``checks.json``."""

    id: str
    status: str  # SUCCESS, FAILURE, WARNING or INFO
    message: str

    @property
    def bad(self) -> bool:
        """A check that makes its scenario fail."""
        return self.status in ("FAILURE", "WARNING")


@contextlib.contextmanager
def bearer_proxy(node: Path, upstream: str, token: str, log: Path) -> Iterator[str]:
    """``tests/node/bearer_proxy.mjs`` in front of ``upstream``; yields its base URL."""
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [str(node), str(PROXY_JS), json.dumps({"upstream": upstream, "token": token})],
            cwd=NODE_DIR,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        assert proc.stdout is not None
        line = b""
        deadline = time.monotonic() + PROXY_START_S
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                assert time.monotonic() < deadline and proc.poll() is None, (
                    f"the proxy did not start: {line!r}, {log.read_text(errors='replace')}"
                )
                if sel.select(timeout=0.1):
                    chunk = os.read(proc.stdout.fileno(), 256)
                    assert chunk, f"the proxy exited: {log.read_text(errors='replace')}"
                    line += chunk
        yield f"http://127.0.0.1:{json.loads(line)['port']}"
        assert proc.poll() is None, f"the proxy died: {log.read_text(errors='replace')}"
    finally:
        end_process(proc)


def run_suite(node: Path, url: str, out: Path) -> dict[str, list[Check]]:
    """Run the pinned suite's active server scenarios against ``url`` with results in
    ``out``; each scenario's checks, in run order."""
    done = subprocess.run(
        [str(node), str(SUITE_JS), "server", "--url", url, "--suite", "active", "-o", str(out)],
        cwd=NODE_DIR,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        check=False,
    )
    output = f"{done.stdout}\n{done.stderr}"
    announced = re.search(r"^Running active suite \((\d+) scenarios\)", done.stdout, re.M)
    assert announced, f"the suite did not start (exit {done.returncode}):\n{output[-4000:]}"
    # "=== Running scenario: X ===" is followed by "Results saved to DIR", or, when the
    # scenario itself crashed, by "Failed to run scenario X: ..." on stderr (no DIR).
    crashed = dict(re.findall(r"^Failed to run scenario (\S+): (.*)$", done.stderr, re.M))
    scenarios: dict[str, list[Check]] = {}
    current = ""
    for line in done.stdout.splitlines():
        if m := re.fullmatch(r"=== Running scenario: (\S+) ===", line):
            current = m.group(1)
            why = crashed.get(current, "the scenario wrote no results")
            scenarios[current] = [Check(current, "FAILURE", why)]
        elif m := re.fullmatch(r"Results saved to (.+)", line):
            raw = json.loads((Path(m.group(1)) / "checks.json").read_text())
            scenarios[current] = [
                Check(c["id"], c["status"], c.get("errorMessage") or c.get("description", ""))
                for c in raw
            ]
    assert len(scenarios) == int(announced.group(1)), f"not every scenario ran:\n{output}"
    return scenarios


def test_the_official_conformance_suite(
    node: Path, leadgate: ServiceProcess, tmp_path: Path
) -> None:
    assert leadgate.demo is not None
    started = time.monotonic()
    with bearer_proxy(node, leadgate.url, leadgate.demo.key, tmp_path / "proxy.log") as proxy:
        scenarios = run_suite(node, f"{proxy}/mcp", tmp_path / "results")
    took = time.monotonic() - started

    def failing(name: str) -> list[str]:
        return [c.message for c in scenarios[name] if c.bad]

    report = "\n".join(f"  {name}: {'; '.join(failing(name)) or 'passes'}" for name in scenarios)
    where = f"\n{report}\nproxy log: {(tmp_path / 'proxy.log').read_text(errors='replace')}"
    unexpected = sorted(n for n in scenarios if n not in EXPECTED_FAILING and failing(n))
    assert not unexpected, f"scenarios that should pass fail: {unexpected}{where}"
    not_run = sorted(EXPECTED_FAILING.keys() - scenarios.keys())
    assert not not_run, f"EXPECTED_FAILING names scenarios the suite did not run: {not_run}"
    stale = sorted(n for n in EXPECTED_FAILING if not failing(n))
    assert not stale, f"these pass now: take them out of EXPECTED_FAILING: {stale}{where}"
    other = sorted(n for n, why in EXPECTED_FAILING.items() if failing(n) != [why])
    assert not other, f"these fail for another reason than EXPECTED_FAILING's: {other}{where}"
    # Nothing the suite sent made the service log an error (the answers alone would not
    # show an exception the SDK turned into a generic error).
    logged = [
        line for line in leadgate.log_text().splitlines() if "[error" in line or "[critical" in line
    ]
    assert not logged and "Traceback" not in leadgate.log_text(), leadgate.log_tail(100)
    print(f"conformance suite: {len(scenarios)} scenarios in {took:.1f} s\n{report}")
