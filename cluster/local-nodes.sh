#!/usr/bin/env bash
# N Ray nodes on this one machine, to try pipeline stages (RayEngine stages=, `--ray --stages N`) without a
# real cluster. Every node carries {"streamspec_stage": 1}, the head also {"streamspec_store": 1}; each node
# gets a Ray `memory` resource, and a staged engine gives each stage node a share of the target's layer bytes
# proportional to it (stage i on the i-th stage node in node-id order: Ray's ids, not the start order).
# On one machine the memory figures only size the shares; nothing enforces them.
# Each node has its own --temp-dir and its own ports. `stop` ends only the processes this script started
# (PIDs recorded at start, plus any process still running under its temp dirs), never other Ray sessions,
# so it does not use a bare `ray stop`.
#
#   cluster/local-nodes.sh start 2             # two nodes, an equal share of the available memory each
#   cluster/local-nodes.sh start 3 4 2 2       # three nodes: 4, 2 and 2 GB (the first is the head)
#   RAY_ADDRESS=127.0.0.1:6700 streamspec generate "Hello" --ray --stages 2
#   cluster/local-nodes.sh stop
#
# Settings: STREAMSPEC_CLUSTER_DIR (default /tmp/streamspec-nodes; keep it short: Ray's unix socket paths live
# under it), STREAMSPEC_RAY_PORT (default 6700; N nodes use PORT .. PORT+100*(N+1)-1), CPUS_PER_NODE (1).
set -euo pipefail

DIR=${STREAMSPEC_CLUSTER_DIR:-/tmp/streamspec-nodes}
PORT=${STREAMSPEC_RAY_PORT:-6700}
CPUS=${CPUS_PER_NODE:-1}
PIDS=$DIR/pids
MAX_NODES=10  # node i's own ports are PORT+10i+2 .. +7: ten nodes fill the first hundred
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
export RAY_worker_niceness=${RAY_worker_niceness:-0}  # Ray runs workers at nice 15 by default: the actors are the hot path

usage() { echo "usage: $0 start N [MEMORY_GB...] | stop   (N: 1 to $MAX_NODES; no MEMORY_GB or one per node)" >&2; exit 2; }

. "$(dirname "$0")/pids.sh"  # ours, stop

node_ports() {  # $1: node index
    local b=$((PORT + 10 * $1))
    echo --node-manager-port=$((b + 2)) --object-manager-port=$((b + 3)) \
        --dashboard-agent-listen-port=$((b + 4)) --dashboard-agent-grpc-port=$((b + 5)) \
        --runtime-env-agent-port=$((b + 6)) --metrics-export-port=$((b + 7)) \
        --min-worker-port=$((PORT + 100 * ($1 + 1))) --max-worker-port=$((PORT + 100 * ($1 + 1) + 99))
}

start() {
    local n=${1:-} i mem log
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_NODES" ] || usage
    shift
    if [ $# -ne 0 ] && [ $# -ne "$n" ]; then echo "give no MEMORY_GB or $n of them (one per node), got $#" >&2; exit 2; fi
    local bytes=()
    if [ $# -eq 0 ]; then  # an equal share of what this machine has available now
        local avail
        avail=$(awk '/^MemAvailable:/ {printf "%.0f", $2 * 1024}' /proc/meminfo)
        for ((i = 0; i < n; i++)); do bytes+=("$(awk -v a="$avail" -v n="$n" 'BEGIN {printf "%.0f", a / n}')"); done
    else
        for mem in "$@"; do
            [[ "$mem" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v g="$mem" 'BEGIN {exit !(g > 0)}' \
                || { echo "not a memory size in GB: $mem" >&2; exit 2; }
            bytes+=("$(awk -v g="$mem" 'BEGIN {printf "%.0f", g * 1e9}')")
        done
    fi
    if [ -s "$PIDS" ]; then echo "already started (see $PIDS); run: $0 stop" >&2; exit 1; fi
    mkdir -p "$DIR/head"
    # shellcheck disable=SC2046
    ray start --head --port="$PORT" --ray-client-server-port=$((PORT + 1)) --include-dashboard=false \
        --num-cpus="$CPUS" --memory="${bytes[0]}" --resources='{"streamspec_store": 1, "streamspec_stage": 1}' \
        --temp-dir="$DIR/head" --disable-usage-stats $(node_ports 0) > "$DIR/head.log" 2>&1 \
        || { cat "$DIR/head.log" >&2; ours > "$PIDS"; stop > /dev/null; exit 1; }
    for ((i = 1; i < n; i++)); do
        log="$DIR/node$((i + 1)).log"
        mkdir -p "$DIR/node$((i + 1))"
        # shellcheck disable=SC2046
        ray start --address="127.0.0.1:$PORT" --num-cpus="$CPUS" --memory="${bytes[$i]}" \
            --resources='{"streamspec_stage": 1}' --temp-dir="$DIR/node$((i + 1))" --disable-usage-stats \
            $(node_ports "$i") > "$log" 2>&1 \
            || { cat "$log" >&2; ours > "$PIDS"; stop > /dev/null; exit 1; }
    done
    ours > "$PIDS"
    echo "started $n nodes at 127.0.0.1:$PORT, memory $(printf '%s ' "${bytes[@]}")bytes ($(wc -l < "$PIDS") processes, PIDs in $PIDS)"
    echo "use: RAY_ADDRESS=127.0.0.1:$PORT streamspec generate \"Hello\" --ray --stages $n"
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) stop ;;
    *) usage ;;
esac
