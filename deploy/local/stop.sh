#!/usr/bin/env bash
# Stops the shared services that deploy/local/start.sh started (PostgreSQL is the machine's and is
# left running). Waits for each to exit, so that its port is free again.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
for name in anvil rivven-schema tansu; do
  pidfile="$TXFLOW_RUN/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 15))
    while kill -0 "$pid" 2>/dev/null; do
      if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; fi
      sleep 0.1
    done
  fi
  rm -f "$pidfile"
done
rm -f "$TXFLOW_RUN/services.env"
