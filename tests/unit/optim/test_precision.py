"""Unit tests of zerompi.optim.precision.LossScaler: dynamic and static fp16 loss scaling."""
from __future__ import annotations

import pytest

import zerompi
from zerompi.errors import ConfigError, ZeroMPIError
from zerompi.optim.precision import LossScaler


def scaler(**overrides) -> LossScaler:
    kwargs = dict(dtype="fp16", initial_scale_power=8, loss_scale_window=3, hysteresis=2,
                  min_loss_scale=1.0)
    return LossScaler.from_policy(zerompi.ZeroConfig(**{**kwargs, **overrides}).precision)


def run(s: LossScaler, overflows: str) -> list[float]:
    """Apply updates ("x" overflow, "." clean) and return the scale after each."""
    out = []
    for c in overflows:
        s.update(c == "x")
        out.append(s.scale)
    return out


def test_from_policy_dynamic():
    s = scaler(initial_scale_power=5, loss_scale_window=7, hysteresis=3, min_loss_scale=0.5)
    assert (s.scale, s.dynamic, s.window, s.hysteresis, s.hysteresis_left, s.min_scale) == (
        32.0, True, 7, 3, 3, 0.5)


def test_from_policy_defaults_start_at_2_pow_16():
    s = LossScaler.from_policy(zerompi.ZeroConfig(dtype="fp16").precision)
    assert s.scale == 2.0 ** 16 and s.dynamic and s.window == 1000 and s.hysteresis == 2


def test_from_policy_static():
    s = scaler(loss_scale=128.0)
    assert s.scale == 128.0 and not s.dynamic


def test_hysteresis_first_overflow_skips_second_halves():
    s = scaler(hysteresis=2)
    assert run(s, "x") == [256.0]
    assert run(s, "x") == [128.0]
    assert run(s, "x") == [64.0]  # budget exhausted: every further overflow halves


@pytest.mark.parametrize("hysteresis", [1, 2, 3, 5])
def test_scale_halves_on_the_hysteresis_th_overflow(hysteresis):
    s = scaler(hysteresis=hysteresis)
    assert run(s, "x" * hysteresis) == [256.0] * (hysteresis - 1) + [128.0]


def test_scale_doubles_after_window_clean_steps():
    s = scaler(loss_scale_window=3)
    assert run(s, "......") == [256.0, 256.0, 512.0, 512.0, 512.0, 1024.0]


def test_overflow_restarts_the_window():
    s = scaler(loss_scale_window=3, hysteresis=1)
    assert run(s, "..x...") == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]


def test_doubling_restores_hysteresis_budget():
    s = scaler(loss_scale_window=2, hysteresis=2)
    assert run(s, "xx") == [256.0, 128.0]
    assert s.hysteresis_left == 1
    assert run(s, "..") == [128.0, 256.0]
    assert s.hysteresis_left == 2
    assert run(s, "x") == [256.0]  # absorbed again


def test_scale_never_below_min():
    s = scaler(initial_scale_power=3, hysteresis=1, min_loss_scale=3.0)
    assert run(s, "x") == [4.0]
    assert run(s, "x") == [3.0]  # clamped, not 2


def test_overflow_at_min_with_hysteresis_exhausted_raises():
    s = scaler(initial_scale_power=2, hysteresis=2, min_loss_scale=2.0)
    assert run(s, "xx") == [4.0, 2.0]
    with pytest.raises(ZeroMPIError, match="minimum"):
        s.update(True)


def test_overflow_at_min_uses_hysteresis_before_raising():
    s = scaler(initial_scale_power=0, hysteresis=3, min_loss_scale=1.0)
    assert run(s, "xx") == [1.0, 1.0]
    with pytest.raises(ZeroMPIError, match="minimum"):
        s.update(True)


def test_static_scale_never_changes():
    s = scaler(loss_scale=64.0, loss_scale_window=2)
    assert run(s, "xxxx....x.x...xxxxxxxx") == [64.0] * 22  # and never raises


def test_direct_construction_honours_hysteresis():
    one = LossScaler(scale=8.0, hysteresis=1)
    one.update(True)
    assert one.scale == 4.0
    four = LossScaler(scale=8.0, hysteresis=4)
    for _ in range(3):
        four.update(True)
    assert four.scale == 8.0
    four.update(True)
    assert four.scale == 4.0


def test_initial_scale_below_minimum_is_a_config_error():
    cfg = zerompi.ZeroConfig(dtype="fp16", initial_scale_power=0, min_loss_scale=4.0)
    with pytest.raises(ConfigError, match="initial_scale_power"):
        LossScaler.from_policy(cfg.precision)
