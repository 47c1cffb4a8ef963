"""The ground every strategy stands on: meshes, per-replica values, collectives, layouts and the
compiled steps of both views. Nothing here knows a strategy.

* ``mesh``, ``values``, ``collectives``, ``replica``, ``loss``: meshes and axis names, the
  ``PerReplica`` / ``Batch`` values, all-reduce implementations, what per-replica code calls
  (``all_reduce``, ``replica_id``), ``compute_average_loss``;
* ``layout``, ``zero``: where state and batches live (the public layout value a strategy builds),
  and ZeRO's sharded state;
* ``step``, ``per_replica``: the compiled step of the global view and the ``run`` of the
  per-replica view, each taking a layout.

What other packages use from here without naming a module: the type aliases (``PyTree``, ...) and
the input path's finite-value check.
"""

from jaxdist.core._types import Metrics as Metrics
from jaxdist.core._types import PyTree as PyTree
from jaxdist.core._types import StepFn as StepFn

__all__ = ["Metrics", "PyTree", "StepFn", "warn_non_finite"]


def __getattr__(name: str):
    # Loaded on first use: the launcher imports jaxdist.core.progress and never needs JAX.
    if name == "warn_non_finite":
        from jaxdist.core._datacheck import warn_non_finite

        return warn_non_finite
    raise AttributeError(f"module 'jaxdist.core' has no attribute {name!r}")
