"""What a script builds itself and hands to ``initialize``: an optimizer, a scheduler, a dataset.

DeepSpeed wraps the script's optimizer; zerompi's optimizer must run on its own flat
shards, so a built optimizer is *rebuilt* there: same class, same defaults, same param
groups (their options, ``lr`` and ``initial_lr`` included). Element-wise optimizers step
flat shards, others (Muon, Adafactor) whole tensors on their owners (optim/whole.py); what
the engine cannot run (LBFGS's closure, SparseAdam's sparse gradients) is refused. A built scheduler is re-pointed at the rebuilt optimizer: its state
(``base_lrs``, step counts) is the optimizer's no more than its own, so the learning
rates it sets follow the same sequence. A dataset becomes DeepSpeed's loader: each rank
its share through a DistributedSampler (shuffled, seed 0, as DeepSpeed's), micro-batches
of ``train_micro_batch_size_per_gpu``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from zerompi.compat.deepspeed.ops.adam import DeepSpeedAdam
from zerompi.config.checks import FIELD_ARGS
from zerompi.errors import ConfigError, UsageError
from zerompi.optim import kinds
from zerompi.torch_private import track_scheduler_steps

__all__ = ["optimizer_settings", "rebind_scheduler", "training_loader"]

_O = torch.optim
_NAMES = {_O.AdamW: "adamw", _O.Adam: "adam", _O.SGD: "sgd"}


def optimizer_settings(optimizer: Any, model: nn.Module) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ZeroConfig overrides and engine param groups that rebuild ``optimizer`` on the shards."""
    if isinstance(optimizer, DeepSpeedAdam):
        cls, name = optimizer.torch_class, optimizer.zerompi_name
    else:
        cls = type(optimizer)
        name = _NAMES.get(cls, cls)
        try:
            kinds.check_supported(cls, cls, key="optimizer")
        except ConfigError as e:
            raise UsageError(f"{e} (zerompi rebuilds the optimizer on its shards)") from None
    # Adagrad makes its (step 0) state at construction; any other state means it has stepped.
    if any(float(state.get("step", 1)) > 0 for state in optimizer.state.values()):
        raise UsageError(f"optimizer={type(optimizer).__name__} has already stepped: its state cannot move onto "
                         "the engine's shards; pass it to initialize before its first step")
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise UsageError("optimizer= holds parameters that are not the model's: build it on model.parameters()")
    defaults = optimizer.defaults
    fields = FIELD_ARGS.get(name, ("lr",)) if isinstance(name, str) else ("lr",)
    accepted = inspect.signature(cls).parameters
    overrides: dict[str, Any] = {"optimizer": name, **{k: defaults[k] for k in fields if k in defaults}}
    # Arguments left at the class's own default stay out, so the engine picks its kernel as for a config.
    overrides["optimizer_kwargs"] = {k: v for k, v in defaults.items() if k not in fields and k in accepted
                                     and v != accepted[k].default}
    groups = [{"params": list(g["params"]),
               **{k: v for k, v in g.items() if k != "params" and (k not in defaults or v != defaults[k])}}
              for g in optimizer.param_groups if g["params"]]  # DeepSpeed drops empty groups too
    return overrides, groups


def _nested(scheduler: Any) -> list[Any]:
    """The scheduler and those it drives (SequentialLR, ChainedScheduler)."""
    return [scheduler] + [s for inner in getattr(scheduler, "_schedulers", []) for s in _nested(inner)]


def rebind_scheduler(scheduler: Any, original: torch.optim.Optimizer | None) -> Callable:
    """A factory that re-points ``scheduler`` (built on ``original``) at the engine's optimizer."""
    name = type(scheduler).__name__
    if original is None:
        raise UsageError(f"lr_scheduler={name} object without optimizer=: a scheduler built beforehand drives an "
                         "optimizer the engine does not use; pass that optimizer as optimizer= too, or a callable "
                         "lr_scheduler(optimizer), or use the config's scheduler block")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError("lr_scheduler=ReduceLROnPlateau: the engine steps the scheduler without a metric; "
                         "step it yourself on engine.optimizer (pass a callable lr_scheduler that returns None)")
    if any(getattr(s, "optimizer", None) is not original for s in _nested(scheduler)):
        raise UsageError(f"lr_scheduler={name} was built on another optimizer than the one passed as optimizer=")

    def factory(optimizer: torch.optim.Optimizer):
        if len(optimizer.param_groups) != len(original.param_groups):
            raise UsageError(f"lr_scheduler={name}: the engine's optimizer has {len(optimizer.param_groups)} param "
                             f"groups, the scheduler's {len(original.param_groups)} (a group without trainable "
                             "parameters?)")
        for s in _nested(scheduler):
            s.optimizer = optimizer
        track_scheduler_steps(optimizer)
        return scheduler
    return factory


def training_loader(dataset: Any, micro_batch: int | None, rank: int, world: int,
                    collate_fn: Callable | None = None, drop_last: bool = False) -> DataLoader:
    """DeepSpeed's training loader: this rank's share of ``dataset`` in micro-batches."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UsageError(f"training_data={type(dataset).__name__}: give a map-style dataset (__getitem__ and "
                         "__len__), which DeepSpeed splits over the ranks; an iterable one must be split by the "
                         "script itself")
    if micro_batch is None:
        raise UsageError("training_data= needs the micro-batch size: give train_micro_batch_size_per_gpu "
                         "(or train_batch_size) in the config")
    # DeepSpeed's sampler; its epoch is never advanced there either, so every epoch has one order.
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # No worker processes: forking an MPI process is unsafe with several MPI libraries.
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=torch.cuda.is_available())
