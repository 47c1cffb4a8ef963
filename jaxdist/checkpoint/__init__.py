"""Checkpoints: Orbax-backed saves that restore on any device count and any ``zero_stage``, their
integrity checks, the side-car evaluator that follows a checkpoint directory
(``jaxdist.evaluator``), and the in-memory tier (``memstate``: recent steps in host memory, where a
restarted process finds them).

>>> import jaxdist
>>> jaxdist.checkpoint.CheckpointManager.__name__
'CheckpointManager'
"""

from jaxdist.checkpoint.manager import OWNER_FILE as OWNER_FILE
from jaxdist.checkpoint.manager import CheckpointError as CheckpointError
from jaxdist.checkpoint.manager import CheckpointManager as CheckpointManager
from jaxdist.checkpoint.manager import (
    CheckpointMismatchError as CheckpointMismatchError,
)
from jaxdist.checkpoint.manager import Restored as Restored

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointMismatchError", "Restored"]
