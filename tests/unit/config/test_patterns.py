"""Patterns matched against every module name (``layer_specs``) are bounded before they run: the four shapes that
took over 20 s on one Llama name, and generated ones of the same kinds, are refused by name when the config is read;
accepted patterns run on worst-case names; a name longer than the config's check is bounded at the match."""

import random

import pytest

from zeroshard.config import parse_config
from zeroshard.config.patterns import MAX_WAYS, NAME_LENGTH, PatternCostError, check_pattern, match_ways

NAME = "model.layers.0.self_attn.q_proj.weight"
REPORTED = [".*" * 12 + "Z", "(.*){1,40}Z", "(.*?){30}Z", "(.*.*){12}Z"]


def _config(pattern: str) -> dict:
    block = {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": [pattern]}]}}
    return {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": block}


@pytest.mark.parametrize("pattern", REPORTED)
def test_the_reported_patterns_are_refused_by_name_when_the_config_is_read(pattern):
    with pytest.raises(ValueError, match="can backtrack in more than 1e\\+07 ways on a module name") as caught:
        parse_config(_config(pattern))
    assert repr(pattern) in str(caught.value)


UNBOUNDED = [".*", ".+", ".*?", r"\d+", "[a-z_.]*", r"\w+", "(?:.*)", "(.*?)", "[^Z]*"]


def _slow(rng: random.Random) -> str:
    """A pattern of one of the reported kinds: at least four unbounded repeats in a row (literals between them that
    every name has), a bounded repeat of a group holding one, or alternatives repeated many times; then a character
    the name lacks, so the match fails after trying every way."""
    kind = rng.choice(["row", "bounded", "nested", "alternatives"])
    if kind == "row":
        parts = [rng.choice(UNBOUNDED) + rng.choice(["", r"\.", "a", "l"]) for _ in range(rng.randint(4, 14))]
        body = "".join(parts)
    elif kind == "bounded":
        count = rng.randint(4, 60)
        body = f"({rng.choice(UNBOUNDED)}){{{rng.choice([f'{count}', f'1,{count}', f'0,{count}'])}}}"
    elif kind == "nested":
        inner = "".join(rng.choice(UNBOUNDED) for _ in range(rng.randint(2, 4)))
        body = f"(?:{inner}){{{rng.randint(2, 12)}}}"
    else:
        body = f"(a|a|{rng.choice(['a', 'aa', '.'])}){{{rng.randint(16, 40)}}}"
    return body + rng.choice(["Z", "Z$", "#"])


@pytest.mark.parametrize("seed", range(200))
def test_generated_patterns_of_those_kinds_are_refused(seed):
    pattern = _slow(random.Random(seed))
    with pytest.raises(PatternCostError):
        check_pattern(pattern)


WORST_NAMES = ["a" * NAME_LENGTH, "1" * NAME_LENGTH, "." * NAME_LENGTH, ("layers.0." * NAME_LENGTH)[:NAME_LENGTH]]
ACCEPTED = [  # (pattern, whether it matches NAME's module)
    (r".*\.self_attn\.[qkv]_proj$", True),
    (r".*\.layers\.\d+\.self_attn\..*_proj$", True),
    (r"model\.layers\.\d+\.self_attn\.(q|k)_proj", True),
    (r".*.*.*Z", False),
    (r"(?:.*\.){3}q_proj", True),
    (r"(ab|b){10}", False),
]


@pytest.mark.parametrize("pattern,matches", ACCEPTED)
def test_accepted_patterns_are_bounded_and_run_on_the_worst_names(pattern, matches):
    """Three unbounded repeats in a row are accepted (real specs use up to three); each runs to its answer on names
    of the checked length made of the characters it repeats over."""
    import re

    check_pattern(pattern)
    assert match_ways(pattern, NAME_LENGTH) <= MAX_WAYS
    for name in WORST_NAMES:
        re.match(pattern, name)
    assert bool(re.match(pattern, NAME.removesuffix(".weight"))) == matches


def test_a_name_longer_than_the_checked_length_is_bounded_at_the_match():
    """``.*.*.*Z`` is accepted for names of 128 characters; on a 1000-character module name it could backtrack in
    about 1e9 ways (minutes with a fourth repeat), so the match refuses by name instead of running."""
    from zeroshard.tensor_parallel.placement import LayerSpec

    spec = LayerSpec((r".*.*.*Z",), "column")
    assert not spec.matches(NAME, None)
    long_name = "model." + "a" * 1000
    with pytest.raises(PatternCostError, match=r"could backtrack .* on module name 'model\.aaa"):
        spec.matches(long_name, None)


@pytest.mark.parametrize("pattern", ["(", "a{2,1}", 5])
def test_patterns_that_are_not_regular_expressions_are_refused(pattern):
    with pytest.raises(ValueError, match="pattern"):
        check_pattern(pattern)


def test_the_bound_counts_as_the_docstring_says():
    assert match_ways(r"abc", 10) == 1
    assert match_ways(r".*", 10) == 12  # 0..11 copies (a body that can stop after one empty round)
    assert match_ways(r"(ab|b|c)", 10) == 3
    assert match_ways(r"(?:.*){3}", 10) == 12**3
    assert match_ways(r".*" * 40, 10) == 10**30  # counted up to 1e30
