"""Engine: a ZeRO-sharded model plus its optimizer, driven by forward/backward/step.

``engine.backward(loss)`` expects the mean loss of this rank's micro-batch.
The engine scales it by ``1 / grad_accum_steps`` (and the fp16 loss scale)
and averages gradients over ranks, so that ``grad_accum_steps`` backward
calls on N ranks give the gradient of the mean loss over the whole global
batch, exactly as single-process training on that batch would.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerompi import offload
from zerompi.checkpoint.background import BackgroundSave
from zerompi.checkpoint.entries import PROCESS_RNG
from zerompi.checkpoint.snapshot import Counters, EngineSnapshot, SavedConfig, ShardSnapshot, ShardView
from zerompi.comm import launch
from zerompi.comm.group import ProcessGroup
from zerompi.comm.topology import build_groups
from zerompi.config import Offload, ZeroConfig
from zerompi.errors import UsageError, ZeroMPIError, all_ranks_ok
from zerompi.implicit import ImplicitBackward
from zerompi.iteration import Iteration
from zerompi.log import get_logger, set_rank
from zerompi.offload.fence import ShardFence
from zerompi.offload.tiers import TierPlan
from zerompi.optim import presets, schedules
from zerompi.optim.groups import GroupOptimizer, check_tensors, group_optimizers
from zerompi.optim.optimizer import ZeroOptimizer
from zerompi.shard import deferred
from zerompi.shard.agreement import check_configs_agree, check_models_agree
from zerompi.shard.bucket import Storage
from zerompi.shard.compression import Compression
from zerompi.shard.placement import optimizer_groups, place
from zerompi.shard.rounds import MicroBatchPlan
from zerompi.shard.sharded import ShardedModel, ShardOptions
from zerompi.shard.stages import plan_for
from zerompi.shard.wiring import CommFactory
from zerompi.torch_private import tree_map

logger = get_logger(__name__)


@dataclass
class Stats:
    """This rank's counters, cumulative since ``initialize``."""

    bytes_sent: dict[str, int] = field(default_factory=dict)  # per collective kind
    model_state_bytes: int = 0  # params, grads, master, optimizer state held in memory (device + host)
    swapped_bytes: int = 0      # model states in this rank's NVMe swap file
    swap_read_bytes: int = 0    # bytes this rank read from its swap file (4 KiB padding included)
    swap_write_bytes: int = 0   # bytes this rank wrote to its swap file
    swap_io_seconds: float = 0.0  # seconds of swap reads and writes, summed over the I/O threads
    steps: int = 0              # optimizer steps taken
    skipped_steps: int = 0      # fp16 overflows
    loss_scale: float = 1.0
    last_grad_norm: float | None = None


def _open_swapper(cfg: ZeroConfig, group: ProcessGroup, rank: int) -> offload.NVMeSwapper | None:
    """Collective: this rank's swap file for NVMe offload (None without); one that fails on some
    ranks only (nvme_path missing there) fails on all together."""
    swapper, error = None, None
    try:
        swapper = offload.open_swapper(cfg.offload, rank)
    except ZeroMPIError as e:
        error = str(e)
    all_ranks_ok(group, error)
    return swapper


def _group_optimizers(cfg: ZeroConfig, module: nn.Module, membership: dict,
                      options: list[dict]) -> tuple[list[GroupOptimizer], frozenset[int]]:
    """Each param group's optimizer, checked before anything is built (a class the engine runs, options it
    takes, tensors it accepts), and the groups whose optimizer steps whole tensors (optim/whole.py)."""
    specs = group_optimizers(cfg.optimization, options, swapped=cfg.offload.optimizer is Offload.NVME)
    check_tensors(specs, [(n, tuple(p.shape), membership[p]) for n, p in module.named_parameters() if p in membership])
    return specs, frozenset(i for i, s in enumerate(specs) if not s.elementwise)


class Engine:
    """Trains ``module`` with ZeRO over the ranks of ``group``; build it with :func:`initialize`."""

    ATTRIBUTES = ("config", "group", "info", "device", "module", "groups", "iteration", "host_memory", "swapper",
                  "sharded", "optimizer", "implicit", "lr_scheduler")
    """The public attributes ``__init__`` sets (checked by a test): with the public methods and properties,
    the interface ResilientEngine presents."""

    def __init__(self, module: nn.Module, cfg: ZeroConfig, group: ProcessGroup,
                 param_groups: list[dict[str, Any]] | None = None, param_init: deferred.ParamInit | None = None,
                 lr_scheduler: schedules.SchedulerFactory | None = None):
        self.config = cfg
        self.group = group
        self.info = launch.discover(group)
        set_rank(self.info.rank)
        if not any(True for _ in module.parameters()):
            raise ZeroMPIError("the model has no parameters: nothing to train")
        if not any(p.requires_grad for p in module.parameters()):
            raise ZeroMPIError("no parameter of the model requires grad: nothing to train")
        check_models_agree(module, group)
        check_configs_agree(cfg, group)
        # The engine is where the config is taken apart: each component gets its section's policy.
        run, sharding, batch, precision, overlap = cfg.runtime, cfg.sharding, cfg.batch, cfg.precision, cfg.overlap
        self.device = launch.select_device(run.device, self.info.local_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(launch.cpu_threads_for(run.cpu_threads, self.info.local_size))
        launch.seed_rank(run.seed, self.info.rank)
        membership, options = optimizer_groups(module, presets.expand(module, param_groups, cfg.optimization))
        specs, whole = _group_optimizers(cfg, module, membership, options)
        plan = plan_for(sharding.stage, rounds=batch.rounds)
        group_of = {n: membership[p] for n, p in module.named_parameters() if p in membership}
        compression = Compression.from_policy(cfg.compression)
        placements = tuple(place([(n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters()],
                                 plan, sharding.persistence_threshold, group_of, cfg.offload.params, compression))
        deferred.check(module, {pl.fqn for pl in placements if pl.bucketed})
        self.module = deferred.to_device(module, self.device)
        self.groups = build_groups(group, self.info, cfg.topology, sharding.stage)
        shard = self.groups.shard
        storage = Storage(plan, shard.rank, shard.size, precision.torch_dtype, self.device,
                            check_finite=not precision.scales_loss)  # fp16 overflows are the loss scaler's
        comm = CommFactory(self.groups, compression.error_feedback, batch.rounds)
        micro = MicroBatchPlan(batch.micro_batches, group.size, group.rank) if batch.rounds.dealt else None
        self.iteration = Iteration(batch.grad_accum_steps, overlap.update, micro)
        """The accumulation window, its rounds and micro-batches: what each verb may do now (iteration.py)."""
        cap = sharding.bucket_numel(torch.empty((), dtype=precision.torch_dtype).element_size())
        # Swapped parameter shards are read ahead even when gathers are not prefetched: three units,
        # which on the capacity benchmark's disk hid most reads that one unit ahead left exposed.
        ahead = overlap.prefetch_units or (3 if cfg.offload.params == Offload.NVME else 0)
        overlap = dataclasses.replace(overlap, prefetch_units=ahead)
        self.host_memory = offload.HostMemory(cfg.offload)
        self.swapper = swapper = _open_swapper(cfg, group, self.rank)
        self._fence = ShardFence()  # buckets an asynchronous save has not taken yet
        tiers = TierPlan(cfg.offload.optimizer, cfg.offload.params, self.device, plan.shard_grads, swapper,
                         cfg.offload.pin_memory, self._fence)
        self.sharded = ShardedModel(module, storage, comm,
                                    ShardOptions(cap, placements, overlap, param_init, sharding.max_live_params,
                                                 buffer_dtype=precision.buffer_dtype,
                                                 whole_groups=whole),
                                    tiers)
        if swapper is not None:  # released memory waits for the next block of its size
            swapper.memory.keep(offload.reuse_bytes(self.sharded.all_buckets))
        self._saving: BackgroundSave | None = None
        self.optimizer = ZeroOptimizer(self.sharded.collectives, cfg.optimization, cfg.precision, group, specs, tiers)
        self.sharded.register_backward_steps(self.optimizer)  # used by backwards that update (iteration.py)
        self._stats = Stats()
        self.implicit = ImplicitBackward(self.begin_backward, self.end_backward)
        """Runs a script's ``loss.backward()`` on watched outputs as ``backward`` (implicit.py)."""
        self.lr_scheduler = schedules.build(lr_scheduler or schedules.from_policy(cfg.lr_policy), self.optimizer)
        """Stepped by ``step()`` after each optimizer step that updated (None: the lr stays)."""

    # ---- identity ---------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    # ---- training ---------------------------------------------------------
    def micro_batch_indices(self) -> list[int]:
        """micro_batches: the global micro-batch indices (in 0..micro_batches-1) this rank runs each
        step, in order: call forward and backward once for each, on that micro-batch's data."""
        if self.iteration.micro is None:
            raise UsageError("micro_batch_indices() belongs to a global batch dealt in micro_batches, which is None")
        return self.iteration.micro.indices

    def __call__(self, *args, **kwargs):
        """Forward: floating inputs are moved to the device and cast to the compute dtype. With
        micro_batches torch's generator is first seeded for the micro-batch about to run (its global index)."""
        dtype, device = self.config.precision.torch_dtype, self.device
        index = self.iteration.forward_index(training=torch.is_grad_enabled() and self.module.training)
        if index is not None:
            torch.manual_seed(MicroBatchPlan.seed(self.config.runtime.seed, self._stats.steps, index))

        def place(x):
            if isinstance(x, torch.Tensor):
                x = x.to(device)
                return x.to(dtype) if x.is_floating_point() else x
            return x
        return self.module(*tree_map(place, args), **tree_map(place, kwargs))

    def backward(self, loss: torch.Tensor, *, window_share: bool = True) -> None:
        """Backward of this rank's mean micro-batch loss; reduces gradients as they appear.

        ``window_share=False``: the loss already is its share of the accumulation window (the
        frameworks' wrappers divide it themselves), so only the fp16 loss scale is applied."""
        if loss.dim() != 0:
            raise UsageError(f"backward() takes a scalar loss, got shape {tuple(loss.shape)}")
        with self.implicit.explicit():
            factor = self.begin_backward(window_share=window_share)
            try:
                (loss * factor).backward()
            except BaseException:
                self.end_backward(ok=False)
                raise
            self.end_backward(ok=True)

    def begin_backward(self, *, window_share: bool = True) -> float:
        """For a backward run by the caller (``backward`` runs one): enter it and return the factor
        the loss's gradient must be scaled by (loss scale, and the accumulation share unless
        ``window_share`` is False). ``end_backward`` ends it."""
        backward, factor = self.iteration.begin_backward(self.optimizer.loss_scale, share=window_share)
        try:
            self.sharded.begin_backward(backward)
        except BaseException:
            self.iteration.end_backward(ok=False)
            raise
        return factor

    def end_backward(self, ok: bool) -> None:
        """After ``begin_backward`` and the autograd backward: reduce what is left (``ok``), or undo
        the micro-batch (the backward failed)."""
        if ok:
            try:
                self.sharded.finish_backward()
            except BaseException:
                self.end_backward(ok=False)
                raise
            self.iteration.end_backward(ok=True)
            return
        if self.sharded.in_backward:
            self.sharded.abort_backward()
        self.optimizer.abandon_backward()
        self.iteration.end_backward(ok=False)

    def step(self) -> bool:
        """Update at the end of an accumulation window; True when the parameters changed."""
        if not self.iteration.begin_step():
            return False
        try:
            for sources in self.iteration.empty_rounds():
                self.sharded.empty_round(sources)
            result = self.optimizer.step()
        finally:
            self.iteration.end_step()
        self._stats.last_grad_norm = result.grad_norm
        if result.stepped:
            self._stats.steps += 1
            if self.lr_scheduler is not None:  # a skipped (fp16 overflow) step does not advance it
                self.lr_scheduler.step()
        else:
            self._stats.skipped_steps += 1
        self.group.step_done()
        return result.stepped

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group, as the next step will use it."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # ---- state ------------------------------------------------------------
    @property
    def stats(self) -> Stats:
        s = self._stats
        s.bytes_sent = dict(self.group.bytes_sent)
        s.model_state_bytes = self.sharded.state_bytes() + self.optimizer.state_bytes()
        s.swapped_bytes = self.swapper.reserved_bytes if self.swapper is not None else 0
        if self.swapper is not None:  # cumulative: a step's traffic is the difference across it
            io = self.swapper.stats
            s.swap_read_bytes, s.swap_write_bytes = io.bytes_read, io.bytes_written
            s.swap_io_seconds = io.read_seconds + io.write_seconds
        s.loss_scale = self.optimizer.loss_scale
        return s

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every entry of ``named_parameters()`` as a full fp32 CPU tensor, on every rank."""
        out: dict[str, torch.Tensor] = {}
        for c in self.sharded.all_collectives:  # a frozen bucket's parameters are gathered and widened to fp32
            layout = c.bucket.layout
            with self.optimizer.resident(layout.index) if c.bucket.trains else nullcontext():
                full = c.full_master().cpu()
            for slot in layout.slots:
                out[slot.fqn] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        ordered = {}
        for name, p in self.module.named_parameters():
            ordered[name] = out[name] if name in out else p.detach().float().cpu().clone()
        return ordered

    def snapshot(self) -> EngineSnapshot:
        """What a checkpoint reads of this engine now (a save refuses one taken inside a window)."""
        s, shard = self._stats, self.groups.shard
        buckets = tuple(ShardSnapshot(b.layout, b.own, b.layout.shard(shard.rank)) for b in self.sharded.all_buckets)
        view = ShardView(shard, writes=self.groups.replicate is None or self.groups.replicate.rank == 0,
                         hierarchical=self.groups.hierarchical, buckets=buckets,
                         config=SavedConfig.of(self.config), fence=self._fence)
        return EngineSnapshot(
            counters=Counters(s.steps, s.skipped_steps, self.optimizer.scaler_state(),
                              schedules.saved_state(self.lr_scheduler)),
            view=view, between_steps=self.iteration.idle, recorded=self.optimizer,
            sources=(self.optimizer, self.sharded, PROCESS_RNG),
            replicated_frozen=tuple(n for n, _ in self.sharded.replicated_frozen()),
            frozen_dtype=self.config.precision.torch_dtype)

    def restore(self, counters: Counters) -> None:
        """After a checkpoint's shards are loaded: its counters, and a new accumulation window."""
        self.iteration.reset()
        self._stats.steps, self._stats.skipped_steps = counters.steps, counters.skipped_steps
        self.optimizer.load_scaler_state(counters.scaler)
        if self.lr_scheduler is not None and counters.scheduler is not None:
            self.lr_scheduler.load_state_dict(counters.scheduler)
        elif self.lr_scheduler is not None or counters.scheduler is not None:
            had, has = ("no", "an") if self.lr_scheduler is not None else ("an", "no")
            logger.warning("the checkpoint has %s lr scheduler state and this engine has %s lr scheduler: the "
                           "learning rates are the checkpoint's param-group values, not rescheduled", had, has)

    def save_checkpoint(self, path, tag: str | None = None, client_state: Any = None, *,
                        include_frozen: bool = True, async_save: bool = False) -> str:
        """Collective: write a sharded HDF5 checkpoint under ``path``; returns its tag.

        ``tag`` defaults to ``step{steps:08d}``; ``client_state`` is any
        JSON-serialisable value (data-loader position, epoch), returned by load.
        ``include_frozen=False`` leaves out the frozen parameters (a fine-tuned model's
        pretrained base): the checkpoint holds what training changed, and loads onto an
        engine whose model was built with the same base.

        With ``async_save`` it returns once the save has started: the state of this moment is
        written, fsynced and published (``latest``) by a background thread while training goes
        on (checkpoint/background.py); ``wait_checkpoint()`` reports its outcome. A save in
        flight is waited for first.
        """
        from zerompi.checkpoint import save, save_async
        if self.optimizer.updated_in_backward:
            raise UsageError("save_checkpoint() between backward() and step() with optimizer_in_backward: the "
                             "buckets are updated but the step is not counted yet; call step() first")
        self.wait_checkpoint()
        if not async_save:
            return save(self, path, tag, client_state, include_frozen=include_frozen)
        tag, self._saving = save_async(self, path, tag, client_state, include_frozen=include_frozen)
        return tag

    def wait_checkpoint(self) -> None:
        """Collective: wait for the asynchronous save in flight, if any, until it is published;
        CheckpointError on every rank if it failed on any. Called by the next save or load and by
        ``close()``; at interpreter exit the save's thread is joined (a failure is logged there)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.wait(self.group)

    def load_checkpoint(self, path, tag: str | None = None) -> Any:
        """Collective: load ``path/tag`` (``latest`` when None) at any world size; returns client_state."""
        from zerompi.checkpoint import load
        self.wait_checkpoint()
        return load(self, path, tag)

    def all_reduce_mean(self, value: float) -> float:
        """Collective: the mean of a Python float over ranks (for logging)."""
        return self.group.sum_floats([float(value)], kind="metrics", what="a metric (all_reduce_mean)")[0] \
            / self.world_size

    def close(self, abandon: bool = False) -> None:
        """Remove every hook, stop the watchdog and the communication thread; the parameters stay
        bound to the engine's buffers. Collective while an asynchronous save is in flight (it is waited for).

        ``abandon``: a rank was lost and the engine is dropped. Nothing communicates: a save in flight
        is abandoned (never published), and what fails to stop is logged, not raised."""
        if abandon:
            saving, self._saving = self._saving, None
            if saving is not None:
                saving.abandon("a rank was lost before every writer finished")
        else:
            self.wait_checkpoint()
        for stop in (self.sharded.remove_hooks, self.group.stop_watchdog, self.group.stop_comm_thread,
                     self.optimizer.close, self.swapper.close if self.swapper is not None else None):
            if stop is None:  # no swap file (it is closed also when only the parameters were offloaded)
                continue
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - a broken engine is being dropped
                if not abandon:
                    raise
                logger.debug("close(abandon=True): %s", e)
