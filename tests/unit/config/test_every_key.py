"""Every config key zeroshard accepts does something: code reads it, or its every value is already satisfied
(declared with the reason), or any value but its default is refused with ``NotImplementedError`` naming it."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from zeroshard.config import parse_config
from zeroshard.config.schema import REMOVED_IN_DEEPSPEED, UNSUPPORTED_FEATURE_BLOCKS, ZeroshardConfig

PACKAGE = Path(__file__).resolve().parents[3] / "zeroshard"
SCHEMA_FILES = [
    PACKAGE / "config" / f"{block}.py" for block in ("schema", "zero_optimization", "parallelism", "monitoring")
]
SOURCE = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p not in SCHEMA_FILES)
SCHEMA = "\n".join(p.read_text() for p in SCHEMA_FILES)  # its properties and validators read some keys


def _section_of(annotation) -> type[BaseModel] | None:
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


# what an item of a list of sections needs besides the key under test
ITEM_REQUIRED = {"layer_specs": {"patterns": ["x"]}}


def walk(model: type[BaseModel] = ZeroshardConfig, path: tuple[str, ...] = ()):
    """(JSON key path, attribute name, field) for every field, sub-sections included; the first item of a list of
    sections is ``<key>[0]``."""
    for name, field in model.model_fields.items():
        keys = (*path, field.alias or name)
        yield keys, name, field
        section = _section_of(field.annotation)
        if section is not None:
            is_list = typing.get_origin(field.annotation) is list
            yield from walk(section, (*path, f"{keys[-1]}[0]") if is_list else keys)


FIELDS = list(walk())
REFUSED = [(keys, field) for keys, _, field in FIELDS if "refused" in (field.json_schema_extra or {})]


def test_no_field_is_parsed_and_ignored():
    ignored = []
    for keys, name, field in FIELDS:
        extra = field.json_schema_extra or {}
        if {"refused", "satisfied", "warned"} & set(extra) or _section_of(field.annotation) is not None:
            continue
        if name in UNSUPPORTED_FEATURE_BLOCKS or name in REMOVED_IN_DEEPSPEED:  # refused when enabled (parse_config)
            continue
        if not re.search(rf"\.{name}\b|\"{name}\"", SOURCE) and not re.search(rf"self\.{name}\b", SCHEMA):
            ignored.append(".".join(keys))
    assert not ignored, f"config keys no code reads (honour them, or mark them refused/satisfied/warned): {ignored}"


def _other_value(field):
    default = field.get_default(call_default_factory=True)
    args = typing.get_args(field.annotation) or (field.annotation,)
    if isinstance(default, bool):
        return not default
    if typing.get_origin(field.annotation) is typing.Literal:
        return next(v for v in typing.get_args(field.annotation) if v != default)
    if isinstance(default, float):
        return default / 2
    if isinstance(default, int):
        return default - 1 if default > 1 else default + 1
    if isinstance(default, list) or any(typing.get_origin(a) is list for a in args):
        return ["x"]
    if isinstance(default, dict) or any(typing.get_origin(a) is dict for a in args):
        return {"x": 1}
    if int in args:
        return 2
    if float in args:
        return 0.5
    if str in args:
        return "x"
    raise AssertionError(f"no other value for {field}")


def _nested(keys: tuple[str, ...], value) -> dict:
    config: dict = {"train_batch_size": 1, "optimizer": {"type": "Adam"}}
    node = config
    for key in keys[:-1]:
        if key.endswith("[0]"):
            name = key[:-3]
            node = node.setdefault(name, [dict(ITEM_REQUIRED.get(name, {}))])[0]
        else:
            node = node.setdefault(key, {})
    node[keys[-1]] = value
    return config


@pytest.mark.parametrize("keys,field", REFUSED, ids=[".".join(k) for k, _ in REFUSED])
def test_refused_keys_name_themselves(keys, field):
    value = _other_value(field)
    with pytest.raises(NotImplementedError, match=re.escape(f"config key '{'.'.join(keys)}' = {value!r}")):
        parse_config(_nested(keys, value))
    parse_config(_nested(keys, field.get_default(call_default_factory=True)))  # the default is accepted


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": True}}, "'stage' must be a number, not true"),
        ({"gradient_clipping": math.nan}, "'gradient_clipping' must be a finite number, not nan"),
        ({"train_micro_batch_size_per_gpu": False}, "must be a number, not false"),
        ({"fp16": {"initial_scale_power": math.inf}}, "must be a finite number, not inf"),
    ],
)
def test_booleans_and_non_finite_numbers_are_not_numbers(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(config)


def test_steps_per_print_infinity_means_never():
    assert parse_config({"train_batch_size": 1, "steps_per_print": math.inf}).steps_per_print is None


def test_duplicate_keys_and_directories_in_config_files(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(ValueError, match=r"key 'stage' appears twice in one object \(2 and 3\)"):
        parse_config(str(path))
    with pytest.raises(ValueError, match="is a directory"):
        parse_config(str(tmp_path))
