"""Type aliases shared across the package."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""Any JAX pytree (nested tuples, lists, dicts, dataclasses of arrays)."""
Metrics: TypeAlias = Any
"""A pytree of scalar arrays returned by a step."""
StepFn: TypeAlias = Callable[[PyTree, PyTree], tuple[PyTree, Metrics]]
"""``train_step(state, batch) -> (state, metrics)``."""
