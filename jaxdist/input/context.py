"""Input functions: each process builds its own pipeline from an ``InputContext``, as in tf.distribute.

``strategy.distribute_datasets_from_function(fn)`` calls ``fn(ctx)`` once on every process. The
dataset ``fn`` returns is batched with the *per-replica* batch size and holds only this process's
share; each step takes one batch per local replica, pads short ones (``mask`` False) and lays the
rows out as one global ``jaxdist.Batch``, the same value ``strategy.distribute`` yields. Processes
whose pipelines end at different steps agree on the end of the epoch (``jaxdist.input.local``).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxdist.input.dataset import DistributedDataset, _Host
from jaxdist.input.local import new_stream_name, per_replica, pipelines, rows_of, synced

__all__ = ["DatasetFromFunction", "InputContext"]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input function needs to know to read its share (tf: ``tf.distribute.InputContext``).

    Attributes:
      num_input_pipelines: how many processes build a pipeline (the processes the mesh spans).
      input_pipeline_id: this process's pipeline, in ``[0, num_input_pipelines)``.
      num_replicas_in_sync: replicas of the strategy across all processes.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    >>> ctx.get_per_replica_batch_size(64)
    16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self):
        for name in ("num_input_pipelines", "num_replicas_in_sync"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"InputContext({name}={value!r}) must be a positive int")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(f"InputContext(input_pipeline_id={self.input_pipeline_id!r}) must be "
                             f"in [0, {self.num_input_pipelines})")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size each replica gets: ``global_batch_size // num_replicas_in_sync``.

        Raises:
          ValueError: ``global_batch_size`` does not divide by ``num_replicas_in_sync`` (tf's error).
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self.num_replicas_in_sync!r}; use a multiple of "
                f"{self.num_replicas_in_sync}")
        return global_batch_size // self.num_replicas_in_sync


def _is_grain_map_dataset(source: Any) -> bool:
    grain = sys.modules.get("grain")  # only a grain user's source can be one: no import here
    return grain is not None and isinstance(source, getattr(grain, "MapDataset", ()))


class DatasetFromFunction(DistributedDataset):
    """What ``strategy.distribute_datasets_from_function(fn)`` returns.

    ``fn`` is called once per process, as tf does, and what it returns is read afresh for every
    epoch (``iter()`` again): a grain ``MapDataset`` is read as grain defines its epochs (epoch ``e``
    is elements ``e * len .. (e + 1) * len - 1``, which ``MapDataset.shuffle`` reshuffles for every
    epoch, in an order fixed by the seed and the epoch); any other re-iterable (a grain
    ``IterDataset``, a list, a ``tf.data`` dataset) starts over with its own order. A one-shot
    iterator (a generator object) cannot start over: ``fn`` is called again for each later epoch.
    """

    def __init__(self, strategy: Any, fn: Callable, *, global_batch_size: int | None = None,
                 prefetch: int = 2, sync_timeout_s: float = 300.0):
        if not callable(fn):
            raise TypeError(f"distribute_datasets_from_function(fn) needs a callable "
                            f"fn(jaxdist.InputContext) -> dataset, got {type(fn).__name__}")
        layout = strategy.layout
        self._peers, me = pipelines(layout)
        self.input_context = InputContext(len(self._peers), me, strategy.num_replicas_in_sync)
        self._num_local = len(layout.local_devices)
        self._fn = fn
        self._source = self._call_fn()
        self._one_shot = isinstance(self._source, Iterator)  # a generator object, say
        self._first: list = []  # an element read from a one-shot source to learn the batch size
        if global_batch_size is None:
            global_batch_size = self._infer_batch_size() * strategy.num_replicas_in_sync
        self._setup(strategy, global_batch_size, prefetch, sync_timeout_s)
        self._per_replica = self.global_batch_size // strategy.num_replicas_in_sync
        self._stream = new_stream_name()

    def _call_fn(self) -> Any:  # an Iterable (checked), maybe an Iterator or grain MapDataset
        source = self._fn(self.input_context)
        if not isinstance(source, Iterable):
            raise TypeError(
                f"the input function returned a {type(source).__name__}; it must return a dataset "
                "batched with the per-replica batch size (a grain dataset, a list or generator of "
                "batches, anything iterable)")
        return source

    def _infer_batch_size(self) -> int:
        if self._one_shot:
            first = next(self._source, None)
            self._first = [] if first is None else [first]
        else:  # a re-iterable: a fresh iterator reads the first batch and is dropped
            first = next(iter(self._source), None)
        if first is None:
            raise ValueError("this process's input pipeline is empty, so the per-replica batch "
                             "size cannot be read from its first batch; pass global_batch_size=")
        return rows_of(first, "the first per-replica batch of this process's pipeline")

    def __len__(self) -> int:
        raise TypeError("the number of batches of a dataset from an input function is not known")

    @property
    def num_examples(self) -> None:
        return None

    def _epoch_items(self, epoch: int) -> Iterator:
        source = self._source
        if _is_grain_map_dataset(source):
            n = len(source)
            items = (source[i] for i in range(epoch * n, (epoch + 1) * n))
            return (x for x in items if x is not None)  # grain's filter leaves None
        if self._one_shot:
            if self._source is not None:  # the first epoch read gets the iterator fn returned
                self._source, first, self._first = None, self._first, []
                return itertools.chain(first, source)
            source = self._call_fn()
        return iter(source)

    def _host_batches(self, epoch: int, position: int, run: int,
                      stop: threading.Event) -> Iterator[_Host]:
        items = self._epoch_items(epoch)
        size, num_local = self._per_replica, self._num_local
        sync = self._sync(run, stop)
        for item, total in synced(per_replica(items, num_local, size), sync,
                                  local_rows=size * num_local, position=position, width=size):
            yield _Host(item.local, item.mask, total)
