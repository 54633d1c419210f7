"""What a Lightning run asks of the engine, translated into a ZeroConfig, or refused by name.

Lightning keeps some settings in the Trainer (``accumulate_grad_batches``, ``gradient_clip_val``,
``precision``) and the optimizer in ``configure_optimizers``; zerompi keeps them in the config.
Each one is taken over where the translation is exact, and refused where the two disagree or
where the engine has no counterpart, so that nothing is silently trained another way.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from zerompi.config import ZeroConfig
from zerompi.config.choices import Device, Schedule
from zerompi.errors import UsageError

OPTIMIZER_KEYS = ("optimizer", "optimizer_kwargs", "lr", "betas", "eps", "weight_decay", "momentum")
"""The config keys ``configure_optimizers`` decides; the strategy's config must leave them unset."""


def refuse(what: str, why: str) -> UsageError:
    return UsageError(f"ZeroMPIStrategy: {what}: {why}")


def check_optimizer_keys_unset(cfg: ZeroConfig) -> None:
    """The optimizer comes from ``configure_optimizers``: a config that sets one too is refused."""
    default = ZeroConfig()
    set_here = [k for k in OPTIMIZER_KEYS if getattr(cfg, k) != getattr(default, k)]
    if set_here:
        raise refuse(f"the config sets {', '.join(set_here)}",
                     "the optimizer and its options come from the LightningModule's configure_optimizers; "
                     "leave these keys at their defaults")


def optimizer_keys(optimizer: torch.optim.Optimizer, module: nn.Module) -> tuple[dict[str, Any], list[dict]]:
    """``configure_optimizers``' optimizer as config changes (its class, ``lr``, its other options) and
    param groups over ``module``'s trainable parameters (each group's options as the optimizer holds
    them, so what an lr scheduler wrote there at its construction is kept)."""
    cls = type(optimizer)
    defaults = dict(optimizer.defaults)
    lr = defaults.pop("lr", None)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise refuse(f"{cls.__name__}(lr={lr!r})", "the learning rate must be a Python number")
    accepted = set(inspect.signature(cls).parameters) - {"params", "lr"}
    kwargs = {k: v for k, v in defaults.items() if k in accepted}  # the rest the constructor sets itself
    owned = {id(p) for p in module.parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        strangers = [p for p in params if id(p) not in owned]
        if strangers:
            raise refuse(f"{cls.__name__}.param_groups[{i}]",
                         f"{len(strangers)} parameters are not the LightningModule's own")
        options = {k: v for k, v in group.items() if k != "params"}
        if isinstance(options.get("lr"), torch.Tensor):
            raise refuse(f"{cls.__name__}.param_groups[{i}]['lr'] is a tensor", "the engine takes a number")
        groups.append({"params": [p for p in params if p.requires_grad], **options})
    groups = [g for g in groups if g["params"]]
    return {"optimizer": cls, "optimizer_kwargs": kwargs, "lr": float(lr)}, groups


def accumulation(cfg: ZeroConfig, accumulate_grad_batches: int, automatic: bool) -> int:
    """The engine's window: Lightning's ``accumulate_grad_batches``, or the config's where Lightning
    leaves it at 1 under manual optimization (Lightning accumulates nothing itself there)."""
    if not automatic:
        return cfg.grad_accum_steps
    if cfg.grad_accum_steps not in (1, accumulate_grad_batches):
        raise refuse(f"Trainer(accumulate_grad_batches={accumulate_grad_batches}) and "
                     f"ZeroConfig(grad_accum_steps={cfg.grad_accum_steps})",
                     "they disagree; set one of them (the Trainer's is taken over)")
    return accumulate_grad_batches


def clipping(cfg: ZeroConfig, clip_val: float | None, algorithm: Any) -> float | None:
    """The engine clips the global gradient norm: the Trainer's ``gradient_clip_val`` becomes
    ``clip_grad_norm`` (clipping by value has no counterpart: the gradients are sharded)."""
    if not clip_val:
        return cfg.clip_grad_norm
    name = getattr(algorithm, "value", algorithm)
    if name not in (None, "norm"):
        raise refuse(f"Trainer(gradient_clip_algorithm={name!r})",
                     "the engine clips the global norm of the sharded gradients only ('norm')")
    if cfg.clip_grad_norm not in (None, float(clip_val)):
        raise refuse(f"Trainer(gradient_clip_val={clip_val}) and ZeroConfig(clip_grad_norm={cfg.clip_grad_norm})",
                     "they disagree; set one of them")
    return float(clip_val)


def device_key(cfg: ZeroConfig, accelerator: str) -> Device:
    """The config's ``device`` for Lightning's accelerator ('cpu' or 'cuda'); a contradiction is refused."""
    wanted = Device.CPU if accelerator == "cpu" else Device.CUDA
    if cfg.device not in (Device.AUTO, wanted):
        raise refuse(f"ZeroConfig(device={cfg.device.value!r}) with Lightning's {accelerator} accelerator",
                     "they disagree")
    return wanted


def engine_config(cfg: ZeroConfig, optimizer: torch.optim.Optimizer, module: nn.Module, *, accumulate: int,
                  automatic: bool, clip_val: float | None, clip_algorithm: Any,
                  accelerator: str) -> tuple[ZeroConfig, list[dict]]:
    """The config the engine runs with, and its param groups."""
    check_optimizer_keys_unset(cfg)
    if cfg.micro_batches is not None:
        raise refuse(f"ZeroConfig(micro_batches={cfg.micro_batches})",
                     "Lightning's sampler deals the global batch to the ranks; micro_batches would deal it again")
    if cfg.fault_tolerance:
        raise refuse("ZeroConfig(fault_tolerance=True)",
                     "a rebuilt engine over fewer ranks would leave Lightning's ranks and sampler behind")
    changes, groups = optimizer_keys(optimizer, module)
    changes.update(grad_accum_steps=accumulation(cfg, accumulate, automatic),
                   clip_grad_norm=clipping(cfg, clip_val, clip_algorithm),
                   device=device_key(cfg, accelerator))
    return cfg.replace(**changes), groups


def check_scheduler(cfg: ZeroConfig, schedulers: list) -> None:
    """One scheduler at most: Lightning's (from configure_optimizers) or the config's, not both."""
    if schedulers and cfg.lr_schedule != Schedule.CONSTANT:
        raise refuse(f"configure_optimizers returns an lr scheduler and ZeroConfig(lr_schedule="
                     f"{cfg.lr_schedule.value!r})", "both would set the learning rate; keep one")
