"""The engine side of ``fault_tolerance=True``: recovery points, and the rebuild after a lost rank.

Recovery source: the last *recovery point* plus a replay of the steps since.
Every ``recovery_every`` optimizer steps (and once at ``initialize``) the engine's state
is kept, in memory with a copy on a buddy rank or as files (sources.py). When a rank
dies, whatever engine verb of a survivor notices it (forward, backward, step, a save
or load) turns the MPI error into :class:`RankLost`, and :meth:`FaultTolerance.recover`:

1. revokes every communicator of the engine (peers still inside one leave it too);
2. shrinks the engine's communicator to the survivors (ULFM agrees on who failed);
3. tears the old engine down without communicating, and rebuilds it in place
   (``Engine.__init__`` on the same object) over the survivors, from a copy of the
   model taken at ``initialize``, with the same param groups and schedulers;
4. loads the newest recovery point every survivor holds (as a per-rank checkpoint:
   checkpoints reshard N -> M, bitwise), takes a new point over the survivors, logs
   what it did, and raises :class:`Recovered`.

The loop then goes on from ``engine.stats.steps``; ``micro_batch_indices()`` deals the
same ``micro_batches`` over the survivors, so the global batch is unchanged and, with
``reproducible=True``, the replayed steps give the bits of the steps lost (without it, the
same micro-batches summed in the survivors' order).
A failure during the recovery itself starts it again over the ranks left.
"""
from __future__ import annotations

import copy
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zerompi.comm import ulfm
from zerompi.comm.mpi import MPIGroup
from zerompi.checkpoint.rawio import WriteOptions
from zerompi.engine import Engine
from zerompi.errors import Recovered, UsageError, ZeroMPIError
from zerompi.log import get_logger
from zerompi.recovery.sources import points_for
from zerompi.services import start_services

logger = get_logger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    """What one recovery did (also logged by the new rank 0)."""

    lost: tuple[int, ...]          # ranks of the engine's group before the failure that are gone
    lost_world: tuple[int, ...]    # the same processes' ranks in MPI_COMM_WORLD
    during: str                    # the verb that noticed: forward, backward, step, save_checkpoint, ...
    at_step: int                   # optimizer steps completed when it was noticed
    ranks_before: int
    ranks_after: int
    source: str                    # the recovery checkpoint loaded
    resumed_at: int                # its step: the loop goes on from here
    seconds: float                 # from the error to the rebuilt, reloaded engine

    def describe(self) -> str:
        ranks = ", ".join(f"{r} (world rank {w})" for r, w in zip(self.lost, self.lost_world))
        return (f"lost rank(s) {ranks} during {self.during} after step {self.at_step}; "
                f"{self.ranks_before} -> {self.ranks_after} ranks; reloaded {self.source} (step {self.resumed_at}, "
                f"{self.at_step - self.resumed_at} step(s) to replay) in {self.seconds:.3f} s")


class ResilientEngine(Engine):
    """The engine ``initialize`` builds with ``fault_tolerance=True``: its verbs (forward, backward, step,
    save/load, ``all_reduce_mean``) turn a lost rank into a rebuild over the survivors and
    :class:`Recovered`; ``close`` also removes the recovery checkpoints."""

    def __init__(self, module, cfg, group, param_groups=None, param_init=None, lr_scheduler=None):
        spare = _prepare(cfg, group, module, param_groups)
        super().__init__(module, cfg, group, param_groups, param_init, lr_scheduler)
        self.recovery = FaultTolerance(self, spare, param_init, lr_scheduler, _directory(self))
        """Recovery checkpoints, and the rebuild after a lost rank (kept across rebuilds)."""

    def __call__(self, *args, **kwargs):
        return self.recovery.run(self, "forward", super().__call__, *args, **kwargs)

    def backward(self, loss) -> None:
        self.recovery.run(self, "backward", super().backward, loss)
        self.recovery.points.settled()  # its round's reduction ran on every rank: the last point is whole

    def step(self) -> bool:
        return self.recovery.run(self, "step", self._step_and_save)

    def _step_and_save(self) -> bool:
        """The step, then the recovery checkpoint it is due: a rank lost in either is recovered from."""
        stepped = super().step()
        self.recovery.after_step(self)
        return stepped

    def save_checkpoint(self, *args, **kwargs) -> str:
        return self.recovery.run(self, "save_checkpoint", super().save_checkpoint, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs) -> Any:
        return self.recovery.run(self, "load_checkpoint", super().load_checkpoint, *args, **kwargs)

    def all_reduce_mean(self, value: float) -> float:
        return self.recovery.run(self, "all_reduce_mean", super().all_reduce_mean, value)

    def close(self) -> None:
        super().close()
        if self.group.rank == 0:  # after the job's last collective
            self.recovery.close()


class FaultTolerance:
    """Recovery checkpoints of one engine and its rebuild after a lost rank (module docstring)."""

    def __init__(self, engine, spare: Any, param_init, lr_scheduler, directory: Path):
        self.spare = spare  # (model, param_groups) as given to initialize, deep-copied together
        self.param_init, self.lr_scheduler = param_init, lr_scheduler
        self.directory = directory
        self.points = points_for(engine.config.recovery_source, directory,
                                 WriteOptions.from_policy(engine.config.checkpointing))
        self.reports: list[RecoveryReport] = []
        self.points.save(engine)

    # ---- the engine's verbs -------------------------------------------------
    def run(self, engine, during: str, verb: Callable, *args, **kwargs):
        """``verb(*args, **kwargs)``; a lost rank noticed inside it is recovered from (raises Recovered)."""
        try:
            out = verb(*args, **kwargs)
        except Recovered:
            raise
        except BaseException as e:
            lost = ulfm.rank_lost(e, _groups(engine))
            if lost is None:
                raise
            self.recover(engine, during, lost)  # raises Recovered
        return out

    # ---- recovery points --------------------------------------------------
    def after_step(self, engine) -> None:
        steps = engine.stats.steps
        if steps % engine.config.recovery_every == 0 and steps > self.points.newest()[0]:
            self.points.save(engine)

    def close(self) -> None:
        """Rank 0 removes the recovery files (after the job's last collective)."""
        self.points.close()

    # ---- recovery ---------------------------------------------------------
    def recover(self, engine, during: str, error: BaseException) -> None:
        start, at_step, before = time.monotonic(), engine.stats.steps, engine.group.size
        group: MPIGroup = engine.group
        logger.warning("rank %d of %d: a rank was lost during %s after step %d (%s); recovering",
                       group.rank, group.size, during, at_step, error)
        lost, lost_world = [], []
        handled = sys.exc_info()[1]  # what run() caught: every error raised from here on carries it
        _teardown(engine)
        while True:
            ulfm.revoke(_groups(engine))
            survivors, gone, gone_world = ulfm.shrink(group)
            lost += gone
            lost_world += gone_world
            if survivors.size < engine.config.min_ranks:
                raise ZeroMPIError(f"fault_tolerance: {survivors.size} rank(s) left after losing world rank(s) "
                                   f"{lost_world}, fewer than min_ranks={engine.config.min_ranks}: giving up")
            try:
                step, source = self._rebuild(engine, survivors)
                break
            except BaseException as e:
                again = ulfm.rank_lost(e, [survivors], since=handled)
                if again is None:
                    raise
                logger.warning("another rank was lost during the recovery (%s); recovering again", again)
                _teardown(engine)
                group = survivors
        report = RecoveryReport(tuple(lost), tuple(lost_world), during, at_step, before, engine.group.size,
                                source, step, time.monotonic() - start)
        self.reports.append(report)
        if engine.group.rank == 0:
            logger.warning("fault_tolerance: %s", report.describe())
        raise Recovered(report.describe(), report)

    def _rebuild(self, engine, survivors: MPIGroup) -> tuple[int, str]:
        """Collective over the survivors: the engine rebuilt over them, its state reloaded and a new point
        taken; returns the step reloaded and where it came from."""
        key = min(survivors.allgather_object(self.points.newest()))
        root, tag = self.points.restore(key, survivors)
        module, param_groups = copy.deepcopy(self.spare)
        cfg = engine.config
        start_services(survivors, cfg)  # watched and progressed as initialize did the job's group
        Engine.__init__(engine, module, cfg, survivors, param_groups, self.param_init, self.lr_scheduler)
        engine.load_checkpoint(root, tag)
        self.points.resume(engine)
        return key[0], self.points.describe(root / tag)


def _directory(engine) -> Path:
    """Collective: the recovery directory every rank agrees on (a fresh name under ``recovery_dir``,
    else under rank 0's temporary directory)."""
    cfg, group = engine.config, engine.group
    name = group.allgather_object(uuid.uuid4().hex[:12] if group.rank == 0 else None)[0]
    if cfg.recovery_dir is not None:
        return Path(cfg.recovery_dir) / f"job-{name}"
    base = group.allgather_object(tempfile.gettempdir() if group.rank == 0 else None)[0]
    return Path(base) / f"zerompi-recovery-{name}"


def _prepare(cfg, group, model, param_groups) -> Any:
    """Before the engine is built: refuse where ULFM is missing (on every rank: the reason is the same)
    and keep a copy of the model and its param groups to rebuild from."""
    if not isinstance(group, MPIGroup):
        raise UsageError("fault_tolerance=True needs an MPI communicator (comm=), not another process group")
    problem = ulfm.support_error()
    if problem is not None:
        raise ZeroMPIError(f"fault_tolerance=True cannot survive a lost rank here: {problem}")
    ulfm.prepare(group)
    return copy.deepcopy((model, param_groups))


def _groups(engine) -> list[Any]:
    groups = engine.__dict__.get("groups")
    found = [engine.group]
    if groups is not None:
        found += [g for g in (groups.world, groups.shard, groups.gather, groups.replicate, groups.secondary) if g]
    return found


def _teardown(engine) -> None:
    """Stop what the engine runs, without a collective (peers are gone): hooks, watchdog, comm thread."""
    saving, engine.__dict__["_saving"] = engine.__dict__.get("_saving"), None
    if saving is not None:  # an asynchronous save in flight is abandoned: it is never published
        saving.abandon("a rank was lost before every writer finished")
    for stop in (lambda: engine.sharded.remove_hooks(), engine.group.stop_watchdog, engine.group.stop_comm_thread,
                 lambda: engine.optimizer.close(), lambda: engine.swapper is not None and engine.swapper.close()):
        try:
            stop()
        except Exception as e:  # noqa: BLE001 - a broken engine is being dropped
            logger.debug("fault_tolerance: teardown: %s", e)
