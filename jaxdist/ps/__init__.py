"""Parameter-server mode: sharded parameters, host-side optimizer updates, a coordinator.

See :class:`ParameterServerStrategy` for the entry point, the parameter-server guide
(``docs/guides/parameter_servers.md``) for a tour, and ``examples/parameter_server.py`` /
``notebooks/04_parameter_server.ipynb``.
"""

from jaxdist.ps.coordinator import ClosureError as ClosureError
from jaxdist.ps.coordinator import ClusterCoordinator as ClusterCoordinator
from jaxdist.ps.coordinator import PerWorkerDataset as PerWorkerDataset
from jaxdist.ps.coordinator import RemoteValue as RemoteValue
from jaxdist.ps.coordinator import WorkerLost as WorkerLost
from jaxdist.ps.optim import OptimizerSpec as OptimizerSpec
from jaxdist.ps.optim import optimizer as optimizer
from jaxdist.ps.placement import Placement as Placement
from jaxdist.ps.placement import plan as plan
from jaxdist.ps.server import ParameterServer as ParameterServer
from jaxdist.ps.server import PushRejected as PushRejected
from jaxdist.ps.server import ServerConfig as ServerConfig
from jaxdist.ps.server import UpdateRecord as UpdateRecord
from jaxdist.ps.strategy import LocalCluster as LocalCluster
from jaxdist.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
from jaxdist.ps.transport import TLSConfig as TLSConfig
from jaxdist.ps.worker import WorkerRuntime as WorkerRuntime
from jaxdist.ps.worker import make_step_id as make_step_id
from jaxdist.ps.worker import remote as remote

__all__ = ["ClosureError", "ClusterCoordinator", "LocalCluster", "OptimizerSpec",
           "ParameterServer", "ParameterServerStrategy", "PerWorkerDataset", "Placement",
           "PushRejected", "RemoteValue", "ServerConfig", "TLSConfig", "UpdateRecord",
           "WorkerLost", "WorkerRuntime", "make_step_id", "optimizer", "plan", "remote"]
