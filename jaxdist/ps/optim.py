"""Optimizers named by value, so a parameter server in another process can rebuild them.

A server process never runs user code: the coordinator sends ``{"name": "adam", "kwargs": {...}}``
and the server calls the matching optax factory from a fixed allow-list. All of them update each
element independently, which keeps a leaf partitioned across servers exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optax

__all__ = ["OptimizerSpec", "optimizer", "ALLOWED_OPTIMIZERS"]

ALLOWED_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam",
                      "adabelief", "lion", "yogi")
_SCALARS = (int, float, bool, str, type(None))


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optax optimizer by name and scalar keyword arguments.

    Attributes:
      name: one of ``ALLOWED_OPTIMIZERS``.
      kwargs: ``(name, value)`` pairs of scalar arguments, e.g. ``(("learning_rate", 0.1),)``.
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.name not in ALLOWED_OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not available to parameter servers; "
                             f"expected one of {ALLOWED_OPTIMIZERS}")
        for key, value in self.kwargs:
            if not isinstance(key, str) or not isinstance(value, _SCALARS):
                raise ValueError(f"optimizer argument {key!r}={value!r} must be a scalar "
                                 "(int, float, bool, str or None) to travel to the servers")
            # A NaN (or inf) rate is taken by optax and turns the whole shard NaN one push
            # later; a server refuses it at Init (this runs there, on the spec it received).
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and not math.isfinite(value):
                raise ValueError(f"optimizer argument {key}={value!r}: expected a finite number")
            if key == "learning_rate" and (not number or value < 0):
                raise ValueError(f"optimizer argument learning_rate={value!r}: expected a finite "
                                 "number >= 0")

    def build(self) -> optax.GradientTransformation:
        return getattr(optax, self.name)(**dict(self.kwargs))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptimizerSpec:
        return cls(str(d["name"]), tuple(sorted(dict(d.get("kwargs", {})).items())))


def optimizer(name: str, /, **kwargs: Any) -> OptimizerSpec:
    """Names an optax optimizer for parameter servers.

    Args:
      name: optax factory name, one of ``ALLOWED_OPTIMIZERS``.
      **kwargs: scalar arguments of the factory.

    Returns:
      An :class:`OptimizerSpec`; ``.build()`` gives the optax transformation.

    Raises:
      ValueError: unknown name or non-scalar argument.

    >>> optimizer("adam", learning_rate=1e-3).to_dict()
    {'name': 'adam', 'kwargs': {'learning_rate': 0.001}}
    """
    return OptimizerSpec(name, tuple(sorted(kwargs.items())))
