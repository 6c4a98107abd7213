# Sourced by demo.sh and up.sh: installs what is missing, builds txflow, starts the local services,
# exports their TXFLOW_* environment and makes sure the `txflow` database exists.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
source "$here/env.sh"
cd "$root"
"$here/install.sh" --background-registry
# The same build as `make test` (deploy/local/test.sh): one set of artifacts, no dependency built
# twice with different features.
cargo build --workspace --all-targets --locked
"$here/install.sh" --wait-registry
eval "$("$here/start.sh")"
psql "$TXFLOW_PG_ADMIN_URL" -qtAc "SELECT 1 FROM pg_database WHERE datname = 'txflow'" | grep -q 1 \
  || psql "$TXFLOW_PG_ADMIN_URL" -qc "CREATE DATABASE txflow"
