"""DeepSpeed's training-script API over zerompi: change one import and run under mpiexec.

::

    import zerompi.deepspeed as deepspeed       # was: import deepspeed
    deepspeed.init_distributed()                # MPI started the ranks: this only learns where they run
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json", training_data=dataset)
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})

The config goes through ``config_from``'s translation (config.py): keys zerompi
cannot honour raise one ConfigError, tuning keys with no effect get one warning, and a
``scheduler`` block runs as DeepSpeed's own formulas (zerompi/compat/deepspeed/lr_schedules.py).
An optimizer, scheduler or dataset the script built itself is rebuilt, re-pointed or
split over the ranks by client.py; the engine object is engine.py's :class:`DeepSpeedEngine`.
What DeepSpeed offers beyond this (model parallelism, an optimizer that is not
element-wise) raises a UsageError saying what to do instead.
"""
from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zerompi.compat.deepspeed import client
from zerompi.compat.deepspeed import comm as ds_comm
from zerompi.compat.deepspeed import muon as ds_muon
from zerompi.compat.deepspeed.batch import complete_batch
from zerompi.compat.deepspeed.comm import init_distributed
from zerompi.compat.deepspeed.config import translate_config, warning_text
from zerompi.compat.deepspeed.engine import DeepSpeedEngine
from zerompi.compat.deepspeed.lr_schedules import scheduler_factory
from zerompi.config import Schedule, ZeroConfig
from zerompi.config.checks import boolean
from zerompi.config.files import read_document
from zerompi.entry import initialize as zero_initialize
from zerompi.errors import UsageError

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize"]

# initialize() keywords of DeepSpeed's that change nothing here (the ranks are already up).
_HARMLESS = ("dist_init_required", "distributed_port", "mesh_param")
# Keywords for what zerompi does not do, and what to do instead.
_REFUSED = {
    "mpu": "zerompi is data parallel only: no model-parallel unit",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` command-line arguments."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configuration (run by zerompi)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train through the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    return parser


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


def _scheduler(lr_scheduler: Any, optimizer: Any, cfg: ZeroConfig, schedule):
    """The engine's scheduler factory: the caller's (a callable, or a built scheduler re-pointed
    at the engine's optimizer), else the config's scheduler block."""
    if lr_scheduler is not None and hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict"):
        lr_scheduler = client.rebind_scheduler(lr_scheduler, optimizer)
    elif lr_scheduler is not None and not callable(lr_scheduler):
        raise UsageError(f"lr_scheduler={type(lr_scheduler).__name__} is neither a scheduler nor a callable "
                         "lr_scheduler(optimizer)")
    chosen = lr_scheduler or (scheduler_factory(schedule) if schedule is not None else None)
    if chosen is not None and cfg.lr_schedule != Schedule.CONSTANT:
        raise UsageError(f"lr_schedule={cfg.lr_schedule!r} and a DeepSpeed scheduler are both given: keep one")
    return chosen


@contextmanager
def _users_rng() -> Iterator[None]:
    """Torch's CPU generator, and the CUDA ones where CUDA is up, as they were before: what the
    engine draws or seeds while it starts does not reach the script."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _round_to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Round the model's floating parameters to the 16-bit compute dtype in place (keeping their dtype).

    DeepSpeed casts the module to bf16/fp16 before its optimizer copies the fp32 masters from it, so a
    parameter the script made in fp32 (a new reward or classifier head) starts its master rounded;
    zerompi's engine starts the master from the fp32 value. Without this, the first update of such a
    parameter differs from DeepSpeed's (DeepSpeed-Chat's reward model: its value head)."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype and p.device.type != "meta":
                p.copy_(p.to(dtype))


def _world_size(comm) -> int:
    if comm is not None:
        return comm.Get_size()
    return ds_comm.get_world_size()


def _own_options(options: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """``comm``, ``overrides`` and ``param_init`` taken out of ``initialize``'s keywords; DeepSpeed's
    that zerompi cannot honour, or unknown ones, refused by name."""
    comm, overrides = options.pop("comm", None), dict(options.pop("overrides", None) or {})
    param_init = options.pop("param_init", None)
    refused = {k: v for k, v in options.items() if k in _REFUSED and v is not None}
    unknown = sorted(k for k in options if k not in _REFUSED and k not in _HARMLESS)
    if refused or unknown:
        raise UsageError("initialize() cannot honour: " + "; ".join(
            [f"{k}= ({_REFUSED[k]})" for k in refused] + [f"{k}= (unknown keyword)" for k in unknown]))
    return comm, overrides, param_init


def initialize(model: nn.Module | None = None, model_parameters: Any = None, config: Any = None,
               lr_scheduler: Any = None, optimizer: Any = None, training_data: Any = None,
               collate_fn: Any = None, **options: Any):
    """Collective: ``deepspeed.initialize`` over zerompi; returns ``(engine, optimizer, loader, lr_scheduler)``.

    ``model_parameters`` (parameters, or param-group dicts) become the optimizer's param
    groups; every trainable parameter must be in one. The optimizer comes from the config's
    ``optimizer`` block, or is ``optimizer``, a built torch optimizer (element-wise: Adam,
    AdamW, SGD, ...) or ``deepspeed.ops.adam``'s, rebuilt on the engine's shards with its
    class, defaults and param groups (``model_parameters`` is then unused, as in DeepSpeed).
    ``lr_scheduler`` is a scheduler built on that optimizer (re-pointed at the engine's) or a
    callable ``lr_scheduler(optimizer)``; either replaces the config's scheduler block, as in
    DeepSpeed. ``training_data`` (a map-style dataset, with ``collate_fn``) gives the loader:
    this rank's share, in micro-batches. Options beyond DeepSpeed's: ``comm`` (an mpi4py
    communicator, MPI.COMM_WORLD by default), ``overrides`` (ZeroConfig field values applied on
    top of the translation, which also resolve "auto" values) and ``param_init`` (how modules
    built under ``deepspeed.zero.Init`` are initialised: zerompi.initialize's).
    Unlike zerompi.initialize, which seeds torch's generator with seed + rank, this leaves the
    script's generators as they were, as DeepSpeed does.
    """
    if model is None:
        raise UsageError("initialize(model=...) is required")
    doc = _config_document(config, options)
    comm, overrides, param_init = _own_options(options)
    param_groups = _param_groups(model, model_parameters)
    if optimizer is not None:
        if "optimizer" in doc:
            raise UsageError("optimizer= and the config's optimizer block both give the optimizer: keep one")
        settings, param_groups = client.optimizer_settings(optimizer, model)
        overrides = {**settings, **overrides}
    if comm is None:
        ds_comm.init_distributed()  # deepspeed.comm answers from here on, as after DeepSpeed's initialize
    cfg, t = translate_config(doc, model, overrides)
    if t.muon is not None:
        ds_muon.check(cfg.stage, cfg.clip_grad_norm, cfg.torch_dtype)
        param_groups = ds_muon.param_groups(model, param_groups, t.muon)
    if cfg.fault_tolerance:
        raise UsageError("overrides fault_tolerance=True is not offered through the DeepSpeed shim: a DeepSpeed "
                         "script deals its data itself (its DataLoader's sampler, fixed at the world size), which "
                         "the survivors of a lost rank could not deal again; allowed: fault_tolerance=False, or "
                         "zerompi.initialize with micro_batches and engine.micro_batch_indices()")
    explicit_accum = t.batch.accum is not None or "grad_accum_steps" in overrides
    batch = complete_batch(t.batch._replace(accum=cfg.grad_accum_steps if explicit_accum else None),
                           _world_size(comm))
    if batch.accum != cfg.grad_accum_steps:
        cfg = cfg.replace(grad_accum_steps=batch.accum)
    text = warning_text(t, cfg.lr, schedule_applied=True)
    if text:
        warnings.warn(text, stacklevel=2)
    _round_to_compute_dtype(model, cfg.torch_dtype)
    with _users_rng():  # DeepSpeed leaves torch's generators alone; zerompi.initialize seeds seed + rank
        engine = zero_initialize(model, cfg, comm=comm, param_groups=param_groups, param_init=param_init,
                                 lr_scheduler=_scheduler(lr_scheduler, optimizer, cfg, t.schedule))
    loader = None
    if training_data is not None:
        loader = client.training_loader(training_data, batch.micro, engine.rank, engine.world_size, collate_fn,
                                        boolean("dataloader_drop_last", doc.get("dataloader_drop_last", False)))
    return (DeepSpeedEngine(engine, batch, t.gather_16bit, loader, config=doc), engine.optimizer, loader,
            engine.lr_scheduler)
