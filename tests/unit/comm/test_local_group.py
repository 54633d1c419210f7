"""The in-process group (zerompi/comm/local.py): every verb at 2-4 ranks against what it must compute,
and whole engines at 2 and 3 ranks against single-process PyTorch, in one pytest process.

The engine rows are the MPI parity rows (tests/mpi/test_parity.py) without ``mpiexec``: the same tiny
GPT, global batches and order-noise bound (tests/mpi/tolerance.py), so a change to shard, optimizer
or codec logic gets a multi-rank verdict in seconds.
"""
from __future__ import annotations

import threading

import pytest
import torch

import zerompi
from tests.mpi import tolerance
from tests.mpi.workers import common
from zerompi.comm.local import LocalGroup, RankFailed, run_ranks
from zerompi.comm.mpi import MPIGroup
from zerompi.comm.group import ProcessGroup
from zerompi.errors import ZeroMPIError

SIZES = [2, 3, 4]


def _data(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64).mul(0.25).add(10 * rank + 1).to(dtype)


def test_local_group_has_every_member_of_the_protocol():
    wanted = {n for n in dir(ProcessGroup) if not n.startswith("_")} | set(ProcessGroup.__annotations__)
    assert wanted - set(dir(LocalGroup)) - {"rank", "size", "label"} == set()
    # the raw MPI handles (h5py's and ULFM's) are MPI's alone
    assert {n for n in dir(MPIGroup) if not n.startswith("_")} - set(dir(LocalGroup)) <= {"comm", "communicators"}


@pytest.mark.parametrize("size", SIZES)
def test_gather_puts_each_rank_s_part_on_the_root_alone(size):
    def body(g: LocalGroup):
        root = size - 1
        out = torch.zeros(3 * size, dtype=torch.uint8) if g.rank == root else None
        g.gather(torch.full((3,), g.rank, dtype=torch.uint8), out, root)
        return None if out is None else out.tolist()
    got = run_ranks(size, body)
    assert got[:-1] == [None] * (size - 1)
    assert got[-1] == [r for r in range(size) for _ in range(3)]


@pytest.mark.parametrize("size", SIZES)
def test_collectives_compute_what_mpi_would(size):
    n = 6 * size

    def body(g: LocalGroup):
        out = {}
        gathered = torch.empty(n)
        g.all_gather(_data(g.rank, 6), gathered)
        out["all_gather"] = gathered
        in_place = torch.zeros(n)
        in_place[g.rank * 6:(g.rank + 1) * 6] = _data(g.rank, 6)
        g.all_gather(None, in_place, async_op=True).wait()
        out["in_place"] = in_place
        out["rs32"] = g.reduce_scatter(_data(g.rank, n)).wait()
        out["rs16"] = g.reduce_scatter(_data(g.rank, n, torch.bfloat16), async_op=True).wait()
        t = _data(g.rank, n)
        g.all_reduce(t)
        out["all_reduce"] = t
        recv = torch.empty(n)
        g.all_to_all(_data(g.rank, n), recv)
        out["all_to_all"] = recv
        b = _data(g.rank, 5)
        g.broadcast(b, root=size - 1)
        out["broadcast"] = b
        out["floats"] = g.sum_floats([g.rank, 1.0])
        out["objects"] = g.allgather_object({"rank": g.rank})
        g.barrier()
        out["bytes"] = dict(g.bytes_sent)
        return out

    res = run_ranks(size, body)
    full = [_data(r, n) for r in range(size)]
    for r, out in enumerate(res):
        assert torch.equal(out["all_gather"], torch.cat([_data(q, 6) for q in range(size)]))
        assert torch.equal(out["in_place"], out["all_gather"])
        mine = slice(r * 6, (r + 1) * 6)
        assert torch.equal(out["rs32"], sum(f[mine] for f in full))
        assert out["rs16"].dtype == torch.float32
        assert torch.equal(out["rs16"], torch.stack([_data(q, n, torch.bfloat16)[mine] for q in range(size)]).float().sum(0))
        assert torch.equal(out["all_reduce"], sum(full))
        assert torch.equal(out["all_to_all"], torch.cat([f[mine] for f in full]))
        assert torch.equal(out["broadcast"], _data(size - 1, 5))
        assert out["floats"] == [sum(range(size)), float(size)]
        assert out["objects"] == [{"rank": q} for q in range(size)]
        assert out["bytes"] == {  # the ZeRO paper's counts, as MPIGroup keeps them (shapes.py)
            "all_gather": 2 * (size - 1) * 6 * 4, "reduce_scatter": (size - 1) * 6 * (4 + 2),
            "all_reduce": 2 * (size - 1) * n * 4 // size, "control": 2 * (size - 1) * 2 * 8 // size,
            "all_to_all": (size - 1) * 6 * 4} | ({"broadcast": (size - 1) * 5 * 4} if r == size - 1 else {})


def counted_failures(g: ProcessGroup, chunk: int = 7) -> list[str]:
    """The verbs given ``used`` (an owner-aligned bucket's live elements per rank) on ``g``, against what
    they must compute: live values as without ``used``, padding zeros, and only live elements counted.
    Shared with the MPI job of tests/mpi/test_whole_tensor.py, which runs it over MPIGroup."""
    size, rank = g.size, g.rank
    used = [0 if q == 1 else chunk - (q % 3) * 2 for q in range(size)]  # rank 1's chunk holds nothing
    n, failures = chunk * size, []

    def padded(t: torch.Tensor, counts) -> torch.Tensor:
        t = t.clone()
        for c, u in zip(t.view(size, -1), counts):
            c[u:] = 0
        return t

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            failures.append(f"{name}: {got.tolist()} != {want.tolist()}")

    full = [padded(_data(q, n), used) for q in range(size)]
    mine = slice(rank * chunk, (rank + 1) * chunk)
    for async_op in (False, True):
        out = torch.full((n,), -1.0)
        g.all_gather(full[rank][mine].clone(), out, async_op=async_op, used=used).wait()
        check(f"all_gather async={async_op}", out, padded(torch.cat([f.view(size, -1)[q] for q, f in enumerate(full)]),
                                                          used))
        in_place = torch.full((n,), -1.0)
        in_place[mine] = full[rank][mine]
        g.all_gather(None, in_place, async_op=async_op, used=used).wait()
        check(f"all_gather in place async={async_op}", in_place, out)
        check(f"reduce_scatter fp32 async={async_op}",
              g.reduce_scatter(_data(rank, n), async_op=async_op, used=used).wait(), sum(f[mine] for f in full))
        half = [padded(_data(q, n, torch.bfloat16), used) for q in range(size)]
        check(f"reduce_scatter bf16 async={async_op}",
              g.reduce_scatter(_data(rank, n, torch.bfloat16), async_op=async_op, used=used).wait(),
              torch.stack([h[mine] for h in half]).float().sum(0))
        recv = torch.full((n,), -1.0)
        g.all_to_all(_data(rank, n), recv, async_op=async_op, used=used).wait()
        check(f"all_to_all async={async_op}", recv, torch.cat([f[mine] for f in full]))
    others = sum(used) - used[rank]
    want = {"all_gather": 4 * 4 * (size - 1) * used[rank],  # 4 calls of 4-byte elements "reduce_scatter": 2 * others * (4 + 2),
            "all_to_all": 2 * others * 4}
    got = {k: v for k, v in g.bytes_sent.items() if k in want}
    if got != want:
        failures.append(f"bytes counted {got} != the live elements' {want}")
    return failures


@pytest.mark.parametrize("size", SIZES)
def test_counted_collectives_move_live_elements_only(size):
    assert run_ranks(size, counted_failures) == [[]] * size


def test_split_makes_sub_groups_ordered_by_key():
    def body(g: LocalGroup):
        sub = g.split(g.rank % 2, -g.rank, "parity")
        t = torch.tensor([float(g.rank)])
        sub.all_reduce(t)
        node = g.split_shared()
        return sub.rank, sub.size, float(t), node.size, dict(g.bytes_sent)

    res = run_ranks(4, body)
    assert [r[:3] for r in res] == [(1, 2, 2.0), (1, 2, 4.0), (0, 2, 2.0), (0, 2, 4.0)]
    assert all(r[3] == 4 for r in res)
    assert all("all_reduce@parity" in r[4] for r in res)  # sub-groups count into the rank's totals


def test_bad_shapes_are_refused_as_by_mpi():
    def body(g: LocalGroup):
        with pytest.raises(ZeroMPIError, match="1-D contiguous"):
            g.all_reduce(torch.zeros(2, 2))
        with pytest.raises(ZeroMPIError, match="do not split"):
            g.reduce_scatter(torch.zeros(5))
        with pytest.raises(ZeroMPIError, match="cannot sum"):
            g.all_reduce(torch.zeros(4, dtype=torch.bfloat16))
        with pytest.raises(ZeroMPIError, match="no MPI communicator"):
            g.h5py_comm()

    run_ranks(2, body)


def test_a_failing_rank_fails_its_peers_instead_of_hanging_them():
    peers: list[BaseException] = []

    def body(g: LocalGroup):
        if g.rank == 1:
            raise ValueError("rank 1 broke")
        try:
            g.all_reduce(torch.zeros(4))
        except RankFailed as e:
            peers.append(e)
            raise

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(3, body, timeout=30)
    assert len(peers) == 2


def test_abort_and_the_debug_check():
    def aborts(g: LocalGroup):
        if g.rank == 0:
            g.abort(7)
        g.barrier()

    with pytest.raises(RankFailed, match="rank 0 aborted the in-process group \\(code 7\\)"):
        run_ranks(2, aborts, timeout=30)

    def mismatched(g: LocalGroup):
        g.all_reduce(torch.zeros(4 if g.rank == 0 else 8))

    with pytest.raises(ZeroMPIError, match="ranks are at different collectives"):
        run_ranks(2, mismatched, debug=True, timeout=30)


def test_a_rank_stuck_outside_collectives_times_the_run_out():
    release = threading.Event()

    def body(g: LocalGroup):
        if g.rank == 1:
            release.wait(20)
        g.barrier()

    with pytest.raises(TimeoutError, match="rank 0, rank 1"):
        run_ranks(2, body, timeout=0.5)
    release.set()


# ---- engines at several ranks, judged as the MPI parity tests judge them ----------------------------
STEPS, ACCUM = 3, 2


def _cfg(stage: int, **kw) -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=stage, lr=3e-3, bucket_mb=0.002, cpu_threads=1, abort_on_exception=False,
                              checkpoint_layout="per_rank", grad_accum_steps=ACCUM, **kw)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_parity_with_single_process_pytorch(stage, world):
    cfg = _cfg(stage)
    batches = common.token_batches(7, world, STEPS, ACCUM)
    models = [common.tiny_gpt(0) for _ in range(world)]  # built here: the ranks share torch's RNG
    runs = run_ranks(world, lambda g: common.engine_train(zerompi.initialize(models[g.rank], cfg, group=g), batches))
    assert all(common.digest(r) == common.digest(runs[0]) for r in runs)  # every rank holds the same model
    ref = common.reference_train(common.tiny_gpt(0), cfg, batches)
    alts = common.reference_orders(lambda: common.tiny_gpt(0), cfg, batches, world)
    row = dict(dtype="fp32", **common.compare(runs[0], ref, alts))
    tolerance.check_parity(row)


def test_create_group_is_made_by_its_members_alone():
    def rank(group):
        if group.rank == 1:
            return None  # not a member: takes no part
        sub = group.create_group([2, 0], label="pair")
        t = torch.tensor([float(group.rank)])
        sub.all_reduce(t)
        return sub.rank, sub.size, t.item()
    assert run_ranks(3, rank) == [(1, 2, 2.0), None, (0, 2, 2.0)]
