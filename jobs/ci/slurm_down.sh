#!/usr/bin/env bash
# Stop the Slurm that jobs/ci/slurm_up.sh DIR started: cancel its jobs, shut
# down slurmctld and slurmd, and wait for both (SIGKILL by pid after 15 s).
#
#   jobs/ci/slurm_down.sh DIR
set -uo pipefail

dir=${1:?usage: slurm_down.sh SCRATCH_DIR}
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$dir/slurm.conf
[ -f "$SLURM_CONF" ] || { echo "slurm_down: no $SLURM_CONF, nothing to stop" >&2; exit 0; }

pids=()
for f in "$dir/slurmctld.pid" "$dir/slurmd.pid"; do
    if [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
        pids+=("$(cat "$f")")
    fi
done

timeout 10 scancel --full --user="$(id -un)" 2>/dev/null || true
timeout 10 scontrol shutdown 2>/dev/null || true

for _ in $(seq 75); do
    left=()
    for p in "${pids[@]}"; do
        kill -0 "$p" 2>/dev/null && left+=("$p")
    done
    [ ${#left[@]} -eq 0 ] && exit 0
    sleep 0.2
done
echo "slurm_down: still running after 15 s, killing ${left[*]}" >&2
for p in "${left[@]}"; do
    kill -KILL "$p" 2>/dev/null || true
done
exit 0
