#!/usr/bin/env bash
# The whole test suite, from a fresh machine of this kind: installs what is missing, starts what is
# needed, checks formatting and lints, runs every test against real PostgreSQL, broker, Schema
# Registry and anvil, and stops what it started.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
source "$here/env.sh"
cd "$root"
t0=$SECONDS

# The registry's cold build (5-11 min) overlaps our own build.
"$here/install.sh" --background-registry
log "building (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
cargo build --workspace --all-targets --locked
"$here/install.sh" --wait-registry

if "$here/start.sh" --status >/dev/null 2>&1; then
  log "shared services already running; leaving them running afterwards"
else
  trap '"$here/stop.sh"' EXIT
fi
eval "$("$here/start.sh")"

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
log "all green in $((SECONDS - t0)) s"
