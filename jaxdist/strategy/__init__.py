"""Distribution strategies, one module per family; ``base`` holds the protocol."""

from jaxdist.core.values import PerReplica as PerReplica
from jaxdist.strategy.base import MeshStrategy as MeshStrategy
from jaxdist.strategy.base import Strategy as Strategy
from jaxdist.strategy.base import check_global_batch_size as check_global_batch_size
from jaxdist.strategy.base import mesh_scope as mesh_scope
from jaxdist.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy
from jaxdist.strategy.mirrored import DefaultStrategy as DefaultStrategy
from jaxdist.strategy.mirrored import MirroredStrategy as MirroredStrategy
from jaxdist.strategy.mirrored import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategy.mirrored import mirrored as mirrored
from jaxdist.strategy.multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jaxdist.strategy.multi_worker import TPUStrategy as TPUStrategy

__all__ = ["CentralStorageStrategy", "DefaultStrategy", "MeshStrategy", "MirroredStrategy",
           "MultiWorkerMirroredStrategy", "OneDeviceStrategy", "PerReplica", "Strategy",
           "TPUStrategy", "check_global_batch_size", "mesh_scope", "mirrored"]
