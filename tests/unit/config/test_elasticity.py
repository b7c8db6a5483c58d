import pytest

from zeroshard.config import AutoContext, parse_config, resolve_config
from zeroshard.config.elasticity import ElasticityIncompatibleWorldSize, compute_elastic_config, valid_world_sizes

BLOCK = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 2}


def test_one_global_batch_for_every_world_size_in_range():
    """DeepSpeed 0.18's search (tests/unit/compat/test_elasticity_parity.py holds its recorded answers): candidates
    are the micro-batch sizes scaled by highly composite numbers; the one valid on the most world sizes wins."""
    v1 = {"elasticity": {**BLOCK, "version": 0.1}}
    assert compute_elastic_config(v1, "0.19.8") == (16, [1, 2])
    assert compute_elastic_config(v1, "0.19.8", world_size=1) == (16, [1, 2], 4)
    assert (
        compute_elastic_config({"elasticity": {**BLOCK, "version": 0.1, "prefer_larger_batch": False}}, "0.19.8")[0]
        == 12  # candidates 12 (2 x 6) and 16 (4 x 4), both valid on [1, 2]: the smaller
    )
    many = {
        "elasticity": {**BLOCK, "version": 0.1, "max_train_batch_size": 840, "micro_batch_sizes": [1], "max_gpus": 8}
    }
    assert compute_elastic_config(many, "0.19.8")[1] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert valid_world_sizes(24, [2], 2, 8) == [2, 3, 4, 6]


def test_world_size_outside_the_elastic_set_is_refused_by_name():
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"World size \(3\) is not valid .* \[1, 2\]"):
        compute_elastic_config({"elasticity": {**BLOCK, "version": 0.1}}, "0.19.8", world_size=3)
    with pytest.raises(ValueError, match="max_acceptable_batch_size: 3"):
        compute_elastic_config({"elasticity": {**BLOCK, "max_train_batch_size": 3, "micro_batch_sizes": [4]}},
                               "0.19.8", world_size=1)  # fmt: skip


def test_resolution_keeps_the_global_batch_across_world_sizes_and_says_why():
    config = parse_config({"elasticity": BLOCK})
    one, two = (resolve_config(config, AutoContext(world_size=w)) for w in (1, 2))
    assert one.batch.train_batch_size == two.batch.train_batch_size == 16
    assert (one.batch.gradient_accumulation_steps, two.batch.gradient_accumulation_steps) == (4, 2)
    assert "elasticity: valid on world sizes [1, 2], here 2" in two.report()


def test_version_0_2_fits_the_batch_to_a_world_size_outside_the_set():
    """As DeepSpeed 0.18 did: a world size outside [min_gpus, max_gpus] trains the largest multiple of its
    micro-batch that fits max_train_batch_size (version 0.1 refuses it instead)."""
    three = resolve_config(parse_config({"elasticity": BLOCK}), AutoContext(world_size=3))
    assert (three.batch.train_batch_size, three.batch.micro_batch_size) == (12, 4)
    with pytest.raises(ValueError, match=r"elasticity: World size \(3\) is not valid.*start a valid number of ranks"):
        resolve_config(parse_config({"elasticity": {**BLOCK, "version": 0.1}}), AutoContext(world_size=3))


def test_batch_keys_beside_elasticity_need_the_ignore_flag():
    with pytest.raises(ValueError, match=r"also sets \['train_batch_size'\]"):
        resolve_config(parse_config({"train_batch_size": 8, "elasticity": BLOCK}), AutoContext(world_size=1))
    config = parse_config({"train_batch_size": 8, "elasticity": {**BLOCK, "ignore_non_elastic_batch_info": True}})
    assert resolve_config(config, AutoContext(world_size=1)).batch.train_batch_size == 16


def test_checkpoint_block_needs_a_directory():
    with pytest.raises(ValueError, match="checkpoint.save_interval_steps needs checkpoint.save_dir"):
        parse_config({"train_batch_size": 2, "checkpoint": {"save_interval_steps": 5}})
    config = parse_config({"train_batch_size": 2, "checkpoint": {"save_dir": "ck", "auto_resume": True}})
    assert config.checkpoint.auto_resume and config.checkpoint.save_interval_steps == 0


@pytest.mark.parametrize("sizes", [[True], [2, False], [2.5], ["4"], [], [0]])
def test_micro_batch_sizes_are_strict_positive_integers(sizes):
    with pytest.raises(ValueError, match="micro_batch_sizes must be a list of positive integers"):
        parse_config({"elasticity": {**BLOCK, "micro_batch_sizes": sizes}})
