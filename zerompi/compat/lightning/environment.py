"""Where each rank runs, as Lightning asks it of a cluster environment: from MPI, through zerompi's group.

MPI started the processes and connected them, so there is no address or port to rendezvous at;
the ranks are those of the group the engine trains over (``launch.discover``), so Lightning and
the engine never disagree about them.
"""
from __future__ import annotations

from lightning.fabric.plugins import ClusterEnvironment

from zerompi.comm.launch import RankInfo
from zerompi.errors import UsageError


class MPIRanks(ClusterEnvironment):
    """Ranks, local ranks and nodes of an MPI job, learned once by the strategy (collectively)."""

    def __init__(self, info: RankInfo):
        self.info = info

    @property
    def creates_processes_externally(self) -> bool:
        return True  # mpiexec (or srun) started every rank

    @property
    def main_address(self) -> str:
        raise UsageError("ZeroMPIStrategy has no rendezvous address: MPI connected the ranks")

    @property
    def main_port(self) -> int:
        raise UsageError("ZeroMPIStrategy has no rendezvous port: MPI connected the ranks")

    @staticmethod
    def detect() -> bool:
        return False  # chosen by ZeroMPIStrategy only, never detected

    def world_size(self) -> int:
        return self.info.world_size

    def set_world_size(self, size: int) -> None:
        self._same("world size", size, self.info.world_size)

    def global_rank(self) -> int:
        return self.info.rank

    def set_global_rank(self, rank: int) -> None:
        self._same("global rank", rank, self.info.rank)

    def local_rank(self) -> int:
        return self.info.local_rank

    def node_rank(self) -> int:
        return self.info.node_rank

    @staticmethod
    def _same(what: str, given: int, actual: int) -> None:
        if given != actual:
            raise UsageError(f"ZeroMPIStrategy: Lightning sets the {what} to {given}, but MPI gives {actual}")
