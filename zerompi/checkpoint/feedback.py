"""Error-feedback residuals in checkpoints: per-rank data, restored only where it still means something.

A rank's residual (shard/compression.py's GradCodes) is what quantising *its*
local gradients dropped; it belongs to that rank and to the bucket layout it was
computed in, not to any shard of the model. Each writing rank saves its
residual of every bucket whole (``b<i>/feedback``, fp32, the bucket's padded
size) in its own file. A load restores them only into the same ranks of a job
with the same world size, hierarchy and bucket layout; anywhere else they
cannot be resharded into anything meaningful, so every rank's residual starts
from zero and rank 0 logs a note saying why.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from zerompi.checkpoint import schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.snapshot import ShardView
from zerompi.log import get_logger, log_rank0
from zerompi.state.declared import HeldResiduals

logger = get_logger(__name__)
FP32 = "<f4"




def parts(residuals: HeldResiduals) -> Iterator[tuple[str, np.ndarray]]:
    """(dataset name, data) of this rank's residuals, as the writer saves them."""
    for index, residual in residuals:
        yield schema.feedback(index), residual.detach().cpu().numpy()


def _why_not(view: ShardView, index: CheckpointIndex) -> str | None:
    """Why this job cannot take the checkpoint's residuals back (None: it can)."""
    if index.world_size != view.group.size:
        return f"written by {index.world_size} ranks, loaded by {view.group.size}"
    saved = (index.config.get("hierarchy"), index.config.get("ranks_per_node"))
    if saved != (view.config.topology.hierarchy, view.config.topology.ranks_per_node):
        return f"written with hierarchy/ranks_per_node {saved}"
    ours = {s.layout.index: s.layout for s in view.shards}
    for b in index.buckets:
        lay = ours.get(b["index"])
        if lay is None or b["padded_numel"] != lay.padded_numel or \
                [tuple(x) for x in b["slots"]] != [(s.fqn, s.offset, s.numel) for s in lay.slots]:
            return "written with another bucket layout"
    if not view.writes:
        return "this rank's node did not write (hsdp replicas)"
    return None


def read(view: ShardView, residuals: HeldResiduals, index: CheckpointIndex, files,
         directory: Path) -> dict[int, np.ndarray] | None:
    """This rank's saved residuals, verified, when they can be restored here; else None (and a note)."""
    if not residuals:
        return None
    why = _why_not(view, index)
    rank = view.group.rank
    if why is None and not all(files.has(rank, schema.feedback(i)) for i, _ in residuals):
        why = "it holds none (written without grad_error_feedback)"
    if why is not None:
        log_rank0(logger, logging.INFO, "%s: error-feedback residuals not restored (%s); they start from zero",
                  directory, why)
        return None
    return {i: schema.read_array(files.dataset(rank, schema.feedback(i), t.numel(), FP32))
            for i, t in residuals}


def restore(residuals: HeldResiduals, saved: dict[int, np.ndarray] | None) -> None:
    """Overwrite this engine's residuals with the checkpoint's, or start them from zero."""
    for i, residual in residuals:
        if saved is None:
            residual.zero_()
        else:
            residual.copy_(torch.from_numpy(saved[i]))
