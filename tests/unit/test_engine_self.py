"""zerompi.initialize and ZeroOptimizer on a world of one (MPI.COMM_SELF), against plain torch.

On one rank every reduction divides by 1 and sums nothing, and the optimizers are
element-wise, so an engine at any stage must give bitwise the parameters of torch
training a copy of the model. The one exception is gradient clipping: ZeroOptimizer
takes the global norm as sqrt of the sum, in Python float64, of each bucket's fp32
norm squared, and scales only when the coefficient is below 1, whereas
torch.nn.utils.clip_grad_norm_ takes the fp32 norm of the per-tensor fp32 norms. The
norms then differ in the last bits, and so may the clipped parameters: those tests pin
bitwise equality with a reference that clips the ZeroOptimizer way (``zero_clip``), and
closeness to clip_grad_norm_.

Bitwise equality also needs a kernel that computes an element the same way whatever tensor it is
in: torch's for-loop does (``foreach=False`` below); the fused CPU kernel, the engine's default
(test_default_kernel), takes a tensor's last few elements through a scalar tail, so a flat shard and
a parameter differ there in the last bit (the MPI parity tests bound that instead).
"""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi
from zerompi.errors import UsageError
from zerompi.optim.optimizer import ZeroOptimizer, optimizer_kwargs

STEPS, ROWS = 3, 5
CAP_ELEMENTS = 32  # bucket size: several buckets (stages 0-2) and gather units (stage 3)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def config(stage, optimizer="adamw", accum=1, clip=None, dtype="fp32", **kw) -> zerompi.ZeroConfig:
    size = 2 if dtype == "bf16" else 4
    return zerompi.ZeroConfig(stage=stage, optimizer=optimizer, lr=0.05, momentum=0.9, grad_accum_steps=accum,
                              clip_grad_norm=clip, dtype=dtype, bucket_mb=CAP_ELEMENTS * size / 2**20,
                              cpu_threads=1, device="cpu", abort_on_exception=False,
                              checkpoint_layout="per_rank", **{"optimizer_kwargs": {"foreach": False}, **kw})


def batches(accum: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(ROWS, 4, generator=g).to(dtype), torch.randn(ROWS, 3, generator=g).to(dtype))
             for _ in range(accum)] for _ in range(STEPS)]


def mse(out, y):
    return ((out - y) ** 2).mean()


def train_engine(cfg, dtype=torch.float32):
    engine = zerompi.initialize(make_model(), cfg, comm=MPI.COMM_SELF)
    norms = []
    for micro in batches(cfg.grad_accum_steps, dtype):
        for i, (x, y) in enumerate(micro):
            engine.backward(mse(engine(x), y))
            assert engine.step() is (i == len(micro) - 1)
        norms.append(engine.stats.last_grad_norm)
    return engine, norms


def zero_clip(params, bucket_fqns, clip):
    """ZeroOptimizer's clipping: per-bucket fp32 norms, combined in float64, scaled only below 1."""
    grads = dict(params)
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(torch.cat([grads[n].grad.reshape(-1) for n in fqns]),
                                                         dtype=torch.float32)) ** 2 for fqns in bucket_fqns))
    coef = clip / (norm + 1e-6) if clip is not None else 1.0
    if coef < 1.0:
        for _, p in params:
            p.grad.mul_(coef)
    return norm


def train_reference(cfg, bucket_fqns, clip_like="torch"):
    """Plain torch on one process; bf16 keeps fp32 masters and a bf16 working copy (as the engine)."""
    master = make_model()
    work = master if cfg.dtype == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
    opt = cfg.optimizer_class()(master.parameters(), **optimizer_kwargs(cfg.optimization, "cpu"))
    norms = []
    for micro in batches(cfg.grad_accum_steps, next(work.parameters()).dtype):
        for x, y in micro:
            (mse(work(x), y) / cfg.grad_accum_steps).backward()
        if work is not master:
            for m, w in zip(master.parameters(), work.parameters()):
                m.grad, w.grad = w.grad.float(), None
        named = list(master.named_parameters())
        if clip_like == "torch" and cfg.clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), cfg.clip_grad_norm)))
        else:
            norms.append(zero_clip(named, bucket_fqns, cfg.clip_grad_norm if clip_like == "zero" else None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if work is not master:
            with torch.no_grad():
                for m, w in zip(master.parameters(), work.parameters()):
                    w.copy_(m)
    return master, work, norms


def bucket_fqns(engine) -> list[list[str]]:
    return [[s.fqn for s in b.layout.slots] for b in engine.sharded.buckets]


def assert_bitwise(state: dict, model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach()), name


MATRIX = list(itertools.product([0, 1, 2, 3], ["adamw", "sgd"], [1, 2], [None, 0.5]))


@pytest.mark.parametrize("stage, optimizer, accum, clip", MATRIX)
def test_fp32_training_matches_torch(stage, optimizer, accum, clip):
    cfg = config(stage, optimizer, accum, clip)
    engine, norms = train_engine(cfg)
    state, fqns = engine.full_state_dict(), bucket_fqns(engine)
    engine.close()
    # the reported norm is the ZeroOptimizer formula's, bitwise, clipped or not
    ref, _, ref_norms = train_reference(cfg, fqns, clip_like="zero")
    assert norms == ref_norms
    assert_bitwise(state, ref)
    torch_ref, _, torch_norms = train_reference(cfg, fqns, clip_like="torch")
    if clip is None:
        assert_bitwise(state, torch_ref)
    else:  # the norm is summed per bucket, not per tensor as torch sums it: equal or a rounding apart
        assert norms == pytest.approx(torch_norms, rel=1e-6)
        for name, p in torch_ref.named_parameters():
            torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_clip_that_does_not_apply_is_bitwise_torch(stage):
    cfg = config(stage, "adamw", 2, 100.0)
    engine, _ = train_engine(cfg)
    state = engine.full_state_dict()
    engine.close()
    ref, _, _ = train_reference(cfg, [], clip_like="torch")  # clip_grad_norm_ scales by exactly 1.0
    assert_bitwise(state, ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_training_matches_torch_with_fp32_masters(stage):
    cfg = config(stage, "adamw", 2, None, dtype="bf16")
    engine, _ = train_engine(cfg, torch.bfloat16)
    state = engine.full_state_dict()
    master, work, _ = train_reference(cfg, [])
    assert_bitwise(state, master)
    for c in engine.sharded.collectives:  # stage 3: the compute parameters exist only while gathered
        c.unshard()
    for p, q in zip(engine.module.parameters(), work.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), q.detach())
    engine.close()


# stage: (kinds counted by initialize, collectives in forward + backward, collectives in step)
COLLECTIVES = {
    0: ({"broadcast"}, 2 * 5, 0),                 # 5 buckets: reduce-scatter + in-place all-gather each
    1: ({"broadcast"}, 5, 1 + 5),                 # reduce-scatter; step: norm all-reduce + 5 all-gathers
    2: ({"broadcast"}, 5, 1 + 5),
    3: ({"broadcast"}, 3 + 3 + 3, 1),             # 3 units: gather forward, gather backward, reduce
}
KINDS = {0: {"broadcast", "all_reduce"}, 1: {"broadcast", "reduce_scatter", "control", "all_gather"},
         2: {"broadcast", "reduce_scatter", "control", "all_gather"},
         3: {"broadcast", "all_gather", "reduce_scatter", "control"}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_per_phase(stage):
    engine = zerompi.initialize(make_model(), config(stage), comm=MPI.COMM_SELF)
    seq = engine.group.monitor.agreement.seq
    assert set(engine.stats.bytes_sent) == COLLECTIVES[stage][0]
    assert seq == len(engine.sharded.buckets) == (3 if stage == 3 else 5)  # one broadcast per bucket
    if stage == 3:
        assert [u.fqn for u in engine.sharded.units] == ["", "0", "2"]
        assert bucket_fqns(engine) == [["4.weight", "4.bias"], ["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    else:  # reverse registration order, cut at 32 elements
        assert bucket_fqns(engine) == [["4.bias", "4.weight"], ["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]]
    x, y = batches(1)[0][0]
    engine.backward(mse(engine(x), y))
    assert engine.group.monitor.agreement.seq - seq == COLLECTIVES[stage][1]
    seq = engine.group.monitor.agreement.seq
    engine.step()
    assert engine.group.monitor.agreement.seq - seq == COLLECTIVES[stage][2]
    stats = engine.stats
    assert set(stats.bytes_sent) == KINDS[stage] and not any(stats.bytes_sent.values())
    assert (stats.steps, stats.skipped_steps, stats.loss_scale) == (1, 0, 1.0)
    engine.close()


def test_initialize_accepts_an_mpi_communicator():
    engine = zerompi.initialize(make_model(), config(2), comm=MPI.COMM_SELF)
    assert (engine.rank, engine.world_size, engine.local_rank) == (0, 1, 0)
    engine.close()
    # today: a group is not accepted as comm (MPIGroup wraps it as if it were an mpi4py communicator)
    with pytest.raises(AttributeError):
        zerompi.initialize(make_model(), config(2), comm=engine.group)


def test_step_and_backward_order_errors():
    engine = zerompi.initialize(make_model(), config(2, accum=2), comm=MPI.COMM_SELF)
    x, y = batches(1)[0][0]
    with pytest.raises(UsageError, match="step\\(\\) called before backward"):
        engine.step()
    engine.backward(mse(engine(x), y))
    assert engine.step() is False  # inside the accumulation window: no update, no error
    engine.backward(mse(engine(x), y))
    with pytest.raises(UsageError, match="backward\\(\\) called 3 times without step"):
        engine.backward(mse(engine(x), y))
    assert engine.step() is True
    with pytest.raises(UsageError, match="scalar loss"):
        engine.backward(engine(x).sum(dim=1))
    engine.close()


# ---- ZeroOptimizer alone ---------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer, clip", [("adamw", 0.05), ("sgd", 0.05), ("adamw", 1e3)])
def test_zero_optimizer_step_matches_clip_grad_norm_and_torch(stage, optimizer, clip):
    cfg = config(stage, optimizer, clip=clip)
    engine = zerompi.initialize(make_model(), cfg, comm=MPI.COMM_SELF)
    assert isinstance(engine.optimizer, ZeroOptimizer)
    g = torch.Generator().manual_seed(2)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in make_model().named_parameters()}
    for c in engine.sharded.collectives:
        c.begin_backward()
        for i, s in enumerate(c.bucket.layout.slots):
            c.add_grad(i, grads[s.fqn])
        c.reduce_grads()
    result = engine.optimizer.step()
    state = engine.full_state_dict()
    ref = make_model()
    for n, p in ref.named_parameters():
        p.grad = grads[n].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
    cfg.optimizer_class()(ref.parameters(), **optimizer_kwargs(cfg.optimization, "cpu")).step()
    assert result.stepped and result.grad_norm == pytest.approx(norm, rel=1e-6)
    if clip > norm:  # no clipping: bitwise
        assert_bitwise(state, ref)
    else:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(state[n], p.detach(), rtol=0, atol=1e-6)
    for b in engine.sharded.buckets:  # the step consumed the gradient: none is left at any stage
        assert torch.equal(b.master_grad(), torch.zeros(b.layout.padded_numel))
    engine.close()


@pytest.mark.parametrize("name,kwargs,device,expect", [
    ("adamw", {}, "cpu", {"fused": True}), ("adam", {}, "cpu", {"fused": True}),
    ("adamw", {"foreach": False}, "cpu", {"foreach": False}), ("adamw", {"fused": False}, "cpu", {"fused": False}),
    ("adamw", {}, "cuda", {}), ("sgd", {}, "cpu", {})])
def test_default_kernel(name, kwargs, device, expect):
    """Adam/AdamW state in host memory gets torch's fused CPU kernel unless optimizer_kwargs chooses one;
    the engine builds its optimizer with it (the reference of the MPI parity tests does too)."""
    cfg = zerompi.ZeroConfig(optimizer=name, optimizer_kwargs=kwargs)
    got = {k: v for k, v in optimizer_kwargs(cfg.optimization, device).items() if k in ("fused", "foreach")}
    assert got == expect
    if device == "cpu":
        engine = zerompi.initialize(make_model(), cfg.replace(device="cpu", abort_on_exception=False),
                                    comm=MPI.COMM_SELF)
        assert {k: engine.optimizer.defaults.get(k) for k in expect} == expect
        engine.close()


@pytest.mark.parametrize("stage,dtype", [(3, "fp32"), (1, "bf16"), (3, "bf16")])
def test_shards_and_optimizer_state_start_on_page_boundaries(stage, dtype):
    """Stage 3's parameter shards, separate masters and (after the first step) the optimizer state live
    in 4 KiB-aligned host memory, so checkpoints and swap files move them with O_DIRECT, uncopied.
    (Stage 1-2 fp32 masters are views of the flat parameter buffer and are staged instead.)"""
    engine, _ = train_engine(config(stage, "adamw", dtype=dtype), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    try:
        for b in engine.sharded.buckets:
            assert b.master.data_ptr() % 4096 == 0
            for k, v in engine.optimizer.state[b.master].items():
                assert not (isinstance(v, torch.Tensor) and v.dim()) or v.data_ptr() % 4096 == 0, k
    finally:
        engine.close()


def test_an_outer_entry_computes_with_its_units_parameters_after_the_inner_entries_return():
    """A unit's entries nest (its module, then the modules down to the deepest one holding all of its
    parameters): the outermost one running gathers and releases, so the outer forward may still compute
    with the parameters after an inner entry returned (as a tied head does). The loss and one SGD step equal
    the plain module's. Breaks guarded: an inner entry that takes the unit over in its pre-forward, or that
    releases it in its post-forward (both survived every unit and MPI test in a mutation run)."""
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) @ self.inner.lin.weight  # the weight again, after the inner entries returned

    torch.manual_seed(0)
    model = Outer()
    plain = copy.deepcopy(model)
    cfg = zerompi.ZeroConfig(stage=3, optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad_norm=None, cpu_threads=1,
                             device="cpu", abort_on_exception=False)
    engine = zerompi.initialize(model, cfg, comm=MPI.COMM_SELF)
    try:
        assert [u.entries for u in engine.sharded.units] == [[model, model.inner, model.inner.lin]]
        x = torch.randn(3, 4)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref = plain(x).pow(2).mean()
        ref.backward()
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        assert torch.equal(loss.detach(), ref.detach()), (loss, ref)
        got = engine.full_state_dict()
        for name, value in plain.state_dict().items():
            assert torch.allclose(got[name], value, rtol=0, atol=1e-6), name
    finally:
        engine.close()


def test_frozen_units_are_released_as_backward_leaves_them():
    """Stage 3 LoRA-style: a deep frozen stack with small trainable heads in every layer. Frozen
    buckets have no gradient hook; each is released once the gradients of its unit's inputs exist,
    so backward holds a couple of units gathered, not the whole frozen base."""
    from zerompi.shard.collectives import BucketState

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(32, 32).requires_grad_(False)
            self.adapter = nn.Linear(32, 32, bias=False)

        def forward(self, x):
            return torch.tanh(self.base(x) + self.adapter(x))

    torch.manual_seed(0)
    model = nn.Sequential(*[Layer() for _ in range(8)])
    cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=0.05, bucket_mb=32 * 33 * 4 / 2**20, cpu_threads=1,
                             device="cpu", abort_on_exception=False)  # one layer a gather unit
    engine = zerompi.initialize(model, cfg, comm=MPI.COMM_SELF)
    frozen = [c for c in engine.sharded.all_collectives if not c.bucket.trains]
    seen = []
    for layer in model:
        layer.register_full_backward_pre_hook(
            lambda *_: seen.append(sum(c.state is not BucketState.SHARDED for c in frozen)))
    try:
        x = torch.randn(4, 32, requires_grad=True)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        assert len(frozen) >= 8 and len(seen) == 8
        assert max(seen) <= 2, seen  # the unit in backward and the one before it (read ahead)
        assert all(c.state is BucketState.SHARDED for c in frozen)
    finally:
        engine.close()
