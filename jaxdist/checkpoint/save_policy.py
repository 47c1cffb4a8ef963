"""When a checkpoint is saved: small policy values, in the style of Orbax's save-decision policies.

The persistent tier's policy type (the in-memory tier's, ``jaxdist.checkpoint.MemoryTierPolicy``,
sits beside it): ``ModelCheckpoint`` and ``BackupAndRestore`` take one. Every name is also
``jaxdist.callbacks.X``, and ``jaxdist.callbacks.save_policy`` still imports them.

A policy answers one question, ``should_save(candidate, previous)``, from the step on offer and the
checkpoints this run has already saved; it keeps no state of its own, so the same value can be
shared, compared and rebuilt freely (Orbax's ``SaveDecisionPolicy`` works the same way). Combine
them with :class:`AnyOf`; write your own by implementing :class:`SavePolicy`.

>>> best = BestMetric("val_loss")
>>> c = lambda step, loss: SaveCandidate(step=step, epoch=step, epoch_end=True, logs={"val_loss": loss})
>>> best.should_save(c(1, 0.5), []), best.should_save(c(2, 0.7), [c(1, 0.5)])
(True, False)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveCandidate:
    """A point where training could save.

    Attributes:
      step: optimizer steps completed.
      epoch: the current epoch (0-based).
      epoch_end: True at an epoch end (``val_*`` metrics exist only there), False after a step.
      logs: the metrics known at that point.
      steps: the steps since the previous point a step-based policy saw: 1, or with ``fit``'s
        ``steps_per_execution=K`` the ``K`` steps (fewer at an epoch's end) of one compiled call,
        after which alone training can save.
    """

    step: int
    epoch: int
    epoch_end: bool
    logs: Mapping[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 1


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether to save at ``candidate``, given the checkpoints already saved (oldest first)."""

    def should_save(self, candidate: SaveCandidate, previous: Sequence[SaveCandidate]) -> bool: ...


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """Saves after every ``n``-th optimizer step.

    With ``fit``'s ``steps_per_execution=K`` training can save only after a call's ``K`` steps, so
    it saves at the first such boundary at or past each multiple of ``n`` (Keras does the same).

    >>> EveryNSteps(5).should_save(SaveCandidate(10, 0, False), [])
    True
    >>> EveryNSteps(5).should_save(SaveCandidate(12, 0, False, steps=4), [])  # steps 9..12
    True
    """

    n: int

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"EveryNSteps(n={self.n}): n must be >= 1")

    def should_save(self, candidate: SaveCandidate, previous: Sequence[SaveCandidate]) -> bool:
        # A multiple of n among the steps (step - steps, step] this point completed.
        return not candidate.epoch_end and (
            candidate.step // self.n > (candidate.step - candidate.steps) // self.n)


@dataclasses.dataclass(frozen=True)
class EveryNEpochs:
    """Saves at the end of every ``n``-th epoch (``n=1``: every epoch, Keras's ``save_freq="epoch"``).

    >>> EveryNEpochs(2).should_save(SaveCandidate(30, 1, True), [])
    True
    """

    n: int = 1

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"EveryNEpochs(n={self.n}): n must be >= 1")

    def should_save(self, candidate: SaveCandidate, previous: Sequence[SaveCandidate]) -> bool:
        return candidate.epoch_end and (candidate.epoch + 1) % self.n == 0


def resolve_mode(mode: str, monitor: str) -> str:
    """Keras's ``mode="auto"``: ``"max"`` for accuracy-like metrics, else ``"min"``."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode={mode!r}; expected 'auto', 'min' or 'max'")
    if mode != "auto":
        return mode
    return "max" if "acc" in monitor or monitor.startswith("fmeasure") else "min"


@dataclasses.dataclass(frozen=True)
class BestMetric:
    """Saves when ``monitor`` improves on every checkpoint saved before (Keras's ``save_best_only``).

    Considered at epoch ends (or after steps with ``at_epoch_end=False``); a candidate whose logs
    lack ``monitor`` is not saved and a warning names the logs there are (as Keras warns).

    Attributes:
      monitor: the log to compare, e.g. ``"val_loss"``.
      mode: ``"min"``, ``"max"`` or ``"auto"``.
      min_delta: the smallest change that counts as an improvement.
      at_epoch_end: consider epoch ends (True) or steps (False).
    """

    monitor: str = "val_loss"
    mode: str = "auto"
    min_delta: float = 0.0
    at_epoch_end: bool = True

    def __post_init__(self):
        resolve_mode(self.mode, self.monitor)

    def should_save(self, candidate: SaveCandidate, previous: Sequence[SaveCandidate]) -> bool:
        if candidate.epoch_end != self.at_epoch_end:
            return False
        value = candidate.logs.get(self.monitor)
        if value is None:
            logger.warning("BestMetric: %r is not in the logs %s; not saving (val_* metrics need "
                           "fit(..., eval_step=, eval_data=))", self.monitor, sorted(candidate.logs))
            return False
        seen = [float(p.logs[self.monitor]) for p in previous if self.monitor in p.logs]
        if not seen:
            return True
        if resolve_mode(self.mode, self.monitor) == "min":
            return float(value) < min(seen) - abs(self.min_delta)
        return float(value) > max(seen) + abs(self.min_delta)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Saves when any of ``policies`` says so.

    >>> p = AnyOf(EveryNSteps(100), EveryNEpochs())
    >>> p.should_save(SaveCandidate(7, 0, True), [])
    True
    """

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy):
        for p in policies:
            if not isinstance(p, SavePolicy):
                raise TypeError(f"AnyOf got {p!r}, which has no should_save(candidate, previous)")
        object.__setattr__(self, "policies", tuple(policies))

    def should_save(self, candidate: SaveCandidate, previous: Sequence[SaveCandidate]) -> bool:
        return any(p.should_save(candidate, previous) for p in self.policies)
