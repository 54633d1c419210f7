"""Stages 0-3 on CUDA tensors, two ranks sharing one GPU, against single-process PyTorch
(workers/gpu_parity.py): fp32 and bf16, accumulation and clipping, AdamW and SGD.

Judged as on the CPU (tests/mpi/tolerance.py): within ORDER_K times the order
noise, here measured by reordered reference runs on the same GPU, so the bound
follows the GPU's kernels. Both ways a collective meets MPI: ``cuda_aware_mpi='off'``
stages device buffers through pinned host memory; ``'on'`` hands device pointers to
MPI, and is skipped, with MPI's own answer, where the library reports no CUDA support.
"""
from __future__ import annotations

import itertools

import pytest

from ..mpi.matrix import collective_bytes, zero_volume
from ..mpi.tolerance import check_parity
from .support import DEVICE, requires_cuda, rows_by_cuda_aware

pytestmark = requires_cuda

SETTINGS = ("off", "on")
# (stage, dtype, (grad_accum_steps, clip_grad_norm), optimizer): workers/gpu_parity.py's loop
COMBOS = list(itertools.product(range(4), ("fp32", "bf16"), ((1, None), (2, 0.05)), ("adamw", "sgd")))


def combo_id(combo) -> str:
    stage, dtype, (accum, clip), opt = combo
    return f"stage{stage}-{dtype}-accum{accum}-{'clip' if clip else 'noclip'}-{opt}"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    get = rows_by_cuda_aware(tmp_path_factory, "gpu_parity.py")
    return lambda setting: {(r["stage"], r["dtype"], (r["accum"], r["clip"]), r["optimizer"]): r
                            for r in get(setting)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_parity(rows, setting, combo):
    check_parity(rows(setting)[combo])


@pytest.mark.parametrize("setting", SETTINGS)
def test_state_stays_on_the_gpu_and_mpi_gets_what_was_asked(rows, setting):
    for r in rows(setting).values():
        assert (r["params"], r["masters"], r["state"]) == ([DEVICE], [DEVICE], [DEVICE]), r
        assert r["cuda_aware"] is (setting == "on"), r


@pytest.mark.parametrize("setting", SETTINGS)
def test_bytes_match_zero_paper(rows, setting):
    # Staging through host memory or not moves the same bytes: the ZeRO paper's volumes.
    for r in rows(setting).values():
        assert collective_bytes(r) == zero_volume(r), (r["stage"], r["dtype"], r["accum"], r["bytes_sent"])
