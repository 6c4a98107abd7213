#!/usr/bin/env bash
# Installs and starts the local infrastructure, then runs every txflow role in one process
# (`txflow up`) until Ctrl-C. Extra arguments go to `txflow up`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
source "$here/env.sh"
cd "$root"
"$here/install.sh" --background-registry
cargo build -p txflow --locked
"$here/install.sh" --wait-registry
eval "$("$here/start.sh")"
psql "$TXFLOW_PG_ADMIN_URL" -qtAc "SELECT 1 FROM pg_database WHERE datname = 'txflow'" | grep -q 1 \
  || psql "$TXFLOW_PG_ADMIN_URL" -qc "CREATE DATABASE txflow"
log "services are up; stop them with deploy/local/stop.sh"
exec "$CARGO_TARGET_DIR/debug/txflow" up "$@"
