"""Real DeepSpeed for the tests that compare against it.

DeepSpeed is never a zerompi dependency: the test extra installs it into the test venv
(``pip install -e '.[test]'``, as jobs/setup.sh does), and the tests run it on the CPU
(``DS_ACCELERATOR=cpu``) in their own processes. Where the test venv lacks it, the peers venv of
the benchmarks (benchmarks/.venv-peers, benchmarks/setup_peers.sh) is used when it exists. Outside
CI neither skips the test; under CI it fails (tests/components.py).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from zerompi.tools.mpirun import mpi_env

from .components import ran, unavailable

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / ".venv-peers" / "bin" / "python"
COMPONENT = "DeepSpeed"
_CHECK = "import deepspeed, torch; print('deepspeed', deepspeed.__version__, '| torch', torch.__version__)"
# Every op the tests' DeepSpeed runs load (FusedAdam, and the shared-memory comm of gloo on the CPU), built
# or found by one process in the environment the ranks get: two ranks loading an op nobody built yet
# both compile it, and a clean CI run once aborted right after that.
_BUILD = """
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
"""


@functools.lru_cache(maxsize=None)  # a failure raises, so only a python that works is kept
def deepspeed_python() -> Path:
    """A python with DeepSpeed importable on the CPU: this venv's, else the peers venv's."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    errors = []
    for python in (Path(sys.executable), PEERS):
        if not python.exists():
            errors.append(f"{python}: missing")
            continue
        proc = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode == 0:
            where = "test venv" if python == Path(sys.executable) else "benchmarks/.venv-peers"
            built = subprocess.run([str(python), "-c", _BUILD], capture_output=True, text=True, timeout=1200,
                                   env={**mpi_env(ROOT), "DS_ACCELERATOR": "cpu"})
            if built.returncode != 0:
                unavailable(COMPONENT, f"{python}: building DeepSpeed's CPU ops failed: {built.stderr[-2000:]}")
            ran(COMPONENT, f"{proc.stdout.strip().splitlines()[-1]} ({where}; its CPU ops built)")
            return python
        errors.append(f"{python}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    unavailable(COMPONENT, "import deepspeed failed (pip install -e '.[test]'): " + "; ".join(errors))
