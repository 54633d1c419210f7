"""``ZeroMPIStrategy``: Lightning's Trainer over a zerompi engine, one process per MPI rank.

    trainer = Trainer(strategy=ZeroMPIStrategy(ZeroConfig(stage=3)), accelerator="cpu", devices=1)
    trainer.fit(module)          # mpiexec -n 4 python -m mpi4py train.py

What Lightning does itself is left to it (loops, hooks, logging, callbacks, its sampler dealing the
global batch to the ranks, its learning-rate schedulers); what touches parameters, gradients or
optimizer state is the engine's: the forward runs through the engine, ``backward`` is the engine's
backward, the optimizer step is ``engine.step()`` (which updates at the end of each accumulation
window), checkpoints are zerompi's sharded HDF5 checkpoints. What cannot be mapped exactly is
refused by name (translate.py).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from zerompi.entry import initialize, job_group
from zerompi.comm import launch
from zerompi.compat.lightning import collectives, translate
from zerompi.compat.lightning.environment import MPIRanks
from zerompi.config import ZeroConfig
from zerompi.engine import Engine
from zerompi.errors import UsageError

TAG = "checkpoint"
"""The engine checkpoint's tag inside a Lightning checkpoint directory."""
METADATA = "lightning.ckpt"
"""Lightning's own state (loops, callbacks, schedulers, hyperparameters) inside that directory."""


class EngineModule(nn.Module):
    """``strategy.model``: the LightningModule, whose forwards (``training_step`` and the others,
    through Lightning's forward redirection) run through the engine."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.module = engine.module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class WindowOptimizer(torch.optim.Optimizer):
    """The optimizer Lightning holds: the engine's param groups (a scheduler or the learning-rate
    monitor reads and sets them), stepped by the strategy through the engine. ``zero_grad`` does
    nothing: each step consumes its window's reduced gradients."""

    def __init__(self, engine: Engine):
        super().__init__(engine.optimizer.param_groups, engine.optimizer.defaults)  # the same group dicts
        self.state = engine.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        raise UsageError("the engine steps in ZeroMPIStrategy.optimizer_step; call the LightningOptimizer's step "
                         "(self.optimizers().step() under manual optimization)")

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # stepped only through the strategy

    def state_dict(self) -> dict[str, Any]:
        raise UsageError("the optimizer state is sharded: it is saved by trainer.save_checkpoint (zerompi's HDF5)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise UsageError("the optimizer state is sharded: it is restored from trainer.fit(ckpt_path=...)")


class ZeroMPIStrategy(ParallelStrategy):
    """Lightning strategy: ZeRO data parallelism over MPI, one process per rank, on CPUs or GPUs.

    Collective: every rank constructs it (it learns where the ranks run). ``config`` is the engine's
    ZeroConfig, less what Lightning decides: the optimizer (``configure_optimizers``), the accumulation
    window (``accumulate_grad_batches``) and norm clipping (``gradient_clip_val``). ``comm`` is the MPI
    communicator (``MPI.COMM_WORLD`` by default).
    """

    strategy_name = "zerompi"

    def __init__(self, config: ZeroConfig | None = None, *, comm: Any = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None):
        cfg = config if config is not None else ZeroConfig()
        group = job_group(cfg, comm)  # as initialize builds it
        info = launch.discover(group)
        super().__init__(cluster_environment=MPIRanks(info), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = cfg
        self._group = group
        self._comm = group.split(0, group.rank, "lightning")  # the strategy's collectives, apart from the engine's
        self.engine: Engine | None = None
        self._optimizer: WindowOptimizer | None = None
        self._schedulers: list = []

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's names for it: ``Trainer(strategy="zerompi")`` (ZeroConfig's defaults) and
        ``"zerompi_stage_0"`` .. ``"zerompi_stage_3"``, as Lightning names its DeepSpeed stages. Lightning finds
        only its own strategies by itself: importing zerompi.compat.lightning registers these."""
        if "zerompi" in strategy_registry:
            return
        strategy_registry.register("zerompi", cls, description="ZeRO over MPI (zerompi), ZeroConfig's defaults")
        for stage in range(4):
            strategy_registry.register(f"zerompi_stage_{stage}", cls, description=f"ZeRO stage {stage} over MPI "
                                       "(zerompi)", config=ZeroConfig(stage=stage))

    # ---- ranks and devices -------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())  # as zerompi picks it
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise translate.refuse(f"the {type(self.accelerator).__name__}", "zerompi runs on CPUs and CUDA GPUs")
        self.set_world_ranks()
        super().setup_environment()

    def model_to_device(self) -> None:
        pass  # the engine places the model (and shards it)

    # ---- the engine ----------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if type(self.precision_plugin) is not Precision:
            raise translate.refuse(f"Trainer(precision={getattr(self.precision_plugin, 'precision', '?')!r})",
                                   "the compute dtype is the config's dtype (ZeroConfig(dtype='bf16')); "
                                   "leave Lightning's precision at '32-true'")
        if self.engine is None:
            self._build_engine(trainer)
        self.model = EngineModule(self.engine)
        if trainer.state.fn == TrainerFn.FITTING:
            self.optimizers = [self._optimizer]
            self.lr_scheduler_configs = self._schedulers

    def _build_engine(self, trainer: Any) -> None:
        module = self.lightning_module
        for hook in ("backward", "configure_gradient_clipping"):
            if is_overridden(hook, module):
                raise translate.refuse(f"{type(module).__name__}.{hook} is overridden",
                                       "the engine runs the backward and clips the sharded gradients itself")
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise translate.refuse(f"configure_optimizers returns {len(optimizers)} optimizers",
                                   "the engine steps one optimizer")
        translate.check_scheduler(self.config, schedulers)
        cfg, groups = translate.engine_config(
            self.config, optimizers[0], module, accumulate=trainer.accumulate_grad_batches,
            automatic=module.automatic_optimization, clip_val=trainer.gradient_clip_val,
            clip_algorithm=trainer.gradient_clip_algorithm, accelerator=self.root_device.type)
        engine = initialize(module, cfg, group=self._group, param_groups=groups)
        if engine.device != self.root_device:
            raise translate.refuse(f"the engine's device {engine.device}", f"Lightning's is {self.root_device}")
        self.engine, self._optimizer = engine, WindowOptimizer(engine)
        for scheduler in schedulers:  # built on the module's optimizer: they now set the engine's groups
            scheduler.scheduler.optimizer = self._optimizer
        self._schedulers = schedulers

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The engine's backward. Under automatic optimization Lightning has already divided the loss by
        ``accumulate_grad_batches``, so only the fp16 loss scale is applied; under manual optimization the
        engine's own factor (the scale and 1/grad_accum_steps)."""
        if args or kwargs:
            raise translate.refuse("backward arguments", f"the engine's backward takes none, got {args} {kwargs}")
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.backward(closure_loss, window_share=not module.automatic_optimization)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The closure (``training_step`` and backward), the hooks before a step (at the window's end only),
        then ``engine.step()``: it updates at the end of the accumulation window, which must be where Lightning
        ends it."""
        if kwargs:
            raise translate.refuse(f"optimizer_step arguments {sorted(kwargs)}", "the engine's step takes none")
        module = model if model is not None else self.lightning_module
        result = closure()
        if module.automatic_optimization and result is None:
            raise translate.refuse("training_step returned None",
                                   "every batch of the engine's accumulation window needs its backward")
        trainer = module.trainer
        if self.engine.iteration.complete:  # once a window, before the step that updates, as under Lightning's
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)  # own accumulation
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if self.engine.step():
            self._optimizer._opt_called = True  # what torch's lr schedulers look for
        if module.automatic_optimization and self.engine.iteration.idle == trainer.fit_loop._should_accumulate():
            raise translate.refuse(
                f"batch {trainer.fit_loop.epoch_loop.batch_idx} of epoch {trainer.current_epoch}",
                "the engine's accumulation window and Lightning's disagree about where a step falls (an epoch "
                "whose batch count is not a multiple of accumulate_grad_batches)")
        return result

    # ---- collectives -------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        collectives.no_subgroup(group, "reduce")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return collectives.reduce(tensor, self._comm, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        collectives.no_subgroup(group, "all_gather")
        if sync_grads:
            raise translate.refuse("all_gather(sync_grads=True)", "no gradient flows back through this gather")
        return collectives.gather_rows(tensor, self._comm)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src, self._comm)

    def barrier(self, name: str | None = None) -> None:
        self._comm.barrier()

    # ---- state ---------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Collective: the module's state dict with whole fp32 parameters (``engine.full_state_dict``), on
        every rank; buffers as this rank holds them."""
        full = self.engine.full_state_dict()
        canonical = {id(p): n for n, p in self.engine.module.named_parameters()}
        aliases = {n: canonical[id(p)] for n, p in self.engine.module.named_parameters(remove_duplicate=False)}
        out = {}
        for name, value in self.engine.module.state_dict(keep_vars=True).items():
            out[name] = full[aliases[name]] if name in aliases else value.detach().clone()
        return out

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # sharded: in the engine's checkpoint

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (which the checkpoint loads into) is built in setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the engine

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Collective: ``filepath`` becomes a directory holding the engine's sharded HDF5 checkpoint (tag
        ``checkpoint``) and Lightning's own state without the weights and the optimizer state
        (``lightning.ckpt``, written by the checkpoint_io, as Lightning writes it)."""
        if storage_options is not None:
            raise translate.refuse("save_checkpoint(storage_options=...)", "the engine writes its own files")
        path = self.broadcast(os.fspath(filepath))
        self.engine.save_checkpoint(path, tag=TAG)
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            self.checkpoint_io.save_checkpoint(meta, os.path.join(path, METADATA))
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: the engine's checkpoint (at any world size and stage) and Lightning's state."""
        path = self.broadcast(os.fspath(checkpoint_path))
        if not os.path.isfile(os.path.join(path, METADATA)):
            raise translate.refuse(f"checkpoint {path}", f"not a ZeroMPIStrategy checkpoint (no {METADATA})")
        self.engine.load_checkpoint(path, TAG)
        return self.checkpoint_io.load_checkpoint(os.path.join(path, METADATA), weights_only=weights_only)

    def teardown(self) -> None:
        """The engine stays (a later validate, test or save uses it; ``close()`` ends it): nothing is moved."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def close(self) -> None:
        """Collective: close the engine (its hooks, threads) and the strategy's communicator."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._comm.free()
