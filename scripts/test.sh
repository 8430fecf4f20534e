#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian 12 machine, then runs
# ruff, mypy and pytest. Extra arguments go to pytest:
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

# ---------------------------------------------------------------- python env
section "Python environment"
PYTHON="${PYTHON:-python3}"
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if ! py_ok "$PYTHON"; then
    for candidate in python3.11 python3.12 python3.13 /usr/bin/python3; do
        if py_ok "$candidate"; then PYTHON="$candidate"; break; fi
    done
fi
py_ok "$PYTHON" || die "Python >= 3.11 not found"

if [ -d "$VENV" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "removing broken $VENV"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $("$PYTHON" --version)"
    if ! "$PYTHON" -m venv "$VENV"; then
        # Debian's own python3 needs python3-venv for ensurepip.
        rm -rf "$VENV"
        apt_install python3-venv
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

# Reinstall only when the dependency declaration or the interpreter changed.
STAMP="$VENV/.leadgate-dev-installed"
want="$( (cat pyproject.toml; "$PY" -VV) | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ] \
    || ! "$PY" -c 'import importlib.metadata as m; [m.version(d) for d in ("leadgate", "pytest", "ruff", "mypy")]' >/dev/null 2>&1; then
    echo "installing leadgate[dev] into $VENV ..."
    "$PY" -m pip install -q -e '.[dev]'
    echo "$want" >"$STAMP"
else
    echo "up to date: $VENV ($("$PY" --version))"
fi

# ---------------------------------------------------------------- checks
FAILED=()

section "ruff check ."
if "$VENV/bin/ruff" check .; then :; else FAILED+=("ruff"); fi

section "mypy"
if "$VENV/bin/mypy"; then :; else FAILED+=("mypy"); fi

section "pytest"
rc=0
"$PY" -m pytest -q -p no:cacheprovider "$@" || rc=$?
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
