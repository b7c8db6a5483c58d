"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's pluggable file writer, which clients use for their own files
(ArcticTraining's MoE checkpoints) or patch (open-instruct). zeroshard's own checkpoints never go through it."""

from . import torch_checkpoint_engine
from .torch_checkpoint_engine import CheckpointCommitInfo, CheckpointEngine, TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine", "torch_checkpoint_engine"]
