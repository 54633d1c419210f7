"""The compression section: which collectives travel as block-wise integer codes (comm/codec.py).

``cfg.compression`` is the policy built from these keys once (shard/compression.py)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import GradQuant, WeightQuant


@dataclass(frozen=True)
class CompressionPolicy:
    """Which collectives travel as block-wise integer codes (comm/codec.py)."""

    weights: WeightQuant
    """Parameter all-gathers: none or int8."""
    grads: GradQuant
    """Gradient reduce-scatters: none, int8 or int4."""
    block: int
    """Values per fp32 scale."""
    error_feedback: bool
    """Carry each rank's gradient quantisation error to its next reduction."""

    @property
    def active(self) -> bool:
        """Any collective is quantized."""
        return self.weights.bits is not None or self.grads.bits is not None


@dataclass(frozen=True, kw_only=True)
class CompressionKeys:
    """The compression section's keys (ZeroConfig's fields) and its policy."""

    quantize_weights: WeightQuant = key(WeightQuant.NONE, checks.of(WeightQuant), policy="weights")
    """Stages 1-3: 'int8' sends parameter all-gathers as int8 codes with one fp32 scale per
    quant_block values (ZeRO++ qwZ): (1 + 4/quant_block) bytes an element instead of c. Each rank
    quantises its own shard once per step, after the update (and at initialize); stage 3's forward and
    backward gathers and the stage 1-2 gather after the step reuse it, and every rank, the owner
    included, computes with the decoded values. The fp32 master stays exact. 'none': as they are."""
    quantize_grads: GradQuant = key(GradQuant.NONE, checks.of(GradQuant), policy="grads")
    """Stages 1-3: 'int8' or 'int4' sends gradient reduce-scatters as int8 or int4 codes (two a byte)
    with one fp32 scale per quant_block values (ZeRO++ qgZ): an all-to-all of the codes, decoded and
    summed in fp32 in rank order, so results are reproducible. 'none': as they are."""
    quant_block: int = key(256, checks.quant_block, policy="block")
    """Values per quantisation scale, an even int in 2..65536: smaller blocks follow the data more
    closely (a value's error is at most half its block's step, max|x|/127 or /7) for 4 bytes of
    scale each."""
    grad_error_feedback: bool = key(False, checks.boolean, policy="error_feedback")
    """With quantize_grads: each rank keeps what quantisation dropped from its local gradient (an fp32
    residual as large as the gradient buckets, 4 bytes per parameter per rank, in memory whatever is
    offloaded) and adds it to the next reduction, so the error does not accumulate over steps. Saved
    in checkpoints; dropped, with a logged note, when a checkpoint is loaded at another world size or
    bucket layout."""

    @cached_property
    def compression(self) -> CompressionPolicy:
        """Quantized collectives."""
        return build(CompressionPolicy, self, CompressionKeys)
