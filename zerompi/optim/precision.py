"""Dynamic loss scaling for fp16: the scale every rank applies to its loss.

Semantics follow the ones fp16 users know from DeepSpeed's config keys:
start at ``2**initial_scale_power``; an overflow on any rank skips the step on
every rank; after ``hysteresis`` overflows the scale halves (never below
``min_loss_scale``); after ``loss_scale_window`` clean steps it doubles and
the hysteresis budget is restored. An overflow with the scale already at its
minimum cannot be cured by scaling, so it raises instead of looping forever.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerompi.config.sections import PrecisionPolicy
from zerompi.errors import ConfigError, ZeroMPIError


@dataclass
class LossScaler:
    """Loss-scale state; ``update(overflow)`` after each step's global overflow check."""

    scale: float
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int | None = None  # overflows left before halving; starts at ``hysteresis``

    def __post_init__(self) -> None:
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis

    @classmethod
    def from_policy(cls, cfg: PrecisionPolicy) -> "LossScaler":
        """The scaler an fp16 policy asks for (``ZeroConfig.precision``)."""
        if cfg.loss_scale > 0:
            return cls(scale=float(cfg.loss_scale), dynamic=False)
        if 2 ** cfg.initial_scale_power < cfg.min_loss_scale:
            raise ConfigError(f"initial_scale_power={cfg.initial_scale_power} starts the loss scale below "
                              f"min_loss_scale={cfg.min_loss_scale:g}; raise it or lower min_loss_scale")
        return cls(scale=float(2 ** cfg.initial_scale_power), window=cfg.loss_scale_window,
                   hysteresis=cfg.hysteresis, min_scale=cfg.min_loss_scale)

    def update(self, overflow: bool) -> None:
        if not overflow:
            self.good_steps += 1
            if self.dynamic and self.good_steps % self.window == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis
            return
        self.good_steps = 0
        if not self.dynamic:
            return
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            return
        if self.scale <= self.min_scale:
            raise ZeroMPIError(
                f"fp16 gradients overflowed with the loss scale already at its minimum "
                f"({self.min_scale:g}); the model diverged or fp16 cannot represent it: "
                "lower the learning rate, clip gradients, or train in bf16")
        self.scale = max(self.scale / 2.0, self.min_scale)
