"""Mixed precision: dtype policy and the fp16 loss scaler."""

from .loss_scaler import LossScaler, LossScaleStuckError
from .policy import DTYPE_NAMES, PrecisionPolicy

__all__ = ["DTYPE_NAMES", "LossScaleStuckError", "LossScaler", "PrecisionPolicy"]
