"""Parity bounds that follow from the arithmetic, measured in the same run.

ZeRO on N ranks computes the same gradients as one process on the global batch,
summed in another order: each rank sums its micro-batch, MPI sums the ranks.
fp32 addition is not associative, so the results differ by rounding, and
training amplifies that (Adam turns the rounding of a gradient that nearly
cancels into a full-size step). How much depends on the CPU's kernels, the
thread count and the model, never on one fixed number.

So every worker also trains the single-process reference three or four more
times, in other summation orders (workers/common.py ``orders``): the global
batch cut into one chunk per rank, into twice as many, and with its rows
reversed, the chunks' gradients summed last first; and, where the rank count
is not a power of two, one chunk per rank whose gradients are summed unscaled
and divided by the count at the end, as the engine averages (scaling each
chunk's loss by 1/3 or 1/6 first rounds differently, and no other order
samples that rounding: without this order the engine's error at 6 ranks was
~10x the noise on an AVX-512 Xeon, with it ~1x). These runs differ from the
reference by summation order alone. Their largest distance from the
reference, per tensor, is the *order noise*; the engine must stay within
``ORDER_K`` times it:

    err(t) <= max(ORDER_K * noise(t), FLOOR)        for every tensor t

with err and noise as max|Δ| / max|reference| of the tensor. ``ORDER_K`` is the
margin between two samples of the same rounding process (the engine's split
and the chunked reference are both "one sum per rank, then a sum over ranks");
``FLOOR`` covers a tensor the reordering happens not to move: 16 units in the
last place of fp32 (2^-20 relative). ``ORDER_K`` = 8 leaves three doublings
between two samples of one rounding process; a broken reduction lands orders
of magnitude beyond it (test_mutation.py, 2 ranks, 3 steps: SGD with every
gradient off by 1e-3 at ~650x its bound, a sum instead of a mean at ~10^5x, a
lost bucket at >10^4x with AdamW too).

16-bit compute is judged the same way, on the whole update:
``rel_update <= ORDER_K * rel_update_noise`` (both ||θ - θ_ref|| / ||θ_ref - θ_0||),
plus a floor of one bf16 rounding (2^-8) of the update. Where only one step of the arithmetic runs in
16 bits (Muon's Newton-Schulz in fp16 on a CPU with mkldnn fp16 kernels), tensors and per-step losses
get a floor of one fp16 rounding (2^-11) instead of fp32's: whether a reordered gradient flips an fp16
rounding is a discrete event, so a run can make a flip that no reordered reference happened to make
(seen: a loss moved 1.8e-6 at a step where both references matched the reference exactly). A broken
update lands far beyond it (DeepSpeed's aspect scale transposed: 0.05-0.3 relative).
"""
from __future__ import annotations

import math

ORDER_K = 8.0
FP32_FLOOR = 2.0 ** -20
BF16_FLOOR = 2.0 ** -8
FP16_FLOOR = 2.0 ** -11


def tensor_failures(err: dict[str, float], noise: dict[str, float], floor: float = FP32_FLOOR) -> dict:
    """Tensors whose error exceeds their bound: {name: (error, bound)}."""
    out = {}
    for name, e in err.items():
        bound = max(ORDER_K * noise[name], floor)
        if not e <= bound:  # NaN fails too
            out[name] = (e, bound)
    return out


def loss_failures(ours: list[float], ref: list[float], alt: list[float], floor: float) -> list[tuple]:
    """Steps whose mean loss differs from the reference's by more than its bound."""
    bad = []
    for step, (o, r, a) in enumerate(zip(ours, ref, alt)):
        bound = max(ORDER_K * abs(a - r), floor * abs(r))
        if not abs(o - r) <= bound:
            bad.append((step, o, r, bound))
    return bad


def check_parity(r: dict) -> None:
    """The bounds above, for one row of a parity-judging worker (see workers/common.compare)."""
    if r["dtype"] == "fp32":
        failed = tensor_failures(r["err"], r["noise"])
        assert not failed, f"beyond {ORDER_K:g} x order noise: {failed}; row {_brief(r)}"
        bad = loss_failures(r["loss_ours"], r["loss_ref"], r["loss_alt"], FP32_FLOOR)
    else:
        bound = max(ORDER_K * r["rel_update_noise"], BF16_FLOOR)
        assert r["rel_update"] <= bound, f"rel_update {r['rel_update']:.3g} > {bound:.3g}; row {_brief(r)}"
        bad = loss_failures(r["loss_ours"], r["loss_ref"], r["loss_alt"], BF16_FLOOR)
    assert not bad, f"losses beyond their bound (step, ours, ref, bound): {bad}; row {_brief(r)}"


def worst_ratio(r: dict) -> float:
    """The largest err / bound of a row (< 1 passes): what the README's margins are read from."""
    if r["dtype"] != "fp32":
        return r["rel_update"] / max(ORDER_K * r["rel_update_noise"], BF16_FLOOR)
    return max((e / max(ORDER_K * r["noise"][n], FP32_FLOOR) for n, e in r["err"].items()), default=0.0)


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("err", "noise", "bytes_sent") and not
            (isinstance(v, float) and math.isnan(v))}


def check_resume(saved_job: dict, resumed_job: dict, dtype: str) -> None:
    """A job resumed at another world size or stage against the one that saved, both trained on
    from the checkpoint: per tensor within ``ORDER_K`` times the order noise, measured as the
    distance of the resumed job's reordered runs (``<order>/<name>`` entries of workers/ckpt.py
    --orders) from its own result."""
    finals = [k for k in resumed_job if k.startswith("final/")]
    orders = {k.split("/")[0] for k in resumed_job} - {"final", "saved"}
    assert finals and orders, sorted(resumed_job)
    err, noise = {}, {}
    for key in finals:
        ours, ref = resumed_job[key], saved_job[key]
        scale = max(float(abs(ref).max()), 1e-12)
        err[key] = float(abs(ours - ref).max()) / scale
        noise[key] = max(float(abs(resumed_job[key.replace("final/", f"{o}/")] - ours).max()) / scale
                         for o in orders)
    failed = tensor_failures(err, noise, FP32_FLOOR if dtype == "fp32" else BF16_FLOOR)
    assert not failed, f"beyond {ORDER_K:g} x order noise (error, bound): {failed}"
