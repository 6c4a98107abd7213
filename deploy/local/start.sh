#!/usr/bin/env bash
# Starts the shared local services if they are not running (idempotent, safe to run in parallel):
#   PostgreSQL 15 (the machine's cluster), the tansu broker, the rivven-schema registry, anvil.
# Prints the environment the binaries and the test harness read, as `export VAR=value` lines, and
# writes the same to $TXFLOW_RUN/services.env.
#   deploy/local/start.sh            start what is missing
#   deploy/local/start.sh --status   report only; exit 1 if something is not running
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
mkdir -p "$TXFLOW_RUN"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
registry_ok() { curl -fsS -m 2 "http://127.0.0.1:$TXFLOW_REGISTRY_PORT/subjects" >/dev/null 2>&1; }
anvil_ok() {
  curl -fsS -m 2 -H 'content-type: application/json' \
    -d '{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}' \
    "http://127.0.0.1:$TXFLOW_ANVIL_PORT" 2>/dev/null | grep -q '"result"'
}
pg_ok() { pg_isready -q -h 127.0.0.1 -p 5432; }

# wait_for NAME SECONDS CHECK...: polls CHECK until it succeeds or the deadline passes.
wait_for() {
  local name=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || die "$name did not become ready within ${secs}s (log: $TXFLOW_RUN/$name.log)"
    sleep 0.1
  done
}

# spawn NAME CMD...: starts CMD detached from this shell, logging to $TXFLOW_RUN/NAME.log.
spawn() {
  local name=$1; shift
  # fd 8 is the start lock: the daemon must not inherit it, or it would hold the lock forever.
  setsid nohup "$@" >"$TXFLOW_RUN/$name.log" 2>&1 < /dev/null 8>&- &
  echo $! > "$TXFLOW_RUN/$name.pid"
}

status() {
  local ok=0
  pg_ok && echo "postgres  up   127.0.0.1:5432" || { echo "postgres  DOWN"; ok=1; }
  port_open "$TXFLOW_BROKER_PORT" && echo "broker    up   127.0.0.1:$TXFLOW_BROKER_PORT" || { echo "broker    DOWN"; ok=1; }
  registry_ok && echo "registry  up   http://127.0.0.1:$TXFLOW_REGISTRY_PORT" || { echo "registry  DOWN"; ok=1; }
  anvil_ok && echo "anvil     up   http://127.0.0.1:$TXFLOW_ANVIL_PORT" || { echo "anvil     DOWN"; ok=1; }
  return $ok
}

if [ "${1:-}" = "--status" ]; then status; exit $?; fi

exec 8>"$TXFLOW_RUN/start.lock"
flock 8

if ! pg_ok; then
  log "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n1)" main start 2>/dev/null \
    || pg_ctlcluster "$(ls /etc/postgresql | sort -V | tail -n1)" main start
  wait_for postgres 30 pg_ok
fi

if ! port_open "$TXFLOW_BROKER_PORT"; then
  [ -x "$TANSU_BIN" ] || "$here/install.sh"
  log "starting tansu on 127.0.0.1:$TXFLOW_BROKER_PORT (memory storage)"
  spawn tansu "$TANSU_BIN" broker --storage-engine memory://tansu/ \
    --listener-url "tcp://127.0.0.1:$TXFLOW_BROKER_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$TXFLOW_BROKER_PORT"
  wait_for tansu 30 port_open "$TXFLOW_BROKER_PORT"
fi

if ! registry_ok; then
  port_open "$TXFLOW_REGISTRY_PORT" && die "port $TXFLOW_REGISTRY_PORT is taken by something that is not a schema registry (set TXFLOW_REGISTRY_PORT)"
  [ -x "$RIVVEN_SCHEMA_BIN" ] || "$here/install.sh"
  log "starting rivven-schema on 127.0.0.1:$TXFLOW_REGISTRY_PORT (BACKWARD compatibility)"
  spawn rivven-schema "$RIVVEN_SCHEMA_BIN" serve --host 127.0.0.1 --port "$TXFLOW_REGISTRY_PORT" --compatibility BACKWARD
  wait_for rivven-schema 30 registry_ok
fi

if ! anvil_ok; then
  port_open "$TXFLOW_ANVIL_PORT" && die "port $TXFLOW_ANVIL_PORT is taken by something that is not anvil (set TXFLOW_ANVIL_PORT)"
  [ -x "$ANVIL_BIN" ] || "$here/install.sh"
  log "starting anvil on 127.0.0.1:$TXFLOW_ANVIL_PORT (block time 0.2 s)"
  spawn anvil "$ANVIL_BIN" --host 127.0.0.1 --port "$TXFLOW_ANVIL_PORT" --block-time 0.2 --max-persisted-states 0
  wait_for anvil 30 anvil_ok
fi

cat > "$TXFLOW_RUN/services.env.tmp" <<ENV
export TXFLOW_DATABASE_URL=$TXFLOW_PG_URL/txflow
export TXFLOW_PG_ADMIN_URL=$TXFLOW_PG_URL/postgres
export TXFLOW_BROKERS=127.0.0.1:$TXFLOW_BROKER_PORT
export TXFLOW_SCHEMA_REGISTRY_URL=http://127.0.0.1:$TXFLOW_REGISTRY_PORT
export TXFLOW_RPC_URLS=http://127.0.0.1:$TXFLOW_ANVIL_PORT
export TXFLOW_TANSU_BIN=$TANSU_BIN
export TXFLOW_ANVIL_BIN=$ANVIL_BIN
export TXFLOW_REGISTRY_BIN=$RIVVEN_SCHEMA_BIN
ENV
mv "$TXFLOW_RUN/services.env.tmp" "$TXFLOW_RUN/services.env"
cat "$TXFLOW_RUN/services.env"
