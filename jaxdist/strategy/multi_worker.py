"""Strategies over several hosts (MultiWorkerMirrored) and over TPU cores (TPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxdist.core import collectives
from jaxdist.core import mesh as mesh_lib
from jaxdist.core.collectives import CROSS_PROCESS_PACK_BYTES
from jaxdist.launch import runtime
from jaxdist.launch.cluster import cluster_from_environment
from jaxdist.strategy.base import UserMeshStrategy
from jaxdist.strategy.mirrored import _CrossDeviceOptions, check_cross_device_options


@dataclasses.dataclass(frozen=True, repr=False)  # UserMeshStrategy's repr
class MultiWorkerMirroredStrategy(_CrossDeviceOptions, UserMeshStrategy):
    """Synchronous data parallelism over every device of every process.

    Call ``jaxdist.initialize(...)`` (or launch with ``jaxdist launch``) before the first JAX call,
    then build the strategy on every process. As tf's strategy does, building it with ``TF_CONFIG``
    set (or ``cluster`` given) and no ``initialize`` yet joins that job itself, provided JAX's
    backend has not started; if it has, the strategy raises rather than run every worker as a
    job of its own. The mesh is 2-D, ``(host, local)``: row ``h`` is process
    ``h``'s devices, so hierarchical reductions can reduce within a host before crossing hosts.
    ``distribute`` reads on each process only the rows of each global batch that its devices hold.

    Args:
      cluster: the ``jaxdist.ClusterSpec`` of the job (optional; default ``TF_CONFIG`` /
        ``JAXDIST_*`` from the environment). The strategy joins it when ``jaxdist.initialize``
        has not run, and checks that the runtime really has that many processes.
      cross_device_ops, pack_bytes, compress: as for ``MirroredStrategy`` (per-replica view),
        except that ``pack_bytes`` defaults to 25 MiB (``CROSS_PROCESS_PACK_BYTES``): a
        reduction crossing processes packs leaves into flat buckets, as tf.distribute's
        ``MultiWorkerMirroredStrategy`` packs gradients (``CommunicationOptions(bytes_per_pack=0)``:
        one pack) and PyTorch DDP buckets them (25 MB). Across processes on CPU each leaf would
        otherwise be one gloo call: XLA:CPU sends a combined all-reduce operand by operand.
        ``pack_bytes=None`` sends every leaf on its own. Packing changes no value: each element is
        the same sum of the same replicas' values.
      zero_stage: as for ``MirroredStrategy``: state sharded over every device of every process.
      mesh, data_axes: keyword-only; a mesh of your own over every process's devices and the
        axes of it that carry the replicas (see ``MirroredStrategy``).

    Raises:
      RuntimeError: a multi-process cluster is configured but JAX's backend started before the
        job was joined (the message names ``jaxdist.initialize()``).

    >>> MultiWorkerMirroredStrategy().pack_bytes == 25 * 2**20
    True
    """

    cluster: Any = None
    cross_device_ops: str = "xla"
    pack_bytes: int | None = CROSS_PROCESS_PACK_BYTES
    compress: str | None = None
    zero_stage: int = 0

    def __post_init__(self):
        self._check_mesh_options()
        check_cross_device_options(self)
        self._join_configured_job()

    def _join_configured_job(self) -> None:
        """tf's habit: ``TF_CONFIG`` set, the strategy built, no ``initialize`` call."""
        if runtime.current_cluster() is not None:
            return
        spec = self.cluster if self.cluster is not None else cluster_from_environment()
        if spec is None or getattr(spec, "num_processes", 1) <= 1:
            return
        from jax._src import xla_bridge  # whether the backend started: no public predicate
        if xla_bridge.backends_are_initialized() and runtime._distributed_state().client is None:
            source = "cluster=" if self.cluster is not None else "TF_CONFIG"
            raise RuntimeError(
                f"MultiWorkerMirroredStrategy: the cluster ({source}) has {spec.num_processes} "
                "processes, but this process has not "
                "joined it and JAX's backend has already started, so it can only run alone "
                "(every worker would train its own copy). Fix: call jaxdist.initialize() first "
                "thing in main(), before any other JAX call (or build this strategy first).")
        runtime.initialize(spec)

    def _build_mesh(self) -> Mesh:
        expected = getattr(self.cluster, "num_processes", None)
        if expected is not None and expected != jax.process_count():
            raise RuntimeError(
                f"the cluster has {expected} processes but JAX runs {jax.process_count()}; call "
                "jaxdist.initialize(cluster) on every process before any other JAX call")
        return mesh_lib.host_local_mesh(jax.devices(), jax.process_count())


@dataclasses.dataclass(frozen=True, repr=False)  # UserMeshStrategy's repr
class TPUStrategy(_CrossDeviceOptions, UserMeshStrategy):
    """``MirroredStrategy`` over the TPU cores (``jax.devices("tpu")``), all-reducing over ICI.

    Args:
      cross_device_ops, pack_bytes, compress, zero_stage: as for ``MirroredStrategy``.
      mesh, data_axes: keyword-only; a mesh of your own over TPU cores and the axes of it that
        carry the replicas (see ``MirroredStrategy``).

    Raises:
      RuntimeError: when no TPU is present (the message suggests ``MirroredStrategy``).
    """

    cross_device_ops: str = "xla"
    pack_bytes: int | None = None
    compress: str | None = None
    zero_stage: int = 0

    def __post_init__(self):
        self._check_mesh_options()
        check_cross_device_options(self)
        self._tpu_devices()  # fail at construction: a TPU strategy without TPUs is a config error

    @staticmethod
    def _tpu_devices() -> list[jax.Device]:
        try:
            devices = jax.devices("tpu")
        except RuntimeError as e:
            raise RuntimeError(
                f"TPUStrategy found no TPU ({e}). On a TPU VM or Colab TPU runtime install "
                "`pip install jaxdist[tpu]`; elsewhere use jaxdist.MirroredStrategy(), which runs the "
                "same code on the devices you have.") from e
        return devices

    def _build_mesh(self) -> Mesh:
        devices = self._tpu_devices()
        if jax.process_count() > 1:  # a TPU pod slice: every host's cores, laid out (host, local)
            return mesh_lib.host_local_mesh(devices, jax.process_count())
        if collectives.OPS.get(self._implementation, collectives.OPS["xla"]).host_local:
            return mesh_lib.host_local_mesh(devices, num_hosts=1)
        return mesh_lib.local_mesh(devices)
