"""Frozen parameters at stage 3 on 2 and 3 real ranks (workers/frozen.py).

A fine-tuning model: the tiny GPT with its tied embeddings and MLP weights frozen. At stage 3
the frozen parameters are sharded and gathered with their unit (no gradient, master, optimizer
state or reduce-scatter), so each rank holds c·Ψ_frozen/N of them; the bytes are exactly the
stage-3 volumes with the frozen part gathered and never reduced; offload moves them like the
rest, bitwise; checkpoints hold them as shards (or not at all with include_frozen=False) and
load at another world size and stage. Inside backward, a unit's frozen part is released once its
backward is over: sampled as each module's backward starts, not only after the step.
"""
from __future__ import annotations

import json

import pytest

from .batch import Batch, selected
from .tolerance import check_parity

WORLDS = (2, 3)


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """workers/frozen.py's phases as one job per world size (tests/mpi/batch.py): the train phase at each
    world size the selected tests name, and the save (3 ranks) before the load (2 ranks) in those jobs.
    ``jobs(name)`` checks a phase's run and returns its results."""
    batch = Batch("frozen.py", tmp_path_factory, whole_file=True)
    tests, where = selected(request), {}
    for world in sorted({i.callspec.params["world"] for i in tests if "train" in i.fixturenames}):
        where[f"np{world}"] = out = tmp_path_factory.mktemp(f"frozen{world}")
        batch.add(f"np{world}", world, "--out", out / "r.json", "--dir", out)
    if any("loaded" in i.fixturenames for i in tests):
        where["save"] = where["load"] = root = tmp_path_factory.mktemp("frozen-ckpt")
        batch.add("save", 3, "--out", root / "save.json", "--phase", "save", "--dir", root)
        batch.add("load", 2, "--out", root / "load.json", "--phase", "load", "--dir", root, after=["save"])
    batch.run()

    def results(name: str) -> dict:
        batch.check(name)
        return json.loads((where[name] / ("r.json" if name.startswith("np") else f"{name}.json")).read_text())
    return results


@pytest.fixture(scope="module")
def train(jobs):
    """The train phase's results at a world size."""
    return lambda world: jobs(f"np{world}")


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("hierarchy", ("parity", "hpz"))
def test_frozen_parity_bytes_and_memory(train, world, hierarchy):
    r = train(world)[hierarchy]
    check_parity(dict(r, dtype="fp32"))
    n, steps, accum, c = world, r["steps"], r["accum"], 4
    frozen, trainable = r["frozen_padded"], r["trainable_padded"]
    assert r["frozen_numel"] > 0 and frozen % n == 0
    vol = lambda padded: (n - 1) * padded // n * c * steps  # noqa: E731
    sent = r["bytes_sent"]
    if hierarchy == "parity":
        # every unit gathered in forward and backward, frozen part included; only trainables reduced
        assert sent["all_gather"] == 2 * accum * vol(frozen + trainable)
        # fp32: the trainable shard is its own master, plus gradient and Adam's two moments
        assert r["model_state_bytes"] == c * frozen // n + 4 * c * trainable // n
    else:  # hpZ: the node-local copy is refreshed for trainables only; frozen ones never change
        assert sent["all_gather@inter"] == vol(trainable)
    assert sent["reduce_scatter"] == accum * vol(trainable)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("prefetch", (0, 1), ids=lambda p: f"prefetch{p}")
def test_frozen_units_are_released_inside_backward(train, world, prefetch):
    """Sampled on every rank as each module's backward starts (workers/held.py): the frozen storage
    gathered is at most that of the units enclosing the module, of those whose inputs carry no
    gradient (the root, released at the end of backward) and prefetch_units largest units per unit
    in backward. A unit kept gathered after its backward breaks it in the first blocks."""
    for r in train(world)["held"][str(prefetch)]:
        assert r["excess"] <= 0, f"more frozen bytes gathered than the bound: {r}"
        assert r["unit_bytes"] <= r["peak"][1] < r["total_bytes"], r  # a unit sampled, never the whole base


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
def test_frozen_shards_offload_bitwise(train, world, dtype):
    r = train(world)["offload"][dtype]
    assert r["cpu"] and r["nvme"] and r["nvme_swapped"] > 0, r


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
def test_requires_grad_changed_after_initialize_raises_on_every_rank(train, world):
    changed = train(world)["changed"]
    for name, errors in changed.items():
        assert len(errors) == world
        for message in errors:
            assert message.startswith("UsageError: requires_grad changed after initialize") and name in message


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
def test_frozen_base_on_the_meta_device(train, world):
    meta = train(world)["meta"]
    assert meta["3"]["errors"] == [""] * world and meta["3"]["frozen"] == 5 and meta["3"]["frozen_values"]
    for message in meta["1"]["errors"]:  # stages 0-2 replicate frozen parameters: they must be real
        assert message.startswith("UsageError: these frozen parameters") and "transformer.wte.weight" in message


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
def test_frozen_sets_that_differ_between_ranks_are_refused(train, world):
    errors = train(world)["mismatched"]
    assert len(errors) == world
    for message in errors:
        assert message.startswith("ModelMismatchError") and "transformer.ln_f.weight" in message


@pytest.fixture(scope="module")
def loaded(jobs):
    """Saved by 3 ranks at stage 3 (and 1), loaded by 2 ranks."""
    return jobs("save"), jobs("load")


@pytest.mark.parametrize("case", ("full->stage3", "full->stage1", "stage1->stage3", "async-nvme->stage3", "adapters"))
def test_frozen_shards_reshard_across_world_sizes_and_stages(loaded, case):
    r = loaded[1][case]
    assert r["error"] == ["", ""] and r["equal"], r


def test_loaded_frozen_shards_are_repacked_for_quantized_gathers(loaded):
    assert loaded[1]["quantized-repacked"]


def test_adapters_only_checkpoint(loaded):
    saved, r = loaded
    assert saved["bytes"]["adapters"] < saved["bytes"]["full"]
    assert r["consolidated"]["adapters"] == r["trainable"] and r["consolidated"]["full"] == r["names"]
    other = r["adapters-other-values"]  # same shapes, another base: the adapters load, the base stays its own
    assert other["error"] == ["", ""] and other["trainable"] and other["frozen_kept"]


def test_adapters_onto_another_base_is_refused_and_changes_nothing(loaded):
    r = loaded[1]["adapters-other-base"]
    assert r["unchanged"]
    for message in r["error"]:
        assert message.startswith("CheckpointError") and "include_frozen=False" in message
        # the first mismatching tensor, in the model's order
        assert message.split("checkpoint of a different model: ")[1].startswith("transformer.wte.weight: shape")
