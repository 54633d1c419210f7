#!/usr/bin/env bash
# Run a command inside one node of the cluster jobs/cluster/up.sh DIR started: in its network,
# UTS (hostname), mount (its /scratch/local, /dev/shm, /etc/hosts) and IPC namespaces, in the
# current directory, with the caller's environment.
#
#   jobs/cluster/exec.sh DIR node2 hostname
#   jobs/cluster/exec.sh DIR 1 ls /scratch/local
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

if [ $# -lt 3 ]; then
    echo "usage: exec.sh DIR NODE CMD..." >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "exec.sh: needs root (nsenter into the node's namespaces)" >&2
    exit 3
fi
[ -d "$1" ] || { echo "exec.sh: no cluster in $1" >&2; exit 2; }
dir=$(cd "$1" && pwd -P)
cluster_names
k=$(node_number "$2") || { echo "exec.sh: $2 is not a node (node1, node2, ... or 1, 2, ...)" >&2; exit 2; }
shift 2
pid=$(holder_pid "$k") || { echo "exec.sh: node$k of $dir is not running" >&2; exit 2; }
exec nsenter -t "$pid" --net --uts --mount --ipc -- bash -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' \
    exec.sh "$PWD" "$@"
