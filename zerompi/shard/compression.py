"""Quantized communication of one bucket: its parameter shard as packed codes, its gradient reduction.

A bucket holds a :class:`WeightCodes` for its parameter shard when parameter
all-gathers are quantized (``quantize_weights``) and a :class:`GradCodes` when
its gradient reduce-scatters are (``quantize_grads``); without them it
communicates as before. Both carry comm/codec.py's packed chunks through
comm/compressed.py, so the byte counters see exactly what crosses.

Weights are encoded once per step, by their owner, from the compute-dtype shard
right after the optimizer updated it (``publish``) and at build from the initial
values; stage 3's forward and backward gathers (and prefetches) reuse that
encoding. Every rank, the owner included, computes with the decoded values, so
the replicas of stages 1-2 stay bitwise equal; the fp32 master is never touched.
With hpZ the node-local secondary copy is held packed too (one chunk per node),
refreshed by one cross-node all-gather of the packed shards per step, and the
forward and backward gathers inside the node decode it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerompi.config.sections import CompressionPolicy
from zerompi.comm.codec import BlockCodec
from zerompi.comm.compressed import CompressedGroup
from zerompi.comm.group import ProcessGroup, Work
from zerompi.shard.layout import BucketLayout


@dataclass(frozen=True)
class Compression:
    """What a bucket's collectives carry (ZeroConfig's ``compression`` policy, as codecs)."""

    weights: BlockCodec | None = None
    grads: BlockCodec | None = None
    error_feedback: bool = False

    @staticmethod
    def from_policy(policy: CompressionPolicy) -> "Compression":
        """The codecs of ZeroConfig's ``compression`` policy."""
        def codec(bits: int | None) -> BlockCodec | None:
            return None if bits is None else BlockCodec(bits, policy.block)
        return Compression(codec(policy.weights.bits), codec(policy.grads.bits), policy.error_feedback)


class WeightCodes:
    """This rank's parameter shard of one bucket as packed codes, and the gathers that decode them.

    Args:
        codec: the weight codec.
        groups: the bucket's groups (comm/topology.py's Groups: shard, gather, secondary).
        layout: the bucket's layout.
        rank: this rank in ``groups.shard``.
        full: the full compute-dtype parameters at build (the same on every rank).
        hpz: keep hpZ's node-local secondary copy (packed) as the source of gathers.
    """

    def __init__(self, codec: BlockCodec, groups, layout: BucketLayout, rank: int, full: torch.Tensor,
                 hpz: bool = False):
        self.codec, self.groups, self.chunk = codec, groups, layout.shard_numel
        own = layout.shard(rank)
        # Every rank holds the same initial values, so each packs its own shard (and, with hpZ, its
        # node's secondary block) locally: the same bytes the per-step refresh will produce.
        self.own = codec.encode(full[own.start:own.stop], self.chunk)
        self.secondary: torch.Tensor | None = None
        if hpz:
            self.secondary = codec.encode(full[groups.secondary_block(layout.padded_numel)], self.chunk)

    def decode_all(self, full: torch.Tensor) -> None:
        """Stages 1-2 at build: ``full`` becomes what the quantized gather after a step gives, decoded
        from every rank's chunk, computed locally since every rank holds the same initial values."""
        full.copy_(self.codec.decode(self.codec.encode(full, self.chunk), self.chunk).reshape(-1))

    def gather(self, out: torch.Tensor, *, async_op: bool = False, what: str = "") -> Work:
        """Stage 3: all-gather the packed shards (hpZ: the node's secondary copy) into ``out``, decoded."""
        source = self.secondary if self.secondary is not None else self.own
        return CompressedGroup(self.groups.gather, self.codec).all_gather(source, out, chunk=self.chunk,
                                                                         async_op=async_op, what=what)

    def publish(self, shard: torch.Tensor, full: torch.Tensor | None, what: str = "") -> None:
        """After the optimizer step: pack the updated ``shard``; gather it into ``full`` (stages 1-2,
        decoded on every rank) or into hpZ's secondary copy (packed)."""
        self.own = self.codec.encode(shard, self.chunk)
        if full is not None:
            CompressedGroup(self.groups.shard, self.codec).all_gather(self.own, full, chunk=self.chunk,
                                                                      what=what).wait()
        if self.secondary is not None:  # hpZ: the one cross-node all-gather of parameters per step
            CompressedGroup(self.groups.secondary, self.codec).all_gather_packed(self.own, self.secondary, what=what)

    def scales(self) -> torch.Tensor:
        """The fp32 scales of this rank's packed shard (one per block)."""
        return self.codec.split(self.own, self.chunk)[0].reshape(-1)

    @property
    def nbytes(self) -> int:
        return self.own.numel() + (self.secondary.numel() if self.secondary is not None else 0)


class GradCodes:
    """One bucket's gradient reduce-scatter as packed codes, with this rank's error-feedback residual.

    The residual is what quantisation dropped from this rank's last reduction of the bucket (fp32,
    the bucket's padded size: 4 bytes per parameter on every rank); the next reduction adds it to
    the gradient before encoding, so the dropped part is sent one step late instead of lost.
    """

    def __init__(self, codec: BlockCodec, group: ProcessGroup, numel: int, feedback: bool, device: torch.device):
        self.comm = CompressedGroup(group, codec)
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device) if feedback else None

    def reduce_scatter(self, full: torch.Tensor, *, async_op: bool = False, what: str = "") -> Work:
        """As the group's reduce_scatter: ``wait()`` gives this rank's summed chunk in fp32."""
        return self.comm.reduce_scatter(full, residual=self.residual, async_op=async_op, what=what)

    def forget(self) -> None:
        """A skipped step: its gradients are discarded, and so is what their quantisation dropped."""
        if self.residual is not None:
            self.residual.zero_()

    @property
    def nbytes(self) -> int:
        return 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
