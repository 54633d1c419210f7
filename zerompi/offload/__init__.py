"""Offload of shards and optimizer state out of device and host memory.

:class:`NVMeSwapper` keeps flat CPU tensors in one file per rank and moves
them with asynchronous, page-aligned block I/O; :class:`SwapConfig` says how.
Tensors from :func:`aligned_empty` skip the staging copy. :func:`open_swapper`,
:func:`swap_out_bucket` (as each bucket is built) and :func:`attach` (once the
optimizer exists) wire an engine to the swap file its config asks for.
"""
from zerompi.offload.aligned import aligned_empty, return_freed_memory
from zerompi.offload.nvme import NVMeSwapper, SwapConfig
from zerompi.offload.residency import InMemory, NVMeResidency, ParamSwap

__all__ = ["InMemory", "NVMeResidency", "NVMeSwapper", "ParamSwap", "SwapConfig", "aligned_empty", "attach",
           "open_swapper", "swap_out_bucket"]


def open_swapper(cfg, rank: int) -> NVMeSwapper | None:
    """This rank's swap file when the config offloads anything to 'nvme'."""
    if "nvme" not in (cfg.offload_optimizer, cfg.offload_params):
        return None
    return_freed_memory()  # shards stream through memory: what is freed must leave the process
    return NVMeSwapper(cfg.nvme_path, rank, SwapConfig(
        block_bytes=cfg.nvme_block_kib * 1024, threads=cfg.nvme_threads, buffers=cfg.nvme_buffers,
        verify=cfg.nvme_verify))


def swap_out_bucket(swapper: NVMeSwapper, cfg, bucket) -> None:
    """Called as each bucket is built: its parameter shard and master go to the swap file before
    the next bucket exists, so that building the model holds one bucket's state, not the model's.

    'cpu' offload needs nothing: the bucket already placed them in host memory.
    """
    if cfg.offload_params == "nvme":
        bucket.param_swap = ParamSwap(swapper, f"b{bucket.layout.index}.param", bucket.param_shard)
    if cfg.offload_optimizer == "nvme":
        NVMeResidency.swap_out_master(swapper, bucket)
        if cfg.stage >= 2:  # the gradient shard goes where the optimizer state is (ZeRO-Infinity)
            bucket.grad_swap = ParamSwap(swapper, f"b{bucket.layout.index}.grad", bucket.grad_shard)


def attach(engine, cfg, swapper: NVMeSwapper | None) -> None:
    """After the optimizer exists: let its state stream through the swap file ('nvme')."""
    if swapper is not None and cfg.offload_optimizer == "nvme":
        engine.optimizer.store = NVMeResidency(engine.sharded.buckets, engine.optimizer.inner, swapper)
