"""Block-wise symmetric integer codes for compressed collectives (ZeRO++'s qwZ and qgZ).

A chunk of ``n`` values is cut into blocks of ``block`` consecutive values (the
last one may be shorter). Each block gets one fp32 scale ``s = max|x| / qmax``
(``qmax`` = 127 for int8, 7 for int4) and each value the integer code
``q = round(x / s)`` in ``[-qmax, qmax]``; decoding gives ``q * s``. The packed
chunk is its scales (4 bytes each) followed by its codes (one byte each for
int8; two per byte for int4, the even-indexed value in the low nibble), so it
takes :meth:`BlockCodec.nbytes` bytes: ``n (1 + 4/block)`` for int8 and
``n (1/2 + 4/block)`` for int4 when ``block`` divides ``n``.

Error: every decoded value is within :meth:`BlockCodec.max_error` of the value
encoded: half a step ``s/2``, plus ``2^-16 s`` for the fp32 rounding of ``x/s``
and ``q*s``. A scale that would round below ``max|x|/qmax`` (subnormal blocks)
is raised by one ulp, and one whose ``qmax`` multiple would overflow (blocks
near the fp32 maximum) is lowered by one, so neither breaks the bound.

Non-finite values are never hidden: a block holding NaN or Inf gets a NaN
scale, so every value it decodes to is NaN and the reduced gradient's norm is
non-finite, which the optimizer reports (or skips, as configured). An all-zero
block has scale 0 and decodes to exact zeros.

Everything here is vectorised torch on whole tensors, deterministic, with no
communication: ``comm/compressed.py`` carries these chunks in collectives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCALE_BYTES = 4  # one fp32 scale per block
_ROUNDING = 2.0 ** -16  # of a step: the fp32 roundings of x/s and q*s (2 * 127 * 2^-24 < 2^-16)


@dataclass(frozen=True)
class BlockCodec:
    """Symmetric ``bits``-bit codes (8 or 4) with one fp32 scale per ``block`` values."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits!r} is not 4 or 8")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block={self.block!r} is not an even number >= 2")

    @property
    def name(self) -> str:
        """'int8' or 'int4': how collective kinds carrying these codes are named."""
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        """The largest code magnitude (codes are symmetric: -qmax..qmax)."""
        return 2 ** (self.bits - 1) - 1

    def blocks(self, n: int) -> int:
        """Blocks (scales) of an ``n``-value chunk."""
        return -(-n // self.block)

    def code_bytes(self, n: int) -> int:
        return n if self.bits == 8 else -(-n // 2)

    def nbytes(self, n: int) -> int:
        """Bytes of one packed chunk of ``n`` values: its scales, then its codes."""
        return SCALE_BYTES * self.blocks(n) + self.code_bytes(n)

    def max_error(self, scales: torch.Tensor) -> torch.Tensor:
        """Per block, the most a decoded value can differ from the value encoded."""
        return scales * (0.5 + _ROUNDING)

    # ---- encoding ---------------------------------------------------------------
    def _scales(self, amax: torch.Tensor) -> torch.Tensor:
        """One scale per block: NaN for a non-finite block, 0 for an all-zero one, else
        max|x|/qmax nudged by an ulp where rounding would break the error bound."""
        q = float(self.qmax)
        s = amax / q
        too_small = amax.double() > q * s.double() + 0.25 * s.double()  # subnormal s lost precision
        s = torch.where(too_small, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
        overflows = torch.isinf(s * q) & torch.isfinite(s)
        s = torch.where(overflows, torch.nextafter(s, torch.zeros_like(s)), s)
        return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))

    def encode(self, x: torch.Tensor, chunk: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Pack the 1-D ``x`` (any float dtype), ``k`` chunks of ``chunk`` values each, into
        ``k * nbytes(chunk)`` bytes. ``residual`` (fp32, like ``x``) receives ``x - decode``:
        error feedback's carry (0 in non-finite blocks, whose values are not kept)."""
        if x.dim() != 1 or x.numel() % chunk:
            raise ValueError(f"encode: {tuple(x.shape)} is not 1-D chunks of {chunk} values")
        k, nb = x.numel() // chunk, self.blocks(chunk)
        blocks = _padded(x.view(k, chunk).float(), nb * self.block).view(k, nb, self.block)
        scales = self._scales(blocks.abs().amax(dim=-1))
        finite = torch.isfinite(scales)
        all_finite = bool(finite.all())
        q = blocks / torch.where(finite & (scales > 0), scales, 1.0).unsqueeze(-1)
        if not all_finite:  # NaN/Inf blocks: their codes are zeros (their NaN scale decodes them to NaN)
            q.masked_fill_(~finite.unsqueeze(-1), 0.0)
        q.round_().clamp_(-self.qmax, self.qmax)
        if residual is not None:
            err = (q * scales.unsqueeze(-1)).neg_().add_(blocks)  # x - q s, with q s rounded as decode rounds it
            if not all_finite:
                err.masked_fill_(~finite.unsqueeze(-1), 0.0)
            residual.view(k, chunk).copy_(err.view(k, -1)[:, :chunk])
        out = torch.empty(k, self.nbytes(chunk), dtype=torch.uint8, device=x.device)
        out[:, :SCALE_BYTES * nb] = scales.view(torch.uint8)
        codes = q.view(k, -1)[:, :chunk]
        if self.bits == 8:
            out[:, SCALE_BYTES * nb:].view(torch.int8).copy_(codes)
        else:
            out[:, SCALE_BYTES * nb:] = self._pack(codes.to(torch.int8))
        return out.view(-1)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """(k, n) int8 codes as bytes: as they are for int8; two nibbles per byte for int4."""
        if self.bits == 8:
            return codes.view(torch.uint8)
        u = (codes + 8).to(torch.uint8)  # -7..7 -> 1..15
        if u.shape[1] % 2:
            u = F.pad(u, (0, 1), value=8)
        return u[:, 0::2] | (u[:, 1::2] << 4)

    # ---- decoding ---------------------------------------------------------------
    def split(self, packed: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales (k, blocks) fp32, codes (k, chunk) int8) of ``k`` packed chunks."""
        width, nb = self.nbytes(chunk), self.blocks(chunk)
        if packed.dim() != 1 or packed.numel() % width:
            raise ValueError(f"decode: {packed.numel()} bytes are not packed chunks of {width}")
        rows = packed.view(-1, width)
        scales = torch.empty(rows.shape[0], nb, dtype=torch.float32, device=packed.device)
        scales.view(torch.uint8).copy_(rows[:, :SCALE_BYTES * nb])  # copied: aligned for fp32
        body = rows[:, SCALE_BYTES * nb:]
        if self.bits == 8:
            return scales, body.view(torch.int8)
        codes = torch.stack((body & 15, body >> 4), dim=-1).view(rows.shape[0], -1)[:, :chunk]
        return scales, codes.to(torch.int8) - 8

    def decode(self, packed: torch.Tensor, chunk: int) -> torch.Tensor:
        """The (k, chunk) fp32 values of ``k`` packed chunks."""
        scales, codes = self.split(packed, chunk)
        k, nb = scales.shape
        values = _padded(codes.float(), nb * self.block).view(k, nb, self.block)
        return values.mul_(scales.unsqueeze(-1)).view(k, -1)[:, :chunk]

    def bound(self, packed: torch.Tensor, chunk: int) -> torch.Tensor:
        """The (k, chunk) error bound of each decoded value, from its block's scale."""
        scales, _ = self.split(packed, chunk)
        per_block = self.max_error(scales).repeat_interleave(self.block, dim=1)
        return per_block[:, :chunk]


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` (k, n) with zero columns up to ``width`` (contiguous; a copy only when it must grow)."""
    if x.shape[1] == width:
        return x.contiguous()
    return F.pad(x, (0, width - x.shape[1]))
