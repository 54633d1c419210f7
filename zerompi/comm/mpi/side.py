"""The hang report's side channel: pickled point-to-point messages on a duplicate communicator."""
from __future__ import annotations

from typing import Any

from zerompi.comm.mpi.library import MPI


class SideChannel:
    """Pickled point-to-point messages on a duplicate communicator, for the hang report only.

    Used from the watchdog thread while the training thread may sit in a collective (hence
    ``MPI_THREAD_MULTIPLE``); nothing here ever waits on another rank.
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self._sent: list[MPI.Request] = []

    def post(self, dest: int, tag: int, obj: Any) -> None:
        if not MPI.Is_finalized():
            self._sent.append(self.comm.isend(obj, dest=dest, tag=tag))

    def poll(self, tag: int) -> list[tuple[int, Any]]:
        """The messages with ``tag`` that have arrived, as ``(source, object)``."""
        arrived: list[tuple[int, Any]] = []
        if MPI.Is_finalized():
            return arrived
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            source = status.Get_source()
            arrived.append((source, self.comm.recv(source=source, tag=tag)))
        return arrived

    def flush(self) -> bool:
        """Drive the posted messages; True when all have left."""
        if MPI.Is_finalized():
            return True
        self._sent = [r for r in self._sent if not r.Test()]
        return not self._sent
