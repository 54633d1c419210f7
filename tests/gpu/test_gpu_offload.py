"""Offload from GPU compute (workers/gpu_offload.py), two ranks sharing one GPU: master weights
and optimizer state on the GPU ('none'), in pinned host memory ('cpu') or in swap files ('nvme').

The update runs on the GPU without offload and on the CPU with it, so 'none'
and the offloaded modes agree within the parity bound (tests/mpi/tolerance.py),
not bitwise; 'cpu' and 'nvme' run the same CPU update and must agree bitwise.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from ..mpi.tolerance import check_parity
from .support import DEVICE, Jobs, requires_cuda, run_json

pytestmark = requires_cuda

MODES = ("none", "cpu", "nvme")
# workers/gpu_offload.py's combinations
KEYS = [f"stage{s}-{d}-accum1" for s in (1, 2, 3) for d in ("fp32", "bf16")] + \
       ["stage2-fp32-accum2", "stage3-fp32-accum2"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    def start(mode):
        base = tmp_path_factory.mktemp(f"gpu-offload-{mode}")
        swap = base / "swap"
        swap.mkdir()
        rows = run_json(2, "gpu_offload.py", base / "rows.json", "--mode", mode, "--swap", str(swap),
                        "--params", str(base / "params.npz"))
        return dict(rows={r["key"]: r for r in rows}, params=dict(np.load(base / "params.npz")),
                    swap_after_exit=sorted(os.listdir(swap)))
    return Jobs(start)


def row(jobs, mode: str, key: str) -> dict:
    r = jobs(mode)["rows"][key]
    assert "error" not in r, f"{mode} {key}: {r['error']}"
    return r


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", KEYS)
def test_parity(jobs, mode, key):
    check_parity(row(jobs, mode, key))


@pytest.mark.parametrize("key", KEYS)
def test_cpu_and_nvme_offload_are_bitwise_identical(jobs, key):
    row(jobs, "cpu", key), row(jobs, "nvme", key)
    cpu, nvme = jobs("cpu")["params"], jobs("nvme")["params"]
    names = [n for n in cpu if n.startswith(f"{key}/")]
    assert names and all(np.array_equal(cpu[n], nvme[n]) for n in names), key


@pytest.mark.parametrize("mode", MODES)
def test_where_state_lives(jobs, mode):
    host = DEVICE if mode == "none" else "cpu"
    for key in KEYS:
        r = row(jobs, mode, key)
        assert (r["params"], r["masters"], r["state"]) == ([DEVICE], [host], [host]), r


def test_cpu_offload_host_copies_are_pinned(jobs):
    if DEVICE != "cuda":
        pytest.skip("dry run on the CPU: no pinned memory without CUDA")
    for key in KEYS:
        r = row(jobs, "cpu", key)
        assert all(r["pinned"].values()), (key, r["pinned"])


def test_nvme_offload_swaps_and_cleans_up(jobs):
    for key in KEYS:
        r = row(jobs, "nvme", key)
        assert r["swapped"] > 0, r
    assert jobs("nvme")["swap_after_exit"] == []
