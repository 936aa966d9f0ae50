# shellcheck shell=bash disable=SC2034  # (variables are for the scripts that source this)
# Shared settings and helpers of scripts/cluster/{up,down,node}.sh. Sourced, not run.
#
# Settings (environment; down.sh reads the values up.sh used from the state dir):
#   AMESH_SLURM_DIR     state dir: config, munge key and socket, logs, spool   [/run/amesh-slurm]
#   AMESH_SLURM_NNODES  number of nodes amesh-n1..amesh-nN                     [4]
#   AMESH_SLURM_NET     first three octets of the private /24                  [10.77.0]
#   AMESH_SLURM_CPUS    CPUs per node (may exceed the real ones)               [nproc, >= 2]
#   AMESH_SLURM_INSTALL 1: apt-get install what is missing; 0: fail instead    [1]
#   AMESH_SLURM_TIMEOUT seconds to wait for each daemon to come up             [60]

AMESH_SLURM_DIR=${AMESH_SLURM_DIR:-/run/amesh-slurm}
# down.sh and node.sh set AMESH_SLURM_USE_SAVED=1: they must tear down / enter what up.sh
# made, whatever this shell's environment says.
if [ "${AMESH_SLURM_USE_SAVED:-0}" = 1 ] && [ -r "$AMESH_SLURM_DIR/settings" ]; then
    # shellcheck disable=SC1091
    . "$AMESH_SLURM_DIR/settings"
fi
AMESH_SLURM_NNODES=${AMESH_SLURM_NNODES:-4}
AMESH_SLURM_NET=${AMESH_SLURM_NET:-10.77.0}
AMESH_SLURM_CPUS=${AMESH_SLURM_CPUS:-$(($(nproc) > 2 ? $(nproc) : 2))}
AMESH_SLURM_INSTALL=${AMESH_SLURM_INSTALL:-1}
AMESH_SLURM_TIMEOUT=${AMESH_SLURM_TIMEOUT:-60}

STATE=$AMESH_SLURM_DIR
MARKER="$STATE/.amesh-slurm"        # down.sh deletes $STATE only when this file is in it
PIDS="$STATE/pids"                   # "name pid" per daemon started outside a node namespace
SLURM_CONF="$STATE/slurm.conf"
MUNGE_DIR="$STATE/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
NET=$AMESH_SLURM_NET
HOST_ADDR="$NET.1"                   # root namespace end of the link to the switch
CTLD_ADDR="$NET.2"                   # slurmctld (namespace amesh-ctl)
SUBNET="$NET.0/24"
BLACKHOLE_METRIC=4242                # the blackhole route loses to the link's own route
NS_SWITCH=amesh-sw                   # holds the bridge; nothing runs in it
NS_CTLD=amesh-ctl
HOST_LINK=amesh0                     # root namespace side of the link to the switch
BRIDGE=br0                           # inside $NS_SWITCH
export SLURM_CONF

node_name() { echo "amesh-n$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }

log() { echo "[cluster] $*" >&2; }

# wait_for DESCRIPTION CMD...: poll CMD until it succeeds, for at most AMESH_SLURM_TIMEOUT s.
wait_for() {
    local what=$1 deadline=$((SECONDS + AMESH_SLURM_TIMEOUT))
    shift
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out after ${AMESH_SLURM_TIMEOUT}s waiting for $what"
            return 1
        fi
        sleep 0.2
    done
}

# Is PID alive and running program COMM (so a stale pid file never kills a stranger)?
pid_is() {
    local pid=$1 comm=$2
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]
}

# Every namespace the scripts may have made, whichever settings made them.
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^amesh-(sw|ctl|n[0-9]+)$' || true
}

# Lock out a concurrent up.sh/down.sh (not needed when the caller holds the lock).
take_lock() {
    if [ "${AMESH_SLURM_LOCK_HELD:-0}" != 1 ]; then
        exec 9<"$(dirname "${BASH_SOURCE[0]}")" # daemons must not inherit fd 9: 9<&-
        flock -w 300 9 || { log "another up.sh/down.sh holds the lock"; exit 1; }
    fi
}
