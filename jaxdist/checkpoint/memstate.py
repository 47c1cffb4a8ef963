"""The in-memory state tier: recent steps' state in host memory, where a restarted process finds it.

Under ``jaxdist launch`` every process gets ``JAXDIST_STATE_DIR``, a host-local directory in
shared memory (``/dev/shm`` where it exists) that outlives the processes but not the host.
``TieredCheckpointManager.save`` (``BackupAndRestore``'s, or a custom loop's) calls
:meth:`InMemoryTier.save` after each step; every few steps it takes a snapshot:

* on the loop's thread, only an asynchronous copy of the state's arrays to host memory is
  *dispatched* (``jax.device_put`` to the ``pinned_host`` memory kind: on a GPU the copy engine
  moves it beside the next step, and the next step may donate the state at once). Nothing there
  grows with the state's size: one call per array, the data moves elsewhere;
* a background thread waits for that copy and writes this process's blocks of each array to one
  of two slot files in the directory, with a checksum per block (``jaxdist.checkpoint._slots``);
  at most one snapshot is in flight, and a step that comes while one is still being written is
  skipped rather than waited for.

How often (every ``k`` steps) follows from what a snapshot costs against a step, measured as the
job runs: the time the loop spends dispatching the copy, and, where the devices are the host's
own cores (XLA:CPU), the host time the copy and the writer take from them (also measured as the
slowdown of the steps that overlap a snapshot). ``k`` is the smallest that keeps that cost within
the budget (5% of steps/s by default: ``JAXDIST_MEMORY_TIER_BUDGET``) and lets the writer keep
up; ``JAXDIST_MEMORY_TIER_EVERY=N`` fixes it (``1``: every step, whatever it costs). A failure
then costs at most ``k + d - 1`` steps, ``d`` being the steps a write takes; the tier says so when
it first knows (``tier.json`` beside the slots, which ``jaxdist launch`` prints, and the log).

Sharded state (``zero_stage`` 1-3, a user mesh) is covered: each process writes only the blocks
its devices hold (a block every process holds, as a replicated array, is written once per host);
:meth:`InMemoryTier.resume` puts them together again, re-sharding when the job comes back with
another layout (``jaxdist.checkpoint._assemble``). When the directory lacks room (two slots of this
process's blocks), the tier switches itself off with one warning and the persistent backup is
what a failure falls back to; it never stops training.

Files are raw bytes described by a JSON header: nothing is ever unpickled.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist import _compat
from jaxdist.checkpoint import _assemble, _slots
from jaxdist.checkpoint._assemble import RejoinRequired as RejoinRequired
from jaxdist.checkpoint._assemble import StateMismatchError as StateMismatchError
from jaxdist.checkpoint._cadence import _Cadence
from jaxdist.checkpoint._copies import (
    PinnedFull,
    _arrays,
    _Blocks,
    _blocks,
    _Elsewhere,
    _my_bytes,
    _pinned_copy,
    _writes_replicated,
)
from jaxdist.checkpoint._overlap import _Overlap
from jaxdist.checkpoint.tier_policy import ENV_BUDGET as ENV_BUDGET
from jaxdist.checkpoint.tier_policy import ENV_EVERY as ENV_EVERY
from jaxdist.checkpoint.tier_policy import MemoryTierPolicy as MemoryTierPolicy
from jaxdist.core import PyTree
from jaxdist.core.values import is_static_leaf, join_static, split_static
from jaxdist.launch import DEFAULT_BUDGET as DEFAULT_BUDGET
from jaxdist.launch import describe_tier as describe_tier
from jaxdist.launch import flush_path as flush_path
from jaxdist.launch import flushed as flushed
from jaxdist.launch import format_bytes as _fmt
from jaxdist.launch import outcome_path as outcome_path
from jaxdist.launch import read_outcome as read_outcome
from jaxdist.launch import read_tier as read_tier
from jaxdist.launch import read_token as _read_token
from jaxdist.launch import request_flush as request_flush
from jaxdist.launch import stop_path as stop_path
from jaxdist.launch import tier_path as tier_path
from jaxdist.launch import watches_flush as watches_flush
from jaxdist.launch import write_stop as write_stop
from jaxdist.launch.heartbeat import ENV_STATE_DIR as ENV_STATE_DIR
from jaxdist.launch.heartbeat import heartbeat_path as heartbeat_path
from jaxdist.launch.heartbeat import read_heartbeat as read_heartbeat
from jaxdist.launch.heartbeat import unusable_dir as _unusable_dir
from jaxdist.launch.heartbeat import write_atomic

logger = logging.getLogger(__name__)

_MARGIN = 64 << 20  # room left free in the directory beyond two slots
_PENDING_SMALL = 64 << 20  # host memory small snapshots' copies may hold while they wait
_write_atomic = write_atomic  # the name tests and older code use


class Snapshot(NamedTuple):
    """A state read back from the memory tier by :meth:`InMemoryTier.resume`.

    Attributes:
      step: the completed step the state belongs to.
      state: the train state, placed like the ``target`` (or the strategy's way).
      data_state: the input position after that step (``{"epoch": E, "position": P}``) or None.
      source: this process's index when it read its part on its own host; -1 when the state
        was put together over the network (a host joined or was lost).
    """

    step: int
    state: PyTree
    data_state: dict | None
    source: int


def _positive_int(v):
    """a whole number >= 1"""
    return v >= 1


def _fraction(v):
    """a number in (0, 1), e.g. 0.05 for 5% of steps/s"""
    return 0 < v < 1


class _Copy(NamedTuple):
    step: int
    host: list
    data: dict | None
    held: list | None = None  # the on-device snapshot the host copy reads, until it lands

    def arrays(self) -> list:
        """The copy's arrays in flight to host memory (what to wait for)."""
        return [d for x in self.host if isinstance(x, _Blocks) for d in x.data]


class InMemoryTier:
    """Keeps recent steps' state in host memory; restores it after a restart.

    Args:
      directory: this host's state directory (default: ``$JAXDIST_STATE_DIR``; with neither,
        the tier is disabled and every method is a no-op returning None).
      rank: this process's index (default: ``jax.process_index()``).
      every: copy and persist every N steps (default: ``$JAXDIST_MEMORY_TIER_EVERY``, else
        measured).
      budget: the share of steps/s the tier may cost (default ``$JAXDIST_MEMORY_TIER_BUDGET``
        or 0.05).
      policy: a :class:`~jaxdist.checkpoint.MemoryTierPolicy` setting ``every`` and
        ``budget`` (and ``enabled=False``: the tier is off), instead of the environment.

    >>> import tempfile, jax.numpy as jnp
    >>> tier = InMemoryTier(tempfile.mkdtemp(), rank=0)
    >>> tier.save(3, {"w": jnp.ones(2)}, {"epoch": 0, "position": 3})
    True
    >>> tier.flush()
    >>> snap = tier.resume({"w": jnp.zeros(2)})
    >>> snap.step, snap.state["w"].tolist(), snap.data_state
    (3, [1.0, 1.0], {'epoch': 0, 'position': 3})
    >>> tier.close()
    """

    def __init__(self, directory: str | None = None, *, rank: int | None = None,
                 every: int | None = None, budget: float | None = None,
                 policy: MemoryTierPolicy | None = None):
        self.directory = directory if directory is not None else os.environ.get(ENV_STATE_DIR)
        if policy is not None:
            if not isinstance(policy, MemoryTierPolicy):
                raise TypeError(f"policy={policy!r}: expected a jaxdist.memstate.MemoryTierPolicy")
            every = policy.every if every is None else every
            budget = policy.budget if budget is None else budget
            if not policy.enabled:
                self.directory = None  # off: every method does nothing
        self._rank = rank
        if every is None or budget is None:  # what the code leaves open, the environment says
            env = MemoryTierPolicy.from_env()
            every = env.every if every is None else every
            budget = env.budget if budget is None else budget
        if every is not None and not _positive_int(every):
            raise ValueError(f"every={every!r}: expected {_positive_int.__doc__}")
        if not _fraction(budget):
            raise ValueError(f"budget={budget!r}: expected {_fraction.__doc__}")
        self._every, self._budget = every, budget
        self._cadence: _Cadence | None = None
        self._cond = threading.Condition()
        self._copies: collections.deque = collections.deque()  # dispatched, not yet ready
        self._ready: _Copy | None = None  # the newest copy whose step is done
        self._write_lock = threading.Lock()  # one writer of this process's slots at a time
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._disabled = self.directory is None
        self._discarded = False  # a completed job's copies were removed (discard)
        self._checked = False
        self._fingerprint: str | None = None
        self._last_copied: int | None = None
        self._announced: tuple | None = None
        self._to_host = _pinned_copy
        self._overlap: _Overlap | None = None  # how copies overlap the step (set at first save)
        self._writes_replicated = _writes_replicated()
        self.last_written: int | None = None
        self.skipped = 0
        # The job these snapshots belong to: BackupAndRestore's folder, and the identity that
        # folder records (a token, ``backup.JOB_FILE``; None: it records none). Written beside
        # them at the first save and checked before a resume, so that a kept state directory
        # left set for another training, or for a rerun whose folder was removed or reused since,
        # is refused rather than resumed from. No owner: neither is checked.
        self.owner: str | None = None
        self.job: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether snapshots are kept (a directory is known and it has room)."""
        return not self._disabled

    @property
    def every(self) -> int | None:
        """Steps between persisted snapshots (None until measured, or while disabled)."""
        return None if self._disabled or self._cadence is None else self._cadence.k

    @property
    def bound(self) -> int | None:
        """The most steps a failure costs when other processes survive it (None until known)."""
        return None if self._disabled or self._cadence is None else self._cadence.bound

    def rank(self) -> int:
        return jax.process_index() if self._rank is None else self._rank

    def _my_dir(self) -> str:
        return os.path.join(self.directory, str(self.rank()))

    def beat(self, step: int) -> None:
        """Kept for older code: progress is reported by ``jaxdist.launch.heartbeat``."""
        from jaxdist.launch import heartbeat

        beat = heartbeat.current()
        if beat is not None and step > beat.dispatched:
            beat.on_step(step - beat.dispatched, None)

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, data_state: Mapping | None = None, *,
             force: bool = False) -> bool:
        """Copies ``state`` after ``step`` to host memory when a copy is due; returns whether.

        Call it on every process after each step. It returns at once: the copy runs on the
        device's copy engine (or XLA's threads) and is persisted on a background thread every
        few copies. ``force=True`` copies and persists this step whatever the cadence: a stop
        at an agreed step (:meth:`flush` waits for it).

        Args:
          step: optimizer steps completed.
          state: the train state after that step (it may be donated to the next step at once).
          data_state: the input position after that step (``iterator.state()``).
          force: copy and persist this step.
        """
        if self._disabled or self._discarded:
            return False
        if not self._checked and not self._first_save(state):
            return False
        cadence = self._cadence
        cadence.on_call(int(step))
        if not force and self._last_copied is not None and (
                step - self._last_copied < cadence.copy_every):
            return False
        with self._cond:
            if not self._room():
                waits = force or self._every == 1
                if not waits:
                    self.skipped += 1  # copies in flight fill the allowance: a later step copies
                    return False
                self._cond.wait_for(lambda: self._room() or self._disabled)
                if self._disabled:
                    return False
        start = time.perf_counter()
        try:
            host, held = self._copy_all(_arrays(state))
        except PinnedFull as e:
            self._off(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - the tier never stops training
            self._off(f"copying the state to host memory failed ({type(e).__name__}: {e})")
            return False
        cadence.on_copy(time.perf_counter() - start, None if force else int(step))
        self._last_copied = step
        copy = _Copy(int(step), host, None if data_state is None else dict(data_state), held)
        with self._cond:
            self._copies.append((copy, force))
            self._cond.notify_all()
        return True

    def _room(self) -> bool:
        """Whether another copy may be taken: copies hold host memory (the newest done one is
        kept), so at most two snapshots' worth, or 64 MiB of small ones (the loop runs steps
        ahead of the devices, and a copy is done only when its step has run)."""
        held = len(self._copies) + (self._ready is not None)  # the newest done one is kept
        if self._overlap is not None and self._overlap.snapshots and not self._snapshot_free():
            return False  # one device snapshot at a time: its host copy has not landed yet
        return not self._copies or (held + 1) * self._bytes <= max(2 * self._bytes,
                                                                    _PENDING_SMALL)

    def _snapshot_free(self) -> bool:
        """Whether no device snapshot is held (call with ``_cond``): one whose host copy has
        landed is released here, without waiting for the writer to reach it."""
        for i, (copy, force) in enumerate(self._copies):
            if copy.held is None:
                continue
            try:
                landed = all(a.is_ready() for a in copy.arrays())
            except Exception:  # noqa: BLE001 - a failed copy holds nothing worth keeping
                landed = True
            if not landed:
                return False
            self._copies[i] = (copy._replace(held=None), force)
        return True

    @property
    def holds_snapshot(self) -> bool:
        """Whether a copy holds a device snapshot of the state now (one more state's worth of
        device memory, until the tier releases it once its host copy has landed)."""
        with self._cond:
            return any(copy.held is not None for copy, _ in self._copies)

    def drop_snapshot(self, error: BaseException | str) -> bool:
        """Releases the device snapshot held now and copies the state directly from then on, said
        in one warning line; returns False (and changes nothing) when none is held.

        For a training step that ran out of device memory (``error``) beside the snapshot: the
        step may then run again, if its inputs were not donated (``fit`` does so once). The copy
        that held the snapshot is abandoned, its host copy too: the copy before it stays the
        newest. A custom loop calls it as ``ckpt.memory.drop_snapshot(e)``.
        """
        with self._cond:
            dropped = [copy for copy, _ in self._copies if copy.held is not None]
            if not dropped:
                return False
            self._copies = collections.deque(c for c in self._copies if c[0].held is None)
            for copy in dropped:
                for x in [*copy.held, *copy.arrays()]:  # freed now, whoever still refers to them
                    if isinstance(x, jax.Array):
                        x.delete()
            newest = ("no copy had landed before it" if self._ready is None
                      else f"step {self._ready.step}'s copy stays the newest")
            self._cond.notify_all()
        cause = error if isinstance(error, str) else (str(error).splitlines() or [""])[0][:200]
        if self._overlap is not None:  # always: only the overlap takes snapshots
            self._overlap._go_direct(
                f"the training step ran out of device memory beside the tier's device snapshot "
                f"of the state ({cause}); the snapshot was dropped and its copy (step "
                f"{', '.join(str(c.step) for c in dropped)}) abandoned; {newest}",
                f"To keep snapshots, leave device memory for one more copy of the state "
                f"({_fmt(self._bytes)}) beside the step: a smaller batch or model, or a larger "
                f"share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION)")
        return True

    def _copy_all(self, leaves: list) -> tuple[list, list | None]:
        """Host copies of this process's blocks of ``leaves`` (each distinct block once),
        dispatched in one call (asynchronous; only this process's devices take part), and the
        device snapshot they read (None: they read the state itself, or XLA:CPU)."""
        out: list[Any] = [None] * len(leaves)
        moving, where = [], []
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array):
                out[i] = np.array(x)
            elif x.is_fully_replicated and not self._writes_replicated:
                out[i] = _Elsewhere(x.shape, np.dtype(x.dtype).name)  # another local process
            else:
                seen, blocks = set(), []
                for shard in x.addressable_shards:
                    index = tuple((s.start or 0, n if s.stop is None else s.stop)
                                  for s, n in zip(shard.index, x.shape))
                    if index not in seen:
                        seen.add(index)
                        blocks.append(index)
                        moving.append(shard.data)
                out[i] = _Blocks(tuple(x.shape), np.dtype(x.dtype).name, blocks)
                where.append((i, len(blocks)))
        held = None
        if moving:
            if self._overlap is not None:
                landed, held = self._overlap.to_host(moving)
            else:
                landed = self._to_host(moving)
            copies = iter(landed)
            for i, n in where:
                out[i] = out[i]._replace(data=[next(copies) for _ in range(n)])
        return out, held

    def _blocks_of(self, leaves: list) -> list:
        """This process's distinct blocks of ``leaves`` on its devices (what a copy moves)."""
        out = []
        for x in leaves:
            if isinstance(x, jax.Array) and (self._writes_replicated or not x.is_fully_replicated):
                seen = set()
                for shard in x.addressable_shards:
                    index = tuple((s.start, s.stop) for s in shard.index)
                    if index not in seen:
                        seen.add(index)
                        out.append(shard.data)
        return out

    def _first_save(self, state: PyTree) -> bool:
        self._checked = True
        leaves = _arrays(state)
        self._fingerprint = _assemble.describe(state)[0]
        need = sum(_my_bytes(x) for x in leaves)
        try:
            os.makedirs(self._my_dir(), exist_ok=True)
        except OSError as e:  # one line, not a traceback, and nothing about free space
            if _unusable_dir() == self.directory:  # the heartbeat has said it already
                self._disabled = True
                return False
            self._off(f"{ENV_STATE_DIR}={self.directory} cannot be used ({e.strerror or e}); set "
                      "it to a writable directory, or unset it")
            return False
        free = _free_bytes(self.directory) + sum(_slot_sizes(self._my_dir()))
        if free < 2 * need + _MARGIN:
            self._off(f"two snapshots of this process's part of the state need "
                      f"{_fmt(2 * need)} in {self.directory}, which has {_fmt(free)} free; make "
                      "it larger (a container: --shm-size) or point JAXDIST_STATE_DIR at a "
                      "directory with room")
            return False
        self._bytes = need
        if self.owner is not None and _read_owner(self.directory) != self._owner_record():
            try:  # the slots are this job's from now on (an older record gains the identity)
                write_atomic(_owner_path(self.directory), json.dumps(self._owner_record()).encode())
            except OSError:
                pass  # a full directory: the slots' own writes will say so
        if self._overlap is None:
            try:
                self._overlap = _Overlap.start(self._blocks_of(leaves))
            except PinnedFull as e:
                self._off(str(e))
                return False
        policy = MemoryTierPolicy(every=self._every, budget=self._budget)
        self._cadence = _Cadence(self._every, self._budget,
                                 host_is_device=jax.default_backend() == "cpu", nbytes=need,
                                 decide=policy.decide)
        for target, name in ((self._writer, "jaxdist-memstate"),
                             (self._watch_flush, "jaxdist-memstate-flush")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return True

    def _off(self, why: str) -> None:
        if not self._disabled:
            self._disabled = True
            logger.warning("the in-memory state tier is off: %s. Training goes on; a failure "
                           "resumes from the persistent backup (BackupAndRestore's directory).",
                           why)
            if self.directory is not None:
                for slot in range(_slots.SLOTS):
                    for path in (_slots.header_path(self._my_dir(), slot),
                                 _slots.data_path(self._my_dir(), slot)):
                        try:
                            os.remove(path)
                        except OSError:
                            pass
        with self._cond:
            self._copies.clear()
            self._ready = None
            self._cond.notify_all()

    def _writer(self) -> None:
        """Waits for each copy's step to be done; persists every ``k`` steps (or when forced)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._copies or self._stopping)
                if not self._copies:
                    return
                copy, force = self._copies[0]
            arrays = copy.arrays()
            held = copy.held or []
            try:
                # The device snapshot is ready when its step is (it runs right after it): when
                # the writer has to wait for it, the host copy's landing is timed from there.
                timed = not all(a.is_ready() for a in held)
                jax.block_until_ready(held)
                snapped = time.perf_counter()
                waited = not all(a.is_ready() for a in arrays)
                jax.block_until_ready(arrays)
            except Exception as e:  # noqa: BLE001 - the tier never stops training
                # The step it copies failed (a peer died inside its collective, say): the copy
                # is dropped; the slots keep the newest good snapshot.
                logger.debug("the copy of step %d failed: %s", copy.step, e)
                self._take(copy, landed=False)
                continue
            if timed:
                self._cadence.on_landed(time.perf_counter() - snapped)
            # Landed: its device snapshot is not needed any more (not even while it is written).
            del held
            copy = copy._replace(held=None)
            if waited:  # only then is now the time its step finished (else: some time before)
                self._cadence.on_done(copy.step)
            if not self._take(copy, landed=True):
                continue  # dropped while the writer waited for it (drop_snapshot)
            last = self.last_written
            if force or last is None or copy.step - last >= self._cadence.k:
                self._persist(copy)

    def _take(self, copy: _Copy, *, landed: bool) -> bool:
        """The writer is done waiting for ``copy``: out of the copies in flight, and the newest
        done one if it landed; returns whether it is (not when ``drop_snapshot`` abandoned it)."""
        with self._cond:
            if self._copies and self._copies[0][0].step == copy.step:
                self._copies.popleft()
            landed = landed and not any(isinstance(a, jax.Array) and a.is_deleted()
                                        for a in copy.arrays())
            if landed:
                self._ready = copy._replace(held=None)  # its device snapshot is free again
            self._cond.notify_all()
        return landed

    def _persist(self, copy: _Copy) -> None:
        """Writes ``copy`` to a slot (unless a newer one is there already)."""
        with self._write_lock:
            if self._disabled or (self.last_written is not None
                                  and copy.step <= self.last_written):
                return
            start, cpu0 = time.perf_counter(), time.thread_time()
            try:
                blocks = [_blocks(x) for x in copy.host]
            except Exception as e:  # noqa: BLE001 - the step this copy is of failed
                # (e.g. a peer died inside its collective): not a snapshot, and no reason to
                # switch the tier off and remove the slots that hold the newest good one.
                logger.debug("the copy of step %d failed: %s", copy.step, e)
                return
            stats: dict = {}
            try:
                written = _slots.write(self._my_dir(), _slots.free_slot(self._my_dir()),
                                       step=copy.step, data_state=copy.data,
                                       fingerprint=self._fingerprint, leaves=blocks,
                                       threads=_write_threads(self._cadence.host_is_device),
                                       stats=stats)
            except _slots.TierFull as e:
                self._off(str(e))
                return
            except Exception as e:  # noqa: BLE001 - the tier never stops training
                self._off(f"writing a snapshot failed ({type(e).__name__}: {e})")
                return
            self.last_written = copy.step
            # CPU time of this thread (reading the copy) and of the threads that wrote it
            cpu = time.thread_time() - cpu0 + stats.get("cpu_s", 0.0)
            self._cadence.on_persist(cpu, time.perf_counter() - start, copy.step)
            self._announce(written)

    def _watch_flush(self) -> None:
        """Persists the newest done copy when the launcher asks (a peer failed: this process is
        about to be stopped, and its copy may be what the job resumes from)."""
        rank_dir = self._my_dir()
        try:
            write_atomic(os.path.join(rank_dir, "flush-watch"), str(os.getpid()).encode())
        except OSError:
            return
        seen = _read_token(flush_path(self.directory))
        while not self._stopping:
            time.sleep(0.02)
            token = _read_token(flush_path(self.directory))
            if token is None or token == seen:
                continue
            seen = token
            copy = self._newest_done()
            if copy is not None:
                self._persist(copy)
            try:
                write_atomic(os.path.join(rank_dir, "flushed"),
                             f"{token} {self.last_written}".encode())
            except OSError:
                pass

    def _newest_done(self) -> _Copy | None:
        """The newest copy that has landed in host memory. The writer takes copies in order and
        may still be writing an older one (a write of hundreds of MB takes a while), so a landed
        copy it has not reached yet is looked for among those in flight."""
        with self._cond:
            newest = self._ready
            for copy, _ in self._copies:
                if newest is not None and copy.step <= newest.step:
                    continue
                try:
                    landed = all(a.is_ready() for a in copy.arrays())
                except Exception:  # noqa: BLE001 - a failed copy is not a newer one
                    landed = False
                if landed:
                    newest = copy
        return newest

    def _announce(self, written: int) -> None:
        c = self._cadence
        if c.bound is None or self._announced == (c.copy_every, c.k, c.bound, c.bound_all):
            return
        self._announced = (c.copy_every, c.k, c.bound, c.bound_all)
        info = {"bytes": self._bytes, "written_bytes": written, "copy_every": c.copy_every,
                "every": c.k, "bound": c.bound, "bound_all": c.bound_all, "cost_s": c.cost(),
                "step_s": c.step_s(), "budget": c.budget, "fixed": self._every is not None,
                "parts": c.parts}
        logger.info("%s", describe_tier(info))
        try:
            write_atomic(tier_path(self.directory, self.rank()), json.dumps(info).encode())
        except OSError:
            pass

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every copy taken is done (at most ``timeout_s``) and writes the newest."""
        if self._cadence is None:
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._copies, timeout=timeout_s)
        copy = self._newest_done()
        if copy is not None:
            self._persist(copy)

    def stop_step(self) -> int | None:
        """The step at which the elastic agent asked the job to stop (to re-form), or None.

        The agent writes it to ``<dir>/stop``; every process reads it after each step (a
        ``stat``, plus a read when it changes).
        """
        if self.directory is None:
            return None
        path = stop_path(self.directory)
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return None
        if mtime != getattr(self, "_stop_mtime", None):
            try:
                with open(path, "rb") as f:
                    self._stop_step = int(f.read())
            except (OSError, ValueError):
                return None
            self._stop_mtime = mtime
        return self._stop_step

    # --- resuming ------------------------------------------------------------------------------

    def newest_local(self) -> tuple[int, str] | None:
        """The newest valid snapshot on this host (any rank's): ``(step, its data file)`` or None."""
        if self.directory is None:
            return None
        found = [(int(h["step"]), _slots.data_path(d, s)) for d, s, h in _slots.slots(
            self.directory)]
        return max(found, default=None)

    def resume(self, target: PyTree, strategy=None) -> Snapshot | None:
        """Every process: the newest step the job's processes hold, with its state; None if none.

        Collective: call it on every process of the job at the same point (start of training).

        Args:
          target: a state with the saved one's structure, shapes and dtypes (values unused),
            placed the way the resumed state should be (the strategy's ``put``).
          strategy: place the result the strategy's way (default: like ``target``).

        Returns:
          A :class:`Snapshot`, or None when no process holds one (or the tier is disabled).

        Raises:
          StateMismatchError: this process's state differs from the job's (another model):
            it must not join.
          RejoinRequired: another process's state differs; this one ends (status 0) so that
            the job re-forms without it.
        """
        if self.directory is None or self._refuses():
            return None
        try:
            _assemble.check_same_state(self.directory, target)
        except StateMismatchError as e:
            self._outcome({"rejected": str(e)})
            raise
        except RejoinRequired:
            self._outcome({"reform": "another process's state differs from the job's"})
            raise
        if strategy is not None:
            target = strategy.put(target)
        tleaves, treedef, statics = split_static(target)
        found = _assemble.resume(self.directory, target, list(tleaves))
        if found is None:
            return None
        step, leaves, data, how = found
        state = join_static(treedef, statics, leaves)
        logger.info("resuming from step %d held in memory (read from %s)", step, how)
        source = jax.process_index() if how == "its own host" else -1
        return Snapshot(step, state, data, source)

    def _owner_record(self) -> dict:
        """What ``owner.json`` says of this job's snapshots."""
        return {"owner": self.owner} | ({} if self.job is None else {"job": self.job})

    def _not_ours(self) -> str | None:
        """Why the snapshots here are not this job's (one line naming the fix), or None."""
        theirs = _read_owner(self.directory)
        if self.owner is None or theirs is None:
            return None  # nothing checked, nothing saved yet (or by a version without owners)
        folder = theirs.get("owner", "(unreadable)")
        if folder != self.owner:
            return (f"the in-memory state in {self.directory} belongs to another job (backed up "
                    f"to {folder}; this one backs up to {self.owner}): not resumed from it, and "
                    "the tier is off for this run so that it stays intact. Unset "
                    f"{ENV_STATE_DIR}, or set it to this job's kept state")
        if "job" not in theirs or theirs["job"] == self.job:
            return None  # this job's (a record without an identity: an older version's, as before)
        now = ("holds no job identity (removed, or a fresh folder)" if self.job is None
               else "holds another run's identity (a training started there since)")
        return (f"the in-memory state in {self.directory} belongs to an earlier run that backed "
                f"up to {folder}, which now {now}: not resumed from it, and the tier is off for "
                f"this run so that it stays intact. Unset {ENV_STATE_DIR} to start afresh, or "
                f"remove {self.directory} if that run's state is not needed")

    def _refuses(self) -> bool:
        """Whether (after one warning line) the snapshots belong to another job, or to an earlier
        run of this one whose backup folder was removed or reused since; every process learns
        whether any refuses (a collective), so that all of them resume alike."""
        why = self._not_ours()
        refused = any(_assemble.allgather_json(why is not None)) if jax.process_count() > 1 \
            else why is not None
        if why is not None:
            logger.warning("%s", why)
            self._disabled = True
        elif refused:
            logger.warning("another process's in-memory state belongs to another job: the job "
                           "does not resume from memory")
        return refused

    def _outcome(self, what: dict) -> None:
        """Tells this host's agent why this process ends (``outcome.json`` beside its slots)."""
        try:
            write_atomic(outcome_path(self.directory, self.rank()), json.dumps(what).encode())
        except OSError:
            pass

    def discard(self) -> None:
        """Forgets this process's snapshots: a job that completed leaves nothing a later run
        could resume from (``BackupAndRestore(delete_checkpoint=True)``; every process calls it
        for its own slots). It saves nothing afterwards (``enabled`` still says whether it ran). A
        tier that is off (another job's state directory, which it refused; no room) leaves the
        directory as it is."""
        if self.directory is None or self._disabled:
            return
        self._discarded = True
        self._stop_threads()
        with self._write_lock:  # a write still under way finishes first
            for slot in range(_slots.SLOTS):
                for path in (_slots.header_path(self._my_dir(), slot),
                             _slots.data_path(self._my_dir(), slot)):
                    with contextlib.suppress(OSError):
                        os.remove(path)
        if self.rank() == 0:
            with contextlib.suppress(OSError):
                os.remove(_owner_path(self.directory))

    def close(self, timeout_s: float = 30.0) -> None:
        """Writes the newest copy (waiting at most ``timeout_s`` for copies whose step may never
        finish: a failed peer) and stops the threads."""
        if not self._threads:
            return
        self.flush(timeout_s)
        self._stop_threads()

    def _stop_threads(self) -> None:
        self._stopping = True
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=1.0)
        self._threads = []


def _owner_path(directory: str) -> str:
    return os.path.join(directory, "owner.json")


def _read_owner(directory: str) -> dict | None:
    """``owner.json``'s record (``{"owner": folder, "job": token}``; older versions wrote no
    ``job``), None when there is none, ``{}`` when it is unreadable."""
    try:
        with open(_owner_path(directory), "rb") as f:
            record = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_threads(host_is_device: bool) -> int:
    """Threads that write a snapshot: several beside accelerators (the host's cores are idle);
    one on XLA:CPU, whose devices are those cores (more threads would take the same CPU time
    from the steps, only sooner)."""
    return 1 if host_is_device else max(1, min(8, (os.cpu_count() or 1) // 2))


def _free_bytes(directory: str) -> int:
    try:
        os.makedirs(directory, exist_ok=True)
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _slot_sizes(rank_dir: str) -> list[int]:
    sizes = []
    for slot in range(_slots.SLOTS):
        try:
            sizes.append(os.path.getsize(_slots.data_path(rank_dir, slot)))
        except OSError:
            pass
    return sizes


def _like(state: PyTree, target: PyTree) -> PyTree:
    def place(x, t):
        if isinstance(t, jax.Array) and not is_static_leaf(x):
            return jax.device_put(x, t.sharding)
        return x
    return jax.tree.map(place, state, target)


__getattr__ = _compat.renamed(__name__)  # the old names (RENAMED), deprecated
