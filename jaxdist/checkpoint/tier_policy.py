"""How often the in-memory tier copies the state: a policy value, set in code or by environment.

``jaxdist.callbacks.BackupAndRestore(dir, memory_tier=MemoryTier(...))`` (or, in a custom loop,
``jaxdist.checkpoint.TieredCheckpointManager(dir, memory_tier=...)`` or
``jaxdist.memstate.StateTier(policy=...)``) takes one; without one, the
environment says (``JAXDIST_MEMORY_TIER=0``, ``JAXDIST_MEMORY_TIER_EVERY``,
``JAXDIST_MEMORY_TIER_BUDGET``: :meth:`MemoryTier.from_env`), as ``jaxdist launch`` users set it.
Like the save policies beside it (``jaxdist.callbacks.SavePolicy``), it is a small frozen value:
cheap to build, safe to share and compare.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from jaxdist.launch import DEFAULT_BUDGET as DEFAULT_BUDGET
from jaxdist.launch import ENV_TIER as ENV_TIER
from jaxdist.launch import tier_on

logger = logging.getLogger(__name__)

ENV_EVERY = "JAXDIST_MEMORY_TIER_EVERY"
"""Snapshot every N steps instead of the measured cadence (``1``: every step)."""
ENV_BUDGET = "JAXDIST_MEMORY_TIER_BUDGET"
"""The share of steps/s the tier may cost (default 0.05)."""


def _env(name: str, kind: type, default: Any, expected: str, ok) -> Any:
    """A variable's value, or ``default`` with one warning when it does not parse or is out of
    range: the tier is optional, so a bad setting must not end every rank of the job."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
        logger.warning("%s=%r: expected %s; using the default (%s)", name, text, expected,
                       "measured" if default is None else default)
        return default
    return value


@dataclasses.dataclass(frozen=True)
class MemoryTier:
    """When the in-memory tier copies the state to host memory.

    Args:
      every: copy (and write to the state directory) every N steps, whatever it costs; None:
        as often as ``budget`` allows, from what copies are measured to cost.
      budget: the share of steps/s the tier may cost, in (0, 1) (0.05: 5%).
      enabled: False switches the tier off: a failure then resumes from the persistent backup.

    Raises:
      ValueError: a value out of range, named with what is expected.

    >>> MemoryTier(every=2)
    MemoryTier(every=2, budget=0.05, enabled=True)
    >>> MemoryTier(budget=5)
    Traceback (most recent call last):
    ...
    ValueError: MemoryTier(budget=5): expected a share of steps/s in (0, 1), e.g. 0.05 for 5%
    """

    every: int | None = None
    budget: float = DEFAULT_BUDGET
    enabled: bool = True

    def __post_init__(self):
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(
                self.every, int) or self.every < 1):
            raise ValueError(f"MemoryTier(every={self.every!r}): expected None (measured) or a "
                             "whole number of steps >= 1")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not (
                0 < self.budget < 1):
            raise ValueError(f"MemoryTier(budget={self.budget!r}): expected a share of steps/s "
                             "in (0, 1), e.g. 0.05 for 5%")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"MemoryTier(enabled={self.enabled!r}): expected True or False")

    @classmethod
    def from_env(cls) -> MemoryTier:
        """The policy the environment sets (``JAXDIST_MEMORY_TIER``, ``..._EVERY``, ``..._BUDGET``).

        A value that does not parse is one warning naming it, and the default is used (the tier
        is optional: a typo must not end every rank of a job).

        >>> MemoryTier.from_env() == MemoryTier()  # none of them set
        True
        """
        every = _env(ENV_EVERY, int, None, "a whole number of steps >= 1", lambda v: v >= 1)
        budget = _env(ENV_BUDGET, float, DEFAULT_BUDGET, "a number in (0, 1), e.g. 0.05 for 5% "
                      "of steps/s", lambda v: 0 < v < 1)
        try:
            enabled = tier_on(os.environ.get(ENV_TIER))
        except ValueError as e:
            logger.warning("%s; the tier stays on", e)
            enabled = True
        return cls(every=every, budget=budget, enabled=enabled)
