#!/usr/bin/env bash
# Take down what scripts/cluster/up.sh brought up: every process in the cluster's network
# namespaces (slurmd, slurmctld, job steps and their tasks, strays), the private munged,
# the namespaces (and with them the bridge and links), the root namespace's link and
# blackhole route, /run/netns if up.sh made it, and the state dir. Safe to run twice, after
# a partial up.sh, or when nothing is up. Never touches a munged or slurm daemon it did not
# start. Settings: AMESH_SLURM_DIR (see lib.sh); the rest is read from the state dir.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
AMESH_SLURM_USE_SAVED=1 # read by lib.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

if [ "$(id -u)" != 0 ]; then
    echo "down.sh: must run as root" >&2
    exit 1
fi
take_lock

ns_pids() { # pids of the processes in the given namespaces
    local ns
    for ns in "$@"; do
        ip netns pids "$ns" 2>/dev/null || true
    done
}

# stop NAMESPACE...: SIGTERM everything in them, SIGKILL what is left after 10 s; return when
# they are empty (daemons may still fork while they stop, hence the loops).
stop_namespaces() {
    [ "$#" -gt 0 ] || return 0
    local pids deadline=$((SECONDS + 10))
    pids=$(ns_pids "$@")
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    while [ -n "$(ns_pids "$@")" ] && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    deadline=$((SECONDS + 10))
    while pids=$(ns_pids "$@") && [ -n "$pids" ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "processes that will not die in $*: $pids"
            return 1
        fi
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    log "stopped processes in $*"
}

# stop_pid NAME PID: stop a daemon we started outside the namespaces (munged).
stop_pid() {
    local name=$1 pid=$2 deadline=$((SECONDS + 10))
    pid_is "$pid" "$name" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    while pid_is "$pid" "$name" && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.1
    done
    if pid_is "$pid" "$name"; then
        kill -KILL "$pid" 2>/dev/null || true
    fi
    log "stopped $name ($pid)"
}

mapfile -t namespaces < <(our_namespaces)
nodes=() others=()
for ns in "${namespaces[@]}"; do
    case $ns in
    amesh-n*) nodes+=("$ns") ;;
    *) others+=("$ns") ;;
    esac
done
status=0
stop_namespaces "${nodes[@]}" || status=1  # slurmd, steps, tasks
stop_namespaces "${others[@]}" || status=1 # slurmctld
if [ -f "$PIDS" ]; then
    while read -r name pid; do
        case $name in
        munged) stop_pid munged "$pid" ;;
        *) # daemons in a namespace, stopped above unless their namespace was gone
            pid_is "$pid" "${name%%:*}" && stop_pid "${name%%:*}" "$pid" ;;
        esac
    done <"$PIDS"
fi

for ns in "${namespaces[@]}"; do
    ip netns delete "$ns" 2>/dev/null || { log "cannot delete namespace $ns"; status=1; }
done
if ip link show "$HOST_LINK" >/dev/null 2>&1; then
    ip link delete "$HOST_LINK"
fi
while ip route show table main type blackhole "$SUBNET" 2>/dev/null | grep -q "metric $BLACKHOLE_METRIC"; do
    ip route delete blackhole "$SUBNET" metric "$BLACKHOLE_METRIC"
done
[ "${#namespaces[@]}" -eq 0 ] || log "deleted namespaces ${namespaces[*]}, $HOST_LINK, blackhole $SUBNET"

# /run/netns: `ip netns add` made it (and a mount on it); remove both if up.sh saw it absent.
if [ -f "$STATE/made-run-netns" ] && [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
    while mountpoint -q /run/netns; do
        umount /run/netns
    done
    rmdir /run/netns
fi

if [ -f "$MARKER" ]; then
    rm -rf -- "$STATE"
    log "removed $STATE"
elif [ -d "$STATE" ]; then
    rmdir -- "$STATE" 2>/dev/null || log "left $STATE: not made by up.sh (no $MARKER)"
fi
exit "$status"
