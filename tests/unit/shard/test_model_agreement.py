"""Every rank builds the same model (shard/agreement.py's check_models_agree): a rank whose parameters or
buffers differ in name, shape, dtype or trainability is named on every rank, with at most three entries
of what only it has and of what only rank 0 has; the same model costs one all-gather of digests."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerompi.comm.local import run_ranks
from zerompi.errors import ModelMismatchError
from zerompi.shard.agreement import check_models_agree


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 5))


def _resized(m):
    m[2] = nn.Linear(8, 6)


def _deeper(m):  # four more parameters than rank 0's: the message lists three
    m.append(nn.Linear(5, 4))
    m.append(nn.Linear(4, 2))


CHANGES = {  # how the last rank's model differs from the others'
    "shape": _resized,
    "dtype": lambda m: m[2].double(),
    "trainability": lambda m: m[0].weight.requires_grad_(False),
    "buffer": lambda m: m.register_buffer("seen", torch.zeros(3)),
    "more parameters": _deeper,
}


def _entries(m: nn.Module) -> set[tuple]:
    """The model as the message names it: kind, name, shape, dtype, trainable (a buffer never is)."""
    return ({("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters()}
            | {("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in m.named_buffers()})


@pytest.mark.parametrize("odd", [2, 0], ids=["last-rank", "rank-0"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_rank_with_another_model_is_named_on_every_rank(change, odd):
    """Three ranks, one (the last, or rank 0 itself) with a changed model: every rank raises the same error,
    naming each rank whose model is not rank 0's with what only it has and what only rank 0 has."""
    def build(rank):
        m = _mlp()
        if rank == odd:
            CHANGES[change](m)
        return m

    def rank(group):
        with pytest.raises(ModelMismatchError) as e:
            check_models_agree(build(group.rank), group)
        return str(e.value)
    messages = run_ranks(3, rank)
    parts, first = [], _entries(build(0))
    for r in range(3):
        ours = _entries(build(r))
        extra, missing = sorted(ours - first, key=str), sorted(first - ours, key=str)
        if extra or missing:
            parts.append(f"rank {r}: model differs from rank 0's: only here {extra[:3]}, only on rank 0 {missing[:3]}")
            assert change != "more parameters" or len(extra + missing) == 4  # three of them are named
    assert len(parts) == (1 if odd else 2) and messages == ["; ".join(parts)] * 3


class _Counted:
    """A group that counts its all-gathers."""

    def __init__(self, group):
        self.group, self.gathers = group, 0

    def allgather_object(self, obj):
        self.gathers += 1
        return self.group.allgather_object(obj)

    def __getattr__(self, name):
        return getattr(self.group, name)


def test_the_same_model_passes_in_one_gather():
    def rank(group):
        counted = _Counted(group)
        check_models_agree(_mlp(), counted)
        return counted.gathers
    assert run_ranks(3, rank) == [1, 1, 1]
