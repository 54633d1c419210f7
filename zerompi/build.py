"""The one way an engine is built: from what ``initialize`` was given, over a process group, with the
group's services started first. ``initialize`` builds through it, and so does the rebuild over a lost
rank's survivors (recovery/engine.py), so that both engines are made alike."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from zerompi.comm.group import ProcessGroup
from zerompi.config import ZeroConfig
from zerompi.engine import Engine
from zerompi.optim import schedules
from zerompi.services import start_services
from zerompi.shard import deferred


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from (``initialize``'s arguments)."""

    model: nn.Module
    config: ZeroConfig
    param_groups: list[dict[str, Any]] | None = None
    param_init: deferred.ParamInit | None = None
    lr_scheduler: schedules.SchedulerFactory | None = None


def build_engine(spec: EngineSpec, group: ProcessGroup, check: Callable[[], None] | None = None) -> Engine:
    """Collective over ``group``: its watchdog and communication thread as the config says, then the engine.
    ``check`` runs in between: a refusal it raises is reported as the job's failure by the watchdog."""
    start_services(group, spec.config)
    if check is not None:
        check()
    return Engine(spec.model, spec.config, group, spec.param_groups, spec.param_init, spec.lr_scheduler)
