"""What a pipeline stage is told to do, one instruction at a time, pure: DeepSpeed's instruction classes, by their
names and fields, since its clients import them, yield them from schedules of their own and key their patches of
the engine by them (diffusion-pipe replaces ``PipelineEngine._INSTRUCTION_MAP[ReduceGrads]``).

An instruction is its class and its keyword fields, nothing more: a *buffer* instruction names the slot
(``buffer_id``) of the stage's in-flight micro-batches it reads or writes; the others act on the whole batch. What
each one does is the engine's (``zeroshard.runtime.pipeline_engine``: the function its ``_INSTRUCTION_MAP`` holds
for the class)."""

from __future__ import annotations


class PipeInstruction:
    """One instruction; its keyword arguments are its fields (``kwargs``, and each an attribute)."""

    def __init__(self, **kwargs):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({fields})"


class OptimizerStep(PipeInstruction):
    """Step the optimizer with the batch's reduced gradients (after :class:`ReduceGrads` and
    :class:`ReduceTiedGrads`); every stage joins it (the gradient norm is the whole model's)."""


class ReduceGrads(PipeInstruction):
    """Finish reducing the batch's gradients over the data-parallel ranks of the stage (launched bucket by bucket
    during the last backward)."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied parameters over the stages holding a copy."""


class CommitP2P(PipeInstruction):
    """DeepSpeed 0.19's, in its DualPipeV schedule: launch the sends and receives queued since the last one, as one
    batch. zeroshard's sends leave when their instruction runs and its receives wait at theirs (a schedule is
    checked on paper for that model, ``zeroshard.pipe.simulate``), so there is nothing left to launch here."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on the in-flight micro-batch held in slot ``buffer_id`` (DualPipeV's also name the
    ``phase``, the rank's model chunk it runs on: ``zeroshard.pipe.dualpipev``)."""

    def __init__(self, buffer_id: int, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch from the data iterator: its inputs on the first stage, its labels on the last."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the slot's inputs (and, on the last stage, the loss against its labels)."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the slot's outputs (the loss on the last stage, else the gradients received for them)."""


class BackwardInputPass(BufferOpInstruction):
    """zeroshard's, for the zero-bubble schedules: the first half of :class:`BackwardPass`, the gradients of the
    slot's inputs only (what the previous stage waits for); the weights' gradients wait for
    :class:`BackwardWeightPass` (``zeroshard.runtime.split_backward``)."""


class BackwardWeightPass(BufferOpInstruction):
    """zeroshard's: the second half, the slot's weight gradients (reduced over the stage's data-parallel ranks at
    the batch's last one); the slot's activations are freed after it."""


class SendActivation(BufferOpInstruction):
    """Send the slot's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as the slot's inputs."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the slot's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the slot's outputs from the next stage."""


BATCH_END = (ReduceTiedGrads, ReduceGrads, OptimizerStep)  # after every instruction on a micro-batch

__all__ = [
    "BATCH_END",
    "BackwardInputPass",
    "BackwardPass",
    "BackwardWeightPass",
    "BufferOpInstruction",
    "CommitP2P",
    "ForwardPass",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
]
