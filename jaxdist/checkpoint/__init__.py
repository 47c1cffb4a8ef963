"""Checkpoints: both fault-tolerance tiers and the manager over them.

Orbax-backed saves that restore on any device count and any ``zero_stage`` (``manager``) and their
integrity checks, the in-memory tier (``memstate``: recent steps in host memory, where a restarted
process finds them), each tier's policy (``save_policy``, ``tier_policy``), the manager over both
tiers that ``BackupAndRestore`` and custom loops use (``tiered``: save, restore the newer copy,
stop on a preemption), and the side-car evaluator that follows a checkpoint directory
(``jaxdist.evaluator``).

>>> import jaxdist
>>> jaxdist.checkpoint.CheckpointManager.__name__, jaxdist.checkpoint.TieredCheckpointManager.__name__
('CheckpointManager', 'TieredCheckpointManager')
"""

from jaxdist.checkpoint.manager import OWNER_FILE as OWNER_FILE
from jaxdist.checkpoint.manager import CheckpointError as CheckpointError
from jaxdist.checkpoint.manager import CheckpointManager as CheckpointManager
from jaxdist.checkpoint.manager import (
    CheckpointMismatchError as CheckpointMismatchError,
)
from jaxdist.checkpoint.manager import Restored as Restored
from jaxdist.checkpoint.memstate import InMemoryTier as InMemoryTier
from jaxdist.checkpoint.tier_policy import MemoryTierPolicy as MemoryTierPolicy
from jaxdist.checkpoint.tiered import TieredCheckpointManager as TieredCheckpointManager
from jaxdist.checkpoint.tiered import TieredRestored as TieredRestored

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointMismatchError", "InMemoryTier",
           "MemoryTierPolicy", "Restored", "TieredCheckpointManager", "TieredRestored"]
