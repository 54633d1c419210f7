"""Configuration of a zerompi engine: one frozen, validated :class:`ZeroConfig`.

Every value is checked once, in ``__post_init__``, so the rest of the package can trust it; a bad
value raises :class:`ConfigError` naming the key, the value and what is allowed. A config comes from
keyword arguments, a plain dict (``from_dict``) or a TOML or JSON file (``from_file``), which also reads
the dialects registered in dialects.py (DeepSpeed JSON, translated key by key by zerompi.compat.deepspeed:
what zerompi lacks is refused, never ignored).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import torch

from zerompi.config import checks, dialects
from zerompi.config.choices import (BufferDType, CheckpointLayout, CudaAware, Device, DType, GradQuant, Hierarchy,
                                    NonFinite, Offload, Progress, RecoverySource, Rounds, Schedule, Stage,
                                    UpdateSchedule, WeightQuant)
from zerompi.config.files import read_document
from zerompi.config.reproducible import check_reproducible
from zerompi.config.policies import (CheckpointPolicy, CompressionPolicy, LrSchedulePolicy, OffloadPolicy, OptimizerPolicy,
                                     OverlapPolicy, PrecisionPolicy, ReliabilityPolicy, TopologyPolicy)
from zerompi.errors import ConfigError


@dataclass(frozen=True, eq=False)
class ZeroConfig:
    """Validated settings of a ZeRO data-parallel engine (see each field's docstring).

    A choice field takes its enum member or the member's value ('bf16', 3) and holds
    the member (see choices.py); to_dict writes the plain values back. Equality
    compares the resolved optimizer class, so a config equals its own
    ``from_dict(to_dict())`` round trip even when built from a class object. The
    policy properties (``precision``, ``offload``, ...) group related fields.
    """

    stage: Stage = Stage.PARAMETERS
    """0 plain data parallel; 1 shards optimizer state + fp32 master; 2 + grads; 3 + params."""
    optimizer: str | type[torch.optim.Optimizer] = "adamw"
    """'adamw', 'adam', 'sgd', an Optimizer subclass or 'package.module.ClassName' to one."""
    optimizer_kwargs: dict = field(default_factory=dict)
    """Extra optimizer arguments; str keys other than 'params' and those set by fields."""
    lr: float = 1e-3
    """Learning rate, finite and > 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam coefficients, each in [0, 1); a list of two numbers becomes a tuple."""
    eps: float = 1e-8
    """Adam denominator term, > 0."""
    weight_decay: float = 0.01
    """Weight decay, >= 0."""
    momentum: float = 0.0
    """SGD momentum, >= 0."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed before each optimizer step, >= 1."""
    clip_grad_norm: float | None = None
    """Global gradient norm limit, > 0; None disables clipping (0 is stored as None)."""
    dtype: DType = DType.FP32
    """Parameter/gradient compute dtype: 'fp32', 'bf16', 'fp16'; master weights are fp32."""
    buffer_dtype: BufferDType = BufferDType.COMPUTE
    """Floating buffers: 'compute' casts them to ``dtype``; 'model' keeps each one's own (DeepSpeed's way)."""
    loss_scale: float = 0.0
    """fp16 only: 0 selects dynamic loss scaling, > 0 is a static scale."""
    initial_scale_power: int = 16
    """Dynamic loss scaling starts at 2**initial_scale_power; 0..64."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles, >= 1."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves, >= 1."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale, > 0."""
    bucket_mb: float = 25.0
    """MiB of gradients per communication bucket at stages 0-2. At stage 3 a module becomes
    a gather unit once its subtree's parameters not claimed by a smaller unit reach this."""
    seed: int = 0
    """Random seed, >= 0."""
    cpu_threads: int | None = None
    """Torch threads per rank on CPU, >= 1; None gives each rank its share of the cores."""
    device: Device = Device.AUTO
    """'auto', 'cpu' or 'cuda'."""
    cuda_aware_mpi: CudaAware = CudaAware.AUTO
    """Device buffers straight to MPI: 'auto' (when torch.cuda and the MPI report support), 'on' or 'off'."""
    offload_optimizer: Offload = Offload.NONE
    """Stages 1-3: where fp32 master weights and optimizer state live between steps:
    'none' (with the parameters), 'cpu' (host memory; the update runs on the CPU) or
    'nvme' (swap files under nvme_path, streamed in bucket by bucket during the step)."""
    offload_params: Offload = Offload.NONE
    """Stage 3: where the parameter shards live between gathers: 'none', 'cpu' or 'nvme'."""
    nvme_path: str | None = None
    """Directory for the per-rank swap files of 'nvme' offload (a local disk)."""
    pin_memory: bool = True
    """Pin host buffers used for offload (when a GPU is present)."""
    nvme_block_kib: int = 8192
    """KiB per swap I/O request, a multiple of 4 in 4..262144."""
    nvme_threads: int = 4
    """Swap I/O threads (requests in flight), 1..64."""
    nvme_buffers: int = 8
    """Page-aligned staging buffers of nvme_block_kib each: the bound on swap staging memory, 1..1024."""
    nvme_verify: bool = True
    """CRC-32 of every swapped block, checked when it is read back."""
    return_freed_memory: bool = False
    """Fix glibc's mmap threshold at 1 MiB, so host blocks of 1 MiB or more go back to the OS when
    freed. glibc's default raises the threshold as large blocks are freed and keeps later ones on its
    heap for reuse: faster (no page faults), but stage 3's gathered units then leave the resident set
    higher than what is live. True trades time for peak host memory (LoRA at stage 3: 24% less peak
    per rank, steps 1.27x slower, benchmarks/results/lora_steps.md); NVMe offload always does it.
    Process-wide; a ``MALLOC_MMAP_THRESHOLD_`` in the environment wins."""
    overlap_grad_reduce: bool = False
    """Start each bucket's gradient reduce-scatter non-blocking as soon as backward has filled it,
    and wait for all of them when backward ends (stages 1-3), instead of reducing in place."""
    optimizer_in_backward: bool = False
    """Stages 2-3: update each bucket during the backward that ends an accumulation window, as soon
    as its gradient is reduced, instead of all buckets in ``step()``. Same arithmetic, bit for bit;
    under NVMe offload the gradient shard never goes to the swap file (its write and read-back: 8
    bytes per element and step at fp32) and the master and optimizer state stream in and out while
    backward computes.
    Needs what a per-bucket update cannot know in advance to be absent: no gradient clipping (the
    global norm), no fp16 (its overflow skips the step) and nonfinite='raise' (a NaN/Inf gradient
    still raises, from ``step()``, but the buckets before it are updated by then). ``step()``
    completes the step: the global norm, the counters, the lr schedule."""
    prefetch_units: int = 0
    """Stage 3: gather this many gather units ahead, non-blocking (0 = gather on demand, up to 8);
    the order is recorded on the first step. With offload_params='nvme' the units' shards are
    read from the swap file this many units ahead (0 there means 3), and with
    optimizer_in_backward so is their optimizer state in backward."""
    mpi_progress: Progress = Progress.NONE
    """How non-blocking collectives progress while Python computes: 'none' (by the MPI library
    alone; with MPICH, MPIR_CVAR_ASYNC_PROGRESS=1 adds a progress thread), 'test' (MPI_Test
    from every gradient hook) or 'thread' (one communication thread per process runs every
    collective as a blocking call, in issue order; needs MPI_THREAD_MULTIPLE). See
    benchmarks/results/overlap.md for what each costs."""
    hierarchy: Hierarchy = Hierarchy.FLAT
    """'flat': shard over all ranks; 'hsdp' (stages 1-3): shard within a node and replicate across
    nodes; 'hpz' (stage 3): flat shards plus a secondary parameter copy sharded within each node,
    so forward/backward all-gathers stay inside the node (ZeRO++). See comm/topology.py."""
    ranks_per_node: int | None = None
    """Ranks per node for 'hsdp'/'hpz': None takes nodes from MPI (shared memory); a number
    groups consecutive ranks, e.g. to emulate several nodes on one machine."""
    nonfinite: NonFinite = NonFinite.RAISE
    """A NaN/Inf gradient in fp32/bf16: 'raise' (naming rank and parameter) or 'skip' the step
    on every rank. fp16 always skips and lowers the loss scale."""
    debug_collectives: bool = False
    """Before every collective, check that all ranks are at the same operation, bucket and
    size, and raise naming the module if not (one extra small all-gather each). Also on
    when the environment sets ZEROMPI_DEBUG=1."""
    collective_timeout: float | None = None
    """Seconds a rank may wait in one collective before the watchdog reports what it was
    waiting on, gathers the hang report and aborts the job; overrides the automatic deadline
    of hang_floor."""
    hang_floor: float | None = 60.0
    """The automatic hang deadline: a rank waiting in one collective longer than
    max(hang_floor, 3 x the running median step time) starts the hang report (rank 0 names the
    culprit rank, its collective and stack) and the job aborts with exit code 4. Seconds; None
    turns the automatic deadline off (collective_timeout still applies)."""
    hang_dir: str | None = None
    """Directory where each rank writes its record (last collectives, stack) when a hang is
    diagnosed, for ``zerompi diagnose DIR``; None: a temporary directory named after the job.
    Use a shared directory to read every rank's record from one node."""
    abort_on_exception: bool = True
    """Install a sys.excepthook that prints an uncaught exception once and calls MPI_Abort,
    so one failing rank ends the job instead of hanging the others."""
    checkpoint_layout: CheckpointLayout = CheckpointLayout.AUTO
    """'per_rank': save_checkpoint writes one HDF5 file per rank plus index.h5; 'shared': one
    shards.h5 written collectively through h5py's mpio driver (needs h5py built with MPI);
    'per_node': one nodeNNNNN.h5 per node (nodes from MPI, or ranks_per_node), written by the
    node's first rank after gathering its node's shards: files per checkpoint divided by the ranks
    per node, for parallel filesystems whose metadata servers one file per rank overloads;
    'auto': shared when h5py has MPI, else per_rank. All load at any world size."""
    param_persistence_threshold: int = 0
    """Stage 3: trainable parameters with fewer elements than this stay gathered on every rank
    between uses (their optimizer state and gradients stay sharded, as at stage 2), which saves
    their many small all-gathers in forward and backward for c bytes each of memory; 0 shards
    every parameter. DeepSpeed's stage3_param_persistence_threshold."""
    max_live_params: int | None = None
    """Stage 3 with prefetch: the most parameter elements gathered by prefetching at once, the
    unit computing plus those gathered ahead (fewer units are prefetched when more would exceed
    it; a unit larger than the bound is still gathered, alone; enclosing units gathered around
    them are not counted). None: prefetch_units alone decides. DeepSpeed's
    stage3_max_live_parameters."""
    lr_schedule: Schedule = Schedule.CONSTANT
    """Learning-rate schedule the engine steps after each optimizer step: 'constant' (lr
    throughout), 'warmup_cosine' or 'warmup_linear' (linear warm-up from lr/warmup_steps to lr
    over warmup_steps steps, then cosine or linear decay to min_lr at total_steps, min_lr after).
    Per optimizer param group, relative to that group's lr. ``initialize(lr_scheduler=fn)``
    takes any torch.optim.lr_scheduler instead."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up, >= 0."""
    total_steps: int | None = None
    """The optimizer step at which a decaying schedule reaches min_lr; > warmup_steps. None only
    with lr_schedule='constant'."""
    min_lr: float = 0.0
    """The learning rate a decaying schedule ends at, 0 <= min_lr <= lr (a group with another lr
    ends at min_lr scaled by that group's lr / lr)."""
    quantize_weights: WeightQuant = WeightQuant.NONE
    """Stages 1-3: 'int8' sends parameter all-gathers as int8 codes with one fp32 scale per
    quant_block values (ZeRO++ qwZ): (1 + 4/quant_block) bytes an element instead of c. Each rank
    quantises its own shard once per step, after the update (and at initialize); stage 3's forward and
    backward gathers and the stage 1-2 gather after the step reuse it, and every rank, the owner
    included, computes with the decoded values. The fp32 master stays exact. 'none': as they are."""
    quantize_grads: GradQuant = GradQuant.NONE
    """Stages 1-3: 'int8' or 'int4' sends gradient reduce-scatters as int8 or int4 codes (two a byte)
    with one fp32 scale per quant_block values (ZeRO++ qgZ): an all-to-all of the codes, decoded and
    summed in fp32 in rank order, so results are reproducible. 'none': as they are."""
    quant_block: int = 256
    """Values per quantisation scale, an even int in 2..65536: smaller blocks follow the data more
    closely (a value's error is at most half its block's step, max|x|/127 or /7) for 4 bytes of
    scale each."""
    reproducible: bool = False
    """Train bitwise the same model at any world size N in 1..micro_batches: the micro-batches'
    gradients are summed in the order of their global index, whatever rank ran them, and every
    rank runs the micro-batches ``engine.micro_batch_indices()`` gives it (round robin). Stages
    0-3 (0 and 1 run stage 2's gradient path), flat groups, fp32 or bf16, explicit ``cpu_threads``;
    config/reproducible.py lists what else it needs. See the README's "Reproducible at any world
    size"."""
    micro_batches: int | None = None
    """Micro-batches per step over all ranks (the global batch, >= the world size), dealt round robin
    (``engine.micro_batch_indices()``); the gradient is their mean. None: ``grad_accum_steps`` per rank."""
    grad_error_feedback: bool = False
    """With quantize_grads: each rank keeps what quantisation dropped from its local gradient (an fp32
    residual as large as the gradient buckets, 4 bytes per parameter per rank, in memory whatever is
    offloaded) and adds it to the next reduction, so the error does not accumulate over steps. Saved
    in checkpoints; dropped, with a logged note, when a checkpoint is loaded at another world size or
    bucket layout."""
    checkpoint_verify: bool = False
    """After each rank file of a checkpoint is written and fsynced, drop it from the page cache and
    read every checksum back from the disk (doubles the save's I/O). Off: the checksums are computed
    from memory as the data is written, and every load checks them."""
    checkpoint_direct_io: bool = True
    """Write checkpoint data with O_DIRECT (whole pages; a block's ragged tail and HDF5's metadata
    through the page cache), which spends a fifth of the CPU of buffered writes and leaves the page
    cache to training: what lets an asynchronous save run beside the steps. Filesystems that refuse
    O_DIRECT get buffered writes anyway; False: buffered writes everywhere (the same bytes)."""
    checkpoint_align_kib: int = 1024
    """Checkpoint datasets of this many KiB or more start on a multiple of it in their file: set it to
    the stripe size on Lustre (1 MiB by default) or the block size on GPFS. A power of two, 4..1048576."""
    checkpoint_async_copy: bool = False
    """What ``save_checkpoint(async_save=True)`` writes from: False, the live shards, each held
    unchanged until written (no extra memory; an optimizer step that reaches a bucket not yet written
    waits for it); True, a copy in host memory taken first (one more copy of this rank's master and
    optimizer state until the save ends; steps wait only for the copy). Under NVMe offload the save
    reads the swap file instead, one bucket at a time, either way."""
    fault_tolerance: bool = False
    """Survive lost ranks without a relaunch (ULFM, Open MPI's ``--with-ft ulfm``): the survivors shrink, rebuild,
    reload the last recovery checkpoint and raise ``zerompi.Recovered``; the loop goes on from ``engine.stats.steps``.
    Needs micro_batches (re-dealt over the survivors; with reproducible=True the bits of the failure-free run).
    See the README's "Surviving a lost rank"."""
    recovery_every: int = 1
    """fault_tolerance: steps between recovery checkpoints (>= 1); a failure replays at most this many."""
    recovery_source: RecoverySource = RecoverySource.MEMORY
    """fault_tolerance: 'memory', recovery checkpoints in memory with a copy on a buddy rank; 'disk', files."""
    recovery_dir: str | None = None
    """fault_tolerance: where recovery files go (every rank must read every rank's: a shared filesystem across
    nodes); None: a fresh directory under rank 0's temporary directory. 'memory' writes there only to recover."""
    min_ranks: int = 1
    """fault_tolerance: the fewest ranks training goes on with; fewer survivors abort the job, >= 1."""

    def __post_init__(self) -> None:
        # Field order, so the first problem reported is the first field's; the
        # cross-field check comes last as it relies on the checked fields.
        for f in fields(self):
            object.__setattr__(self, f.name, checks.CHECKS[f.name](f.name, getattr(self, f.name)))
        checks.check_offload(self)
        checks.check_schedule(self)
        checks.check_optimizer_kwargs(self)
        checks.check_quantization(self)
        checks.check_in_backward(self)
        check_reproducible(self)
        checks.check_fault_tolerance(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ZeroConfig):
            return NotImplemented
        return self._identity() == other._identity()

    def _identity(self) -> tuple:
        return tuple(self.optimizer_class() if f.name == "optimizer" else getattr(self, f.name)
                     for f in fields(self))

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim.Optimizer subclass that ``optimizer`` names."""
        return checks.optimizer_class("optimizer", self.optimizer)

    @property
    def rounds(self) -> Rounds:
        """How a step's gradients are gathered: from ``micro_batches`` and ``reproducible``."""
        return Rounds.WINDOW if self.micro_batches is None else Rounds.ORDERED if self.reproducible else Rounds.SUMMED

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch.dtype."""
        return self.dtype.torch

    def bucket_numel(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes that fit in one bucket of ``bucket_mb`` MiB (>= 1)."""
        if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
            raise ValueError(f"itemsize={itemsize!r} is not an int >= 1")
        return max(1, int(self.bucket_mb * 2**20 // itemsize))

    @property
    def optimization(self) -> OptimizerPolicy:
        """The optimizer, its hyperparameters, clipping and non-finite gradients."""
        return OptimizerPolicy(self.optimizer, self.optimizer_kwargs, self.lr, self.betas, self.eps,
                               self.weight_decay, self.momentum, self.clip_grad_norm, self.nonfinite,
                               self.reproducible)

    @property
    def checkpointing(self) -> CheckpointPolicy:
        """How checkpoints are laid out and written."""
        return CheckpointPolicy(self.checkpoint_layout, self.checkpoint_verify, self.checkpoint_direct_io,
                                self.checkpoint_align_kib, self.checkpoint_async_copy)

    @property
    def lr_policy(self) -> LrSchedulePolicy:
        """The built-in learning-rate schedule."""
        return LrSchedulePolicy(self.lr_schedule, self.lr, self.warmup_steps, self.total_steps, self.min_lr)

    @property
    def precision(self) -> PrecisionPolicy:
        """Compute dtype and fp16 loss scaling."""
        return PrecisionPolicy(self.dtype, self.loss_scale, self.initial_scale_power,
                               self.loss_scale_window, self.hysteresis, self.min_loss_scale)

    @property
    def offload(self) -> OffloadPolicy:
        """Offload tiers and the NVMe swap settings."""
        return OffloadPolicy(self.offload_optimizer, self.offload_params, self.nvme_path, self.pin_memory,
                             self.nvme_block_kib, self.nvme_threads, self.nvme_buffers, self.nvme_verify)

    @property
    def overlap(self) -> OverlapPolicy:
        """Overlap of communication with computation."""
        return OverlapPolicy(self.overlap_grad_reduce, self.prefetch_units, self.mpi_progress,
                             UpdateSchedule.IN_BACKWARD if self.optimizer_in_backward else UpdateSchedule.AFTER_BACKWARD)

    @property
    def topology(self) -> TopologyPolicy:
        """Grouping of ranks for sharding."""
        return TopologyPolicy(self.hierarchy, self.ranks_per_node)

    @property
    def reliability(self) -> ReliabilityPolicy:
        """Collective checks, watchdog and abort."""
        return ReliabilityPolicy(self.debug_collectives, self.collective_timeout,
                                 self.abort_on_exception, self.hang_floor, self.hang_dir)

    @property
    def compression(self) -> CompressionPolicy:
        """Quantized collectives."""
        return CompressionPolicy(self.quantize_weights, self.quantize_grads, self.quant_block,
                                 self.grad_error_feedback)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict that from_dict accepts and JSON can hold."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update((k, v.value) for k, v in out.items() if isinstance(v, Enum))  # plain str / int
        if isinstance(self.optimizer, type):
            out["optimizer"] = f"{self.optimizer.__module__}.{self.optimizer.__qualname__}"
        out["betas"] = list(self.betas)
        out["optimizer_kwargs"] = copy.deepcopy(self.optimizer_kwargs)
        return out

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied and validated."""
        checks.reject_unknown(changes, [f.name for f in fields(self)], "config keys")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Build from a mapping of field names to values; unknown keys are refused."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config={d!r} is not a mapping of config keys to values")
        checks.reject_unknown(d, [f.name for f in fields(cls)], "config keys")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike, table: str | None = None) -> ZeroConfig:
        """Read a .toml or .json file, or one top-level ``table`` of it; another framework's config
        that a registered dialect recognises (DeepSpeed JSON: zerompi.compat.deepspeed) is read
        through it (dialects.py)."""
        doc, where = read_document(path, table)
        dialect = dialects.recognising(doc)
        try:
            return dialect.read(doc) if dialect is not None else cls.from_dict(doc)
        except ConfigError as e:
            how = f" (read as a {dialect.name} config)" if dialect is not None else ""
            raise ConfigError(f"{where}{how}: {e}") from None

    @classmethod
    def from_deepspeed(cls, d: Mapping[str, Any], model: torch.nn.Module | None = None,
                       **overrides: Any) -> ZeroConfig:
        """Deprecated, kept for one release: ``zerompi.compat.deepspeed.config_from``."""
        warnings.warn("ZeroConfig.from_deepspeed is deprecated: use zerompi.compat.deepspeed.config_from "
                      "(the same translation)", DeprecationWarning, stacklevel=2)
        return dialects.named("DeepSpeed").read(d, model, **overrides)
