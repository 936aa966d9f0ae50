#!/usr/bin/env bash
# Bring up a private SLURM cluster on this machine (as root): munged, slurmctld and 4 nodes
# amesh-n1..amesh-n4, each a "host" of its own: its own network namespace and address, its
# own hostname (UTS namespace) and an /etc/hosts that names them all (mount namespace).
# Waits until every node is idle, then prints the nodes and the environment for the SLURM
# clients. scripts/cluster/down.sh takes it all down again. Running up.sh again while the
# cluster is up and healthy changes nothing; after a partial run it starts over.
#
# Addresses (defaults; AMESH_SLURM_NET changes the first three octets):
#   10.77.0.0/24    private subnet. The nodes' namespaces route only this subnet, and the root
#                   namespace has a blackhole route for it (metric 4242) behind the link's
#                   own route, so no packet for it ever leaves the machine.
#   10.77.0.1       root namespace, link "amesh0": the controller side. Processes of this
#                   machine (an amesh controller, a test) listen here; jobs on every node
#                   reach it.
#   10.77.0.2       namespace amesh-ctl, hostname amesh-ctl: slurmctld (port 6817).
#   10.77.0.11-14   namespaces amesh-n1..n4, hostnames amesh-n1..n4: slurmd (port 6818) and
#                   the jobs' tasks, which reach each other and 10.77.0.1.
#   All of them hang off bridge br0 in namespace amesh-sw (its own namespace, so that the
#   root namespace's firewall never filters traffic between nodes).
#
# Clients (sbatch, srun, squeue, scancel, sinfo, scontrol) run in the root namespace with
#   SLURM_CONF=$AMESH_SLURM_DIR/slurm.conf  (or: set -a; . $AMESH_SLURM_DIR/cluster.env)
# Jobs inherit it. scripts/cluster/node.sh amesh-n2 CMD... runs CMD "on" node amesh-n2.
#
# munged is private too: own key and socket under the state dir (AuthInfo=socket=...), so a
# system munged, if any, is neither used nor touched. The packages' own services are not
# started (policy-rc.d while installing).
#
# Settings: see scripts/cluster/lib.sh (AMESH_SLURM_DIR, _NNODES, _NET, _CPUS, _INSTALL,
# _TIMEOUT). Prints "install: N s" and "start: N s" to stderr.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

if [ "$(id -u)" != 0 ]; then
    echo "up.sh: must run as root" >&2
    exit 1
fi
take_lock
export AMESH_SLURM_LOCK_HELD=1 # the down.sh we run shares our lock

SETTINGS="AMESH_SLURM_NNODES=$AMESH_SLURM_NNODES
AMESH_SLURM_NET=$AMESH_SLURM_NET
AMESH_SLURM_CPUS=$AMESH_SLURM_CPUS"

idle_nodes() { scontrol show nodes -o 2>/dev/null | grep -c ' State=IDLE ' || true; }
all_idle() { [ "$(idle_nodes)" = "$AMESH_SLURM_NNODES" ]; }
# Nodes that respond and take jobs (busy ones too: a healthy cluster may be running jobs).
serving_nodes() {
    scontrol show nodes -o 2>/dev/null |
        grep -cE ' State=(IDLE|MIXED|ALLOCATED)(\+COMPLETING)? ' || true
}
munge_ok() { munge -S "$MUNGE_SOCKET" -n | unmunge -S "$MUNGE_SOCKET"; }
ctld_up() { scontrol ping | grep -q 'is UP'; }

healthy() {
    [ -f "$MARKER" ] && [ -f "$STATE/cluster.env" ] || return 1
    [ "$(cat "$STATE/settings" 2>/dev/null)" = "$SETTINGS" ] || return 1
    local name pid
    while read -r name pid; do
        pid_is "$pid" "${name%%:*}" || return 1
    done <"$PIDS"
    command -v scontrol >/dev/null && [ "$(serving_nodes)" = "$AMESH_SLURM_NNODES" ]
}

report() {
    local i
    echo "# SLURM cluster: state in $STATE"
    for i in $(seq 1 "$AMESH_SLURM_NNODES"); do
        echo "# node $(node_name "$i") $(node_addr "$i")"
    done
    echo "# controller side (root namespace) $HOST_ADDR, slurmctld $CTLD_ADDR"
    sed 's/^/export /' "$STATE/cluster.env"
}

if healthy; then
    log "already up"
    report
    exit 0
fi
# Whatever an earlier or partial run left goes first.
bash "$HERE/down.sh" >&2

now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

DONE=0
MADE_POLICY=0
on_exit() {
    if [ "$MADE_POLICY" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
    if [ "$DONE" != 1 ]; then
        log "up.sh failed; logs follow, then down.sh"
        for f in "$STATE"/log/*; do
            [ -f "$f" ] || continue
            echo "----- $f" >&2
            tail -n 30 "$f" >&2 || true
        done
        AMESH_SLURM_USE_SAVED=1 bash "$HERE/down.sh" >&2 || true
    fi
}
trap on_exit EXIT

# ---- install ------------------------------------------------------------------------------
t_install=$(now)
missing=()
# (openssh: tests/test_env_ssh.py starts sshd on nodes, for the `ssh` target)
for pkg in munge slurmctld slurmd slurm-client openssh-server openssh-client; do
    dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' ||
        missing+=("$pkg")
done
command -v ip >/dev/null || missing+=(iproute2)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$AMESH_SLURM_INSTALL" != 1 ]; then
        log "missing packages: ${missing[*]} (AMESH_SLURM_INSTALL=0)"
        exit 1
    fi
    log "installing ${missing[*]}"
    if [ ! -e /usr/sbin/policy-rc.d ]; then # keep their services from starting
        MADE_POLICY=1
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get -qq -o DPkg::Lock::Timeout=300 update >/dev/null
    apt-get -qq -y -o DPkg::Lock::Timeout=300 install --no-install-recommends "${missing[@]}" >/dev/null
    if [ "$MADE_POLICY" = 1 ]; then
        rm -f /usr/sbin/policy-rc.d
        MADE_POLICY=0
    fi
fi
for cmd in munged mungekey slurmctld slurmd sbatch nsenter unshare setpriv flock sshd ssh ssh-keygen; do
    command -v "$cmd" >/dev/null || { log "$cmd not found"; exit 1; }
done
log "install: $(elapsed "$t_install") s"

# ---- state dir ----------------------------------------------------------------------------
t_start=$(now)
if [ -e "$STATE" ] && [ -n "$(ls -A "$STATE")" ]; then
    log "$STATE exists and is not ours (no $MARKER); set AMESH_SLURM_DIR"
    DONE=1 # leave it alone
    exit 1
fi
mkdir -p "$STATE"
chmod 755 "$STATE"
: >"$MARKER"
echo "$SETTINGS" >"$STATE/settings"
: >"$PIDS"
mkdir -p "$STATE"/{log,ctld,spool}
[ -d /run/netns ] || : >"$STATE/made-run-netns" # down.sh then removes /run/netns too

# ---- munged (private key and socket) ------------------------------------------------------
mkdir -p "$MUNGE_DIR"
mungekey --create --keyfile="$MUNGE_DIR/munge.key"
chown -R munge:munge "$MUNGE_DIR"
chmod 755 "$MUNGE_DIR"
chmod 400 "$MUNGE_DIR/munge.key"
setsid setpriv --reuid=munge --regid=munge --init-groups -- \
    munged --foreground --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed" \
    --log-file="$STATE/log/munged.log" </dev/null >>"$STATE/log/munged.out" 2>&1 9<&- &
echo "munged $!" >>"$PIDS"
wait_for "munged" munge_ok

# ---- network ------------------------------------------------------------------------------
ip route replace blackhole "$SUBNET" metric "$BLACKHOLE_METRIC"
ip netns add "$NS_SWITCH"
ip -n "$NS_SWITCH" link set lo up
ip -n "$NS_SWITCH" link add "$BRIDGE" type bridge
ip -n "$NS_SWITCH" link set "$BRIDGE" up
ip link add "$HOST_LINK" type veth peer name host netns "$NS_SWITCH"
ip -n "$NS_SWITCH" link set host master "$BRIDGE" up
ip addr add "$HOST_ADDR/24" dev "$HOST_LINK"
ip link set "$HOST_LINK" up

# add_host NAMESPACE ADDRESS: a namespace with eth0 on the bridge (port NAMESPACE there).
add_host() {
    local ns=$1 addr=$2
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "$ns" netns "$NS_SWITCH" type veth peer name eth0 netns "$ns"
    ip -n "$NS_SWITCH" link set "$ns" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
}
{
    echo "127.0.0.1 localhost"
    echo "$HOST_ADDR amesh-host"
    echo "$CTLD_ADDR $NS_CTLD"
} >"$STATE/hosts"
add_host "$NS_CTLD" "$CTLD_ADDR"
for i in $(seq 1 "$AMESH_SLURM_NNODES"); do
    add_host "$(node_name "$i")" "$(node_addr "$i")"
    echo "$(node_addr "$i") $(node_name "$i")" >>"$STATE/hosts"
done

# launch NAME NAMESPACE CMD...: run CMD as a daemon "on" host NAMESPACE: in its network
# namespace, with hostname NAMESPACE and our hosts file. nsenter, not `ip netns exec`: that
# remounts /sys, and slurmd exits. Each program execs the next, so $! is CMD's pid.
launch() {
    local name=$1 ns=$2
    shift 2
    # shellcheck disable=SC2016 # $1 $2 $@ belong to the inner sh
    setsid nsenter --net="/run/netns/$ns" -- unshare --uts --mount --propagation private -- \
        sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' \
        sh "$ns" "$STATE/hosts" "$@" </dev/null >>"$STATE/log/${name//:/-}.out" 2>&1 9<&- &
    echo "$name $!" >>"$PIDS"
}

# ---- slurm.conf ---------------------------------------------------------------------------
{
    cat <<EOF
# Written by scripts/cluster/up.sh; removed by down.sh.
ClusterName=amesh
SlurmctldHost=$NS_CTLD($CTLD_ADDR)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/spool/%n/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=30
NodeName=DEFAULT CPUs=$AMESH_SLURM_CPUS RealMemory=1000 State=UNKNOWN
EOF
    for i in $(seq 1 "$AMESH_SLURM_NNODES"); do
        echo "NodeName=$(node_name "$i") NodeHostname=$(node_name "$i") NodeAddr=$(node_addr "$i")"
    done
    echo "PartitionName=amesh Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"$SLURM_CONF"

# ---- daemons ------------------------------------------------------------------------------
launch slurmctld "$NS_CTLD" slurmctld -D -c -f "$SLURM_CONF"
wait_for "slurmctld" ctld_up
for i in $(seq 1 "$AMESH_SLURM_NNODES"); do
    name=$(node_name "$i")
    mkdir -p "$STATE/spool/$name"
    launch "slurmd:$name" "$name" slurmd -D -N "$name" -f "$SLURM_CONF"
done
wait_for "$AMESH_SLURM_NNODES idle nodes" all_idle

names=() addrs=()
for i in $(seq 1 "$AMESH_SLURM_NNODES"); do
    names+=("$(node_name "$i")")
    addrs+=("$(node_addr "$i")")
done
cat >"$STATE/cluster.env" <<EOF
SLURM_CONF=$SLURM_CONF
AMESH_SLURM_DIR=$STATE
AMESH_SLURM_NODE_NAMES=$(IFS=,; echo "${names[*]}")
AMESH_SLURM_NODE_ADDRS=$(IFS=,; echo "${addrs[*]}")
AMESH_SLURM_HOST_ADDR=$HOST_ADDR
AMESH_SLURM_CTLD_ADDR=$CTLD_ADDR
EOF
DONE=1
log "start: $(elapsed "$t_start") s"
report
