"""Single-process strategies: Default, OneDevice and Mirrored (all-reduce over local devices)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from jaxdist.core import collectives, zero
from jaxdist.core import mesh as mesh_lib
from jaxdist.launch import runtime
from jaxdist.strategy.base import MeshStrategy, UserMeshStrategy, resolve_devices

ALIASES = {"auto": "xla", "nccl": "xla"}
"""tf.distribute's names for XLA's own all-reduce: ``"auto"`` (tf's default, ``cross_device_ops=None``:
the best the platform has) and ``"nccl"`` (tf's ``NcclAllReduce``). XLA lowers its all-reduce to
NCCL on GPUs, to ICI collectives on TPUs and to in-process (or gloo, across processes) reductions
on CPUs, so both are ``"xla"``; ``"nccl"`` on devices other than GPUs logs a warning."""

logger = logging.getLogger(__name__)


def check_cross_device_options(strategy) -> None:
    """Validates ``cross_device_ops`` / ``pack_bytes`` / ``compress`` / ``zero_stage`` of a
    mirrored-style strategy."""
    object.__setattr__(strategy, "zero_stage",
                       zero.check_zero_stage(type(strategy).__name__, strategy.zero_stage))
    impl = strategy.cross_device_ops
    try:
        collectives.check_options(ALIASES.get(impl, impl) if isinstance(impl, str) else impl,
                                  strategy.pack_bytes, strategy.compress)
    except ValueError as e:
        raise ValueError(
            f"{type(strategy).__name__}(cross_device_ops={strategy.cross_device_ops!r}, "
            f"pack_bytes={strategy.pack_bytes!r}, compress={strategy.compress!r}): {e} "
            f"cross_device_ops also takes tf.distribute's {tuple(ALIASES)}.") from None


if TYPE_CHECKING:  # a mixin of the MeshStrategy dataclasses that have these option fields
    class _Options(MeshStrategy):
        cross_device_ops: str
        zero_stage: int
        pack_bytes: int | None
        compress: str | None
else:
    _Options = object


class _CrossDeviceOptions(_Options):
    """Maps the public option fields onto what MeshStrategy reads."""

    @property
    def _implementation(self) -> str:  # type: ignore[override]  # (a field of MeshStrategy)
        return ALIASES.get(self.cross_device_ops, self.cross_device_ops)

    def _layout_hooks(self, mesh: Mesh, data_axes: tuple[str, ...]) -> dict:
        platforms = {d.platform for d in mesh.devices.flat}
        if self.cross_device_ops == "nccl" and platforms != {"gpu"}:
            logger.warning("cross_device_ops='nccl' on %s devices: NCCL needs GPUs, so XLA's own "
                           "all-reduce is used (the same numbers)", "/".join(sorted(platforms)))
        hooks = super()._layout_hooks(mesh, data_axes)
        others = list(mesh_lib.other_axes(mesh, data_axes))
        if self.zero_stage and others:
            # ZeRO's rule places each leaf on the data axes only; a leaf the user sharded over
            # their own axes would silently lose that layout, so the two are not combined yet.
            raise ValueError(
                f"{type(self).__name__}(zero_stage={self.zero_stage}) on a mesh with axes "
                f"{others} besides data_axes={data_axes}: sharded state does not yet compose with "
                "your own model-axis shardings. Use zero_stage=0 on this mesh, or a mesh whose "
                "axes all carry replicas.")
        hooks.update(zero.layout_hooks(mesh, data_axes, self.zero_stage))
        return hooks

    @property
    def _pack_bytes(self) -> int | None:  # type: ignore[override]
        return self.pack_bytes

    @property
    def _compress(self) -> str | None:  # type: ignore[override]
        return self.compress


@dataclasses.dataclass(frozen=True, repr=False)  # UserMeshStrategy's repr
class MirroredStrategy(_CrossDeviceOptions, UserMeshStrategy):
    """Synchronous data parallelism over the local devices (``tf.distribute.MirroredStrategy``).

    State is replicated on every device; each step's global batch is split over them; gradients are
    all-reduced so every copy stays identical. In the global view XLA's partitioner inserts the
    all-reduce; ``cross_device_ops``, ``pack_bytes`` and ``compress`` choose how
    ``jaxdist.all_reduce`` reduces in the per-replica view (``strategy.run``).

    In a multi-process job (``jaxdist launch -n N``, which joins it when ``jaxdist`` is imported,
    or after ``jaxdist.initialize()``) the default ``devices=None`` means every device of every
    process, as ``MultiWorkerMirroredStrategy``: the processes train one job, not one each. A
    process launched as one of several that has not joined raises, naming the fix.

    Args:
      devices: the devices to use, exactly as given (default: all of this process's devices, or
        every process's in a multi-process job).
      cross_device_ops: ``"xla"`` (psum: NCCL on GPU, ICI on TPU), ``"ring"``, ``"hierarchical"``
        or ``"one_device"``.
      pack_bytes: pack leaves smaller than this many bytes into shared buckets before reducing.
      compress: ``"bf16"`` sends float gradients as bfloat16.
      zero_stage: where state lives on the replicas (ZeRO): ``0`` a full copy on each (default),
        ``1`` optimizer state sharded, ``2`` gradients reduce-scattered too, ``3`` parameters
        sharded too (see ``jaxdist.zero`` and the sharded-state guide). Global view only
        (``step``, ``@jaxdist.mirrored``, ``fit``); the numbers do not change.
      mesh: keyword-only; a ``jax.sharding.Mesh`` of your own to run on instead of ``devices``
        (Explicit axes, as ``jax.make_mesh`` gives, or Auto). Batches already on it are used
        without a copy (``put`` copies state, so donation never deletes the caller's arrays).
      data_axes: keyword-only; the axes of ``mesh`` that carry the replicas (default: all of
        them). State leaves you sharded over the mesh's other axes keep their sharding.

    Raises:
      ValueError: an unknown ``cross_device_ops`` or ``zero_stage``, invalid packing options,
        ``devices`` and ``mesh`` both given, or ``data_axes`` that the mesh lacks.

    >>> import jax, jaxdist
    >>> jaxdist.MirroredStrategy(jax.devices()[:1]).num_replicas_in_sync
    1
    >>> jaxdist.MirroredStrategy(jax.devices()[:2], zero_stage=1).zero_stage
    1
    >>> m = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    >>> jaxdist.MirroredStrategy(mesh=m, data_axes=("data",)).num_replicas_in_sync
    2
    """

    devices: Sequence[jax.Device] | None = None
    cross_device_ops: str = "xla"
    pack_bytes: int | None = None
    compress: str | None = None
    zero_stage: int = 0

    def __post_init__(self):
        self._check_mesh_options(self.devices)
        if self.devices is not None:
            object.__setattr__(self, "devices", resolve_devices(self.devices, "MirroredStrategy",
                                                                lazy=True))
        check_cross_device_options(self)

    def _build_mesh(self) -> Mesh:
        if self.devices is None:
            runtime.check_joined("MirroredStrategy")
            if jax.process_count() > 1:
                # One job across the processes (`jaxdist launch -n N`, jaxdist.initialize()): every
                # process's devices, laid out (host, local), as MultiWorkerMirroredStrategy does.
                return mesh_lib.host_local_mesh(jax.devices(), jax.process_count())
        devices = resolve_devices(self.devices, "MirroredStrategy")
        if collectives.OPS.get(self._implementation, collectives.OPS["xla"]).host_local:
            # Hierarchical reduction needs a (host, local) split; one process is a (1, n) mesh.
            return mesh_lib.host_local_mesh(devices, num_hosts=1)
        return mesh_lib.local_mesh(devices)


@dataclasses.dataclass(frozen=True)
class OneDeviceStrategy(MeshStrategy):
    """Everything on one named device (``tf.distribute.OneDeviceStrategy``).

    Args:
      device: a ``jax.Device`` or a tf.distribute device string such as ``"/gpu:0"``
        (default: JAX's default device).
    """

    device: jax.Device | str | None = None

    def __post_init__(self):
        if isinstance(self.device, str):
            mesh_lib.check_device_string(self.device)
        elif self.device is not None and not isinstance(self.device, jax.Device):
            raise TypeError(f"OneDeviceStrategy(device=...) expects a jax.Device such as "
                            f"jax.devices()[0] or a device string such as '/gpu:0', got "
                            f"{type(self.device).__name__}")

    def _build_mesh(self) -> Mesh:
        device = self.device
        if isinstance(device, str):
            device = mesh_lib.device_from_string(device)
        return mesh_lib.local_mesh([device or jax.devices()[0]])


@dataclasses.dataclass(frozen=True)
class DefaultStrategy(MeshStrategy):
    """No distribution: one replica on JAX's default device (``tf.distribute`` default strategy).

    A step is plain ``jax.jit``; ``all_reduce`` inside ``run`` is the identity.
    """

    def _build_mesh(self) -> Mesh:
        return mesh_lib.local_mesh(jax.devices()[:1])

    def _data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        return ()


def mirrored(fn=None, /, *, devices: Sequence[jax.Device] | None = None,
             cross_device_ops: str = "xla", pack_bytes: int | None = None,
             compress: str | None = None, donate: bool = True, max_in_flight: int = 8,
             zero_stage: int = 0):
    """Distributes a single-device ``train_step(state, batch)`` over the local devices.

    ``@jaxdist.mirrored`` is ``MirroredStrategy().step(train_step)``; with arguments,
    ``@jaxdist.mirrored(devices=jax.devices()[:4])`` builds the strategy from them. The result is
    called exactly like the original and exposes ``.strategy``. ``zero_stage`` shards the state
    over the devices as ``MirroredStrategy(zero_stage=...)`` does.

    >>> import jax, jax.numpy as jnp, jaxdist
    >>> @jaxdist.mirrored(devices=jax.devices()[:1])
    ... def step(w, batch):
    ...     return w - 0.5 * jnp.mean(batch), {"mean": jnp.mean(batch)}
    >>> w, m = step(jnp.float32(1.0), jnp.ones(4, jnp.float32))
    >>> float(w), step.strategy.num_replicas_in_sync
    (0.5, 1)
    """
    strategy = MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops,
                                pack_bytes=pack_bytes, compress=compress, zero_stage=zero_stage)
    if fn is None:
        return lambda f: strategy.step(f, donate=donate, max_in_flight=max_in_flight)
    return strategy.step(fn, donate=donate, max_in_flight=max_in_flight)
