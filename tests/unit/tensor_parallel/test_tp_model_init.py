"""tp_model_init's arguments are checked before anything joins a process group or touches the model."""

import pytest
import torch.nn as nn

from zeroshard import tp_model_init


@pytest.mark.parametrize("tp_size", [0, -2, True, 2.0, "2"])
def test_a_bad_tp_size_is_named(tp_size):
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        tp_model_init(nn.Linear(2, 2), tp_size)


def test_a_size_the_config_disagrees_with_is_named():
    with pytest.raises(ValueError, match=r"disagrees with the config's tensor_parallel.autotp_size 1"):
        tp_model_init(nn.Linear(2, 2), 2, config={"tensor_parallel": {"autotp_size": 1}})
    with pytest.raises(TypeError, match="unexpected argument"):
        tp_model_init(nn.Linear(2, 2), 2, mpu=object())
