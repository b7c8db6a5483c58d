"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` layer. zeroshard has no expert layers yet: importing works,
constructing one is refused by name (a model whose experts are plain modules trains with them replicated)."""

from .._not_built import not_built

MoE = not_built("deepspeed.moe.layer.MoE", "expert parallelism is not implemented yet; experts would be replicated")

__all__ = ["MoE"]
