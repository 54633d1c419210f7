"""Unit tests of zerompi.shard.layout: bucket planning, shards, pieces and stage-3 gather units."""
from __future__ import annotations

import math
import random

import pytest
import torch

from tests.components import require_module
from zerompi.shard.layout import (BucketLayout, ParamSlot, ParamSpec, Piece, ShardRange, choose_units,
                            assign_owners, common_ancestor, padded_numel, parent_fqn, plan_buckets,
                            plan_owned_bucket)


# --- random cases -------------------------------------------------------------

def random_specs(rng: random.Random, n: int, groups: int) -> list[ParamSpec]:
    """``n`` parameters named p0..p{n-1}; shapes of 0-3 dims, some with a zero dim."""
    specs = []
    for i in range(n):
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7]) if rng.random() < 0.1 else rng.randint(1, 7)
                      for _ in range(rng.randint(0, 3)))
        specs.append(ParamSpec(f"p{i}", shape, rng.randrange(groups)))
    return specs


def random_case(seed: int) -> tuple[list[ParamSpec], int, int]:
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randint(0, 24), rng.randint(1, 3))
    world = 1 + seed % 8
    cap = rng.choice([1, 2, 5, 17, 64, 300, 10**9])
    return specs, world, cap


SEEDS = range(64)


def numel_of(spec: ParamSpec) -> int:
    return math.prod(spec.shape)


def check_plan(specs: list[ParamSpec], world: int, cap: int) -> None:
    """Every planning invariant, for one case (shared by the parametrised and hypothesis tests)."""
    buckets = plan_buckets(specs, world, cap, first_index=3)
    by_name = {s.fqn: s for s in specs}
    position = {s.fqn: i for i, s in enumerate(specs)}
    seen = [slot.fqn for b in buckets for slot in b.slots]
    assert sorted(seen) == sorted(by_name)
    assert [b.index for b in buckets] == list(range(3, 3 + len(buckets)))
    firsts = [position[b.slots[0].fqn] for b in buckets]
    assert firsts == sorted(firsts)
    for b in buckets:
        assert {by_name[s.fqn].group for s in b.slots} == {b.group}
        assert b.numel == sum(s.numel for s in b.slots)
        assert b.numel <= cap or len(b.slots) == 1
        assert b.padded_numel == padded_numel(b.numel, world) and b.world_size == world
        offset = 0
        for slot in b.slots:
            assert slot.offset == offset
            assert slot.shape == by_name[slot.fqn].shape and slot.numel == numel_of(by_name[slot.fqn])
            offset += slot.numel
        shards = [b.shard(r) for r in range(world)]
        assert [(s.start, s.stop) for s in shards] == [
            (r * b.shard_numel, (r + 1) * b.shard_numel) for r in range(world)]
        assert shards[-1].stop == b.padded_numel


# --- padded_numel -----------------------------------------------------------

@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 100, 1001])
def test_padded_numel_is_smallest_nonempty_multiple(numel, world):
    padded = padded_numel(numel, world)
    assert padded % world == 0
    assert padded >= max(numel, world)
    assert padded - numel < world or (numel == 0 and padded == world)


# --- plan_buckets: a worked example -----------------------------------------

def test_plan_buckets_worked_example():
    specs = [ParamSpec("a", (3, 2), 0), ParamSpec("b", (4,), 1), ParamSpec("c", (5,), 0),
             ParamSpec("d", (20,), 0), ParamSpec("e", (), 1)]
    buckets = plan_buckets(specs, world_size=4, cap_numel=12, first_index=2, unit="blk")
    assert buckets == [
        BucketLayout(2, 0, (ParamSlot("a", (3, 2), 6, 0), ParamSlot("c", (5,), 5, 6)), 11, 12, 4,
                     "blk"),
        BucketLayout(3, 1, (ParamSlot("b", (4,), 4, 0), ParamSlot("e", (), 1, 4)), 5, 8, 4, "blk"),
        BucketLayout(4, 0, (ParamSlot("d", (20,), 20, 0),), 20, 20, 4, "blk"),
    ]
    assert buckets[0].shard(2) == ShardRange(6, 9) and buckets[0].full == ShardRange(0, 12)
    assert buckets[0].pieces(ShardRange(4, 8)) == [Piece("a", 4, 0, 2), Piece("c", 0, 2, 2)]


@pytest.mark.parametrize("world, cap", [(0, 10), (1, 0), (-1, 5), (4, -3)])
def test_plan_buckets_rejects_bad_sizes(world, cap):
    with pytest.raises(ValueError):
        plan_buckets([ParamSpec("a", (2,), 0)], world, cap)


def test_plan_buckets_empty():
    assert plan_buckets([], 4, 10) == []


# --- plan_buckets: properties over random cases ------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_every_param_in_exactly_one_bucket_in_order(seed):
    specs, world, cap = random_case(seed)
    buckets = plan_buckets(specs, world, cap)
    for group in {s.group for s in specs}:
        in_buckets = [slot.fqn for b in buckets if b.group == group for slot in b.slots]
        assert in_buckets == [s.fqn for s in specs if s.group == group]


@pytest.mark.parametrize("seed", SEEDS)
def test_slots_are_contiguous_from_zero(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        offsets = [slot.offset for slot in b.slots]
        ends = [slot.offset + slot.numel for slot in b.slots]
        assert offsets == [0] + ends[:-1]
        assert b.numel == sum(slot.numel for slot in b.slots) == ends[-1]


@pytest.mark.parametrize("seed", SEEDS)
def test_bucket_padding(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        assert b.padded_numel % world == 0 and b.padded_numel >= b.numel
        assert b.padded_numel - b.numel < world or (b.numel == 0 and b.padded_numel == world)


@pytest.mark.parametrize("seed", SEEDS)
def test_buckets_never_mix_groups(seed):
    specs, world, cap = random_case(seed)
    group = {s.fqn: s.group for s in specs}
    for b in plan_buckets(specs, world, cap):
        assert {group[slot.fqn] for slot in b.slots} == {b.group}


@pytest.mark.parametrize("seed", SEEDS)
def test_bucket_respects_cap_unless_single_param(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        assert b.numel <= cap or len(b.slots) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_buckets_are_not_cut_needlessly(seed):
    """A bucket is closed only because the next parameter of its group would overflow the cap."""
    specs, world, cap = random_case(seed)
    buckets = plan_buckets(specs, world, cap)
    for group in {b.group for b in buckets}:
        mine = [b for b in buckets if b.group == group]
        for b, nxt in zip(mine, mine[1:]):
            assert b.numel + nxt.slots[0].numel > cap


@pytest.mark.parametrize("seed", SEEDS)
def test_indices_consecutive_and_ordered_by_first_param(seed):
    specs, world, cap = random_case(seed)
    position = {s.fqn: i for i, s in enumerate(specs)}
    buckets = plan_buckets(specs, world, cap, first_index=7)
    assert [b.index for b in buckets] == list(range(7, 7 + len(buckets)))
    firsts = [position[b.slots[0].fqn] for b in buckets]
    assert firsts == sorted(firsts)


@pytest.mark.parametrize("seed", SEEDS)
def test_shards_tile_padded_buffer(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        covered = torch.zeros(b.padded_numel, dtype=torch.int32)
        for r in range(world):
            s = b.shard(r)
            assert s.numel == b.shard_numel > 0
            covered[s.start:s.stop] += 1
        assert torch.equal(covered, torch.ones_like(covered))
        assert b.full == ShardRange(0, b.padded_numel)


@pytest.mark.parametrize("seed", SEEDS)
def test_pieces_of_all_shards_reconstruct_every_param(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        flat = torch.arange(b.padded_numel, dtype=torch.float64)
        flat[b.numel:] = -1.0  # padding must never be read
        rebuilt = {slot.fqn: torch.full((slot.numel,), float("nan"), dtype=torch.float64)
                   for slot in b.slots}
        count = {slot.fqn: torch.zeros(slot.numel, dtype=torch.int32) for slot in b.slots}
        for r in range(world):
            rng = b.shard(r)
            shard = flat[rng.start:rng.stop]
            for p in b.pieces(rng):
                assert p.numel > 0 and 0 <= p.local_start and p.local_start + p.numel <= rng.numel
                rebuilt[p.fqn][p.param_start:p.param_start + p.numel] = \
                    shard[p.local_start:p.local_start + p.numel]
                count[p.fqn][p.param_start:p.param_start + p.numel] += 1
        for slot in b.slots:
            assert torch.equal(count[slot.fqn], torch.ones_like(count[slot.fqn]))
            expected = torch.arange(slot.offset, slot.offset + slot.numel, dtype=torch.float64)
            assert torch.equal(rebuilt[slot.fqn], expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_pieces_of_full_range_are_whole_nonempty_params(seed):
    specs, world, cap = random_case(seed)
    for b in plan_buckets(specs, world, cap):
        assert b.pieces(b.full) == [Piece(s.fqn, 0, s.offset, s.numel) for s in b.slots if s.numel]
        assert b.pieces(ShardRange(b.numel, b.padded_numel)) == []


def test_plan_invariants_hypothesis():
    hypothesis = require_module("hypothesis")
    st = hypothesis.strategies
    shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)
    spec_lists = st.lists(st.tuples(shapes, st.integers(0, 2)), max_size=20).map(
        lambda xs: [ParamSpec(f"p{i}", shape, g) for i, (shape, g) in enumerate(xs)])

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(spec_lists, st.integers(1, 8), st.integers(1, 200))
    def run(specs, world, cap):
        check_plan(specs, world, cap)

    run()


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_invariants_combined(seed):
    check_plan(*random_case(seed))


# --- module names -------------------------------------------------------------

@pytest.mark.parametrize("fqn, parent", [("a.b.c", "a.b"), ("a", ""), ("", None), ("h.0", "h")])
def test_parent_fqn(fqn, parent):
    assert parent_fqn(fqn) == parent


@pytest.mark.parametrize("fqns, expected", [
    (["a.b.c", "a.b.d"], "a.b"),
    (["a", "b"], ""),
    (["x.y"], "x.y"),
    (["a.b", "a.bc"], "a"),          # components, not string prefixes
    (["a.b", "a.b.c"], "a.b"),
    (["transformer.wte", "lm_head"], ""),
    (["", "a.b"], ""),
])
def test_common_ancestor(fqns, expected):
    assert common_ancestor(fqns) == expected


# --- choose_units -------------------------------------------------------------

GPT_MODULES = [
    "", "transformer", "transformer.wte", "transformer.wpe", "transformer.h",
    "transformer.h.0", "transformer.h.0.ln_1", "transformer.h.0.attn", "transformer.h.0.mlp",
    "transformer.h.1", "transformer.h.1.ln_1", "transformer.h.1.attn", "transformer.h.1.mlp",
    "transformer.ln_f", "lm_head",
]
GPT_NUMEL = {"transformer.wte": 1000, "transformer.wpe": 100, "transformer.ln_f": 10,
             "lm_head": 1000,
             **{f"transformer.h.{i}.{m}": n for i in range(2)
                for m, n in [("ln_1", 10), ("attn", 300), ("mlp", 400)]}}
GPT_CALLABLE = set(GPT_MODULES) - {"transformer.h"}  # an nn.ModuleList is never called


def test_choose_units_gpt_blocks():
    mapping = choose_units(GPT_MODULES, GPT_NUMEL, 500, GPT_CALLABLE)
    expected = {m: "" for m in GPT_MODULES}
    expected["transformer.wte"] = "transformer.wte"
    expected["lm_head"] = "lm_head"
    for m in GPT_MODULES:
        for i in range(2):
            if m.startswith(f"transformer.h.{i}"):
                expected[m] = f"transformer.h.{i}"
    assert mapping == expected


def test_choose_units_splits_uncallable_container():
    # h's subtree (1420) reaches the cap but h cannot be a unit: its blocks (710 each, under the
    # cap) become the units, not its parent, which would gather the whole of h at once.
    mapping = choose_units(GPT_MODULES, GPT_NUMEL, 1200, GPT_CALLABLE)
    blocks = {m: m[:len("transformer.h.0")] for m in GPT_MODULES if m.startswith("transformer.h.")}
    assert mapping == {m: blocks.get(m, "") for m in GPT_MODULES}
    # wte + wpe + ln_f = 1110 < 1200 stay with the root; h itself maps to its nearest unit
    assert mapping["transformer.wte"] == mapping["transformer.h"] == ""
    # the same tree with every module callable makes h the unit
    everything = choose_units(GPT_MODULES, GPT_NUMEL, 1200)
    assert {m for m in GPT_MODULES if m.startswith("transformer.h")} == \
        {m for m, u in everything.items() if u == "transformer.h"}
    # h claims its 1420, so transformer keeps 1110 < 1200 and the root takes it
    assert everything["transformer.wte"] == everything["transformer"] == ""


def test_choose_units_root_takes_everything_below_cap():
    assert choose_units(GPT_MODULES, GPT_NUMEL, 10**9, GPT_CALLABLE) == {m: "" for m in GPT_MODULES}
    assert choose_units([""], {}, 1) == {"": ""}


def random_tree(seed: int):
    """Modules (parents first), own numels, callable set and a cap."""
    rng = random.Random(seed)
    modules, children = [""], {"": 0}
    for _ in range(rng.randint(0, 30)):
        parent = rng.choice(modules)
        name = f"{parent}.{children[parent]}" if parent else str(children[parent])
        children[parent] += 1
        children[name] = 0
        modules.append(name)
    own = {m: rng.choice([0, 0, 1, 5, 20, 100]) for m in modules if rng.random() < 0.8}
    callable_ = {m for m in modules if rng.random() < 0.75}
    return modules, own, callable_, rng.choice([1, 10, 50, 200, 10**6])


def is_ancestor_or_self(a: str, m: str) -> bool:
    return a == "" or m == a or m.startswith(a + ".")


@pytest.mark.parametrize("seed", SEEDS)
def test_choose_units_maps_to_ancestor_unit(seed):
    modules, own, callable_, cap = random_tree(seed)
    mapping = choose_units(modules, own, cap, callable_)
    assert set(mapping) == set(modules) and mapping[""] == ""
    for m, u in mapping.items():
        assert is_ancestor_or_self(u, m)
        assert mapping[u] == u  # the unit of a module is itself a unit
        # the nearest unit: no unit strictly between u and m
        assert not any(mapping[a] == a for a in modules
                       if a != u and is_ancestor_or_self(u, a) and is_ancestor_or_self(a, m))


@pytest.mark.parametrize("seed", SEEDS)
def test_choose_units_only_callable_modules_become_units(seed):
    modules, own, callable_, cap = random_tree(seed)
    units = set(choose_units(modules, own, cap, callable_).values())
    assert units - {""} <= callable_


@pytest.mark.parametrize("seed", SEEDS)
def test_choose_units_unit_iff_unclaimed_subtree_reaches_cap(seed):
    """A callable module is a unit iff the elements of its subtree not claimed by a unit below it
    reach the cap, or it holds some and its parent is an uncallable container that reached the cap
    (then the container's callable children are the units)."""
    modules, own, callable_, cap = random_tree(seed)
    mapping = choose_units(modules, own, cap, callable_)

    def unclaimed(m):  # elements in m's subtree not claimed by a unit strictly below m
        return sum(own.get(x, 0) for x in modules if is_ancestor_or_self(m, x) and is_ancestor_or_self(mapping[x], m))

    def split_children(p):
        return [c for c in modules if c and parent_fqn(c) == p and mapping[c] == c and unclaimed(c) < cap]

    def container_reached_cap(p):  # what p's subtree held for p before its children were split off
        split = split_children(p)
        return sum(own.get(x, 0) for x in modules if is_ancestor_or_self(p, x) and (
            is_ancestor_or_self(mapping[x], p) or mapping[x] in split)) >= cap

    for m in modules:
        if not m or m not in callable_:
            continue
        u, p = unclaimed(m), parent_fqn(m)
        by_split = bool(p) and p not in callable_ and u > 0 and container_reached_cap(p)
        assert (mapping[m] == m) == (u >= cap or by_split), (m, u, cap, p)


def test_descent_lists_the_modules_between_a_unit_and_its_parameters():
    from zerompi.shard.layout import descent
    assert descent("", "base_model.model") == ["base_model", "base_model.model"]
    assert descent("a", "a.b.c") == ["a.b", "a.b.c"]
    assert descent("a.b", "a.b") == [] and descent("", "") == []


# --- owner-aligned buckets (optimizers that see whole tensors) -----------------

@pytest.mark.parametrize("seed", SEEDS)
def test_owned_buckets_hold_each_parameter_whole_in_its_owners_shard(seed):
    specs, world, cap = random_case(seed)
    align = 1 + seed % 3
    whole = frozenset(g for g in range(3) if (seed >> g) & 1)
    plain = plan_buckets(specs, world, cap, first_index=3, align=align)
    owned = plan_buckets(specs, world, cap, first_index=3, align=align, whole=whole)
    assert [(b.index, b.group, sorted(s.fqn for s in b.slots)) for b in owned] == \
        [(b.index, b.group, sorted(s.fqn for s in b.slots)) for b in plain]  # the same cut into buckets
    for b, p in zip(owned, plain):
        if b.group not in whole:
            assert b == p
            continue
        assert b.numel == sum(s.numel for s in b.slots) and b.shard_numel % align == 0
        spans = sorted((s.offset, s.offset + s.numel) for s in b.slots)
        assert all(z <= a for (_, z), (a, _) in zip(spans, spans[1:]))  # no two slots overlap
        for slot in b.slots:  # inside one shard, so its owner updates it whole
            assert slot.offset // b.shard_numel == (slot.offset + max(slot.numel, 1) - 1) // b.shard_numel
        pieces = [pc for r in range(world) for pc in b.pieces(b.shard(r))]
        assert sorted((pc.fqn, pc.param_start, pc.numel) for pc in pieces) == \
            sorted((s.fqn, 0, s.numel) for s in b.slots if s.numel)


@pytest.mark.parametrize("seed", SEEDS)
def test_owners_are_balanced_by_size_and_the_same_everywhere(seed):
    rng = random.Random(seed)
    numels = [rng.choice([1, 64, 256, 1024, 4096]) for _ in range(rng.randint(1, 40))]
    world = 1 + seed % 8
    owners = assign_owners(numels, world)
    assert owners == assign_owners(list(numels), world) and set(owners) <= set(range(world))
    load = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
    assert max(load) <= sum(numels) / world + max(numels)  # greedy largest-first's bound


def test_owned_bucket_worked_example():
    """Two 4x4 matrices and two 4-vectors over 2 ranks: a matrix and a vector each, shards of 20."""
    specs = [ParamSpec("a", (4, 4), 0), ParamSpec("b", (4,), 0), ParamSpec("c", (4, 4), 0), ParamSpec("d", (4,), 0)]
    b = plan_owned_bucket(0, 0, specs, 2)
    assert assign_owners([16, 4, 16, 4], 2) == (0, 0, 1, 1)
    assert (b.shard_numel, b.padded_numel, b.numel) == (20, 40, 40)
    assert [(s.fqn, s.offset) for s in b.slots] == [("a", 0), ("b", 16), ("c", 20), ("d", 36)]
