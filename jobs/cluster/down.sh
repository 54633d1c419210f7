#!/usr/bin/env bash
# Stop the cluster jobs/cluster/up.sh DIR started and remove what it made: cancel the jobs, stop
# slurmctld and every slurmd, end every process left in the nodes, delete the namespaces (their
# mounts go with them), the veth pairs and the bridge. Safe to run twice, or after a crash:
# it looks for the names derived from DIR as well as in DIR/state. Every wait is bounded.
#
#   jobs/cluster/down.sh DIR
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

say() { echo "cluster down: $*" >&2; }
[ $# -eq 1 ] || { echo "usage: down.sh DIR" >&2; exit 2; }
if [ "$(id -u)" != 0 ]; then
    say "needs root (namespaces, links, daemons started as root)"
    exit 3
fi
if [ ! -d "$1" ]; then
    say "no $1: nothing to stop"
    exit 0
fi
dir=$(cd "$1" && pwd -P)
cluster_names

wait_gone() {  # wait up to $1 tenths of a second for the pids in $2.. to exit
    local n=$1 p left
    shift
    for _ in $(seq "$n"); do
        left=""
        for p in "$@"; do alive "$p" && left="$left $p"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    echo "$left"
    return 1
}

# ---- Slurm --------------------------------------------------------------------------------------
conf=$dir/slurm/slurm.conf
ctld=""
if p=$(pid_in "$dir/slurm/slurmctld.pid") && tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$conf"; then
    ctld=$p
fi
if [ -n "$ctld" ]; then
    export SLURM_CONF=$conf
    timeout 15 scancel --full --user=root 2>/dev/null || true
    timeout 15 scontrol shutdown 2>/dev/null || true
    if left=$(wait_gone 150 "$ctld"); then :; else
        say "slurmctld still running after 15 s: killing $left"
        kill -KILL "$ctld" 2>/dev/null || true
        wait_gone 50 "$ctld" >/dev/null || say "slurmctld $ctld did not exit"
    fi
fi

# ---- the nodes: every process in their network namespaces, then the namespaces -----------------
mapfile -t spaces < <(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$prefix-(node[0-9]+|head)$" || true)
for ns in "${spaces[@]}"; do
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
    [ ${#pids[@]} -gt 0 ] || continue
    kill -TERM "${pids[@]}" 2>/dev/null || true   # slurmd, job steps, the holder
    if ! left=$(wait_gone 50 "${pids[@]}"); then
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
    fi
done
for ns in "${spaces[@]}"; do
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)  # anything started meanwhile
    if [ ${#pids[@]} -gt 0 ]; then
        kill -KILL "${pids[@]}" 2>/dev/null || true
        wait_gone 50 "${pids[@]}" >/dev/null || say "processes left in $ns: ${pids[*]}"
    fi
    ip netns del "$ns" 2>/dev/null || say "could not delete netns $ns"
done

# ---- links: the host ends of the veth pairs (their node ends went with the namespaces), the bridge
mapfile -t links < <(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
                     | grep -E "^${prefix}(v[0-9]+|br)$" || true)
for l in "${links[@]}"; do
    [ "$l" = "$bridge" ] && continue
    ip link del "$l" 2>/dev/null || true
done
ip link show "$bridge" >/dev/null 2>&1 && { ip link del "$bridge" || say "could not delete $bridge"; }

# iproute2 made /run/netns a mount point for its first namespace; undo that once none is left.
mkdir -p /run/lock
{
    if flock -w 30 9 && [ -d /run/netns ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ] && mountpoint -q /run/netns; then
        umount /run/netns 2>/dev/null || true
    fi
} 9>/run/lock/zerompi-cluster.lock

rm -f "$dir/state" "$dir"/nodes/*/holder.pid "$dir"/nodes/node*/slurmd.pid "$dir/slurm/slurmctld.pid"
say "stopped the cluster in $dir"
exit 0
