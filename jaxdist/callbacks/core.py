"""The callback protocol: what ``fit`` tells callbacks (``TrainInfo``) and what they may answer.

The library never owns a mutable model. A callback that resumes a run *returns* a :class:`Resume`
from ``on_train_begin`` (``fit`` carries on from it); one that changes the state later (a restore,
a new learning rate) assigns ``info.state``; one that stops training sets ``info.stop_training``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdist.core import PyTree


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a resumed ``fit`` starts: returned by a callback's ``on_train_begin``.

    Attributes:
      state: the restored train state (placed the strategy's way).
      step: optimizer steps already taken.
      epoch: the epoch to continue (0-based).
      position: batches of ``epoch`` already consumed.
      source: where it came from, for logs (a checkpoint step, say).

    >>> Resume(state={"w": 0.0}, step=12, epoch=1, position=0).step
    12
    """

    state: PyTree
    step: int
    epoch: int = 0
    position: int = 0
    source: Any = None


@dataclasses.dataclass
class TrainInfo:
    """What a callback sees.

    Attributes:
      epoch: the current epoch (0-based).
      step: optimizer steps completed since the start of training (all epochs).
      state: the current train state (device arrays; reading it forces a sync, so don't every step).
      logs: the epoch's metrics as far as they have been read back from the devices, without
        waiting for them (they lag the newest step by up to ``max_in_flight`` calls); a callback
        that needs the newest values calls :meth:`latest_logs`.
      epoch_steps: steps in this epoch so far.
      steps_per_epoch: planned steps per epoch, or None when unknown.
      stop_training: set True to end training after this step / epoch.
      position: batches of ``epoch`` already consumed when training (re)starts (``fit`` sets it
        from the ``Resume`` a callback returns).
      iterator: the epoch's ``DistributedIterator`` (its ``state()`` is the input position).
      strategy: the strategy the step runs under.
      steps_per_execution: steps ``fit`` runs per compiled call (Keras's name).
      call_steps: steps the latest call ran. ``on_train_batch_end`` runs once per call (as in
        Keras), so it sees steps ``step - call_steps + 1 .. step`` done: with
        ``steps_per_execution=K``, ``K`` of them (fewer for an epoch's last call).
    """

    epoch: int = 0
    step: int = 0
    state: PyTree = None
    logs: dict[str, float] = dataclasses.field(default_factory=dict)
    epoch_steps: int = 0
    steps_per_epoch: int | None = None
    epochs: int = 1
    global_batch_size: int | None = None
    stop_training: bool = False
    position: int = 0
    iterator: Any = None
    strategy: Any = None
    steps_per_execution: int = 1
    call_steps: int = 1
    _read_all: Any = dataclasses.field(default=None, repr=False, compare=False)

    def latest_logs(self) -> dict[str, float]:
        """The epoch's metrics over every step dispatched so far (also set as ``logs``).

        Unlike ``logs`` this waits for the devices to finish those steps, so the loop stops
        running ahead while a callback reads; call it when a decision needs the newest values, not
        every step. Outside ``fit``'s epochs it returns ``logs``.
        """
        if self._read_all is not None:
            self.logs = dict(self._read_all())
        return self.logs


class Callback:
    """Base class: override the hooks you need (all are no-ops here).

    ``on_train_begin`` may return a :class:`Resume` to continue an earlier run (at most one
    callback may); ``fit`` then starts from its state, step and input position.
    """

    def on_train_begin(self, info: TrainInfo) -> "Resume | None": ...

    def on_epoch_begin(self, info: TrainInfo) -> None: ...

    def on_train_batch_end(self, info: TrainInfo) -> None: ...

    def on_epoch_end(self, info: TrainInfo) -> None: ...

    def on_train_end(self, info: TrainInfo) -> None: ...

    def close(self) -> None:
        """Releases resources; ``fit`` calls it last, also when training raised."""


