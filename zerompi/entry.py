"""``initialize``: the process group (MPI by default) and its guards, then the engine: a plain
:class:`Engine`, or with ``fault_tolerance=True`` a :class:`~zerompi.recovery.ResilientEngine`."""
from __future__ import annotations

from typing import Any

from torch import nn

from zerompi.checkpoint.stores import store_for
from zerompi.comm import guard, launch
from zerompi.comm.group import ProcessGroup
from zerompi.comm.mpi import MPIGroup
from zerompi.config import ZeroConfig
from zerompi.build import EngineSpec, build_engine
from zerompi.engine import Engine
from zerompi.errors import UsageError
from zerompi.optim import schedules
from zerompi.recovery import ResilientEngine
from zerompi.shard import deferred


def job_group(cfg: ZeroConfig, comm=None) -> MPIGroup:
    """Collective: the engine's MPI group over ``comm`` (``MPI.COMM_WORLD`` by default), as ``cfg`` asks;
    metadata exchanges get a duplicate communicator of their own, so that a save one rank makes alone waits
    there and is named by the hang report instead of meeting the others' next collective. Frameworks that
    hand ``initialize`` a group of their own (the Lightning strategy) build it here too."""
    return MPIGroup(comm, cuda_aware=launch.use_cuda_aware(cfg.runtime.cuda_aware_mpi),
                    debug=cfg.reliability.debug_collectives, separate_metadata=True)


def initialize(model: nn.Module, config: ZeroConfig | None = None, *, comm=None,
               param_groups: list[dict[str, Any]] | None = None,
               param_init: deferred.ParamInit | None = None,
               lr_scheduler: schedules.SchedulerFactory | None = None,
               group: ProcessGroup | None = None) -> Engine | ResilientEngine:
    """Collective: wrap ``model`` in an :class:`Engine` over ``comm`` (``MPI.COMM_WORLD`` by default).

    ``group`` replaces ``comm`` with another process group, e.g. the in-process
    ``zerompi.comm.local.LocalGroup`` that tests run at several ranks in one process.

    ``param_groups`` optionally splits the trainable parameters into optimizer
    groups with their own options, like ``torch.optim`` param groups, e.g.
    ``[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]``.

    A model built under ``torch.device("meta")`` is materialised one bucket at
    a time, each module by ``param_init(module)`` (default: its
    ``reset_parameters()``), so no rank ever holds the whole model (deferred.py).

    ``lr_scheduler(optimizer)`` builds any ``torch.optim.lr_scheduler`` scheduler on the
    engine's optimizer (default: the config's ``lr_schedule``); ``engine.step()`` steps it.
    """
    cfg = config if config is not None else ZeroConfig()
    store_for(cfg.checkpoint_layout)  # a layout this h5py cannot write fails now, not at the first save
    reliability = cfg.reliability
    if group is None:
        group = job_group(cfg, comm)
    elif comm is not None:
        raise UsageError("initialize: pass comm (an MPI communicator) or group, not both")
    if reliability.abort_on_exception:
        guard.abort_on_uncaught_exception(group)
    spec = EngineSpec(model, cfg, param_groups, param_init, lr_scheduler)
    if cfg.fault_tolerance:  # a lost rank is survived: a supervisor rebuilds the engine over the survivors
        return ResilientEngine(spec, group)
    return build_engine(spec, group)
