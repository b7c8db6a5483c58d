"""DeepSpeed's layer specifications (``deepspeed.pipe.LayerSpec``, ``TiedLayerSpec``): a layer described by its class
and arguments, built only on the stage that holds it, so a model larger than one rank is never built whole.

A :class:`TiedLayerSpec` names a module several stages hold one copy each of (GPT's input embedding reused as the
output head): the copies start equal and their gradients are summed over the stages holding them, so they stay
equal. ``forward_fn(module, inputs)`` lets a stage use the tied module differently (the head multiplies by the
embedding's weight).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from torch import nn


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built when the stage holding it asks (:meth:`build`)."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec builds torch.nn.Module classes, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        arguments = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(arguments)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared, under ``key``, by every stage whose layers name it; ``tied_weight_attr``: the attribute path(s)
    of the tied tensor(s) (``"weight"``, or ``"word_embeddings.weight"``)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args,
        forward_fn: Optional[Callable] = None,
        tied_weight_attr: Union[str, Sequence[str]] = ("weight",),
        **module_kwargs,
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec key must be a non-empty string, got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec forward_fn must be callable, got {forward_fn!r}")
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise TypeError(f"TiedLayerSpec tied_weight_attr names attributes, got {tied_weight_attr!r}")
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, attrs
