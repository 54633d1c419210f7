"""Real DeepSpeed for the tests that compare against it: the peers venv, benchmarks/.venv-peers.

DeepSpeed is never a zerompi dependency; benchmarks/setup_peers.sh installs it (0.19.8, CPU)
into that venv. Outside CI a missing venv skips the test; under CI the fixture runs the setup
script once and fails the test when that does not work (tests/components.py).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .components import in_ci, ran, unavailable

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "benchmarks" / ".venv-peers"
PYTHON = VENV / "bin" / "python"
COMPONENT = "DeepSpeed (benchmarks/.venv-peers)"
_CHECK = "import deepspeed, torch; print('deepspeed', deepspeed.__version__, '| torch', torch.__version__)"


def deepspeed_python() -> Path:
    """The peers venv's python, with DeepSpeed importable on CPU (set up under CI when missing)."""
    if not PYTHON.exists():
        if not in_ci():
            unavailable(COMPONENT, f"{VENV.relative_to(ROOT)} is missing: run bash benchmarks/setup_peers.sh")
        proc = subprocess.run(["bash", "benchmarks/setup_peers.sh"], cwd=ROOT, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            unavailable(COMPONENT, f"benchmarks/setup_peers.sh exited {proc.returncode}: {proc.stderr[-2000:]}")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([str(PYTHON), "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        unavailable(COMPONENT, f"import deepspeed failed: {proc.stderr[-2000:]}")
    ran("DeepSpeed", proc.stdout.strip().splitlines()[-1])
    return PYTHON
