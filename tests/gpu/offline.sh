#!/usr/bin/env bash
# The GPU suite on a machine with a CUDA torch but no network: MPI comes from wheels in WHEELS
# (default .whl: e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl mpich mpi4py`
# on a connected machine), installed into the environment of the `python3` that holds torch.
#   GPU_SUITE_LIMIT  seconds the suite may run (default 400)
#   GPU_SUITE_ARGS   more pytest arguments
#   OUT              where the log goes (default .)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ZEROMPI_TEST_TIMEOUT=${ZEROMPI_TEST_TIMEOUT:-240}
PY=$(python3 -c "import sys; print(sys.executable)")
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "${WHEELS:-.whl}"/*.whl
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, mpi4py.MPI as M, h5py, zerompi; print('torch', torch.__version__, torch.cuda.is_available(), '|', M.Get_library_version().splitlines()[0])"
timeout "${GPU_SUITE_LIMIT:-400}" "$PY" -m pytest tests/gpu -rs -p no:cacheprovider ${GPU_SUITE_ARGS:-} 2>&1 | tee "${OUT:-.}/gpu-suite.log" | tail -150
