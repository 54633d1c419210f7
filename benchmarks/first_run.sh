#!/usr/bin/env bash
# A newcomer's first two commands, timed: a fresh clone of HEAD, the README's set-up (`bash jobs/setup.sh`)
# and its quick-start job (`mpiexec -n 2 python -m mpi4py jobs/train_gpt.py`), appended as a row to
# benchmarks/results/first_run.md with the commit, the venv's size and whether pip's cache held the wheels.
#
#   benchmarks/first_run.sh [--no-cache]     --no-cache: pip downloads every wheel (PIP_NO_CACHE_DIR=1)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$repo" rev-parse --short HEAD)
work=$(mktemp -d /tmp/zerompi-first-XXXXXX)
trap 'rm -rf "$work"' EXIT
cache="pip's cache as this machine has it"
if [ "${1:-}" = "--no-cache" ]; then export PIP_NO_CACHE_DIR=1; cache="no pip cache (wheels from PyPI or the local wheel folder)"; fi
git clone -q "$repo" "$work/repo"
cd "$work/repo" || exit 1
start=$(date +%s.%N)
bash jobs/setup.sh > "$work/setup.log" 2>&1 || { echo "first_run: set-up failed: $work/setup.log" >&2; exit 1; }
mid=$(date +%s.%N)
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py jobs/train_gpt.py > "$work/job.log" 2>&1 \
    || { echo "first_run: the job failed" >&2; tail -20 "$work/job.log" >&2; exit 1; }
end=$(date +%s.%N)
size=$(du -sh .venv | cut -f1)
done_line=$(grep -m1 "^done:" "$work/job.log" | cut -c1-120)
row=$(printf '| %s | %s | %.0f s | %.0f s | %.0f s | %s | %s | %s |' "$commit" "$(date -u +%F)" \
      "$(echo "$mid - $start" | bc)" "$(echo "$end - $mid" | bc)" "$(echo "$end - $start" | bc)" "$size" "$cache" \
      "$(cut -d' ' -f1-3 /proc/loadavg)")
results="$repo/benchmarks/results/first_run.md"
if [ ! -f "$results" ]; then
    {
        echo "# A newcomer's first run: set-up and the quick-start job"
        echo
        echo "\`benchmarks/first_run.sh\`: a fresh clone, \`bash jobs/setup.sh\`, then"
        echo "\`.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py jobs/train_gpt.py\`, on this machine's 2 cores"
        echo "(pip's own settings apply: a local wheel folder in PIP_FIND_LINKS makes the set-up a lower bound)."
        echo
        echo "| commit | date | set-up | job | together | .venv | wheels | load average at the end |"
        echo "|---|---|---|---|---|---|---|---|"
    } > "$results"
fi
echo "$row" >> "$results"
echo "$row"
echo "first_run: $done_line" >&2
