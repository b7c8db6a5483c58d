"""``deepspeed.runtime.bf16_optimizer``: importable (clients test ``isinstance(engine.optimizer, BF16_Optimizer)``);
constructing DeepSpeed's bf16 wrapper is refused by name."""

from .._not_built import not_built

BF16_Optimizer = not_built(
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer",
    "DeepSpeed's bf16 wrapper around an optimizer: zeroshard's ZeRO stack keeps fp32 master weights for bf16 at "
    "every stage (pass the torch optimizer, or the config's optimizer block, to initialize)",
)

__all__ = ["BF16_Optimizer"]
