"""An in-process group: ranks as threads of one process, for tests at 2-4 ranks without ``mpiexec``.

:class:`LocalGroup` meets the same :class:`~zerompi.comm.group.ProcessGroup` protocol as
``MPIGroup``, checks the same shapes and counts the same bytes, so shard, optimizer, checkpoint and
codec logic runs at several ranks inside one pytest process (seconds, not an MPI job's start-up).
:func:`run_ranks` starts the ranks and returns what each returned.

What differs from MPI, by design:

- every collective completes when issued (``async_op`` handles are already done): ranks issue
  collectives in the same order, as MPI requires, so nothing waits on a later call;
- reductions sum in rank order, one fixed order; MPI's order depends on its algorithm;
- ranks share the process: torch's global RNG, the thread count and any process-global state
  are common to all of them. Tests of per-process state (RNG streams, memory peaks, swap files) use MPI;
- ``h5py_comm()`` has no communicator, so the shared-file checkpoint layout needs MPI;
- a rank that raises (or ``abort``s) breaks the rendezvous, so its peers raise instead of
  hanging, and :func:`run_ranks` re-raises the first error.
"""
from __future__ import annotations

import copy
import socket
import threading
import time
from typing import Any, Callable, Sequence

import torch

from zerompi.comm import shapes
from zerompi.comm.group import Work
from zerompi.comm.monitor import Agreement, Entered, Monitor
from zerompi.comm.watchdog import HangPolicy
from zerompi.errors import ZeroMPIError


class RankFailed(ZeroMPIError):
    """Another rank of the in-process group failed or aborted while this one waited for it."""


class _World:
    """The rendezvous of one group's ranks: a slot each, and a barrier on either side of reading them."""

    def __init__(self, size: int):
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)
        self.lock = threading.Lock()
        self.children: dict[tuple, _World] = {}  # (split number, color) or (create_group key, number) -> sub-world

    def wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RankFailed("another rank of the in-process group failed or aborted") from None

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective of this world)."""
        self.slots[rank] = value
        self.wait()
        values = list(self.slots)
        self.wait()  # nobody overwrites a slot before every rank has read them all
        return values

    def abort(self) -> None:
        self.barrier.abort()
        with self.lock:
            for child in self.children.values():
                child.abort()


def _rank_order_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's tensor, rank 0 first: one fixed order, whatever the rank count."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


class LocalGroup:
    """One rank's view of an in-process group (see the module docstring for what differs from MPI)."""

    cuda_aware = False

    def __init__(self, world: _World, rank: int, *, label: str = "", monitor: Monitor | None = None,
                 debug: bool = False):
        self._world = world
        self.rank, self.size, self.label = rank, world.size, label
        self.monitor = monitor if monitor is not None else Monitor(Agreement(debug=debug))
        self._splits = 0
        self._created: dict[tuple, int] = {}  # create_group calls per rank list

    @property
    def bytes_sent(self) -> dict[str, int]:
        return self.monitor.counters.bytes_sent

    def _exchange(self, desc: str | Entered, value: Any) -> list[Any]:
        what, event = (desc, None) if isinstance(desc, str) else desc
        with self.monitor.watchdog.blocked(what, self.label, event):
            return self._world.exchange(self.rank, value)

    def _enter(self, kind: str, t: torch.Tensor, what: str, nbytes: int | None) -> Entered:
        if nbytes is not None:  # None: this rank sends nothing (a broadcast's receivers)
            self.monitor.counters.add(kind, self.label, nbytes)
        entered = self.monitor.enter(kind, t, what, self.label)
        if self.monitor.agreement.debug:
            self.monitor.agreement.check(self._exchange(f"the debug check before {entered.desc}", entered.desc))
        return entered

    def _mine(self, t: torch.Tensor) -> slice:
        n = t.numel() // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    # ---- collectives on flat tensors ------------------------------------
    def all_gather(self, shard: torch.Tensor | None, out: torch.Tensor, *, kind: str = "all_gather",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        desc = self._enter(kind, out, what, shapes.all_gather_bytes(shard, out, self.size, used, self.rank))
        own = (out[self._mine(out)] if shard is None else shard).detach().clone()
        out.copy_(torch.cat(self._exchange(desc, own)))
        if used is not None:  # what MPI's Allgatherv leaves: padding that never travelled, zeroed
            shapes.clear_padding(out, self.size, used)
        return Work.done()

    def reduce_scatter(self, full: torch.Tensor, *, kind: str = "reduce_scatter",
                       async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        desc = self._enter(kind, full, what, shapes.reduce_scatter_bytes(full, self.size, used, self.rank))
        chunks = [t[self._mine(t)] for t in self._exchange(desc, full.detach().clone())]
        if full.dtype in shapes.SUM_DTYPES:  # summed in the input's precision, as MPI_SUM does
            total = _rank_order_sum(chunks).float()
        else:
            total = torch.stack(chunks).float().sum(dim=0)
        if used is not None:
            total[used[self.rank]:].zero_()
        return Work.done(total)

    def all_reduce(self, t: torch.Tensor, *, kind: str = "all_reduce", async_op: bool = False,
                   what: str = "") -> Work:
        desc = self._enter(kind, t, what, shapes.all_reduce_bytes(t, self.size))
        t.copy_(_rank_order_sum(self._exchange(desc, t.detach().clone())))
        return Work.done()

    def shift(self, t: torch.Tensor, offset: int, *, kind: str = "shift", what: str = "") -> torch.Tensor:
        desc = self._enter(kind, t, what, shapes.shift_bytes(t, offset, self.size))
        return self._exchange(desc, t.detach().clone())[(self.rank - offset) % self.size]

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, *, kind: str = "all_to_all",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        desc = self._enter(kind, send, what, shapes.all_to_all_bytes(send, recv, self.size, used, self.rank))
        recv.copy_(torch.cat([v[self._mine(v)] for v in self._exchange(desc, send.detach().clone())]))
        if used is not None:
            shapes.clear_padding(recv, self.size, [used[self.rank]] * self.size)
        return Work.done()

    def broadcast(self, t: torch.Tensor, root: int = 0, *, kind: str = "broadcast", what: str = "") -> None:
        nbytes = shapes.broadcast_bytes(t, self.size)
        desc = self._enter(kind, t, what, nbytes if self.rank == root else None)
        t.copy_(self._exchange(desc, t.detach().clone())[root])

    def gather(self, t: torch.Tensor, out: torch.Tensor | None, root: int = 0, *, kind: str = "gather",
               what: str = "") -> None:
        mine = out if self.rank == root else None
        nbytes = shapes.gather_bytes(t, mine, self.size)
        desc = self._enter(kind, t, what, nbytes if self.rank != root else None)
        parts = self._exchange(desc, t.detach().clone())
        if mine is not None:
            mine.copy_(torch.cat(parts))

    # ---- small control messages ----------------------------------------
    def sum_floats(self, values: list[float], *, kind: str = "control", what: str = "") -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64)
        self.all_reduce(buf, kind=kind, what=what)
        return buf.tolist()

    def allgather_object(self, obj: Any) -> list[Any]:
        """Each rank gets its own copies, as unpickling MPI's messages would give it."""
        event = self.monitor.recorder.begin("allgather_object", self.label, "metadata", 0)
        return copy.deepcopy(self._exchange(Entered("an exchange of metadata (allgather_object)", event), obj))

    def barrier(self) -> None:
        event = self.monitor.recorder.begin("barrier", self.label, "", 0)
        with self.monitor.watchdog.blocked("a barrier", self.label, event):
            self._world.wait()

    def abort(self, code: int = 1) -> None:
        self._world.abort()
        raise RankFailed(f"rank {self.rank} aborted the in-process group (code {code})")

    # ---- sub-groups and where this rank runs ----------------------------
    def split(self, color: int, key: int, label: str) -> "LocalGroup":
        number, self._splits = self._splits, self._splits + 1
        pairs = self._exchange("a split of the group", (color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        with self._world.lock:
            world = self._world.children.setdefault((number, color), _World(len(members)))
        return LocalGroup(world, [r for _, r in members].index(self.rank), label=label, monitor=self.monitor)

    def create_group(self, ranks: list[int], label: str = "") -> "LocalGroup":
        """A sub-group of ``ranks`` (in that order), made by those ranks alone, as MPI_Comm_create_group:
        the n-th such call with the same ranks makes the same sub-world on each of them."""
        key = ("create", tuple(ranks))
        number = self._created[key] = self._created.get(key, -1) + 1
        with self._world.lock:
            world = self._world.children.setdefault((key, number), _World(len(ranks)))
        return LocalGroup(world, list(ranks).index(self.rank), label=label, monitor=self.monitor)

    def split_shared(self) -> "LocalGroup":
        return self.split(0, self.rank, "node")  # every thread shares this process's memory

    def free(self) -> None:
        """Nothing to release: the sub-world goes with its last reference."""

    @staticmethod
    def processor_name() -> str:
        return socket.gethostname()

    @staticmethod
    def library_version() -> str:
        return "in-process threads (zerompi.comm.local)"

    def h5py_comm(self) -> Any:
        raise ZeroMPIError("an in-process group has no MPI communicator for h5py; the shared-file "
                           "checkpoint layout needs an MPI group")

    # ---- hang protection and progress -----------------------------------
    def start_watchdog(self, policy: HangPolicy) -> None:
        """A rank waiting longer than ``collective_timeout`` breaks the rendezvous: every rank raises.
        In-process ranks have no automatic deadline (``run_ranks`` bounds a test's time) and no side
        channel: the rank writes its record (if ``policy.directory``) and gives the per-rank message."""
        self.monitor.watchdog.start(policy._replace(floor=None), self.rank, self.size,
                                    lambda code: self._world.abort(), self.monitor.recorder)

    def step_done(self) -> None:
        """An optimizer step ended (its duration sets the watchdog's default deadline)."""
        self.monitor.recorder.step_done()

    def stop_watchdog(self) -> None:
        self.monitor.watchdog.stop()

    def start_comm_thread(self) -> None:
        """Collectives complete when issued here: there is no progress to drive."""

    def stop_comm_thread(self) -> None:
        """See ``start_comm_thread``."""


def run_ranks(size: int, fn: Callable[[LocalGroup], Any], *, debug: bool = False,
              timeout: float | None = 120.0) -> list[Any]:
    """Run ``fn(group)`` on ``size`` threads, one rank each; what each returned, in rank order.

    The first exception any rank raises is re-raised here once every thread has ended (its peers,
    blocked in a collective, raise :class:`RankFailed` instead of hanging). ``timeout`` bounds the
    whole run: past it the rendezvous is broken and ``TimeoutError`` names the ranks still running.
    """
    world = _World(size)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(LocalGroup(world, rank, debug=debug))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append((rank, exc))
            world.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank {r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        world.abort()
        raise TimeoutError(f"in-process ranks still running after {timeout:g} s: {', '.join(alive)}")
    first = next((e for _, e in errors if not isinstance(e, RankFailed)), None) or \
        (errors[0][1] if errors else None)
    if first is not None:
        raise first
    return results
