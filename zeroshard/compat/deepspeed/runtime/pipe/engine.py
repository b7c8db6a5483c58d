"""``deepspeed.runtime.pipe.engine``: the pipeline engine ``initialize`` returns for a ``PipelineModule`` is
zeroshard's (``zeroshard.runtime.pipeline_engine``)."""

from .....pipe import PipelineError
from .....runtime.pipeline_engine import PipelineEngine

# the names of DeepSpeed's pipeline timers (clients' engine subclasses import them): zeroshard's timers of the same
# work are ``train_batch`` and ``pipe_wait`` (engine.get_wall_clock_timers())
BATCH_INPUT_TIMER = "batch_input"
TRAIN_BATCH_TIMER = "train_batch"
PIPE_SEND_OUTPUT_TIMER = "pipe_send_output"
PIPE_SEND_GRAD_TIMER = "pipe_send_grad"
PIPE_RECV_INPUT_TIMER = "pipe_recv_input"
PIPE_RECV_GRAD_TIMER = "pipe_recv_grad"

__all__ = [
    "BATCH_INPUT_TIMER",
    "PIPE_RECV_GRAD_TIMER",
    "PIPE_RECV_INPUT_TIMER",
    "PIPE_SEND_GRAD_TIMER",
    "PIPE_SEND_OUTPUT_TIMER",
    "PipelineEngine",
    "PipelineError",
    "TRAIN_BATCH_TIMER",
]
