"""One declaration per config key (zerompi/config/declare.py): the checks, the policies and a dialect's direct
spellings all come from the sections' declarations."""
from __future__ import annotations

import dataclasses

import pytest

from zerompi import ZeroConfig
from zerompi.compat.deepspeed import config as ds_config
from zerompi.config.declare import CHECK, build, feeds, key
from zerompi.config.zero import CHECKS, SECTIONS
from zerompi.errors import ConfigError

POLICIES = ("sharding", "topology", "optimization", "lr_policy", "batch", "precision", "runtime", "offload",
            "overlap", "compression", "checkpointing", "reliability", "recovery")


def test_every_key_is_declared_with_its_check():
    names = [f.name for f in dataclasses.fields(ZeroConfig)]
    assert sorted(CHECKS) == sorted(names)
    assert all(callable(f.metadata[CHECK]) for f in dataclasses.fields(ZeroConfig))


def test_a_key_without_a_check_is_refused_where_it_is_declared():
    with pytest.raises(TypeError, match="check"):
        key(1)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_is_built_from_its_sections_keys(name):
    """Each policy field comes from the key of its name, the key declaring it, or a derived value: build
    refuses a field that none fills (so a new policy field without its key fails here)."""
    assert dataclasses.is_dataclass(getattr(ZeroConfig(), name))


def test_every_key_fills_a_field_of_a_policy_of_its_section():
    """A key that fills nothing would be a setting that does nothing. optimizer_in_backward and reproducible
    are read through derived values (overlap's update schedule, the optimizer's deterministic kernel)."""
    derived = {"optimizer_in_backward", "reproducible"}
    cfg = ZeroConfig()
    for section in SECTIONS:
        targets = set()
        for name in POLICIES:
            policy = getattr(cfg, name)
            if getattr(type(cfg), name).func.__qualname__.startswith(section.__name__ + "."):
                targets |= {f.name for f in dataclasses.fields(policy)}
        for f in dataclasses.fields(section):
            assert feeds(f) in targets or f.name in derived, (section.__name__, f.name)


def test_a_renamed_policy_field_takes_the_declaring_keys_value():
    cfg = ZeroConfig(stage=3, nvme_block_kib=64, checkpoint_verify=False, param_persistence_threshold=7,
                     fault_tolerance=True, recovery_every=3, micro_batches=4)
    assert cfg.offload.block_kib == 64 and cfg.checkpointing.verify is False
    assert cfg.sharding.persistence_threshold == 7
    assert (cfg.recovery.enabled, cfg.recovery.every) == (True, 3)


def test_build_names_the_field_no_key_fills():
    @dataclasses.dataclass(frozen=True)
    class Policy:
        nothing_fills_me: int

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Keys:
        seed: int = key(0, CHECKS["seed"])

    with pytest.raises(TypeError, match="Policy.nothing_fills_me"):
        build(Policy, Keys(), Keys)


def test_the_deepspeed_keys_carried_unchanged_are_the_declared_ones():
    assert dict(ds_config._DS_DIRECT) == {
        "zero_optimization.stage": "stage", "zero_optimization.offload_optimizer.device": "offload_optimizer",
        "zero_optimization.offload_param.device": "offload_params", "gradient_accumulation_steps": "grad_accum_steps",
        "gradient_clipping": "clip_grad_norm", **{f"fp16.{k}": k for k in (
            "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")},
        **{f"optimizer.params.{k}": k for k in ("lr", "betas", "eps", "weight_decay", "momentum")}}


def test_a_declared_check_refuses_by_key():
    with pytest.raises(ConfigError, match="nvme_threads"):
        ZeroConfig(nvme_threads=65)
