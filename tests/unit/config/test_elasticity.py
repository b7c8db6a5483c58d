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


def test_world_sizes_outside_the_block_are_refused_even_where_the_batch_divides():
    batch = choose_batch(16, [2, 4], 1, 2)
    with pytest.raises(ValueError, match=r"world size 4 cannot train .* valid world sizes: \[1, 2\]"):
        micro_batch_for(batch, 4, [2, 4])  # 16 = 4 ranks x 4: divides, but max_gpus is 2
    nodes = choose_batch(48, [2], 2, 8, gpus_per_node=2)
    assert nodes.valid_world_sizes == (2, 4, 6, 8)
    with pytest.raises(ValueError, match="world size 3 cannot train"):
        micro_batch_for(nodes, 3, [2])  # 48 = 3 x 2 x 8 divides; 3 ranks are not whole nodes of 2
    with pytest.raises(ValueError, match="world size 3 cannot train"):
        resolve_config(parse_config({"elasticity": {**BLOCK, "max_gpus": 2}}), AutoContext(world_size=3))


@pytest.mark.parametrize("sizes", [[True], [2, False], [2.5], ["4"], [], [0]])
def test_micro_batch_sizes_are_strict_positive_integers(sizes):
    with pytest.raises(ValueError, match="micro_batch_sizes must be a list of positive integers"):
        parse_config({"elasticity": {**BLOCK, "micro_batch_sizes": sizes}})


def test_the_search_is_a_sieve_equal_to_testing_every_batch():
    """Same answer as trying each batch's divisors (the old search, 53 s at 1e6), at every size tried here."""
    for args in [(96, [2, 4, 6], 1, 8, True, 1), (200, [3, 5], 2, 12, False, 2), (60, [1], 1, 60, True, 1)]:
        limit, micros, low, high, larger, per_node = args
        counted = {b: len(valid_world_sizes(b, micros, low, high, per_node)) for b in range(1, limit + 1)}
        most = max(counted.values())
        best = [b for b, n in counted.items() if n == most]
        assert choose_batch(*args).train_batch_size == (best[-1] if larger else best[0]), args
    big = choose_batch(10**6, [2, 4, 6], 1, 10000)  # answers at once; the old search took 53 s
    assert big.train_batch_size <= 10**6 and len(big.valid_world_sizes) > 100
    with pytest.raises(ValueError, match="max_train_batch_size"):
        parse_config({"elasticity": {**BLOCK, "max_train_batch_size": 10**9}})
