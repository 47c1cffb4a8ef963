"""jaxdist: tf.distribute-style distribution strategies for JAX, as pure functions over meshes.

>>> import jax, jaxdist
>>> jaxdist.MirroredStrategy(jax.devices()[:1]).num_replicas_in_sync
1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxdist import (
    _compat,
    _output,  # noqa: F401  (loads gRPC before anything else does, quietly)
)
from jaxdist._version import __version__ as __version__
from jaxdist.launch import heartbeat as _heartbeat
from jaxdist.launch import runtime as _runtime

# The public names, each loaded from its module on first use (PEP 562): `import jaxdist` costs
# what its launcher needs, not JAX, Flax, Optax and Orbax (`jaxdist launch` and every elastic
# agent start in 0.2 s and 38 MB rather than 2.3 s and 170 MB). Names: the module defining each.
_PUBLIC = {
    "AutoShardPolicy": "jaxdist.input.local", "Batch": "jaxdist.input.dataset",
    "CentralStorageStrategy": "jaxdist.strategy", "ClusterSpec": "jaxdist.launch.cluster",
    "DefaultStrategy": "jaxdist.strategy", "DistributedDataset": "jaxdist.input.dataset",
    "FileSource": "jaxdist.input.local", "History": "jaxdist.training.fit",
    "InputContext": "jaxdist.input.context", "InputSyncTimeoutError": "jaxdist.input.local",
    "MirroredStrategy": "jaxdist.strategy", "MultiWorkerMirroredStrategy": "jaxdist.strategy",
    "OneDeviceStrategy": "jaxdist.strategy",
    "ParameterServerStrategy": "jaxdist.ps.strategy", "PerReplica": "jaxdist.strategy",
    "ReduceOp": "jaxdist.core.replica", "ShardableSource": "jaxdist.input.local",
    "Strategy": "jaxdist.strategy", "TPUStrategy": "jaxdist.strategy",
    "accumulate_gradients": "jaxdist.training.accumulate", "all_gather": "jaxdist.core.replica",
    "all_reduce": "jaxdist.core.replica", "barrier": "jaxdist.launch.runtime",
    "compute_average_loss": "jaxdist.core.loss", "evaluate": "jaxdist.training.fit",
    "fit": "jaxdist.training.fit", "initialize": "jaxdist.launch.runtime",
    "mirrored": "jaxdist.strategy", "num_replicas": "jaxdist.core.replica",
    "predict": "jaxdist.training.fit", "replica_id": "jaxdist.core.replica",
}
# The public namespaces: name: module.
_NAMESPACES = {
    "callbacks": "jaxdist.callbacks", "checkpoint": "jaxdist.checkpoint",
    "cluster": "jaxdist.launch.cluster", "datasets": "jaxdist.input.datasets",
    "models": "jaxdist.training.models", "precision": "jaxdist.training.precision",
    "ps": "jaxdist.ps", "schedules": "jaxdist.training.schedules", "zero": "jaxdist.core.zero",
}
__all__ = sorted({*_PUBLIC, *_NAMESPACES}, key=lambda name: (name[0].islower(), name))

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported
    from jaxdist import callbacks as callbacks
    from jaxdist import checkpoint as checkpoint
    from jaxdist import ps as ps
    from jaxdist.core import zero as zero
    from jaxdist.core.loss import compute_average_loss as compute_average_loss
    from jaxdist.core.replica import ReduceOp as ReduceOp
    from jaxdist.core.replica import all_gather as all_gather
    from jaxdist.core.replica import all_reduce as all_reduce
    from jaxdist.core.replica import num_replicas as num_replicas
    from jaxdist.core.replica import replica_id as replica_id
    from jaxdist.input import datasets as datasets
    from jaxdist.input.context import InputContext as InputContext
    from jaxdist.input.dataset import Batch as Batch
    from jaxdist.input.dataset import DistributedDataset as DistributedDataset
    from jaxdist.input.local import AutoShardPolicy as AutoShardPolicy
    from jaxdist.input.local import FileSource as FileSource
    from jaxdist.input.local import InputSyncTimeoutError as InputSyncTimeoutError
    from jaxdist.input.local import ShardableSource as ShardableSource
    from jaxdist.launch import cluster as cluster
    from jaxdist.launch.cluster import ClusterSpec as ClusterSpec
    from jaxdist.launch.runtime import barrier as barrier
    from jaxdist.launch.runtime import initialize as initialize
    from jaxdist.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
    from jaxdist.strategy import CentralStorageStrategy as CentralStorageStrategy
    from jaxdist.strategy import DefaultStrategy as DefaultStrategy
    from jaxdist.strategy import MirroredStrategy as MirroredStrategy
    from jaxdist.strategy import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from jaxdist.strategy import OneDeviceStrategy as OneDeviceStrategy
    from jaxdist.strategy import PerReplica as PerReplica
    from jaxdist.strategy import Strategy as Strategy
    from jaxdist.strategy import TPUStrategy as TPUStrategy
    from jaxdist.strategy import mirrored as mirrored
    from jaxdist.training import models as models
    from jaxdist.training import precision as precision
    from jaxdist.training import schedules as schedules
    from jaxdist.training.accumulate import accumulate_gradients as accumulate_gradients
    from jaxdist.training.fit import History as History
    from jaxdist.training.fit import evaluate as evaluate
    from jaxdist.training.fit import fit as fit
    from jaxdist.training.fit import predict as predict

# Old module paths (jaxdist.models, jaxdist.step, ...) are stub modules in jaxdist/_compat/paths/,
# found through the package's search path; each imports as its new home (jaxdist/_compat/).
__path__.append(_compat.PATHS)


def __getattr__(name: str):
    if name in _PUBLIC or name in _NAMESPACES:
        value = (getattr(importlib.import_module(_PUBLIC[name]), name) if name in _PUBLIC
                 else importlib.import_module(_NAMESPACES[name]))
        globals()[name] = value  # found here from now on, without this function
        return value
    # jaxdist.memstate, jaxdist.evaluator, ... without importing them first
    if f"jaxdist.{name}" in _compat.MOVED:
        return importlib.import_module(f"jaxdist.{name}")
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

# Under `jaxdist launch`, every training step reports progress to the launcher (hang detection).
_heartbeat.install()
# Under `jaxdist launch -n N`, every process joins the one job the launcher describes, so a
# @jaxdist.mirrored script trains one job, not N copies (jaxdist.launch.runtime.join_if_launched).
_runtime.join_if_launched()
