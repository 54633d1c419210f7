"""GradShard: this rank's reduced gradient of one bucket, wherever its tier keeps it.

The shard is written by the bucket's reductions and read once per step by the
optimizer, which asks for two things: the squared norm (for clipping and the
overflow check) and the gradient itself in fp32, unscaled and clipped. Both
come from here, the same way whatever the tier:

* a resident shard converts to fp32 once per step (a view when it already is
  fp32 on the master's device), unscales in place, and takes its norm from that;
* a swapped shard keeps its squared norm from the last reduction, since the
  gradient is in memory only inside a ``loaded()`` block, and is read back,
  unscaled and clipped when its bucket's turn in the step comes.
"""
from __future__ import annotations

import torch

from zerompi.blockio.aligned import release
from zerompi.offload.tiers import ShardTier


NORM_CHUNK = 1024
"""reproducible=True: elements per chunk of the exact gradient norm (shards are whole chunks)."""


class GradShard:
    """The reduced gradient shard of one bucket (stages 2-3 accumulate micro-batches into it;
    stages 0-1 overwrite it once per window with the reduction of the local sum)."""

    def __init__(self, tier: ShardTier, numel: int, master_device: torch.device):
        self.tier = tier
        self.numel = numel
        self.master_device = master_device
        self.fresh = True     # no reduction since the last step: the shard holds nothing of use
        self._sq = 0.0        # squared norm after the last reduction (swapped tiers only)
        self._fp32: torch.Tensor | None = None  # this step's unscaled fp32 gradient (resident, or kept by write)

    def write(self, reduced: torch.Tensor, *, accumulate: bool, taken_next: bool = False) -> None:
        """Store a reduction: added to what earlier micro-batches left (``accumulate``), or in
        place of it. Zeros, then add, is the arithmetic of a freshly zeroed shard, so results do
        not depend on the tier. ``taken_next``: the update takes this gradient before anything
        else touches it (optimizer_in_backward), so a swapped shard keeps its fp32 copy in memory
        for ``take`` instead of a round trip through the swap file."""
        with self.tier.loaded(load=accumulate and not self.fresh) as shard:
            reduced = reduced.to(shard.device, non_blocking=False)  # a swapped shard is in host memory
            if not accumulate:
                shard.copy_(reduced)
            else:
                if self.fresh:
                    shard.zero_()
                shard.add_(reduced)
            keep = taken_next and not self.tier.stays_resident
            if not self.tier.stays_resident:  # the step will not see this gradient before its turn
                # kept: the shard's own memory when it is fp32 already (released from the tier
                # below, it lives on in ``g``), else an fp32 copy
                g = shard.detach() if keep and shard.dtype == torch.float32 and \
                    shard.device == self.master_device else shard.to(self.master_device, torch.float32)
                self._sq = float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
            if keep:
                self._fp32 = g
            else:
                self.tier.store()
        self.fresh = False

    def filled_in_place(self) -> None:
        """A reduction wrote the (resident) shard directly: stage 0's whole-buffer all-reduce."""
        self.fresh = False

    def _resident_fp32(self, scale: float) -> torch.Tensor:
        if self._fp32 is None:
            with self.tier.loaded() as shard:
                g = shard.to(self.master_device, torch.float32)
            if scale != 1.0:
                g.div_(scale)
            self._fp32 = g
        return self._fp32

    def norm_sq(self, scale: float) -> float:
        """The squared L2 norm of the unscaled gradient (``scale`` is the fp16 loss scale)."""
        if self.fresh:
            return 0.0
        if self.tier.stays_resident:
            return float(torch.linalg.vector_norm(self._resident_fp32(scale), dtype=torch.float32)) ** 2
        return self._sq / (scale * scale)  # exact for the power-of-two scales of dynamic scaling

    def take(self, scale: float, coef: float) -> torch.Tensor:
        """The fp32 gradient for the update: unscaled, times the clip coefficient when below 1."""
        if self.tier.stays_resident and not self.fresh:
            g = self._resident_fp32(scale)
        else:  # kept by write(taken_next=True), else zeros or a copy read back from the tier
            g = self._fp32 if self._fp32 is not None else self.peek()
            if scale != 1.0:
                g.div_(scale)
        if coef < 1.0:
            g.mul_(coef)
        return g

    def prefetch(self) -> None:
        """Start reading a swapped-out gradient, so that ``take`` finds it in memory."""
        if not self.fresh and not self.tier.stays_resident:
            self.tier.prefetch()

    def peek(self) -> torch.Tensor:
        """The current gradient in fp32 (zeros when fresh), without the step's caching."""
        if self.fresh:
            return torch.zeros(self.numel, dtype=torch.float32, device=self.master_device)
        with self.tier.loaded() as shard:
            return shard.to(self.master_device, torch.float32, copy=not self.tier.stays_resident)

    def chunk_sq(self, chunk: int = NORM_CHUNK) -> torch.Tensor:
        """The fp64 sum of squares of each ``chunk`` elements of the gradient (a power of two), added as a
        fixed pairwise tree: halves added element-wise, log2(chunk) times. Element-wise adds round the same
        on every device whatever the number of chunks, where a reduction kernel's order need not (CUDA's
        cumsum changed the last bit with the shard's length: benchmarks/results/reproducible_cuda_h200.log).
        Every fp32 square is exact in fp64; reproducible=True adds the chunk sums with math.fsum, exactly."""
        sums = self.peek().double().square_().view(-1, chunk)
        while sums.shape[1] > 1:
            half = sums.shape[1] // 2
            sums = sums[:, :half] + sums[:, half:]
        return sums[:, 0].contiguous()

    def zero(self) -> None:
        """After a step (or a skipped one): the next reduction starts the shard afresh."""
        if self._fp32 is not None and not self.tier.stays_resident:  # write(taken_next=True)'s own copy
            release(self._fp32, self.tier.memory)  # its memory may serve the next shard
        self.fresh, self._sq, self._fp32 = True, 0.0, None

    @property
    def nbytes(self) -> int:
        return self.tier.nbytes
