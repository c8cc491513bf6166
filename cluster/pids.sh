# Sourced by local-two-nodes.sh and local-nodes.sh: the processes a script started, found by its temp dir ($DIR)
# and its PID file ($PIDS), and stopping exactly those (never other Ray sessions, so no bare `ray stop`).

ours() {  # PIDs whose command line mentions our temp dirs (gcs, raylets, agents, log monitors ...)
    local p
    for p in /proc/[0-9]*; do
        if tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q -- "$DIR/"; then echo "${p#/proc/}"; fi
    done
}

stop() {
    local all p i
    all=$( { cat "$PIDS" 2>/dev/null || true; ours; } | sort -u)
    if [ -z "$all" ]; then echo "nothing to stop"; rm -f "$PIDS"; return 0; fi
    for p in $all; do kill -TERM "$p" 2>/dev/null || true; done
    for i in $(seq 50); do  # up to 5 s for a clean exit, then force
        all=$(for p in $all; do kill -0 "$p" 2>/dev/null && echo "$p"; done || true)
        [ -z "$all" ] && break
        sleep 0.1
    done
    for p in $all; do kill -KILL "$p" 2>/dev/null || true; done
    rm -f "$PIDS"
    echo "stopped"
}
