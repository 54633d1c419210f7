"""Asynchronous saves on one rank (MPI_COMM_SELF): the state of the call is written while training goes on,
the fence makes the step wait for buckets not yet taken, failures come back through wait_checkpoint.
The multi-rank cases (markers, publication by rank 0, kills) are in tests/mpi/test_checkpoint.py."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi
from zerompi.checkpoint import load_full_state_dict, stores
from zerompi.offload.fence import ShardFence
from zerompi.errors import CheckpointError, UsageError


def engine(**kw) -> zerompi.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    cfg = zerompi.ZeroConfig(stage=kw.pop("stage", 3), optimizer="adamw", lr=1e-2, bucket_mb=0.01, cpu_threads=1,
                             device="cpu", checkpoint_layout="per_rank", abort_on_exception=False, **kw)
    return zerompi.initialize(model, cfg, comm=MPI.COMM_SELF)


def train(e, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        e.backward(e(x).pow(2).mean())
        e.step()


def slowed(e, seconds: float) -> list[int]:
    """Delay each bucket the save takes; returns the buckets in the order taken."""
    frozen, taken = e.optimizer.fenced_state, []

    @contextmanager
    def slow(index):
        time.sleep(seconds)
        taken.append(index)
        with frozen(index) as held:
            yield held
    e.optimizer.fenced_state = slow
    return taken


def gated(e) -> tuple[list[int], threading.Event]:
    """Hold each bucket the save takes until the returned gate opens (at most 60 s); returns the buckets in the
    order taken, and the gate."""
    frozen, taken, gate = e.optimizer.fenced_state, [], threading.Event()

    @contextmanager
    def held(index):
        gate.wait(60)
        taken.append(index)
        with frozen(index) as state:
            yield state
    e.optimizer.fenced_state = held
    return taken, gate


def _open_once(gate: threading.Event, cond, limit: float = 60.0) -> threading.Thread:
    """A thread that opens ``gate`` once ``cond()`` holds (or after ``limit`` s: no test waits forever)."""
    def run():
        end = time.monotonic() + limit
        while not cond() and time.monotonic() < end:
            time.sleep(0.01)
        gate.set()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("kw", [{}, {"checkpoint_async_copy": True}, {"stage": 1}], ids=["live", "copy", "stage1"])
def test_async_save_holds_the_state_of_the_call(tmp_path, kw, monkeypatch):
    """The save returns before it has taken any bucket; the next step waits for the buckets it has not taken
    (the gate opens only once a step waits on the fence), and the file holds the state of the call."""
    e = engine(**kw)
    train(e, 2, seed=1)
    at_call = e.full_state_dict()
    taken, gate = gated(e)
    fence, waiting, wait = e._fence, threading.Event(), e._fence.wait

    def noted_wait(index):
        if fence.held(index):
            waiting.set()
        wait(index)
    monkeypatch.setattr(fence, "wait", noted_wait)
    position = {"n": 2}
    tag = e.save_checkpoint(tmp_path, "t", client_state=position, async_save=True)
    taken_at_return = list(taken)
    opener = _open_once(gate, waiting.is_set)
    position["n"] = 4  # changed in place before the save publishes: the index holds the call's value
    train(e, 2, seed=2)  # the step waits for the buckets the save has not taken yet
    opener.join()
    e.wait_checkpoint()
    assert tag == "t" and (tmp_path / "latest").read_text().strip() == "t" and not list(tmp_path.glob(".tmp-*"))
    assert taken == list(range(len(e.sharded.buckets)))
    saved = load_full_state_dict(tmp_path)
    for name, value in at_call.items():
        assert torch.equal(saved[name], value), name
    assert e._fence.waits > 0 and taken_at_return == []
    fresh = engine(**kw)
    assert fresh.load_checkpoint(tmp_path) == {"n": 2}
    after = e.full_state_dict()
    train(fresh, 0, seed=2)
    assert any(not torch.equal(after[n], at_call[n]) for n in after)  # training went on meanwhile
    e.close()
    fresh.close()


def test_close_and_the_next_save_wait_for_the_save_in_flight(tmp_path):
    e = engine()
    train(e, 1, seed=1)
    slowed(e, 0.05)
    e.save_checkpoint(tmp_path, "a", async_save=True)
    e.save_checkpoint(tmp_path, "b", async_save=True)  # waits for "a" first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"] or (tmp_path / "a").is_dir()
    e.close()  # waits for "b"
    assert (tmp_path / "latest").read_text().strip() == "b" and (tmp_path / "b" / "index.h5").is_file()
    e.wait_checkpoint()  # nothing in flight: nothing to do


def test_failed_async_save_raises_at_wait_and_keeps_latest(tmp_path, monkeypatch):
    e = engine()
    train(e, 1, seed=1)
    e.save_checkpoint(tmp_path, "good")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device (test)")
    monkeypatch.setattr(stores, "write_rank_file", broken)
    e.save_checkpoint(tmp_path, "bad", async_save=True)
    with pytest.raises(CheckpointError, match=r"asynchronous save of 'bad' failed: rank 0: OSError.*No space left"):
        e.wait_checkpoint()
    assert (tmp_path / "latest").read_text().strip() == "good" and not (tmp_path / "bad").exists()
    train(e, 1, seed=2)  # the fence was released: training goes on
    e.close()


def test_async_save_refuses_the_shared_layout(tmp_path):
    e = engine()
    e.config = e.config.replace(checkpoint_layout="shared")  # what initialize refuses without a parallel h5py
    with pytest.raises(UsageError, match="checkpoint_layout='shared'"):
        e.save_checkpoint(tmp_path, async_save=True)
    e.close()


def test_fence_wait_blocks_until_release():
    fence, seen = ShardFence(), []
    fence.hold([0, 1])
    waiter = threading.Thread(target=lambda: (fence.wait(1), seen.append("1 free")))
    waiter.start()
    fence.wait(2)  # never held
    time.sleep(0.05)
    assert seen == [] and fence.held(1)
    fence.release(0)
    time.sleep(0.02)
    assert seen == []
    fence.release(1)
    waiter.join(5)
    assert seen == ["1 free"] and fence.waits == 1

