"""LoRA with the real peft library on Hugging Face GPT-2 and Llama (workers/lora.py).

``peft.get_peft_model`` freezes the base and adds trainable adapters; the engine trains the PEFT
model at stages 0-3 on 2 and 3 ranks against single-process PEFT on the same global batch, with
the parity bounds of the core tests (tolerance.py; 16-bit runs judged on the adapters' update,
the frozen base checked to be exactly its initial values in the compute dtype). At stage 3 the
frozen base is sharded (c·Ψ_frozen/N per rank), HF ``generate`` runs on the trained engine, and a
checkpoint saved with ``include_frozen=False`` consolidates into an adapters-only file that PEFT
loads (``set_peft_model_state_dict`` and ``PeftModel.from_pretrained``); inside backward, the frozen
base is released unit by unit, not kept gathered to the end.
"""
from __future__ import annotations

import pytest

from tests.components import require_module

from .launcher import WorkerResults
from .tolerance import check_parity

WORLDS = (2, 3)
MODELS = ("gpt2", "llama")
CASES = [(s, "fp32") for s in range(4)] + [(1, "bf16"), (3, "bf16")]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    require_module("peft", "transformers")
    return WorkerResults("lora.py", lambda r: (r["model"], r["stage"], r["dtype"]), tmp_path_factory, preload=("peft",))


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stage,dtype", CASES, ids=lambda c: str(c))
def test_lora_parity_with_single_process_peft(rows, world, model, stage, dtype):
    r = rows(world)[(model, stage, dtype)]
    assert r["frozen_exact"], r
    check_parity(r)
    n, c = r["world"], 4 if dtype == "fp32" else 2
    frozen = r["frozen_numel"] * c if stage < 3 else r["frozen_padded"] * c // n
    assert (r["frozen_padded"] >= r["frozen_numel"]) if stage == 3 else r["frozen_padded"] == 0
    # the frozen base: whole on every rank at stages 0-2, one shard per rank at stage 3
    assert r["model_state_bytes"] >= frozen
    if stage == 3:
        assert r["model_state_bytes"] == frozen + 16 * r["trainable_padded"] // n
        assert r["bytes_sent"]["reduce_scatter"] == (n - 1) * r["trainable_padded"] // n * c * r["steps"]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("model", MODELS)
def test_generate_and_adapters_round_trip_at_stage3(rows, world, model):
    r = rows(world)[(model, 3, "fp32")]
    assert r["generate"], "greedy tokens differ from a single process holding the engine's parameters"
    assert r["saved_names"], "the adapters-only consolidated file holds other names than the LoRA parameters"
    assert r["set_state"] and r["from_pretrained"], r


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
def test_frozen_base_is_released_inside_backward_at_stage3(rows, world, model, dtype):
    """Sampled on every rank as each module's backward starts (workers/held.py): the frozen base
    gathered is at most the units enclosing the module and those whose inputs carry no gradient
    (the root, the base layers before the first adapter), which wait for the end of backward;
    prefetch is off. A base unit kept gathered after its backward breaks it in the first layer."""
    for r in rows(world)[(model, 3, dtype)]["held"]:
        assert r["excess"] <= 0, f"more frozen bytes gathered than the bound: {r}"
        assert r["unit_bytes"] <= r["peak"][1] < r["total_bytes"], r  # a unit sampled, never the whole base
