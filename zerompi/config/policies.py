"""Grouped, read-only views of a ZeroConfig's flat fields: one policy per concern.

``cfg.optimization``, ``cfg.lr_policy``, ``cfg.precision``, ``cfg.offload``,
``cfg.overlap``, ``cfg.topology``, ``cfg.reliability`` and ``cfg.compression`` build these from fields ``__post_init__`` has already
checked, so a policy holds parsed values (enum members, floats, ints) and does
no validation of its own. The flat fields stay the config's spelling; a policy
is what a component takes, so it sees only the settings it uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerompi.config import checks
from zerompi.config.choices import (CheckpointLayout, DType, GradQuant, Hierarchy, NonFinite, Offload, Progress, Schedule,
                                    UpdateSchedule, WeightQuant)


@dataclass(frozen=True)
class OptimizerPolicy:
    """The inner optimizer and its update: what ZeroOptimizer (and a reference optimizer) is built from."""

    optimizer: Any
    """'adamw', 'adam', 'sgd', an Optimizer subclass or a dotted path to one (checked)."""
    kwargs: dict
    """Extra constructor arguments (optimizer_kwargs)."""
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    momentum: float
    clip_grad_norm: float | None
    """Clip the global gradient norm to this (None: no clipping)."""
    nonfinite: NonFinite
    """A NaN/Inf gradient in fp32/bf16: raise or skip the step (fp16 always skips)."""
    deterministic: bool = False
    """reproducible=True: the for-loop kernel, which computes an element the same way wherever
    shard boundaries fall (a fused or multi-tensor kernel treats a tensor's last elements apart)."""

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim.Optimizer subclass that ``optimizer`` names."""
        return checks.optimizer_class("optimizer", self.optimizer)


@dataclass(frozen=True)
class CheckpointPolicy:
    """How checkpoints are laid out and written."""

    layout: CheckpointLayout
    """Per-rank files, one shared file, or 'auto'."""
    verify: bool
    """Read every checksum back from the disk after the fsync."""
    direct_io: bool
    """Whole pages through O_DIRECT where the filesystem allows it."""
    align_kib: int
    """Large datasets start on a multiple of this many KiB (the stripe size)."""
    async_copy: bool
    """A background save writes from a host copy taken first (else from the live shards)."""


@dataclass(frozen=True)
class LrSchedulePolicy:
    """The built-in learning-rate schedule (optim/schedules.py)."""

    schedule: Schedule
    lr: float
    warmup_steps: int
    total_steps: int | None
    min_lr: float


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype and fp16 loss scaling."""

    dtype: DType
    """Parameter/gradient compute dtype; master weights are fp32."""
    loss_scale: float
    """fp16: 0 selects dynamic loss scaling, > 0 is a static scale."""
    initial_scale_power: int
    """Dynamic loss scaling starts at 2**initial_scale_power."""
    loss_scale_window: int
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int
    """Overflows tolerated before the dynamic scale halves."""
    min_loss_scale: float
    """Floor of the dynamic loss scale."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch.dtype."""
        return self.dtype.torch

    @property
    def scales_loss(self) -> bool:
        """fp16 needs a loss scaler; fp32 and bf16 do not."""
        return self.dtype is DType.FP16

    @property
    def dynamic_scale(self) -> bool:
        """fp16 with a scale that adapts to overflows (loss_scale == 0)."""
        return self.scales_loss and self.loss_scale == 0


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


@dataclass(frozen=True)
class OverlapPolicy:
    """How communication overlaps computation."""

    grad_reduce: bool
    """Start each bucket's gradient reduce-scatter non-blocking as soon as backward fills it."""
    prefetch_units: int
    """Stage 3: gather units gathered ahead, non-blocking (0 = on demand)."""
    progress: Progress
    """How non-blocking collectives progress while Python computes."""
    update: UpdateSchedule = UpdateSchedule.AFTER_BACKWARD
    """When buckets are updated: in ``step()``, or during the backward that ends a window."""


@dataclass(frozen=True)
class TopologyPolicy:
    """How ranks are grouped for sharding."""

    hierarchy: Hierarchy
    """Flat, hsdp (shard in a node, replicate across) or hpz (secondary copy per node)."""
    ranks_per_node: int | None
    """Ranks per node; None takes nodes from MPI (shared memory)."""

    @property
    def is_flat(self) -> bool:
        """One shard group over all ranks."""
        return self.hierarchy is Hierarchy.FLAT


@dataclass(frozen=True)
class ReliabilityPolicy:
    """What happens when communication goes wrong (a non-finite gradient: OptimizerPolicy.nonfinite)."""

    debug_collectives: bool
    """Check before every collective that all ranks are at the same one."""
    collective_timeout: float | None
    """Seconds a rank may wait in one collective before the watchdog aborts; overrides hang_floor."""
    abort_on_exception: bool
    """An uncaught exception on one rank calls MPI_Abort instead of hanging the others."""
    hang_floor: float | None
    """Least seconds of the automatic hang deadline (max with 3 median steps); None: off."""
    hang_dir: str | None
    """Where ranks write their records on a hang abort; None: a temporary directory per job."""


@dataclass(frozen=True)
class CompressionPolicy:
    """Which collectives travel as block-wise integer codes (comm/codec.py)."""

    weights: WeightQuant
    """Parameter all-gathers: none or int8."""
    grads: GradQuant
    """Gradient reduce-scatters: none, int8 or int4."""
    block: int
    """Values per fp32 scale."""
    error_feedback: bool
    """Carry each rank's gradient quantisation error to its next reduction."""

    @property
    def active(self) -> bool:
        """Any collective is quantized."""
        return self.weights.bits is not None or self.grads.bits is not None
