"""What a process group runs beside the engine, as the config says: the hang watchdog and the
communication thread. ``initialize`` starts them on the job's group, and the rebuild after a lost
rank (recovery.py) on the survivors' group, so that both are watched and progressed alike."""
from __future__ import annotations

from zerompi.comm.group import ProcessGroup
from zerompi.comm.watchdog import HangPolicy
from zerompi.config import Progress, ZeroConfig


def start_services(group: ProcessGroup, cfg: ZeroConfig) -> None:
    """Collective: the watchdog with the config's hang policy, and the communication thread if asked for."""
    reliability = cfg.reliability
    group.start_watchdog(HangPolicy(reliability.collective_timeout, reliability.hang_floor, reliability.hang_dir))
    if cfg.overlap.progress == Progress.THREAD:
        group.start_comm_thread()
