"""What every section of the config shares: strict keys (an unknown key is an error naming it), numbers that are
numbers, switches that are switches, one key given under two spellings refused unless equal; the markers of keys
zeroshard parses but refuses (``refused``), already satisfies (``satisfied``) or accepts without acting on
(``warned``); and DeepSpeed's deprecated
spellings moved to their current keys (``rename_deprecated``)."""

from __future__ import annotations

import math
import typing
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Auto = Literal["auto"]  # a value "auto" stands for until :mod:`.resolve` fills it in
DTypeName = Literal["fp32", "fp16", "bf16"]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key, the value and the fix. DeepSpeed's
    ``DeepSpeedConfigError`` is this class."""


class Section(BaseModel):
    """Every config section rejects unknown keys and accepts both field names and DeepSpeed aliases.

    Numbers are numbers: ``true``/``false`` is refused where a number is expected (JSON would otherwise make
    ``"stage": true`` stage 1), and so are NaN and infinity (``gradient_clipping: NaN`` would disable
    clipping). Switches are switches: a string (``"enabled": "yes"``, ``"false"``) is refused where only
    ``true``/``false`` is meant (``"auto"`` where a key takes it). A key and its DeepSpeed alias together
    (``bf16`` and ``bfloat16``) are one key given twice: refused unless equal."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        for name, field in cls.model_fields.items():
            if field.alias and name in values and field.alias in values and values[name] != values[field.alias]:
                raise ValueError(
                    f"'{name}' and '{field.alias}' are one key (DeepSpeed reads either spelling) given twice with "
                    "different values; keep one"
                )
            key = next((k for k in (name, field.alias) if k and k in values), None)
            if key is None:
                continue
            value = values[key]
            if _takes_number(field.annotation):
                if isinstance(value, bool):
                    raise ValueError(f"'{key}' must be a number, not {str(value).lower()}")
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"'{key}' must be a finite number, not {value}")
            elif _is_switch(field.annotation) and isinstance(value, str) and value != "auto":
                raise ValueError(f"'{key}' must be true or false, not the string {value!r}")
        twice = {field.alias for name, field in cls.model_fields.items() if field.alias and name in values
                 and field.alias in values}  # fmt: skip
        return {k: v for k, v in values.items() if k not in twice} if twice else values


def _is_switch(annotation: Any) -> bool:
    """The field takes a bool and no string but "auto" (``Union[bool, Auto]``, ``Optional[bool]``)."""
    args = typing.get_args(annotation) or (annotation,)
    kinds = {a for arg in args for a in (typing.get_args(arg) or (arg,))}
    return bool in kinds and str not in kinds


def _takes_number(annotation: Any) -> bool:
    """The field accepts an int or a float (and not a bool)."""
    args = typing.get_args(annotation) or (annotation,)
    kinds = {a for arg in args for a in (typing.get_args(arg) or (arg,))}
    return bool(kinds & {int, float}) and bool not in kinds


def refused(default: Any, reason: str, **kwargs) -> Any:
    """A DeepSpeed key zeroshard parses but does not implement: any value but ``default`` is refused with a
    ``NotImplementedError`` naming the key (``parse_config``)."""
    return Field(default, json_schema_extra={"refused": reason}, **kwargs)


def satisfied(default: Any, reason: str, **kwargs) -> Any:
    """A DeepSpeed key whose every value zeroshard already satisfies (a performance hint whose effect is
    built in, or a guarantee zeroshard always gives); ``reason`` says why, and the docs list it."""
    return Field(default, json_schema_extra={"satisfied": reason}, **kwargs)


def warned(default: Any, reason: str, **kwargs) -> Any:
    """A DeepSpeed key zeroshard accepts and does not act on (a tuning knob of a mechanism it replaces): any value but
    ``default`` is named, with ``reason``, in the one warning ``parse_config`` gives for all such keys."""
    return Field(default, json_schema_extra={"warned": reason}, **kwargs)


def rename_deprecated(values: Any, old: str, new: str) -> Any:
    """Move a deprecated key to its new name, refusing a conflicting value under both names."""
    if not isinstance(values, dict) or old not in values:
        return values
    values = dict(values)
    value = values.pop(old)
    if new in values and values[new] != value:
        raise ValueError(f"'{old}' (deprecated) and '{new}' disagree ({value!r} vs {values[new]!r}); keep only '{new}'")
    warnings.warn(f"config key '{old}' is deprecated; use '{new}'", FutureWarning, stacklevel=2)
    values[new] = value
    return values


__all__ = ["ConfigError", "Section", "refused", "rename_deprecated", "satisfied", "warned"]
