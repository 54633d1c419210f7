"""The stage-3 prefetch schedule: record the first forward, follow it, give up on a change; and an engine
whose model has no root unit, where the model's own forward begins each pass."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.shard.collectives import BucketState
from zerompi.shard.prefetch import Prefetcher

ROOT, A, B, C = (SimpleNamespace(fqn=n) for n in ("", "a", "b", "c"))


def _forward(p, units):
    return [p.forward(u, root=u is ROOT) for u in units]


def test_first_forward_records_then_prefetches_ahead_and_behind():
    p = Prefetcher(depth=1)
    assert _forward(p, [ROOT, A, B, C]) == [[], [], [], []]
    assert _forward(p, [ROOT, A, B, C]) == [[A], [B], [C], []]
    assert p.backward(C) == [B] and p.backward(B) == [A] and p.backward(A) == [ROOT] and p.backward(ROOT) == []


def test_backward_skips_units_whose_backward_began():
    """The root encloses the other units: its backward starts first, so the last unit's backward must not
    gather it again (with NVMe offload that read was thrown away by the step's publish)."""
    p = Prefetcher(depth=1)
    _forward(p, [ROOT, A, B, C])
    _forward(p, [ROOT, A, B, C])
    assert p.backward(ROOT) == [] and p.backward(C) == [B] and p.backward(B) == [A] and p.backward(A) == []
    _forward(p, [ROOT, A, B, C])  # a new pass forgets the last one's backward
    assert p.backward(A) == [ROOT]


def test_depth_two():
    p = Prefetcher(depth=2)
    _forward(p, [ROOT, A, B, C])
    assert _forward(p, [ROOT, A, B, C])[:2] == [[A, B], [B, C]]
    assert p.backward(C) == [B, A]


def test_changed_order_turns_prefetch_off_once(caplog):
    p = Prefetcher(depth=1)
    _forward(p, [ROOT, A, B, C])
    with caplog.at_level(logging.WARNING, logger="zerompi.shard.prefetch"):
        assert _forward(p, [ROOT, B, A, C]) == [[A], [], [], []]
        assert _forward(p, [ROOT, B, A, C]) == [[], [], [], []]
    assert not p.enabled and p.backward(C) == []
    warnings = [r for r in caplog.records if "prefetch turned off" in r.getMessage()]
    assert len(warnings) == 1 and "unit 'b' ran where 'a' ran" in warnings[0].getMessage()


def test_depth_zero_never_prefetches():
    p = Prefetcher(depth=0)
    assert _forward(p, [ROOT, A]) + _forward(p, [ROOT, A]) == [[], [], [], []]


def test_max_live_params_bounds_what_is_gathered_ahead():
    sizes = {"": 10, "a": 4, "b": 4, "c": 8}
    p = Prefetcher(depth=3, budget=18, size=lambda u: sizes[u.fqn])
    _forward(p, [ROOT, A, B, C])
    # the unit computing counts: root (10) + a (4) + b (4) = 18 fits, c would not
    assert _forward(p, [ROOT, A, B, C]) == [[A, B], [B, C], [C], []]
    assert p.backward(C) == [B, A] and p.backward(B) == [A, ROOT]  # 4 + 4 + 10 = 18
    assert Prefetcher(depth=2, budget=5, size=lambda u: sizes[u.fqn]).backward(C) == []  # never recorded
    big = Prefetcher(depth=2, budget=3, size=lambda u: sizes[u.fqn])
    _forward(big, [ROOT, A, B, C])
    assert _forward(big, [ROOT, A, B, C]) == [[], [], [], []]  # every unit alone exceeds it: no prefetch


def _two_units(group):
    """Linear, ReLU, Linear at stage 3 with one unit per Linear (no root unit) and prefetch_units=1."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=1e-2, prefetch_units=1, bucket_mb=1e-4,
                             cpu_threads=1, device="cpu", abort_on_exception=False)
    return m, zerompi.initialize(m, cfg, group=group)


def test_a_model_whose_root_holds_no_parameter_prefetches():
    """Every parameter in a smaller unit leaves no root unit, so the model's own forward begins each pass: the
    recording ends after the first pass (it grew by a pass per forward before) and later forwards gather ahead."""
    def rank(group):
        m, engine = _two_units(group)
        s = engine.sharded
        ahead = []
        m[0].register_forward_pre_hook(lambda *_: ahead.append(s.units[1].members[0].state))
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
        engine.close()
        prefetcher = s.schedule.prefetcher
        return [u.fqn for u in s.units], [u.fqn for u in prefetcher.order], prefetcher.recording, ahead
    for units, order, recording, ahead in run_ranks(2, rank):
        assert units == order == ["0", "2"] and not recording
        assert ahead == [BucketState.SHARDED, BucketState.GATHERING, BucketState.GATHERING]


def test_a_units_backward_gathers_the_unit_before_it_ahead():
    """In backward, unit '2' starts the gather of unit '0' (prefetch_units=1), which is in flight when the
    gradient reaches the ReLU between them, once the first pass has recorded the order.
    Break guarded: the schedule's backward prefetch not issued (it survived every unit test)."""
    def rank(group):
        m, engine = _two_units(group)
        s, seen = engine.sharded, []

        def watch(_module, _args, out):
            out.register_hook(lambda _grad: seen.append(s.units[0].members[0].state))
        m[1].register_forward_hook(watch)
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
        engine.close()
        return seen
    for seen in run_ranks(2, rank):
        assert seen == [BucketState.SHARDED, BucketState.GATHERING, BucketState.GATHERING]
