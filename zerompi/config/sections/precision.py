"""The precision section: the compute dtype, floating buffers and fp16 loss scaling.

``cfg.precision`` is the policy built from these keys once (optim/precision.py, the shard placement)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import BufferDType, DType


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype and fp16 loss scaling."""

    dtype: DType
    """Parameter/gradient compute dtype; master weights are fp32."""
    loss_scale: float
    """fp16: 0 selects dynamic loss scaling, > 0 is a static scale."""
    initial_scale_power: int
    """Dynamic loss scaling starts at 2**initial_scale_power."""
    loss_scale_window: int
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int
    """Overflows tolerated before the dynamic scale halves."""
    min_loss_scale: float
    """Floor of the dynamic loss scale."""
    buffer_dtype: BufferDType = BufferDType.COMPUTE
    """Floating buffers cast to the compute dtype, or each kept in its own."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch.dtype."""
        return self.dtype.torch

    @property
    def scales_loss(self) -> bool:
        """fp16 needs a loss scaler; fp32 and bf16 do not."""
        return self.dtype is DType.FP16

    @property
    def dynamic_scale(self) -> bool:
        """fp16 with a scale that adapts to overflows (loss_scale == 0)."""
        return self.scales_loss and self.loss_scale == 0


@dataclass(frozen=True, kw_only=True)
class PrecisionKeys:
    """The precision section's keys (ZeroConfig's fields) and its policy."""

    dtype: DType = key(DType.FP32, checks.of(DType))
    """Parameter/gradient compute dtype: 'fp32', 'bf16', 'fp16'; master weights are fp32."""
    buffer_dtype: BufferDType = key(BufferDType.COMPUTE, checks.of(BufferDType))
    """Floating buffers: 'compute' casts them to ``dtype``; 'model' keeps each one's own (DeepSpeed's way)."""
    loss_scale: float = key(0.0, checks.nonnegative, spelled={"DeepSpeed": "fp16.loss_scale"})
    """fp16 only: 0 selects dynamic loss scaling, > 0 is a static scale."""
    initial_scale_power: int = key(16, checks.whole(0, 64), spelled={"DeepSpeed": "fp16.initial_scale_power"})
    """Dynamic loss scaling starts at 2**initial_scale_power; 0..64."""
    loss_scale_window: int = key(1000, checks.whole(1), spelled={"DeepSpeed": "fp16.loss_scale_window"})
    """Steps without overflow before the dynamic scale doubles, >= 1."""
    hysteresis: int = key(2, checks.whole(1), spelled={"DeepSpeed": "fp16.hysteresis"})
    """Overflows tolerated before the dynamic scale halves, >= 1."""
    min_loss_scale: float = key(1.0, checks.positive, spelled={"DeepSpeed": "fp16.min_loss_scale"})
    """Floor of the dynamic loss scale, > 0."""

    @cached_property
    def precision(self) -> PrecisionPolicy:
        """Compute dtype, buffers and fp16 loss scaling."""
        return build(PrecisionPolicy, self, PrecisionKeys)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch.dtype."""
        return self.dtype.torch
