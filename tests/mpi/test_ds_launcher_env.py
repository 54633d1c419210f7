"""``import zerompi.deepspeed`` under plain ``mpiexec -n 2`` (MPICH's Hydra) gives each rank the
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` DeepSpeed's launcher would have set,
from Hydra's own variables (workers/ds_launcher_env.py); names already set are kept."""
from __future__ import annotations

import json
import subprocess

from .launcher import ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec, rank_python

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def run(tmp_path, **given: str) -> list[dict]:
    env = {k: v for k, v in mpi_env().items() if k not in NAMES}  # as a shell with none of them set
    out = tmp_path / "rows.json"
    cmd = [*mpiexec(), "-n", "2", *rank_python(), "-m", "mpi4py", str(WORKERS / "ds_launcher_env.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env={**env, **given}, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_each_rank_gets_its_names_from_mpiexec(tmp_path):
    rows = run(tmp_path)
    assert [r["mpi"] for r in rows] == [[0, 2], [1, 2]]
    assert [r["env"] for r in rows] == [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2"}
        for r in (0, 1)]


def test_names_already_set_are_kept(tmp_path):
    rows = run(tmp_path, RANK="7")  # mpiexec passes it on to every rank
    assert [r["env"]["RANK"] for r in rows] == ["7", "7"] and [r["env"]["LOCAL_RANK"] for r in rows] == ["0", "1"]


def test_the_runner_sets_master_addr_and_port_so_a_frameworks_gloo_group_starts(tmp_path):
    """``python -m zerompi.deepspeed script.py`` on 2 ranks: the script's own gloo group (env://, as Accelerate's
    use_cpu and the Trainer's --use_cpu build one) starts with no MASTER_ADDR or MASTER_PORT from the user:
    the runner set them from MPI, the same on every rank (DeepSpeed's MPI discovery does so too).
    Break: drop the two setdefaults, and torch stops at 'MASTER_ADDR expected, but not set'."""
    env = {k: v for k, v in mpi_env().items() if k not in (*NAMES, "MASTER_ADDR", "MASTER_PORT")}
    out = tmp_path / "gloo.json"
    cmd = [*mpiexec(), "-n", "2", *rank_python(), "-m", "zerompi.deepspeed", str(WORKERS / "runner_gloo.py"),
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads(out.read_text())
    assert got["sum"] == 3.0
    assert got["rows"][0]["MASTER_ADDR"] == "127.0.0.1" and int(got["rows"][0]["MASTER_PORT"]) > 0
    assert got["rows"][0] == {**got["rows"][1], "RANK": "0"} and got["rows"][1]["RANK"] == "1"
