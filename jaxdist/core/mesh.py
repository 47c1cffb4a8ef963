"""Building the meshes that strategies run on.

Every mesh built here uses ``AxisType.Auto``: jax 0.10's ``jax.make_mesh`` defaults to explicit axes,
under which ordinary single-device code (``jnp.take_along_axis`` on a batch-sharded array, say)
raises ``ShardingTypeError``. The global view promises to run unmodified user code, so the
partitioner must be free to choose intermediate shardings.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
"""The single axis of a local data-parallel mesh (MirroredStrategy, OneDeviceStrategy)."""
HOST_AXIS = "host"
"""Outer axis of the 2-D multi-host mesh: one entry per process."""
LOCAL_AXIS = "local"
"""Inner axis of the 2-D multi-host mesh: the devices of one process."""


def local_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D ``data`` mesh over exactly ``devices``, in the order given.

    >>> import jax
    >>> local_mesh(jax.devices()[:1]).axis_names
    ('data',)
    """
    return Mesh(np.asarray(devices, dtype=object), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def host_local_mesh(devices: Sequence[jax.Device], num_hosts: int) -> Mesh:
    """A 2-D ``(host, local)`` mesh: row ``h`` holds the devices of host (process) ``h``.

    On one process ``num_hosts`` may factorise the local devices (``(1, n)`` or ``(2, n/2)``), so
    that hierarchical collectives can be exercised without several processes.

    Raises:
      ValueError: if the devices cannot be split evenly over ``num_hosts`` rows.
    """
    n = len(devices)
    if num_hosts < 1 or n % num_hosts:
        raise ValueError(
            f"cannot arrange {n} devices as {num_hosts} hosts of equal size; "
            f"pass a host count that divides {n}")
    procs = sorted({d.process_index for d in devices})
    if len(procs) > 1:
        if len(procs) != num_hosts:
            raise ValueError(
                f"devices span {len(procs)} processes but num_hosts={num_hosts}; on several "
                "processes each mesh row must be exactly one process's devices")
        rows = [[d for d in devices if d.process_index == p] for p in procs]
        if len({len(r) for r in rows}) != 1:
            sizes = {p: len(r) for p, r in zip(procs, rows)}
            raise ValueError(f"every process must contribute the same number of devices, got {sizes}")
        grid = np.asarray(rows, dtype=object)
    else:
        grid = np.asarray(devices, dtype=object).reshape(num_hosts, n // num_hosts)
    return Mesh(grid, (HOST_AXIS, LOCAL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


_DEVICE_SPEC = re.compile(
    r"^(?:/job:[\w-]+)?(?:/replica:\d+)?(?:/task:(?P<task>\d+))?"
    r"(?:/device:|/)?(?P<kind>cpu|gpu|tpu):(?P<index>\d+)$", re.IGNORECASE)


def _tf_names(devices: Sequence[jax.Device]) -> list[str]:
    """tf's local names: the kind, then the index among this process's devices of that kind."""
    seen: dict[str, int] = {}
    names = []
    for d in devices:
        kind = d.platform if d.platform in ("cpu", "tpu") else "gpu"
        names.append(f"/{kind}:{seen.setdefault(kind, 0)}")
        seen[kind] += 1
    return names


def _parse_device_string(spec: str) -> re.Match:
    m = _DEVICE_SPEC.match(spec.strip()) if isinstance(spec, str) else None
    if m is None:
        raise ValueError(
            f"cannot read the device string {spec!r}; use tf.distribute's forms such as '/gpu:0', "
            "'/device:GPU:0', 'CPU:0' or '/job:worker/replica:0/task:1/device:GPU:0', or pass "
            "jax.Device objects (jax.devices()[0])")
    return m


def check_device_string(spec: str) -> str:
    """Checks the form of a tf.distribute device string without starting JAX's backend."""
    _parse_device_string(spec)
    return spec


def device_from_string(spec: str) -> jax.Device:
    """Resolves a tf.distribute device string (``"/gpu:0"``, ``"/device:GPU:1"``, ``"CPU:0"``,
    ``"/job:worker/replica:0/task:1/device:GPU:0"``) to a JAX device.

    The index counts the devices of that kind owned by the task (this process when no task is
    named), as tf's local device names do.

    Raises:
      ValueError: a string of another form, or no such device; the message lists the devices there
        are.

    >>> device_from_string("/cpu:0") == jax.local_devices(backend="cpu")[0]
    True
    """
    m = _parse_device_string(spec)
    kind, index = m["kind"].lower(), int(m["index"])
    task = jax.process_index() if m["task"] is None else int(m["task"])
    try:
        candidates = [d for d in jax.devices(kind) if d.process_index == task]
    except RuntimeError:
        candidates = []
    if index >= len(candidates):
        there = ", ".join(_tf_names(jax.local_devices())) or "none"
        raise ValueError(
            f"no device {spec!r}: task {task} has {len(candidates)} {kind.upper()} device(s); "
            f"this process has: {there}")
    return candidates[index]


def with_auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` itself when every axis is ``Auto``, else the same devices and names with Auto axes.

    A user's own mesh (``jax.make_mesh`` gives ``Explicit`` axes) is run by jaxdist's global view
    on its Auto twin: the two describe the same device layout, so an array is moved between them
    without a copy (``jax.device_put`` re-labels the buffers).

    >>> import jax
    >>> m = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> m.axis_types, with_auto_axes(m).axis_types
    ((Explicit,), (Auto,))
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_user_mesh(mesh: Mesh, data_axes, what: str) -> tuple[str, ...]:
    """Validates ``mesh=`` / ``data_axes=`` given to a strategy; returns the data axes.

    Args:
      mesh: a ``jax.sharding.Mesh`` (Explicit or Auto axes) over the devices to use.
      data_axes: the mesh axes the replicas (and the batch) span, in mesh order; ``None`` means
        every axis of the mesh.
      what: the strategy's name, for messages.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh`` (an ``AbstractMesh`` has no devices).
      ValueError: ``data_axes`` names an axis the mesh lacks, repeats one, or is empty.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}(mesh=...) expects a jax.sharding.Mesh with devices, such as "
                        f"jax.make_mesh((8,), ('data',)), got {type(mesh).__name__}")
    if data_axes is None:
        return tuple(mesh.axis_names)
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown or len(set(axes)) != len(axes):
        raise ValueError(
            f"{what}(data_axes={data_axes!r}) must name one or more distinct axes of the mesh, "
            f"whose axes are {tuple(mesh.axis_names)}" + (f"; {unknown} are not among them"
                                                          if unknown else ""))
    # In mesh order, so that replica r is the r-th device along the data axes, as JAX counts.
    return tuple(a for a in mesh.axis_names if a in axes)


def other_axes(mesh: Mesh, data_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of ``mesh`` (of size > 1) that carry no replicas: axes a user's own code shards.

    >>> import jax
    >>> other_axes(jax.make_mesh((4, 2), ("data", "model")), ("data",))
    ('model',)
    """
    return tuple(a for a in mesh.axis_names if a not in data_axes and mesh.shape[a] > 1)
