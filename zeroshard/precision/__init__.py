"""Mixed precision: dtype policy and the fp16 loss scaler."""

from .fp32_buffers import NameRule, fp32_buffer_rules, fp32_buffers
from .loss_scaler import LossScaler, LossScaleStuckError
from .policy import DTYPE_NAMES, PrecisionPolicy

__all__ = [
    "DTYPE_NAMES",
    "LossScaleStuckError",
    "LossScaler",
    "NameRule",
    "PrecisionPolicy",
    "fp32_buffer_rules",
    "fp32_buffers",
]
