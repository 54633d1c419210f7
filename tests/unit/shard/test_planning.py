"""shard/planning.py's plan_layouts on a model that has every kind of parameter at stage 3: a small
trainable one kept gathered (under the persistence threshold), trainable and frozen ones sharded, in two
gather units, one of them a wrapper whose inner module runs on its own. Checked whole: the bucket numbering
(gathered buckets first, then each unit's trainable ones continuing that count; frozen ones numbered apart
from 0), each sharded parameter's unit, each unit's entries, the units chosen at the cap (a module owning
exactly the cap's elements is a unit), and stages 0-2 planning no units.

Guards the planning.py mutants the engine tests let through (benchmarks/results/mutation-shard-planning.md)."""
from __future__ import annotations

import logging

from torch import nn

from zerompi import log
from zerompi.shard.placement import place
from zerompi.shard.planning import log_plan, plan_layouts
from zerompi.shard.stages import plan_for


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)  # 40 elements

    def forward(self, x):
        return self.fc(x)


class Wrapper(nn.Module):  # a unit whose parameters all sit in a module that runs on its own
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Net(nn.Module):
    def __init__(self, frozen_base: bool = True):
        super().__init__()
        self.scale = nn.Parameter(nn.init.ones_(nn.Linear(1, 2).weight))  # 2 elements: kept gathered
        self.base = nn.Linear(4, 4)  # frozen (unless asked), sharded
        self.base.requires_grad_(not frozen_base)
        self.head = Wrapper()

    def forward(self, x):
        return self.head(self.base(x)) * self.scale.sum()


def _plan(stage: int, cap: int, threshold: int = 3, frozen_base: bool = True, whole=frozenset()):
    net = Net(frozen_base)
    placed = place([(n, tuple(p.shape), p.requires_grad) for n, p in net.named_parameters()], plan_for(stage),
                   threshold, {n: 0 for n, p in net.named_parameters() if p.requires_grad})
    return net, plan_layouts(net, placed, plan_for(stage), 2, cap, whole=whole)


def _rows(layouts):
    return [(b.index, b.unit, b.trainable, [s.fqn for s in b.slots]) for b in layouts]


def test_stage_3_numbers_buckets_places_units_and_finds_their_entries():
    """cap 40: head.inner.fc owns exactly 40 elements, so it is a unit of its own; the frozen base joins the
    root's unit, whose entries reach down to base (the deepest module holding all its parameters)."""
    net, (layouts, units, unit_of) = _plan(3, cap=40)
    assert _rows(layouts) == [(0, "", True, ["scale"]),                          # gathered: first, counted
                              (0, "", False, ["base.weight", "base.bias"]),      # frozen: numbered apart, from 0
                              (1, "head.inner.fc", True, ["head.inner.fc.weight", "head.inner.fc.bias"])]
    assert unit_of == {"base.weight": "", "base.bias": "", "head.inner.fc.weight": "head.inner.fc",
                       "head.inner.fc.bias": "head.inner.fc"}
    assert [(u.fqn, u.entries) for u in units] == [("", [net, net.base]), ("head.inner.fc", [net.head.inner.fc])]


def test_a_module_owning_one_element_less_than_the_cap_is_no_unit():
    """cap 41: head.inner.fc's 40 elements join the root's unit, numbered after the gathered bucket."""
    net, (layouts, units, unit_of) = _plan(3, cap=41)
    assert _rows(layouts) == [(0, "", True, ["scale"]),
                              (1, "", True, ["head.inner.fc.weight", "head.inner.fc.bias"]),
                              (0, "", False, ["base.weight", "base.bias"])]
    assert [u.fqn for u in units] == [""] and set(unit_of.values()) == {""}


def test_a_unit_above_the_modules_holding_its_parameters_enters_through_each_that_runs():
    """One sharded parameter, deep in the wrapper: the root's unit is entered by every module that runs on
    the way down to it (PeftModel.generate calls the inner model's forward, not the wrapper's)."""
    net, (layouts, units, unit_of) = _plan(3, cap=1000, threshold=17)
    assert unit_of == {"head.inner.fc.weight": ""}
    assert [(u.fqn, u.entries) for u in units] == [("", [net, net.head, net.head.inner, net.head.inner.fc])]


def test_stages_0_to_2_plan_no_units():
    for stage in (0, 1, 2):
        _, (layouts, units, unit_of) = _plan(stage, cap=20)
        assert units == [] and unit_of == {} and all(b.unit == "" for b in layouts)


def test_units_number_their_trainable_buckets_on_from_each_other():
    """base trainable: the root's unit takes bucket 1 after the gathered one, head.inner.fc's unit bucket 2."""
    _, (layouts, _, _) = _plan(3, cap=40, frozen_base=False)
    assert [(b.index, b.unit) for b in layouts] == [(0, ""), (1, ""), (2, "head.inner.fc")]


def test_stage_0_plans_no_owner_aligned_buckets():
    """Every rank updates every tensor at stage 0: a whole-tensor group is bucketed as any other."""
    _, (plain, _, _) = _plan(0, cap=20, frozen_base=False)
    _, (whole, _, _) = _plan(0, cap=20, frozen_base=False, whole=frozenset({0}))
    assert [(b.index, b.padded_numel, [s.offset for s in b.slots]) for b in whole] == \
        [(b.index, b.padded_numel, [s.offset for s in b.slots]) for b in plain]


def test_the_plan_is_logged_at_info(caplog):
    """On rank 0 (set here: an in-process group run before may have left this process another rank)."""
    _, (layouts, _, _) = _plan(3, cap=40)
    before = log._RANK
    log.set_rank(0)
    try:
        with caplog.at_level(logging.INFO, logger="zerompi.shard.planning"):
            log_plan(3, [(b, b.trainable) for b in layouts], 2)
    finally:
        log.set_rank(before)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "stage 3, 3 buckets (1 frozen) on 2 ranks:" in text and "frozen   0 unit=-" in text, text
