import pytest

from zeroshard.config import AutoContext, parse_config, resolve_config
from zeroshard.config.elasticity import choose_batch, micro_batch_for, valid_world_sizes

BLOCK = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 2}


def test_one_global_batch_for_every_world_size_in_range():
    batch = choose_batch(16, [2, 4], 1, 2)
    assert batch.train_batch_size == 16 and batch.valid_world_sizes == (1, 2)
    assert micro_batch_for(batch, 1, [2, 4]) == (4, 4) and micro_batch_for(batch, 2, [2, 4]) == (4, 2)
    assert choose_batch(16, [2, 4], 1, 2, prefer_larger_batch=False).train_batch_size == 4
    # the batch valid on the most world sizes wins over a larger one valid on fewer
    assert choose_batch(840, [1], 1, 8).valid_world_sizes == (1, 2, 3, 4, 5, 6, 7, 8)
    assert choose_batch(100, [1], 1, 8) == choose_batch(96, [1], 1, 8)  # 6 world sizes; the larger of the ties
    assert valid_world_sizes(24, [2], 1, 8, gpus_per_node=2) == (2, 4, 6)


def test_world_size_outside_the_elastic_set_is_refused_by_name():
    batch = choose_batch(16, [2, 4], 1, 2)
    with pytest.raises(ValueError, match=r"world size 3 cannot train the elastic global batch 16 .* \[1, 2\]"):
        micro_batch_for(batch, 3, [2, 4])
    with pytest.raises(ValueError, match="no global batch up to max_train_batch_size 3"):
        choose_batch(3, [4], 1, 2)


def test_resolution_keeps_the_global_batch_across_world_sizes_and_says_why():
    config = parse_config({"elasticity": BLOCK})
    one, two = (resolve_config(config, AutoContext(world_size=w)) for w in (1, 2))
    assert one.batch.train_batch_size == two.batch.train_batch_size == 16
    assert (one.batch.gradient_accumulation_steps, two.batch.gradient_accumulation_steps) == (4, 2)
    assert "elasticity: valid on world sizes [1, 2], here 2" in two.report()


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
