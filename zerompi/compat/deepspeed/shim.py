"""DeepSpeed's training-script API over zerompi: change one import and run under mpiexec.

::

    import zerompi.deepspeed as deepspeed       # was: import deepspeed
    deepspeed.init_distributed()                # nothing to do: mpiexec started the ranks
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})

The config goes through ``config_from``'s translation (config.py): keys zerompi
cannot honour raise one ConfigError, tuning keys with no effect get one warning, and a
``scheduler`` block runs as DeepSpeed's own formulas (zerompi/compat/deepspeed/lr_schedules.py).
:class:`DeepSpeedEngine` is a thin wrapper rather than an Engine subclass, so that
DeepSpeed's spellings (``save_checkpoint`` returning True, ``load_checkpoint`` returning a
pair, batch-size getters) never change what :class:`zerompi.Engine` answers; the
zerompi engine is ``.engine``. What DeepSpeed offers beyond this (a user-built optimizer,
``training_data``, model parallelism) raises a UsageError saying what to do instead.
"""
from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerompi.checkpoint import safetensors, schema
from zerompi.config import Schedule, ZeroConfig
from zerompi.compat.deepspeed.config import translate_config, warning_text
from zerompi.compat.deepspeed.batch import Batch, complete_batch
from zerompi.config.files import read_document
from zerompi.engine import Engine
from zerompi.engine import initialize as zero_initialize
from zerompi.errors import UsageError, all_ranks_ok
from zerompi.compat.deepspeed.lr_schedules import scheduler_factory

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize"]

# initialize() keywords of DeepSpeed's that change nothing here (the ranks are already up).
_HARMLESS = ("dist_init_required", "distributed_port", "mesh_param")
# Keywords for what zerompi does not do, and what to do instead.
_REFUSED = {
    "training_data": "build the DataLoader yourself (each rank loads its own micro-batches); "
                     "initialize returns None in its place",
    "collate_fn": "build the DataLoader yourself",
    "mpu": "zerompi is data parallel only: no model-parallel unit",
}


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """Nothing to do: mpiexec started the ranks and MPI connects them (kept so scripts run unchanged)."""


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` command-line arguments."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configuration (run by zerompi)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train through the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    return parser


class DeepSpeedEngine:
    """The DeepSpeed engine methods a training loop uses, answered by a zerompi :class:`Engine`."""

    def __init__(self, engine: Engine, batch: Batch, gather_16bit_on_save: bool = False):
        self.engine = engine
        """The zerompi engine underneath."""
        self._batch = batch
        self._gather_16bit = gather_16bit_on_save  # stage3_gather_16bit_weights_on_model_save

    # ---- training ---------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward (floating inputs go to the engine's device and compute dtype)."""
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of this rank's mean micro-batch loss (scaled by 1/accumulation, as DeepSpeed does)."""
        if retain_graph:
            raise UsageError("backward(retain_graph=True) is not supported: the engine frees gathered "
                             "parameters and reduces gradients as backward runs")
        self.engine.backward(loss)
        return loss

    def step(self, lr_kwargs: Mapping | None = None) -> None:
        """Call after every backward: updates at the end of each accumulation window."""
        if lr_kwargs:
            raise UsageError(f"step(lr_kwargs={lr_kwargs!r}) is not supported: the scheduler steps by itself")
        self.engine.step()

    def zero_grad(self) -> None:
        """Nothing to do: the engine's step consumes the reduced gradients, and the next window
        starts from zero (kept so scripts that call it run unchanged)."""

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # ---- what a loop asks -------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def local_rank(self) -> int:
        return self.engine.local_rank

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, fp16 overflow skips included (as DeepSpeed counts)."""
        stats = self.engine.stats
        return stats.steps + stats.skipped_steps

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def gradient_accumulation_steps(self) -> int:
        return self._batch.accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch_value(self._batch.micro, "train_micro_batch_size_per_gpu")

    def train_batch_size(self) -> int:
        return self._batch_value(self._batch.train, "train_batch_size")

    def _batch_value(self, value: int | None, key: str) -> int:
        if value is None:
            raise UsageError(f"{key} is unknown: the config gives neither train_batch_size nor "
                             "train_micro_batch_size_per_gpu as a number (left out or 'auto')")
        return value

    # ---- checkpoints ------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> bool:
        """Collective: a zerompi checkpoint under ``save_dir/tag`` (default ``global_step{N}``, as
        DeepSpeed names it); ``client_state`` must be JSON-serialisable; ``exclude_frozen_parameters``
        leaves the frozen base out (``include_frozen=False``). Returns True. ``async_save`` (zerompi's)
        writes it on a background thread (Engine.save_checkpoint); ``wait_checkpoint()``."""
        if not save_latest:
            raise UsageError("save_checkpoint(save_latest=False) is not supported: zerompi always points "
                             "'latest' at the new checkpoint")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        self.engine.save_checkpoint(save_dir, tag, client_state if client_state is not None else {},
                                    include_frozen=not exclude_frozen_parameters, async_save=async_save)
        return True

    def wait_checkpoint(self) -> None:
        """Collective: wait for an asynchronous save (zerompi's Engine.wait_checkpoint)."""
        self.engine.wait_checkpoint()

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, Any]:
        """Collective: load ``load_dir/tag`` (``latest`` when None) at any world size; returns
        (its path, client_state), or (None, None) when ``tag`` is None and nothing was saved."""
        if not (load_module_strict and load_optimizer_states and load_lr_scheduler_states) or load_module_only:
            raise UsageError("load_checkpoint loads the whole state: the strict/optimizer/scheduler/module-only "
                             "switches are not supported (zerompi.checkpoint.load_full_state_dict reads the "
                             "weights alone)")
        latest = Path(load_dir) / schema.LATEST
        if tag is None:
            if not latest.exists():
                return None, None
            tag = latest.read_text().strip()
        client_state = self.engine.load_checkpoint(load_dir, tag)
        return os.path.join(os.fspath(load_dir), tag), client_state

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: rank 0 writes every parameter (tied ones once; the trainable ones alone with
        ``exclude_frozen_parameters``) and persistent buffer, whole, in the compute dtype, as
        safetensors under ``save_dir`` (no pickle: a ``.bin`` name is refused).
        At stage 3 only with ``stage3_gather_16bit_weights_on_model_save``, as DeepSpeed: otherwise
        it warns and writes nothing. Returns whether it wrote."""
        if Path(save_filename).suffix != ".safetensors":
            raise UsageError(f"save_16bit_model(save_filename={save_filename!r}): zerompi writes safetensors, "
                             "never pickles; use a name ending in .safetensors (transformers loads "
                             "model.safetensors)")
        if self.engine.config.stage == 3 and not self._gather_16bit:
            warnings.warn("save_16bit_model at stage 3 writes nothing unless the config sets "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (as in DeepSpeed)",
                          stacklevel=2)
            return False
        full = self.engine.full_state_dict()  # collective: fp32, every rank
        dtype = self.engine.config.torch_dtype
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        tensors = {n: t.to(dtype) for n, t in full.items() if not (exclude_frozen_parameters and n in frozen)}
        keep = set(self.module.state_dict(keep_vars=True))  # persistent buffers (no data is read)
        tensors.update({n: b.detach().cpu() for n, b in self.module.named_buffers() if n in keep})
        error = None
        if self.global_rank == 0:
            try:
                Path(save_dir).mkdir(parents=True, exist_ok=True)
                entries = [safetensors.Entry(n, tuple(t.shape), safetensors.CODES[str(t.dtype).removeprefix("torch.")])
                           for n, t in tensors.items()]
                safetensors.write(Path(save_dir) / save_filename, entries,
                                  lambda n: memoryview(tensors[n].reshape(-1).contiguous().view(torch.uint8).numpy()).cast("B"))
            except (OSError, KeyError) as e:
                error = f"save_16bit_model: {type(e).__name__}: {e}"
        all_ranks_ok(self.engine.group, error)
        return True

    def close(self) -> None:
        self.engine.close()


def _config_document(config: Any, options: dict[str, Any]) -> Mapping[str, Any]:
    """The DeepSpeed config from ``config``, DeepSpeed's ``config_params`` or ``args.deepspeed_config``."""
    params, args = options.pop("config_params", None), options.pop("args", None)
    if config is not None and params is not None:
        raise UsageError("give the DeepSpeed config once: config= or config_params=, not both")
    config = config if config is not None else params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise UsageError("no DeepSpeed config: pass config= (a dict or a JSON file path) or "
                         "args with deepspeed_config")
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        return read_document(config).doc
    raise UsageError(f"config={config!r} is neither a dict nor a path to a JSON file")


def _param_groups(model: nn.Module, model_parameters: Any) -> list[dict[str, Any]] | None:
    """DeepSpeed's ``model_parameters`` (parameters or param-group dicts) as engine param groups."""
    if model_parameters is None:
        return None
    if not isinstance(model_parameters, Iterable):
        raise UsageError(f"model_parameters={model_parameters!r} is not an iterable of parameters "
                         "or of param-group dicts")
    items = list(model_parameters)
    if items and all(isinstance(g, Mapping) for g in items):
        return [{**g, "params": list(g["params"])} if "params" in g else dict(g) for g in items]
    if all(isinstance(p, torch.Tensor) for p in items):
        return [{"params": items}]
    raise UsageError("model_parameters mixes parameters and param-group dicts: give one kind")


def _scheduler(lr_scheduler: Any, cfg: ZeroConfig, schedule):
    """The engine's scheduler factory: the caller's callable, else the config's scheduler block."""
    built = hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")
    if lr_scheduler is not None and (built or not callable(lr_scheduler)):
        raise UsageError(f"lr_scheduler={type(lr_scheduler).__name__} object is not supported: a scheduler built "
                         "beforehand drives an optimizer the engine does not use; pass a callable "
                         "lr_scheduler(optimizer) that builds it on the optimizer it is given, or use the "
                         "config's scheduler block")
    chosen = lr_scheduler or (scheduler_factory(schedule) if schedule is not None else None)
    if chosen is not None and cfg.lr_schedule != Schedule.CONSTANT:
        raise UsageError(f"lr_schedule={cfg.lr_schedule!r} and a DeepSpeed scheduler are both given: keep one")
    return chosen


def _world_size(comm) -> int:
    if comm is not None:
        return comm.Get_size()
    from zerompi.comm.mpi import world_size
    return world_size()


def initialize(model: nn.Module | None = None, model_parameters: Any = None, config: Any = None,
               lr_scheduler: Any = None, optimizer: Any = None, **options: Any):
    """Collective: ``deepspeed.initialize`` over zerompi; returns ``(engine, optimizer, None, lr_scheduler)``.

    ``model_parameters`` (parameters, or param-group dicts) become the optimizer's param
    groups; every trainable parameter must be in one. ``lr_scheduler`` may be a callable
    ``lr_scheduler(optimizer)``; it replaces the config's scheduler block, as in DeepSpeed.
    The optimizer comes from the config's ``optimizer`` block. Options beyond DeepSpeed's:
    ``comm`` (an mpi4py communicator, MPI.COMM_WORLD by default) and ``overrides`` (ZeroConfig
    field values applied on top of the translation, which also resolve "auto" values).
    """
    if model is None:
        raise UsageError("initialize(model=...) is required")
    if optimizer is not None:
        raise UsageError("optimizer= is not supported: zerompi builds the optimizer on its own shards; "
                         "describe it in the config's optimizer block (type Adam, AdamW or SGD, and params)")
    doc = _config_document(config, options)
    comm, overrides = options.pop("comm", None), dict(options.pop("overrides", None) or {})
    refused = {k: v for k, v in options.items() if k in _REFUSED and v is not None}
    unknown = sorted(k for k in options if k not in _REFUSED and k not in _HARMLESS)
    if refused or unknown:
        raise UsageError("initialize() cannot honour: " + "; ".join(
            [f"{k}= ({_REFUSED[k]})" for k in refused] + [f"{k}= (unknown keyword)" for k in unknown]))
    cfg, t = translate_config(doc, model, overrides)
    explicit_accum = t.batch.accum is not None or "grad_accum_steps" in overrides
    batch = complete_batch(t.batch._replace(accum=cfg.grad_accum_steps if explicit_accum else None),
                           _world_size(comm))
    if batch.accum != cfg.grad_accum_steps:
        cfg = cfg.replace(grad_accum_steps=batch.accum)
    text = warning_text(t, cfg.lr, schedule_applied=True)
    if text:
        warnings.warn(text, stacklevel=2)
    engine = zero_initialize(model, cfg, comm=comm, param_groups=_param_groups(model, model_parameters),
                             lr_scheduler=_scheduler(lr_scheduler, cfg, t.schedule))
    return DeepSpeedEngine(engine, batch, t.gather_16bit), engine.optimizer, None, engine.lr_scheduler

