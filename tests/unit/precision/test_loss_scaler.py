import pytest

from zeroshard.config import parse_config
from zeroshard.precision import LossScaler, LossScaleStuckError, PrecisionPolicy


def dynamic(**kw):
    fp16 = parse_config({"fp16": {"enabled": True, **kw}}).fp16
    return LossScaler.from_config(fp16)


def test_defaults_follow_deepspeed():
    s = dynamic()
    assert s.dynamic and s.scale == 2.0**16 and s.window == 1000 and s.hysteresis == 2 and s.min_scale == 1


def test_hysteresis_delays_halving():
    s = dynamic(initial_scale_power=10, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # first overflow eaten by hysteresis
    s.update(True)
    assert s.scale == 512
    s.update(True)
    assert s.scale == 256


def test_window_of_clean_steps_doubles():
    s = dynamic(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    for _ in range(2):
        s.update(False)
    assert s.scale == 16
    s.update(False)
    assert s.scale == 32
    s.update(True)
    assert s.scale == 16 and s.clean_steps == 0


def test_min_scale_is_a_floor_and_stuck_raises():
    s = dynamic(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.max_stuck_steps = 3
    s.update(True)
    assert s.scale == 1
    s.update(True)
    s.update(True)
    with pytest.raises(LossScaleStuckError, match="minimum loss scale 1"):
        s.update(True)


def test_static_scale_never_moves():
    s = LossScaler.from_config(parse_config({"fp16": {"enabled": True, "loss_scale": 128}}).fp16)
    s.update(True)
    s.update(False)
    assert s.scale == 128 and not s.dynamic


def test_disabled_is_identity_and_state_round_trips():
    assert LossScaler.from_config(parse_config({}).fp16).scale == 1.0
    s = dynamic(initial_scale_power=5)
    s.update(True)
    t = dynamic()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_precision_policy():
    import torch

    assert PrecisionPolicy.from_config(parse_config({})).compute == torch.float32
    bf16 = PrecisionPolicy.from_config(parse_config({"bf16": {"enabled": True}}))
    assert bf16.compute == bf16.reduce == torch.bfloat16 and bf16.master == torch.float32
    mixed = PrecisionPolicy.from_config(parse_config({"fp16": {"enabled": True}, "communication_data_type": "fp32"}))
    assert mixed.compute == torch.float16 and mixed.reduce == torch.float32
