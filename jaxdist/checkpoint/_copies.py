"""The in-memory tier's copies of a state in host memory: this process's distinct blocks of each
array, copied without a collective (``jaxdist.memstate``)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist.core import PyTree
from jaxdist.core.values import split_static


class _Blocks(NamedTuple):
    """This process's distinct blocks of one array, copied to host memory."""

    shape: tuple
    dtype: str
    index: list  # type: ignore[assignment]  # (shadows tuple.index)
    data: list | None = None


class _Elsewhere(NamedTuple):
    """An array another process of this host writes (replicated: one copy per host is enough)."""

    shape: tuple
    dtype: str


def _arrays(tree: PyTree) -> list:
    return split_static(tree)[0]


def _writes_replicated() -> bool:
    """Whether this process writes the arrays every process holds whole: one per host does
    (``LOCAL_RANK`` 0, set by ``jaxdist launch``; every process when it is not known)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _pinned_copy(leaves: list[jax.Array]) -> list[jax.Array]:
    """Asynchronous copies of ``leaves`` (this process's blocks) in host memory, which later
    steps may donate the originals past: one ``device_put`` to the ``pinned_host`` memory kind
    (a GPU's or TPU's copy engine moves them), or on XLA:CPU, whose device memory is host memory,
    a compiled copy (dispatched asynchronously; a ``device_put`` between memory kinds there
    copies at once, on the loop's thread)."""
    device: Any = next(iter(leaves[0].sharding.device_set)) if leaves else None
    if leaves and device.platform != "cpu":
        try:
            return jax.device_put(leaves, [x.sharding.with_memory_kind("pinned_host")
                                           for x in leaves])
        except (ValueError, NotImplementedError, TypeError, jax.errors.JaxRuntimeError):
            pass  # no pinned host memory here: a device-side copy instead
    # One call per device: only this process's devices take part (a copy must never be a
    # collective: processes may copy at different steps).
    by_device: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        by_device.setdefault(next(iter(x.sharding.device_set)), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for positions in by_device.values():
        for i, y in zip(positions, _device_copy([leaves[i] for i in positions])):
            out[i] = y
    return out


@jax.jit
def _device_copy(leaves):
    return [x.copy() for x in leaves]


def _blocks(x: Any) -> tuple[tuple[int, ...], str, list]:
    """``(global shape, dtype name, [(index, block), ...])`` of what this process writes."""
    if isinstance(x, _Elsewhere):
        return x.shape, x.dtype, []
    if isinstance(x, _Blocks):
        return x.shape, x.dtype, [(i, np.asarray(d)) for i, d in zip(x.index, x.data)]
    arr = np.asarray(x)
    return arr.shape, arr.dtype.name, [(tuple((0, n) for n in arr.shape), arr)]


def _my_bytes(x: Any) -> int:
    if not isinstance(x, jax.Array):
        return int(np.asarray(x).nbytes)
    if x.is_fully_replicated and not _writes_replicated():
        return 0
    indices = {tuple((s.start, s.stop) for s in shard.index) for shard in x.addressable_shards}
    per = x.addressable_shards[0].data.nbytes if x.addressable_shards else 0
    return per * len(indices)
