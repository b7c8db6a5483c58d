"""DeepSpeed's expert-parameter protocol in the compat namespace: optimizer groups split as DeepSpeed splits them,
expert-group calls refused by name where they ask for layouts zeroshard lacks (group creation on ranks is tested in
tests/distributed/test_moe.py)."""

import pytest
import torch

from zeroshard.compat.deepspeed.moe import utils
from zeroshard.compat.deepspeed.utils import groups


def expert(shape=(2, 3, 4), group="ep_size_2"):
    param = torch.nn.Parameter(torch.zeros(shape))
    param.allreduce, param.group_name = False, group
    return param


def test_expert_parameters_move_to_their_own_groups_as_deepspeed_moves_them():
    dense, a, b = torch.nn.Parameter(torch.zeros(3)), expert(), expert(group="ep_size_4")
    out = utils.split_params_into_different_moe_groups_for_optimizer({"params": [dense, a, b], "name": "p", "lr": 0.1})
    assert [g["params"] for g in out] == [[dense], [a], [b]]
    assert [(g["name"], g.get("moe", False), g["lr"]) for g in out] == [
        ("p", False, 0.1),
        ("ep_size_2", True, 0.1),
        ("ep_size_4", True, 0.1),
    ]
    assert utils.is_moe_param(a) and not utils.is_moe_param(dense) and utils.is_moe_param_group(out[1])
    chunks = utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": [expert(), expert(), expert()], "name": "p"}], max_group_size=30
    )
    assert [len(g["params"]) for g in chunks] == [0, 1, 1, 1]  # 24 elements each: one per group of at most 30
    with pytest.raises(KeyError):
        utils.split_params_into_different_moe_groups_for_optimizer({"params": [expert()]})  # DeepSpeed keys by name
    with pytest.raises(ValueError, match="Unknown param group type"):
        utils.split_params_into_different_moe_groups_for_optimizer("params")
    assert utils.configure_moe_param_groups([dense, a])[1]["moe"] is True
    shared, experts = utils.split_params_into_shared_and_expert_params([dense, a])
    assert shared == [dense] and experts == [a]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(mp_size=2), "mp_size"),
        (dict(pp_size=2), "pp_size"),
        (dict(use_data_before_expert_parallel_=True), "use_data_before_expert_parallel_"),
        (dict(folding_spec=object()), "folding_spec"),
    ],
)
def test_expert_group_layouts_zeroshard_lacks_are_refused_by_name(kwargs, named):
    with pytest.raises(NotImplementedError, match=named):
        groups._create_expert_and_data_parallel(2, **kwargs)


def test_an_expert_group_never_made_is_named():
    with pytest.raises(AssertionError, match="expert parallel group 'ep_size_7' is not initialized"):
        groups._get_expert_parallel_group("ep_size_7")
    assert groups._get_expert_model_parallel_world_size() == 1
