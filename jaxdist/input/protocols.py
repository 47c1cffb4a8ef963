"""The input interfaces ``fit``, ``evaluate`` and ``predict`` rely on, written down.

``DistributedDataset`` (``strategy.distribute``) implements both; the parameter-server
``PSDataset`` implements ``EpochSource`` (``fit`` with ``ParameterServerStrategy``). A data type
of your own that has these members works in ``fit`` as they do.

>>> import jax, numpy as np, jaxdist
>>> ds = jaxdist.MirroredStrategy(jax.devices()[:1]).distribute(np.arange(8.0), 4)
>>> isinstance(ds, GroupedEpochSource), isinstance(ds.iterator(), EpochIterator)
(True, True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, Union, runtime_checkable

import jax
import numpy as np

InMemoryData = Union[tuple, dict, np.ndarray, jax.Array]
"""In-memory arrays ``fit`` distributes itself (with ``batch_size=``): ``(x, y)``, a dict of arrays,
one array."""


@runtime_checkable
class EpochIterator(Protocol):
    """One epoch of batches, as ``fit`` reads it.

    ``position`` is the number of batches handed out so far (what ``BackupAndRestore`` saves, so
    that ``source.iterator(epoch=e, position=k)`` resumes at the next batch); ``last_num_real``
    the real (unpadded) examples of the batch last returned (a tuple per batch for a group),
    which the metrics are weighted by. Leaving a ``with`` block stops its producer.
    """

    position: int
    last_num_real: Any

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


@runtime_checkable
class EpochSource(Protocol):
    """Data ``fit`` trains on: global batches of ``global_batch_size`` rows, by epoch."""

    global_batch_size: int

    def iterator(self, *, epoch: int = 0, position: int = 0) -> EpochIterator:
        """The batches of ``epoch`` after the first ``position``."""
        ...


@runtime_checkable
class GroupedEpochSource(EpochSource, Protocol):
    """An ``EpochSource`` that also hands out groups of ``K`` batches stacked (what one compiled
    call of ``K`` steps takes: ``steps_per_execution=K``) and at most ``steps`` of them, and
    counts its own epochs (``next_epoch``: what ``iter()`` gives, with those options).
    ``evaluate`` and ``predict`` read ``shuffle`` to refuse a shuffled dataset where the order
    matters."""

    shuffle: bool

    def iterator(self, *, epoch: int = 0, position: int = 0, group_size: int | None = None,
                 steps: int | None = None) -> EpochIterator: ...

    def next_epoch(self, *, group_size: int | None = None, steps: int | None = None) -> EpochIterator:
        """The next epoch's iterator (what ``iter(source)`` returns), with ``iterator``'s options."""
        ...
