#!/usr/bin/env bash
# The first process of one node of jobs/cluster/up.sh: run by up.sh inside the node's fresh
# network, UTS, mount and IPC namespaces, it sets the node up and then holds the namespaces
# (exec.sh and the node's slurmd enter them with nsenter) until down.sh ends it.
#
#   node.sh NAME NODE_DIR SCRATCH_MOUNT
set -euo pipefail
name=$1 node_dir=$2 scratch=$3

hostname "$name"
# This network namespace's sysfs (/sys/class/net lists lo and eth0 only), keeping the
# machine's cgroup mounts under it (slurmd looks for them at /sys/fs/cgroup).
mkdir -p "$node_dir/.cgroup"
mount --rbind /sys/fs/cgroup "$node_dir/.cgroup"
umount -l /sys
mount -t sysfs sysfs /sys
mount --rbind "$node_dir/.cgroup" /sys/fs/cgroup
umount -l "$node_dir/.cgroup"
# Its own view of the names (node1.., the login node) on a private copy of /etc/hosts.
mount --bind "$node_dir/hosts" /etc/hosts
# Its own shared memory, as on a separate machine: MPI's shared-memory transport stays
# within the node.
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
# The node-local disk: only this node sees NODE_DIR/scratch at SCRATCH_MOUNT.
mount --bind "$node_dir/scratch" "$scratch"

echo $$ >"$node_dir/holder.pid.tmp"
mv "$node_dir/holder.pid.tmp" "$node_dir/holder.pid"
exec sleep infinity
