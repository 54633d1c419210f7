"""Pure planning of flat buffers: which parameter lives where, and who owns what.

No MPI, no allocation: functions of names, shapes and sizes, unit-tested on
their own. A bucket is a flat buffer of parameters padded to a multiple of
the world size; rank r owns the contiguous shard ``[r*S, (r+1)*S)``. For an
optimizer that sees whole tensors a bucket is owner-aligned instead: each
parameter lies whole in one rank's shard, with padding between the shards. Every
slot records its parameter's offset, so any shard can be described in
parameter coordinates (:meth:`BucketLayout.pieces`), which is what makes
checkpoints independent of the world size that wrote them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence


class ParamSpec(NamedTuple):
    """What planning needs to know about a parameter."""

    fqn: str
    shape: tuple[int, ...]
    group: int  # optimizer param group; buckets never mix groups


class ParamSlot(NamedTuple):
    """Where one parameter lives inside its bucket."""

    fqn: str
    shape: tuple[int, ...]
    numel: int
    offset: int


class Piece(NamedTuple):
    """The part of one parameter that falls inside a shard.

    ``param_start`` is the offset into the flattened parameter, ``local_start``
    the offset into the shard, ``numel`` the length of the overlap.
    """

    fqn: str
    param_start: int
    local_start: int
    numel: int


@dataclass(frozen=True)
class ShardRange:
    """A half-open range ``[start, stop)`` of a bucket's flat buffer."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` holding ``numel`` elements (at least one per rank)."""
    return max(1, math.ceil(numel / world_size)) * world_size


@dataclass(frozen=True)
class BucketLayout:
    """Frozen plan of one bucket: its slots, its padded size and its shards."""

    index: int
    group: int
    slots: tuple[ParamSlot, ...]
    numel: int
    padded_numel: int
    world_size: int
    unit: str = ""  # stage 3: fully qualified name of the module whose forward gathers it
    owned: bool = False  # owner-aligned (plan_owned_bucket): each shard's parameters, then padding
    trainable: bool = True  # False: stage 3's frozen parameters (a shard of values; no gradient or state)

    @property
    def used(self) -> tuple[int, ...] | None:
        """An owner-aligned bucket's live elements per rank, at the front of each shard: its collectives
        carry only those (comm/group.py's ``used``), so padding never travels. None for a flat bucket,
        whose padding is a few elements at the end."""
        if not self.owned:
            return None
        counts = [0] * self.world_size
        for slot in self.slots:
            counts[slot.offset // self.shard_numel] += slot.numel
        return tuple(counts)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard(self, rank: int) -> ShardRange:
        s = self.shard_numel
        return ShardRange(rank * s, (rank + 1) * s)

    @property
    def full(self) -> ShardRange:
        return ShardRange(0, self.padded_numel)

    def pieces(self, rng: ShardRange) -> list[Piece]:
        """The parameters overlapping ``rng``, in parameter coordinates (padding excluded)."""
        out = []
        for slot in self.slots:
            lo = max(rng.start, slot.offset)
            hi = min(rng.stop, slot.offset + slot.numel)
            if lo < hi:
                out.append(Piece(slot.fqn, lo - slot.offset, lo - rng.start, hi - lo))
        return out


def _make_bucket(index: int, group: int, specs: Sequence[ParamSpec], world_size: int,
                 unit: str, align: int = 1, trainable: bool = True) -> BucketLayout:
    slots, offset = [], 0
    for spec in specs:
        numel = math.prod(spec.shape)
        slots.append(ParamSlot(spec.fqn, tuple(spec.shape), numel, offset))
        offset += numel
    return BucketLayout(index, group, tuple(slots), offset, padded_numel(offset, world_size * align),
                        world_size, unit, trainable=trainable)


def assign_owners(numels: Sequence[int], world_size: int, load: list[int] | None = None) -> tuple[int, ...]:
    """Each tensor's owner rank, balanced by size: largest first (the earlier of equals), each to the
    least loaded rank (the lowest of equals), so that every rank computes the same answer. No rank's
    load exceeds the mean load plus the largest tensor. ``load``: each rank's load so far (the group's
    earlier buckets), updated in place, so that the balance holds over all of them."""
    load = [0] * world_size if load is None else load
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + numels[i]
    return tuple(owner)


def plan_owned_bucket(index: int, group: int, specs: Sequence[ParamSpec], world_size: int,
                      unit: str = "", align: int = 1, load: list[int] | None = None) -> BucketLayout:
    """A bucket in which every parameter lies whole inside one rank's shard, its owner's, for an
    optimizer that must see whole tensors: rank r's shard holds the parameters assigned to r
    (:func:`assign_owners`) in their given order, then padding. The shard size is the largest owner's
    load in this bucket (a multiple of ``align``); ``numel`` counts the parameters' elements, which
    padding now separates. ``load``: as :func:`assign_owners`'."""
    numels = [math.prod(spec.shape) for spec in specs]
    owners = assign_owners(numels, world_size, load)
    here = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world_size)]
    shard = max(1, math.ceil(max(here) / align)) * align
    fill, slots = [r * shard for r in range(world_size)], []
    for spec, n, r in zip(specs, numels, owners):
        slots.append(ParamSlot(spec.fqn, tuple(spec.shape), n, fill[r]))
        fill[r] += n
    slots.sort(key=lambda slot: slot.offset)
    return BucketLayout(index, group, tuple(slots), sum(numels), shard * world_size, world_size, unit, owned=True)


def plan_buckets(specs: Sequence[ParamSpec], world_size: int, cap_numel: int, *,
                 first_index: int = 0, unit: str = "", align: int = 1,
                 whole: frozenset[int] = frozenset(), loads: dict[int, list[int]] | None = None,
                 trainable: bool = True) -> list[BucketLayout]:
    """Cut ``specs`` (in order) into buckets of at most ``cap_numel`` elements.

    Each optimizer group is cut separately; a parameter larger than the cap
    gets a bucket of its own. Buckets come out ordered by their first parameter.
    ``align``: every shard is a multiple of this many elements (reproducible=True's norm chunks).
    ``whole``: groups whose optimizer sees whole tensors: their buckets are owner-aligned
    (:func:`plan_owned_bucket`), balanced over all of a group's buckets (``loads``: each group's
    per-rank loads so far, kept across calls by the caller). ``trainable``: False for stage 3's
    frozen parameters (their buckets are never owner-aligned: nothing steps them).
    """
    loads = {} if loads is None else loads
    if world_size < 1 or cap_numel < 1:
        raise ValueError(f"world_size={world_size} and cap_numel={cap_numel} must be >= 1")
    chunks: list[tuple[int, int, list[ParamSpec]]] = []  # (position of first param, group, params)
    open_chunk: dict[int, tuple[int, list[ParamSpec], int]] = {}
    for pos, spec in enumerate(specs):
        numel = math.prod(spec.shape)
        start, members, size = open_chunk.get(spec.group, (pos, [], 0))
        if members and size + numel > cap_numel:
            chunks.append((start, spec.group, members))
            start, members, size = pos, [], 0
        members.append(spec)
        open_chunk[spec.group] = (start, members, size + numel)
    chunks.extend((start, group, members) for group, (start, members, _) in open_chunk.items())
    chunks.sort(key=lambda c: c[0])
    return [plan_owned_bucket(first_index + i, group, members, world_size, unit, align,
                              loads.setdefault(group, [0] * world_size)) if group in whole else
            _make_bucket(first_index + i, group, members, world_size, unit, align, trainable)
            for i, (_, group, members) in enumerate(chunks)]


# ---- stage 3: which modules gather their parameters -----------------------

def parent_fqn(fqn: str) -> str | None:
    """``"a.b.c" -> "a.b"``, ``"a" -> ""`` (the root), root -> None."""
    if fqn == "":
        return None
    return fqn.rpartition(".")[0]


def descent(outer: str, inner: str) -> list[str]:
    """The modules below ``outer`` down to ``inner`` (its descendant or itself), outermost first:
    ``descent("a", "a.b.c") == ["a.b", "a.b.c"]``, ``descent("", "x") == ["x"]``."""
    if inner == outer:
        return []
    parts = inner.split(".")
    skip = len(outer.split(".")) if outer else 0
    return [".".join(parts[:i]) for i in range(skip + 1, len(parts) + 1)]


def common_ancestor(fqns: Iterable[str]) -> str:
    """The deepest module whose subtree contains every module in ``fqns``."""
    paths = [f.split(".") if f else [] for f in fqns]
    common: list[str] = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def choose_units(modules: Sequence[str], own_numel: dict[str, int], cap_numel: int,
                 callable_modules: set[str] | None = None) -> dict[str, str]:
    """Pick stage-3 gather units and map every module to the unit that gathers its parameters.

    ``modules`` lists every module name ("" is the root), parents before
    children; ``own_numel`` the number of parameter elements assigned to each.
    Walking bottom-up, a module becomes a unit once the elements in its
    subtree not already claimed by a smaller unit reach ``cap_numel``; the
    root is always a unit and takes the rest. Only modules in
    ``callable_modules`` (default: all) can be units: a container such as
    ``nn.ModuleList`` is never called, so its hooks would never fire; when
    such a container reaches the cap, its callable children with unclaimed
    elements become units instead.
    """
    unclaimed = {m: own_numel.get(m, 0) for m in modules}
    units: set[str] = {""}
    children: dict[str, list[str]] = {}
    for m in modules:
        if m:
            children.setdefault(parent_fqn(m), []).append(m)
    for m in sorted(modules, key=lambda f: -len(f.split(".")) if f else 0):
        if not m:
            continue
        if unclaimed[m] >= cap_numel and (callable_modules is None or m in callable_modules):
            units.add(m)
            continue
        if unclaimed[m] >= cap_numel:
            # A container (nn.ModuleList of blocks) that reaches the cap but is never called:
            # its callable children become units, as one would wrap each block, rather than
            # handing a large subtree up to an ancestor that gathers all of it at once.
            for c in children.get(m, []):
                if c not in units and unclaimed[c] > 0 and c in callable_modules:
                    units.add(c)
                    unclaimed[m] -= unclaimed[c]
        unclaimed[parent_fqn(m)] += unclaimed[m]
    mapping = {}
    for m in modules:
        u = m
        while u not in units:
            u = parent_fqn(u)
        mapping[m] = u
    return mapping
