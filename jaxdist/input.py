"""Distributed input: global batches padded with a mask, sharded per process, prefetched to device.

Invariant: every example of an epoch is seen exactly once. A final partial batch is padded up to
the global batch size (so the step's shape, and therefore its compilation, never changes) with
copies of real rows, and ``mask`` marks which rows are real. Copies rather than zeros, so that a
padded row never produces NaN in a loss that a mask multiplies away (``NaN * 0`` is still NaN).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from jaxdist._datacheck import check_fits_jax_dtype, warn_non_finite
from jaxdist._types import PyTree

if TYPE_CHECKING:
    from jaxdist.strategy.base import MeshStrategy

logger = logging.getLogger(__name__)


class Batch(NamedTuple):
    """One global batch: ``data`` (the pytree the dataset yields) and ``mask`` (bool ``[batch]``).

    Both are ``jax.Array``\\ s sharded over the replicas along their first axis. ``mask[i]`` is False
    for padding rows added to complete a final partial batch; pass it to
    ``jaxdist.compute_average_loss`` and use it in metrics.
    """

    data: PyTree
    mask: Any


def _path_str(path) -> str:
    return "data" + "".join(str(k) for k in path)


def check_batch_leaves(tree: PyTree, num_replicas: int, *, what: str) -> int:
    """Checks that every leaf is an array with the same leading dimension; returns it.

    Raises:
      ValueError: naming the offending leaf and its shape/type, or a value that does not fit the
        dtype JAX will store it in (uint64 2**63 without x64, say).
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not flat:
        raise ValueError(f"{what} has no array leaves; expected e.g. (x, y) or {{'x': x, 'y': y}}")
    sizes = {}
    for path, leaf in flat:
        if not isinstance(leaf, (np.ndarray, jax.Array)) or np.ndim(leaf) == 0:
            kind = type(leaf).__name__ if not hasattr(leaf, "shape") else f"a scalar of shape {leaf.shape}"
            raise ValueError(
                f"{what} leaf {_path_str(path)} is {kind}; every leaf must be a numpy or jax array "
                "whose first axis indexes examples (convert lists with np.asarray)")
        sizes[_path_str(path)] = np.shape(leaf)[0]
    check_fits_jax_dtype(tree, what=what)
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{what} leaves have different leading (example) dimensions: {sizes}; "
                         "every leaf must have one row per example")
    n = next(iter(sizes.values()))
    if what == "batch" and n % num_replicas:
        raise ValueError(
            f"batch has {n} examples, which does not divide over {num_replicas} replicas; use "
            f"strategy.distribute(data, global_batch_size) (it pads the last batch with a mask) or a "
            f"batch size that is a multiple of {num_replicas}")
    return n


class _Host(NamedTuple):
    """A global batch on the host: this process's rows of it and of the mask, and the number of
    real rows in the whole global batch."""

    local: PyTree
    mask: np.ndarray
    num_real: int


class DistributedDataset:
    """What ``strategy.distribute`` returns: iterate it for one epoch of ``jaxdist.Batch`` values.

    Each ``iter()`` starts the next epoch (epochs reshuffle deterministically from the seed);
    ``iterator(epoch=, position=)`` starts anywhere, which is how a checkpointed run resumes exactly.
    """

    def __init__(self, strategy: "MeshStrategy", data: Any, global_batch_size: int, *,
                 shuffle: bool = False, seed: int = 0, drop_remainder: bool = False,
                 prefetch: int = 2):
        n = strategy.num_replicas_in_sync
        if not isinstance(global_batch_size, (int, np.integer)) or global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
        if global_batch_size % n:
            lo = global_batch_size // n * n
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide over the {n} replicas of "
                f"{type(strategy).__name__}; use a multiple of {n} such as {lo or n} or {lo + n}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.strategy = strategy
        self.global_batch_size = int(global_batch_size)
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self._prefetch = prefetch
        self._epoch = 0
        if isinstance(data, (tuple, dict, np.ndarray, jax.Array)):
            self._num_examples = check_batch_leaves(data, n, what="dataset")
            warn_non_finite(data, what="dataset")
            self._arrays = jax.tree.map(np.asarray, data)
            self._iterable = None
        elif isinstance(data, Iterable) or callable(data):
            if shuffle:
                raise ValueError("shuffle=True needs an in-memory dataset ((x, y) tuple or dict of "
                                 "arrays); shuffle an iterable of batches at its source")
            self._arrays, self._num_examples, self._iterable = None, None, data
        else:
            raise ValueError(
                f"cannot distribute a {type(data).__name__}; pass (x, y) / a dict of numpy arrays, "
                "or an iterable of such batches")

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
        it = self.iterator(epoch=self._epoch)
        self._epoch += 1
        return it

    def iterator(self, *, epoch: int = 0, position: int = 0) -> "DistributedIterator":
        """An iterator over ``epoch`` starting after ``position`` batches."""
        return DistributedIterator(self, epoch, position)

    # --- producing host batches -------------------------------------------------------------------
    def _rows(self) -> slice:
        """The rows of a global batch whose devices belong to this process."""
        if jax.process_count() == 1:
            return slice(0, self.global_batch_size)
        index_map = self.strategy._batch_sharding.addressable_devices_indices_map(
            (self.global_batch_size,))
        starts = sorted({idx[0].start or 0 for idx in index_map.values()})
        stops = sorted({idx[0].stop or self.global_batch_size for idx in index_map.values()})
        lo, hi = starts[0], stops[-1]
        if hi - lo != len(set(starts)) * (self.global_batch_size // self.strategy.num_replicas_in_sync):
            raise RuntimeError("this process's devices do not hold a contiguous block of the batch")
        return slice(lo, hi)

    def _host_batches(self, epoch: int, position: int) -> Iterator[_Host]:
        gb, rows = self.global_batch_size, self._rows()
        if self._arrays is not None:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)
                     if self.shuffle else np.arange(self._num_examples))
            for k in range(position, len(self)):
                idx = order[k * gb:(k + 1) * gb]
                yield self._pad(idx, rows, lambda i: jax.tree.map(lambda a: a[i], self._arrays))
            return
        source = self._iterable() if callable(self._iterable) else self._iterable
        emitted = 0  # position counts batches handed out, which skips dropped partial ones
        for k, item in enumerate(source):
            b = check_batch_leaves(item, 1, what=f"batch {k} of the dataset")
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
            yield self._pad(np.arange(b), rows,
                            lambda i, item=item: jax.tree.map(lambda a: np.asarray(a)[i], item))

    def _pad(self, idx: np.ndarray, rows: slice, take: Callable) -> _Host:
        gb, real = self.global_batch_size, len(idx)
        full_idx = np.resize(idx, gb) if real < gb else idx  # pads with copies of real rows
        mask = np.arange(gb) < real
        return _Host(take(full_idx[rows]), mask[rows], real)

    def _to_device(self, host: _Host):
        sharding, gb = self.strategy._batch_sharding, self.global_batch_size

        def put(local):
            return jax.make_array_from_process_local_data(sharding, local, (gb,) + local.shape[1:])

        return Batch(jax.tree.map(put, host.local), put(host.mask)), host.num_real


_DONE = object()


class _Producer:
    """The prefetch thread's side. It holds no reference to the iterator, so an iterator that is
    dropped is garbage-collected, and its ``__del__`` stops the thread."""

    def __init__(self, batches: Iterator, to_device: Callable, capacity: int):
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.stop = threading.Event()
        self._batches, self._to_device = batches, to_device
        self.thread = threading.Thread(target=self._run, name="jaxdist-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for host in self._batches:
                if not self._put(self._to_device(host)):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(e)
        finally:
            self._batches = self._to_device = None

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop.set()
        while True:  # drop prepared batches so their device buffers are freed
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)


class DistributedIterator:
    """An epoch of ``Batch`` values, prepared ``prefetch`` batches ahead on a background thread.

    ``state()`` is ``{"epoch": e, "position": k}`` (batches handed out so far), enough to resume
    at exactly the next batch via ``dataset.iterator(**state)``. ``last_num_real`` is the number of
    real (unpadded) examples in the batch most recently returned. ``close()`` (or leaving a
    ``with`` block, or dropping the iterator) stops the background thread.
    """

    def __init__(self, dataset: DistributedDataset, epoch: int, position: int):
        self.epoch, self.position = epoch, position
        self.last_num_real = 0
        self._producer = _Producer(dataset._host_batches(epoch, position), dataset._to_device,
                                   dataset._prefetch)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        producer = self._producer
        while True:
            if producer.stop.is_set():
                raise StopIteration
            try:
                item = producer.queue.get(timeout=0.5)
                break
            except queue.Empty:
                if not producer.thread.is_alive() and producer.queue.empty():
                    producer.stop.set()
                    raise StopIteration from None
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self.last_num_real = item
        self.position += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def close(self) -> None:
        self._producer.shutdown()

    def __enter__(self) -> "DistributedIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.stop.set()
