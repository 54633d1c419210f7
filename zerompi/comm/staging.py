"""Device tensors on their way to MPI: staged through pinned host memory, or not at all.

An MPI that is not CUDA-aware reads and writes host memory only, so each collective copies its device
tensors to pinned host buffers and the results back. A group of one rank skips MPI altogether
(mpi/group.py): its collectives are local copies on the current stream, the same bits MPI would give, with
no synchronisation and no trip through host memory (at one rank on a GPU the staging cost four times
DDP's step time: benchmarks/results/gpu-h200-np1.md).
"""
from __future__ import annotations

from typing import Callable

import torch

from zerompi.comm import shapes


def stage(tensors: tuple[torch.Tensor, ...], cuda_aware: bool) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Host-visible stand-ins for ``tensors`` and a function copying results back."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors), lambda: None
    torch.cuda.current_stream().synchronize()  # MPI must see finished kernels
    if cuda_aware:
        return list(tensors), lambda: None
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in tensors]

    def copy_back() -> None:
        for dev, host in zip(tensors, hosts):
            dev.copy_(host, non_blocking=False)
    return hosts, copy_back


def alone_copy(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    """One rank's all-gather or all-to-all: its own part is the whole (nothing to do in place)."""
    if src is not None:
        dst.copy_(src)


def alone_reduce_scatter(full: torch.Tensor) -> torch.Tensor:
    """One rank's reduce-scatter, as mpi/group.py's returns it: a new fp32 tensor (a 16-bit input summed over
    its one row in fp32, as the Alltoall path sums over ranks)."""
    if full.dtype in shapes.SUM_DTYPES:
        return full.to(torch.float32, copy=True)
    return full.view(1, -1).float().sum(dim=0)
