#!/usr/bin/env bash
# The README's main command: installs and starts the local infrastructure, builds txflow and runs
# `txflow demo` (a few hundred requests from several signers through the pipeline to the chain).
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
export TXFLOW_LOG="${TXFLOW_LOG:-warn}"
exec "$CARGO_TARGET_DIR/debug/txflow" demo "$@"
