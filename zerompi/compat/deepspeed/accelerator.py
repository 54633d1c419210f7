"""``deepspeed.accelerator.get_accelerator()``: the device questions a DeepSpeed script asks, for CPU and CUDA.

The accelerator is CUDA when torch sees a GPU (the engine's ``device: auto`` picks it too) and
the CPU otherwise; ``DS_ACCELERATOR=cpu`` or ``cuda`` chooses, as in DeepSpeed. On the CPU the
answers are DeepSpeed's CPU accelerator's: one "device" per rank of the node (``LOCAL_SIZE``,
which ``init_distributed`` sets), memory as this process's resident set.
``communication_backend_name()`` names the torch.distributed backend DeepSpeed would use
(scripts pass it to ``init_distributed``, which ignores it: MPI connects the ranks).
"""
from __future__ import annotations

import os
import resource

import torch

from zerompi.errors import UsageError

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator"]


class Accelerator:
    """What both accelerators answer alike."""

    _name = ""
    _backend = ""

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        return self._backend

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def is_bf16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def range_push(self, msg: str) -> None:
        """Profiler ranges: nothing to mark here."""

    def range_pop(self) -> None:
        """Profiler ranges: nothing to mark here."""

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def __repr__(self) -> str:
        return f"<zerompi {self._name} accelerator>"


class CpuAccelerator(Accelerator):
    """One CPU "device" per rank of the node, as DeepSpeed's CPU accelerator counts them."""

    _name = "cpu"
    _backend = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed's CPU accelerator never names an index

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def device_count(self) -> int:
        return max(1, int(os.environ.get("LOCAL_SIZE", 1)))

    def set_device(self, device_index: int) -> None:
        """One CPU: nothing to choose."""

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is done when the call returns."""

    def empty_cache(self) -> None:
        """No caching allocator on the CPU."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """This process's resident set, in bytes."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """This process's peak resident set, in bytes."""
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, self.memory_allocated())

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """The kernel's peak cannot be reset."""

    reset_peak_memory_stats = reset_max_memory_allocated

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_fp16_supported(self) -> bool:
        return False  # the engine trains fp16 on the GPU only (DeepSpeed asks oneDNN here)


class CudaAccelerator(Accelerator):
    """torch.cuda's answers."""

    _name = "cuda"
    _backend = "nccl"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_allocated

    def total_memory(self, device_index: int | None = None) -> int:
        index = device_index if device_index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def Stream(self, *args, **kwargs):  # noqa: N802  (DeepSpeed's spelling)
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)


_chosen: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """This process's accelerator: ``DS_ACCELERATOR`` if set, else CUDA when available, else the CPU."""
    global _chosen
    if _chosen is None:
        name = os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        if name not in ("cpu", "cuda"):
            raise UsageError(f"DS_ACCELERATOR={name!r}: zerompi runs on 'cpu' or 'cuda'")
        _chosen = CudaAccelerator() if name == "cuda" else CpuAccelerator()
    return _chosen


def set_accelerator(accelerator: Accelerator) -> None:
    """Choose the accelerator (DeepSpeed's ``set_accelerator``)."""
    global _chosen
    _chosen = accelerator
