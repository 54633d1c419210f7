"""An asynchronous save writes all of the state of its call, the whole-tensor optimizers' too
(checkpoint/taken.py): the save's thread is held once the fence has released every bucket, training
goes on three steps meanwhile and changes every state, and a fresh engine loaded from the checkpoint
then holds, bitwise, the copies taken at the call: parameters, every bucket's master, the optimizer's
whole state dict (Muon's momentum, Adafactor's factored statistics, AdamW's moments, step counts).
Two ranks as threads (zerompi.comm.local), real HDF5 files and a real writer thread."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerompi
from tests.unit.optim import test_whole as w
from tests.unit.optim.loop import batch, train
from zerompi.checkpoint import CheckpointError, optimizer_record, save_async
from zerompi.checkpoint.entries import entries
from zerompi.checkpoint.taken import Capture, HostCopy, check_plain, owns_memory
from zerompi.checkpoint.tensors import TensorStates
from zerompi.checkpoint.writer import build_index
from zerompi.checkpoint.writer import parts as writer_parts
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig


def state(engine) -> dict:
    """Collective: everything a resume restores of this rank's engine, as copies taken now."""
    opt = engine.optimizer
    every = [p for g in opt.inner.param_groups for p in g["params"]]  # masters, or views of them (whole tensors)
    return {"params": engine.full_state_dict(), "masters": [b.master.detach().clone() for b in opt.buckets],
            "optimizer": [copy.deepcopy(opt.inner.state.get(p, {})) for p in every],
            "steps": (engine.stats.steps, engine.stats.skipped_steps)}


def tensors(value, at: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts and lists, by its path."""
    if isinstance(value, torch.Tensor):
        return {at: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {k: t for key, v in items for k, t in tensors(v, f"{at}/{key}").items()}


def differences(got: dict, want: dict) -> list[str]:
    """The paths where ``got`` is not bitwise ``want`` (tensors: values and dtype; the rest: ==)."""
    a, b = tensors(got), tensors(want)
    out = sorted(set(a) ^ set(b))
    out += [k for k in sorted(set(a) & set(b)) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return out + ([] if got["steps"] == want["steps"] else ["steps"])


@pytest.mark.parametrize("mode", list(w.MODES))
@pytest.mark.parametrize("stage", [1, 3])
def test_async_save_of_whole_tensor_state_is_the_calls(tmp_path, stage, mode):
    """Guards: packing the whole-tensor optimizer state (tensors.py's TensorStates) on the save's thread,
    after the call returns, instead of at the call: the file then holds the state of later steps."""
    def rank(group):
        engine = w._engine(group, stage, mode)
        train(engine, range(2))
        at_call, hold = state(engine), threading.Event()
        _, saving = save_async(engine, tmp_path, "mid", after_fence=hold.wait)
        try:
            train(engine, range(2, 5))  # while the writer is held: every state moves on
            moved = state(engine)
        finally:
            hold.set()
        saving.wait(engine.group)
        engine.close()
        fresh = w._engine(group, stage, mode)
        fresh.load_checkpoint(tmp_path)
        resumed = state(fresh)
        fresh.close()
        return at_call, moved, resumed

    for at_call, moved, resumed in run_ranks(2, rank):
        held = {k for k, t in tensors(at_call).items() if t.any()}  # a shard of padding alone stays zero
        assert held and held <= set(differences(moved, at_call)), held - set(differences(moved, at_call))
        assert not differences(resumed, at_call), differences(resumed, at_call)


def _live_arrays(engine) -> list[np.ndarray]:
    """The memory of every tensor the engine keeps that a step changes: masters, optimizer state, residuals."""
    opt = engine.optimizer
    live = [b.master for b in opt.buckets] + [r for _, r in engine.sharded.residuals()]
    live += [t for s in opt.inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.detach().numpy() for t in live]


def test_the_save_thread_gets_host_copies_and_the_fenced_buckets_alone():
    """What the save's thread receives, from an engine with Muon, AdamW and error-feedback residuals: the
    fenced buckets (every one held), the frozen shards, and host copies that are read-only, of their own
    memory and share none with any tensor the engine keeps; written, they are the synchronous save's datasets.
    Guards: an entry whose take() hands the thread a view of live state instead of a copy."""
    def rank(group):
        net = w._net()
        cfg = ZeroConfig(stage=3, **{**w.CFG, "reproducible": False, "micro_batches": None, "quantize_grads": "int4",
                                     "grad_error_feedback": True})
        engine = zerompi.initialize(net, cfg, group=group, param_groups=w._muon_groups(net))
        for step in range(2):
            x, y = batch(step, group.rank)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        snap = engine.snapshot()
        meta = optimizer_record.gathered(engine.group, snap.view, snap.recorded)
        capture = Capture.of(entries(snap, meta, True))
        kinds = [type(t).__name__ for t in capture.taken]
        held = all(snap.view.fence.held(i) for i in range(len(snap.view.shards)))
        live = _live_arrays(engine)
        copies = [a for t in capture.taken if isinstance(t, HostCopy) for _, a in t.datasets]
        private = all(not a.flags.writeable and owns_memory(a) and not any(np.shares_memory(a, m) for m in live)
                      for a in copies)
        written = [(n, a.copy()) for n, a in capture.parts()]  # releases the fence as it goes
        synchronous = list(writer_parts(snap, meta, True))
        engine.close()
        same = [n for n, _ in written] == [n for n, _ in synchronous] and \
            all(a.dtype == b.dtype and np.array_equal(a, b) for (_, a), (_, b) in zip(written, synchronous))
        return kinds, held, bool(copies) and private, same, len(engine.sharded.residuals())

    for kinds, held, private, same, residuals in run_ranks(2, rank):
        assert kinds == ["FencedBuckets", "HostCopy", "FrozenRead", "HostCopy", "HostCopy"] and residuals
        assert held and private and same


class _LazyTensorStates(TensorStates):
    """The whole-tensor state packed on the save's thread, after the call returns."""

    def take(self):
        return self.parts


def test_a_tensor_or_a_callable_cannot_reach_the_save_thread():
    """The capture refuses, at the call, anything but host copies of their own memory, the fenced buckets
    and the frozen shards; the index rank 0 publishes holds plain data alone.
    Guards: packing the whole-tensor optimizer state lazily, on the save's thread (take() returning a
    callable), and a tensor or a view of one handed over as a host copy."""
    with pytest.raises(CheckpointError, match="dataset 'x' from Tensor after the call returns"):
        HostCopy((("x", torch.zeros(3)),))
    with pytest.raises(CheckpointError, match="dataset 'x' from a view of a tensor's memory"):
        HostCopy((("x", torch.zeros(3).numpy()),))
    with pytest.raises(CheckpointError, match="a host copy's datasets must be a tuple, not generator"):
        HostCopy(("x", np.zeros(3)) for _ in range(1))
    with pytest.raises(CheckpointError, match="hands an asynchronous save's thread function"):
        Capture((lambda: iter(()),))
    copy_ = HostCopy.of([("x", torch.zeros(3).numpy())])
    assert owns_memory(copy_.datasets[0][1]) and not copy_.datasets[0][1].flags.writeable

    def rank(group):
        engine = w._engine(group, 1, "muon+adamw")
        train(engine, range(1))
        snap = engine.snapshot()
        meta = optimizer_record.gathered(engine.group, snap.view, snap.recorded)
        lazy = _LazyTensorStates(snap.view, engine.optimizer, meta.get("tensor_states"))
        try:
            with pytest.raises(CheckpointError, match="entry 'whole-tensor optimizer state' hands an asynchronous "
                                                      "save's thread method"):
                Capture.of([lazy])
            with pytest.raises(CheckpointError, match=r"the index\.client_state\['w'\], a Tensor"):
                check_plain(build_index(engine, snap, "t", {"w": torch.zeros(1)}, meta, "id", "per_rank", True),
                            "the index")
        finally:
            engine.close()
    run_ranks(2, rank)
