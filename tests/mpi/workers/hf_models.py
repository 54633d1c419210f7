"""Small Hugging Face models with LoRA adapters from the real peft library (no download)."""
from __future__ import annotations

import torch


def base_model(kind: str, vocab: int, seq: int):
    """A 2-layer GPT-2 or Llama built from its config (dropout off, so runs are deterministic)."""
    import transformers
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model kind {kind!r}")


TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"]}


def lora_model(kind: str, vocab: int, seq: int, seed: int = 0):
    """``peft.get_peft_model`` on the base: LoRA r=4 on the attention (and an MLP) projections;
    everything else frozen. The same seed gives the same base and adapters."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base = base_model(kind, vocab, seq)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind],
                     fan_in_fan_out=kind == "gpt2")
    return get_peft_model(base, cfg)
