"""How often the in-memory tier copies the state: a policy value, set in code or by environment.

``jaxdist.callbacks.BackupAndRestore(dir, memory_tier=MemoryTier(...))`` (or
``jaxdist.memstate.StateTier(policy=...)`` in a custom loop) takes one; without one, the
environment says (``JAXDIST_MEMORY_TIER=0``, ``JAXDIST_MEMORY_TIER_EVERY``,
``JAXDIST_MEMORY_TIER_BUDGET``: :meth:`MemoryTier.from_env`), as ``jaxdist launch`` users set it.
Like the save policies beside it (``jaxdist.callbacks.SavePolicy``), it is a small frozen value:
cheap to build, safe to share and compare.
"""

from __future__ import annotations

import dataclasses
import os

DEFAULT_BUDGET = 0.05
ENV_TIER = "JAXDIST_MEMORY_TIER"
"""``0`` switches the tier off."""
ENV_EVERY = "JAXDIST_MEMORY_TIER_EVERY"
ENV_BUDGET = "JAXDIST_MEMORY_TIER_BUDGET"


def _env(name: str, kind: type, default, expected: str, ok):
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name}={text!r}: expected {expected}")
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

        Raises:
          ValueError: a variable that does not parse, named with what is expected.

        >>> MemoryTier.from_env() == MemoryTier()  # none of them set
        True
        """
        every = _env(ENV_EVERY, int, None, "a whole number of steps >= 1", lambda v: v >= 1)
        budget = _env(ENV_BUDGET, float, DEFAULT_BUDGET, "a number in (0, 1), e.g. 0.05 for 5% "
                      "of steps/s", lambda v: 0 < v < 1)
        switch = os.environ.get(ENV_TIER, "1")
        if switch not in ("0", "1", ""):
            raise ValueError(f"{ENV_TIER}={switch!r}: expected 0 (off) or 1 (on)")
        return cls(every=every, budget=budget, enabled=switch != "0")
