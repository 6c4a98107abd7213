#!/usr/bin/env bash
# Installs and starts the local infrastructure, then runs every txflow role in one process
# (`txflow up`) until Ctrl-C. Extra arguments go to `txflow up`.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare.sh"
log "services are up; stop them with deploy/local/stop.sh"
exec "$CARGO_TARGET_DIR/debug/txflow" up "$@"
