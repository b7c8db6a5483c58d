"""Reading a config from a dict or JSON file, with errors that name the key, the value and the fix."""

from __future__ import annotations

import difflib
import json
import os
import typing
import warnings
from pathlib import Path
from typing import Any, Iterator, Union

from pydantic import BaseModel, ValidationError

from .schema import REMOVED_IN_DEEPSPEED, UNSUPPORTED_FEATURE_BLOCKS, ZeroshardConfig
from .section import ConfigError

ConfigSource = Union[dict, str, os.PathLike, ZeroshardConfig]


def parse_config(source: ConfigSource) -> ZeroshardConfig:
    """Validate a config dict (or the path of a JSON file) into a :class:`ZeroshardConfig`."""
    if isinstance(source, ZeroshardConfig):
        return source
    source = _without_foreign_top_level_keys(load_json_or_dict(source))
    _check_depth(source)
    try:
        config = ZeroshardConfig.model_validate(source)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    _reject_enabled_unsupported(config)
    reject_refused(config, written=source)
    unheeded = keys_not_acted_on(config, written=source)
    if unheeded:
        warnings.warn(
            "config keys accepted but not acted on by zeroshard: "
            + "; ".join(f"'{key}' = {value!r} ({why})" for key, value, why in unheeded),
            UserWarning,
            stacklevel=2,
        )
    return config


def _without_foreign_top_level_keys(source: dict) -> dict:
    """DeepSpeed reads the top level of its config with ``get`` and ignores keys it does not know (LLaMA-Factory's
    example configs carry ``comms_config`` and ``monitor_config``); its sections are strict, and so are ours. A
    top-level key within two edits of a known one is a typo and stays, so that validation refuses it with
    did-you-mean; any other unknown key is named in a warning and dropped."""
    known = _keys_of(ZeroshardConfig)
    foreign = [k for k in source if k not in known and not any(_is_typo(k, name) for name in known)]
    if foreign:
        warnings.warn(
            f"config keys {foreign} are not DeepSpeed or zeroshard keys; ignored (as DeepSpeed ignores them)",
            UserWarning,
            stacklevel=3,
        )
    return {k: v for k, v in source.items() if k not in foreign}


def _is_typo(key: str, known: str) -> bool:
    """Within two single-character edits (insert, delete, replace, swap of neighbours), one for short keys; or a
    known key cut short (``gradient_clip`` for ``gradient_clipping``)."""
    if not isinstance(key, str):
        return False
    if len(key) >= 8 and known.lower().startswith(key.lower()):
        return True
    budget = 1 if len(known) <= 5 else 2
    if abs(len(key) - len(known)) > budget:
        return False
    a, b = key.lower(), known.lower()
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            current[j] = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + cost)
            if previous is not None and i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous[j - 2] + 1)
        previous, row = row, current
    return row[-1] <= budget


def marked_fields(section: BaseModel, path: str = "", written: Any = None) -> Iterator[tuple[str, Any, Any, dict]]:
    """(key as the config spells it, value, default, schema marks) of every field of ``section`` and the sections
    inside it (``written``: the dict it was read from; a key it does not hold gets DeepSpeed's name)."""
    written = written if isinstance(written, dict) else {}
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        spelling = name if name in written else field.alias or name
        key = f"{path}{spelling}"
        yield key, value, field.get_default(call_default_factory=True), field.json_schema_extra or {}
        if isinstance(value, BaseModel):
            yield from marked_fields(value, f"{key}.", written.get(spelling))
        elif isinstance(value, list):
            items = written.get(spelling)
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    given = items[index] if isinstance(items, list) and index < len(items) else None
                    yield from marked_fields(item, f"{key}[{index}].", given)


def reject_refused(section: BaseModel, written: Any = None) -> None:
    """Refuse, naming the key as the config spells it, any value but the default of a key zeroshard parses but does
    not implement."""
    for key, value, default, marks in marked_fields(section, written=written):
        if "refused" in marks and value not in (default, "auto"):
            raise NotImplementedError(
                f"config key '{key}' = {value!r} is not implemented by zeroshard ({marks['refused']}); remove the "
                f"key or set it to {default!r}"
            )


def keys_not_acted_on(section: BaseModel, written: Any = None) -> list[tuple[str, Any, str]]:
    """(key as the config spells it, value, why) for each key marked ``warned`` whose value is not its default."""
    return [
        (key, value, marks["warned"])
        for key, value, default, marks in marked_fields(section, written=written)
        if "warned" in marks and value != default
    ]


def load_json_or_dict(source: Union[dict, str, os.PathLike]) -> dict:
    """A config dict as given, or read from the JSON file it names."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise ConfigError(f"config file '{path}' is a directory; pass the JSON file inside it")
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            source = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys, parse_int=_parse_int)
            _refuse_long_integers(source, path)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file '{path}' is not valid JSON: {err}") from None
        except RecursionError:
            raise ConfigError(f"config file '{path}' nests deeper than JSON can be read: not a config") from None
        except _DuplicateKey as err:
            raise ConfigError(f"config file '{path}': {err}") from None
    if not isinstance(source, dict):
        raise TypeError(f"config must be a dict or a path to a JSON file, got {type(source).__name__}")
    return dict(source)


MAX_INTEGER_DIGITS = 30  # far beyond any count or size a config holds; Python refuses over 4300 with no key named


class _LongInteger(str):
    """An integer literal of more than MAX_INTEGER_DIGITS digits, kept as text until its key is known."""


def _parse_int(text: str):
    return _LongInteger(text) if len(text.lstrip("-")) > MAX_INTEGER_DIGITS else int(text)


def _refuse_long_integers(source: Any, path: Path) -> None:
    pending = [(source, "")]
    while pending:
        node, where = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            at = f"{where}.{key}" if where else str(key)
            if isinstance(value, _LongInteger):
                raise ConfigError(
                    f"config file '{path}': key '{at}' holds an integer of {len(value.lstrip('-'))} digits "
                    f"({value[:12]}...); no config value needs more than {MAX_INTEGER_DIGITS}"
                )
            if isinstance(value, (dict, list)):
                pending.append((value, at))


MAX_DEPTH = 32  # DeepSpeed's deepest block is 4 levels down; free-form blocks (optimizer.params) add a few


def _check_depth(source: dict) -> None:
    """Refuse a config nested deeper than any real one, by name, before validation recurses into it (a crafted
    file 10,000 levels deep would otherwise end in Python's RecursionError)."""
    pending = [(source, 1, "")]
    while pending:
        node, depth, path = pending.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"config nests deeper than {MAX_DEPTH} levels (at '{path[:200]}...'): not a config")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, (dict, list)):
                pending.append((value, depth + 1, f"{path}.{key}" if path else str(key)))


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """JSON lets a key appear twice and keeps the last; a config where it happens is a mistake to point out."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key '{key}' appears twice in one object ({out[key]!r} and {value!r}); keep one")
        out[key] = value
    return out


def _reject_enabled_unsupported(config: ZeroshardConfig) -> None:
    for key, enabled_by_default in UNSUPPORTED_FEATURE_BLOCKS.items():
        block = getattr(config, key)
        if block is not None and block.get("enabled", enabled_by_default):
            raise NotImplementedError(
                f"config key '{key}' enables a DeepSpeed feature zeroshard does not implement; "
                f"remove the '{key}' block or set \"enabled\": false"
            )
    for key, feature in REMOVED_IN_DEEPSPEED.items():
        block = getattr(config, key)
        if block is None:
            continue
        if block.get("enabled", True) is False:
            warnings.warn(f"config key '{key}' (disabled): DeepSpeed 0.19 removed {feature}; remove it", stacklevel=3)
            continue
        raise NotImplementedError(
            f"config key '{key}': DeepSpeed 0.19 removed {feature} (its config reader refuses the block) and "
            f"zeroshard does not implement it; remove the '{key}' block"
        )


def _keys_of(model: type[BaseModel]) -> dict[str, type | None]:
    """Accepted keys of a section (names and aliases), each with its sub-section model if any."""
    keys: dict[str, type | None] = {}
    for name, field in model.model_fields.items():
        sub = next((t for t in _flatten(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)
        keys[name] = sub
        if field.alias:
            keys[field.alias] = sub
    return keys


def _flatten(annotation: Any) -> list:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [t for arg in args for t in _flatten(arg)]


def _clean_path(loc: tuple, root: type[BaseModel]) -> tuple[str, dict[str, type | None]]:
    """Drop pydantic's union-branch tags from an error location; return the key path and the parent's keys."""
    keys: dict[str, type | None] | None = _keys_of(root)
    parent_keys: dict[str, type | None] = keys
    free_form = False  # inside a dict-valued field such as optimizer.params: every part is a key
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif free_form:
            parts.append(part)
        elif keys is not None:
            parts.append(part)
            parent_keys = keys
            sub = keys.get(part)
            free_form = part not in keys or _is_dict_field(parent_keys, part)
            keys = _keys_of(sub) if sub is not None else None
        # else: a union-branch tag after a scalar field ("int", "literal['auto']"): not part of the path
    return ".".join(parts).replace(".[", "["), parent_keys


def _is_dict_field(keys: dict[str, type | None], name: str) -> bool:
    return keys.get(name) is None and name in _DICT_FIELDS


_DICT_FIELDS = {"params", "zeropp_loco_param", "parallel_write", "timers", *UNSUPPORTED_FEATURE_BLOCKS,
                *REMOVED_IN_DEEPSPEED}  # fmt: skip


def format_validation_error(
    err: ValidationError, root: type[BaseModel] = ZeroshardConfig, what: str = "zeroshard/DeepSpeed config"
) -> str:
    messages: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    unknown: list[str] = []
    for e in err.errors():
        path, parent_keys = _clean_path(e["loc"], root)
        if e["type"] == "extra_forbidden":
            leaf = path.rsplit(".", 1)[-1]
            close = difflib.get_close_matches(leaf, list(parent_keys), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; remove it or check its spelling"
            unknown.append(f"unknown config key '{path}'{hint}")
            continue
        messages.setdefault(path, []).append(e["msg"].removeprefix("Value error, "))
        values[path] = e.get("input")
    lines = list(unknown)
    for path, reasons in messages.items():
        where = f"config key '{path}' = {_shown(values[path])}" if path else "config"
        lines.append(f"{where}: {' or '.join(dict.fromkeys(reasons))}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def _shown(value: Any) -> str:
    """A value for an error message: its repr, at most 120 characters (an integer of thousands of digits has no repr
    Python will write)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 100:
        return f"<an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits>"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
