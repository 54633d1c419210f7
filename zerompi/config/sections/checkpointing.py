"""The checkpointing section: how checkpoints are laid out and written.

``cfg.checkpointing`` is the policy built from these keys once (zerompi.checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import CheckpointLayout


@dataclass(frozen=True)
class CheckpointPolicy:
    """How checkpoints are laid out and written."""

    layout: CheckpointLayout
    """Per-rank files, one shared file, per-node files, or 'auto'."""
    verify: bool
    """Read every checksum back from the disk after the fsync."""
    direct_io: bool
    """Whole pages through O_DIRECT where the filesystem allows it."""
    align_kib: int
    """Large datasets start on a multiple of this many KiB (the stripe size)."""
    async_copy: bool
    """A background save writes from a host copy taken first (else from the live shards)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointKeys:
    """The checkpointing section's keys (ZeroConfig's fields) and its policy."""

    checkpoint_layout: CheckpointLayout = key(CheckpointLayout.AUTO, checks.of(CheckpointLayout), policy="layout")
    """'per_rank': save_checkpoint writes one HDF5 file per rank plus index.h5; 'shared': one
    shards.h5 written collectively through h5py's mpio driver (needs h5py built with MPI);
    'per_node': one nodeNNNNN.h5 per node (nodes from MPI, or ranks_per_node), written by the
    node's first rank after gathering its node's shards: files per checkpoint divided by the ranks
    per node, for parallel filesystems whose metadata servers one file per rank overloads;
    'auto': shared when h5py has MPI, else per_rank. All load at any world size."""
    checkpoint_verify: bool = key(False, checks.boolean, policy="verify")
    """After each rank file of a checkpoint is written and fsynced, drop it from the page cache and
    read every checksum back from the disk (doubles the save's I/O). Off: the checksums are computed
    from memory as the data is written, and every load checks them."""
    checkpoint_direct_io: bool = key(True, checks.boolean, policy="direct_io")
    """Write checkpoint data with O_DIRECT (whole pages; a block's ragged tail and HDF5's metadata
    through the page cache), which spends a fifth of the CPU of buffered writes and leaves the page
    cache to training: what lets an asynchronous save run beside the steps. Filesystems that refuse
    O_DIRECT get buffered writes anyway; False: buffered writes everywhere (the same bytes)."""
    checkpoint_align_kib: int = key(1024, checks.align_kib, policy="align_kib")
    """Checkpoint datasets of this many KiB or more start on a multiple of it in their file: set it to
    the stripe size on Lustre (1 MiB by default) or the block size on GPFS. A power of two, 4..1048576."""
    checkpoint_async_copy: bool = key(False, checks.boolean, policy="async_copy")
    """What ``save_checkpoint(async_save=True)`` writes from: False, the live shards, each held
    unchanged until written (no extra memory; an optimizer step that reaches a bucket not yet written
    waits for it); True, a copy in host memory taken first (one more copy of this rank's master and
    optimizer state until the save ends; steps wait only for the copy). Under NVMe offload the save
    reads the swap file instead, one bucket at a time, either way."""

    @cached_property
    def checkpointing(self) -> CheckpointPolicy:
        """How checkpoints are laid out and written."""
        return build(CheckpointPolicy, self, CheckpointKeys)
