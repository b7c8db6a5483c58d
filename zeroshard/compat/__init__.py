"""Compatibility layers: zeroshard under the names other tools expect (today: DeepSpeed's).

Nothing here is a second implementation; every name is a re-export of, or a thin adapter over, a zeroshard
module. :func:`install_as_deepspeed` makes ``import deepspeed`` resolve to :mod:`zeroshard.compat.deepspeed`.
"""

from .alias import DEEPSPEED_API_VERSION, install_as_deepspeed

__all__ = ["DEEPSPEED_API_VERSION", "install_as_deepspeed"]
