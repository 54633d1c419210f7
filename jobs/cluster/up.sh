#!/usr/bin/env bash
# A Slurm cluster of N nodes on this one machine, for trying multi-node jobs without a cluster.
#
#   jobs/cluster/up.sh DIR --nodes N [--link-mbit M] [--latency-us L] [--cpus C] [--scratch PATH]
#   source DIR/env.sh           # then sbatch, srun, squeue, sinfo, sacct work from this shell
#   jobs/cluster/exec.sh DIR node2 CMD...    # a command inside node2
#   jobs/cluster/down.sh DIR    # stops everything and removes what up.sh made
#
# Each node is a set of Linux namespaces (network, UTS, mount, IPC) with hostname nodeK, its
# own loopback, its own /dev/shm, an /etc/hosts naming every machine, and a node-local disk:
# DIR's nodes/nodeK/scratch mounted at PATH (default /scratch/local) that only nodeK sees. The
# rest of the file system (DIR/shared, the repository, the venv) is common to all, as a
# parallel file system is. The nodes (10.213.S.11..), the head (10.213.S.2) and this machine
# (the login node, 10.213.S.1) reach each other through veth pairs on one Linux bridge with a
# private /24 (S free and picked from DIR's hash); the nodes have no default route and there
# is no NAT, so nothing they send can leave the bridge. --link-mbit shapes each node's link in
# both directions (tbf); --latency-us delays every packet a node sends by L microseconds
# (netem; node-to-node round trip 2L). No shaping by default.
#
# Slurm: slurmctld runs in "head", one more set of namespaces on the bridge, so that it is
# reachable from the bridge only (it has no authentication) and its port is free whatever
# runs here (jobs/ci/slurm_up.sh's Slurm too); one slurmd per node inside its namespaces. No
# munge (auth/none), no accounting database: sacct reads the job completion log
# (JobCompType=jobcomp/filetxt) through DIR/bin/sacct, which adds --completion.
# --cpus C: CPUs each node declares (default: this machine's nproc, as every node sees all
# cores); nodes may declare more than there are (SlurmdParameters=config_overrides).
#
# Needs root (exit 3 otherwise, or when a tool is missing and cannot be installed); installs
# Debian's Slurm with apt-get when missing, as jobs/ci/slurm_up.sh does. A DIR left by a
# crashed run is cleared first (down.sh). DIR/state lists what was made. Progress on stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

say() { echo "cluster up: $*" >&2; }
die() { say "$*"; exit 1; }
usage() {
    echo "usage: up.sh DIR --nodes N [--link-mbit M] [--latency-us L] [--cpus C] [--scratch PATH]" >&2
    exit 2
}

[ $# -ge 1 ] || usage
case $1 in -*) usage ;; esac
arg_dir=$1
shift
nodes=2 mbit="" latency="" cpus=$(nproc) scratch_mount=/scratch/local
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) nodes=${2:?}; shift 2 ;;
        --link-mbit) mbit=${2:?}; shift 2 ;;
        --latency-us) latency=${2:?}; shift 2 ;;
        --cpus) cpus=${2:?}; shift 2 ;;
        --scratch) scratch_mount=${2:?}; shift 2 ;;
        --nodes=*) nodes=${1#*=}; shift ;;
        --link-mbit=*) mbit=${1#*=}; shift ;;
        --latency-us=*) latency=${1#*=}; shift ;;
        --cpus=*) cpus=${1#*=}; shift ;;
        --scratch=*) scratch_mount=${1#*=}; shift ;;
        *) usage ;;
    esac
done
for v in "$nodes" "$cpus" ${mbit:+"$mbit"} ${latency:+"$latency"}; do
    case $v in ''|*[!0-9]*) say "not a whole number: $v"; usage ;; esac
done
[ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] || { say "--nodes must be 1..200"; exit 2; }
case $scratch_mount in /*) ;; *) say "--scratch must be an absolute path"; exit 2 ;; esac

if [ "$(id -u)" != 0 ]; then
    say "needs root: it creates network namespaces, a bridge, veth pairs and mounts," \
        "and runs slurmd as root (run it with sudo, or on a machine where you are root)"
    exit 3
fi
for tool in ip unshare nsenter flock setsid sha1sum mount hostname; do
    command -v "$tool" >/dev/null || { say "missing tool: $tool (util-linux, iproute2)"; exit 3; }
done
if { [ -n "$mbit" ] || [ -n "$latency" ]; } && ! command -v tc >/dev/null; then
    say "--link-mbit/--latency-us need tc (iproute2)"
    exit 3
fi

# Root in a container may still lack the capabilities (CAP_SYS_ADMIN, CAP_NET_ADMIN) this needs.
if ! unshare --net --uts --mount --ipc true 2>/dev/null; then
    say "cannot create network/UTS/mount/IPC namespaces here (unshare failed: a container without CAP_SYS_ADMIN?)"
    exit 3
fi

install_slurm() {  # as jobs/ci/slurm_up.sh does
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        say "slurmctld/slurmd/sbatch are not installed and there is no apt-get;"
        say "install slurmctld slurmd slurm-client first"
        exit 3
    fi
    say "installing slurmctld slurmd slurm-client libpmix-dev with apt-get"
    local pkgs=(slurmctld slurmd slurm-client libpmix-dev)
    if ! DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2; then
        DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -qq >&2 || true
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2 \
            || { say "could not install Slurm with apt-get"; exit 3; }
    fi
}
install_slurm

dir=$(cluster_dir "$arg_dir")
cluster_names
state=$dir/state

# What a crashed run left in this DIR (processes, namespaces, links) goes first.
if [ -e "$state" ] || ip netns list 2>/dev/null | grep -q "^$prefix-" || ip link show "$bridge" >/dev/null 2>&1; then
    say "clearing what a previous run left in $dir"
    bash "$here/down.sh" "$dir" >&2 || true
fi

record() { echo "$*" >>"$state"; }
: >"$state"
record "dir $dir"
ok=0
on_exit() {
    if [ "$ok" != 1 ]; then
        say "failed; logs:"
        for f in "$dir/slurm/slurmctld.log" "$dir"/nodes/node*/slurmd.log "$dir"/nodes/*/holder.log; do
            [ -s "$f" ] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }
        done
        say "tearing down"
        bash "$here/down.sh" "$dir" >&2 || true
    fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM HUP  # interrupted (timeout, ^C): the EXIT trap still tears down

# ---- network: one bridge, a veth pair per node -----------------------------------------------
mkdir -p /run/lock
exec 9>/run/lock/zerompi-cluster.lock
flock -w 120 9 || die "another up.sh held /run/lock/zerompi-cluster.lock for 120 s"

in_use() {  # is 10.213.$1.0/24 on any interface or route here?
    ip -4 -o addr show | grep -q " 10\.213\.$1\." || ip -4 route show | grep -q "^10\.213\.$1\."
}
subnet=""
start=$((0x$hash % 200 + 20))
for i in $(seq 0 199); do
    s=$(( (start - 20 + i) % 200 + 20 ))
    if ! in_use "$s"; then subnet=10.213.$s; break; fi
done
[ -n "$subnet" ] || die "no free 10.213.S.0/24 (S in 20..219) on this machine"
record "subnet $subnet.0/24"
say "bridge $bridge with $subnet.0/24, $nodes nodes"

no_ipv6() {  # interface $1 (in netns $2 if given): no IPv6, so no link-local chatter either
    if [ -n "${2:-}" ]; then
        ip netns exec "$2" sh -c "echo 1 >/proc/sys/net/ipv6/conf/$1/disable_ipv6" 2>/dev/null || true
    else
        [ -w "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ] && echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6" || true
    fi
}

record "link $bridge"
# Bridged frames do not go through iptables (br_netfilter), whatever the host's rules.
if ! ip link add "$bridge" type bridge nf_call_iptables 0 2>/dev/null && ! ip link add "$bridge" type bridge; then
    say "cannot create a bridge (no CAP_NET_ADMIN, or no bridge support in this kernel)"
    exit 3
fi
no_ipv6 "$bridge"
ip addr add "$subnet.1/24" dev "$bridge"
ip link set "$bridge" up

burst_bytes() { local b=$(( $1 * 1250 )); [ "$b" -ge 16000 ] || b=16000; echo "$b"; }  # 10 ms at M Mbit/s
shape() {  # shape the egress of device $1 (in netns $2, or "" for here); latency only if $3
    local dev=$1 ns=$2 delay=$3 tc=(tc)
    [ -n "$ns" ] && tc=(ip netns exec "$ns" tc)
    if [ -n "$delay" ]; then
        if ! "${tc[@]}" qdisc add dev "$dev" root handle 1: netem delay "${delay}us" limit 100000; then
            say "tc netem failed on $dev: this kernel may lack sch_netem (CONFIG_NET_SCH_NETEM), which --latency-us needs"
            exit 3
        fi
        if [ -n "$mbit" ]; then
            "${tc[@]}" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "${mbit}mbit" \
                burst "$(burst_bytes "$mbit")" latency 100ms
        fi
    elif [ -n "$mbit" ]; then
        if ! "${tc[@]}" qdisc add dev "$dev" root tbf rate "${mbit}mbit" burst "$(burst_bytes "$mbit")" latency 100ms; then
            say "tc tbf failed on $dev: this kernel may lack sch_tbf (CONFIG_NET_SCH_TBF), which --link-mbit needs"
            exit 3
        fi
    fi
}

address_of() { if [ "$1" = 0 ]; then echo "$subnet.2"; else echo "$subnet.$((10 + $1))"; fi; }
login=$(hostname -s)
mkdir -p "$dir/shared" "$dir/nodes"
hosts_file=$dir/hosts
{
    echo "127.0.0.1 localhost"
    echo "$subnet.1 $login login"
    for k in $(seq 0 "$nodes"); do echo "$(address_of "$k") $(machine_name "$k")"; done
} >"$hosts_file"

for k in $(seq 0 "$nodes"); do
    ns=$(netns_of "$k") hv=$(hostveth_of "$k") nd=$dir/nodes/$(machine_name "$k")
    record "netns $ns"
    ip netns add "$ns"
    record "link $hv"
    ip link add "$hv" type veth peer name "${prefix}n$k" netns "$ns"
    no_ipv6 "$hv"
    ip link set "$hv" master "$bridge"
    ip link set "$hv" up
    ip -n "$ns" link set "${prefix}n$k" name eth0
    no_ipv6 all "$ns"
    no_ipv6 default "$ns"
    no_ipv6 eth0 "$ns"
    ip -n "$ns" addr add "$(address_of "$k")/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    if [ "$k" != 0 ] && { [ -n "$mbit" ] || [ -n "$latency" ]; }; then
        shape eth0 "$ns" "$latency"   # what the node sends: bandwidth and latency
        shape "$hv" "" ""             # what it receives: bandwidth
    fi
    rm -rf "$nd"
    mkdir -p "$nd/scratch" "$nd/spool"
    cp "$hosts_file" "$nd/hosts"
done
flock -u 9
exec 9>&-
[ -n "$mbit$latency" ] && say "links: ${mbit:+$mbit Mbit/s }${latency:+$latency us per packet sent}"

# ---- the nodes' own namespaces --------------------------------------------------------------
mkdir -p "$scratch_mount"  # the mount point on the host (left in place: other clusters may use it)
for k in $(seq 0 "$nodes"); do
    name=$(machine_name "$k") nd=$dir/nodes/$(machine_name "$k")
    setsid nsenter --net="/run/netns/$(netns_of "$k")" -- unshare --uts --mount --ipc --propagation private -- \
        bash "$here/node.sh" "$name" "$nd" "$scratch_mount" </dev/null >"$nd/holder.log" 2>&1 &
done
for k in $(seq 0 "$nodes"); do
    deadline=$((SECONDS + 30))
    until holder_pid "$k" >/dev/null || [ "$SECONDS" -ge "$deadline" ]; do sleep 0.1; done
    holder_pid "$k" >/dev/null || die "$(machine_name "$k") did not come up within 30 s"
    record "holder $(machine_name "$k") $(holder_pid "$k")"
done
in_machine() {  # run $2.. in machine $1's namespaces, with a plain daemon environment
    local k=$1
    shift
    nsenter -t "$(holder_pid "$k")" --net --uts --mount --ipc -- \
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"
}

# ---- Slurm ------------------------------------------------------------------------------------
# slurmctld runs in "head" and each slurmd in its node: each has its own network, so Slurm's
# usual ports are free there whatever runs on this machine (jobs/ci/slurm_up.sh's Slurm too).
ctld_port=6817
slurmd_port=6818

mem_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
node_mem=$(( mem_mb / nodes ))
[ "$node_mem" -ge 1 ] || node_mem=1
sdir=$dir/slurm
rm -rf "$sdir"
mkdir -p "$sdir/state" "$dir/bin"
conf=$sdir/slurm.conf
cat >"$conf" <<EOF
# Written by jobs/cluster/up.sh: $nodes nodes on one machine (namespaces on bridge $bridge).
ClusterName=$prefix
SlurmctldHost=head($subnet.2)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
MessageTimeout=30
StateSaveLocation=$sdir/state
SlurmctldPidFile=$sdir/slurmctld.pid
SlurmctldLogFile=$sdir/slurmctld.log
SlurmdSpoolDir=$dir/nodes/%n/spool
SlurmdPidFile=$dir/nodes/%n/slurmd.pid
SlurmdLogFile=$dir/nodes/%n/slurmd.log
TmpFS=$scratch_mount
# No accounting database: sacct --completion reads this log of finished jobs (DIR/bin/sacct adds it).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$sdir/jobcomp.log
# Finished jobs stay visible to squeue/scontrol for 5 minutes.
MinJobAge=300
EOF
for k in $(seq "$nodes"); do
    echo "NodeName=node$k NodeAddr=$subnet.$((10 + k)) NodeHostname=node$k CPUs=$cpus RealMemory=$node_mem State=UNKNOWN"
done >>"$conf"
echo "PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$conf"
record "slurm $conf"

cat >"$dir/bin/sacct" <<EOF
#!/bin/sh
# This cluster keeps no accounting database (AccountingStorageType=accounting_storage/none);
# sacct reads the log of finished jobs instead (JobCompType=jobcomp/filetxt).
exec $(command -v sacct) --completion "\$@"
EOF
chmod +x "$dir/bin/sacct"

in_machine 0 slurmctld -f "$conf"
for k in $(seq "$nodes"); do
    in_machine "$k" slurmd -f "$conf" -N "node$k"
done

export SLURM_CONF=$conf
want=$(seq -s ' ' -f 'node%g' "$nodes")
states="" idle=0
deadline=$((SECONDS + 90))
while [ "$SECONDS" -lt "$deadline" ]; do
    states=$(timeout 10 sinfo -h -N -o "%N=%T" 2>/dev/null | sort -u | tr '\n' ' ' || true)
    idle=0
    for k in $(seq "$nodes"); do
        case " $states" in *" node$k=idle "*) idle=$((idle + 1)) ;; esac
    done
    [ "$idle" = "$nodes" ] && break
    sleep 0.3
done
[ "$idle" = "$nodes" ] || die "nodes not all idle within 90 s: ${states:-no answer from slurmctld} (want $want idle)"

# ---- the login environment ------------------------------------------------------------------
cat >"$dir/env.sh" <<EOF
# source this file: the shell becomes a login node of the cluster in $dir (jobs/cluster/up.sh).
export ZEROMPI_CLUSTER=$dir
export SLURM_CONF=$conf
case ":\$PATH:" in *":$dir/bin:"*) ;; *) export PATH=$dir/bin:\$PATH:/usr/sbin:/sbin ;; esac
# The node-local disk of every node (each sees its own), and the disk all nodes share.
export CLUSTER_SCRATCH=$scratch_mount
export CLUSTER_SHARED=$dir/shared
# Accounting is off (no slurmdbd): sacct here is $dir/bin/sacct, i.e. sacct --completion, which
# reads finished jobs from $sdir/jobcomp.log; squeue -t all shows them for 5 minutes too.
# MPI needs nothing set: the nodes have only lo and eth0, and MPICH (UCX or OFI) and Open MPI
# take eth0 between nodes. srun --mpi=pmi2 for MPICH, --mpi=pmix for Open MPI 5; mpiexec
# runs inside an allocation (sbatch, or salloc here) and starts its daemons with srun.
EOF
ok=1
say "up: $nodes nodes ($states) on $bridge $subnet.0/24, slurmctld on head ($subnet.2:$ctld_port)"
say "source $dir/env.sh"
echo "$dir/env.sh"
