"""``jaxdist.fit`` with ``ParameterServerStrategy``: steps scheduled through the coordinator.

tf.keras's ``model.fit`` under ``tf.distribute.ParameterServerStrategy`` creates a
``ClusterCoordinator``, schedules the train function once per step (``steps_per_execution``
steps per closure) on whichever worker is free, lets batch-level callbacks see ``RemoteValue``
logs that resolve when read, and joins the coordinator at the end of every epoch. This module does
the same for :func:`jaxdist.fit`:

* ``strategy.step(loss_fn, optimizer=...)`` returns a :class:`PSStep`; its first call starts the
  servers and workers from the state ``fit`` passes in (the parameter tree) and each call
  schedules one worker step (pull, gradient, push), returning ``{"loss": RemoteValue}`` at once;
* ``fit`` reads metrics a few steps late (``max_in_flight``), so at most that many closures are in
  flight, as Keras's ``steps_per_execution`` bounds them;
* at each epoch end the step's own callback joins the coordinator and sets ``info.state`` to the
  parameters fetched from the servers, so ``History.state`` is the trained tree;
* ``strategy.distribute(data, batch_size)`` gives the batches: each is one worker step's batch
  (TF's per-worker batch); an epoch is ``len(data) // batch_size`` full batches (the remainder
  is left out, reshuffled each epoch; asynchronous pushes carry no mask).

Differences from Keras, stated: validation inside ``fit`` is not supported (evaluate
``history.state`` afterwards); the coordinator iterates the data and ships each batch with its
closure (TF's workers read a per-worker dataset), which is free in process and costs a msgpack
copy per batch across processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist.callbacks import Callback, TrainInfo
from jaxdist.ps.worker import remote

__all__ = ["PSStep", "PSDataset"]


@remote
def fit_step(worker, batch):
    """One scheduled step of ``jaxdist.fit``: pull, gradient, push on ``worker``."""
    return worker.step(tuple(batch) if isinstance(batch, list) else batch)


class _Lifecycle(Callback):
    """Joins the coordinator at epoch end (as Keras does) and hands the trained tree to fit."""

    def __init__(self, step: PSStep):
        self._step = step

    def on_epoch_end(self, info: TrainInfo) -> None:
        coord = self._step.coordinator
        if coord is not None:
            coord.join()
            info.state = coord.fetch_params()

    def close(self) -> None:
        self._step.close()


class PSStep:
    """What ``ParameterServerStrategy.step(loss_fn, optimizer=...)`` returns (see module doc).

    Attributes:
      strategy: the strategy (``jaxdist.fit`` finds it here).
      coordinator: the running :class:`~jaxdist.ps.ClusterCoordinator` (after the first call).
      callbacks: run by ``jaxdist.fit`` before the user's callbacks.
    """

    def __init__(self, strategy: Any, loss_fn: Callable, optimizer: Any):
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.coordinator: Any = None  # the strategy's ClusterCoordinator, from the first call
        self.callbacks = (_Lifecycle(self),)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        if self.coordinator is None:
            self.coordinator = self.strategy.start(state, self.optimizer, self.loss_fn)
        return state, {"loss": self.coordinator.schedule(fit_step, args=(batch,))}

    def close(self) -> None:
        """Shuts the job down (``fit`` does this when training ends, also on error)."""
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self.coordinator = None


class _Iterator:
    """One epoch of a ``PSDataset``: full batches in ``order`` from batch ``position`` on (a
    ``jaxdist.input.EpochIterator``)."""

    def __init__(self, data: tuple, order: np.ndarray, batch: int, position: int):
        self._data, self._order, self._batch = data, order, batch
        self.position = position
        self.last_num_real = batch

    def __iter__(self) -> "_Iterator":
        return self

    def __next__(self) -> tuple:
        if (self.position + 1) * self._batch > len(self._order):
            raise StopIteration
        idx = self._order[self.position * self._batch:(self.position + 1) * self._batch]
        self.position += 1
        return tuple(np.asarray(a)[idx] for a in self._data)

    def __enter__(self) -> "_Iterator":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def state(self) -> dict[str, int]:
        return {"position": self.position}


class PSDataset:
    """Full batches of ``data`` for :func:`jaxdist.fit` under ``ParameterServerStrategy``.

    Args:
      data: a tuple of arrays with the same first dimension (e.g. ``(x, y)``).
      global_batch_size: examples per step (one worker's batch).
      shuffle, seed: reshuffle every epoch with ``seed + epoch``.

    Raises:
      ValueError: arrays of different lengths, or fewer examples than one batch.

    >>> ds = PSDataset((np.arange(10), np.arange(10)), 4, shuffle=False)
    >>> with ds.iterator(epoch=0) as it:
    ...     [b[0].tolist() for b in it]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    def __init__(self, data: Any, global_batch_size: int, *, shuffle: bool = True,
                 seed: int = 0):
        self.data = tuple(data) if isinstance(data, (tuple, list)) else (data,)
        lengths = {len(a) for a in jax.tree.leaves(self.data)}
        if len(lengths) != 1:
            raise ValueError(f"arrays of different lengths {sorted(lengths)}; expected one first "
                             "dimension")
        self.num_examples = lengths.pop()
        if not isinstance(global_batch_size, int) or not 1 <= global_batch_size <= self.num_examples:
            raise ValueError(f"batch size {global_batch_size!r} must be an integer in "
                             f"[1, {self.num_examples}] (the number of examples)")
        self.global_batch_size = global_batch_size
        self.shuffle, self.seed = shuffle, seed

    def __len__(self) -> int:
        return self.num_examples // self.global_batch_size

    def iterator(self, *, epoch: int = 0, position: int = 0) -> _Iterator:
        """The batches of ``epoch`` after the first ``position`` (a ``jaxdist.input.EpochSource``)."""
        order = (np.random.default_rng(self.seed + epoch).permutation(self.num_examples)
                 if self.shuffle else np.arange(self.num_examples))
        return _Iterator(self.data, order, self.global_batch_size, position)
