"""``deepspeed.ops.adam``: FusedAdam and DeepSpeedCPUAdam, as classes scripts construct.

Passed to ``deepspeed.initialize(optimizer=...)`` they become the engine's optimizer on its
shards: torch's AdamW (``adam_w_mode``/``adamw_mode`` True, the default) or Adam with the
same hyperparameters, which is the arithmetic DeepSpeed's kernels implement, and with
``bias_correction=False`` zerompi's UncorrectedAdam (optim/adam.py). Stepped by
themselves (outside an engine) they run that optimizer. What those kernels offer
beyond it is refused: ``amsgrad`` (FusedAdam refuses it too), 16-bit optimizer states.
"""
from __future__ import annotations

from typing import Any

import torch

from zerompi.errors import UsageError
from zerompi.optim.adam import PATH, UncorrectedAdam

__all__ = ["DeepSpeedAdam", "DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedAdam(torch.optim.Optimizer):
    """Adam(W) under DeepSpeed's names: hyperparameters in ``defaults``, AdamW or Adam by ``adamw``."""

    def __init__(self, params: Any, lr: float, bias_correction: bool, betas: tuple[float, float], eps: float,
                 weight_decay: float, adamw: bool, amsgrad: bool):
        name = type(self).__name__
        if amsgrad:
            raise UsageError(f"{name}(amsgrad=True) is not supported (DeepSpeed's kernels have no AMSGrad)")
        options = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                       weight_decay=weight_decay)
        if not bias_correction:
            options["decoupled"] = adamw  # UncorrectedAdam's switch between AdamW and Adam
        super().__init__(params, options)
        self.adamw, self.bias_correction = adamw, bool(bias_correction)
        self._inner: torch.optim.Optimizer | None = None

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """The optimizer with this one's arithmetic."""
        if not self.bias_correction:
            return UncorrectedAdam
        return torch.optim.AdamW if self.adamw else torch.optim.Adam

    @property
    def zerompi_name(self) -> str:
        """The engine's name for it (ZeroConfig.optimizer)."""
        return PATH if not self.bias_correction else "adamw" if self.adamw else "adam"

    def step(self, closure=None):
        """Outside an engine: torch's optimizer over these very param groups (built at the first step)."""
        if self._inner is None:
            self._inner = self.torch_class(self.param_groups)  # their keys are its options
            self.state = self._inner.state
        return self._inner.step(closure)


class FusedAdam(DeepSpeedAdam):
    """``deepspeed.ops.adam.FusedAdam``'s constructor."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, adam_w_mode, amsgrad)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(DeepSpeedAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``'s constructor (the master weights' device is the config's)."""

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if not fp32_optimizer_states:
            raise UsageError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: zerompi keeps "
                             "optimizer states in fp32")
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad)
        self.adamw_mode = adamw_mode
