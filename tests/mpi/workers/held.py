"""Stage 3's gathered frozen parameters inside backward, sampled where a module's backward starts.

Frozen buckets have no gradient hook: a unit's frozen part is released once the gradients of
the unit's inputs exist. So when the gradient of a module's output arrives, the frozen storage
gathered may be at most:

* the units enclosing the module (the one computing and those around it: theirs is released
  only after the inner units' backward);
* the units whose forward inputs carried no gradient (the root, which takes token ids, and in
  LoRA the base layers before the first adapter): nothing tells that their backward is over,
  so they wait for the end of the backward, by design;
* what ``prefetch_units`` may gather ahead: each unit in backward (the chain enclosing the
  module) may have started gathering that many units before it, counted as the largest (an
  enclosing block prefetches the previous block's last unit before its own inner units start).

A stage 3 that keeps every unit it gathers until the end of backward (or until the step) holds
the later units as well while the first ones compute, which every measurement taken after the
step misses.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def frozen_bytes(unit) -> int:
    return sum(c.bucket.param_full.nbytes for c in unit.members if not c.bucket.trains)


def held_bytes(engine) -> int:
    """Bytes of frozen parameter storage gathered (or being gathered) now."""
    return sum(b.param_full.nbytes for b in engine.sharded.all_buckets if not b.trains and b.param_full.is_allocated)


def _encloses(unit_fqn: str, fqn: str) -> bool:
    return unit_fqn == "" or fqn == unit_fqn or fqn.startswith(unit_fqn + ".")


def held_in_backward(engine, batches, loss_fn, prefetch: int) -> dict:
    """Forward, backward and step on each of this rank's ``batches``, sampling the last backward
    (with prefetch, not the engine's first: that one records the order). ``prefetch``: the
    engine's prefetch_units. Returns the number of samples, the sample furthest over the bound
    (``excess`` <= 0 when it holds), the one with the most bytes held and the unit sizes."""
    units = engine.sharded.units
    largest = max(frozen_bytes(u) for u in units)
    silent: set[str] = set()  # units whose forward inputs carried no gradient
    samples: list[tuple[str, int, int]] = []  # (module, held, bound)
    armed = [False]

    def grads(tree) -> list[torch.Tensor]:
        return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

    def inputs_seen(unit, args, kwargs):
        if armed[0] and not grads((args, kwargs)):
            silent.add(unit.fqn)

    # id -> (the tensor, kept so that its id is not reused in this pass; the modules that returned it)
    outputs: dict[int, tuple[torch.Tensor, list[str]]] = {}

    def sample(modules):
        enclosing = [u for u in units if any(_encloses(u.fqn, m) for m in modules)]
        allowed = {u.fqn: frozen_bytes(u) for u in units if u.fqn in silent} | \
            {u.fqn: frozen_bytes(u) for u in enclosing}
        ahead = prefetch * len(enclosing) * largest
        samples.append((modules[0], held_bytes(engine), sum(allowed.values()) + ahead))

    def output_seen(fqn, out):
        # the engine's hook on the same tensor, registered first, gathers first; a module returning
        # its input as is (dropout with p=0) shares the tensor, so every module returning it counts
        for t in grads(out) if armed[0] else ():
            if id(t) not in outputs:
                outputs[id(t)] = (t, [])
                t.register_hook(lambda _grad, m=outputs[id(t)][1]: sample(m))
            outputs[id(t)][1].append(fqn)

    handles = [u.module.register_forward_pre_hook(lambda _m, a, k, u=u: inputs_seen(u, a, k), with_kwargs=True)
               for u in units]
    handles += [m.register_forward_hook(lambda _m, _a, out, f=fqn: output_seen(f, out))
                for fqn, m in engine.module.named_modules()]
    try:
        for i, batch in enumerate(batches):
            armed[0] = i == len(batches) - 1
            engine.backward(loss_fn(engine, batch))
            engine.step()
    finally:
        for h in handles:
            h.remove()
        outputs.clear()
    worst = max(samples, key=lambda s: s[1] - s[2])
    peak = max(samples, key=lambda s: s[1])
    return dict(samples=len(samples), excess=worst[1] - worst[2], worst=list(worst), peak=list(peak),
                unit_bytes=largest, total_bytes=sum(frozen_bytes(u) for u in units))
