"""Offload of shards and optimizer state out of device and host memory.

:class:`TierPlan` (tiers.py) reads the offload settings once and hands each new
bucket the tier of each of its shards (:class:`Resident` or :class:`Swapped`)
and the optimizer its store (residency.py: :class:`InMemory` or
:class:`NVMeResidency`). :class:`NVMeSwapper` keeps flat CPU tensors in one
file per rank and moves them with asynchronous, page-aligned block I/O
(blockio/direct.py); tensors from :func:`aligned_empty` skip the staging copy.
:class:`HostMemory` decides once what an engine's freed host memory does.
"""
from zerompi.blockio.aligned import aligned_empty
from zerompi.blockio.memory import return_freed_memory
from zerompi.offload.nvme import NVMeSwapper, SwapConfig
from zerompi.offload.residency import InMemory, NVMeResidency
from zerompi.offload.tiers import Resident, ShardTier, Swapped, TierPlan

__all__ = ["HostMemory", "InMemory", "NVMeResidency", "NVMeSwapper", "Resident", "ShardTier", "SwapConfig",
           "Swapped", "TierPlan", "aligned_empty", "open_swapper", "return_freed_memory", "reuse_bytes"]


class HostMemory:
    """What an engine's freed host memory does, decided once from its settings.

    Freed blocks of 1 MiB or more go back to the OS at once (``return_freed_memory``) when the
    config's ``return_freed_memory`` asks for it, and always when anything is offloaded to NVMe:
    shards then stream through memory block after block, and what is freed must leave the
    process. glibc's setting is process-wide, so a second engine can only add to it.

    ``policy`` is the config's :class:`~zerompi.config.sections.offload.OffloadPolicy`."""

    def __init__(self, policy):
        self.returns_freed = bool(policy.return_freed_memory or policy.uses_nvme) and return_freed_memory()
        """Whether freed blocks now leave the process (False also where the C library or the
        environment's ``MALLOC_MMAP_THRESHOLD_`` decided otherwise)."""


def open_swapper(policy, rank: int) -> NVMeSwapper | None:
    """This rank's swap file when the offload settings send anything to 'nvme'.

    ``policy`` is the config's :class:`~zerompi.config.sections.offload.OffloadPolicy`."""
    if not policy.uses_nvme:
        return None
    return NVMeSwapper(policy.nvme_path, rank, SwapConfig(
        block_bytes=policy.block_kib * 1024, threads=policy.threads, buffers=policy.buffers,
        verify=policy.verify))


REUSE_FP32_SHARDS = 12  # the step streams a bucket's master, two Adam moments and its gradient, and
                        # the next buckets' reads run ahead: a dozen fp32 shards of the largest size
REUSE_GATHERS = 4       # gathered parameter buffers of the units in flight (the current one, prefetched ones)


def reuse_bytes(buckets) -> int:
    """How much released host memory an engine that swaps keeps for reuse: a dozen of its largest
    fp32 shards and four of its largest gathered buffers (aligned.py's Reuse)."""
    return (REUSE_FP32_SHARDS * 4 * max(b.layout.shard_numel for b in buckets)
            + REUSE_GATHERS * max(b.param_full.nbytes for b in buckets))
