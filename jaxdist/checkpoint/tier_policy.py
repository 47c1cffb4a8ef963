"""How often the in-memory tier copies the state: a policy value, set in code or by environment.

``jaxdist.callbacks.BackupAndRestore(dir, memory_tier=MemoryTierPolicy(...))`` (or, in a custom loop,
``jaxdist.checkpoint.TieredCheckpointManager(dir, memory_tier=...)`` or
``jaxdist.checkpoint.InMemoryTier(policy=...)``) takes one; without one, the
environment says (``JAXDIST_MEMORY_TIER=0``, ``JAXDIST_MEMORY_TIER_EVERY``,
``JAXDIST_MEMORY_TIER_BUDGET``: :meth:`MemoryTierPolicy.from_env`), as ``jaxdist launch`` users set it.
Like the save policies beside it (``jaxdist.callbacks.SavePolicy``), it is a small frozen value:
cheap to build, safe to share and compare.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from jaxdist import _compat
from jaxdist.checkpoint._cadence import TierChoice, TierMeasurements, _choose
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
class MemoryTierPolicy:
    """When the in-memory tier copies the state to host memory.

    Args:
      every: copy (and write to the state directory) every N steps, whatever it costs; None:
        as often as ``budget`` allows, from what copies are measured to cost.
      budget: the share of steps/s the tier may cost, in (0, 1) (0.05: 5%).
      enabled: False switches the tier off: a failure then resumes from the persistent backup.

    Raises:
      ValueError: a value out of range, named with what is expected.

    >>> MemoryTierPolicy(every=2)
    MemoryTierPolicy(every=2, budget=0.05, enabled=True)
    >>> MemoryTierPolicy(budget=5)
    Traceback (most recent call last):
    ...
    ValueError: MemoryTierPolicy(budget=5): expected a share of steps/s in (0, 1), e.g. 0.05 for 5%
    """

    every: int | None = None
    budget: float = DEFAULT_BUDGET
    enabled: bool = True

    def __post_init__(self):
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(
                self.every, int) or self.every < 1):
            raise ValueError(f"MemoryTierPolicy(every={self.every!r}): expected None (measured) or a "
                             "whole number of steps >= 1")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not (
                0 < self.budget < 1):
            raise ValueError(f"MemoryTierPolicy(budget={self.budget!r}): expected a share of steps/s "
                             "in (0, 1), e.g. 0.05 for 5%")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"MemoryTierPolicy(enabled={self.enabled!r}): expected True or False")

    def decide(self, measured: TierMeasurements, *, host_is_device: bool) -> TierChoice:
        """How often the tier copies and writes, and the steps a failure may cost then.

        Pure: the same measurements give the same answer. The tier's stateful part measures (the
        loop's rhythm, what a copy costs the devices, how long a write takes) and asks this each
        time its measurements change; ``every`` fixes the cadence, else ``budget`` sets it.

        Args:
          measured: what the tier measured (``jaxdist.checkpoint._cadence.TierMeasurements``).
          host_is_device: whether the devices are the host's own cores (XLA:CPU).

        Returns:
          ``TierChoice(copy_every, k, bound, bound_all)``: steps between copies, between writes,
          and the most a failure costs with a surviving process and with none.
        """
        return _choose(measured, every=self.every, budget=self.budget,
                       host_is_device=host_is_device)

    @classmethod
    def from_env(cls) -> MemoryTierPolicy:
        """The policy the environment sets (``JAXDIST_MEMORY_TIER``, ``..._EVERY``, ``..._BUDGET``).

        A value that does not parse is one warning naming it, and the default is used (the tier
        is optional: a typo must not end every rank of a job).

        >>> MemoryTierPolicy.from_env() == MemoryTierPolicy()  # none of them set
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


__getattr__ = _compat.renamed(__name__)  # the old names (RENAMED), deprecated
