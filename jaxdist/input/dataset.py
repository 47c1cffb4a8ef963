"""Distributed input: global batches padded with a mask, sharded per process, prefetched to device.

Invariant: every example of an epoch is seen exactly once. A final partial batch is padded up to
the global batch size (so the step's shape, and therefore its compilation, never changes) with
copies of real rows, and ``mask`` marks which rows are real. Copies rather than zeros, so that a
padded row never produces NaN in a loss that a mask multiplies away (``NaN * 0`` is still NaN).

Batches of in-memory arrays are placed on the devices ahead of use, several at a time: the rows of
up to ``AHEAD_BATCHES`` batches (at most ``AHEAD_BYTES`` of them; one batch when a batch is larger)
are gathered in one copy, sent to the devices in one transfer and split there into per-step
batches in one dispatch (never more than an epoch holds). A transfer costs the host about as much
for thirty-two small batches as for one, so this takes most of the input's host work off a small
model's steps (per batch on one CPU device: 13 us at 8 a time, 8 us at 32). A stack of batches
for several steps in one compiled call (``fit``'s ``steps_per_execution``) is made the same way,
without the split.

In-memory arrays that fit a memory budget (``on_device``; see ``ON_DEVICE_FRACTION``) are placed on
the devices once, a full copy on each local device, the first time the dataset is iterated. Every
batch, chunk or stack is then gathered there from the indices the host computes exactly as it does
for host rows (the same order, padding, masks and resume positions): per batch the host sends a few
bytes of indices instead of the rows, and each device gathers its own rows from its own copy, with
no traffic between devices.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist.core import PyTree, warn_non_finite
from jaxdist.core.layout import check_batch_leaves
from jaxdist.core.step import stacked_sharding
from jaxdist.core.values import Batch
from jaxdist.input.iterator import DistributedIterator, _first, _one
from jaxdist.input.local import (
    AutoShardPolicy,
    ShardableSource,
    StepSync,
    new_stream_name,
    pipelines,
    regroup,
    rows_of,
    synced,
)

__all__ = ["Batch", "DistributedDataset", "DistributedIterator", "Group", "check_batch_leaves"]

logger = logging.getLogger(__name__)

AHEAD_BATCHES = 32
"""The most batches of in-memory arrays placed on the devices ahead of use (made in one go)."""
AHEAD_BYTES = 16 << 20
"""...and the most bytes of them (global batch bytes; each device holds its share)."""
ON_DEVICE_FRACTION = 0.25
"""``on_device=None`` keeps in-memory arrays on the devices when their bytes are at most this share
of the smallest local device's memory (``device.memory_stats()["bytes_limit"]``): each local device
holds a full copy."""
ON_DEVICE_HOST_BYTES = 1 << 30
"""...and where JAX reports no device memory (CPU devices share the host's): when their bytes times
the number of local devices (one copy each) are at most this."""


class _Indices(NamedTuple):
    """Rows to gather on the devices from the dataset placed there: this process's rows of a batch
    ``(rows,)`` or of a stack of batches ``(size, rows)``, int32."""

    idx: np.ndarray


class _Host(NamedTuple):
    """A global batch on the host: this process's rows of it, the mask (of the whole global batch
    when this process knows it, else of its own rows), and the number of real rows in the whole
    global batch."""

    local: PyTree
    mask: np.ndarray
    num_real: int


class _HostGroup(NamedTuple):
    """Consecutive global batches on the host, stacked: this process's rows of each
    ``(size, rows, ...)``, their masks ``(size, gb or rows)``, and the real rows in each of the
    first ``len(num_real)`` of them (the rest only pad the stack to its usual size)."""

    local: PyTree
    mask: np.ndarray
    num_real: tuple


class Group(NamedTuple):
    """Consecutive batches stacked on a new leading axis, for one compiled call of several steps.

    Attributes:
      batches: a ``Batch`` whose data leaves are ``(size, global_batch, ...)`` and whose mask is
        ``(size, global_batch)``, placed ``P(None, data)`` (the mask replicated when it can be).
      num_real: the real examples of each batch of the group, in order; ``len(num_real)`` batches
        are real, the remaining entries up to ``size`` only pad an epoch's last, shorter group
        (``DistributedStep.steps`` never runs them).
    """

    batches: Batch
    num_real: tuple


class DistributedDataset:
    """What ``strategy.distribute`` returns: iterate it for one epoch of ``jaxdist.Batch`` values.

    Each ``iter()`` starts the next epoch (epochs reshuffle deterministically from the seed);
    ``iterator(epoch=, position=)`` starts anywhere, which is how a checkpointed run resumes exactly.
    An iterable source is split between processes by ``auto_shard_policy``
    (``jaxdist.AutoShardPolicy``); with ``FILE`` / ``OFF`` each process reads only its own stream.
    """

    def __init__(self, strategy: Any, data: Any, global_batch_size: int, *,
                 shuffle: bool = False, seed: int = 0, drop_remainder: bool = False,
                 prefetch: int | None = None,
                 auto_shard_policy: AutoShardPolicy | str = AutoShardPolicy.AUTO,
                 sync_timeout_s: float = 300.0, on_device: bool | None = None):
        if on_device not in (None, True, False):
            raise ValueError(f"on_device must be None (on the devices when the arrays fit "
                             f"ON_DEVICE_FRACTION of their memory), True or False, got {on_device!r}")
        in_memory = isinstance(data, (tuple, dict, np.ndarray, jax.Array))
        if prefetch is None:
            # In-memory rows cost one gather and an asynchronous transfer, less than handing them
            # over from a thread (benchmarks/overhead.py: distribute_thread); an iterable's batches
            # may take real time to make, so a thread makes them while the devices compute.
            prefetch = 0 if in_memory else 2
        self._setup(strategy, global_batch_size, prefetch, sync_timeout_s)
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        policy = AutoShardPolicy(auto_shard_policy)
        if isinstance(data, list) and data and all(isinstance(x, (np.ndarray, jax.Array))
                                                   for x in data):
            shapes = [tuple(np.shape(x)) for x in data]
            raise ValueError(
                f"distribute got a list of {len(data)} arrays {shapes}: a list is an iterable of "
                f"batches, so this would be read as {len(data)} batches of one array each. For a "
                "dataset of features and labels pass a tuple (x, y) or a dict; for batches of a "
                "single array pass iter(batches) or a generator function")
        if in_memory:
            if policy in (AutoShardPolicy.FILE, AutoShardPolicy.OFF):
                raise ValueError(
                    f"auto_shard_policy={policy} applies to iterable sources; in-memory arrays are "
                    "split by rows on every process (AUTO / DATA). For data that already differs "
                    "per process use strategy.distribute_datasets_from_function")
            self._num_examples = check_batch_leaves(data, self.strategy.num_replicas_in_sync,
                                                    what="dataset")
            warn_non_finite(data, what="dataset")
            # Taken as they are now, as tf.data does: changing the caller's arrays afterwards
            # changes no batch, on the host or the devices alike (read-only arrays, a read-only
            # memory map say, are used as they are: nothing can change them through them).
            self._arrays = jax.tree.map(_snapshot, data)
            self._iterable = None
            row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:]))
                            for a in jax.tree.leaves(self._arrays))
            self._ahead = int(max(1, min(AHEAD_BATCHES, -(-self._num_examples // global_batch_size),
                                         AHEAD_BYTES // max(1, row_bytes * global_batch_size))))
            self._on_device = self._keep_on_device(on_device, row_bytes * self._num_examples)
            self._on_device_asked = on_device
        elif isinstance(data, Iterable) or callable(data):
            if shuffle:
                raise ValueError("shuffle=True needs an in-memory dataset ((x, y) tuple or dict of "
                                 "arrays); shuffle an iterable of batches at its source")
            if policy is AutoShardPolicy.AUTO:
                policy = (AutoShardPolicy.FILE if isinstance(data, ShardableSource)
                          else AutoShardPolicy.DATA)
            if policy is AutoShardPolicy.FILE and not isinstance(data, ShardableSource):
                raise ValueError(
                    f"AutoShardPolicy.FILE needs a source that exposes shards (an object with "
                    f"shard(index, count), e.g. jaxdist.FileSource(paths, read)), got a "
                    f"{type(data).__name__}; wrap the files in a FileSource, or use "
                    "AutoShardPolicy.DATA (every process reads all batches and keeps its rows)")
            self._arrays, self._num_examples, self._iterable = None, None, data
        else:
            raise ValueError(
                f"cannot distribute a {type(data).__name__}; pass (x, y) / a dict of numpy arrays, "
                "or an iterable of such batches")
        self.auto_shard_policy = policy
        if policy in (AutoShardPolicy.FILE, AutoShardPolicy.OFF):
            self._stream = new_stream_name()

    def _setup(self, strategy: Any, global_batch_size: int, prefetch: int,
               sync_timeout_s: float) -> None:
        n = strategy.num_replicas_in_sync
        if not isinstance(global_batch_size, (int, np.integer)) or global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
        if global_batch_size % n:
            lo = global_batch_size // n * n
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide over the {n} replicas of "
                f"{type(strategy).__name__}; use a multiple of {n} such as {lo or n} or {lo + n}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (0: batches are made by the loop's own "
                             f"thread when it asks for them), got {prefetch!r}")
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s!r}")
        self.strategy = strategy
        self.global_batch_size = int(global_batch_size)
        self.shuffle, self.seed, self.drop_remainder = False, 0, False
        self.auto_shard_policy = AutoShardPolicy.DATA
        self._prefetch, self._sync_timeout_s = prefetch, sync_timeout_s
        self._epoch = 0
        self._runs = itertools.count()
        self._full_mask = None  # the device mask of a batch without padding, made once
        self._arrays = None
        self._ahead = 1  # batches placed ahead of use at a time (in-memory arrays: see __init__)
        self._on_device = False  # in-memory arrays gathered on the devices (see _keep_on_device)
        self._device_arrays = None  # ... placed there on first use
        self._on_device_asked = None  # what distribute(on_device=...) said (in-memory arrays)
        self._placing = threading.Lock()
        self._gathers: dict = {}  # compiled gathers, by the shape of what they make
        self._full_masks: dict = {}  # the device mask of a stack of full batches, by its shape

    def _keep_on_device(self, on_device: bool | None, nbytes: int) -> bool:
        """Whether the in-memory arrays (``nbytes``) are gathered on the devices (see
        ``ON_DEVICE_FRACTION``): ``on_device`` when it is given, else when they fit the budget."""
        if any(a.dtype.hasobject for a in jax.tree.leaves(self._arrays)):
            if on_device:
                raise ValueError("on_device=True needs numeric arrays; this dataset has an object "
                                 "array (strings?), which only the host can index: leave on_device "
                                 "unset or pass False")
            return False
        if on_device is not None:
            return on_device
        devices = list(self.strategy.layout.batch.addressable_devices)
        if not devices:  # nothing of the batch is this process's: nothing to place here
            return False
        limits = []
        for d in devices:
            try:
                stats = d.memory_stats()
            except Exception:  # a backend without memory statistics
                stats = None
            if not stats or "bytes_limit" not in stats:
                return nbytes * len(devices) <= ON_DEVICE_HOST_BYTES
            limits.append(int(stats["bytes_limit"]))
        keep = nbytes <= ON_DEVICE_FRACTION * min(limits)
        if not keep:
            logger.info("distribute: %.1f MB of arrays exceed %.0f%% of a device's memory; their "
                        "batches are gathered on the host", nbytes / 1e6, ON_DEVICE_FRACTION * 100)
        return keep

    @property
    def on_device(self) -> bool:
        """Whether batches are gathered on the devices from arrays placed there once."""
        return self._on_device

    def __len__(self) -> int:
        """Batches per epoch (in-memory datasets only)."""
        if self._arrays is None:
            raise TypeError("the number of batches of an iterable dataset is not known")
        full, rest = divmod(self._num_examples, self.global_batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    @property
    def num_examples(self) -> int | None:
        return self._num_examples

    def __iter__(self) -> "DistributedIterator":
        return self.next_epoch()

    def next_epoch(self, **options: Any) -> "DistributedIterator":
        """What ``iter()`` returns (the next epoch), with ``iterator``'s other options."""
        it = self.iterator(epoch=self._epoch, **options)
        self._epoch += 1
        return it

    def iterator(self, *, epoch: int = 0, position: int = 0, group_size: int | None = None,
                 steps: int | None = None) -> "DistributedIterator":
        """An iterator over ``epoch`` starting after ``position`` batches.

        Args:
          epoch, position: where to start (``iterator(**it.state())`` resumes ``it``).
          group_size: with ``K``, yield ``Group`` values instead of batches: ``K`` consecutive
            batches stacked on a new leading axis (fewer real ones at the epoch's end), what one
            compiled call of ``K`` steps takes (``fit(..., steps_per_execution=K)``). For
            in-memory data, ``K`` past the epoch's batches (or ``steps``) is capped there.
          steps: hand out at most this many batches (the epoch may end sooner); none is made
            past them.

        Raises:
          ValueError: ``group_size`` or ``steps`` not an int >= 1.
        """
        for name, value in (("group_size", group_size), ("steps", steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if group_size is not None and self._arrays is not None:
            # A group is padded to group_size batches: K=40000 on an 8-batch epoch stacked
            # 2.4 GB. A group never holds more than the epoch's batches (nor `steps`), so capping
            # there changes no number, and the size stays the same from epoch to epoch (one
            # compilation). An iterable dataset's length is not known: it is not capped.
            group_size = max(1, min(int(group_size), len(self), steps or len(self)))
        return DistributedIterator(self, epoch, position, group_size, steps)

    def epoch_stream(self, epoch: int, position: int, stop: threading.Event, *,
                     group_size: int | None = None, steps: int | None = None
                     ) -> tuple[Iterator[Any], Callable[[Any], Any], int]:
        """What an iterator of this dataset runs (``DistributedIterator`` asks for it):
        ``(items, make, prefetch)``, the epoch's host-side items from batch ``position`` (groups
        of ``group_size``, or chunks placed ahead, or single batches; ``steps`` at most), the
        function that places one item on the devices (a ``Group``, or a list of
        ``(Batch, num_real)``), and how many items a producer thread makes ahead (0: on the
        caller's thread). ``stop`` ends the items early. Call it on the loop's thread: it takes
        the iteration's run number, so that processes creating iterators in the same order name
        the same exchange."""
        run = next(self._runs)
        if group_size is not None:
            return (self._host_groups(epoch, position, run, stop, group_size, steps),
                    self._group_to_device, self._prefetch)
        if self._ahead > 1:
            return (self._host_groups(epoch, position, run, stop, self._ahead, steps),
                    self._chunk_to_device, self._prefetch)
        items = self._host_batches(epoch, position, run, stop)
        if steps is not None:
            items = _first(items, steps)
        return items, functools.partial(_one, self._to_device), self._prefetch

    # --- producing host batches -------------------------------------------------------------------
    def _rows(self) -> slice:
        """The rows of a global batch whose devices belong to this process."""
        if jax.process_count() == 1:
            return slice(0, self.global_batch_size)
        index_map = self.strategy.layout.batch.addressable_devices_indices_map(
            (self.global_batch_size,))
        starts = sorted({idx[0].start or 0 for idx in index_map.values()})
        stops = sorted({idx[0].stop or self.global_batch_size for idx in index_map.values()})
        lo, hi = starts[0], stops[-1]
        if hi - lo != len(set(starts)) * (self.global_batch_size // self.strategy.num_replicas_in_sync):
            raise RuntimeError("this process's devices do not hold a contiguous block of the batch")
        return slice(lo, hi)

    def _host_batches(self, epoch: int, position: int, run: int,
                      stop: threading.Event) -> Iterator[_Host]:
        gb, rows = self.global_batch_size, self._rows()
        if self._arrays is not None:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)
                     if self.shuffle else np.arange(self._num_examples))
            take = _as_indices if self._on_device else functools.partial(_take_rows, self._arrays)
            for k in range(position, len(self)):
                idx = order[k * gb:(k + 1) * gb]
                yield self._pad(idx, rows, take)
            return
        source = self._iterable() if callable(self._iterable) else self._iterable
        if self.auto_shard_policy is not AutoShardPolicy.DATA:
            yield from self._per_process(source, rows, position, self._sync(run, stop))
            return
        emitted = 0  # position counts batches handed out, which skips dropped partial ones
        for k, item in enumerate(source):
            b = rows_of(item, f"batch {k} of the dataset")
            if b > gb:
                raise ValueError(
                    f"batch {k} of the dataset has {b} examples but global_batch_size is {gb}; an "
                    "iterable must yield global batches of at most that size (to distribute an "
                    "in-memory dataset pass a tuple (x, y), not a list)")
            if b < gb and self.drop_remainder:
                continue
            emitted += 1
            if emitted <= position:
                continue
            if b == gb and (rows.start, rows.stop) == (0, gb) and self._put_copies():
                # The whole batch as it came: the transfer's own copy is the only one.
                yield _Host(jax.tree.map(np.asarray, item), np.ones(gb, bool), gb)
            else:
                yield self._pad(np.arange(b), rows, lambda i, item=item: _take_rows(item, i))

    def _put_copies(self) -> bool:
        """Whether placing host rows copies them during the call (GPU, TPU: into the runtime's
        staging memory), so that a batch handed over as it came needs no copy of ours. XLA:CPU
        instead uses an aligned host buffer in place, which must then be ours (``_take_rows``): a
        generator may refill the buffer it yielded."""
        return next(iter(self.strategy.layout.batch.device_set)).platform != "cpu"

    def _per_process(self, source: Any, rows: slice, position: int,
                     sync: StepSync) -> Iterator[_Host]:
        """FILE / OFF: this process's own stream, regrouped into its rows of each global batch."""
        peers, me = pipelines(self.strategy.layout)
        if self.auto_shard_policy is AutoShardPolicy.FILE:
            source = source.shard(me, len(peers))
        local_rows = rows.stop - rows.start
        for item, total in synced(regroup(source, local_rows), sync, local_rows=local_rows,
                                  position=position,
                                  min_real=self.global_batch_size if self.drop_remainder else 0):
            yield _Host(item.local, item.mask, total)

    def _sync(self, run: int, stop: threading.Event) -> StepSync:
        """The exchange of iteration ``run`` (processes number their iterations alike)."""
        return StepSync(f"{self._stream}/{run}", pipelines(self.strategy.layout)[0],
                        self._sync_timeout_s, cancel=stop,
                        previous=f"{self._stream}/{run - 1}" if run else None)

    def _pad(self, idx: np.ndarray, rows: slice, take: Callable) -> _Host:
        gb, real = self.global_batch_size, len(idx)
        full_idx = np.resize(idx, gb) if real < gb else idx  # pads with copies of real rows
        return _Host(take(full_idx[rows]), np.arange(gb) < real, real)

    def _host_groups(self, epoch: int, position: int, run: int, stop: threading.Event,
                     size: int, steps: int | None) -> Iterator[_HostGroup]:
        """``size`` batches at a time, stacked (the last group padded with copies of its last
        batch, which are never used), ``steps`` batches at most; in-memory rows are gathered in
        one copy per group."""
        if self._arrays is None:
            batches: Any = self._host_batches(epoch, position, run, stop)
            if steps is not None:
                batches = _first(batches, steps)
            try:
                while group := list(itertools.islice(batches, size)):
                    yield _stack(group, size)
            finally:
                batches.close()  # a generator's finally blocks (exchanges, files) run now
            return
        gb, rows, total = self.global_batch_size, self._rows(), len(self)
        if steps is not None:
            total = min(total, position + steps)
        order = (np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)
                 if self.shuffle else np.arange(self._num_examples))
        for first in range(position, total, size):
            count = min(size, total - first)
            idx = order[first * gb:(first + count) * gb]
            real = len(idx) - (count - 1) * gb  # rows of the group's last batch
            if real < gb:  # pads with copies of real rows, as _pad does
                idx = np.concatenate([idx[:(count - 1) * gb], np.resize(idx[(count - 1) * gb:], gb)])
            idx = idx.reshape(count, gb)
            if count < size:
                idx = np.concatenate([idx, np.repeat(idx[-1:], size - count, axis=0)])
            local = idx[:, rows]
            if self._on_device:
                stacked = _as_indices(local)
            else:
                stacked = jax.tree.map(lambda a, shape=local.shape: a.reshape(shape + a.shape[1:]),
                                       _take_rows(self._arrays, local.reshape(-1)))
            mask = np.ones((size, gb), bool)
            mask[count - 1, real:] = False
            yield _HostGroup(stacked, mask, (gb,) * (count - 1) + (real,))

    def _to_device(self, host: _Host):
        layout, gb = self.strategy.layout, self.global_batch_size
        # A mask of the whole global batch is replicated (Layout.mask_sharding says why); a
        # process that only knows its own rows' mask (FILE / OFF pipelines) shards it.
        mask_sharding = layout.replicated if len(host.mask) == gb else layout.batch
        on_device = isinstance(host.local, _Indices)
        if host.num_real == gb:  # every row is real: the mask is the same every full batch
            if self._full_mask is None:
                self._full_mask = self._put(mask_sharding, np.ones(len(host.mask), bool))
            data = (self._gather(host.local.idx, False) if on_device
                    else self._put(layout.batch, host.local))
            return Batch(data, self._full_mask), gb
        if on_device:
            data, mask = self._gather(host.local.idx, False), self._put(mask_sharding, host.mask)
        else:
            data, mask = self._put((layout.batch, mask_sharding), (host.local, host.mask))
        return Batch(data, mask), host.num_real

    def _group_to_device(self, host: _HostGroup) -> Group:
        """A stack of batches placed for ``DistributedStep.steps``: ``P(None, data)``, the mask
        replicated when this process knows the whole global batch's (as ``_to_device``)."""
        layout = self.strategy.layout
        on = stacked_sharding(layout.batch)
        mask_on = layout.replicated if host.mask.shape[1] == self.global_batch_size else on
        if isinstance(host.local, _Indices):
            data = self._gather(host.local.idx, False)
            if host.mask.all():  # a group of full batches: the same mask every time
                mask = self._full_masks.get(host.mask.shape)
                if mask is None:
                    mask = self._full_masks[host.mask.shape] = self._put(
                        mask_on, host.mask, stacked=True)
            else:
                mask = self._put(mask_on, host.mask, stacked=True)
            return Group(Batch(data, mask), host.num_real)
        data, mask = self._put((on, mask_on), (host.local, host.mask), stacked=True)
        return Group(Batch(data, mask), host.num_real)

    def _chunk_to_device(self, host: _HostGroup) -> list:
        """Batches placed ahead of use: the stack in one transfer, split on the devices into one
        batch per step in one dispatch; ``[(Batch, num_real), ...]`` for the real batches."""
        layout, gb = self.strategy.layout, self.global_batch_size
        if isinstance(host.local, _Indices):
            parts, treedef = self._gather(host.local.idx, True), None
        else:
            leaves, treedef = jax.tree.flatten(host.local)
            on = stacked_sharding(layout.batch)
            split = _splitter(len(leaves), host.mask.shape[0], on, layout.batch)
            # Called inside a user's own jax.set_mesh (Explicit axes, say): run on the strategy's.
            with layout.mesh_context():
                if _fast_put(layout.batch):
                    parts = split(*leaves)  # numpy in: the compiled call's own transfer
                else:
                    parts = split(*self._put(on, leaves, stacked=True))
        out = []
        for k, num_real in enumerate(host.num_real):
            data = parts[k] if treedef is None else jax.tree.unflatten(treedef, parts[k])
            if num_real == gb:
                if self._full_mask is None:
                    mask_at = layout.replicated if host.mask.shape[1] == gb else layout.batch
                    self._full_mask = self._put(mask_at, np.ones(host.mask.shape[1], bool))
                mask = self._full_mask
            else:
                mask = self._put(layout.replicated if host.mask.shape[1] == gb else layout.batch,
                                 host.mask[k])
            out.append((Batch(data, mask), num_real))
        return out

    def _placed_arrays(self) -> PyTree | None:
        """The in-memory arrays on the devices, a full copy on each (placed on first use, once).

        None when they do not fit and ``on_device`` was left to ``distribute``: checked again at
        first use against the room the devices have left beside what was used so far (the
        state placed by then, say), or found when placing them runs out of memory; the batches are
        then gathered on the host, as one line says. Asked for with ``on_device=True``, or in a
        job of several processes (which must all place alike), running out of memory is an error
        of one line."""
        with self._placing:
            if self._device_arrays is None and self._on_device:
                nbytes = sum(a.nbytes for a in jax.tree.leaves(self._arrays))
                room = self._room()
                auto = self._on_device_asked is None and jax.process_count() == 1
                try:
                    if auto and room is not None and nbytes > room:
                        raise _NoRoom(f"{nbytes / 1e6:.1f} MB beside the "
                                      f"{room / 1e6:.1f} MB left on a device")
                    self._device_arrays = self._place()
                except (_NoRoom, jax.errors.JaxRuntimeError) as e:
                    if not isinstance(e, _NoRoom) and "RESOURCE_EXHAUSTED" not in str(e):
                        raise
                    if not auto:
                        raise MemoryError(
                            f"distribute: the dataset's {nbytes / 1e6:.1f} MB do not fit on each "
                            f"device (each holds a full copy): pass on_device=False to gather its "
                            f"batches on the host and send each one") from None
                    logger.warning("distribute: the dataset's arrays do not fit on the devices "
                                   "(%s); their batches are gathered on the host", e)
                    self._on_device = False
            return self._device_arrays

    def _room(self) -> int | None:
        """Bytes a device can still take beside its peak use so far (None: not reported)."""
        room = None
        for d in self.strategy.layout.replicated.addressable_devices:
            try:
                stats = d.memory_stats() or {}
            except Exception:  # a backend without memory statistics
                return None
            if "bytes_limit" not in stats:
                return None
            left = int(stats["bytes_limit"]) - int(stats.get("peak_bytes_in_use", 0))
            room = left if room is None else min(room, left)
        return room

    def _place(self) -> PyTree:
        replicated = self.strategy.layout.replicated
        if jax.process_count() == 1:
            return jax.device_put(self._arrays, replicated)
        return jax.tree.map(  # every process holds the whole arrays
            lambda a: jax.make_array_from_process_local_data(replicated, a, a.shape), self._arrays)

    def _gather(self, idx: np.ndarray, split: bool) -> Any:
        """This process's rows ``idx`` of a batch ``(rows,)`` or a stack ``(size, rows)``, gathered on
        the devices from the arrays placed there: a batch laid out as ``layout.batch``, a stack as
        ``P(None, data)`` or (``split``) one batch per row of ``idx``. One dispatch; the host sends
        only ``idx``."""
        layout = self.strategy.layout
        arrays = self._placed_arrays()
        stacked = idx.ndim == 2
        if arrays is None:  # they did not fit: these rows from the host (later ones made there)
            rows = jax.tree.map(lambda a: a.reshape(idx.shape + a.shape[1:]),
                                _take_rows(self._arrays, idx.reshape(-1)))
            if not stacked:
                return self._put(layout.batch, rows)
            placed = self._put(stacked_sharding(layout.batch), rows, stacked=True)
            if not split:
                return placed
            with layout.mesh_context():
                return [jax.tree.map(lambda a, k=k: a[k], placed) for k in range(idx.shape[0])]
        idx_on = stacked_sharding(layout.batch) if stacked else layout.batch
        key = (idx.shape, split)
        fn = self._gathers.get(key)
        if fn is None:
            fn = self._gathers[key] = _gatherer(idx.shape[0] if split else 0, layout.replicated,
                                                idx_on, layout.batch if split or not stacked
                                                else idx_on)
        with layout.mesh_context():
            if jax.process_count() > 1 or not _fast_put(idx_on):
                idx = self._put(idx_on, idx, stacked=stacked)
            return fn(arrays, idx)  # one device: numpy in, the compiled call's own transfer

    def _put(self, sharding, tree, *, stacked: bool = False):
        """Host rows of a global batch (or of a stack of them) -> global arrays: one batched
        transfer of the whole tree in a single process (cheaper than an array at a time), the
        process-local assembly otherwise. ``sharding`` is one sharding or a pytree prefix of
        ``tree`` of them."""
        if jax.process_count() == 1:
            shardings = jax.tree.broadcast(sharding, tree)
            if all(_fast_put(s) for s in jax.tree.leaves(shardings)):
                leaves, treedef = jax.tree.flatten(tree)
                with self.strategy.layout.mesh_context():  # the strategy's mesh, not the user's
                    placed = _transfer(tuple(jax.tree.leaves(shardings)))(*leaves)
                return jax.tree.unflatten(treedef, placed)
            return jax.device_put(tree, sharding)
        gb = self.global_batch_size
        lead = 2 if stacked else 1

        def assemble(local, where):
            if where.is_fully_replicated:  # every process holds the whole value
                return jax.make_array_from_process_local_data(where, local, local.shape)
            shape = local.shape[:lead - 1] + (gb,) + local.shape[lead:]
            return jax.make_array_from_process_local_data(where, local, shape)

        return jax.tree.map(assemble, tree, jax.tree.broadcast(sharding, tree))


def _fast_put(sharding: jax.sharding.Sharding) -> bool:
    """Whether host arrays reach ``sharding`` fastest as the arguments of a compiled call. On one
    device that call's own transfer costs the host a few microseconds where ``jax.device_put``
    costs tens per array; split over several devices the call takes a slower path than
    ``device_put``."""
    return len(sharding.device_set) == 1


@functools.lru_cache(maxsize=64)
def _transfer(shardings: tuple) -> Callable:
    """Host arrays -> device arrays laid out as ``shardings``, as one compiled call."""
    return jax.jit(lambda *xs: xs, in_shardings=shardings, out_shardings=shardings)


@functools.lru_cache(maxsize=64)
def _splitter(num_leaves: int, size: int, stacked: Any, each: Any) -> Callable:
    """Stacked leaves ``(size, ...)`` -> ``size`` tuples of per-step leaves, in one dispatch."""
    def split(*leaves):
        return [tuple(leaf[k] for leaf in leaves) for k in range(size)]

    return jax.jit(split, in_shardings=(stacked,) * num_leaves, out_shardings=each)


@functools.lru_cache(maxsize=64)
def _gatherer(split: int, arrays_on: Any, idx_on: Any, out_on: Any) -> Callable:
    """``arrays[idx]`` for every leaf, compiled: the arrays replicated and the indices laid out like
    the batch, so that each device gathers its own rows from its own copy (no collective). With
    ``split``, a stack ``(split, rows)`` of indices gives ``split`` batches (a list). One function
    per layout, shared by every dataset: a new dataset of the same shapes compiles nothing."""
    def take(arrays, idx):
        # The host made idx from the arrays' own row count: every index is in range.
        return jax.tree.map(lambda a: a.at[idx].get(mode="promise_in_bounds"), arrays)

    if not split:
        return jax.jit(take, in_shardings=(arrays_on, idx_on), out_shardings=out_on)

    def take_each(arrays, idx):
        return [take(arrays, idx[k]) for k in range(split)]

    return jax.jit(take_each, in_shardings=(arrays_on, idx_on), out_shardings=out_on)


def _as_indices(idx: np.ndarray) -> _Indices:
    return _Indices(np.asarray(idx, np.int32))


def _stack(group: list, size: int) -> _HostGroup:
    """Host batches of one group stacked, padded to ``size`` with copies of the last one."""
    padded = group + [group[-1]] * (size - len(group))
    local = jax.tree.map(lambda *leaves: np.stack(leaves), *[h.local for h in padded])
    return _HostGroup(local, np.stack([h.mask for h in padded]),
                      tuple(h.num_real for h in group))


# XLA:CPU uses a host buffer aligned to this many bytes in place (jax.device_put aliases it) and
# copies any other, at 2-4x the cost of the copy itself.
_ALIGN = 64


class _NoRoom(Exception):
    """The devices have no room left for the dataset's arrays."""


def _snapshot(x: Any) -> np.ndarray:
    """``x`` as numpy, copied when it is the caller's own writable array."""
    a = np.asarray(x)
    if a is x and a.flags.writeable:
        a = a.copy()
    return a


def _take_rows(tree: PyTree, idx: np.ndarray) -> PyTree:
    """``a[idx]`` of every leaf, each into a fresh aligned buffer, so that placing it on CPU devices
    costs no second copy. Fresh per batch: nothing writes to a buffer once it has been handed over."""
    def take(a):
        a = np.asarray(a)
        if a.dtype.hasobject:
            return a[idx]
        shape = (len(idx),) + a.shape[1:]
        nbytes = int(np.prod(shape)) * a.itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        out = raw[start:start + nbytes].view(a.dtype).reshape(shape)
        return np.take(a, idx, axis=0, out=out, mode="clip")  # "clip": unbuffered; idx is in range

    return jax.tree.map(take, tree)
