"""omniattn: fast trainable attention for every mask, on one Triton kernel core."""
from . import reference
from .api import attention

__all__ = ["attention", "reference"]
__version__ = "0.1.0"
