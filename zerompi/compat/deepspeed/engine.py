"""DeepSpeed's engine object: the methods and attributes a training loop uses, over a zerompi Engine.

A thin wrapper rather than an Engine subclass, so that DeepSpeed's spellings
(``save_checkpoint`` returning True, ``load_checkpoint`` returning a pair, batch-size
getters) never change what :class:`zerompi.Engine` answers; the zerompi engine is
``.engine``. ``config`` is the DeepSpeed config document, as on DeepSpeed's engine; any other
attribute falls through to the wrapped module (``engine.gradient_checkpointing_enable()``).
"""
from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerompi.checkpoint import schema
from zerompi import export
from zerompi.compat.deepspeed import parameter_offload, param_status
from zerompi.compat.deepspeed.batch import Batch
from zerompi.compat.deepspeed.timer import ThroughputTimer
from zerompi.config import DType
from zerompi.engine import Engine
from zerompi.errors import UsageError

__all__ = ["DeepSpeedEngine", "live_engines"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # open engines, for zero.GatheredParameters to find a parameter's


def live_engines() -> list[DeepSpeedEngine]:
    """The engines built and not yet closed in this process."""
    return list(_LIVE)


class DeepSpeedEngine:
    """The DeepSpeed engine methods a training loop uses, answered by a zerompi :class:`Engine`."""

    def __init__(self, engine: Engine, batch: Batch, gather_16bit_on_save: bool = False,
                 training_dataloader: Any = None, config: Mapping | None = None):
        self.engine = engine
        """The zerompi engine underneath."""
        self.config = dict(config or {})
        """The DeepSpeed config document it was built from (``engine.config["zero_optimization"]``)."""
        self.training_dataloader = training_dataloader
        """The loader ``initialize(training_data=...)`` built (None without one)."""
        self._batch = batch
        self._gather_16bit = gather_16bit_on_save  # stage3_gather_16bit_weights_on_model_save
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._step_applied = False
        self._no_sync = False
        self.tput_timer = ThroughputTimer(batch.train)
        """Started by each forward, stopped by each step(), as DeepSpeed's (timer.py)."""
        param_status.mark(engine)  # stage 3: p.ds_status, which TRL reads before gathering a weight
        parameter_offload.mark(engine)  # stage 3: what TRL's generation takes the module hooks off through
        _LIVE.add(self)

    # ---- training ---------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward (floating inputs go to the engine's device and compute dtype). Its
        outputs carry gradient hooks, so that ``loss.backward()`` works as ``engine.backward(loss)``."""
        self.engine.implicit.abandon()
        self.tput_timer.start()
        return self.engine.implicit.watch(self.engine(*args, **kwargs), before=self._check_no_sync)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of this rank's mean micro-batch loss, scaled by 1/accumulation as DeepSpeed does, or
        not with ``scale_wrt_gas=False`` (transformers' Trainer, whose loss is already the window's share)."""
        if retain_graph:
            raise UsageError("backward(retain_graph=True) is not supported: the engine frees gathered "
                             "parameters and reduces gradients as backward runs")
        if not scale_wrt_gas and self.engine.iteration.micro is not None:
            raise UsageError("backward(scale_wrt_gas=False) with micro_batches: each micro-batch's share is 1/G")
        self._check_no_sync()
        self.engine.backward(loss, window_share=scale_wrt_gas)
        return loss

    def _check_no_sync(self) -> None:
        if self._no_sync:
            raise UsageError("backward() inside no_sync(): zerompi reduces gradients in every backward and "
                             "counts a window's micro-batches by step(); accumulate with the config's "
                             "gradient_accumulation_steps and call step() after each backward instead")

    def step(self, lr_kwargs: Mapping | None = None) -> None:
        """Call after every backward: updates at the end of each accumulation window."""
        if lr_kwargs:
            raise UsageError(f"step(lr_kwargs={lr_kwargs!r}) is not supported: the scheduler steps by itself")
        if self._no_sync:
            raise UsageError("step() inside no_sync() (DeepSpeed refuses it too)")
        self.engine.implicit.abandon()
        boundary = self.is_gradient_accumulation_boundary()
        if self._boundary is not None and boundary != self.engine.iteration.complete:
            raise UsageError(f"step() with set_gradient_accumulation_boundary({boundary}) after "
                             f"{self.engine.iteration.done} backward call(s) of a window of {self._batch.accum} "
                             "(the config's gradient_accumulation_steps): they must agree")
        self._step_applied = self.engine.step()
        self.tput_timer.stop(global_step=boundary)

    @property
    def micro_steps(self) -> int:
        """step() calls since the engine was built or loaded, as DeepSpeed counts them for the
        accumulation boundary (the engine's iteration machine counts them)."""
        return self.engine.iteration.step_calls

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch's step() ends the accumulation window (and updates): as
        ``set_gradient_accumulation_boundary`` last said, else as the engine's iteration machine says."""
        if self._boundary is not None:
            return self._boundary
        return self.engine.iteration.boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's override for loops that call step() once per window (accelerate's): whether the
        coming backward ends the window. step() checks it against the window the engine counted."""
        self._boundary = bool(is_boundary)

    def was_step_applied(self) -> bool:
        """Whether the latest step() changed the parameters (False inside a window, or on an fp16 overflow)."""
        return self._step_applied

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's context without gradient reduction. Forward and evaluation inside change
        nothing; a backward inside would, since zerompi cannot hold it back from the window
        (it raises), and step() is refused there as DeepSpeed refuses it."""
        if self._no_sync:
            raise UsageError("no_sync() inside no_sync() (DeepSpeed refuses re-entry too)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def zero_grad(self) -> None:
        """Nothing to do: the engine's step consumes the reduced gradients, and the next window
        starts from zero (kept so scripts that call it run unchanged)."""

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def __getattr__(self, name: str) -> Any:
        """Anything else is the module's (``gradient_checkpointing_enable``, ``config``), as in DeepSpeed."""
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(engine.module, name)
        except AttributeError:
            raise AttributeError(f"neither DeepSpeedEngine nor {type(engine.module).__name__} has "
                                 f"attribute {name!r}") from None

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's parameters under ``module.``, as DeepSpeed's engine (an nn.Module holding it) names them."""
        return self.module.named_parameters(prefix=prefix + ("." if prefix else "") + "module", recurse=recurse)

    # ---- what a loop asks -------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def local_rank(self) -> int:
        return self.engine.local_rank

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, fp16 overflow skips included (as DeepSpeed counts)."""
        stats = self.engine.stats
        return stats.steps + stats.skipped_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed by those steps: ``global_steps * train_batch_size()``, as DeepSpeed counts."""
        return self.global_steps * self.train_batch_size()

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the latest update, before clipping (None before the first)."""
        return self.engine.stats.last_grad_norm

    def fp16_enabled(self) -> bool:
        return self.engine.config.dtype == DType.FP16

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.dtype == DType.BF16

    def zero_optimization_stage(self) -> int:
        return int(self.engine.config.stage)

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def gradient_accumulation_steps(self) -> int:
        return self._batch.accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch_value(self._batch.micro, "train_micro_batch_size_per_gpu")

    def train_batch_size(self) -> int:
        return self._batch_value(self._batch.train, "train_batch_size")

    def _batch_value(self, value: int | None, key: str) -> int:
        if value is None:
            raise UsageError(f"{key} is unknown: the config gives neither train_batch_size nor "
                             "train_micro_batch_size_per_gpu as a number (left out or 'auto')")
        return value

    # ---- checkpoints ------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> bool:
        """Collective: a zerompi checkpoint under ``save_dir/tag`` (default ``global_step{N}``, as
        DeepSpeed names it); ``client_state`` must be JSON-serialisable; ``exclude_frozen_parameters``
        leaves the frozen base out (``include_frozen=False``). Returns True. ``async_save`` (zerompi's)
        writes it on a background thread (Engine.save_checkpoint); ``wait_checkpoint()``."""
        if not save_latest:
            raise UsageError("save_checkpoint(save_latest=False) is not supported: zerompi always points "
                             "'latest' at the new checkpoint")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        save_dir, tag = self._agreed_place(save_dir, tag)
        self.engine.save_checkpoint(save_dir, tag, client_state if client_state is not None else {},
                                    include_frozen=not exclude_frozen_parameters, async_save=async_save)
        return True

    def _agreed_place(self, save_dir, tag: str) -> tuple[str, str]:
        """Rank 0's directory and tag. DeepSpeed writes each rank's files under the directory that rank
        names, so a script may name one per rank (e.g. from the clock, a second apart); a zerompi
        checkpoint is one directory that every rank writes into, so the ranks take rank 0's, and say so."""
        places = self.engine.group.allgather_object((str(save_dir), str(tag)))
        if len(set(places)) > 1 and self.engine.rank == 0:
            others = sorted({f"{d}/{t}" for d, t in places[1:] if (d, t) != places[0]})
            warnings.warn(f"save_checkpoint: the ranks named different places ({', '.join(others[:3])}"
                          f"{' ...' if len(others) > 3 else ''}); every rank writes into rank 0's, "
                          f"{places[0][0]}/{places[0][1]}", stacklevel=3)
        return places[0]

    def wait_checkpoint(self) -> None:
        """Collective: wait for an asynchronous save (zerompi's Engine.wait_checkpoint)."""
        self.engine.wait_checkpoint()

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, Any]:
        """Collective: load ``load_dir/tag`` (``latest`` when None) at any world size; returns
        (its path, client_state), or (None, None) when ``tag`` is None and nothing was saved."""
        if not (load_module_strict and load_optimizer_states and load_lr_scheduler_states) or load_module_only:
            raise UsageError("load_checkpoint loads the whole state: the strict/optimizer/scheduler/module-only "
                             "switches are not supported (zerompi.checkpoint.load_full_state_dict reads the "
                             "weights alone)")
        latest = Path(load_dir) / schema.LATEST
        if tag is None:
            if not latest.exists():
                return None, None
            tag = latest.read_text().strip()
        client_state = self.engine.load_checkpoint(load_dir, tag)  # a new accumulation window
        return os.path.join(os.fspath(load_dir), tag), client_state

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: rank 0 writes the whole model in the compute dtype as safetensors (zerompi/export.py).
        At stage 3 only with ``stage3_gather_16bit_weights_on_model_save``, as DeepSpeed: otherwise it
        warns and writes nothing. Returns whether it wrote."""
        export.check_name(save_filename)
        if self.engine.config.stage == 3 and not self._gather_16bit:
            warnings.warn("save_16bit_model at stage 3 writes nothing unless the config sets "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (as in DeepSpeed)",
                          stacklevel=2)
            return False
        export.save_16bit(self.engine, save_dir, save_filename, exclude_frozen_parameters)
        return True

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the module's state dict, every parameter whole, in the compute dtype (zerompi/export.py)."""
        if destination is not None or keep_vars:
            raise UsageError("module_state_dict(destination=, keep_vars=True) is not supported: it returns "
                             "gathered copies")
        return export.state_dict_16bit(self.engine, prefix, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether the config sets ``stage3_gather_16bit_weights_on_model_save`` (accelerate asks at stage 3)."""
        return self._gather_16bit

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Collective: the whole model's state dict in the compute dtype on rank 0, None on the others
        (DeepSpeed's answer, which accelerate's and transformers' savers take at stage 3)."""
        out = export.state_dict_16bit(self.engine, "", exclude_frozen_parameters)
        return out if self.global_rank == 0 else None

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """Collective: ``module_state_dict`` under ``module.``, as DeepSpeed's engine names it."""
        return self.module_state_dict(destination, prefix + "module.", keep_vars)

    def close(self) -> None:
        _LIVE.discard(self)
        self.engine.close()

    def destroy(self) -> None:
        """Release what the engine holds (DeepSpeed's spelling of close)."""
        self.close()


