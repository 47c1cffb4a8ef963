"""CentralStorageStrategy: one copy of the state in host memory, compute on the devices."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.core import mesh as mesh_lib
from jaxdist.core.values import is_static_leaf
from jaxdist.strategy.base import UserMeshStrategy, resolve_devices

logger = logging.getLogger(__name__)

HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True, repr=False)  # UserMeshStrategy's repr
class CentralStorageStrategy(UserMeshStrategy):
    """Synchronous data parallelism with the state held once, in host memory.

    Between steps the parameters and optimizer state live in host memory (``pinned_host``), one
    copy in all: a leaf whose first axis divides over the replicas is partitioned across them, a
    smaller one is kept whole. Each step brings the state to the devices, runs the user's
    global-view step there (XLA reduces the per-device gradients), and writes the updated state back
    to host memory, so device memory holds it only for the duration of a step — the point of
    tf's CentralStorageStrategy, for models whose optimizer state crowds device memory.

    Where the backend has no host memory space the state stays partitioned in device memory (still
    one copy). With one device this degenerates to that device, as tf.distribute does.

    Args:
      devices: the compute devices (default: all of this process's devices).
      mesh: keyword-only; a mesh of your own to run on instead of ``devices`` (see
        ``MirroredStrategy``).
      data_axes: keyword-only; the axes of ``mesh`` the replicas span (default: all of them).
    """

    devices: Sequence[jax.Device] | None = None

    def __post_init__(self):
        self._check_mesh_options(self.devices)
        if self.devices is not None:
            object.__setattr__(self, "devices", resolve_devices(self.devices,
                                                                "CentralStorageStrategy", lazy=True))

    def _build_mesh(self) -> Mesh:
        return mesh_lib.local_mesh(resolve_devices(self.devices, "CentralStorageStrategy"))

    @functools.cached_property
    def _memory_kind(self) -> str | None:
        if self.num_replicas_in_sync == 1:
            return None
        kinds = {m.kind for d in self.mesh.devices.flat for m in d.addressable_memories()}
        if HOST_MEMORY in kinds:
            return HOST_MEMORY
        logger.warning("devices %s have no %r memory; CentralStorageStrategy keeps its one copy of "
                       "the state partitioned in device memory", self.mesh.devices.flat[0],
                       HOST_MEMORY)
        return None

    @functools.cached_property
    def _central(self) -> dict[bool, NamedSharding]:
        """Host shardings, keyed by whether the leaf is partitioned over the replicas."""
        kind = self._memory_kind
        return {True: NamedSharding(self.mesh, jax.P(self.layout.data_axes), memory_kind=kind),
                False: NamedSharding(self.mesh, jax.P(), memory_kind=kind)}

    def _layout_hooks(self, mesh: Mesh, data_axes: tuple[str, ...]) -> dict[str, Any]:
        return {"state_sharding": self._leaf_sharding, "adapt_step": self._wrap_step}

    def _leaf_sharding(self, leaf: Any) -> jax.sharding.Sharding:
        shape = leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)
        return self._central[bool(shape) and shape[0] % self.num_replicas_in_sync == 0]

    def _wrap_step(self, fn: Callable) -> Callable:
        if self._memory_kind is None and self.num_replicas_in_sync == 1:
            return fn
        device = self.layout.replicated

        @functools.wraps(fn)
        def central_step(state, batch):
            # Host -> devices (a gather of the partitions), compute, devices -> host. XLA:CPU and
            # GPU refuse arithmetic that mixes memory spaces, so both moves are explicit.
            on_device = jax.tree.map(
                lambda x: x if is_static_leaf(x) else jax.device_put(x, device), state)
            out = fn(on_device, batch)
            if isinstance(out, tuple) and len(out) == 2 and (
                    jax.tree.structure(out[0]) == jax.tree.structure(state)):
                new_state = jax.tree.map(
                    lambda x: x if is_static_leaf(x) else jax.device_put(x, self._leaf_sharding(x)),
                    out[0])
                return new_state, out[1]
            return out

        return central_step
