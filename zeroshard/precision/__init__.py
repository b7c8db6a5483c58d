"""Mixed precision: dtype policy and the fp16 loss scaler."""

from .loss_scaler import LossScaler, LossScaleStuckError
from .policy import PrecisionPolicy

__all__ = ["LossScaleStuckError", "LossScaler", "PrecisionPolicy"]
