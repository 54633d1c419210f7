"""zerompi.comm.mpi.MPIGroup in one process: MPI.COMM_SELF and a Dup of it, and a recording stand-in communicator.

On a world of one every collective is a local copy (no MPI call) and the (N-1)/N volume is 0, so the
byte formulas are pinned with ``Recorder``, a duck-typed communicator of any size that
records which MPI call each verb makes and moves no data (except where a test presets
what Alltoall delivers). What these tests pin is today's behaviour, including the odd
parts (marked "today:"), so that a refactor of comm/ can be checked against it.
"""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from zerompi.comm.group import Work
from zerompi.comm.monitor import CollectiveMismatchError, Monitor
from zerompi.comm.mpi import MPIGroup
from zerompi.errors import ZeroMPIError


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("ZEROMPI_DEBUG", raising=False)


def self_group(**kw) -> MPIGroup:
    return MPIGroup(MPI.COMM_SELF, **kw)


@pytest.fixture(params=["COMM_SELF", "COMM_SELF.Dup()"])
def g(request) -> MPIGroup:
    """A group of one over ``COMM_SELF`` itself and over a duplicate (its own context, as mpi4py's tests do)."""
    if request.param == "COMM_SELF":
        yield self_group()
        return
    group = MPIGroup(MPI.COMM_SELF.Dup())
    yield group
    group.free()


class Request:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def Wait(self):
        self.log.append(f"Wait {self.name}")

    def Test(self):
        return True


class Recorder:
    """Rank ``rank`` of ``size``: records each MPI call by name; Alltoall writes ``deliver``."""

    def __init__(self, size: int, rank: int = 0, deliver: torch.Tensor | None = None, others=None):
        self.size, self.rank, self.deliver, self.others = size, rank, deliver, others
        self.calls: list[str] = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def __getattr__(self, name):
        if not name[:1].isupper():
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)
            if name in ("Alltoall", "Ialltoall") and self.deliver is not None:
                args[1].copy_(self.deliver.view(args[1].dtype))
            return Request(self.calls, name) if name.startswith("I") else None
        return call

    def allgather(self, obj):  # the debug check and allgather_object (pickled objects)
        self.calls.append("allgather")
        return [obj] + [obj if self.others is None else self.others] * (self.size - 1)


# ---- results on COMM_SELF ----------------------------------------------------------------

def test_group_of_one(g):
    assert (g.rank, g.size, g.label, g.cuda_aware, g.monitor.agreement.debug) == (0, 1, "", False, False)
    assert dict(g.bytes_sent) == {} and g.monitor.agreement.seq == 0 and g.monitor.watchdog.waiting is None
    assert g.h5py_comm() is g.comm and g.h5py_comm().Get_size() == 1


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_reduce_is_identity_in_place(g, async_op, dtype):
    t = torch.linspace(-1, 1, 7, dtype=dtype)
    before = t.clone()
    work = g.all_reduce(t, async_op=async_op)
    assert isinstance(work, Work) and work.wait() is None and work.test()
    assert torch.equal(t, before) and t.dtype == dtype


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_reduce_scatter_returns_fp32(g, async_op, dtype):
    full = torch.linspace(-3, 3, 6).to(dtype)
    before = full.clone()
    out = g.reduce_scatter(full, async_op=async_op).wait()
    # today: the result is fp32 for every input dtype, fp64 included (``out.float()``)
    assert out.dtype == torch.float32 and torch.equal(out, before.float())
    assert torch.equal(full, before)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_gather_copies_and_in_place(g, async_op, dtype):
    shard = torch.arange(5).to(dtype)
    out = torch.full((5,), -1.0).to(dtype)
    assert g.all_gather(shard, out, async_op=async_op).wait() is None
    assert torch.equal(out, shard)
    g.all_gather(None, out, async_op=async_op).wait()  # in place: unchanged
    assert torch.equal(out, shard)


def test_broadcast_sum_floats_allgather_object_barrier(g):
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    g.broadcast(t)
    assert t.tolist() == [1.0, 2.0]
    assert g.sum_floats([1.5, -2.25]) == [1.5, -2.25]
    assert g.allgather_object({"a": 1}) == [{"a": 1}]
    g.barrier()
    assert g.monitor.agreement.seq == 2  # broadcast and sum_floats' all_reduce; objects and barriers are not counted


def test_byte_counters_on_one_rank_are_zero_but_keyed(g):
    g.all_reduce(torch.zeros(8))
    g.reduce_scatter(torch.zeros(8))
    g.all_gather(torch.zeros(8), torch.zeros(8), kind="custom")
    g.broadcast(torch.zeros(8))
    g.sum_floats([1.0])
    sub = g.split(0, 0, "intra")
    assert (sub.size, sub.label) == (1, "intra") and sub.monitor is g.monitor
    node = g.split_shared()
    assert (node.size, node.label) == (1, "node") and node.monitor is g.monitor
    sub.all_reduce(torch.zeros(8))
    assert dict(g.bytes_sent) == {"all_reduce": 0, "reduce_scatter": 0, "custom": 0, "broadcast": 0,
                                  "control": 0, "all_reduce@intra": 0}
    assert g.monitor.agreement.seq == 6
    sub.free()
    node.free()


def test_work_wait_is_idempotent():
    calls = []
    w = Work(finish=lambda: calls.append(1) or len(calls))
    assert w.test() and w.wait() == 1 and w.wait() == 1 and calls == [1]
    assert Work().wait() is None and Work().test()


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda g: g.all_reduce(torch.zeros(2, 3)), "1-D contiguous"),
    (lambda g: g.all_reduce(torch.zeros(6)[::2]), "contiguous=False"),
    (lambda g: g.all_reduce(torch.zeros(4, dtype=torch.bfloat16)), "MPI cannot sum torch.bfloat16"),
    (lambda g: g.all_reduce(torch.zeros(4, dtype=torch.int64)), "MPI cannot sum torch.int64"),
    (lambda g: g.reduce_scatter(torch.zeros(2, 2)), "1-D contiguous"),
    (lambda g: g.all_gather(torch.zeros(3), torch.zeros(4)), "shard 3 x 1 ranks != out 4"),
    (lambda g: g.all_gather(torch.zeros(4), torch.zeros(8)[::2]), "all_gather out"),
    (lambda g: g.all_gather(torch.zeros(4, 1), torch.zeros(4)), "all_gather shard"),
    # today: a dtype mismatch reports the size message, although the sizes agree
    (lambda g: g.all_gather(torch.zeros(3, dtype=torch.float64), torch.zeros(3)), "shard 3 x 1 ranks != out 3"),
    (lambda g: g.broadcast(torch.zeros(2, 2)), "broadcast"),
])
def test_bad_input_raises_before_any_collective(g, call, message):
    with pytest.raises(ZeroMPIError, match=message.replace("[", r"\[")):
        call(g)
    assert g.monitor.agreement.seq == 0 and dict(g.bytes_sent) == {}


def test_reduce_scatter_bad_size_and_dtype():
    g = MPIGroup(Recorder(size=4))
    with pytest.raises(ZeroMPIError, match="10 elements do not split over 4 ranks"):
        g.reduce_scatter(torch.zeros(10))
    assert g.monitor.agreement.seq == 0
    # an unsupported dtype is rejected before it is counted or numbered (shapes.py checks first)
    with pytest.raises(ZeroMPIError, match="unsupported dtype torch.int32"):
        g.reduce_scatter(torch.zeros(8, dtype=torch.int32))
    assert g.monitor.agreement.seq == 0 and dict(g.bytes_sent) == {}
    assert g.comm.calls == []


# ---- what is counted and which MPI call is made, on N ranks -----------------------------

@pytest.mark.parametrize("size", [2, 4])
def test_byte_formulas_and_mpi_calls(size):
    comm = Recorder(size)
    g = MPIGroup(comm)
    P = 8 * size
    g.all_gather(torch.zeros(P // size), torch.zeros(P))                    # fp32
    g.all_gather(None, torch.zeros(P, dtype=torch.bfloat16), kind="ag16", async_op=True).wait()
    g.reduce_scatter(torch.zeros(P))
    g.reduce_scatter(torch.zeros(P, dtype=torch.bfloat16), kind="rs16", async_op=True).wait()
    g.reduce_scatter(torch.zeros(P, dtype=torch.float64), kind="rs64")
    g.all_reduce(torch.zeros(P, dtype=torch.float64), async_op=True).wait()
    g.broadcast(torch.zeros(P))
    g.sum_floats([1.0, 2.0])
    n = size - 1
    assert dict(g.bytes_sent) == {
        "all_gather": n * 8 * 4, "ag16": n * 8 * 2,
        "reduce_scatter": n * 8 * 4, "rs16": n * 8 * 2, "rs64": n * 8 * 8,
        "all_reduce": 2 * n * P * 8 // size,
        "broadcast": n * P * 4,                           # counted by the root only
        "control": 2 * n * 2 * 8 // size,                 # sum_floats: an fp64 all_reduce
    }
    assert comm.calls == ["Allgather", "Iallgather", "Wait Iallgather", "Reduce_scatter_block",
                          "Ialltoall", "Wait Ialltoall", "Reduce_scatter_block", "Iallreduce",
                          "Wait Iallreduce", "Bcast", "Allreduce"]
    assert g.monitor.agreement.seq == 8


def test_broadcast_not_counted_off_root():
    g = MPIGroup(Recorder(size=4, rank=2))
    g.broadcast(torch.zeros(16))
    assert dict(g.bytes_sent) == {} and g.monitor.agreement.seq == 1


def test_labelled_group_counts_under_its_label():
    g = MPIGroup(Recorder(size=2), label="inter", monitor=Monitor())
    g.all_gather(torch.zeros(3), torch.zeros(6))
    assert dict(g.bytes_sent) == {"all_gather@inter": 12}


def test_16bit_reduce_scatter_sums_in_fp32_in_rank_order():
    # 3 ranks, one element each: this rank receives 256, 1, 1 (bf16). In bf16, 256 + 1 rounds
    # back to 256 twice; the fp32 sum gives 258.
    recv = torch.tensor([256.0, 1.0, 1.0], dtype=torch.bfloat16)
    g = MPIGroup(Recorder(size=3, deliver=recv))
    out = g.reduce_scatter(torch.zeros(3, dtype=torch.bfloat16)).wait()
    assert out.dtype == torch.float32 and out.tolist() == [258.0]
    assert ((recv[0] + recv[1]) + recv[2]).item() == 256.0


# ---- debug mode -----------------------------------------------------------------------------

@pytest.mark.parametrize("env, debug", [(None, False), ("0", False), ("", False), ("1", True), ("yes", True)])
def test_debug_from_environment(monkeypatch, env, debug):
    if env is not None:
        monkeypatch.setenv("ZEROMPI_DEBUG", env)
    assert self_group().monitor.agreement.debug is debug
    assert self_group(debug=True).monitor.agreement.debug is True


def test_debug_check_agrees_on_one_rank():
    comm = Recorder(size=1)
    g = MPIGroup(comm, debug=True)
    g.all_reduce(torch.zeros(6), what="bucket 0")
    # the debug check's exchange only: a one-rank group's collective is a local copy (staging.py)
    assert comm.calls == ["allgather"] and g.monitor.agreement.seq == 1
    g2 = self_group(debug=True)
    g2.reduce_scatter(torch.zeros(4, dtype=torch.float16))
    assert g2.monitor.agreement.seq == 1 and g2.monitor.watchdog.waiting is None


def test_debug_mismatch_names_every_rank():
    comm = Recorder(size=2, others="all_gather #0 of 6 x float32")
    g = MPIGroup(comm, debug=True)
    with pytest.raises(CollectiveMismatchError) as info:
        g.all_reduce(torch.zeros(6), what="bucket 0")
    assert str(info.value).endswith("rank 0: all_reduce #0 of 6 x float32 for bucket 0; "
                                    "rank 1: all_gather #0 of 6 x float32")
    assert isinstance(info.value, ZeroMPIError)
    # the mismatch is found before the data moves; the sequence number is spent
    assert comm.calls == ["allgather"] and g.monitor.agreement.seq == 1 and g.monitor.watchdog.waiting is None


def test_no_debug_check_without_debug():
    comm = Recorder(size=2, others="something else")
    g = MPIGroup(comm)
    g.all_reduce(torch.zeros(6))
    assert comm.calls == ["Allreduce"]


def test_metadata_on_its_own_communicator():
    """separate_metadata: allgather_object runs on a duplicate, so a lone metadata exchange can never
    match a peer's data collective (the watchdog names it instead)."""
    plain = MPIGroup(MPI.COMM_SELF.Dup())
    assert plain.communicators == (plain.comm,) and plain.metadata_comm is None
    group = MPIGroup(MPI.COMM_SELF.Dup(), separate_metadata=True)
    meta = group.metadata_comm
    assert group.communicators == (group.comm, meta)
    assert MPI.Comm.Compare(group.comm, meta) == MPI.CONGRUENT  # same ranks, another context
    assert group.allgather_object({"a": 1}) == [{"a": 1}]
    for g in (plain, group):
        for comm in g.communicators:
            comm.Free()
