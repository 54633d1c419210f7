"""What a checkpoint records of whole-tensor optimizer state (zerompi/checkpoint/tensors.py), checked
against the optimizer's own state as torch keeps it: each tensor written once, back to back from the
start of its writer's ``t/states``, every rank's dataset the longest rank's length; plain scalars kept
per tensor survive a resume; a dtype it cannot hold is refused; and a job without whole-tensor groups
writes none of it."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import zerompi
from tests.unit.optim import test_whole as w
from tests.unit.optim.loop import plain, train
from zerompi.checkpoint import schema, tensors
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import CheckpointError


class Counting(torch.optim.Optimizer):
    """Steps whole tensors (it declares nothing): ``p -= lr * grad / step``, the step a plain int per tensor."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    self.more(state, p)
                    p.add_(p.grad, alpha=-group["lr"] / state["step"])

    def more(self, state: dict, p: torch.Tensor) -> None:
        pass


class Tallying(Counting):
    """Counting, with a float64 tensor of state per tensor (a dtype a checkpoint does not hold)."""

    def more(self, state: dict, p: torch.Tensor) -> None:
        state["tally"] = state.get("tally", torch.zeros((), dtype=torch.float64)) + p.grad.double().abs().sum()


CFG = {k: v for k, v in w.CFG.items() if k != "weight_decay"}


def _engine(group, stage: int, optimizer, net: nn.Module | None = None, **changes):
    config = ZeroConfig(stage=stage, **{**CFG, "optimizer": optimizer, **changes})
    return zerompi.initialize(w._net() if net is None else net, config, group=group)


def _states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Each tensor's state tensors as the optimizer keeps them on this rank."""
    return {name: {k: v.clone() for k, v in state.items()}
            for i in range(len(engine.sharded.buckets)) for name, _, state in engine.optimizer.tensor_states(i)}


@pytest.mark.parametrize("optimizer", ["torch.optim.Adafactor", Counting], ids=["adafactor", "counting"])
def test_each_writer_packs_its_tensors_back_to_back_from_the_start(tmp_path, optimizer):
    """Saved at stage 2 on 3 ranks: the records name each tensor with state once, on the rank that steps
    it, at offsets that run back to back from 0 in its ``t/states``, holding its state tensors (by name,
    as fp32) exactly; every rank's ``t/states`` is the longest rank's length (Counting keeps no state
    tensor: zero)."""
    def rank(group):
        engine = _engine(group, 2, optimizer)
        train(engine, range(2))
        engine.save_checkpoint(tmp_path, "s")
        states = _states(engine)
        engine.close()
        return states
    held = run_ranks(3, rank)
    records = CheckpointIndex.read(tmp_path / "s" / schema.INDEX).optimizer.get("tensor_states", {})
    assert records.keys() == {n for states in held for n in states}
    totals = [sum(v.numel() for s in states.values() for v in s.values()) for states in held]
    for r, states in enumerate(held):
        with h5py.File(tmp_path / "s" / schema.rank_file(r), "r") as f:
            packed = f[schema.TENSOR_STATES][()]
        assert len(packed) == max(totals)
        at = 0
        for name, record in sorted(((n, rec) for n, rec in records.items() if rec["rank"] == r),
                                   key=lambda item: item[1]["offset"]):
            assert record["offset"] == at and name in states, (r, name)
            want = np.concatenate([states[name][k].float().reshape(-1).numpy() for k in sorted(states[name])])
            assert np.array_equal(packed[at:at + len(want)], want), (r, name)
            at += len(want)
        assert at == totals[r]


def test_plain_scalars_kept_per_tensor_resume_on_other_owners(tmp_path):
    """Counting's step is a plain int on each tensor's owner; saved on 3 ranks (rank 0 owns no tensor of
    the second bucket) and resumed on 2, the third step is the plain loop's bits (a lost count would
    restart the step at 1)."""
    def save(group):
        engine = _engine(group, 2, Counting)
        train(engine, range(2))
        engine.save_checkpoint(tmp_path, "s")
        engine.close()

    def resume(group):
        engine = _engine(group, 3, Counting)
        engine.load_checkpoint(tmp_path, "s")
        train(engine, range(2, 3))
        got = engine.full_state_dict()
        engine.close()
        return got
    run_ranks(3, save)
    net = w._net()
    want = plain(net, [Counting(net.parameters(), lr=CFG["lr"])], 3)
    for got in run_ranks(2, resume):
        assert not w._differences(got, want), w._differences(got, want)


def test_at_stage_0_a_tensor_starting_a_replicas_slice_is_written_by_that_replica_alone(tmp_path):
    """Stage 0 (every rank steps every tensor; each writes its slice of the bucket): two 8x8 matrices
    split the bucket at 64 elements, so the second starts rank 1's slice exactly where rank 0's ends.
    It is recorded once, on rank 1, and every tensor loads the state torch's Adafactor had."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))

    def step(engine):
        engine.backward(engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).square().mean())
        assert engine.step()

    def rank(group):
        engine = _engine(group, 0, "torch.optim.Adafactor", net(), reproducible=False, micro_batches=None)
        step(engine)
        engine.save_checkpoint(tmp_path, "s")
        before = _states(engine)
        engine.close()
        loaded = _engine(group, 0, "torch.optim.Adafactor", net(), reproducible=False, micro_batches=None)
        loaded.load_checkpoint(tmp_path, "s")
        after = _states(loaded)
        written = [(s.written.start, s.written.stop) for s in loaded.snapshot().view.shards]
        loaded.close()
        return before, after, written
    got = run_ranks(2, rank)
    assert got[0][2] == [(0, 64)] and got[1][2] == [(64, 128)]  # the case this test is about
    records = CheckpointIndex.read(tmp_path / "s" / schema.INDEX).optimizer["tensor_states"]
    assert {n: r["rank"] for n, r in records.items()} == {"2.weight": 0, "0.weight": 1}
    for before, after, _ in got:
        assert before.keys() == after.keys() == {"0.weight", "2.weight"}
        assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])


def test_a_state_of_a_dtype_a_checkpoint_cannot_hold_is_refused_on_every_rank(tmp_path):
    """Tallying keeps a float64 tensor per tensor: the save is refused on every rank, naming the state,
    its tensor and the dtypes a checkpoint holds."""
    def rank(group):
        engine = _engine(group, 2, Tallying)
        train(engine, range(1))
        with pytest.raises(CheckpointError, match=r"optimizer state 'tally' of tensor '[\w.]+' is float64: a "
                                                  r"checkpoint holds whole-tensor state of dtypes \['float32'"):
            engine.save_checkpoint(tmp_path, "s")
        engine.close()
        return True
    assert run_ranks(2, rank) == [True, True]


def test_a_job_without_whole_tensor_groups_records_and_writes_none(tmp_path):
    """AdamW steps flat shards: the index has no ``tensor_states`` (which the loader reads as none), no
    rank file has ``t/states``, and a resume on another world size gets the optimizer state it had."""
    def save(group):
        engine = _engine(group, 2, "adamw", weight_decay=0.01)
        train(engine, range(2))
        engine.save_checkpoint(tmp_path, "s")
        engine.close()

    def resume(group):
        engine = _engine(group, 1, "adamw", weight_decay=0.01)
        engine.load_checkpoint(tmp_path, "s")
        train(engine, range(2, 3))
        got = engine.full_state_dict()
        engine.close()
        return got
    run_ranks(2, save)
    index = CheckpointIndex.read(tmp_path / "s" / schema.INDEX)
    assert "tensor_states" not in index.optimizer and tensors.checked(index.optimizer.get("tensor_states"), 2) == {}
    for r in range(2):
        with h5py.File(tmp_path / "s" / schema.rank_file(r), "r") as f:
            assert schema.TENSOR_STATES not in f, r
    net = w._net()
    want = plain(net, [torch.optim.AdamW(net.parameters(), lr=CFG["lr"], weight_decay=0.01, foreach=False)], 3)
    for got in run_ranks(3, resume):
        assert not w._differences(got, want), w._differences(got, want)


GOOD = {"rank": 0, "offset": 0, "shapes": {"row_var": [40, 1], "step": []},
        "dtypes": {"row_var": "float32", "step": "float32"}}


@pytest.mark.parametrize("shapes,ok", [
    ({"row_var": [40, 0], "step": []}, True),  # a state of no elements still has a shape
    ({"row_var": [0], "step": []}, True),
    ({"": [40, 1], "step": []}, False),  # a state needs a name
])
def test_a_record_s_state_names_and_shapes(shapes, ok):
    """The index check takes what torch takes as a tensor's shape (dimensions of 0 included: torch.empty
    makes such a tensor) and refuses a state without a name."""
    record = {**GOOD, "shapes": shapes, "dtypes": dict.fromkeys(shapes, "float32")}
    if ok:
        assert all(torch.empty(s).shape == tuple(s) for s in shapes.values())
        assert tensors.checked({"w": record}, 1) == {"w": record}
    else:
        with pytest.raises(CheckpointError, match="must name the same states"):
            tensors.checked({"w": record}, 1)
