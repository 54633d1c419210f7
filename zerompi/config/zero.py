"""Configuration of a zerompi engine: one frozen, validated :class:`ZeroConfig`.

Every value is checked once, in ``__post_init__``, so the rest of the package
can trust it; a bad value raises :class:`ConfigError` naming the key, the value
and what is allowed. A config comes from keyword arguments, a plain dict
(``from_dict``), a TOML or JSON file (``from_file``) or a DeepSpeed JSON config
(``from_deepspeed``), translated key by key: what zerompi lacks is refused, never ignored.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import numbers
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from zerompi.errors import ConfigError

_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEVICES = ("auto", "cpu", "cuda")
_CUDA_AWARE = ("auto", "on", "off")
_OFFLOAD = ("none", "cpu", "nvme")
# Optimizer arguments the engine fills from fields (``lr`` alone for other optimizers);
# repeating one in optimizer_kwargs would be a second spelling of the same setting.
_ADAM_ARGS = ("lr", "betas", "eps", "weight_decay")
_FIELD_ARGS = {"adamw": _ADAM_ARGS, "adam": _ADAM_ARGS, "sgd": ("lr", "momentum", "weight_decay")}


def _choices(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def _int(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
    # bool is an int subclass, but True as a step count is always a mistake.
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{key}={value!r} is not an int {rng}")
    return int(value)


def _float(key: str, value: Any, *, gt: float | None = None, ge: float | None = None,
           lt: float | None = None) -> float:
    bounds = [f"{op} {b}" for op, b in ((">", gt), (">=", ge), ("<", lt)) if b is not None]
    try:  # an int beyond the float range is no number a config can mean
        finite = isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and finite and (gt is None or value > gt)
            and (ge is None or value >= ge) and (lt is None or value < lt)):
        raise ConfigError(f"{key}={value!r} is not a finite number {' and '.join(bounds)}")
    return float(value)


def _ge0(key: str, value: Any) -> float:
    return _float(key, value, ge=0)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {_choices(allowed)}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a bool (true or false)")
    return value


def _offload(key: str, value: Any) -> str:
    return _choice(key, value, _OFFLOAD)


def _block_kib(key: str, value: Any) -> int:
    value = _int(key, value, 4, 256 * 1024)
    if value % 4:
        raise ConfigError(f"{key}={value!r} is not a multiple of 4 KiB (O_DIRECT needs page-aligned I/O)")
    return value


def _check_offload(cfg) -> None:
    """Cross-field rules of offloading, checked after every field is valid."""
    if cfg.offload_optimizer != "none" and cfg.stage == 0:
        raise ConfigError(f"offload_optimizer={cfg.offload_optimizer!r} needs a sharded optimizer: "
                          "stage=0 is not allowed; allowed: stage 1, 2 or 3")
    if cfg.offload_params != "none" and cfg.stage != 3:
        raise ConfigError(f"offload_params={cfg.offload_params!r} needs sharded parameters: "
                          f"stage={cfg.stage} is not allowed; allowed: stage 3")
    if "nvme" in (cfg.offload_optimizer, cfg.offload_params) and cfg.nvme_path is None:
        raise ConfigError("nvme_path=None: offloading to 'nvme' needs a directory for the swap files")


def _betas(key: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ConfigError(f"{key}={value!r} is not a pair of finite numbers >= 0 and < 1")
    b1, b2 = (_float(f"{key}[{i}]", b, ge=0, lt=1) for i, b in enumerate(value))
    return (b1, b2)


def _optional(key: str, value: Any, check: Callable[[str, Any], Any], none_means: str) -> Any:
    if value is None:
        return None
    try:
        return check(key, value)
    except ConfigError as e:
        raise ConfigError(f"{e}, or None ({none_means})") from None


def _path(key: str, value: Any) -> str:
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}={value!r} is not a non-empty path string")
    return path


def _optimizer_kwargs(key: str, value: Any) -> dict:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}={value!r} is not a dict with str keys")
    return dict(value)


def _import_dotted(key: str, path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # an import can fail in any way; report it as a config error
        raise ConfigError(f"{key}={path!r} cannot be imported as 'package.module.ClassName': "
                          f"{type(e).__name__}: {e}") from None


def _resolve_optimizer(key: str, value: Any) -> type[torch.optim.Optimizer]:
    if isinstance(value, str) and value in _OPTIMIZERS:
        return _OPTIMIZERS[value]
    if isinstance(value, str) and "." in value:
        cls = _import_dotted(key, value)
    elif isinstance(value, type):
        cls = value
    else:
        raise ConfigError(f"{key}={value!r} is not one of {_choices(_OPTIMIZERS)}, a subclass of "
                          "torch.optim.Optimizer, or a dotted path 'package.module.ClassName'")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer):
        raise ConfigError(f"{key}={value!r} resolves to {cls!r}, which is not a subclass of "
                          "torch.optim.Optimizer; allowed: " + _choices(_OPTIMIZERS)
                          + ", an Optimizer subclass or a dotted path to one")
    return cls


# One checker per field, called as check(key, value) -> normalised value. The
# key is a parameter so that from_deepspeed reports errors under DeepSpeed's names.
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "stage": lambda k, v: _int(k, v, 0, 3),
    # Kept as given (not the resolved class), so to_dict writes back what the user wrote.
    "optimizer": lambda k, v: _resolve_optimizer(k, v) and v,
    "optimizer_kwargs": _optimizer_kwargs,
    "lr": lambda k, v: _float(k, v, gt=0),
    "betas": _betas,
    "eps": lambda k, v: _float(k, v, gt=0),
    "weight_decay": _ge0,
    "momentum": _ge0,
    "grad_accum_steps": lambda k, v: _int(k, v, 1),
    # 0 is stored as None: one spelling for "no clipping" downstream.
    "clip_grad_norm": lambda k, v: _optional(k, v, _ge0, "no clipping") or None,
    "dtype": lambda k, v: _choice(k, v, _DTYPES),
    "loss_scale": _ge0,
    "initial_scale_power": lambda k, v: _int(k, v, 0, 64),
    "loss_scale_window": lambda k, v: _int(k, v, 1),
    "hysteresis": lambda k, v: _int(k, v, 1),
    "min_loss_scale": lambda k, v: _float(k, v, gt=0),
    "bucket_mb": lambda k, v: _float(k, v, gt=0),
    "seed": lambda k, v: _int(k, v, 0),
    "cpu_threads": lambda k, v: _optional(k, v, lambda k, v: _int(k, v, 1), "automatic"),
    "device": lambda k, v: _choice(k, v, _DEVICES),
    "cuda_aware_mpi": lambda k, v: _choice(k, v, _CUDA_AWARE),
    "offload_optimizer": _offload,
    "offload_params": _offload,
    "nvme_path": lambda k, v: _optional(k, v, _path, "no NVMe directory"),
    "pin_memory": _bool,
    "nvme_block_kib": _block_kib,
    "nvme_threads": lambda k, v: _int(k, v, 1, 64),
    "nvme_buffers": lambda k, v: _int(k, v, 1, 1024),
    "nvme_verify": _bool,
    "overlap_grad_reduce": _bool,
    "prefetch_units": lambda k, v: _int(k, v, 0, 8),
    "mpi_progress": lambda k, v: _choice(k, v, ("none", "test", "thread")),
    "hierarchy": lambda k, v: _choice(k, v, ("flat", "hsdp", "hpz")),
    "ranks_per_node": lambda k, v: _optional(k, v, lambda k, v: _int(k, v, 1), "nodes from MPI"),
    "nonfinite": lambda k, v: _choice(k, v, ("raise", "skip")),
    "debug_collectives": _bool,
    "collective_timeout": lambda k, v: _optional(k, v, lambda k, v: _float(k, v, gt=0), "no watchdog"),
    "abort_on_exception": _bool,
    "checkpoint_layout": lambda k, v: _choice(k, v, ("auto", "per_rank", "shared")),
}


def _reject_unknown(keys: Iterable[Any], allowed: list[str], what: str) -> None:
    unknown = sorted(str(k) for k in keys if k not in allowed)
    if unknown:
        raise ConfigError(f"unknown {what}: {', '.join(unknown)}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True, eq=False)
class ZeroConfig:
    """Validated settings of a ZeRO data-parallel engine (see each field's docstring).

    Equality compares the resolved optimizer class, so a config equals its own
    ``from_dict(to_dict())`` round trip even when built from a class object.
    """

    stage: int = 3
    """0 plain data parallel; 1 shards optimizer state + fp32 master; 2 + grads; 3 + params."""
    optimizer: str | type[torch.optim.Optimizer] = "adamw"
    """'adamw', 'adam', 'sgd', an Optimizer subclass or 'package.module.ClassName' to one."""
    optimizer_kwargs: dict = field(default_factory=dict)
    """Extra optimizer arguments; str keys other than 'params' and those set by fields."""
    lr: float = 1e-3
    """Learning rate, finite and > 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam coefficients, each in [0, 1); a list of two numbers becomes a tuple."""
    eps: float = 1e-8
    """Adam denominator term, > 0."""
    weight_decay: float = 0.01
    """Weight decay, >= 0."""
    momentum: float = 0.0
    """SGD momentum, >= 0."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed before each optimizer step, >= 1."""
    clip_grad_norm: float | None = None
    """Global gradient norm limit, > 0; None disables clipping (0 is stored as None)."""
    dtype: str = "fp32"
    """Parameter/gradient compute dtype: 'fp32', 'bf16', 'fp16'; master weights are fp32."""
    loss_scale: float = 0.0
    """fp16 only: 0 selects dynamic loss scaling, > 0 is a static scale."""
    initial_scale_power: int = 16
    """Dynamic loss scaling starts at 2**initial_scale_power; 0..64."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles, >= 1."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves, >= 1."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale, > 0."""
    bucket_mb: float = 25.0
    """MiB of gradients per communication bucket at stages 0-2. At stage 3 a module becomes
    a gather unit once its subtree's parameters not claimed by a smaller unit reach this."""
    seed: int = 0
    """Random seed, >= 0."""
    cpu_threads: int | None = None
    """Torch threads per rank on CPU, >= 1; None gives each rank its share of the cores."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'."""
    cuda_aware_mpi: str = "auto"
    """Device buffers straight to MPI: 'auto' (when torch.cuda and the MPI report support), 'on' or 'off'."""
    offload_optimizer: str = "none"
    """Stages 1-3: where fp32 master weights and optimizer state live between steps:
    'none' (with the parameters), 'cpu' (host memory; the update runs on the CPU) or
    'nvme' (swap files under nvme_path, streamed in bucket by bucket during the step)."""
    offload_params: str = "none"
    """Stage 3: where the parameter shards live between gathers: 'none', 'cpu' or 'nvme'."""
    nvme_path: str | None = None
    """Directory for the per-rank swap files of 'nvme' offload (a local disk)."""
    pin_memory: bool = True
    """Pin host buffers used for offload (when a GPU is present)."""
    nvme_block_kib: int = 8192
    """KiB per swap I/O request, a multiple of 4 in 4..262144."""
    nvme_threads: int = 4
    """Swap I/O threads (requests in flight), 1..64."""
    nvme_buffers: int = 8
    """Page-aligned staging buffers of nvme_block_kib each: the bound on swap staging memory, 1..1024."""
    nvme_verify: bool = True
    """CRC-32 of every swapped block, checked when it is read back."""
    overlap_grad_reduce: bool = False
    """Start each bucket's gradient reduce-scatter non-blocking as soon as backward has filled it,
    and wait for all of them when backward ends (stages 1-3), instead of reducing in place."""
    prefetch_units: int = 0
    """Stage 3: gather this many gather units ahead, non-blocking (0 = gather on demand, up to 8);
    the order is recorded on the first step. With offload_params='nvme' the units' shards are
    read from the swap file this many units ahead (0 there means 1)."""
    mpi_progress: str = "none"
    """How non-blocking collectives progress while Python computes: 'none' (by the MPI library
    alone; with MPICH, MPIR_CVAR_ASYNC_PROGRESS=1 adds a progress thread), 'test' (MPI_Test
    from every gradient hook) or 'thread' (one communication thread per process runs every
    collective as a blocking call, in issue order; needs MPI_THREAD_MULTIPLE). See
    benchmarks/results/overlap.md for what each costs."""
    hierarchy: str = "flat"
    """'flat': shard over all ranks; 'hsdp' (stages 1-3): shard within a node and replicate across
    nodes; 'hpz' (stage 3): flat shards plus a secondary parameter copy sharded within each node,
    so forward/backward all-gathers stay inside the node (ZeRO++). See topology.py."""
    ranks_per_node: int | None = None
    """Ranks per node for 'hsdp'/'hpz': None takes nodes from MPI (shared memory); a number
    groups consecutive ranks, e.g. to emulate several nodes on one machine."""
    nonfinite: str = "raise"
    """A NaN/Inf gradient in fp32/bf16: 'raise' (naming rank and parameter) or 'skip' the step
    on every rank. fp16 always skips and lowers the loss scale."""
    debug_collectives: bool = False
    """Before every collective, check that all ranks are at the same operation, bucket and
    size, and raise naming the module if not (one extra small all-gather each). Also on
    when the environment sets ZEROMPI_DEBUG=1."""
    collective_timeout: float | None = None
    """Seconds a rank may wait in one collective before the watchdog reports what it was
    waiting on and aborts the job; None disables the watchdog."""
    abort_on_exception: bool = True
    """Install a sys.excepthook that prints an uncaught exception once and calls MPI_Abort,
    so one failing rank ends the job instead of hanging the others."""
    checkpoint_layout: str = "auto"
    """'per_rank': save_checkpoint writes one HDF5 file per rank plus index.h5; 'shared': one
    shards.h5 written collectively through h5py's mpio driver (needs h5py built with MPI);
    'auto': shared when h5py has MPI, else per_rank. Both load at any world size."""

    def __post_init__(self) -> None:
        # Field order, so the first problem reported is the first field's; the
        # cross-field check comes last as it relies on the checked fields.
        for f in fields(self):
            object.__setattr__(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))
        _check_offload(self)
        taken = ("params", *_FIELD_ARGS.get(self.optimizer, ("lr",)))
        clash = [k for k in taken if k in self.optimizer_kwargs]
        if clash:
            raise ConfigError(f"optimizer_kwargs={self.optimizer_kwargs!r} sets {_choices(clash)}, "
                              f"which the engine or the fields set for optimizer={self.optimizer!r}"
                              f"; allowed: any str key but {_choices(taken)}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ZeroConfig):
            return NotImplemented
        return self._identity() == other._identity()

    def _identity(self) -> tuple:
        return tuple(self.optimizer_class() if f.name == "optimizer" else getattr(self, f.name)
                     for f in fields(self))

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim.Optimizer subclass that ``optimizer`` names."""
        return _resolve_optimizer("optimizer", self.optimizer)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch.dtype."""
        return _DTYPES[self.dtype]

    def bucket_numel(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes that fit in one bucket of ``bucket_mb`` MiB (>= 1)."""
        if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
            raise ValueError(f"itemsize={itemsize!r} is not an int >= 1")
        return max(1, int(self.bucket_mb * 2**20 // itemsize))

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict that from_dict accepts and JSON can hold."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.optimizer, type):
            out["optimizer"] = f"{self.optimizer.__module__}.{self.optimizer.__qualname__}"
        out["betas"] = list(self.betas)
        out["optimizer_kwargs"] = copy.deepcopy(self.optimizer_kwargs)
        return out

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied and validated."""
        _reject_unknown(changes, [f.name for f in fields(self)], "config keys")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Build from a mapping of field names to values; unknown keys are refused."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config={d!r} is not a mapping of config keys to values")
        _reject_unknown(d, [f.name for f in fields(cls)], "config keys")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike, table: str | None = None) -> ZeroConfig:
        """Read a .toml or .json file, or one top-level ``table`` of it; DeepSpeed
        configs are recognised and go through from_deepspeed."""
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path={path!r} is not a file path")
        path = Path(path)
        doc, where = _load_document(path), str(path)
        if table is not None:
            if not isinstance(table, str) or table not in doc:
                raise ConfigError(f"table={table!r} is not in {where}; its top-level "
                                  f"keys are: {', '.join(doc) or '(none)'}")
            doc, where = doc[table], f"{where} [{table}]"
            if not isinstance(doc, Mapping):
                raise ConfigError(f"{where}: table={table!r} holds {doc!r}, not a table")
        from zerompi.config.deepspeed import looks_like_deepspeed
        deepspeed = looks_like_deepspeed(doc)
        try:
            return cls.from_deepspeed(doc) if deepspeed else cls.from_dict(doc)
        except ConfigError as e:
            how = " (read as a DeepSpeed config)" if deepspeed else ""
            raise ConfigError(f"{where}{how}: {e}") from None

    @classmethod
    def from_deepspeed(cls, d: Mapping[str, Any], **overrides: Any) -> ZeroConfig:
        """Translate a DeepSpeed JSON config; ``overrides`` are field values applied on top.

        Keys zerompi cannot honour are all listed in one ConfigError. Left-out settings
        take DeepSpeed's defaults where they change training (stage 0; no weight decay
        in a given optimizer block), else ZeroConfig's."""
        from zerompi.config.deepspeed import deepspeed_kwargs  # the translation tables live apart
        if not isinstance(d, Mapping):
            raise ConfigError(f"DeepSpeed config={d!r} is not a mapping")
        _reject_unknown(overrides, [f.name for f in fields(cls)], "from_deepspeed overrides")
        kwargs = deepspeed_kwargs(d)
        kwargs.update(overrides)
        return cls(**kwargs)


def _load_document(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {str(path)!r} has extension {path.suffix!r}, "
                          "which is not one of '.toml', '.json'")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    try:
        doc = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests tables or lists too deeply to be a config") from None
    except ValueError as e:  # TOMLDecodeError and JSONDecodeError both derive from it
        kind = suffix[1:].upper()
        raise ConfigError(f"config file {str(path)!r} is not valid {kind}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {str(path)!r} holds a {type(doc).__name__}, not a table")
    return doc
