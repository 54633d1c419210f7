"""``deepspeed.zero``: ``Init`` (build a model without holding it whole) and ``GatheredParameters``.

``Init`` puts every parameter a module registers on the meta device (buffers stay real:
the engine keeps them whole), so that ``initialize`` materialises the model bucket by
bucket (zerompi/shard/deferred.py). The initial values then come from each module's
``reset_parameters()`` (or ``initialize(param_init=...)``), not from the constructors, and
differ from an eager build's, as DeepSpeed's do from a single process's.

``GatheredParameters(params, modifier_rank)`` gives the full parameters inside the block,
on every rank; with ``modifier_rank`` set, the values that rank holds on leaving become
every rank's (in an engine: its fp32 master and what it computes with). Collective: every
rank enters it with the same parameters, in any order (a set's differs per process: they are
exchanged in the model's order, or zero.Init's registration order before ``initialize``).
Before ``initialize``, a parameter still on the meta device is made real first: its module's
``reset_parameters()``, or zeros for a module without one when the block writes them
(transformers' ``from_pretrained`` loads the weights so, as into DeepSpeed's partitions).
Parameters keep their Python attributes through all of it (transformers marks loaded ones).
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from zerompi.compat.deepspeed import comm
from zerompi.compat.deepspeed.engine import DeepSpeedEngine, live_engines
from zerompi.errors import UsageError
from zerompi.shard.deferred import reset_parameters

__all__ = ["GatheredParameters", "Init"]

# A meta parameter's module, kept on the parameter (a weak reference *to* it would stop the
# engine's materialisation from swapping it in place).
_OWNER = "_zerompi_meta_owner"
_ORDER = "_zerompi_meta_order"  # the registration order under zero.Init: the same on every rank
_REGISTERED = itertools.count()


def swap_in(param: nn.Parameter, new: torch.Tensor) -> None:
    """``torch.utils.swap_tensors`` that leaves ``param`` its Python attributes (swap_tensors swaps those too)."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, new)
    param.__dict__.update(attributes)


class Init:
    """Context manager: modules built inside keep their parameters on the meta device.

    DeepSpeed's keywords that place or partition parameters (``remote_device``,
    ``pin_memory``, ``config_dict_or_path``, ``dtype``, ...) are the config's business here and
    are accepted; ``module`` (a model already built) leaves nothing to defer. Model- and
    sequence-parallel groups do not exist in zerompi and are refused.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True, dtype: Any = None,
                 mpu: Any = None, zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group: Any = None,
                 param_swapper: Any = None):
        parallel = {"mpu": mpu, "zero_param_parallel_group": zero_param_parallel_group,
                    "sequence_data_parallel_group": sequence_data_parallel_group}
        given = [k for k, v in parallel.items() if v is not None]
        if given:
            raise UsageError(f"zero.Init({', '.join(given)}=...): zerompi is data parallel only")
        self.enabled = enabled and module is None
        self._original = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._original = nn.Module.register_parameter
            nn.Module.register_parameter = _on_meta(self._original)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._original is not None:
            nn.Module.register_parameter = self._original
            self._original = None


def _on_meta(register):
    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # an already-meta one may be tied elsewhere: keep it
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved
            setattr(moved, _OWNER, weakref.ref(module))
            setattr(moved, _ORDER, next(_REGISTERED))
    return register_parameter


def _as_list(params: Any) -> list[nn.Parameter]:
    items = [params] if isinstance(params, torch.Tensor) else list(params) if isinstance(params, Iterable) else []
    out, seen = [], set()
    for p in items:
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _engine_of(params: list[nn.Parameter]) -> DeepSpeedEngine | None:
    ids = {id(p) for p in params}
    owners = [e for e in live_engines() if any(id(p) in ids for p in e.module.parameters())]
    if len(owners) > 1:
        raise UsageError("GatheredParameters: these parameters belong to several engines; gather each apart")
    return owners[0] if owners else None


@contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """Collective: the full ``params`` inside the block; ``modifier_rank``'s changes kept on leaving."""
    params = _as_list(params)
    if not enabled or not params:
        yield
        return
    engine = _engine_of(params)
    if engine is None:
        _materialise(params, writing=modifier_rank is not None)
        yield
        if modifier_rank is not None:
            for p in sorted(params, key=lambda q: getattr(q, _ORDER, -1)):  # zero.Init's order, not the caller's
                comm.broadcast(p.data, modifier_rank)
        return
    with torch.no_grad():
        gathered = _Gathered(engine, params)
    yield
    with torch.no_grad():
        gathered.leave(modifier_rank)


@contextmanager
def _generators_kept() -> Iterator[None]:
    """torch's global generators (the CPU's, and CUDA's where initialised) as they were on entry: values drawn
    for the user (reset_parameters) must not move what the user draws next, as DeepSpeed keeps them too (a
    ZeRO-3 from_pretrained, then get_peft_model, must start LoRA where a plain run does)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _materialise(params: list[nn.Parameter], writing: bool) -> None:
    """Parameters zero.Init left on the meta device: real, initialised by their module's reset_parameters(),
    or zeros where it has none and the block writes them (``writing``); torch's generators are kept."""
    with _generators_kept():
        _make_real(params, writing)


def _make_real(params: list[nn.Parameter], writing: bool) -> None:
    owners = {}
    for p in params:
        if p.is_meta:
            ref = getattr(p, _OWNER, None)
            owner = ref() if ref is not None else None
            if owner is None:
                raise UsageError("GatheredParameters: a parameter on the meta device that zero.Init did not "
                                 "register; build the model under deepspeed.zero.Init, or for real")
            owners[id(owner)] = owner
    for owner in owners.values():
        resets = getattr(owner, "reset_parameters", None) is not None
        if not (resets or writing):
            raise UsageError(f"GatheredParameters: {type(owner).__name__} has parameters on the meta device and no "
                             "reset_parameters(), and the block only reads them (modifier_rank=None): nothing "
                             "gives them values")
        for p in owner.parameters(recurse=False):
            if p.is_meta:  # swapped in place: the Parameter object (tied uses, param groups) stays
                swap_in(p, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        if resets:
            with torch.no_grad():
                reset_parameters(owner)


class _Gathered:
    """An engine's parameters made whole for the block, and written back from one rank after it."""

    def __init__(self, engine: DeepSpeedEngine, params: list[nn.Parameter]):
        self.engine = engine.engine
        wanted = {id(p) for p in params}
        self.slots = []  # (the bucket's collectives, trains, index, slot, param, its bound view)
        sharded = self.engine.sharded
        for c in sharded.all_collectives:
            b = c.bucket
            hits = [(s, p) for s, p in zip(b.layout.slots, b.params) if id(p) in wanted]
            if not hits:
                continue
            full = c.full_params() if c.plan.shard_params else None  # collective
            for s, p in hits:
                self.slots.append((c, b.trains, b.layout.index, s, p, p.data))
                # a copy for the block, so that changes reach the engine only through leave()
                p.data = full[s.offset:s.offset + s.numel].view(s.shape).clone() if full is not None \
                    else p.data.clone()
        bucketed = {id(entry[4]) for entry in self.slots}
        order = {id(p): k for k, p in enumerate(self.engine.module.parameters())}
        # replicated: already whole; in the model's order, whatever order the caller's collection had
        self.plain = sorted((p for p in params if id(p) not in bucketed), key=lambda p: order.get(id(p), -1))

    def leave(self, modifier_rank: int | None) -> None:
        group = self.engine.group
        if modifier_rank is not None:
            for p in self.plain + [entry[4] for entry in self.slots]:
                flat = p.data.contiguous().view(-1)
                group.broadcast(flat, modifier_rank, kind="script", what="GatheredParameters")
                p.data.copy_(flat.view(p.shape))
        new = {id(p): p.data.detach().clone() for *_, p, _view in self.slots}
        for *_, p, view in self.slots:
            p.data = view
        if modifier_rank is None:
            return
        buckets: dict[tuple[bool, int], list] = {}
        for b, trains, i, s, p, _ in self.slots:
            buckets.setdefault((trains, i), []).append((b, s, new[id(p)]))
        for (trains, i), entries in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
            self._write(trains, i, entries)

    def _write(self, trains: bool, index: int, entries: list) -> None:
        """Put the new values into bucket ``index``'s shards (collective over its group)."""
        collectives = entries[0][0]
        own = slice(collectives.bucket.own.start, collectives.bucket.own.stop)
        if not trains:
            full = collectives.full_params()
            for _, s, value in entries:
                full[s.offset:s.offset + s.numel] = value.reshape(-1).to(full.dtype)
            self.engine.sharded.load_frozen(index, full[own])
            return
        optimizer = self.engine.optimizer
        with optimizer.resident(index) as master:
            full = collectives.full_master()
            for _, s, value in entries:
                full[s.offset:s.offset + s.numel] = value.reshape(-1).float()
            master.copy_(full[own])
            collectives.publish()
