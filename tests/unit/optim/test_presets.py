"""``optimizer="muon"`` (zerompi/optim/presets.py): which parameters the rule gives Muon in the models
people train, and the plain single-process loop's bits with the two torch optimizers it stands for."""
from __future__ import annotations

import pytest
import torch

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import ConfigError
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.optim.presets import muon_parameters

from .loop import plain, train
from .test_whole import CFG, _net


def _muon_names(model) -> list[str]:
    chosen = muon_parameters(model)
    return [n for n, p in model.named_parameters() if id(p) in chosen]


def test_the_rule_on_zerompis_gpt():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_embd=32, n_head=4))
    assert _muon_names(model) == ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                                  "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]


def test_the_rule_on_hugging_face_models():
    """GPT-2's Conv1D matrices and Llama's projections; not the embeddings, the head (tied or not) or norms."""
    from tests.components import require_module
    transformers = require_module("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                n_positions=16))
    assert _muon_names(gpt2) == [f"transformer.h.0.{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                          "mlp.c_proj")]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16, tie_word_embeddings=False))
    assert _muon_names(llama) == [f"model.layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]


def _plain(steps: int, momentum: float = 0.95) -> dict[str, torch.Tensor]:
    net = _net()
    mats = [p for p in net.parameters() if p.dim() == 2]
    rest = [p for p in net.parameters() if p.dim() != 2]
    return plain(net, [
        torch.optim.Muon(mats, lr=1e-2, weight_decay=0.01, momentum=momentum, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)], steps)


@pytest.mark.parametrize("stage,n", [(0, 1), (2, 2), (3, 3)])
def test_muon_preset_trains_the_two_torch_optimizers_bits(stage, n):
    want = _plain(3, momentum=0.9)

    def rank(group):
        engine = zerompi.initialize(_net(), ZeroConfig(stage=stage, **{**CFG, "optimizer": "muon"},
                                                       optimizer_kwargs={"momentum": 0.9}), group=group)
        train(engine, range(3))
        got = engine.full_state_dict()
        engine.close()
        return got
    for got in run_ranks(n, rank):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_given_groups_are_cut_in_two_keeping_the_options_each_takes():
    def rank(group):
        net = _net()
        engine = zerompi.initialize(net, ZeroConfig(stage=2, **{**CFG, "optimizer": "muon"}), group=group,
                                    param_groups=[{"params": list(net.parameters()), "weight_decay": 0.0,
                                                   "betas": (0.8, 0.9)}])
        groups = engine.optimizer.param_groups
        engine.close()
        return [(g["weight_decay"], g.get("betas")) for g in groups]
    assert run_ranks(2, rank)[0] == [(0.0, None), (0.0, (0.8, 0.9))]  # Muon's half takes no betas


def test_muons_learning_rate_is_the_configs():
    with pytest.raises(ConfigError, match=r"optimizer_kwargs=\{'lr': 0.02\} sets 'lr'"):
        ZeroConfig(optimizer="muon", optimizer_kwargs={"lr": 0.02})
