"""jaxdist: tf.distribute-style distribution strategies for JAX, as pure functions over meshes.

>>> import jax, jaxdist
>>> jaxdist.MirroredStrategy(jax.devices()[:1]).num_replicas_in_sync
1
"""

from jaxdist import callbacks as callbacks
from jaxdist import checkpoint as checkpoint
from jaxdist import cluster as cluster
from jaxdist import datasets as datasets
from jaxdist import models as models
from jaxdist import precision as precision
from jaxdist import ps as ps
from jaxdist import schedules as schedules
from jaxdist import zero as zero
from jaxdist.accumulate import accumulate_gradients as accumulate_gradients
from jaxdist.cluster import ClusterSpec as ClusterSpec
from jaxdist.fit import History as History
from jaxdist.fit import evaluate as evaluate
from jaxdist.fit import fit as fit
from jaxdist.fit import predict as predict
from jaxdist.input import Batch as Batch
from jaxdist.input import DistributedDataset as DistributedDataset
from jaxdist.input_context import InputContext as InputContext
from jaxdist.input_local import AutoShardPolicy as AutoShardPolicy
from jaxdist.input_local import FileSource as FileSource
from jaxdist.input_local import InputSyncTimeoutError as InputSyncTimeoutError
from jaxdist.input_local import ShardableSource as ShardableSource
from jaxdist.loss import compute_average_loss as compute_average_loss
from jaxdist.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
from jaxdist.replica import ReduceOp as ReduceOp
from jaxdist.replica import all_gather as all_gather
from jaxdist.replica import all_reduce as all_reduce
from jaxdist.replica import num_replicas as num_replicas
from jaxdist.replica import replica_id as replica_id
from jaxdist.runtime import barrier as barrier
from jaxdist.runtime import initialize as initialize
from jaxdist.strategy import CentralStorageStrategy as CentralStorageStrategy
from jaxdist.strategy import DefaultStrategy as DefaultStrategy
from jaxdist.strategy import MirroredStrategy as MirroredStrategy
from jaxdist.strategy import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jaxdist.strategy import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategy import PerReplica as PerReplica
from jaxdist.strategy import Strategy as Strategy
from jaxdist.strategy import TPUStrategy as TPUStrategy
from jaxdist.strategy import mirrored as mirrored

__version__ = "0.3.0"

__all__ = [
    "AutoShardPolicy", "Batch", "CentralStorageStrategy", "ClusterSpec", "DefaultStrategy",
    "DistributedDataset", "FileSource", "History", "InputContext", "InputSyncTimeoutError",
    "MirroredStrategy", "MultiWorkerMirroredStrategy", "OneDeviceStrategy",
    "ParameterServerStrategy", "PerReplica", "ReduceOp", "ShardableSource", "Strategy",
    "TPUStrategy", "accumulate_gradients", "all_gather", "all_reduce", "barrier", "callbacks",
    "checkpoint", "cluster", "compute_average_loss", "datasets", "evaluate", "fit",
    "initialize", "mirrored", "models", "num_replicas", "precision", "predict", "ps",
    "replica_id", "schedules", "zero",
]
