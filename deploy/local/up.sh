#!/usr/bin/env bash
# Installs and starts the local infrastructure, then runs every txflow role in one process
# (`txflow up`) until Ctrl-C. Extra arguments go to `txflow up`.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare.sh"
# The gateway needs a JWT key: a local development secret (kept outside the clone, never
# printed), unless one is configured already.
if [[ -z "${TXFLOW_GATEWAY_JWT_SECRET_FILE:-}" && -z "${TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE:-}" ]]; then
  secret="$HOME/.cache/txflow/local-jwt-secret"
  if [[ ! -s "$secret" ]]; then
    (umask 077 && head -c 48 /dev/urandom | base64 > "$secret")
  fi
  export TXFLOW_GATEWAY_JWT_SECRET_FILE="$secret"
  log "gateway JWT secret (HS256): $secret"
fi
log "services are up; stop them with deploy/local/stop.sh"
exec "$CARGO_TARGET_DIR/debug/txflow" up "$@"
