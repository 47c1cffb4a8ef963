"""The save policies, under the path they had before they moved to ``jaxdist.checkpoint.save_policy``.

The persistent tier's policy type lives beside the in-memory tier's in ``jaxdist/checkpoint/``
(issue 42: the checkpoint package holds both tiers and their policies); the names here are the
same objects, so ``isinstance`` and existing imports keep working.
"""

from jaxdist.checkpoint.save_policy import AnyOf as AnyOf
from jaxdist.checkpoint.save_policy import BestMetric as BestMetric
from jaxdist.checkpoint.save_policy import EveryNEpochs as EveryNEpochs
from jaxdist.checkpoint.save_policy import EveryNSteps as EveryNSteps
from jaxdist.checkpoint.save_policy import SaveCandidate as SaveCandidate
from jaxdist.checkpoint.save_policy import SavePolicy as SavePolicy
from jaxdist.checkpoint.save_policy import resolve_mode as resolve_mode

__all__ = ["AnyOf", "BestMetric", "EveryNEpochs", "EveryNSteps", "SaveCandidate", "SavePolicy",
           "resolve_mode"]
