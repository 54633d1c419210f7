# Shared by up.sh, down.sh and exec.sh (sourced, not run): the names a cluster in DIR uses.
#
# Machine 0 is "head" (slurmctld), machines 1..N are node1..nodeN. Every name carries a short
# hash of DIR's absolute path, so two clusters (and the one-node Slurm of jobs/ci/slurm_up.sh)
# can run side by side:
#   network namespaces  zc<hash>-head, zc<hash>-node<k>
#   bridge              zc<hash>br
#   host end of veth k  zc<hash>v<k>   (the other end is eth0 inside machine k)

export PATH=$PATH:/usr/sbin:/sbin

cluster_dir() {  # absolute path of $1 (created)
    mkdir -p "$1"
    (cd "$1" && pwd -P)
}

cluster_names() {  # sets hash, prefix, bridge for the cluster in $dir
    hash=$(printf %s "$dir" | sha1sum | cut -c1-6)
    prefix=zc$hash
    bridge=${prefix}br
}

machine_name() { if [ "$1" = 0 ]; then echo head; else echo "node$1"; fi; }
netns_of() { echo "$prefix-$(machine_name "$1")"; }
hostveth_of() { echo "${prefix}v$1"; }

alive() {  # a process that still runs (a zombie waiting for its parent does not)
    local st
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

pid_in() {  # the pid in file $1, if that process is alive
    local p
    [ -s "$1" ] || return 1
    p=$(cat "$1" 2>/dev/null) || return 1
    alive "$p" && echo "$p"
}

holder_pid() {  # the pid whose namespaces are machine $1's (0: head), if it is alive and is ours
    local p
    p=$(pid_in "$dir/nodes/$(machine_name "$1")/holder.pid") || return 1
    # A stale pid file after a crash may name a reused pid: it must sit in this node's netns.
    [ "$(stat -L -c %i "/proc/$p/ns/net" 2>/dev/null)" = "$(stat -L -c %i "/run/netns/$(netns_of "$1")" 2>/dev/null)" ] \
        || return 1
    echo "$p"
}

node_number() {  # node3 or 3 -> 3; head -> 0
    local n=${1#node}
    [ "$1" = head ] && n=0
    case $n in ''|*[!0-9]*) return 1 ;; esac
    echo "$n"
}
