#!/usr/bin/env bash
# The README's main command: installs and starts the local infrastructure, builds txflow and runs
# `txflow demo` (a few hundred requests from several signers through the pipeline to the chain).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare.sh"
export TXFLOW_LOG="${TXFLOW_LOG:-warn}"
exec "$CARGO_TARGET_DIR/debug/txflow" demo "$@"
