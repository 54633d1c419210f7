"""The engine side of ``fault_tolerance=True``: recovery points, and the rebuild after a lost rank.

Recovery source: the last *recovery point* plus a replay of the steps since.
Every ``recovery_every`` optimizer steps (and once at ``initialize``) the engine's state
is kept, in memory with a copy on a buddy rank or as files (sources.py). When a rank
dies, whatever engine verb of a survivor notices it (every public method of the engine runs through
one guarded entry: forward, backward and its begin/end halves, step, a save or load,
full_state_dict, ...) hands the MPI error to :meth:`FaultTolerance.recover`, which:

1. revokes every communicator of the engine (peers still inside one leave it too);
2. shrinks the engine's communicator to the survivors (ULFM agrees on who failed);
3. drops the old engine without communicating (``Engine.close(abandon=True)``) and builds a
   new one over the survivors with ``build_engine``, as ``initialize`` built the first, from a
   copy of the model taken at ``initialize``, with the same param groups and schedulers;
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
import dataclasses
import functools
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from zerompi.build import EngineSpec, build_engine
from zerompi.comm import guard, ulfm
from zerompi.comm.mpi import MPIGroup
from zerompi.engine import Engine
from zerompi.errors import Recovered, UsageError, ZeroMPIError
from zerompi.implicit import ImplicitBackward
from zerompi.log import get_logger
from zerompi.recovery.sources import points_for

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


def _present_engine(cls: type) -> type:
    """Give ``cls`` Engine's interface, member by member, at class creation: each public method it does not
    define runs through its one guarded entry (``_guarded``), each public property and declared attribute
    (``Engine.ATTRIBUTES``) reads the current engine's. Explicit to ``dir``, ``help`` and ``inspect``, and a
    verb added to Engine is covered without editing recovery."""
    def verb(name: str) -> Callable:
        @functools.wraps(getattr(Engine, name))
        def guarded(self, *args, **kwargs):
            return self._guarded(name, *args, **kwargs)
        return guarded

    def current(name: str, doc: str | None) -> property:
        return property(lambda self: getattr(self.current, name), doc=doc)

    own = set(vars(cls)) | set(cls.OWN)
    for name, value in vars(Engine).items():
        if name.startswith("_") or name in own:
            continue
        setattr(cls, name, current(name, value.__doc__) if isinstance(value, property) else verb(name))
    for name in set(Engine.ATTRIBUTES) - own:
        setattr(cls, name, current(name, f"The current engine's ``{name}``."))
    return cls


@_present_engine
class ResilientEngine:
    """The engine ``initialize`` builds with ``fault_tolerance=True``: a supervisor around the :class:`Engine`
    of the moment (``current``), presenting the engine's interface explicitly (``_present_engine``). Every
    public method of the engine is run through one guarded entry, so a lost rank noticed inside any of them
    becomes a rebuild over the survivors and :class:`Recovered`; attributes and properties are the current
    engine's. ``close`` also removes the recovery points."""

    OWN = ("current", "recovery", "implicit")  # set by __init__: its own, not the current engine's

    def __init__(self, spec: EngineSpec, group):
        if not isinstance(group, MPIGroup):
            raise UsageError("fault_tolerance=True needs an MPI communicator (comm=), not another process group")
        spare = copy.deepcopy((spec.model, spec.param_groups))  # to rebuild from, before the engine moves it
        self.current: Engine = build_engine(spec, group, check=lambda: _require_ulfm(group))
        """The engine now: rebuilt over the survivors by each recovery."""
        self.recovery = FaultTolerance(self.current, spec, spare, _directory(self.current))
        """Recovery points, and the rebuild after a lost rank (kept across rebuilds)."""
        self.implicit = ImplicitBackward(self.begin_backward, self.end_backward)
        """A script's ``loss.backward()`` as the guarded backward (implicit.py)."""

    def _guarded(self, name: str, *args, **kwargs):
        return self.recovery.run(self, name, lambda engine: getattr(engine, name)(*args, **kwargs))

    def __call__(self, *args, **kwargs):
        return self.recovery.run(self, "forward", lambda engine: engine(*args, **kwargs))

    @functools.wraps(Engine.backward)
    def backward(self, loss, *, window_share: bool = True) -> None:
        self._guarded("backward", loss, window_share=window_share)
        self.recovery.points.settled()  # its round's reduction ran on every rank: the last point is whole

    @functools.wraps(Engine.end_backward)
    def end_backward(self, ok: bool) -> None:
        self._guarded("end_backward", ok)
        if ok:
            self.recovery.points.settled()

    @functools.wraps(Engine.step)
    def step(self) -> bool:
        return self.recovery.run(self, "step", self._step_and_point)

    def _step_and_point(self, engine: Engine) -> bool:
        """The step, then the recovery point it is due: a rank lost in either is recovered from."""
        stepped = engine.step()
        self.recovery.after_step(engine)
        return stepped

    @functools.wraps(Engine.close)
    def close(self) -> None:
        self.current.close()
        if self.current.group.rank == 0:  # after the job's last collective
            self.recovery.close()


class FaultTolerance:
    """Recovery checkpoints of one engine and its rebuild after a lost rank (module docstring)."""

    def __init__(self, engine: Engine, spec: EngineSpec, spare: Any, directory: Path):
        self.spec = spec
        self.spare = spare  # (model, param_groups) as given to initialize, deep-copied together
        self.directory = directory
        self.points = points_for(engine.config.recovery.source, directory)
        self.reports: list[RecoveryReport] = []
        self.points.save(engine)

    # ---- the guarded entry ------------------------------------------------------
    def run(self, supervisor: ResilientEngine, during: str, call: Callable[[Engine], Any]):
        """``call(engine)`` on the current engine; a lost rank noticed inside it is recovered from
        (raises Recovered naming ``during``)."""
        engine = supervisor.current
        try:
            out = call(engine)
        except Recovered:
            raise
        except BaseException as e:
            lost = ulfm.rank_lost(e, _groups(engine))
            if lost is None:
                raise
            self.recover(supervisor, during, lost)  # raises Recovered
        return supervisor if out is engine else out  # train(), eval(): the supervisor, not the engine inside

    # ---- recovery points --------------------------------------------------
    def after_step(self, engine) -> None:
        steps = engine.stats.steps
        if steps % engine.config.recovery.every == 0 and steps > self.points.newest()[0]:
            self.points.save(engine)

    def close(self) -> None:
        """Rank 0 removes the recovery files (after the job's last collective)."""
        self.points.close()

    # ---- recovery ---------------------------------------------------------
    def recover(self, supervisor: ResilientEngine, during: str, error: BaseException) -> None:
        engine = supervisor.current
        start, at_step, before = time.monotonic(), engine.stats.steps, engine.group.size
        group: MPIGroup = engine.group
        logger.warning("rank %d of %d: a rank was lost during %s after step %d (%s); recovering",
                       group.rank, group.size, during, at_step, error)
        lost, lost_world = [], []
        handled = sys.exc_info()[1]  # what run() caught: every error raised from here on carries it
        engine.close(abandon=True)
        revoke = _groups(engine)
        while True:
            ulfm.revoke(revoke)
            survivors, gone, gone_world = ulfm.shrink(group)
            lost += gone
            lost_world += gone_world
            if survivors.size < engine.config.recovery.min_ranks:
                # the hook aborts over the survivors: no hang report or abort over a group with dead ranks
                guard.hand_over(survivors)
                raise ZeroMPIError(f"fault_tolerance: {survivors.size} rank(s) left after losing world rank(s) "
                                   f"{lost_world}, fewer than min_ranks={engine.config.recovery.min_ranks}: giving up")
            built: list[Engine] = []
            try:
                step, source = self._rebuild(survivors, built)
                break
            except BaseException as e:
                again = ulfm.rank_lost(e, [survivors], since=handled)
                if again is None:
                    guard.hand_over(survivors)
                    raise
                logger.warning("another rank was lost during the recovery (%s); recovering again", again)
                for partial in built:  # built, then lost while loading its state
                    partial.close(abandon=True)
                revoke = _groups(built[0]) if built else [survivors]
                group = survivors
        supervisor.current = built[0]
        guard.hand_over(built[0].group)  # a later uncaught error: its hang report and abort over the survivors
        report = RecoveryReport(tuple(lost), tuple(lost_world), during, at_step, before, survivors.size,
                                source, step, time.monotonic() - start)
        self.reports.append(report)
        if survivors.rank == 0:
            logger.warning("fault_tolerance: %s", report.describe())
        raise Recovered(report.describe(), report)

    def _rebuild(self, survivors: MPIGroup, built: list[Engine]) -> tuple[int, str]:
        """Collective over the survivors: an engine built over them (appended to ``built``), its state
        reloaded and a new point taken; returns the step reloaded and where it came from."""
        key = min(survivors.allgather_object(self.points.newest()))
        point = self.points.restore(key, survivors)
        module, param_groups = copy.deepcopy(self.spare)
        engine = build_engine(dataclasses.replace(self.spec, model=module, param_groups=param_groups), survivors)
        built.append(engine)
        point.load(engine)
        self.points.resume(engine)
        return key[0], point.describe()


def _directory(engine) -> Path:
    """Collective: the recovery directory every rank agrees on (a fresh name under ``recovery_dir``,
    else under rank 0's temporary directory)."""
    cfg, group = engine.config, engine.group
    name = group.allgather_object(uuid.uuid4().hex[:12] if group.rank == 0 else None)[0]
    if cfg.recovery.directory is not None:
        return Path(cfg.recovery.directory) / f"job-{name}"
    base = group.allgather_object(tempfile.gettempdir() if group.rank == 0 else None)[0]
    return Path(base) / f"zerompi-recovery-{name}"


def _require_ulfm(group: MPIGroup) -> None:
    """Refuse where ULFM is missing (on every rank: the reason is the same), else prepare the group."""
    problem = ulfm.support_error()
    if problem is not None:
        raise ZeroMPIError(f"fault_tolerance=True cannot survive a lost rank here: {problem}")
    ulfm.prepare(group)


def _groups(engine: Engine) -> list[Any]:
    """The engine's communicators, which a recovery revokes."""
    g = engine.groups
    return [engine.group] + [c for c in (g.world, g.shard, g.gather, g.replicate, g.secondary) if c]
