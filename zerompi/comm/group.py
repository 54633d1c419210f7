"""What the rest of zerompi asks of a process group, and the handles its collectives return.

The package outside ``comm/`` types groups as :class:`ProcessGroup` and never
sees a communicator; ``comm/mpi/`` (:class:`~zerompi.comm.mpi.MPIGroup`) is
the one implementation, and the only module that uses mpi4py. Collectives
take flat, contiguous tensors and return a :class:`Work`.
"""
from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from zerompi.comm.watchdog import HangPolicy

Blocked = Callable[[], AbstractContextManager]  # the watchdog's "this rank waits in ..." bookkeeping


class Work:
    """Handle for a collective whose data has already moved; ``wait()`` is idempotent and returns the result.

    ``finish`` (copying staged data back, summing 16-bit chunks) runs once, at
    the first ``wait()``. ``Work()`` is a handle with nothing left to do.
    Subclasses add the wait for data still in flight.
    """

    def __init__(self, finish: Callable[[], Any] | None = None):
        self._finish = finish
        self._done = False
        self._result: Any = None

    @staticmethod
    def done(result: Any = None) -> "Work":
        """A handle whose result is already known (a blocking collective)."""
        work = Work()
        work._done, work._result = True, result
        return work

    def wait(self) -> Any:
        if not self._done:
            self._transfer()
            if self._finish is not None:
                self._result = self._finish()
            self._done = True
        return self._result

    def test(self) -> bool:
        """True once the data has moved (``wait()`` then returns without blocking on other ranks)."""
        return self._done or self._transferred()

    def _transfer(self) -> None:
        """Block until the data has moved; here it already has."""

    def _transferred(self) -> bool:
        return True


class Request(Protocol):
    """A non-blocking MPI request, as mpi4py's ``MPI.Request`` (typed here without mpi4py)."""

    def Wait(self) -> Any: ...
    def Test(self) -> bool: ...


class RequestWork(Work):
    """A non-blocking MPI collective: ``Wait``/``Test`` on its request also drive MPI's progress."""

    def __init__(self, request: Request, finish: Callable[[], Any] | None = None, blocked: Blocked = nullcontext):
        super().__init__(finish)
        self._request = request
        self._blocked = blocked

    def _transfer(self) -> None:
        with self._blocked():
            self._request.Wait()

    def _transferred(self) -> bool:
        return self._request.Test()


class FutureWork(Work):
    """A blocking collective queued on the communication thread (thread.py); done when its future is."""

    def __init__(self, future: Future, finish: Callable[[], Any] | None = None, blocked: Blocked = nullcontext):
        super().__init__(finish)
        self._future = future
        self._blocked = blocked

    def _transfer(self) -> None:
        with self._blocked():
            self._future.result()

    def _transferred(self) -> bool:
        return self._future.done()


class ThenWork(Work):
    """A collective followed by local work on what it received (e.g. decoding compressed chunks):
    waiting or testing it waits on or tests the collective, then ``finish`` runs once."""

    def __init__(self, first: Work, finish: Callable[[], Any]):
        super().__init__(finish)
        self._first = first

    def _transfer(self) -> None:
        self._first.wait()

    def _transferred(self) -> bool:
        return self._first.test()


class ProcessGroup(Protocol):
    """The ranks one collective runs over, and the verbs zerompi uses on them.

    Every group of a process shares its byte counters, its debug sequence, the
    hang recorder, the watchdog and the communication thread; ``split``/``split_shared`` make
    sub-groups that keep sharing them.
    """

    rank: int
    size: int
    label: str        # "" for groups spanning the job; counters are keyed ``kind@label`` otherwise
    cuda_aware: bool  # device tensors go to the collective directly (else staged via pinned host memory)

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per collective kind by every group of this process."""

    # ---- collectives on flat tensors ------------------------------------
    # ``used`` (all_gather, reduce_scatter, all_to_all): the buffer is one equal chunk per rank, and
    # only the first ``used[r]`` elements of chunk r are live; the rest is padding that never travels
    # (an owner-aligned bucket's: shard/layout.py), and the padding of what the call returns is zeros.
    def all_gather(self, shard: torch.Tensor | None, out: torch.Tensor, *, kind: str = "all_gather",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work: ...
    def reduce_scatter(self, full: torch.Tensor, *, kind: str = "reduce_scatter",
                       async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work: ...
    def all_reduce(self, t: torch.Tensor, *, kind: str = "all_reduce", async_op: bool = False,
                   what: str = "") -> Work: ...
    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, *, kind: str = "all_to_all",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work: ...
    def broadcast(self, t: torch.Tensor, root: int = 0, *, kind: str = "broadcast", what: str = "") -> None: ...
    def gather(self, t: torch.Tensor, out: torch.Tensor | None, root: int = 0, *, kind: str = "gather",
               what: str = "") -> None:
        """Blocking: ``out[r*n:(r+1)*n]`` = rank r's ``t`` on ``root`` (``out`` is None elsewhere)."""
    def shift(self, t: torch.Tensor, offset: int, *, kind: str = "shift", what: str = "") -> torch.Tensor:
        """Blocking, every rank: send ``t`` (any length) to rank ``rank + offset`` (mod size); return what
        rank ``rank - offset`` sent (a copy of a buddy's state: recovery's in-memory replicas)."""

    # ---- small control messages ----------------------------------------
    def sum_floats(self, values: list[float], *, kind: str = "control", what: str = "") -> list[float]: ...
    def allgather_object(self, obj: Any) -> list[Any]: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...

    # ---- sub-groups and where this rank runs ----------------------------
    def split(self, color: int, key: int, label: str) -> "ProcessGroup": ...
    def split_shared(self) -> "ProcessGroup": ...
    def create_group(self, ranks: list[int], label: str = "") -> "ProcessGroup": ...  # by those ranks alone
    def free(self) -> None: ...
    def processor_name(self) -> str: ...
    def library_version(self) -> str: ...
    def h5py_comm(self) -> Any: ...

    # ---- hang protection and progress -----------------------------------
    def start_watchdog(self, policy: HangPolicy) -> None:
        """Collective: start the hang watchdog (watchdog.py) of this process's groups."""
    def stop_watchdog(self) -> None: ...
    def step_done(self) -> None:
        """An optimizer step ended: the running median step time sets the default hang deadline."""
    def start_comm_thread(self) -> None: ...
    def stop_comm_thread(self) -> None: ...
