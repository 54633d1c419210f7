"""NVMeSwapper on real files: round trips, O_DIRECT, corruption, errors, cleanup, memory bound."""
from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from zerompi.errors import ConfigError, UsageError, ZeroMPIError
from zerompi.offload import NVMeSwapper, SwapConfig, aligned_empty
from zerompi.offload.nvme import SwapError
from tests.components import unavailable

REPO = Path(__file__).resolve().parents[3]
BLOCK = 16 * 1024  # small blocks: multi-block tensors stay small and fast
SMALL = SwapConfig(block_bytes=BLOCK, threads=3, buffers=4)


def _tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 255 if dtype == torch.uint8 else 2**40, (numel,), generator=g, dtype=dtype)


def _round_trip(sw: NVMeSwapper, key: str, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    sw.reserve(key, t.numel() * t.element_size())
    assert sw.write(key, t).result() is None
    out = torch.empty_like(t) if out is None else out
    assert sw.read(key, out).result() is out
    return out


def _run_python(code: str, cwd: Path = REPO) -> dict:
    """Run code in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- config ------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("block_bytes", 5000), ("block_bytes", 0), ("block_bytes", 512 << 20), ("block_bytes", 4096.0),
    ("threads", 0), ("threads", 65), ("buffers", 0), ("direct", 1), ("verify", "yes"),
])
def test_config_rejects_bad_values(key, value):
    with pytest.raises(ConfigError, match=rf"SwapConfig\.{key}={value!r}"):
        SwapConfig(**{key: value})


def test_swapper_wants_a_swap_config(tmp_path):
    with pytest.raises(ConfigError, match="expected a SwapConfig, got dict"):
        NVMeSwapper(tmp_path, 0, {"threads": 2})


# -- round trips -------------------------------------------------------------------

BYTE_SIZES = [1, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 4104]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("nbytes", BYTE_SIZES, ids=lambda n: f"{n}B")
def test_round_trip(tmp_path, dtype, nbytes):
    numel = max(1, nbytes // torch.empty(0, dtype=dtype).element_size())
    t = _tensor(numel, dtype)
    with NVMeSwapper(tmp_path, rank=0, config=SMALL) as sw:
        # A neighbour before and after: a block must not spill into the next region.
        before, after = _tensor(1000, torch.float32, 1), _tensor(1000, torch.float32, 2)
        sw.reserve("before", before.nbytes)
        sw.write("before", before).result()
        out = _round_trip(sw, "t", t)
        sw.reserve("after", after.nbytes)
        sw.write("after", after).result()
        assert torch.equal(out, t)
        assert torch.equal(sw.read("before", torch.empty_like(before)).result(), before)
        assert sw.region("t").offset % 4096 == 0 and sw.region("t").nbytes == t.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_aligned_tensors_skip_the_staging_copy(tmp_path, dtype):
    """Whole blocks of 4 KiB-aligned memory go straight to the file; a ragged tail is staged."""
    elem = torch.empty(0, dtype=dtype).element_size()
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        for numel, staged in [(3 * BLOCK // elem, 0), ((2 * BLOCK + 100) // elem, 100 // elem * elem)]:
            t = aligned_empty(numel, dtype)
            assert t.data_ptr() % 4096 == 0 and t.shape == (numel,)
            t.copy_(_tensor(numel, dtype))
            out = aligned_empty(numel, dtype)
            before = sw.stats.staged_bytes
            assert torch.equal(_round_trip(sw, f"k{numel}", t, out), t)
            assert sw.stats.staged_bytes - before == 2 * staged  # once written, once read
        # misaligned, both ways: everything is staged (an output from torch.empty may happen to be aligned)
        shifted, out = (aligned_empty(BLOCK + 1, torch.uint8)[1:] for _ in range(2))
        shifted.copy_(_tensor(BLOCK, torch.uint8))
        before = sw.stats.staged_bytes
        assert torch.equal(_round_trip(sw, "shifted", shifted, out), shifted)
        assert sw.stats.staged_bytes - before == 2 * BLOCK


def test_shapes_and_zero_bytes(tmp_path):
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        m = _tensor(6000, torch.float32).view(60, 100)
        assert torch.equal(_round_trip(sw, "matrix", m), m)
        empty = torch.empty(0)
        assert torch.equal(_round_trip(sw, "empty", empty), empty)
        assert sw.reserved_bytes == 24576  # 24000 bytes rounded up to 4 KiB; the empty key takes none


def test_many_keys_in_flight(tmp_path):
    """Hundreds of futures at once through two buffers; every byte lands in its key."""
    cfg = SwapConfig(block_bytes=BLOCK, threads=4, buffers=2)
    tensors = {f"b{i}.{kind}": _tensor(37 * i + 1 + 3000 * (i % 5), torch.float32, i)
               for i in range(60) for kind in ("master", "exp_avg", "exp_avg_sq")}
    with NVMeSwapper(tmp_path, 0, cfg) as sw:
        for key, t in tensors.items():
            sw.reserve(key, t.nbytes)
        writes = [sw.write(key, t) for key, t in tensors.items()]
        sw.wait_all()
        assert all(f.done() and f.exception() is None for f in writes)
        outs = {key: torch.empty_like(t) for key, t in tensors.items()}
        reads = [sw.read(key, outs[key]) for key in tensors]
        for f in reads:
            f.result()
        assert all(torch.equal(outs[k], t) for k, t in tensors.items())
        total = sum(-(-t.nbytes // 4096) * 4096 for t in tensors.values())
        assert sw.stats.bytes_written == total and sw.stats.bytes_read == total
        assert sw.stats.write_seconds > 0 and sw.stats.checksum_seconds > 0


def test_overwrite_key(tmp_path):
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        a, b = _tensor(9000, torch.float32, 1), _tensor(9000, torch.float32, 2)
        assert torch.equal(_round_trip(sw, "k", a), a)
        assert sw.reserve("k", a.nbytes) == sw.region("k")  # same size again: same region
        sw.write("k", b).result()
        assert torch.equal(sw.read("k", torch.empty_like(b)).result(), b)


def test_conflicting_transfers_of_one_key_are_refused(tmp_path):
    cfg = SwapConfig(block_bytes=64 * 1024, threads=1, buffers=1)
    with NVMeSwapper(tmp_path, 0, cfg) as sw:
        big, small = _tensor(4 << 20, torch.float32), _tensor(100, torch.float32)
        sw.reserve("big", big.nbytes)
        sw.reserve("small", small.nbytes)
        sw.write("big", big)  # 256 blocks on one thread: "small" queues behind them
        sw.write("small", small)
        with pytest.raises(UsageError, match="'small' while a write of it is in flight"):
            sw.read("small", torch.empty_like(small))
        with pytest.raises(UsageError, match="in flight"):
            sw.write("small", small)
        sw.wait_all()
        first, second = torch.empty_like(small), torch.empty_like(small)
        sw.read("small", first), sw.read("small", second)  # concurrent reads are fine
        sw.wait_all()
        assert torch.equal(first, small) and torch.equal(second, small)


# -- O_DIRECT and its fallback ------------------------------------------------------

def _o_direct_on(sw: NVMeSwapper) -> bool:
    return bool(fcntl.fcntl(sw.fileno(), fcntl.F_GETFL) & os.O_DIRECT)


def test_o_direct_is_used_on_disk(tmp_path):
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        assert sw.direct and _o_direct_on(sw)
        t = _tensor(10_000, torch.float32)
        assert torch.equal(_round_trip(sw, "t", t), t)
    with NVMeSwapper(tmp_path, 0, SwapConfig(block_bytes=BLOCK, direct=False)) as sw:
        assert not sw.direct and not _o_direct_on(sw)


def test_tmpfs_works_with_at_most_one_warning():
    """tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: either way, one warning at most."""
    if not os.path.isdir("/dev/shm"):
        unavailable("/dev/shm", "not a directory here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NVMeSwapper("/dev/shm", 0, SMALL) as sw:
            t = _tensor(20_000, torch.float32)
            assert torch.equal(_round_trip(sw, "t", t), t)
            assert _o_direct_on(sw) == sw.direct
    assert len(caught) == (0 if sw.direct else 1)


def test_fallback_when_filesystem_refuses_o_direct(tmp_path):
    """ramfs refuses O_DIRECT at open(); mounted in a private mount namespace of a child."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        unavailable("ramfs", "mounting one (a filesystem that refuses O_DIRECT) needs root and unshare(1)")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    code = f"""
        import json, os, warnings, torch
        from zerompi.offload import NVMeSwapper, SwapConfig, aligned_empty
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with NVMeSwapper({str(mnt)!r}, 3, SwapConfig(block_bytes=16384)) as sw:
                t = torch.arange(50_000, dtype=torch.float32)
                sw.reserve("t", t.nbytes)
                for _ in range(3):
                    sw.write("t", t).result()
                    ok = torch.equal(sw.read("t", torch.empty_like(t)).result(), t)
                files = os.listdir({str(mnt)!r})
        print(json.dumps(dict(ok=ok, direct=sw.direct, files=files, gone=not os.path.exists(sw.path),
                              warnings=[str(w.message) for w in caught])))
    """
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    cmd = f"mount -t ramfs none {mnt} && exec {sys.executable} {script}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    if "mount" in proc.stderr and proc.returncode != 0:
        unavailable("ramfs", f"mount failed: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["ok"] and not res["direct"] and res["gone"]
    assert len(res["files"]) == 1 and res["files"][0].startswith("zerompi-swap-rank3-")  # no leftover
    assert len(res["warnings"]) == 1 and "refuses O_DIRECT" in res["warnings"][0]


# -- corruption --------------------------------------------------------------------

@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "aligned"])
def test_verify_catches_a_byte_changed_in_the_file(tmp_path, aligned):
    t = _tensor(3 * BLOCK // 4 + 1, torch.float32)  # three blocks and a bit
    t = aligned_empty(t.numel(), t.dtype).copy_(t) if aligned else t
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        sw.reserve("pad", 100)
        region = sw.reserve("b0.master", t.nbytes)
        sw.write("b0.master", t).result()
        bad = region.offset + BLOCK + 123  # inside the second block
        fd = os.open(sw.path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, bad)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), bad)
        finally:
            os.close(fd)
        out = aligned_empty(t.numel(), t.dtype) if aligned else torch.empty_like(t)
        with pytest.raises(SwapError) as info:
            sw.read("b0.master", out).result()
        msg = str(info.value)
        assert sw.path in msg and "'b0.master'" in msg and f"offset {region.offset + BLOCK}" in msg
        assert "changed underneath us" in msg


def test_truncated_file_is_a_short_read(tmp_path):
    t = _tensor(3 * BLOCK // 4, torch.float32)
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        region = sw.reserve("k", t.nbytes)
        sw.write("k", t).result()
        os.truncate(sw.path, region.offset + 2 * BLOCK)
        future = sw.read("k", torch.empty_like(t))
        with pytest.raises(SwapError, match=rf"short read on .*'k'.*offset {region.offset + 2 * BLOCK}"):
            future.result()
        with pytest.raises(SwapError, match="short read"):
            sw.wait_all()  # failures surface here too, once
        sw.wait_all()


# -- misuse and environment errors --------------------------------------------------

def test_key_misuse(tmp_path):
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        t = _tensor(100, torch.float32)
        with pytest.raises(SwapError, match="'nope'.*not reserved"):
            sw.write("nope", t)
        sw.reserve("k", t.nbytes)
        with pytest.raises(SwapError, match="'k'.*never written"):
            sw.read("k", torch.empty_like(t))
        with pytest.raises(SwapError, match="has 404 bytes but the key's region holds 400"):
            sw.write("k", _tensor(101, torch.float32))
        with pytest.raises(SwapError, match="not a contiguous"):
            sw.write("k", _tensor(200, torch.float32)[::2])
        with pytest.raises(SwapError, match="already reserved with 400 bytes, asked for 8"):
            sw.reserve("k", 8)
        sw.write("k", t).result()
        with pytest.raises(SwapError, match="written as torch.float32, read into torch.int32"):
            sw.read("k", torch.empty(100, dtype=torch.int32))
        with pytest.raises(SwapError, match="nbytes must be an int >= 0"):
            sw.reserve("neg", -1)


def test_missing_or_bad_directory(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(SwapError, match=str(missing)):
        NVMeSwapper(missing, 0)
    regular = tmp_path / "file"
    regular.write_text("x")
    for bad in (regular, regular / "sub"):  # root ignores chmod, so unwritable = not a directory
        with pytest.raises(ZeroMPIError, match=str(bad)):
            NVMeSwapper(bad, 0)


def test_reservation_larger_than_free_space(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        with pytest.raises(SwapError, match=rf"cannot reserve .*'huge'.*{sw.path}.*free"):
            sw.reserve("huge", free + (1 << 30))
        with pytest.raises(SwapError, match="not reserved"):
            sw.region("huge")
        assert sw.reserved_bytes == 0


# -- cleanup -----------------------------------------------------------------------

def test_close_removes_file_and_is_idempotent(tmp_path):
    sw = NVMeSwapper(tmp_path, 0, SMALL)
    t = _tensor(5000, torch.float32)
    sw.reserve("k", t.nbytes)
    sw.write("k", t)  # still in flight: close() drains it
    assert os.path.exists(sw.path)
    sw.close()
    sw.close()
    assert not os.path.exists(sw.path) and list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="after close"):
        sw.write("k", t)


def test_with_block_exception_removes_file(tmp_path):
    with pytest.raises(KeyError):
        with NVMeSwapper(tmp_path, 0, SMALL) as sw:
            sw.reserve("k", 4096)
            raise KeyError("boom")
    assert not os.path.exists(sw.path)


def test_garbage_collection_removes_file(tmp_path):
    sw = NVMeSwapper(tmp_path, 0, SMALL)
    path = sw.path
    del sw
    gc.collect()
    assert not os.path.exists(path)


def test_interpreter_exit_removes_file(tmp_path):
    res = _run_python(f"""
        import json, torch
        from zerompi.offload import NVMeSwapper
        sw = NVMeSwapper({str(tmp_path)!r}, 0)
        t = torch.ones(1 << 20)
        sw.reserve("k", t.nbytes)
        sw.write("k", t)  # not waited for, never closed
        KEEP = sw  # alive until exit, so only the exit hook can remove the file
        print(json.dumps(dict(path=sw.path)))
    """)
    assert res["path"].startswith(str(tmp_path))
    assert not os.path.exists(res["path"]) and list(tmp_path.iterdir()) == []


# -- memory bound ------------------------------------------------------------------

def test_staging_memory_is_bounded_by_the_pool(tmp_path):
    """A 64 MiB tensor through 2 buffers of 4 MiB: peak RSS grows by about 8 MiB, not 64."""
    res = _run_python(f"""
        import json, torch
        from zerompi.offload import NVMeSwapper, SwapConfig, aligned_empty

        def kib(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1])

        src = torch.randn(16 << 20)
        dst = torch.zeros_like(src)
        with NVMeSwapper({str(tmp_path)!r}, 0, SwapConfig(block_bytes=4 << 20, threads=4, buffers=2)) as sw:
            sw.reserve("k", src.nbytes)
            try:  # reset the peak (VmHWM) to the current RSS
                open("/proc/self/clear_refs", "w").write("5")
            except OSError:
                pass
            base = max(kib("VmRSS"), kib("VmHWM"))
            sw.write("k", src).result()
            sw.read("k", dst).result()
            growth = kib("VmHWM") - base
        print(json.dumps(dict(growth_kib=growth, equal=bool(torch.equal(src, dst)))))
    """)
    assert res["equal"]
    assert res["growth_kib"] < 24 * 1024, res  # 8 MiB of buffers plus thread stacks; 64 MiB would fail


def test_streamed_optimizer_state_moves_without_staging(tmp_path):
    """NVMeResidency re-allocates swapped-in state 4 KiB aligned: after the first step (whose
    Adam moments torch allocates itself) every byte moves straight between tensor and file,
    and the streamed update equals the in-memory one bit for bit."""
    from types import SimpleNamespace

    from zerompi.offload.residency import NVMeResidency
    numel = 3 * BLOCK // 4
    masters = [torch.nn.Parameter(_tensor(numel, torch.float32, seed=i)) for i in range(3)]
    reference = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    inner, ref_opt = torch.optim.Adam(masters, lr=0.1), torch.optim.Adam(reference, lr=0.1)
    with NVMeSwapper(tmp_path, 0, SMALL) as sw:
        buckets = [SimpleNamespace(master=m, layout=SimpleNamespace(index=i)) for i, m in enumerate(masters)]
        for b in buckets:  # as the engine does while it builds the buckets
            NVMeResidency.swap_out_master(sw, b.layout.index, b.master)
            assert b.master.numel() == 0
        res = NVMeResidency(buckets, inner, sw)
        staged = []
        for step in range(3):
            before = sw.stats.staged_bytes
            for i in res.stream():
                masters[i].grad = _tensor(numel, torch.float32, seed=10 * step + i)
                inner.step()  # steps every param; the swapped-out ones have no grad and are skipped
                masters[i].grad = None
            staged.append(sw.stats.staged_bytes - before)
            for i, p in enumerate(reference):
                p.grad = _tensor(numel, torch.float32, seed=10 * step + i)
            ref_opt.step()
        assert staged[0] > 0 and staged[1:] == [0, 0], staged
        for i, m in enumerate(masters):
            with res.resident(i):
                assert torch.equal(m, reference[i])
                assert torch.equal(inner.state[m]["exp_avg"], ref_opt.state[reference[i]]["exp_avg"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=lambda d: str(d).removeprefix("torch."))
def test_aligned_tensors_are_no_views_so_release_frees_them(dtype):
    """A view keeps its base alive through ``_base``: a released shard would keep its whole storage."""
    from zerompi.blockio.aligned import aligned_clone
    flat, square = _tensor(4900, dtype), _tensor(4900, dtype).view(70, 70)
    for t, like in ((aligned_empty(4900, dtype), None), (aligned_clone(flat), flat), (aligned_clone(square), square)):
        assert t.data_ptr() % 4096 == 0 and t._base is None
        if like is not None:
            assert t.shape == like.shape and torch.equal(t, like)


def test_priority_pool_runs_the_lowest_priority_first_then_in_submission_order():
    import threading

    from zerompi.offload.swapfile import Priority, PriorityPool
    pool, gate, order = PriorityPool(1, "test"), threading.Event(), []
    pool.submit(Priority.URGENT, gate.wait)  # holds the only thread while the others queue
    for name, priority in (("w1", Priority.BEHIND), ("s1", Priority.SOON), ("u1", Priority.URGENT),
                           ("w2", Priority.BEHIND), ("u2", Priority.URGENT)):
        pool.submit(priority, lambda name=name: order.append(name))
    gate.set()
    pool.shutdown()
    pool.shutdown()  # idempotent
    assert order == ["u1", "u2", "s1", "w1", "w2"]


def test_state_streamed_behind_backward_matches_the_step(tmp_path):
    """NVMeResidency.ahead/behind/drain (optimizer_in_backward's order) leave the same state as
    ``resident`` (the step's), and at most BEHIND buckets' writes in flight."""
    from zerompi.offload.residency import NVMeResidency
    masters = [_tensor(3000 + i, torch.float32, seed=i) for i in range(4)]
    copies = [m.clone() for m in masters]
    with NVMeSwapper(tmp_path, 0) as sw:
        for i, m in enumerate(masters):
            NVMeResidency.swap_out_master(sw, i, m)

        class B:
            def __init__(self, i, m):
                self.master, self.layout = m, type("L", (), {"index": i})()
        res = NVMeResidency([B(i, m) for i, m in enumerate(masters)], torch.optim.SGD(masters, lr=0.1), sw)
        for i in (3, 2, 1, 0):
            res.ahead(i)
            with res.behind(i):
                masters[i].mul_(2).add_(i)
            assert len(res._behind) <= res.BEHIND
        res.drain()
        assert res._behind == [] and all(not m.numel() for m in masters)
        for i, m in enumerate(masters):
            with res.resident(i):
                assert torch.equal(m, copies[i] * 2 + i)


def test_released_memory_is_reused_only_when_nothing_else_holds_it():
    from zerompi.blockio.aligned import Reuse, allocate, release
    pool = Reuse(limit=3 * (40000 + 4096))
    if pool._use_count is None:
        unavailable("torch storage use count", "this torch has none: released memory is never reused")
    t = aligned_empty(10000, torch.float32, pool)
    ptr = t.data_ptr()
    release(t, pool)
    assert pool.nbytes == 40000 + 4096 and t.numel() == 0
    u = aligned_empty(10000, torch.float32, pool)  # the same block again, still 4 KiB aligned
    assert u.data_ptr() == ptr and ptr % 4096 == 0 and pool.nbytes == 0
    held = u[:10]  # a view keeps the memory in use: not reused
    release(u, pool)
    assert pool.nbytes == 0 and held.data_ptr() == ptr
    other = aligned_empty(2500, torch.bfloat16, pool)
    assert other.data_ptr() != ptr
    many = [torch.empty(0) for _ in range(5)]
    for v in many:
        allocate(v, 10000, pool)
    newest = many[-1].data_ptr()
    for v in many:  # the pool keeps at most its limit (three blocks), the oldest going first
        release(v, pool)
    assert pool.nbytes == pool.limit and aligned_empty(10000, torch.float32, pool).data_ptr() == newest
    kept = pool.nbytes
    release(aligned_empty(10000, torch.float32))  # no pool: nothing taken, nothing kept
    assert pool.nbytes == kept


def test_each_swapper_has_its_own_pool_sized_by_its_engine(tmp_path):
    """Two engines' swappers never share released memory; a pool's limit only grows."""
    a, b = NVMeSwapper(tmp_path, 0), NVMeSwapper(tmp_path, 1)
    try:
        assert a.memory is not b.memory and a.memory.limit == b.memory.limit == 0
        a.memory.keep(1 << 20)
        a.memory.keep(1 << 10)
        assert (a.memory.limit, b.memory.limit) == (1 << 20, 0)
    finally:
        a.close()
        b.close()
