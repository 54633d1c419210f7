"""What a script builds itself, handed to initialize on a world of one: an optimizer (torch's or
deepspeed.ops.adam's), a built scheduler, a dataset; and the engine methods loops ask."""
from __future__ import annotations

import warnings

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed
from zerompi.compat.deepspeed import client
from zerompi.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerompi.errors import UsageError

LOCAL = {"device": "cpu", "cpu_threads": 1, "abort_on_exception": False, "checkpoint_layout": "per_rank"}
BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
         "zero_optimization": {"stage": 2}}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def train(engine, steps: int = 4) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(1)
    losses, lrs = [], []
    for _ in range(steps):
        lrs.append(engine.get_lr()[0])
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(2, 4, generator=g)
            loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses, lrs


def start(m, cfg=None, **kwargs):
    return deepspeed.initialize(model=m, config=cfg or BATCH, comm=MPI.COMM_SELF, overrides=LOCAL, **kwargs)


@pytest.mark.parametrize("make, block", [
    (lambda p: FusedAdam(p, lr=0.01, weight_decay=0.1), {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}),
    (lambda p: DeepSpeedCPUAdam(p, lr=0.01, adamw_mode=False),
     {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}),
    (lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9), weight_decay=0.0),
     {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}}),
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
])
def test_built_optimizer_trains_as_the_config_block(make, block):
    m = model()
    engine, optimizer, _, _ = start(m, optimizer=make(m.parameters()))
    built = train(engine)[0]
    engine.close()
    engine, *_ = start(model(), {**BATCH, "optimizer": block})
    assert built == train(engine)[0]
    engine.close()


def test_other_elementwise_optimizer_and_param_groups():
    m = model()
    opt = torch.optim.Adagrad([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.02}], lr=0.1,
                              lr_decay=0.01)
    engine, optimizer, *_ = start(m, optimizer=opt)
    assert [type(o) for o in optimizer.inner.optimizers] == [torch.optim.Adagrad]  # one over every group
    assert [(g["lr"], g["lr_decay"]) for g in optimizer.param_groups] == [(0.1, 0.01), (0.02, 0.01)]
    losses = train(engine, 3)[0]
    engine.close()
    # the same arithmetic as torch's Adagrad on the whole model
    expected = _torch_losses(lambda ref: torch.optim.Adagrad(
        [{"params": ref[0].parameters()}, {"params": ref[2].parameters(), "lr": 0.02}], lr=0.1, lr_decay=0.01))
    assert losses == pytest.approx(expected, rel=1e-5)


def _torch_losses(make, steps: int = 3) -> list[float]:
    """The last micro-batch's loss of each step of ``train``'s loop, run by torch's own ``make(model)``."""
    ref = model()
    opt = make(ref)
    g = torch.Generator().manual_seed(1)
    expected = []
    for _ in range(steps):
        for _ in range(2):
            x = torch.randn(2, 4, generator=g)
            loss = (ref(x) - x.sum(1, keepdim=True)).pow(2).mean()
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    return expected


@pytest.mark.parametrize("make, match", [
    (lambda p: torch.optim.LBFGS(p), "cannot run here: its step needs a closure"),
    (lambda p: FusedAdam(p, amsgrad=True), "amsgrad"),
    (lambda p: DeepSpeedCPUAdam(p, fp32_optimizer_states=False), "fp32"),
])
def test_optimizers_refused(make, match):
    m = model()
    with pytest.raises(UsageError, match=match):
        start(m, optimizer=make(m.parameters()))


def test_stepped_or_foreign_optimizer_refused():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    with pytest.raises(UsageError, match="already stepped"):
        start(m, optimizer=opt)
    with pytest.raises(UsageError, match="not the model's"):
        start(model(), optimizer=torch.optim.SGD(model(1).parameters(), lr=0.1))


def test_fused_adam_steps_alone_as_torch_adamw():
    a, b = model(), model()
    ours, theirs = FusedAdam(a.parameters(), lr=0.1, weight_decay=0.1), torch.optim.AdamW(b.parameters(), lr=0.1,
                                                                                         weight_decay=0.1)
    for m, opt in ((a, ours), (b, theirs)):
        for _ in range(2):
            m(torch.ones(2, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1)),
    lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2),
                                                            torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)], [2]),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10),
])
def test_built_scheduler_follows_its_own_sequence(make):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    scheduler = make(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()"
        engine, optimizer, _, returned = start(m, optimizer=opt, lr_scheduler=scheduler)
        assert returned is scheduler and scheduler.optimizer is optimizer
        lrs = train(engine, 5)[1] + [engine.get_lr()[0]]
    engine.close()
    ref_opt = torch.optim.AdamW(model().parameters(), lr=0.01)
    ref = make(ref_opt)
    expected = []
    for _ in range(6):
        expected.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    assert lrs == pytest.approx(expected, rel=1e-15)


def test_scheduler_of_another_optimizer_refused():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(m.parameters(), lr=0.01), 1)
    with pytest.raises(UsageError, match="another optimizer"):
        start(m, optimizer=opt, lr_scheduler=other)
    with pytest.raises(UsageError, match="ReduceLROnPlateau"):
        start(m, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(UsageError, match="both give the optimizer"):
        start(m, {**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, optimizer=opt)


def test_training_data_gives_each_rank_its_share():
    data = [(torch.full((4,), float(i)), torch.tensor([float(i)])) for i in range(10)]
    m = model()
    engine, _, loader, _ = start(m, {**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}},
                                 training_data=data)
    assert engine.training_dataloader is loader and loader.batch_size == 2 and len(loader) == 5
    assert sorted(int(v) for x, _ in loader for v in x[:, 0]) == list(range(10))
    x, y = next(iter(loader))
    engine.backward((engine(x) - y).pow(2).mean())
    engine.close()
    # DeepSpeed's split on 3 ranks: disjoint shares (padded to equal length), all samples covered
    shares = [[int(v) for x, _ in client.training_loader(data, 2, r, 3) for v in x[:, 0]] for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4] and set(sum(shares, [])) == set(range(10))
    order = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=1, shuffle=True, seed=0)
    assert shares[1] == list(order)
    collated = client.training_loader(data, 5, 0, 1, collate_fn=lambda items: len(items))
    assert list(collated) == [5, 5]


class Net(nn.Sequential):
    checkpointing = False

    def gradient_checkpointing_enable(self):
        self.checkpointing = True


def test_engine_methods_a_loop_asks(tmp_path):
    torch.manual_seed(0)
    m = Net(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    # BatchNorm's bf16 weight needs bf16 running statistics: DeepSpeed casts buffers only when told to.
    cfg = {**BATCH, "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "bf16": {"enabled": True}, "data_types": {"buffer_dtype": "bf16"}}
    engine, *_ = start(m, cfg)
    assert engine.device == torch.device("cpu")
    assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization_stage()) == (False, True, 2)
    assert engine.get_global_grad_norm() is None and engine.global_samples == 0
    boundary, applied = [], []
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        boundary.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(torch.randn(2, 4, generator=g)).float().pow(2).mean())
        engine.step()
        applied.append(engine.was_step_applied())
    assert boundary == [False, True, False, True] and applied == [False, True, False, True]
    assert engine.get_global_grad_norm() > 0 and (engine.global_steps, engine.global_samples) == (2, 8)
    engine.gradient_checkpointing_enable()  # the module's, through the engine
    assert m.checkpointing and list(engine.parameters()) == list(m.parameters())
    assert [n for n, _ in engine.named_parameters()][0] == "module.0.weight"
    with pytest.raises(AttributeError, match="neither DeepSpeedEngine nor Net"):
        engine.no_such_thing
    full = engine.engine.full_state_dict()
    sd = engine.module_state_dict()
    assert list(sd) == list(m.state_dict())
    assert all(torch.equal(sd[n], v.to(torch.bfloat16)) for n, v in full.items())
    assert list(engine.state_dict()) == [f"module.{n}" for n in m.state_dict()]
    engine.eval()
    assert not engine.training
    with engine.no_sync():
        engine(torch.randn(2, 4))  # evaluation inside changes nothing
        with pytest.raises(UsageError, match="inside no_sync"):
            engine.backward(engine(torch.randn(2, 4)).float().mean())
        with pytest.raises(UsageError, match="no_sync"):
            engine.step()
    engine.destroy()
    from zerompi.compat.deepspeed.engine import live_engines
    assert engine not in live_engines()


def test_accelerates_loop_one_step_per_window_and_the_config():
    """accelerate's DeepSpeed loop: set_gradient_accumulation_boundary before each backward, step() at the
    boundary only, backward(scale_wrt_gas=False) on a loss already divided by the window; the same update
    as the plain loop. A boundary the engine's window disagrees with is named; engine.config is the document."""
    cfg = {**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    plain, *_ = start(model(), cfg)
    ours, *_ = start(model(), cfg)
    assert ours.config == cfg and ours.config["zero_optimization"]["stage"] == 2
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        xs = [torch.randn(2, 4, generator=g) for _ in range(2)]
        for k, x in enumerate(xs):
            plain.backward(plain(x).pow(2).mean())
            plain.step()
            ours.set_gradient_accumulation_boundary(k == 1)
            assert ours.is_gradient_accumulation_boundary() is (k == 1)
            ours.backward(ours(x).pow(2).mean() / 2, scale_wrt_gas=False)
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))
    ours.set_gradient_accumulation_boundary(True)
    ours.backward(ours(torch.randn(2, 4)).pow(2).mean())
    with pytest.raises(UsageError, match=r"set_gradient_accumulation_boundary\(True\) after 1 backward call"):
        ours.step()


def test_a_built_whole_tensor_optimizer_is_rebuilt_and_steps_whole_tensors():
    """Adafactor factors each matrix's second moment: rebuilt on the engine, it trains as torch's Adafactor
    on the model's own tensors (optim/whole.py), not on flat shards."""
    m = model()
    engine, optimizer, *_ = start(m, optimizer=torch.optim.Adafactor(m.parameters(), lr=0.01))
    losses = train(engine, 3)[0]
    engine.close()
    assert losses == pytest.approx(_torch_losses(lambda ref: torch.optim.Adafactor(ref.parameters(), lr=0.01)),
                                   rel=1e-5)
