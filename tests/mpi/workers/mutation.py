"""Deliberate breakage of the gradient reduction, to show that the parity bounds catch it.

``mutate(kind)`` wraps the process group's reduce-scatter (every stage's gradient
reduction goes through it; stage 0 as its all-reduce's first half) so that what a
rank receives is scaled by 1 + 1e-3 ('scale'), summed instead of averaged ('sum'),
or, for the model's first bucket, zero ('drop'). Used only by the parity worker's
``--mutate``; the engine itself has no such switch.
"""
from __future__ import annotations

from zerompi.comm.mpi import MPIGroup

MUTATIONS = {
    "scale": lambda out, group, what: out.mul_(1 + 1e-3),
    "sum": lambda out, group, what: out.mul_(group.size),
    "drop": lambda out, group, what: out.zero_() if what.startswith("bucket 0 ") else out,
}


class _Mutated:
    """A collective handle whose result is changed once, when first waited for."""

    def __init__(self, work, change):
        self.work, self.change, self.changed = work, change, False

    def wait(self):
        out = self.work.wait()
        if not self.changed:
            self.change(out)
            self.changed = True
        return out

    def test(self) -> bool:
        return self.work.test()


def mutate(kind: str) -> None:
    original = MPIGroup.reduce_scatter
    change = MUTATIONS[kind]

    def reduce_scatter(self, full, **kwargs):
        work = original(self, full, **kwargs)
        return _Mutated(work, lambda out: change(out, self, kwargs.get("what", "")))
    MPIGroup.reduce_scatter = reduce_scatter
