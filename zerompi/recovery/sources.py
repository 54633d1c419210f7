"""Where ``fault_tolerance`` takes a lost rank's state from (``recovery_source``).

A source keeps *recovery points*, the engine's state after a step, taken collectively every
``recovery_every`` steps (and once at ``initialize``). After a failure the survivors agree on
the newest point every one of them holds (``newest``; a point whose taking a failure cut short
is held by some ranks only, so the one before it is kept until the next is whole) and
``restore`` it as something the rebuilt engine loads, resharding N -> M bit for bit.

- :class:`DiskPoints` (``'disk'``): a per-rank checkpoint under ``recovery_dir`` per point,
  written and fsynced, loaded by the engine's ordinary loader: any set of lost ranks is recovered.
- :class:`MemoryPoints` (``'memory'``): each rank's point packed in its own memory
  (checkpoint/replica.py) and a copy in its *buddy*'s, the rank ``N // 2`` places on (so on
  another node when ranks fill nodes in order and a node holds at most half of them). Each point
  costs two copies of a rank's shard state and one exchange of it. Nothing is written, even to
  recover: the survivors holding each old rank's copy serve the new ranks' reads of it
  (checkpoint/held.py). A rank lost together with its buddy cannot be recovered (the job then
  aborts, naming both).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from zerompi.checkpoint import replica
from zerompi.checkpoint.held import HeldCheckpoint
from zerompi.checkpoint.reader import load_held
from zerompi.checkpoint.schema import step_tag as tag
from zerompi.checkpoint.writer import save
from zerompi.comm.group import ProcessGroup
from zerompi.config import CheckpointLayout
from zerompi.config.choices import RecoverySource
from zerompi.errors import CheckpointError, ZeroMPIError, all_ranks_ok


class Points(Protocol):
    def save(self, engine) -> None:
        """Collective: a recovery point of ``engine`` now (between steps)."""

    def settled(self) -> None:
        """Every rank has finished taking the newest point (a collective of the next step ran): older
        points can go."""

    def newest(self) -> tuple[int, int]:
        """(step, recoveries before it was taken) of the newest point this rank holds whole: the survivors
        restore the smallest of theirs, which each of them holds."""

    def restore(self, key: tuple[int, int], survivors: ProcessGroup) -> "Restored":
        """Collective over the survivors: point ``key``, as the rebuilt engine loads it."""

    def resume(self, engine) -> None:
        """Collective over the survivors, once the engine is rebuilt and reloaded: what a second
        failure needs."""

    def close(self) -> None:
        """Rank 0, after the job's last collective: remove what is on disk."""


class Restored(Protocol):
    def load(self, engine) -> None:
        """Collective over the survivors: the point into the engine built over them."""

    def describe(self) -> str:
        """Where the point came from, for the recovery report."""


class OnDisk(NamedTuple):
    root: Path
    tag: str

    def load(self, engine) -> None:
        engine.load_checkpoint(self.root, self.tag)

    def describe(self) -> str:
        return str(self.root / self.tag)


class InMemory(NamedTuple):
    held: HeldCheckpoint

    def load(self, engine) -> None:
        load_held(engine, self.held)

    def describe(self) -> str:
        return f"{self.held.where}, from the survivors' copies (nothing written)"


class DiskPoints:
    """Per-rank checkpoints under ``directory``; the last two are kept (a survivor may not have seen the
    last one complete)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.saved: list[int] = []

    def save(self, engine) -> None:
        engine.wait_checkpoint()
        steps = engine.stats.steps
        save(engine, self.directory, tag(steps), layout=CheckpointLayout.PER_RANK)
        self.saved = [*self.saved[-1:], steps]
        if engine.group.rank == 0:
            for old in self.directory.glob("step*"):
                if old.name < tag(self.saved[0]):
                    shutil.rmtree(old, ignore_errors=True)

    def settled(self) -> None:
        pass  # a file point costs nothing in memory: the older one goes at the next save

    def newest(self) -> tuple[int, int]:
        return self.saved[-1], 0

    def restore(self, key: tuple[int, int], survivors: ProcessGroup) -> OnDisk:
        self.saved = [key[0]]
        return OnDisk(self.directory, tag(key[0]))

    def resume(self, engine) -> None:
        pass  # the files reshard to any group

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _Point(NamedTuple):
    step: int
    generation: int       # recoveries before it was taken (its group: the job's, or the survivors' of one)
    rank: int             # this process's rank in the group that took it
    world_size: int
    own: torch.Tensor     # this rank's state, packed
    held: torch.Tensor    # the packed state of rank (rank - offset) mod world_size


def buddy_offset(world_size: int) -> int:
    """How far a rank's copy travels: half the job, so a node's ranks keep their copies on another node."""
    return max(1, world_size // 2)


def coverage_problem(shards: int, offered: list[list[int]], replicated: bool = False) -> str | None:
    """What is wrong with the replicas the survivors offer (``offered[i]``: the old shard ranks survivor
    i holds for the recovery), or None when each of the ``shards`` is offered, and exactly once unless
    ``replicated`` (hsdp: every node's ranks hold the same shards, so more than one may offer one)."""
    count = [0] * shards
    for ranks in offered:
        for r in ranks:
            count[r] += 1
    missing = [r for r, c in enumerate(count) if c == 0]
    twice = [r for r, c in enumerate(count) if c > 1 and not replicated]
    if not (missing or twice):
        return None
    by = {r: [i for i, ranks in enumerate(offered) if r in ranks] for r in twice}
    return "; ".join(filter(None, [
        f"no survivor holds old rank(s) {missing}" if missing else "",
        ", ".join(f"old rank {r} is held by survivors {by[r]}" for r in twice)]))


class MemoryPoints:
    """Packed points in memory, each rank's copied onto its buddy (module docstring)."""

    def __init__(self, directory: Path):
        self.directory = directory  # names the points' saves; nothing is written under it
        self.points: list[_Point] = []  # the last two; after a recovery, one of the group before it
        self.restored = 0  # recoveries so far

    def save(self, engine) -> None:
        engine.wait_checkpoint()
        group = engine.group
        own = replica.take(engine, f"{self.directory.name}-{self.restored}-{engine.stats.steps}")
        held = group.shift(own, buddy_offset(group.size), what="the recovery point's copy for the buddy rank")
        self.points = [*self.points[-1:], _Point(engine.stats.steps, self.restored, group.rank, group.size, own, held)]

    def settled(self) -> None:
        del self.points[:-1]

    def newest(self) -> tuple[int, int]:
        return self.points[-1].step, self.points[-1].generation

    def restore(self, key: tuple[int, int], survivors: ProcessGroup) -> InMemory:
        step = key[0]
        point = next((p for p in self.points if (p.step, p.generation) == key), None)
        if point is None:  # the agreement guarantees it is held; say so if it is not
            raise ZeroMPIError(f"fault_tolerance: the recovery point of step {step} (after {key[1]} recoveries) "
                               f"is not held here (held: {[(p.step, p.generation) for p in self.points]})")
        alive = survivors.allgather_object(point.rank)
        lost = sorted(set(range(point.world_size)) - set(alive))
        offset = buddy_offset(point.world_size)
        orphans = [(r, (r + offset) % point.world_size) for r in lost if (r + offset) % point.world_size in lost]
        if orphans:
            raise ZeroMPIError("fault_tolerance (recovery_source='memory'): rank(s) " + ", ".join(
                f"{r} (whose copy rank {b} held)" for r, b in orphans) + " were lost together with the ranks "
                "holding their copies; recovery_source='disk' survives that")
        self.restored += 1
        mine = [point.own] + ([point.held] if (point.rank - offset) % point.world_size in lost else [])
        error, offered = None, []
        try:
            offered = [replica.unpack(packed) for packed in mine]
        except CheckpointError as e:
            error = str(e)
        all_ranks_ok(survivors, error, ZeroMPIError)
        held = HeldCheckpoint(survivors, offered, step)
        problem = coverage_problem(held.files, held.offered_by, held.files < point.world_size)
        if problem:  # every survivor sees the same lists, so all raise together instead of a load waiting
            raise ZeroMPIError(f"fault_tolerance: the recovery point of step {step} was not rebuilt: {problem}")
        return InMemory(held)

    def resume(self, engine) -> None:
        self.save(engine)  # the survivors' own point, with buddies among themselves

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def points_for(source: RecoverySource, directory: Path) -> Points:
    return MemoryPoints(directory) if source == RecoverySource.MEMORY else DiskPoints(directory)
