#!/usr/bin/env bash
# Quick start: sets everything up and runs leadgate on the embedded default (SQLite file,
# built-in `script` model) with a demo organization whose worker has a lead.
#   scripts/run.sh                 # uses ./config.toml, created from config.example.toml
#   LEADGATE_CONFIG=my.toml scripts/run.sh
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
die() { printf 'run.sh: %s\n' "$*" >&2; exit 1; }
apt_install() {
    [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

# shellcheck source=scripts/venv.sh
. "$ROOT/scripts/venv.sh"

CONFIG="${LEADGATE_CONFIG:-$ROOT/config.toml}"
if [ ! -f "$CONFIG" ]; then
    cp "$ROOT/config.example.toml" "$CONFIG"
    echo "created $CONFIG from config.example.toml"
fi
LG="$VENV/bin/leadgate"
"$LG" db upgrade --config "$CONFIG" >/dev/null
demo="$("$LG" demo --config "$CONFIG")"
key="$(printf '%s' "$demo" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["apiKey"])')"
url="$("$PY" - "$CONFIG" <<'PY'
import sys
from leadgate.core.config import load_settings
s = load_settings(sys.argv[1])
print(f"http://{s.server.host}:{s.server.port}")
PY
)"
cat <<MSG

leadgate is starting at $url
  demo organization: demo   agents: worker (reviewed by lead), lead, plain
  API key (shown once, stored hashed): $key

Try it:
  curl -s $url/v1/chat/completions -H "Authorization: Bearer $key" \\
       -d '{"model": "plain", "messages": [{"role": "user", "content": "hello"}]}'
  curl -s $url/v1/chat/completions -H "Authorization: Bearer $key" \\
       -d '{"model": "worker", "messages": [{"role": "user", "content": "draft it #complete"}]}'
  curl -s $url/operator/activity -H "Authorization: Bearer $key"

Stop with Ctrl-C.
MSG
exec "$LG" serve --config "$CONFIG"
