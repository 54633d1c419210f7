#!/usr/bin/env bash
# Start a one-node Slurm on this machine (slurmctld + slurmd, no munge, no
# accounting) with every file in a scratch folder; nothing under /etc changes.
#
#   jobs/ci/slurm_up.sh DIR        prints DIR/slurm.conf on stdout; then
#   export SLURM_CONF=DIR/slurm.conf && sbatch ...
#   jobs/ci/slurm_down.sh DIR      stops it again
#
# Installs Debian's slurmctld, slurmd, slurm-client and libpmix-dev with apt
# when they are missing and this runs as root with apt-get; otherwise it exits
# 3 with a message. Ports are the first free ones from 6817 (or $SLURM_UP_PORT),
# so two of these can run side by side. Progress goes to stderr.
set -euo pipefail

dir=${1:?usage: slurm_up.sh SCRATCH_DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$conf

say() { echo "slurm_up: $*" >&2; }

install_slurm() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "slurmctld/slurmd/sbatch are not installed and this is not root with apt-get;"
        say "install slurmctld slurmd slurm-client (Debian/Ubuntu) first"
        exit 3
    fi
    say "installing slurmctld slurmd slurm-client libpmix-dev with apt-get"
    local pkgs=(slurmctld slurmd slurm-client libpmix-dev)
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
    fi
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {  # first free port >= $1
    local p=$1
    while ! port_free "$p"; do p=$((p + 1)); done
    echo "$p"
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local host ctld_port slurmd_port user
    host=$(hostname -s)
    user=$(id -un)  # root in CI; the daemons and the jobs all run as whoever starts this
    ctld_port=$(free_port "${SLURM_UP_PORT:-6817}")
    slurmd_port=$(free_port $((ctld_port + 1)))
    mkdir -p "$dir/state" "$dir/spool"
    cat >"$conf" <<EOF
# Written by jobs/ci/slurm_up.sh: a one-node test cluster on localhost.
ClusterName=zerompi-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Finished jobs stay visible to squeue/scontrol for 5 minutes (there is no accounting).
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

install_slurm
if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid"; then
    say "already running in $dir"
else
    write_conf
    slurmctld -f "$conf"
    slurmd -f "$conf"
fi

# Wait until the node accepts jobs.
node=$(hostname -s)
for _ in $(seq 100); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    if [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ]; then
        say "node $node is $state (SLURM_CONF=$conf)"
        echo "$conf"
        exit 0
    fi
    sleep 0.2
done
say "node $node did not become idle within 20 s (state '${state:-?}'); logs:"
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
