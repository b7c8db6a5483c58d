"""``deepspeed.elasticity.compute_elastic_config`` answers as DeepSpeed's last elasticity (0.18.9) answered, on every
input of the grid its own code was run on (``tests/fixtures/deepspeed_elasticity``: 2568 calls, versions 0.1 and
0.2, nodes and model parallelism, valid and invalid world sizes, malformed blocks). Where DeepSpeed crashed
(TypeError, ZeroDivisionError) zeroshard raises ``ElasticityConfigError`` naming the cause instead."""

import json
from pathlib import Path

import pytest

from zeroshard.compat.deepspeed import elasticity

_SAVED = json.loads(
    (Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_elasticity" / "expected.json").read_text()
)
RECORDS = [{**call, "ds_config": _SAVED["configs"][call["config"]]} for call in _SAVED["calls"]]
CRASHES = {"TypeError", "ZeroDivisionError", "AssertionError"}  # DeepSpeed's own failures: named errors here


def _call(case: dict):
    return elasticity.compute_elastic_config(
        case["ds_config"], case["target"], world_size=case["world_size"],
        return_microbatch=case["return_microbatch"],
    )  # fmt: skip


def test_every_recorded_answer_of_deepspeed_0_18(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the records were made without it
    wrong = []
    for case in RECORDS:
        try:
            got = {"result": [list(r) if isinstance(r, list) else r for r in _call(case)]}
        except Exception as error:  # noqa: BLE001 - the class is compared with DeepSpeed's
            names = {c.__name__ for c in type(error).__mro__}
            expected = case.get("error")
            same = expected in names or (expected in CRASHES and isinstance(error, elasticity.ElasticityConfigError))
            got = {"error": expected if same else type(error).__name__, "message": str(error)}
        if "result" in case:
            ok = got.get("result") == case["result"] and all(
                type(a) is type(b) for a, b in zip(got["result"], case["result"])
            )
        else:
            ok = got.get("error") == case["error"]
        if not ok:
            wrong.append((case, got))
    assert not wrong, f"{len(wrong)} of {len(RECORDS)} differ; first: {wrong[:3]}"


def test_the_grid_covers_both_versions_errors_and_the_world_size_fallback():
    versions = {
        c["ds_config"].get("elasticity", {}).get("version") for c in RECORDS if isinstance(c["ds_config"], dict)
    }
    assert {0.1, 0.2} <= versions
    errors = {c["error"] for c in RECORDS if "error" in c}
    assert errors >= {"ElasticityConfigError", "ElasticityIncompatibleWorldSize", "ElasticityError", "ValueError"}
    assert "TypeError" in errors  # DeepSpeed's crash where no candidate batch is valid anywhere
    # version 0.2 at a world size outside the elastic set: DeepSpeed fits the batch to that world instead
    fallback = [c for c in RECORDS if "result" in c and c["world_size"] and c["result"][1] == [c["world_size"]]]
    assert len(fallback) > 10


def test_ms_swift_calls_it_with_its_keywords(monkeypatch):
    """ms-swift's prepare_deepspeed_elastic_config: keywords ds_config, target_deepspeed_version, world_size."""
    from zeroshard.compat.deepspeed.git_version_info import version

    block = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 2}
    batch, valid, micro = elasticity.compute_elastic_config(
        ds_config={"elasticity": block}, target_deepspeed_version=version, world_size=2
    )
    assert (batch, valid, micro) == (16, [1, 2], 4)
    with pytest.raises(elasticity.ElasticityConfigError, match="Elasticity V 0.2 needs WORLD_SIZE"):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        elasticity.compute_elastic_config(ds_config={"elasticity": block}, target_deepspeed_version=version)


BLOCK = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4}


@pytest.mark.parametrize(
    "change,said",
    [
        (lambda b: [b], "the 'elasticity' block must be a dict"),
        (lambda b: {**b, "micro_batch_sizes": []}, "micro_batch_sizes is empty"),
        (lambda b: {**b, "max_train_batch_size": float("nan")}, "max_train_batch_size must be a finite number"),
        (lambda b: {**b, "max_train_batch_size": "16"}, "max_train_batch_size must be a finite number"),
        (lambda b: {**b, "max_gpus": "4"}, "max_gpus must be an integer"),
        (lambda b: {**b, "version": "new"}, "version 'new' is not a number"),
    ],
    ids=["list-block", "no-micro-batches", "nan-max", "string-max", "string-gpus", "text-version"],
)
def test_the_public_function_names_malformed_blocks(change, said):
    """DeepSpeed 0.18 crashed on these (ValueError from min(), TypeError, AttributeError); the config's schema
    refused them already, the public function now does too."""
    with pytest.raises(elasticity.ElasticityConfigError, match=said):
        elasticity.compute_elastic_config({"elasticity": change(BLOCK)}, "0.19.8", world_size=2)


@pytest.mark.parametrize("world_size", [-3, 2.0, True, "2"])
def test_a_world_size_that_is_not_a_count_is_refused(world_size):
    with pytest.raises(elasticity.ElasticityConfigError, match="world_size must be a non-negative int"):
        elasticity.compute_elastic_config({"elasticity": BLOCK}, "0.19.8", world_size=world_size)


def test_the_batch_stays_within_max_train_batch_size():
    """DeepSpeed's PR 8237 (after 0.18): the micro-batches' least common multiple (120 for [8, 10, 12]) is no
    candidate above max_train_batch_size 100; 0.18 returned it."""
    block = {**BLOCK, "max_train_batch_size": 100, "micro_batch_sizes": [8, 10, 12], "max_gpus": 1500, "version": 0.1}
    batch, valid = elasticity.compute_elastic_config({"elasticity": block}, "0.19.8")
    assert batch == 96 and batch <= 100 and valid == [1, 2, 3, 4, 6, 8, 12]
