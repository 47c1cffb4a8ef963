"""Callbacks for ``jaxdist.fit``, by job.

* :mod:`~jaxdist.callbacks.core`: the protocol (``Callback``, ``TrainInfo``, ``Resume``).
* :mod:`~jaxdist.callbacks.checkpointing`: ``ModelCheckpoint``, ``BackupAndRestore`` and the save
  policies of :mod:`~jaxdist.checkpoint.save_policy` (the persistent tier's policy type).
* :mod:`~jaxdist.callbacks.schedules`: ``LearningRateScheduler``, ``EarlyStopping``, ``TerminateOnNaN``.
* :mod:`~jaxdist.callbacks.reporting`: ``ProgressBar``, ``TensorBoard``.

Every public name is importable as ``jaxdist.callbacks.X``.

>>> import jaxdist
>>> jaxdist.callbacks.EarlyStopping("val_accuracy").mode
'max'
"""

from jaxdist import _compat
from jaxdist.callbacks.checkpointing import BackupAndRestore as BackupAndRestore
from jaxdist.callbacks.checkpointing import ModelCheckpoint as ModelCheckpoint
from jaxdist.callbacks.checkpointing import TrainingPreempted as TrainingPreempted
from jaxdist.callbacks.core import Callback as Callback
from jaxdist.callbacks.core import Resume as Resume
from jaxdist.callbacks.core import TrainInfo as TrainInfo
from jaxdist.callbacks.reporting import ProgressBar as ProgressBar
from jaxdist.callbacks.reporting import TensorBoard as TensorBoard
from jaxdist.callbacks.schedules import EarlyStopping as EarlyStopping
from jaxdist.callbacks.schedules import LearningRateScheduler as LearningRateScheduler
from jaxdist.callbacks.schedules import TerminateOnNaN as TerminateOnNaN
from jaxdist.callbacks.schedules import get_hyperparam as get_hyperparam
from jaxdist.checkpoint.save_policy import AnyOf as AnyOf
from jaxdist.checkpoint.save_policy import BestMetric as BestMetric
from jaxdist.checkpoint.save_policy import EveryNEpochs as EveryNEpochs
from jaxdist.checkpoint.save_policy import EveryNSteps as EveryNSteps
from jaxdist.checkpoint.save_policy import SaveCandidate as SaveCandidate
from jaxdist.checkpoint.save_policy import SavePolicy as SavePolicy

__all__ = ["AnyOf", "BackupAndRestore", "BestMetric", "Callback", "EarlyStopping", "EveryNEpochs",
           "EveryNSteps", "LearningRateScheduler", "ModelCheckpoint", "ProgressBar", "Resume",
           "SaveCandidate", "SavePolicy", "TensorBoard", "TerminateOnNaN", "TrainInfo", "TrainingPreempted",
           "get_hyperparam"]

__getattr__ = _compat.renamed(__name__)  # MemoryTier: jaxdist.checkpoint.MemoryTierPolicy
