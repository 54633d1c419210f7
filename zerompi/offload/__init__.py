"""Offload of shards and optimizer state out of device and host memory.

:class:`NVMeSwapper` keeps flat CPU tensors in one file per rank and moves
them with asynchronous, page-aligned block I/O; :class:`SwapConfig` says how.
Tensors from :func:`aligned_empty` skip the staging copy. :func:`attach`
wires an engine's buckets and optimizer to the swap file its config asks for.
"""
from zerompi.offload.aligned import aligned_empty
from zerompi.offload.nvme import NVMeSwapper, SwapConfig
from zerompi.offload.residency import InMemory, NVMeResidency, ParamSwap

__all__ = ["InMemory", "NVMeResidency", "NVMeSwapper", "ParamSwap", "SwapConfig", "aligned_empty", "attach"]


def attach(engine, cfg) -> NVMeSwapper | None:
    """Open this rank's swap file when the config offloads to 'nvme', and move state into it.

    'cpu' offload needs nothing here: the buckets already placed master
    weights (and stage-3 parameter shards) in host memory.
    """
    if "nvme" not in (cfg.offload_optimizer, cfg.offload_params):
        return None
    swapper = NVMeSwapper(cfg.nvme_path, engine.rank, SwapConfig(
        block_bytes=cfg.nvme_block_kib * 1024, threads=cfg.nvme_threads, buffers=cfg.nvme_buffers,
        verify=cfg.nvme_verify))
    if cfg.offload_params == "nvme":
        for b in engine.sharded.buckets:
            b.param_swap = ParamSwap(swapper, f"b{b.layout.index}.param", b.param_shard)
    if cfg.offload_optimizer == "nvme":
        engine.optimizer.store = NVMeResidency(engine.sharded.buckets, engine.optimizer.inner, swapper)
    return swapper
