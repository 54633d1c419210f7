"""zerompi.deepspeed on a world of one (MPI.COMM_SELF): DeepSpeed's initialize and engine methods."""
from __future__ import annotations

import warnings

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed
from zerompi.compat.deepspeed.schedule import read_schedule
from zerompi.errors import ConfigError, UsageError
from zerompi.compat.deepspeed.lr_schedules import factor_for

LOCAL = {"device": "cpu", "cpu_threads": 1, "abort_on_exception": False, "checkpoint_layout": "per_rank"}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                              "warmup_max_lr": 0.01, "warmup_type": "linear"}},
            **extra}


def start(cfg=None, **kwargs):
    m = model()
    kwargs.setdefault("model_parameters", m.parameters())
    return deepspeed.initialize(model=m, config=cfg or config(), comm=MPI.COMM_SELF, overrides=LOCAL, **kwargs)


def test_training_loop_and_getters(tmp_path):
    engine, optimizer, loader, scheduler = start()
    assert loader is None and optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.train_batch_size()) == (2, 2, 4)
    assert (engine.global_rank, engine.world_size, engine.local_rank) == (0, 1, 0)
    spec = read_schedule(config(), False)
    factor = factor_for(spec, 0.01)
    g = torch.Generator().manual_seed(1)
    lrs, losses = [], []
    for step in range(5):
        lrs.append(engine.get_lr()[0])
        for _ in range(2):
            x = torch.randn(2, 4, generator=g)
            loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        losses.append(loss.item())
        assert engine.global_steps == step + 1
    assert lrs == pytest.approx([factor.value(k) for k in range(5)], rel=1e-12)
    assert engine.save_checkpoint(tmp_path, client_state={"epoch": 1}) is True
    assert (tmp_path / "global_step5").is_dir()
    engine.eval()
    assert not engine.module.training
    engine.close()

    again, *_ = start()
    path, client = again.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step5") and client == {"epoch": 1}
    assert again.get_lr() == pytest.approx([factor.value(5)])
    assert again.global_steps == 5
    again.close()


def test_load_without_checkpoint_returns_none(tmp_path):
    engine, *_ = start()
    assert engine.load_checkpoint(tmp_path) == (None, None)
    engine.close()


def test_param_groups_and_derived_accumulation():
    m = model()
    groups = [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 0.002}]
    cfg = config(train_batch_size=8, train_micro_batch_size_per_gpu=2)
    del cfg["gradient_accumulation_steps"], cfg["scheduler"]
    engine, optimizer, _, scheduler = deepspeed.initialize(model=m, model_parameters=groups, config=cfg,
                                                           comm=MPI.COMM_SELF, overrides=LOCAL)
    assert engine.gradient_accumulation_steps() == 4 and engine.engine.config.grad_accum_steps == 4
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.002] and scheduler is None
    engine.close()


def test_config_file_and_args(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config()))
    args = deepspeed.add_config_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = deepspeed.initialize(args=args, model=model(), comm=MPI.COMM_SELF, overrides=LOCAL)
    assert engine.gradient_accumulation_steps() == 2
    engine.close()


def test_user_scheduler_callable_wins():
    engine, _, _, scheduler = start(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    engine.close()


def test_tuning_keys_warned_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = start(config(steps_per_print=10, wall_clock_breakdown=False))
    assert [str(w.message).count("steps_per_print") for w in caught] == [1]
    assert "scheduler" not in str(caught[0].message)  # applied here
    engine.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)), "config's optimizer block both"),
    (dict(lr_scheduler=torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 1)),
     "without optimizer=.*callable lr_scheduler"),
    (dict(training_data=iter([1, 2])), "map-style dataset"),
    (dict(mpu=object()), "mpu="),
    (dict(pipeline=True), r"pipeline= \(unknown keyword\)"),
    (dict(model_parameters=[{"params": []}, nn.Parameter(torch.zeros(1))]), "mixes parameters and param-group"),
])
def test_what_zerompi_cannot_honour(kwargs, match):
    with pytest.raises(UsageError, match=match):
        start(**kwargs)


def test_inconsistent_batch_raises_naming_keys():
    with pytest.raises(ConfigError, match="train_batch_size=8, train_micro_batch_size_per_gpu=2, "
                                          "gradient_accumulation_steps=2 disagree on 1 ranks"):
        start(config(train_batch_size=8))


def test_no_config():
    with pytest.raises(UsageError, match="no DeepSpeed config"):
        deepspeed.initialize(model=model(), comm=MPI.COMM_SELF)


@pytest.mark.parametrize("stage, dtype, gather", [(1, "fp32", False), (3, "bf16", True), (3, "fp32", False)])
def test_save_16bit_model_writes_safetensors_that_torch_loads(tmp_path, stage, dtype, gather):
    import json
    import struct

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    doc = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": stage, "stage3_gather_16bit_weights_on_model_save": gather} if stage == 3 else {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=doc, comm=MPI.COMM_SELF)
    with pytest.raises(UsageError, match="never pickles"):
        engine.save_16bit_model(tmp_path, "pytorch_model.bin")
    if stage == 3 and not gather:
        with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
            assert engine.save_16bit_model(tmp_path) is False
        assert not (tmp_path / "model.safetensors").exists()
        engine.close()
        return
    full = engine.engine.full_state_dict()
    assert engine.save_16bit_model(tmp_path) is True
    raw = (tmp_path / "model.safetensors").read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    data = raw[8 + size:]
    names = set(header) - {"__metadata__"}
    assert names == set(model.state_dict())
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name, value in full.items():
        start, stop = header[name]["data_offsets"]
        got = torch.frombuffer(bytearray(data[start:stop]), dtype=want).view(header[name]["shape"])
        assert torch.equal(got, value.to(want)), name
    engine.close()


@pytest.mark.parametrize("stage", (1, 3))
def test_exclude_frozen_parameters(tmp_path, stage):
    """DeepSpeed's exclude_frozen_parameters: the checkpoint and the 16-bit file leave the frozen base out."""
    from safetensors.torch import load_file

    from zerompi.checkpoint import load_full_state_dict
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    net[0].requires_grad_(False)
    doc = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=net, config=doc, comm=MPI.COMM_SELF, overrides=LOCAL)
    engine.save_checkpoint(tmp_path / "ckpt", tag="adapters", exclude_frozen_parameters=True)
    assert sorted(load_full_state_dict(tmp_path / "ckpt", "adapters")) == ["2.bias", "2.weight"]
    engine.save_16bit_model(tmp_path, "head.safetensors", exclude_frozen_parameters=True)
    assert sorted(load_file(str(tmp_path / "head.safetensors"))) == ["2.bias", "2.weight"]
    engine.close()


def test_initialize_leaves_the_scripts_generator_alone():
    import zerompi
    m = model()  # seeds 0
    torch.manual_seed(1234)
    torch.rand(2)
    state = torch.random.get_rng_state()
    expected = torch.rand(5)
    torch.random.set_rng_state(state)
    deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config(), comm=MPI.COMM_SELF,
                         overrides=LOCAL)
    assert torch.equal(torch.rand(5), expected)  # DeepSpeed does not reseed either
    m = model()
    zerompi.initialize(m, zerompi.ZeroConfig(stage=2, seed=7, **LOCAL), comm=MPI.COMM_SELF)
    after = torch.rand(5)
    torch.manual_seed(7 + 0)  # zerompi's own initialize keeps seeding seed + rank
    assert torch.equal(after, torch.rand(5))


class _Rotary(nn.Module):
    """A layer scaled by a table computed in its buffer's dtype, as a rotary embedding's fp32 inv_freq is."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.linspace(0.1, 0.9, 4) / 3)

    def forward(self, x):
        y = self.lin(x)
        return y * torch.cos(self.inv_freq * 7).to(y.dtype)


@pytest.mark.parametrize("stage", (0, 3))
@pytest.mark.parametrize("buffer_dtype", (None, "bf16"))
def test_bf16_casts_buffers_only_when_buffer_dtype_says_so(stage, buffer_dtype):
    """DeepSpeed 0.19 casts the parameters alone under bf16: an fp32 buffer stays fp32 and the forward is that
    of the module with bf16 parameters; data_types.buffer_dtype="bf16" casts the buffers too."""
    import copy
    torch.manual_seed(0)
    net = _Rotary()
    ref = copy.deepcopy(net)
    ref.lin.to(torch.bfloat16)  # the parameters alone
    if buffer_dtype:
        ref.to(torch.bfloat16)
    x = torch.randn(3, 4).to(torch.bfloat16)
    doc = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "data_types": {"buffer_dtype": buffer_dtype}}
    engine, *_ = deepspeed.initialize(model=net, config=doc, comm=MPI.COMM_SELF, overrides=LOCAL)
    assert net.inv_freq.dtype == (torch.bfloat16 if buffer_dtype else torch.float32)
    with torch.no_grad():
        got, want, all16 = engine(x), ref(x), copy.deepcopy(ref).to(torch.bfloat16)(x)
    assert torch.equal(got, want)
    assert buffer_dtype or not torch.equal(want, all16)  # the buffer's dtype shows in the output
    engine.close()


def test_fault_tolerance_is_refused_through_the_shim():
    """A DeepSpeed script's data loader fixes each rank's share at start: survivors could not deal it again."""
    m = model()
    with pytest.raises(UsageError, match="fault_tolerance=True is not offered through the DeepSpeed shim"):
        deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config(gradient_accumulation_steps=1),
                             comm=MPI.COMM_SELF, overrides={**LOCAL, "fault_tolerance": True, "micro_batches": 2})


def test_throughput_timer_counts_forwards_and_steps():
    engine, *_ = start()  # 2 micro-batches of 2 per optimizer step
    timer = engine.tput_timer
    assert timer.avg_samples_per_sec() == float("-inf")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(8):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert (timer.micro_step_count, timer.global_step_count, timer.epoch_count) == (8, 4, 0)
    assert 0 < timer.avg_samples_per_sec() < float("inf")  # steps 3 and 4 timed (the first two are not)
    timer.update_epoch_count()  # DeepSpeed-Chat's call after each epoch
    assert (timer.micro_step_count, timer.epoch_count) == (0, 1)
    engine.close()


@pytest.mark.parametrize("block,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16bit_masters_start_from_the_rounded_weights(block, dtype):
    """DeepSpeed casts the module to the 16-bit dtype before copying the fp32 masters from it."""
    m = model()  # fp32 weights, most not representable in 16 bits
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(**{block: {"enabled": True}}), comm=MPI.COMM_SELF, overrides=LOCAL)
    masters = engine.engine.full_state_dict()
    assert any(not torch.equal(masters[n], v) for n, v in before.items())
    for n, v in before.items():
        assert torch.equal(masters[n], v.to(dtype).float()), n
    engine.close()
