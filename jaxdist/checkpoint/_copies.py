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


class PinnedFull(RuntimeError):
    """Pinned host memory ran out for a copy: the copies never go to device memory instead (a
    device copy is lost with the process that holds it)."""

    def __init__(self, error: BaseException):
        super().__init__(
            f"pinned host memory is exhausted ({str(error).splitlines()[0][:200]}); XLA's pinned "
            "host allocator is capped (64 GiB by default): leave room for the tier's two copies "
            "beside the program's own pinned buffers, or turn the tier off (JAXDIST_MEMORY_TIER=0)")


def _to_pinned(leaves: list) -> list:
    """``device_put`` of ``leaves`` to the ``pinned_host`` memory kind; ``PinnedFull`` when
    that memory ran out (the other errors as ``device_put`` raises them)."""
    try:
        return jax.device_put(leaves, [x.sharding.with_memory_kind("pinned_host") for x in leaves])
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            raise PinnedFull(e) from e
        raise


def _pinned_copy(leaves: list[jax.Array]) -> list[jax.Array]:
    """Asynchronous copies of ``leaves`` (this process's blocks) in host memory, which later
    steps may donate the originals past: one ``device_put`` to the ``pinned_host`` memory kind
    (a GPU's or TPU's copy engine moves them), or on XLA:CPU, whose device memory is host memory,
    a compiled copy (dispatched asynchronously; a ``device_put`` between memory kinds there
    copies at once, on the loop's thread)."""
    device: Any = next(iter(leaves[0].sharding.device_set)) if leaves else None
    if leaves and device.platform != "cpu":
        try:
            return _to_pinned(leaves)
        except (ValueError, NotImplementedError, TypeError):
            pass  # no pinned host memory kind on this backend: a device-side copy instead
    return _per_device_copy(leaves)


def _per_device_copy(leaves: list[jax.Array]) -> list[jax.Array]:
    """Compiled copies of single-device ``leaves`` (fresh buffers), dispatched asynchronously.
    One call per device: only this process's devices take part (a copy must never be a
    collective: processes may copy at different steps)."""
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


# --- copies that overlap the next step (GPUs, TPUs) --------------------------------------------
#
# A host copy (``device_put`` to ``pinned_host``) reads its source buffers until it lands, tens of
# ms for a GB over PCIe. When the next step donates those buffers (a training step donates its
# state), that step must wait for the copy: measured on an H100 with a 1.3 GB state, a copy every 4
# steps cost 12% of steps/s. So the tier first takes an on-device snapshot (a compiled copy that
# produces fresh buffers nobody donates; it runs in order on the compute stream, ~3% of a step
# when done every step) and host-copies that; the snapshot is released once its host copy landed.

_DEVICE_MARGIN = 256 << 20  # device memory left free beyond a snapshot (fragmentation, temporaries)


def _is_host_device(leaves: list) -> bool:
    """Whether the devices are the host's own cores (XLA:CPU): device memory is host memory."""
    return not leaves or next(iter(leaves[0].sharding.device_set)).platform == "cpu"


def _bytes_by_device(leaves: list) -> dict:
    by: dict[Any, int] = {}
    for x in leaves:
        for d in x.sharding.device_set:
            by[d] = by.get(d, 0) + x.nbytes
    return by


def _peak(leaves: list) -> int | None:
    """The highest peak use (``memory_stats()["peak_bytes_in_use"]``) of the devices holding
    ``leaves``; None where a device reports none."""
    peak = 0
    for device in {d for x in leaves for d in x.sharding.device_set}:
        try:
            used = (device.memory_stats() or {}).get("peak_bytes_in_use")
        except Exception:  # noqa: BLE001 - not every backend reports memory
            return None
        if used is None:
            return None
        peak = max(peak, int(used))
    return peak


def _device_room(leaves: list) -> tuple[bool, str]:
    """Whether every device holding ``leaves`` has room for one more copy of them beside the
    training step's peak (``memory_stats()``: the allocator's limit less the peak it has seen);
    the reason in words when not. A device that reports no statistics is taken to have room."""
    for device, need in _bytes_by_device(leaves).items():
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - not every backend reports memory
            stats = {}
        limit = stats.get("bytes_limit")
        used = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
        if limit is None or used is None:
            continue
        free = int(limit) - int(used)
        if free < need + _DEVICE_MARGIN:
            return False, (f"a snapshot needs {need / 1e6:.0f} MB (+{_DEVICE_MARGIN >> 20} MiB) on "
                           f"{device}, which has {free / 1e6:.0f} MB free beside the step's peak")
    return True, ""


def _snapshot_to_host(leaves: list) -> tuple[list, list]:
    """``(host copies, device snapshot)``: an on-device copy of ``leaves`` (fresh buffers that
    no step donates), then its asynchronous copy to ``pinned_host``. Keep the snapshot until the
    host copies have landed; the originals may be donated at once without waiting for them.

    Raises what ``device_put`` raises where no pinned host memory exists, ``PinnedFull`` where
    it ran out."""
    snap = _per_device_copy(leaves)
    return _to_pinned(snap), snap


def _warm_pinned_pool(leaves: list, copies: int = 2) -> None:
    """Grows the pinned host pool to ``copies`` snapshots once, before the first timed step: the
    first ``device_put`` to ``pinned_host`` of 1.3 GB took 1.3-1.5 s on an H100 (the pool grows),
    later ones 26-30 ms. JAX gives no way to copy into a buffer it already holds (``device_put``
    always allocates), so reuse rests on XLA's pinned host allocator keeping what it grew: the
    tier then never holds more than ``copies`` snapshots, and the pool stops growing."""
    held = [jax.device_put(leaves, [x.sharding.with_memory_kind("pinned_host") for x in leaves])
            for _ in range(copies)]
    jax.block_until_ready(held)
    del held
