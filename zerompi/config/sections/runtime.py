"""The runtime section: the seed, the device, CPU threads and whether MPI takes device buffers.

``cfg.runtime`` is the policy built from these keys once (entry.py and the engine's start)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import CudaAware, Device


@dataclass(frozen=True)
class RuntimePolicy:
    """Where and how a rank computes."""

    seed: int
    """Random seed of every rank (and of the micro-batches' dropout in the reproducible mode)."""
    cpu_threads: int | None
    """Torch threads per rank on CPU; None: each rank's share of the cores."""
    device: Device
    """auto, cpu or cuda."""
    cuda_aware_mpi: CudaAware
    """Device buffers straight to MPI: auto, on or off."""


@dataclass(frozen=True, kw_only=True)
class RuntimeKeys:
    """The runtime section's keys (ZeroConfig's fields) and its policy."""

    seed: int = key(0, checks.whole(0))
    """Random seed, >= 0."""
    cpu_threads: int | None = key(None, checks.maybe(checks.whole(1), "automatic"))
    """Torch threads per rank on CPU, >= 1; None gives each rank its share of the cores."""
    device: Device = key(Device.AUTO, checks.of(Device))
    """'auto', 'cpu' or 'cuda'."""
    cuda_aware_mpi: CudaAware = key(CudaAware.AUTO, checks.of(CudaAware))
    """Device buffers straight to MPI: 'auto' (when torch.cuda and the MPI report support), 'on' or 'off'."""

    @cached_property
    def runtime(self) -> RuntimePolicy:
        """Seed, device, threads and CUDA-aware MPI."""
        return build(RuntimePolicy, self, RuntimeKeys)
