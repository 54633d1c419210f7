#!/usr/bin/env bash
# A virtual environment whose h5py writes through the mpio driver, for the shared-file
# checkpoint layout: Debian's parallel h5py (HDF5 built with Open MPI) and mpi4py, seen
# through a --system-site-packages venv of Debian's python3, plus torch from pip.
#
#   jobs/ci/parallel_h5py.sh VENV        then: mpiexec.openmpi -n 2 VENV/bin/python ...
#
# Installs the Debian packages with apt when they are missing and this runs as root with
# apt-get; otherwise exits 3 with a message. Debian's h5py picks its MPI build only when it
# runs under an MPI launcher (OMPI_COMM_WORLD_SIZE set) or H5PY_ALWAYS_USE_MPI is set.
# Other machines: build h5py with HDF5_MPI=ON against a parallel HDF5 (README.md).
set -euo pipefail

venv=${1:?usage: parallel_h5py.sh VENV}
python=/usr/bin/python3
pkgs=(python3-h5py-mpi python3-mpi4py python3-venv openmpi-bin)
say() { echo "parallel_h5py: $*" >&2; }

missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "missing Debian packages ${missing[*]} and this is not root with apt-get"
        exit 3
    fi
    say "installing ${missing[*]} with apt-get"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
# Debian's numpy stays (h5py and mpi4py were built against it); torch comes from pip.
"$venv/bin/python" -c "import torch" 2>/dev/null || \
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==${ZEROMPI_TORCH:-2.13.0}" >&2
H5PY_ALWAYS_USE_MPI=1 "$venv/bin/python" -c "import h5py, mpi4py, torch; assert h5py.get_config().mpi" >&2
say "ready: $venv (h5py with MPI, Open MPI's mpiexec.openmpi)"
