"""The closed choices of a :class:`~zerompi.config.ZeroConfig`, as enums parsed once.

Each member's value is the string (or, for :class:`Stage`, the int) a config
file spells, and a member compares and hashes equal to it: ``cfg.dtype == "fp16"``
and ``cfg.stage == 3`` hold, ``json.dumps`` writes the plain value. ``repr`` is the
plain value's too, so a message written as ``f"{key}={value!r}"`` reads
``dtype='fp16'`` whether ``value`` is the member or the string, and a config's
repr is the keyword call that builds it.
"""
from __future__ import annotations

from enum import IntEnum, StrEnum

import torch


class Choice(StrEnum):
    """A string choice; ``repr`` shows the plain value, as a config spells it."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The allowed values, in declaration order."""
        return tuple(m.value for m in cls)


class Stage(IntEnum):
    """What is sharded: 1 optimizer state, 2 adds grads, 3 adds params."""

    REPLICATED = 0
    """Plain data parallel: every rank holds everything and all-reduces gradients."""
    OPTIMIZER = 1
    """Optimizer state and the fp32 master weights are sharded."""
    GRADIENTS = 2
    """Stage 1 plus reduced gradients sharded."""
    PARAMETERS = 3
    """Stage 2 plus parameters sharded, gathered per unit around its forward and backward."""

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state and master weights live in shards (stages 1-3)."""
        return self >= Stage.OPTIMIZER

    @property
    def shards_grads(self) -> bool:
        """Reduced gradients live in shards (stages 2-3)."""
        return self >= Stage.GRADIENTS

    @property
    def shards_params(self) -> bool:
        """Parameters live in shards between gathers (stage 3)."""
        return self == Stage.PARAMETERS


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DType(Choice):
    """Compute dtype of parameters and gradients; master weights are always fp32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    """Needs loss scaling: its range is too narrow for small gradients."""

    @property
    def torch(self) -> torch.dtype:
        """The matching torch.dtype."""
        return _TORCH_DTYPES[self.value]

    @property
    def is_16bit(self) -> bool:
        """bf16 or fp16."""
        return self is not DType.FP32


class BufferDType(Choice):
    """The dtype of the model's floating buffers (rotary tables, norm statistics) in training."""

    COMPUTE = "compute"
    """Cast to the compute dtype at initialize, like the parameters."""
    MODEL = "model"
    """Each keeps the dtype the model gives it: DeepSpeed 0.19's default (it casts parameters only)."""


class Offload(Choice):
    """Where offloaded state lives between uses."""

    NONE = "none"
    """With the parameters (on the compute device)."""
    CPU = "cpu"
    """Host memory."""
    NVME = "nvme"
    """Per-rank swap files under nvme_path."""


class Device(Choice):
    """The compute device of each rank."""

    AUTO = "auto"
    """CUDA when torch sees a GPU, else CPU."""
    CPU = "cpu"
    CUDA = "cuda"


class CudaAware(Choice):
    """Whether device buffers go to MPI directly."""

    AUTO = "auto"
    """When torch.cuda and the MPI library both report support."""
    ON = "on"
    OFF = "off"
    """Stage through pinned host memory."""


class Progress(Choice):
    """How non-blocking collectives progress while Python computes."""

    NONE = "none"
    """By the MPI library alone."""
    TEST = "test"
    """MPI_Test from every gradient hook."""
    THREAD = "thread"
    """One communication thread per process runs every collective (MPI_THREAD_MULTIPLE)."""


class UpdateSchedule(Choice):
    """When the optimizer updates a bucket in a window's last backward (``optimizer_in_backward``)."""

    AFTER_BACKWARD = "after_backward"
    """``step()`` updates every bucket."""
    IN_BACKWARD = "in_backward"
    """Each bucket as soon as its gradient is final; ``step()`` completes the step."""


class Hierarchy(Choice):
    """How ranks are grouped for sharding."""

    FLAT = "flat"
    """Shard over all ranks."""
    HSDP = "hsdp"
    """Shard within a node, replicate across nodes (stages 1-3)."""
    HPZ = "hpz"
    """Flat shards plus a secondary parameter copy sharded within each node (stage 3, ZeRO++)."""


class NonFinite(Choice):
    """What a NaN/Inf gradient in fp32/bf16 does (fp16 always skips)."""

    RAISE = "raise"
    """Raise, naming rank and parameter."""
    SKIP = "skip"
    """Skip the step on every rank."""


class Schedule(Choice):
    """The learning-rate schedule the engine steps (``lr_schedule``)."""

    CONSTANT = "constant"
    """``lr`` throughout (no scheduler)."""
    WARMUP_COSINE = "warmup_cosine"
    """Linear warm-up over ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr`` at ``total_steps``."""
    WARMUP_LINEAR = "warmup_linear"
    """Linear warm-up over ``warmup_steps`` to ``lr``, then linear decay to ``min_lr`` at ``total_steps``."""


class CheckpointLayout(Choice):
    """How save_checkpoint lays out its files."""

    AUTO = "auto"
    """SHARED when h5py has MPI, else PER_RANK."""
    PER_RANK = "per_rank"
    """One HDF5 file per rank plus index.h5."""
    SHARED = "shared"
    """One shards.h5 written collectively through h5py's mpio driver."""
    PER_NODE = "per_node"
    """One nodeNNNNN.h5 per node: each node's first rank gathers its node's shards and writes them."""


class RecoverySource(Choice):
    """Where ``fault_tolerance`` takes a lost rank's state from (``recovery_source``)."""

    MEMORY = "memory"
    """Each rank keeps its recovery checkpoint in memory and a copy in its buddy's, the rank half the job
    away (on another node when ranks fill nodes in order); nothing is written until a rank is lost. A rank
    lost together with its buddy cannot be recovered."""
    DISK = "disk"
    """Per-rank checkpoint files under ``recovery_dir``, fsynced: any set of lost ranks is recovered."""


class WeightQuant(Choice):
    """How parameter all-gathers are compressed (``quantize_weights``)."""

    NONE = "none"
    """In the compute dtype, as they are."""
    INT8 = "int8"
    """Block-wise int8 codes with one fp32 scale per block (ZeRO++ qwZ)."""

    @property
    def bits(self) -> int | None:
        """Bits per code, or None when nothing is quantized."""
        return None if self is WeightQuant.NONE else 8


class GradQuant(Choice):
    """How gradient reduce-scatters are compressed (``quantize_grads``)."""

    NONE = "none"
    """In the compute dtype, summed by MPI (fp32) or in fp32 after an all-to-all (16-bit)."""
    INT8 = "int8"
    """Block-wise int8 codes and fp32 scales, all-to-all, summed in fp32 in rank order."""
    INT4 = "int4"
    """As int8 with 4-bit codes, two per byte (ZeRO++ qgZ)."""

    @property
    def bits(self) -> int | None:
        """Bits per code, or None when nothing is quantized."""
        return {GradQuant.NONE: None, GradQuant.INT8: 8, GradQuant.INT4: 4}[self]


class Rounds(Choice):
    """How a step's gradients are gathered (derived from ``micro_batches`` and ``reproducible``, not a key)."""

    WINDOW = "window"
    """Each rank runs ``grad_accum_steps`` micro-batches of its own and the window's sum is reduced."""
    SUMMED = "summed"
    """``micro_batches`` dealt round robin over the ranks; each round (the k-th backward of every rank)
    is reduce-scattered and added to the shard: the same micro-batches at any world size, summed in an
    order that depends on it."""
    ORDERED = "ordered"
    """As SUMMED, and every micro-batch's gradient is added in global index order (reproducible=True)."""

    @property
    def dealt(self) -> bool:
        """The global batch is dealt in micro-batches (shard/rounds.py's MicroBatchPlan)."""
        return self is not Rounds.WINDOW
