"""Optimizers that see whole tensors on CUDA tensors (workers/gpu_whole.py): with reproducible=True, Muon +
AdamW and Adafactor at stages 0-3 on two ranks sharing one GPU train bitwise what the plain single-process
loop trains on the same GPU, as on the CPU (tests/unit/optim/test_whole.py). The owner-aligned buckets'
counted collectives (only each rank's live elements travel) meet device buffers both ways:
``cuda_aware_mpi='off'`` stages them through pinned host memory, ``'on'`` hands device pointers to MPI
(skipped, with MPI's own answer, where the library reports no CUDA support)."""
from __future__ import annotations

import pytest

from .support import DEVICE, requires_cuda, rows_by_cuda_aware

pytestmark = requires_cuda

SETTINGS = ("off", "on")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return rows_by_cuda_aware(tmp_path_factory, "gpu_whole.py")


@pytest.mark.parametrize("setting", SETTINGS)
def test_whole_tensor_optimizers_train_the_plain_loops_bits_on_the_gpu(rows, setting):
    got = rows(setting)
    assert len(got) == 8, got  # 2 modes x stages 0-3
    for r in got:
        assert r["device"] == DEVICE and r["differ"] == [], r
