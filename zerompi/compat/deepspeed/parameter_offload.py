"""``engine.optimizer.parameter_offload`` of a stage-3 engine: the surface through which frameworks take
DeepSpeed 0.19.8's ZeRO-3 module hooks off and put them back.

TRL's ``unwrap_model_for_generation`` (1.16, used by GRPO, RLOO, GKD and online DPO) gathers the whole model
with ``GatheredParameters`` and then calls ``remove_hooks(model)``: it clears each parameter's
``ds_active_sub_modules``, removes ``parameter_offload.forward_hooks`` and ``backward_hooks``, generates, and
calls ``add_hooks(model)``, which registers them again through ``_register_deepspeed_module(module)``.
Generation runs a different number of forwards on each rank (each stops when its own sequences end), so
gathering units in those forwards would meet no partner. Here removing the hooks pauses the engine's forward
hooks (shard/hooks.py) and registering them resumes them; the parameters are whole in the block meanwhile.
"""
from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["ParameterOffload", "mark"]


class _Pause:
    """What ``forward_hooks`` holds: removing it pauses the engine's forward hooks."""

    def __init__(self, hooks) -> None:
        self._hooks = hooks

    def remove(self) -> None:
        self._hooks.paused = True


class _Module:
    """The module as DeepSpeed's hooks see it: its parameters, and no external ones."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self._module.named_parameters(prefix=prefix, recurse=recurse)

    def ds_external_parameters(self) -> list:
        return []


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as frameworks touch it: ``module``, ``forward_hooks``,
    ``backward_hooks`` and ``_register_deepspeed_module``."""

    def __init__(self, module: nn.Module, hooks) -> None:
        self.module = _Module(module)
        self._hooks = hooks
        self.forward_hooks: list = [_Pause(hooks)]
        self.backward_hooks: list = []  # zerompi's backward hooks fire only in a backward, and generation has none
        for p in module.parameters():
            p.ds_active_sub_modules = set()  # DeepSpeed's per-parameter record of the modules using it: none here

    def _register_deepspeed_module(self, module) -> None:  # the name DeepSpeed (>= 0.16.4) and TRL use
        self._hooks.paused = False
        self.forward_hooks = [_Pause(self._hooks)]


def mark(engine) -> None:
    """Give a stage-3 engine's optimizer its ``parameter_offload`` (DeepSpeed's ZeRO-3 optimizer has one)."""
    if int(engine.config.stage) != 3 or engine.optimizer is None:
        return
    engine.optimizer.parameter_offload = ParameterOffload(engine.module, engine.sharded.hooks)
