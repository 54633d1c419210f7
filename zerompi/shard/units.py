"""Stage 3's gather units: a module whose forward gathers its buckets (their collectives, driven together),
and which module owns each parameter (the deepest one containing every module that holds it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from zerompi.shard.layout import common_ancestor

if TYPE_CHECKING:
    from zerompi.shard.collectives import BucketCollectives


@dataclass
class Unit:
    """Stage 3: a module whose forward gathers its buckets and releases them after: ``members``, the
    collectives of its buckets (collectives.py), which it drives together.

    ``entries`` are the modules whose forward gathers the unit: the unit's module and the
    callable modules between it and the deepest module holding all of its parameters. So a
    wrapper's inner model, called directly (``PeftModel.generate`` runs the base model's
    forward, not the wrapper's), still gathers what the wrapper's unit holds. The outermost
    entry running (``active``) gathers and releases; nested entries find it gathered.
    """

    fqn: str
    module: nn.Module
    entries: list[nn.Module] = field(default_factory=list)
    members: list[BucketCollectives] = field(default_factory=list)
    active: nn.Module | None = None

    @property
    def numel(self) -> int:
        """Elements its buckets hold gathered (the prefetcher's measure)."""
        return sum(c.bucket.layout.padded_numel for c in self.members)

    def prefetch(self) -> None:
        """Start its buckets' gathers (or their shards' reads from the swap file)."""
        for c in self.members:
            c.prefetch()

    def release(self, frozen_only: bool = False) -> None:
        """Free its gathered parameters (``frozen_only``: those of its frozen buckets, once its backward ran)."""
        for c in self.members:
            if not (frozen_only and c.bucket.trains):
                c.reshard()

    @property
    def has_frozen(self) -> bool:
        return any(not c.bucket.trains for c in self.members)


def owners_of(module: nn.Module, params: list[nn.Parameter]) -> dict[nn.Parameter, str]:
    """The deepest module containing every module that holds each parameter.

    A tied parameter (embedding = LM head) is held by two modules; gathering it
    with their common ancestor keeps it available to both.
    """
    wanted = {id(p) for p in params}
    holders: dict[int, list[str]] = {}
    for fqn, m in module.named_modules():
        for p in m.parameters(recurse=False):
            if id(p) in wanted:
                holders.setdefault(id(p), []).append(fqn)
    return {p: common_ancestor(holders[id(p)]) for p in params}
