"""The offload section: where master weights, optimizer state and parameter shards live between uses,
the NVMe swap settings, and what freed host memory does.

``cfg.offload`` is the policy built from these keys once (zerompi.offload)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import Offload


@dataclass(frozen=True)
class OffloadPolicy:
    """Where master weights, optimizer state and parameter shards live between uses."""

    optimizer: Offload
    """Stages 1-3: home of fp32 master weights and optimizer state."""
    params: Offload
    """Stage 3: home of the parameter shards between gathers."""
    nvme_path: str | None
    """Directory for the per-rank swap files; set whenever a tier is NVME."""
    pin_memory: bool
    """Pin host buffers used for offload (when a GPU is present)."""
    block_kib: int
    """KiB per swap I/O request."""
    threads: int
    """Swap I/O threads (requests in flight)."""
    buffers: int
    """Page-aligned staging buffers of block_kib each."""
    verify: bool
    """CRC-32 of every swapped block, checked when read back."""
    return_freed_memory: bool = False
    """Host blocks of 1 MiB or more go back to the OS when freed (always under NVMe offload)."""

    @property
    def uses_nvme(self) -> bool:
        """Either tier swaps to NVMe."""
        return Offload.NVME in (self.optimizer, self.params)

    @property
    def uses_cpu(self) -> bool:
        """Either tier lives in host memory."""
        return Offload.CPU in (self.optimizer, self.params)

    @property
    def active(self) -> bool:
        """Anything is offloaded at all."""
        return self.optimizer is not Offload.NONE or self.params is not Offload.NONE


@dataclass(frozen=True, kw_only=True)
class OffloadKeys:
    """The offload section's keys (ZeroConfig's fields) and its policy."""

    offload_optimizer: Offload = key(Offload.NONE, checks.of(Offload), policy="optimizer",
                                     spelled={"DeepSpeed": "zero_optimization.offload_optimizer.device"})
    """Stages 1-3: where fp32 master weights and optimizer state live between steps:
    'none' (with the parameters), 'cpu' (host memory; the update runs on the CPU) or
    'nvme' (swap files under nvme_path, streamed in bucket by bucket during the step)."""
    offload_params: Offload = key(Offload.NONE, checks.of(Offload), policy="params",
                                  spelled={"DeepSpeed": "zero_optimization.offload_param.device"})
    """Stage 3: where the parameter shards live between gathers: 'none', 'cpu' or 'nvme'."""
    nvme_path: str | None = key(None, checks.maybe(checks.path, "no NVMe directory"))
    """Directory for the per-rank swap files of 'nvme' offload (a local disk)."""
    pin_memory: bool = key(True, checks.boolean)
    """Pin host buffers used for offload (when a GPU is present)."""
    nvme_block_kib: int = key(8192, checks.block_kib, policy="block_kib")
    """KiB per swap I/O request, a multiple of 4 in 4..262144."""
    nvme_threads: int = key(4, checks.whole(1, 64), policy="threads")
    """Swap I/O threads (requests in flight), 1..64."""
    nvme_buffers: int = key(8, checks.whole(1, 1024), policy="buffers")
    """Page-aligned staging buffers of nvme_block_kib each: the bound on swap staging memory, 1..1024."""
    nvme_verify: bool = key(True, checks.boolean, policy="verify")
    """CRC-32 of every swapped block, checked when it is read back."""
    return_freed_memory: bool = key(False, checks.boolean)
    """Fix glibc's mmap threshold at 1 MiB, so host blocks of 1 MiB or more go back to the OS when
    freed. glibc's default raises the threshold as large blocks are freed and keeps later ones on its
    heap for reuse: faster (no page faults), but stage 3's gathered units then leave the resident set
    higher than what is live. True trades time for peak host memory (LoRA at stage 3: 24% less peak
    per rank, steps 1.27x slower, benchmarks/results/lora_steps.md); NVMe offload always does it.
    Process-wide; a ``MALLOC_MMAP_THRESHOLD_`` in the environment wins."""

    @cached_property
    def offload(self) -> OffloadPolicy:
        """Offload tiers, the NVMe swap settings and freed host memory."""
        return build(OffloadPolicy, self, OffloadKeys)
