#!/usr/bin/env bash
# Quick start: sets everything up and runs leadgate on the embedded default (SQLite file,
# built-in `script` model) with a demo organization whose worker has a lead.
#   scripts/run.sh                 # uses ./config.toml, created from config.example.toml
#   scripts/run.sh --rotate-key    # revoke the kept demo key and mint a new one
#   LEADGATE_CONFIG=my.toml scripts/run.sh
# The demo Owner key is kept (mode 0600) in .leadgate-demo-key next to the config and
# reused on every start; the database stores only its hash.
set -euo pipefail

# A relative LEADGATE_CONFIG names a file in the caller's directory: made absolute before
# the cd below (it was read from the repository instead).
if [ -n "${LEADGATE_CONFIG:-}" ]; then
    # -s: symlinks kept as named, as leadgate itself reads the path (the database and
    # the key file sit beside the config as named, wherever a link points).
    LEADGATE_CONFIG="$(realpath -ms -- "$LEADGATE_CONFIG")"
fi
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
die() { printf 'run.sh: %s\n' "$*" >&2; exit 1; }
apt_install() {
    [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

ROTATE=()
for arg in "$@"; do
    case "$arg" in
        --rotate-key) ROTATE=(--rotate-key) ;;
        -h|--help) sed -n '2,8p' "$ROOT/scripts/run.sh"; exit 0 ;;
        *) die "unknown option $arg (see scripts/run.sh --help)" ;;
    esac
done

# shellcheck source=scripts/venv.sh
. "$ROOT/scripts/venv.sh"

CONFIG="${LEADGATE_CONFIG:-$ROOT/config.toml}"
LG="$VENV/bin/leadgate"
# Nothing is written before we know the service can start: a port in use (another
# leadgate running?) stops here, before the database or a key is touched.
check_with="$CONFIG"
[ -f "$CONFIG" ] || check_with="$ROOT/config.example.toml"
"$LG" serve --check-ports --config "$check_with" >/dev/null || exit 1

if [ ! -f "$CONFIG" ]; then
    cp "$ROOT/config.example.toml" "$CONFIG"
    echo "created $CONFIG from config.example.toml"
fi
KEY_FILE="$(dirname "$CONFIG")/.leadgate-demo-key"
"$LG" db upgrade --config "$CONFIG" >/dev/null
demo="$("$LG" demo --config "$CONFIG" --key-file "$KEY_FILE" "${ROTATE[@]}")"
read -r key reused <<<"$(printf '%s' "$demo" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d["apiKey"], d["keyReused"])')"
url="$("$PY" - "$CONFIG" <<'PY'
import sys
from leadgate.core.config import load_settings
s = load_settings(sys.argv[1])
print(f"http://{s.server.host}:{s.server.port}")
PY
)"
if [ "$reused" = True ]; then
    key_note="the same key as last time (kept in $KEY_FILE, mode 0600)"
else
    key_note="new; kept in $KEY_FILE (mode 0600) and reused on the next start"
fi
if [ "$(basename "$CONFIG")" = config.toml ]; then
    config_note="(leadgate reads ./config.toml: run its commands from $(dirname "$CONFIG"), or give --config $CONFIG)"
else
    config_note="(give every leadgate command --config $CONFIG, or export LEADGATE_CONFIG=$CONFIG)"
fi
cat <<MSG

leadgate is starting at $url   (config: $CONFIG)
  demo organization: demo   agents: worker (reviewed by lead), lead, plain
  Owner API key: $key
    $key_note
    scripts/run.sh --rotate-key revokes it and mints a new one

The leadgate command is $VENV/bin/leadgate. To type just \`leadgate\` in this shell:
  export PATH="$VENV/bin:\$PATH"
$config_note

Try it:
  curl -s $url/v1/chat/completions -H "Authorization: Bearer $key" \\
       -d '{"model": "plain", "messages": [{"role": "user", "content": "hello"}]}'
  curl -s $url/v1/chat/completions -H "Authorization: Bearer $key" \\
       -d '{"model": "worker", "messages": [{"role": "user", "content": "draft it #complete #escalate"}]}'
  leadgate review list --org demo --format table
Operator console: $url/console/  (first: leadgate user create --org demo --email you@example.com --role member)

Stop with Ctrl-C.
MSG
exec "$LG" serve --config "$CONFIG"
