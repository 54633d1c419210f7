""":class:`MPIGroup`: collectives on flat, contiguous tensors over an MPI communicator.

Everything outside comm/ sees a ``ProcessGroup`` (comm/group.py). Every collective takes 1-D
contiguous tensors and returns a :class:`Work` handle; shapes.py checks them and counts the bytes,
as for every group.

MPI has no 16-bit floating reduction, so a 16-bit reduce-scatter is an ``Alltoall`` (same bytes) followed
by a local fp32 sum over ranks, which is also more accurate than summing in 16 bits. staging.py says how
device tensors reach MPI, and what a group of one rank does instead.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from zerompi.comm import sentinel, shapes
from zerompi.comm.group import FutureWork, RequestWork, Work
from zerompi.comm.monitor import Agreement, Entered, Monitor
from zerompi.comm.mpi.library import MPI, thread_support_error
from zerompi.comm.mpi.side import SideChannel
from zerompi.comm.recorder import Event
from zerompi.comm.staging import alone_copy, alone_reduce_scatter, stage
from zerompi.comm.thread import CommThread
from zerompi.comm.watchdog import HangPolicy, batch_job, default_directory
from zerompi.errors import ZeroMPIError

_SHIFT_TAG = 17  # point-to-point on the job's communicator: never matched by a collective


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view MPI can describe: 16-bit floats travel as int16 where no arithmetic happens."""
    return t.view(torch.int16) if t.dtype in shapes.HALF_DTYPES else t


class MPIGroup:
    """A :class:`~zerompi.comm.group.ProcessGroup` over an MPI communicator.

    Args:
        comm: the mpi4py communicator (``MPI.COMM_WORLD`` when None).
        cuda_aware: pass device tensors straight to MPI (else stage via pinned host memory).
        debug: compare every collective across ranks first (also set by ``ZEROMPI_DEBUG``).
        separate_metadata: exchange metadata on a duplicate communicator (collective; see below).
        label: "" for groups spanning the job; "intra"/"inter"/"node" for node-aware groups.
        monitor: the parts shared with the other groups of this process (new ones when None).
    """

    def __init__(self, comm: MPI.Comm | None = None, *, cuda_aware: bool = False, debug: bool = False,
                 label: str = "", monitor: Monitor | None = None, separate_metadata: bool = False):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = cuda_aware
        self.label = label
        self.monitor = monitor if monitor is not None else Monitor(Agreement(
            debug=debug or os.environ.get("ZEROMPI_DEBUG", "") not in ("", "0")))
        # separate_metadata (collective): metadata exchanges (allgather_object) run on a duplicate
        # communicator of their own. A rank that alone starts one (a save_checkpoint on one rank) then
        # waits in a collective its peers never enter, where the watchdog names it, instead of meeting
        # their data collective, which MPI may abort as a size mismatch ("Message truncated") first.
        self.metadata_comm: MPI.Comm | None = self._call(self.comm.Dup) if separate_metadata else None

    @property
    def communicators(self) -> tuple[MPI.Comm, ...]:
        """The group's communicators: its own, and the metadata one if separate (for ULFM's revoke)."""
        return (self.comm,) if self.metadata_comm is None else (self.comm, self.metadata_comm)

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per collective kind by every group of this process (shared counters)."""
        return self.monitor.counters.bytes_sent

    def split(self, color: int, key: int, label: str) -> MPIGroup:
        """A sub-group (``MPI_Comm_split``) sharing this group's counters, debug mode and watchdog."""
        return MPIGroup(self._call(lambda: self.comm.Split(color, key)), cuda_aware=self.cuda_aware, label=label,
                        monitor=self.monitor)

    def create_group(self, ranks: list[int], label: str = "") -> MPIGroup:
        """A sub-group of ``ranks`` (this group's ranks, in that order), made by those ranks alone
        (``MPI_Comm_create_group``: the others need not take part)."""
        sub = self.comm.Get_group().Incl(list(ranks))
        try:
            comm = self._call(lambda: self.comm.Create_group(sub, tag=0))
        finally:
            sub.Free()
        return MPIGroup(comm, cuda_aware=self.cuda_aware, label=label, monitor=self.monitor)

    def h5py_comm(self) -> MPI.Comm:
        """The communicator for ``h5py.File(driver="mpio", comm=...)``.

        The one place the raw communicator leaves comm/: h5py's MPI-IO needs an
        mpi4py communicator and takes no other handle.
        """
        return self.comm

    def free(self) -> None:
        """Release the communicator (``MPI_Comm_free``) of a group made by ``split``/``split_shared``."""
        self.comm.Free()

    # ---- hang protection --------------------------------------------------
    def start_watchdog(self, policy: HangPolicy) -> None:
        """Collective: diagnose and abort when this rank waits past ``policy``'s deadline (watchdog.py).

        The side channel is a duplicate communicator (so the report never depends on the stuck
        collective); without ``MPI_THREAD_MULTIPLE`` there is none and a rank aborts alone, as the
        watchdog did before. With no ``hang_dir`` the records go under a temporary directory named
        after the batch job, else after rank 0's host and process id."""
        if not policy.active or self.size == 1:
            return
        channel = SideChannel(self._call(self.comm.Dup)) if thread_support_error() is None else None
        if policy.directory is None:
            job = batch_job()
            if job is None:
                local = f"{MPI.Get_processor_name()}-{os.getpid()}"
                job = channel.comm.bcast(local, root=0) if channel is not None else local
            policy = policy._replace(directory=default_directory(job))
        # every rank's host, once: a report names the node of ranks that cannot answer (lost, or cut off)
        hosts = tuple(channel.comm.allgather(MPI.Get_processor_name())) if channel is not None else ()
        self.monitor.watchdog.start(policy, self.rank, self.size, self.abort, self.monitor.recorder, channel, hosts)
        # a rank killed by a signal is named by its job rank, which is what the launcher's ranks are
        world = hosts if self.size == MPI.COMM_WORLD.Get_size() else ()  # the end records name ranks by job rank
        sentinel.start(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), MPI.Get_processor_name(),
                       policy.directory, world)

    def step_done(self) -> None:
        """An optimizer step ended (its duration sets the watchdog's default deadline)."""
        self.monitor.recorder.step_done()

    def stop_watchdog(self) -> None:
        self.monitor.watchdog.stop()

    def start_comm_thread(self) -> None:
        """Run every collective of this process on one communication thread (thread.py)."""
        problem = thread_support_error()
        if problem is not None:
            raise ZeroMPIError(problem)
        if self.monitor.comm_thread is None:
            self.monitor.comm_thread = CommThread()

    def stop_comm_thread(self) -> None:
        thread, self.monitor.comm_thread = self.monitor.comm_thread, None
        if thread is not None:
            thread.close()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """A blocking MPI call, queued behind the communication thread's collectives if there is one."""
        thread = self.monitor.comm_thread
        return fn() if thread is None else thread.run(fn)

    def _issue(self, entered: Entered, blocking: Callable[[], Any], start: Callable[[], MPI.Request],
               finish: Callable[[], Any], async_op: bool) -> Work:
        """One collective: blocking, non-blocking (``start``), or on the communication thread."""
        blocked = lambda: self._blocked(entered.desc, entered.event)
        if async_op:
            thread = self.monitor.comm_thread
            if thread is not None:
                return FutureWork(thread.submit(blocking), finish, blocked)
            return RequestWork(start(), finish, blocked)
        with blocked():
            self._call(blocking)
        return Work.done(finish())

    def _blocked(self, what: str, event: Event | None = None) -> AbstractContextManager:
        """The watchdog's record that this rank waits in ``what`` (naming the group); ``event`` ends with it."""
        return self.monitor.watchdog.blocked(what, self.label, event)

    def _enter(self, kind: str, t: torch.Tensor, what: str) -> Entered:
        """Number and record the collective; in debug mode every rank must be at the same one."""
        entered = self.monitor.enter(kind, t, what, self.label)
        if self.monitor.agreement.debug:
            with self._blocked(f"the debug check before {entered.desc}"):
                descs = self._call(lambda: self.comm.allgather(entered.desc))
            self.monitor.agreement.check(descs)
        return entered

    # ---- topology -------------------------------------------------------
    def split_shared(self) -> MPIGroup:
        """Ranks sharing this node's memory (``MPI_COMM_TYPE_SHARED``)."""
        return MPIGroup(self._call(lambda: self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)),
                        cuda_aware=self.cuda_aware, label="node", monitor=self.monitor)

    @staticmethod
    def processor_name() -> str:
        return MPI.Get_processor_name()

    @staticmethod
    def library_version() -> str:
        return MPI.Get_library_version().strip().splitlines()[0]

    def _alone(self, entered: Entered, op: Callable[[], Any]) -> Work:
        """A collective of a one-rank group: ``op``, the local copy MPI would make (staging.py)."""
        with self._blocked(*entered):
            return Work.done(op())

    def _count(self, kind: str, nbytes: int) -> None:
        self.monitor.counters.add(kind, self.label, nbytes)

    # ---- collectives ----------------------------------------------------
    def all_gather(self, shard: torch.Tensor | None, out: torch.Tensor, *, kind: str = "all_gather",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        """``out[r*S:(r+1)*S] = shard of rank r``; ``shard`` may be ``None`` for in place.

        ``used`` (group.py): ``Allgatherv`` of the live elements, into their places in ``out``."""
        self._count(kind, shapes.all_gather_bytes(shard, out, self.size, used, self.rank))
        entered = self._enter(kind, out, what)
        if self.size == 1:
            return self._alone(entered, lambda: alone_copy(out, shard))
        if used is not None:
            shapes.clear_padding(out, self.size, used)
        if shard is None:
            (o,), back = stage((out,), self.cuda_aware)
            send = MPI.IN_PLACE
        else:
            (s, o), back = stage((shard, out), self.cuda_aware)
            send = _raw(s) if used is None else _raw(s)[:used[self.rank]]
        if used is not None:
            recv = [_raw(o), (list(used), shapes.displacements(o, self.size))]
            return self._issue(entered, lambda: self.comm.Allgatherv(send, recv),
                               lambda: self.comm.Iallgatherv(send, recv), back, async_op)
        return self._issue(entered, lambda: self.comm.Allgather(send, _raw(o)),
                           lambda: self.comm.Iallgather(send, _raw(o)), back, async_op)

    def reduce_scatter(self, full: torch.Tensor, *, kind: str = "reduce_scatter",
                       async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        """Sum ``full`` over ranks; ``wait()`` returns this rank's chunk in fp32.

        fp32/fp64 use ``Reduce_scatter_block`` (``used``: ``Reduce_scatter`` of the live elements,
        packed back to back first); 16-bit inputs use ``Alltoall`` (``Alltoallv``) and sum the
        received chunks in fp32 in rank order.
        """
        self._count(kind, shapes.reduce_scatter_bytes(full, self.size, used, self.rank))
        n = full.numel() // self.size
        entered = self._enter(kind, full, what)
        if self.size == 1:
            return self._alone(entered, lambda: alone_reduce_scatter(full))
        if full.dtype in shapes.SUM_DTYPES:
            if used is None:
                out = torch.empty(n, dtype=full.dtype, device=full.device)
                (f, o), back = stage((full, out), self.cuda_aware)
                blocking = lambda: self.comm.Reduce_scatter_block(f, o, op=MPI.SUM)
                start = lambda: self.comm.Ireduce_scatter_block(f, o, op=MPI.SUM)
            else:  # the padding of this rank's chunk never arrives: zeros
                out = torch.zeros(n, dtype=full.dtype, device=full.device)
                (f, o), back = stage((shapes.live(full, self.size, used), out), self.cuda_aware)
                mine, counts = o[:used[self.rank]], list(used)
                blocking = lambda: self.comm.Reduce_scatter(f, mine, counts, op=MPI.SUM)
                start = lambda: self.comm.Ireduce_scatter(f, mine, counts, op=MPI.SUM)
            return self._issue(entered, blocking, start, lambda: (back(), out.float())[1], async_op)
        recv = torch.empty_like(full) if used is None else torch.zeros_like(full)
        (f, r), back = stage((full, recv), self.cuda_aware)

        def finish() -> torch.Tensor:
            back()
            return recv.view(self.size, n).float().sum(dim=0)
        blocking, start = self._exchanged(f, r, used)
        return self._issue(entered, blocking, start, finish, async_op)

    def _exchanged(self, send: torch.Tensor, recv: torch.Tensor, used: Sequence[int] | None
                   ) -> tuple[Callable[[], Any], Callable[[], MPI.Request]]:
        """An all-to-all of ``send``'s chunks into ``recv`` (counted: ``Alltoallv`` of the live
        elements), as the blocking call and the one starting a request."""
        if used is None:
            return (lambda: self.comm.Alltoall(_raw(send), _raw(recv)),
                    lambda: self.comm.Ialltoall(_raw(send), _raw(recv)))
        displs = shapes.displacements(send, self.size)
        s = [_raw(send), (list(used), displs)]
        r = [_raw(recv), ([used[self.rank]] * self.size, displs)]
        return lambda: self.comm.Alltoallv(s, r), lambda: self.comm.Ialltoallv(s, r)

    def all_reduce(self, t: torch.Tensor, *, kind: str = "all_reduce", async_op: bool = False,
                   what: str = "") -> Work:
        """In-place sum of an fp32/fp64 tensor over ranks."""
        self._count(kind, shapes.all_reduce_bytes(t, self.size))
        entered = self._enter(kind, t, what)
        if self.size == 1:
            return self._alone(entered, lambda: None)
        (x,), back = stage((t,), self.cuda_aware)
        return self._issue(entered, lambda: self.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                           lambda: self.comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM), back, async_op)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, *, kind: str = "all_to_all",
                   async_op: bool = False, what: str = "", used: Sequence[int] | None = None) -> Work:
        """``recv[r*n:(r+1)*n]`` = chunk ``rank`` of rank r's ``send`` (the bytes of any dtype, moved as they are)."""
        self._count(kind, shapes.all_to_all_bytes(send, recv, self.size, used, self.rank))
        entered = self._enter(kind, send, what)
        if self.size == 1:
            return self._alone(entered, lambda: alone_copy(recv, send))
        if used is not None:
            shapes.clear_padding(recv, self.size, [used[self.rank]] * self.size)
        (s, r), back = stage((send, recv), self.cuda_aware)
        blocking, start = self._exchanged(s, r, used)
        return self._issue(entered, blocking, start, back, async_op)

    def broadcast(self, t: torch.Tensor, root: int = 0, *, kind: str = "broadcast", what: str = "") -> None:
        """In-place broadcast from ``root`` (used once, at initialisation)."""
        nbytes = shapes.broadcast_bytes(t, self.size)
        if self.rank == root:
            self._count(kind, nbytes)
        entered = self._enter(kind, t, what)
        (x,), back = stage((t,), self.cuda_aware)
        with self._blocked(*entered):
            self._call(lambda: self.comm.Bcast(_raw(x), root=root))
        back()

    def gather(self, t: torch.Tensor, out: torch.Tensor | None, root: int = 0, *, kind: str = "gather",
               what: str = "") -> None:
        """Blocking ``MPI_Gather`` of equal parts to ``root`` (a checkpoint's node writer)."""
        mine = out if self.rank == root else None
        nbytes = shapes.gather_bytes(t, mine, self.size)
        if self.rank != root:
            self._count(kind, nbytes)
        entered = self._enter(kind, t, what)
        (x, *o), back = stage((t, *([mine] if mine is not None else [])), self.cuda_aware)
        with self._blocked(*entered):
            self._call(lambda: self.comm.Gather(_raw(x), _raw(o[0]) if o else None, root=root))
        back()

    def shift(self, t: torch.Tensor, offset: int, *, kind: str = "shift", what: str = "") -> torch.Tensor:
        """One message each way with the ranks ``offset`` away (group.py), its length probed: one meeting."""
        dest, source = (self.rank + offset) % self.size, (self.rank - offset) % self.size
        self._count(kind, shapes.shift_bytes(t, offset, self.size))
        entered = self._enter(kind, t, what)
        (x,), _ = stage((t,), self.cuda_aware)

        def exchange() -> torch.Tensor:
            sent, status = self.comm.Isend(_raw(x), dest, _SHIFT_TAG), MPI.Status()
            self.comm.Probe(source, _SHIFT_TAG, status)
            out = torch.empty(status.Get_count(MPI.BYTE) // x.element_size(), dtype=x.dtype)
            self.comm.Recv(_raw(out), source, _SHIFT_TAG)
            sent.Wait()
            return out
        with self._blocked(*entered):
            out = self._call(exchange)
        return out.to(t.device)

    # ---- small control messages ----------------------------------------
    def sum_floats(self, values: list[float], *, kind: str = "control", what: str = "") -> list[float]:
        """Sum a few Python floats over ranks (norms, overflow flags, metrics)."""
        buf = torch.tensor(values, dtype=torch.float64)
        self.all_reduce(buf, kind=kind, what=what)
        return buf.tolist()

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (metadata only, never tensors)."""
        event = self.monitor.recorder.begin("allgather_object", self.label, "metadata", 0)
        with self._blocked("an exchange of metadata (allgather_object)", event):
            comm = self.metadata_comm if self.metadata_comm is not None else self.comm
            return self._call(lambda: comm.allgather(obj))

    def barrier(self) -> None:
        with self._blocked("a barrier", self.monitor.recorder.begin("barrier", self.label, "", 0)):
            self._call(self.comm.Barrier)

    def abort(self, code: int = 1) -> None:
        sentinel.quiet()  # every zerompi abort has said why: the watcher of this rank stays silent
        self.comm.Abort(code)
