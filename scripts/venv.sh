# Sourced by scripts/test.sh and scripts/run.sh: creates or refreshes .venv with
# leadgate[dev] installed. Expects ROOT, VENV, die() and apt_install() to be defined;
# leaves PY pointing at the venv's python.
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
    # This machine's pip config lists local mirrors that warn once per package; keep
    # the output readable but show everything when the install fails.
    pip_log="$(mktemp)"
    if ! "$PY" -m pip install -q -e '.[dev]' >"$pip_log" 2>&1; then
        cat "$pip_log" >&2
        die "pip install failed"
    fi
    grep -v 'is ignored: it is neither a file nor a directory' "$pip_log" || true
    rm -f "$pip_log"
    echo "$want" >"$STAMP"
else
    echo "up to date: $VENV ($("$PY" --version))"
fi

