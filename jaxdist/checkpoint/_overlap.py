"""How the in-memory tier's host copies overlap the training step (``jaxdist.memstate``).

On a GPU or TPU a host copy (``jax.device_put`` to the ``pinned_host`` memory kind) reads its
source buffers until it lands: tens of milliseconds for a GB over PCIe. A training step donates
its state, so a step that follows a copy of the state itself waits for the copy (measured on an
H100 with a 1.3 GB state and 41 ms steps: a copy every 4 steps cost 12% of steps/s, 58% while the
pinned pool grew). The tier therefore copies an on-device *snapshot*: a compiled copy of the
state, fresh buffers no step donates, which runs in order on the devices (3% of a step when taken
every step), and the host copy of it overlaps the steps that follow; the snapshot is released
once its host copy has landed, so one extra state of device memory is held while a copy is in
flight, and a copy is skipped (not waited for) while the previous snapshot is still held.

A device without room for that extra state (``memory_stats()``: its allocator's limit less the
peak it has seen) gets the direct copy instead, said in one log line: copies then read the state
itself and the step after one may wait for it (the cadence measures that and copies less often).
The room is checked again whenever the devices' peak has grown since (an evaluation, a longer
batch), and a snapshot that runs out of device memory turns snapshots off the same way. A
training step that runs out of device memory while a snapshot is held beside it makes the tier
drop that snapshot (its copy is abandoned; the previous one stays the newest) and turn snapshots
off the same way (``InMemoryTier.drop_snapshot``), and ``fit`` runs that step again once. Host
copies never go to device memory: where pinned host memory runs out (XLA's pinned allocator is
capped) the tier turns itself off in one line (``PinnedFull``), as a copy in device memory would
be lost with its process.
Pinned host memory is grown once at the tier's start (a throwaway copy, not counted as a copy's
cost); JAX allocates every ``device_put``'s destination anew, so reuse rests on XLA's pinned host
allocator keeping what it grew, and the tier never holds more than two copies. On XLA:CPU (device
memory is host memory) a copy is a compiled copy on each device, as before.
"""

from __future__ import annotations

import logging

import jax

from jaxdist.checkpoint._copies import (
    PinnedFull,
    _device_room,
    _is_host_device,
    _peak,
    _pinned_copy,
    _snapshot_to_host,
    _warm_pinned_pool,
)

logger = logging.getLogger("jaxdist.checkpoint.memstate")


class _Overlap:
    """The tier's way of copying: ``snapshots`` (copy an on-device snapshot) or the direct copy."""

    def __init__(self, snapshots: bool, peak: int | None = None):
        self.snapshots = snapshots
        self._peak = peak  # the devices' peak use when their room was last checked

    @classmethod
    def start(cls, blocks: list) -> _Overlap | None:
        """The way to copy ``blocks`` (this process's device buffers of the state), with the
        pinned pool and the snapshot's compile warmed once; None on XLA:CPU (today's copy)."""
        if not blocks or _is_host_device(blocks):
            return None
        peak = _peak(blocks)
        room, why = _device_room(blocks)
        try:
            if room:
                host, snap = _snapshot_to_host(blocks)  # compiles the copy, grows the pool
                jax.block_until_ready(host)
                del snap
                _warm_pinned_pool(blocks, copies=1)  # a second copy held beside the first
                del host
                return cls(True, peak)
            _warm_pinned_pool(blocks, copies=2)
        except PinnedFull:
            raise  # never a device copy instead: the tier turns itself off
        except (ValueError, NotImplementedError, TypeError, jax.errors.JaxRuntimeError) as e:
            if room and "RESOURCE_EXHAUSTED" in str(e):
                why = f"allocating a snapshot failed ({str(e).splitlines()[0][:200]})"
            else:
                logger.debug("no pinned host memory here (%s): a device-side copy instead", e)
                return None
        logger.warning("in-memory tier: copying the state directly, not through a device "
                       "snapshot: %s. The step after each copy may wait for it; the tier copies "
                       "less often to stay within its budget", why)
        return cls(False)

    def to_host(self, blocks: list) -> tuple[list, list | None]:
        """``(host copies, the device snapshot they read or None)``, dispatched asynchronously.

        Raises ``PinnedFull`` when pinned host memory ran out."""
        if self.snapshots and self._still_room(blocks):
            try:
                return _snapshot_to_host(blocks)
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                self._go_direct(f"no device memory for a snapshot "
                                f"({str(e).splitlines()[0][:200]})")
        return _pinned_copy(blocks), None

    def _still_room(self, blocks: list) -> bool:
        """Whether a snapshot still fits: checked again only when the devices' peak grew since
        the last check (a longer sequence, an evaluation); snapshots go off, said once, if not."""
        peak = _peak(blocks)
        if peak is None or self._peak is None or peak <= self._peak:
            return True
        self._peak = peak
        room, why = _device_room(blocks)
        if not room:
            self._go_direct(why)
        return room

    def _go_direct(self, why: str, fix: str = "") -> None:
        """Snapshots off for the rest of the run, said in one line (``why``, then ``fix``)."""
        self.snapshots = False
        logger.warning("in-memory tier: copying the state directly from now on: %s. The step "
                       "after each copy may wait for it%s", why, fix and f". {fix}")
