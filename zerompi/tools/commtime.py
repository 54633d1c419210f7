"""Communication per step with quantized collectives, and an α-β projection of its time.

Per optimizer step (no accumulation) one rank takes part in, with S = ceil(Ψ/N)
elements per rank and c bytes per compute element:

    stages 1-2  gradient reduce-scatter + parameter all-gather
    stage 3  parameter all-gather x 2 (forward, backward) + gradient reduce-scatter

A collective moves one chunk per peer: S c bytes as they are, or the packed chunk
of comm/codec.py (codes + one fp32 scale per block: S (1 + 4/B) bytes for int8,
S (1/2 + 4/B) for int4) when quantized. The model is one bucket here; the engine
packs each bucket's shard, so its counters differ by the blocks' rounding.

Time, per collective, by the α-β (latency-bandwidth) model of a ring or
pairwise exchange: (N-1) messages of one chunk each, ``(N-1) (α + chunk / β)``,
with α the link latency and β its bandwidth; the step's communication time is
the sum over its collectives, nothing overlapped, and the codec's own work
(benchmarks/results/quantized-speed.md measures it) not counted.
"""
from __future__ import annotations

from typing import NamedTuple

from zerompi.errors import ConfigError
from zerompi.shard.stages import PLANS, plan_for

WEIGHT_CHOICES = ("none", "int8")
GRAD_CHOICES = ("none", "int8", "int4")
_BITS = {"none": None, "int8": 8, "int4": 4}


class Quantization(NamedTuple):
    """``quantize_weights``, ``quantize_grads`` and ``quant_block`` as ZeroConfig spells them."""

    weights: str = "none"
    grads: str = "none"
    block: int = 256

    def chunk_bytes(self, which: str, numel: int, c: int) -> int:
        """Bytes of one rank's chunk of ``numel`` elements in a ``which`` ('weights'/'grads') collective."""
        bits = _BITS[self.weights if which == "weights" else self.grads]
        if bits is None:
            return numel * c
        from zerompi.comm.codec import BlockCodec  # torch: imported only when something is quantized
        return BlockCodec(bits, self.block).nbytes(numel)


def check(weights: str, grads: str, block: int) -> Quantization:
    """Validated settings (ConfigError naming the flag otherwise)."""
    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"--quantize-weights {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    if grads not in GRAD_CHOICES:
        raise ConfigError(f"--quantize-grads {grads!r} is not one of {', '.join(GRAD_CHOICES)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2 or block > 65536:
        raise ConfigError(f"--quant-block {block!r} is not an even number in 2..65536")
    return Quantization(weights, grads, block)


def collectives(stage: int) -> list[tuple[str, str]]:
    """(collective kind, 'weights' or 'grads') of one step at ``stage``: the stage table's."""
    return list(plan_for(stage).step_collectives)


class StepComm(NamedTuple):
    """What one rank sends in one step, per collective kind, and the α-β time of it."""

    bytes_by_kind: dict[str, int]
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


def step_comm(shard: int, ranks: int, stage: int, c: int, q: Quantization, link: tuple[float, float],
              frozen: int = 0) -> StepComm:
    """Bytes sent per kind and projected seconds of one step; ``link`` = (bits per second, latency seconds);
    ``frozen``: elements of frozen parameters per rank, gathered with the rest at stage 3."""
    bandwidth, latency = link
    sent: dict[str, int] = {}
    seconds = 0.0
    for kind, which in collectives(stage):
        chunk = q.chunk_bytes(which, shard + (frozen if plan_for(stage).shard_params and which == "weights" else 0), c)
        name = kind if _BITS[getattr(q, which)] is None else f"{kind}.{getattr(q, which)}"
        sent[name] = sent.get(name, 0) + (ranks - 1) * chunk
        seconds += (ranks - 1) * (latency + 8 * chunk / bandwidth)
    return StepComm(sent, seconds)


def comm_rows(shard_of, ranks: list[int], c: int, q: Quantization, link: tuple[float, float],
              frozen_of=lambda n: 0) -> list[dict]:
    """For each world size and stage 1-3: bytes and α-β seconds per step, unquantized and with ``q``
    (``frozen_of(n)``: frozen elements per rank, which stage 3 gathers too)."""
    rows = []
    plain = Quantization(block=q.block)
    for n in ranks:
        for stage in (p.stage for p in PLANS.values() if p.shard_optimizer):
            shard, frozen = shard_of(n), frozen_of(n)
            base = step_comm(shard, n, stage, c, plain, link, frozen)
            ours = step_comm(shard, n, stage, c, q, link, frozen)
            rows.append(dict(ranks=n, stage=stage, bytes=ours.bytes, bytes_by_kind=ours.bytes_by_kind,
                             seconds=ours.seconds, unquantized_bytes=base.bytes, unquantized_seconds=base.seconds))
    return rows


def render(rows: list[dict], q: Quantization, link: tuple[float, float], num) -> list[str]:
    """The text section ``zerompi estimate`` prints for these rows (``num`` formats a number)."""
    gbps, latency = link
    lines = ["", f"Communication per rank per step with weights {q.weights}, gradients {q.grads} "
                 f"(block {q.block}), GB, and its α-β time at {num(gbps / 1e9)} Gb/s, {num(latency * 1e6)} µs "
                 "latency (unquantized in brackets):"]
    header = ["ranks", "stage", "GB", "ms", "of unquantized"]
    body = [[str(r["ranks"]), str(r["stage"]), f"{num(r['bytes'] / 1e9)} ({num(r['unquantized_bytes'] / 1e9)})",
             f"{num(r['seconds'] * 1e3)} ({num(r['unquantized_seconds'] * 1e3)})",
             f"{r['bytes'] / r['unquantized_bytes']:.3f}" if r["unquantized_bytes"] else "-"] for r in rows]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    return lines + ["  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body]]
