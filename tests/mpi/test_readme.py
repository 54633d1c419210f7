"""README.md's complete example, as a user runs it: ``mpiexec -n 2 python -m mpi4py train.py`` in a fresh
directory trains 100 steps and saves at 50 and 100; run again from the step-50 checkpoint (``latest``
pointed back at it, as after a job killed between the saves) it resumes there and reaches the same
step-100 loss at 2 ranks, and resumes at 1 rank too (any world size)."""
from __future__ import annotations

import re
import subprocess

from .launcher import ROOT, TIMEOUT, mpi_env, mpiexec, rank_python

BLOCK = re.compile(r"<!-- runs in tests/mpi/test_readme.py -->\n```python\n(.*?)```", re.S)


def _run(n: int, cwd) -> str:
    cmd = [*mpiexec(), "-n", str(n), *rank_python(), "-m", "mpi4py", "train.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=mpi_env(), cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_the_readmes_example_trains_saves_and_resumes(tmp_path):
    (tmp_path / "train.py").write_text(BLOCK.search((ROOT / "README.md").read_text()).group(1))
    first = _run(2, tmp_path)
    saved = re.findall(r"step (\d+): loss ([\d.]+), saved", first)
    assert [s for s, _ in saved] == ["50", "100"], first
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step00000050", "step00000100"]
    (tmp_path / "ckpt" / "latest").write_text("step00000050")
    again = _run(2, tmp_path)
    assert "resumed at step 50" in again and re.findall(r"step (\d+): loss ([\d.]+), saved", again) == [saved[1]], again
    (tmp_path / "ckpt" / "latest").write_text("step00000050")
    one = _run(1, tmp_path)
    assert "resumed at step 50" in one and "step 100: loss" in one, one
