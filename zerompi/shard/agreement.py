"""Every rank must build the same model: parameter names, shapes, dtypes and trainability agree.

A rank whose model differs (another config file, another code version) would shard and reduce
the wrong elements silently; one digest all-gather finds it, and a second gathers rank 0's
signature only to name the difference.
"""
from __future__ import annotations

import hashlib

from torch import nn

from zerompi.comm.group import ProcessGroup
from zerompi.errors import ModelMismatchError, all_ranks_ok


def _signature(module: nn.Module) -> list[tuple]:
    params = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad)
              for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return params + buffers


def check_models_agree(module: nn.Module, group: ProcessGroup) -> None:
    """Collective: every rank must hold the same parameter names, shapes and dtypes."""
    sig = _signature(module)
    digest = hashlib.sha256(repr(sig).encode()).hexdigest()
    digests = group.allgather_object(digest)
    if len(set(digests)) == 1:
        return
    reference = group.allgather_object(sig if group.rank == 0 else None)[0]
    problem = None
    if digest != digests[0]:
        ours, theirs = set(sig), set(reference)
        extra = sorted(ours - theirs, key=str)[:3]
        missing = sorted(theirs - ours, key=str)[:3]
        problem = f"model differs from rank 0's: only here {extra}, only on rank 0 {missing}"
    all_ranks_ok(group, problem, ModelMismatchError)
