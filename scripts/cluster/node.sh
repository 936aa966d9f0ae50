#!/usr/bin/env bash
# node.sh HOST CMD...: run CMD "on" a host of the cluster scripts/cluster/up.sh brought up
# (amesh-n1.., or amesh-ctl): in the network, UTS and mount namespaces of its daemon, so with
# its address, its hostname and the cluster's /etc/hosts. As root. Example:
#   scripts/cluster/node.sh amesh-n2 python3 -c 'import socket; print(socket.gethostname())'
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
AMESH_SLURM_USE_SAVED=1 # read by lib.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 HOST CMD..." >&2
    exit 2
fi
host=$1
shift
case $host in
"$NS_CTLD") want=slurmctld ;;
*) want="slurmd:$host" ;;
esac
pid=$(awk -v n="$want" '$1 == n { print $2 }' "$PIDS" 2>/dev/null || true)
if ! pid_is "$pid" "${want%%:*}"; then
    echo "node.sh: $host is not up (no $want in $PIDS)" >&2
    exit 1
fi
exec nsenter --target "$pid" --net --uts --mount -- "$@"
