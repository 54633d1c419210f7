"""reproducible=True's gradient norm: each chunk's sum of squares added as a fixed tree (GradShard.chunk_sq),
judged bit for bit against the tree written out here in plain Python floats (IEEE doubles)."""
from __future__ import annotations

import torch

from zerompi.offload import Resident
from zerompi.shard.grads import NORM_CHUNK, GradShard


def _tree(values: list[float]) -> float:
    """Halves added element-wise (the first half's i-th with the second half's i-th) until one is left."""
    while len(values) > 1:
        half = len(values) // 2
        values = [values[i] + values[i + half] for i in range(half)]
    return values[0]


def _sequential(values: list[float]) -> float:
    total = 0.0
    for v in values:
        total += v
    return total


def test_chunk_sums_are_the_pairwise_tree_bit_for_bit():
    """Guards: the tree replaced by ``sums.sum(dim=1)`` (torch's own reduction order, which the CPU's
    reproducible runs cannot tell apart but CUDA's changes with the shard's length)."""
    chunks = 16
    g = torch.Generator().manual_seed(0)
    # magnitudes over 2^-20..2^20, so that the squares' sum rounds differently in every order
    grad = torch.randn(chunks * NORM_CHUNK, generator=g) * 2.0 ** torch.randint(-20, 21, (chunks * NORM_CHUNK,), generator=g)
    shard = GradShard(Resident(torch.zeros(grad.numel())), grad.numel(), torch.device("cpu"))
    shard.write(grad, accumulate=False)
    got = shard.chunk_sq()

    squares = [[float(x) * float(x) for x in grad[c * NORM_CHUNK:(c + 1) * NORM_CHUNK].tolist()]
               for c in range(chunks)]  # an fp32 square is exact in a double
    want = [_tree(s) for s in squares]
    assert got.dtype == torch.float64 and got.tolist() == want
    # the input tells the orders apart: torch's sum and a sequential sum each differ from the tree somewhere
    flat = grad.double().square().view(chunks, NORM_CHUNK).sum(dim=1).tolist()
    assert flat != want and [_sequential(s) for s in squares] != want
