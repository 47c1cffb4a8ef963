"""Building the meshes that strategies run on.

Every mesh built here uses ``AxisType.Auto``: jax 0.10's ``jax.make_mesh`` defaults to explicit axes,
under which ordinary single-device code (``jnp.take_along_axis`` on a batch-sharded array, say)
raises ``ShardingTypeError``. The global view promises to run unmodified user code, so the
partitioner must be free to choose intermediate shardings.
"""

from __future__ import annotations

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
