"""The example GPT and its stdlib byte corpus, single process (no MPI)."""
from __future__ import annotations

import copy

import pytest
import torch

from zerompi.errors import ConfigError
from zerompi.models.corpus import ByteCorpus, decode
from zerompi.models.gpt import GPT, GPTConfig, gpt_config_from_dict

SMALL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def small_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def batch(B: int = 3, T: int = 16):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (B, T), generator=g)
    y = torch.randint(0, 256, (B, T), generator=g)
    return x, y


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus(max_bytes=200_000)


def test_shapes_and_loss():
    model = small_gpt()
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, 256)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # At init the prediction is near uniform over the 256 bytes.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    logits, loss = model(x)
    assert loss is None and logits.shape == (3, 16, 256)


def test_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        small_gpt()(torch.zeros(1, 33, dtype=torch.long))


def test_weight_tying_shares_one_parameter():
    model = small_gpt()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))
    assert sum(n.endswith("wte.weight") or n == "lm_head.weight" for n in names) == 1
    assert model.num_params() == sum(p.numel() for p in model.parameters())

    untied = small_gpt(tie_weights=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() == model.num_params() + 256 * 32
    assert untied.num_params(exclude_embeddings=True) == model.num_params(exclude_embeddings=True)


def test_residual_projections_use_scaled_init():
    model = GPT(GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=16))
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / 4, rel=0.1)  # 0.02 / sqrt(2 * 8)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.count_nonzero(model.transformer.h[0].attn.c_attn.bias) == 0


def test_grad_checkpoint_matches_plain_backward():
    plain = small_gpt()
    ckpt = copy.deepcopy(plain)
    ckpt.config = GPTConfig(**{**SMALL, "grad_checkpoint": True})
    x, y = batch()
    losses, calls = [], []
    for model in (plain, ckpt):
        n = [0]
        model.transformer.h[0].register_forward_pre_hook(lambda *_, n=n: n.__setitem__(0, n[0] + 1))
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
        calls.append(n[0])
    assert calls == [1, 2]  # checkpointing reruns the block's forward during backward
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_bf16_parameters():
    model = small_gpt().to(torch.bfloat16)
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert model.transformer.wte.weight.grad.dtype == torch.bfloat16


def test_config_from_dict():
    cfg = gpt_config_from_dict({"n_layer": 2, "n_embd": 64, "n_head": 4})
    assert cfg == GPTConfig(n_layer=2, n_embd=64, n_head=4)
    with pytest.raises(ConfigError, match="n_layers"):
        gpt_config_from_dict({"n_layers": 2})
    with pytest.raises(ConfigError, match="divisible"):
        gpt_config_from_dict({"n_embd": 30, "n_head": 4})


def test_corpus_is_the_stdlib_bytes(corpus):
    assert len(corpus) == 200_000
    assert len(corpus.val) == 10_000
    assert corpus.train.dtype == torch.uint8
    text = decode(corpus.train[:5000])
    assert "import" in text or "def " in text


def test_batches_are_deterministic_and_shifted(corpus):
    def draw(seed):
        return corpus.get_batch("train", 4, 32, torch.Generator().manual_seed(seed))

    x, y = draw(7)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    x2, y2 = draw(7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, draw(8)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    xv, _ = corpus.get_batch("val", 2, 32, torch.Generator().manual_seed(7))
    assert xv.shape == (2, 32)
    with pytest.raises(ValueError):
        corpus.get_batch("test", 2, 32, torch.Generator())


def test_decode_replaces_invalid_utf8():
    assert decode(torch.tensor([104, 105])) == "hi"
    assert decode([0xFF, 65]) == "\ufffdA"
