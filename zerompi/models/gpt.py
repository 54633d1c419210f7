"""A GPT-2 style decoder-only transformer (pre-LayerNorm), kept small and readable.

Layout follows GPT-2 so parameter names read familiarly::

    transformer.wte / wpe      token and position embeddings
    transformer.h[i]           Block: ln_1 -> attn -> (+) -> ln_2 -> mlp -> (+)
    transformer.ln_f           final LayerNorm
    lm_head                    vocabulary projection, tied to wte when tie_weights

Works with parameters cast to bfloat16 and with activation checkpointing
(``grad_checkpoint=True`` recomputes each block in the backward pass).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zerompi.config.checks import kind_of, same_kind
from zerompi.errors import ConfigError


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256      # longest sequence the position embedding covers
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.0
    bias: bool = True          # biases in Linear and LayerNorm layers
    tie_weights: bool = True   # lm_head.weight is wte.weight
    grad_checkpoint: bool = False  # recompute blocks in backward to save activation memory


def gpt_config_from_dict(d: dict) -> GPTConfig:
    """Build a GPTConfig from a plain dict (e.g. a TOML table); unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown GPT config key(s): {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    for f in dataclasses.fields(GPTConfig):
        if f.name in d and not same_kind(d[f.name], f.default):
            raise ConfigError(f"GPT config key {f.name}: expected {kind_of(f.default)}, got {d[f.name]!r}")
    cfg = GPTConfig(**d)
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # One Parameter under two names; named_parameters() yields it once (as wte.weight).
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections so the residual stream's variance
        # does not grow with depth (two residual additions per layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def init_module(self, module: nn.Module) -> None:
        """``param_init`` for a GPT built on the meta device: one module's own parameters, from
        the distributions ``__init__`` gives the whole model (values differ: another draw order)."""
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        self._init_weights(module)
        if any(m is module for n, m in self.named_modules() if n.endswith("c_proj")):
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, each shared Parameter counted once.

        With exclude_embeddings the position embedding is left out, and so is
        the token embedding unless it is tied (then it is also the output layer).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.transformer.wte.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.config.grad_checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            # Compute the loss in fp32 so bf16 logits do not lose precision in log-softmax.
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
