"""Iterating a distributed dataset: batches made on the loop's thread or ahead on a bounded thread.

``DistributedDataset.iterator`` returns a ``DistributedIterator``. The dataset makes host batches
(or stacks of them) and places them; this module hands them out, with the input position that a
checkpoint records, and stops the thread when the iterator is closed or dropped.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxdist.core.values import Batch

__all__ = ["DistributedIterator"]


_DONE = object()


def _one(to_device: Callable, host: Any) -> list:
    return [to_device(host)]


def _first(items: Iterator, n: int) -> Iterator:
    """The first ``n`` of ``items``; closing it closes ``items`` (a generator's cleanup runs)."""
    try:
        for k, item in enumerate(items):
            yield item
            if k + 1 == n:
                return
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


class _Producer:
    """The prefetch thread's side. It holds no reference to the iterator, so an iterator that is
    dropped is garbage-collected, and its ``__del__`` stops the thread."""

    def __init__(self, batches: Iterator, to_device: Callable, capacity: int,
                 stop: threading.Event):
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.stop = stop
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


class _Inline:
    """``prefetch=0``: each batch is made on the caller's thread when ``next()`` asks for it."""

    def __init__(self, batches: Iterator, to_device: Callable, stop: threading.Event):
        self._batches, self._to_device, self.stop = batches, to_device, stop

    def make(self):  # never called once shut down: next() checks ``stop`` first
        try:
            return self._to_device(next(self._batches))
        except StopIteration:
            self.shutdown()
            return _DONE
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop.set()
        batches, self._batches, self._to_device = self._batches, None, None
        if batches is not None and hasattr(batches, "close"):
            batches.close()  # a generator's finally blocks (exchanges, files) run now


class DistributedIterator:
    """An epoch of ``Batch`` values, prepared ``prefetch`` items ahead on a background thread
    (with ``prefetch=0``, made on the caller's thread when asked for).

    ``state()`` is ``{"epoch": e, "position": k}`` (batches handed out so far), enough to resume
    at exactly the next batch via ``dataset.iterator(**state)``. ``last_num_real`` is the number of
    real (unpadded) examples in the batch most recently returned; ``stall_s`` the seconds ``next()``
    has waited for a batch that was not ready yet (the input pipeline's stall). ``close()`` (or
    leaving a ``with`` block, or dropping the iterator) stops the background thread.

    Batches of in-memory arrays are made and placed on the devices up to ``AHEAD_BATCHES`` at a
    time (at most ``AHEAD_BYTES``), so up to that many wait on the devices ahead of use. Made
    with ``group_size=K``, it yields ``Group`` values (``K`` batches stacked) and
    ``last_num_real`` is the tuple of the group's real examples per batch.
    """

    def __init__(self, dataset: Any, epoch: int, position: int,
                 group_size: int | None = None, steps: int | None = None):
        self.epoch, self.position = epoch, position
        self.last_num_real: Any = 0
        self.stall_s = 0.0  # time next() spent waiting for (or making) a batch: the input's stall
        self._grouped = group_size is not None
        self._ready: collections.deque = collections.deque()  # placed ahead, not handed out yet
        # The run number is taken here, on the caller's thread, so that processes creating
        # iterators in the same order name the same exchange.
        stop = threading.Event()
        items, make, prefetch = dataset.epoch_stream(epoch, position, stop,
                                                     group_size=group_size, steps=steps)
        self._producer = (_Producer(items, make, prefetch, stop)
                          if prefetch else _Inline(items, make, stop))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._ready:
            batch, self.last_num_real = self._ready.popleft()
            self.position += 1
            return batch
        producer = self._producer
        if producer.stop.is_set():
            raise StopIteration
        if isinstance(producer, _Inline):  # made here and now: all of its time is the loop's wait
            waited_from = time.perf_counter()
            item = producer.make()
            self.stall_s += time.perf_counter() - waited_from
        else:
            item = self._next_prefetched(producer)
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        if self._grouped:
            self.last_num_real = item.num_real
            self.position += len(item.num_real)
            return item
        self._ready.extend(item[1:])
        batch, self.last_num_real = item[0]
        self.position += 1
        return batch

    def _next_prefetched(self, producer: _Producer):
        try:
            return producer.queue.get_nowait()
        except queue.Empty:
            waited_from = time.perf_counter()
            item = self._wait(producer)
            self.stall_s += time.perf_counter() - waited_from
            return item

    @staticmethod
    def _wait(producer: _Producer):
        while True:
            if producer.stop.is_set():
                raise StopIteration
            try:
                return producer.queue.get(timeout=0.5)
            except queue.Empty:
                if not producer.thread.is_alive() and producer.queue.empty():
                    producer.stop.set()
                    raise StopIteration from None

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def close(self) -> None:
        self._ready.clear()  # batches placed ahead: their device buffers are freed
        self._producer.shutdown()

    def __enter__(self) -> "DistributedIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.stop.set()
