#!/usr/bin/env bash
# A local SpecGate cluster on one machine: redis-server, N replicas, HAProxy in front.
#   ops/cluster.sh up [N]   start (N=2); prints the balancer's URL
#   ops/cluster.sh down     SIGTERM everything (replicas drain), then stop Redis and HAProxy
# Settings come from the environment:
#   CLUSTER_DIR (.cluster)   pids, ports, logs and the rendered haproxy.cfg
#   LB_PORT (8080), FIRST_PORT (8081), REDIS_PORT (6390)
#   SPECGATE_* variables reach every replica (models, API keys, policies, ...)
#   SPECGATE_STREAM_HOLD_S defaults to 290 here: HAProxy's `timeout server` is 600 s, so a stream's
#   headers may wait for its first token that long, and a replica that dies in a prefill has
#   its streams replayed by HAProxy (Node's fetch gives up on headers after 300 s)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(mkdir -p "${CLUSTER_DIR:-.cluster}" && cd "${CLUSTER_DIR:-.cluster}" && pwd)
LB_PORT=${LB_PORT:-8080}
FIRST_PORT=${FIRST_PORT:-8081}
REDIS_PORT=${REDIS_PORT:-6390}
export SPECGATE_STREAM_HOLD_S=${SPECGATE_STREAM_HOLD_S:-290}
SPECGATE=${SPECGATE:-.venv/bin/specgate}

wait_ready() {  # url seconds
  for _ in $(seq "$(( $2 * 5 ))"); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 0.2
  done
  echo "not ready: $1" >&2
  return 1
}

up() {
  local n=${1:-2}
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log"
  local servers=""
  for i in $(seq 1 "$n"); do
    local port=$(( FIRST_PORT + i - 1 ))
    SPECGATE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0" SPECGATE_REPLICA_ID="r$i" \
      "$SPECGATE" serve --port "$port" >"$DIR/replica-$i.log" 2>&1 &
    echo $! >"$DIR/replica-$i.pid"
    echo "$port" >"$DIR/replica-$i.port"
    servers+="    server r$i 127.0.0.1:$port check"$'\n'
  done
  for i in $(seq 1 "$n"); do wait_ready "http://127.0.0.1:$(cat "$DIR/replica-$i.port")/ready" 300; done
  sed -e "s/@LB_PORT@/$LB_PORT/" -e "s#@DIR@#$DIR#" ops/haproxy.cfg.tmpl | awk -v s="$servers" '{ if ($0 == "@SERVERS@") printf "%s", s; else print }' \
    >"$DIR/haproxy.cfg"
  haproxy -c -q -f "$DIR/haproxy.cfg"
  # in the foreground (-db) so its log, written to stdout, lands in the cluster's folder
  haproxy -db -f "$DIR/haproxy.cfg" >>"$DIR/haproxy.log" 2>&1 &
  echo $! >"$DIR/haproxy.pid"
  wait_ready "http://127.0.0.1:$LB_PORT/health" 30
  echo "http://127.0.0.1:$LB_PORT"
}

down() {
  for f in "$DIR"/replica-*.pid; do
    [ -e "$f" ] || continue
    kill -TERM "$(cat "$f")" 2>/dev/null || true
  done
  for f in "$DIR"/replica-*.pid; do
    [ -e "$f" ] || continue
    local pid; pid=$(cat "$f")
    # a zombie (exited, its parent has not reaped it yet) still answers kill -0: it is gone
    for _ in $(seq 300); do
      kill -0 "$pid" 2>/dev/null || break
      [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" = Z ] && break
      sleep 0.2
    done
    rm -f "$f"
  done
  [ -e "$DIR/haproxy.pid" ] && kill "$(cat "$DIR/haproxy.pid")" 2>/dev/null || true
  [ -e "$DIR/redis.pid" ] && kill "$(cat "$DIR/redis.pid")" 2>/dev/null || true
  rm -f "$DIR/haproxy.pid" "$DIR/redis.pid"
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  down) down ;;
  *) echo "usage: ops/cluster.sh up [N] | down" >&2; exit 2 ;;
esac
