"""Which process group each collective runs over: flat, HSDP, or ZeRO++ hpZ.

* ``flat``: shard over every rank (the ZeRO paper).
* ``hsdp``: shard within a node, replicate across nodes. Gradients are
  reduce-scattered inside the node and the shards all-reduced across nodes;
  parameter all-gathers never leave the node. Memory is divided by the
  ranks per node instead of the world size.
* ``hpz`` (stage 3): optimizer state, master weights and gradients sharded
  over every rank as in ``flat``, plus a secondary copy of the parameters
  sharded within each node, refreshed once per step; the forward and
  backward all-gathers then stay inside the node.

Nodes are the ranks that share memory (``MPI_COMM_TYPE_SHARED``), or blocks of
``ranks_per_node`` consecutive ranks when that is set (to emulate several
nodes on one machine, or to match a job's real layout when the launcher packs
ranks by node). Every node must have the same number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from zerompi.comm.group import ProcessGroup
from zerompi.config.choices import Hierarchy, Stage
from zerompi.config.sections import TopologyPolicy
from zerompi.errors import ConfigError
from zerompi.comm.launch import RankInfo


@dataclass(frozen=True)
class Groups:
    """The groups one engine communicates over."""

    world: ProcessGroup
    shard: ProcessGroup                    # buckets are sharded over it; gradients reduce-scattered
    gather: ProcessGroup                   # parameters are all-gathered over it
    replicate: ProcessGroup | None = None  # hsdp: shards all-reduced across nodes
    secondary: ProcessGroup | None = None  # hpz: builds the node's secondary parameter copy

    @property
    def hierarchical(self) -> bool:
        return self.replicate is not None or self.secondary is not None

    def secondary_block(self, numel: int) -> slice:
        """hpZ: this rank's block of a ``numel``-element bucket in its node's secondary copy, which
        is sharded over the gather group (the node)."""
        n = numel // self.gather.size
        return slice(self.gather.rank * n, (self.gather.rank + 1) * n)


class NodePlacement(NamedTuple):
    """Where this rank sits among the nodes."""

    node: int
    local_rank: int
    ranks_per_node: int
    nodes: int


def node_placement(info: RankInfo, ranks_per_node: int | None) -> NodePlacement:
    """This rank's node, its rank within it, the ranks per node and the number of nodes."""
    if ranks_per_node is None:
        return NodePlacement(info.node_rank, info.local_rank, info.local_size, info.num_nodes)
    if info.world_size % ranks_per_node:
        raise ConfigError(f"ranks_per_node={ranks_per_node} does not divide the world size "
                          f"{info.world_size}; allowed: a divisor of the world size")
    return NodePlacement(info.rank // ranks_per_node, info.rank % ranks_per_node, ranks_per_node,
                         info.world_size // ranks_per_node)


def build_groups(world: ProcessGroup, info: RankInfo, topology: TopologyPolicy, stage: Stage) -> Groups:
    """Collective: split ``world`` for ``topology.hierarchy`` (flat, hsdp, hpz)."""
    hierarchy, ranks_per_node = topology.hierarchy, topology.ranks_per_node
    if hierarchy == Hierarchy.FLAT:
        return Groups(world, world, world)
    if hierarchy == Hierarchy.HSDP and not stage.shards_optimizer:
        raise ConfigError("hierarchy='hsdp' shards within a node: it needs stage 1, 2 or 3")
    if hierarchy == Hierarchy.HPZ and not stage.shards_params:
        raise ConfigError(f"hierarchy='hpz' is a stage-3 parameter partition; stage={stage}")
    node, local, per_node, nodes = node_placement(info, ranks_per_node)
    sizes = world.allgather_object(per_node)
    if len(set(sizes)) != 1:
        raise ConfigError(f"hierarchy={hierarchy!r} needs the same number of ranks on every node, "
                          f"got {sorted(set(sizes))}; set ranks_per_node to a common divisor")
    intra = world.split(node, local, "intra")
    inter = world.split(local, node, "inter")
    if hierarchy == Hierarchy.HSDP:
        return Groups(world, intra, intra, replicate=inter)
    # hpz: order the primary shards so that node-local rank l's secondary block is made of the
    # primary shards of the ranks (l, node 0..R-1), i.e. one all-gather over the inter group.
    zero = world.split(0, local * nodes + node, "")
    return Groups(world, zero, intra, secondary=inter)
