#!/usr/bin/env bash
# Two Ray nodes on this one machine, to try RayEngine's placement without a real cluster:
#   head   carries {"streamspec_store": 1}     -> the LayerStoreActor lands here
#   second carries {"streamspec_verifier": 1}  -> the VerifierActor lands here
# Each node has its own --temp-dir and its own ports. `stop` ends only the processes this script started
# (PIDs recorded at start, plus any process still running under its temp dirs), never other Ray sessions,
# so it does not use a bare `ray stop`.
#
#   cluster/local-two-nodes.sh start     # prints the address; then e.g.
#   RAY_ADDRESS=127.0.0.1:6390 streamspec generate "Hello" --ray
#   cluster/local-two-nodes.sh stop
#
# Settings: STREAMSPEC_CLUSTER_DIR (default /tmp/streamspec-two-nodes; keep it short: Ray's unix socket
# paths live under it), STREAMSPEC_RAY_PORT (default 6390; the nodes use PORT .. PORT+299), CPUS_PER_NODE (1).
set -euo pipefail

DIR=${STREAMSPEC_CLUSTER_DIR:-/tmp/streamspec-two-nodes}
PORT=${STREAMSPEC_RAY_PORT:-6390}
CPUS=${CPUS_PER_NODE:-1}
PIDS=$DIR/pids
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
export RAY_worker_niceness=${RAY_worker_niceness:-0}  # Ray runs workers at nice 15 by default: the actors are the hot path

. "$(dirname "$0")/pids.sh"  # ours, stop

node_ports() {  # $1: offset of this node's port block
    local b=$((PORT + $1))
    echo --node-manager-port=$((b + 2)) --object-manager-port=$((b + 3)) \
        --dashboard-agent-listen-port=$((b + 4)) --dashboard-agent-grpc-port=$((b + 5)) \
        --runtime-env-agent-port=$((b + 6)) --metrics-export-port=$((b + 7)) \
        --min-worker-port=$((PORT + 100 + $1 * 10)) --max-worker-port=$((PORT + 199 + $1 * 10))
}

start() {
    if [ -s "$PIDS" ]; then echo "already started (see $PIDS); run: $0 stop" >&2; exit 1; fi
    mkdir -p "$DIR/head" "$DIR/node2"
    # shellcheck disable=SC2046
    ray start --head --port="$PORT" --ray-client-server-port=$((PORT + 1)) --include-dashboard=false \
        --num-cpus="$CPUS" --resources='{"streamspec_store": 1}' --temp-dir="$DIR/head" \
        --disable-usage-stats $(node_ports 0) > "$DIR/head.log" 2>&1 \
        || { cat "$DIR/head.log" >&2; exit 1; }
    # shellcheck disable=SC2046
    ray start --address="127.0.0.1:$PORT" --num-cpus="$CPUS" --resources='{"streamspec_verifier": 1}' \
        --temp-dir="$DIR/node2" --disable-usage-stats $(node_ports 10) > "$DIR/node2.log" 2>&1 \
        || { cat "$DIR/node2.log" >&2; ours > "$PIDS"; stop; exit 1; }
    ours > "$PIDS"
    echo "started 2 nodes at 127.0.0.1:$PORT ($(wc -l < "$PIDS") processes, PIDs in $PIDS)"
    echo "use: RAY_ADDRESS=127.0.0.1:$PORT streamspec generate \"Hello\" --ray"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
