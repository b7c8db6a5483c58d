"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layer classes. zeroshard's tensor parallelism keeps the
model's own modules (``zeroshard.tensor_parallel``); gathering their pieces for a weight sync goes through
``engine.consolidated_state_dict()``."""

from .._not_built import not_built

GatherReplacedLayerParams = not_built(
    "deepspeed.module_inject.layers.GatherReplacedLayerParams",
    "AutoTP's replaced layers do not exist here; gather full weights with engine.consolidated_state_dict()",
)

__all__ = ["GatherReplacedLayerParams"]
