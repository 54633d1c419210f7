"""The runtime section: the seed, the device, CPU threads and whether MPI takes device buffers.

``cfg.runtime`` is the policy built from these keys once (entry.py and the engine's start)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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

    seed: int = 0
    """Random seed, >= 0."""
    cpu_threads: int | None = None
    """Torch threads per rank on CPU, >= 1; None gives each rank its share of the cores."""
    device: Device = Device.AUTO
    """'auto', 'cpu' or 'cuda'."""
    cuda_aware_mpi: CudaAware = CudaAware.AUTO
    """Device buffers straight to MPI: 'auto' (when torch.cuda and the MPI report support), 'on' or 'off'."""

    @cached_property
    def runtime(self) -> RuntimePolicy:
        """Seed, device, threads and CUDA-aware MPI."""
        return RuntimePolicy(self.seed, self.cpu_threads, self.device, self.cuda_aware_mpi)
