"""The pieces of zerompi/comm/ apart from MPI: Work handles, Counters, the debug Agreement, the Watchdog.

Also the seam itself: MPIGroup has every member of the ProcessGroup protocol, and the old
``zerompi.dist`` name still imports it (test_structure.py checks that only comm/mpi.py imports mpi4py).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import zerompi
from zerompi.comm.group import FutureWork, ProcessGroup, RequestWork, Work
from zerompi.comm.monitor import Agreement, CollectiveMismatchError, Counters, Monitor
from zerompi.comm.mpi import MPIGroup, thread_support_error
from zerompi.comm.recorder import Recorder
from zerompi.comm.watchdog import ABORT_CODE, HangPolicy, Overdue, Watchdog


class Request:
    """An MPI request stand-in that completes when ``Wait`` is called (or ``ready`` is set)."""

    def __init__(self, log: list[str]):
        self.log, self.ready = log, False

    def Wait(self):
        self.log.append("Wait")
        self.ready = True

    def Test(self):
        self.log.append("Test")
        return self.ready


def counting_finish(log: list[str]):
    return lambda: log.append("finish") or log.count("finish")


# ---- Work ---------------------------------------------------------------------------------

def test_plain_work_is_complete_and_finishes_once():
    log: list[str] = []
    w = Work(counting_finish(log))
    assert w.test() and log == []  # the data has moved; finish waits for wait()
    assert w.wait() == 1 and w.wait() == 1 and log == ["finish"]
    assert Work().wait() is None and Work().test()


def test_done_work_carries_its_result():
    result = torch.ones(2)
    w = Work.done(result)
    assert w.test() and w.wait() is result and w.wait() is result


def test_request_work_waits_inside_blocked_then_finishes():
    log: list[str] = []

    class Blocked:
        def __enter__(self):
            log.append("blocked")

        def __exit__(self, *exc):
            log.append("unblocked")
    w = RequestWork(Request(log), counting_finish(log), Blocked)
    assert not w.test() and log == ["Test"]
    assert w.wait() == 1 and w.wait() == 1
    assert log == ["Test", "blocked", "Wait", "unblocked", "finish"]  # finish runs outside the wait
    assert w.test()


def test_request_work_test_drives_the_request_until_wait():
    log: list[str] = []
    request = Request(log)
    w = RequestWork(request)
    assert not w.test()
    request.ready = True
    assert w.test() and w.wait() is None and w.test()
    assert log == ["Test", "Test", "Wait"]  # once waited, test() no longer asks MPI


def test_future_work_follows_its_future_and_raises_its_error():
    future: Future = Future()
    log: list[str] = []
    w = FutureWork(future, counting_finish(log))
    assert not w.test()
    threading.Timer(0.02, future.set_result, args=(None,)).start()
    assert w.wait() == 1 and w.test() and log == ["finish"]
    failed: Future = Future()
    failed.set_exception(RuntimeError("collective failed"))
    bad = FutureWork(failed, counting_finish(log))
    assert bad.test()  # done, although badly: wait() says how
    with pytest.raises(RuntimeError, match="collective failed"):
        bad.wait()
    assert log == ["finish"]


# ---- Counters and the debug agreement ------------------------------------------------------

def test_counters_key_by_kind_and_label():
    c = Counters()
    c.add("all_gather", "", 12)
    c.add("all_gather", "", 4.0)
    c.add("all_gather", "intra", 8)
    c.add("reduce_scatter", "inter", 0)
    assert dict(c.bytes_sent) == {"all_gather": 16, "all_gather@intra": 8, "reduce_scatter@inter": 0}
    assert all(type(v) is int for v in c.bytes_sent.values())


def test_agreement_numbers_and_describes():
    a = Agreement()
    assert (a.debug, a.seq) == (False, 0)
    assert a.describe("all_reduce", torch.zeros(6), "bucket 0") == "all_reduce #0 of 6 x float32 for bucket 0"
    assert a.describe("ag", torch.zeros(4, dtype=torch.bfloat16), "") == "ag #1 of 4 x bfloat16"
    assert a.seq == 2
    Agreement.check(["x #0", "x #0"])
    with pytest.raises(CollectiveMismatchError, match="rank 0: x #0; rank 1: y #0$"):
        Agreement.check(["x #0", "y #0"])


def test_monitor_parts_are_fresh_per_monitor():
    m1, m2 = Monitor(), Monitor()
    assert m1.counters is not m2.counters and m1.watchdog is not m2.watchdog
    assert m1.agreement.debug is False and m1.comm_thread is None


# ---- Watchdog -------------------------------------------------------------------------------

def test_watchdog_decision():
    w = Watchdog()
    assert w.overdue(1.0, time.monotonic() + 100) is None  # not waiting: never overdue
    with w.blocked("all_gather #3"):
        start = w.waiting[1]
        assert w.waiting[0] == "all_gather #3"
        assert w.overdue(1.0, start + 1.0) is None          # exactly the timeout: not yet
        assert w.overdue(1.0, start + 2.5) == Overdue("all_gather #3", 2.5)
    assert w.waiting is None and w.overdue(1.0, start + 10) is None


def test_watchdog_aborts_a_long_wait_through_the_injected_abort(capfd):
    w = Watchdog()
    aborted = threading.Event()
    codes: list[int] = []

    def abort(code: int) -> None:
        codes.append(code)
        aborted.set()
    with w.blocked("a barrier", "intra"):  # a sub-group's label is named in the report
        w.start(HangPolicy(0.2, None, None), 1, 4, abort, Recorder())
        assert aborted.wait(10)
    w.stop()
    assert codes == [ABORT_CODE]
    err = capfd.readouterr().err
    assert "zerompi watchdog: rank 1 of 4 has waited" in err and "in a barrier (group intra)" in err
    assert "collective_timeout=0.2 s" in err


def test_watchdog_leaves_short_waits_alone():
    w = Watchdog()
    codes: list[int] = []
    w.start(HangPolicy(0.4, None, None), 0, 2, codes.append, Recorder())
    for _ in range(5):
        with w.blocked("a short wait"):
            time.sleep(0.05)
    time.sleep(0.3)
    w.stop()
    assert codes == []


def test_group_watchdog_is_shared_and_tracks_collectives():
    g = MPIGroup(MPI.COMM_SELF)
    sub = g.split(0, 0, "intra")
    assert sub.monitor.watchdog is g.monitor.watchdog
    seen: list[object] = []
    with g._blocked("x"):
        seen.append(sub.monitor.watchdog.waiting[0])
    assert seen == ["x"]
    sub.free()


# ---- the seam -------------------------------------------------------------------------------

def test_mpi_group_has_every_member_of_the_protocol():
    g = MPIGroup(MPI.COMM_SELF)
    members = {n for n in vars(ProcessGroup) if not n.startswith("_")} | set(ProcessGroup.__annotations__)
    assert {"all_gather", "reduce_scatter", "h5py_comm", "rank", "bytes_sent"} <= members
    assert sorted(n for n in members if not hasattr(g, n)) == []


def test_thread_level_is_asked_of_mpi():
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE  # mpi4py's default here
    assert thread_support_error() is None


def test_old_dist_name_imports_the_comm_modules_with_a_deprecation_warning():
    """zerompi.dist.X is zerompi.comm.X itself (one module object), for one release, with a warning."""
    code = textwrap.dedent("""
        import warnings, zerompi.comm.group as new
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            import zerompi.dist.group as old
            from zerompi.dist.codec import BlockCodec
        import zerompi.comm.codec
        assert old is new and BlockCodec is zerompi.comm.codec.BlockCodec, (old, new)
        assert old.__spec__.name == "zerompi.comm.group"
        assert [str(w.message) for w in seen if w.category is DeprecationWarning] == [
            "zerompi.dist is deprecated and will be removed in the next release; import zerompi.comm instead"]
        try:
            import zerompi.dist.nosuch
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("zerompi.dist.nosuch imported")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(zerompi.__file__).parent.parent)


def test_shared_checkpoint_writer_gets_the_communicator_only_for_h5py(monkeypatch, tmp_path):
    """SharedWriter agrees through the group's allgather_object; h5py's mpio driver gets h5py_comm()."""
    from zerompi.checkpoint import shared
    from zerompi.errors import CheckpointError
    opened = []

    def refuse(path, mode, *, driver, comm):
        opened.append((driver, comm))
        raise OSError("no parallel HDF5 here")
    monkeypatch.setattr(shared.h5py, "File", refuse)
    g = MPIGroup(MPI.COMM_SELF)
    with pytest.raises(CheckpointError, match="rank 0: cannot create it through the mpio driver"):
        shared.SharedWriter(tmp_path / shared.SHARED, g, "save-1")
    assert opened == [("mpio", g.h5py_comm())]


def test_ulfm_support_names_the_missing_launch_flag():
    """fault_tolerance's refusal says which of mpiexec's flags is missing, for each MPI."""
    from zerompi.comm import ulfm
    ompi = "Open MPI v5.0.11, package: Open MPI"
    missing_ft = ulfm.support_error({}, ompi)
    assert "OMPI_MCA_mpi_ft_enable is not set" in missing_ft and ulfm.LAUNCH_FLAGS in missing_ft
    missing_finalize = ulfm.support_error({"OMPI_MCA_mpi_ft_enable": "1"}, ompi)
    assert "MPI_Finalize can wait forever" in missing_finalize and "async_mpi_finalize 1" in missing_finalize
    both = {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_async_mpi_finalize": "true"}
    assert ulfm.support_error(both, ompi) in (None, f"{ompi} has no MPIX_Comm_shrink (built without ULFM): "
                                                    f"{ulfm.LAUNCH_HINT}")
    assert "MPICH's fault tolerance" in ulfm.support_error(both, "MPICH Version: 5.0.2")
    assert "offers no ULFM" in ulfm.support_error(both, "Intel(R) MPI Library 2021")
