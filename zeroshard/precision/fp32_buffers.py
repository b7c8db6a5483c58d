"""The buffers a model keeps in fp32 while the rest of it trains in bf16 or fp16 (DeepSpeed 0.19.8's
``data_types.keep_in_fp32_modules``).

Hugging Face models name such tensors in two class attributes: ``_keep_in_fp32_modules_strict`` (fp32 under bf16 and
fp16) and ``_keep_in_fp32_modules`` (fp32 under fp16 only). The case that matters is a MoE router's
``e_score_correction_bias`` (DeepSeek-V3 and its descendants): its values lie close together far from zero, where bf16's
steps are coarser than their differences, so a bf16 copy changes which experts tokens go to.

``keep_in_fp32_modules`` selects the names: ``"auto"`` (the model's own lists), a list of patterns (``*`` stands for
any characters; a pattern may match anywhere in the buffer's full name, as transformers matches them), or ``[]``
(nothing). Only buffers are kept; parameters follow the training dtype, as in DeepSpeed.

A pattern is matched by finding its pieces between ``*`` in order, leftmost first, which is exact for this kind of
pattern and linear in the name: no regular expression is built from a config or a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence, Union

import torch

AUTO = "auto"
FP32Buffers = Union[str, tuple[str, ...]]  # AUTO, or patterns


@dataclass(frozen=True)
class NameRule:
    """Buffers under ``prefix`` (a module's path and a dot; "" for the whole model) whose remaining name contains
    ``pattern``'s pieces in order."""

    prefix: str
    pattern: str

    def matches(self, name: str) -> bool:
        if not name.startswith(self.prefix):
            return False
        position = len(self.prefix)
        for piece in self.pattern.split("*"):
            found = name.find(piece, position)
            if found < 0:
                return False
            position = found + len(piece)
        return True


def fp32_buffer_rules(module: torch.nn.Module, setting: FP32Buffers, compute: torch.dtype) -> tuple[NameRule, ...]:
    """What ``setting`` keeps in fp32 of ``module`` when it trains in ``compute`` (nothing under fp32)."""
    if compute not in (torch.float16, torch.bfloat16):
        return ()
    if setting != AUTO:
        return tuple(NameRule("", pattern) for pattern in setting)
    rules = []
    for path, child in module.named_modules():
        names = list(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
        if compute == torch.float16:
            names += list(getattr(child, "_keep_in_fp32_modules", None) or [])
        rules += [NameRule(f"{path}." if path else "", name) for name in names if isinstance(name, str)]
    return tuple(dict.fromkeys(rules))


def fp32_buffers(module: torch.nn.Module, rules: Sequence[NameRule]) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating buffers of ``module`` some rule keeps in fp32, with their full names."""
    if not rules:
        return
    for name, buffer in module.named_buffers():
        if buffer.is_floating_point() and any(rule.matches(name) for rule in rules):
            yield name, buffer


__all__ = ["AUTO", "FP32Buffers", "NameRule", "fp32_buffer_rules", "fp32_buffers"]
