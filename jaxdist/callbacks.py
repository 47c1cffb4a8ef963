"""Callbacks for ``jaxdist.fit``: hooks that see a ``TrainInfo`` and may stop or redirect training.

The library never owns a mutable model: a callback that changes the state (a restore, say) assigns
``info.state``, and ``fit`` carries on from that value.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

from jaxdist._types import PyTree

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainInfo:
    """What a callback sees.

    Attributes:
      epoch: the current epoch (0-based).
      step: optimizer steps completed since the start of training (all epochs).
      state: the current train state (device arrays; reading it forces a sync, so don't every step).
      logs: the latest metrics read back from the device (they lag the newest step by a few steps).
      epoch_steps: steps in this epoch so far.
      steps_per_epoch: planned steps per epoch, or None when unknown.
      stop_training: set True to end training after this step / epoch.
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


class Callback:
    """Base class: override the hooks you need (all are no-ops here)."""

    def on_train_begin(self, info: TrainInfo) -> None: ...

    def on_epoch_begin(self, info: TrainInfo) -> None: ...

    def on_train_batch_end(self, info: TrainInfo) -> None: ...

    def on_epoch_end(self, info: TrainInfo) -> None: ...

    def on_train_end(self, info: TrainInfo) -> None: ...


class ProgressBar(Callback):
    """A tqdm bar per epoch showing the running metrics and examples per second (process 0 only)."""

    def __init__(self, *, leave: bool = True):
        self._leave = leave
        self._bar: Any = None
        self._t0 = 0.0

    def on_epoch_begin(self, info: TrainInfo) -> None:
        if jax.process_index() != 0:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=info.steps_per_epoch, desc=f"epoch {info.epoch + 1}/{info.epochs}",
                         unit="step", leave=self._leave, dynamic_ncols=True)
        self._t0 = time.perf_counter()

    def _postfix(self, info: TrainInfo) -> dict:
        out = {k: f"{v:.4f}" for k, v in info.logs.items()}
        elapsed = time.perf_counter() - self._t0
        if info.global_batch_size and elapsed > 0:
            out["ex/s"] = f"{info.epoch_steps * info.global_batch_size / elapsed:,.0f}"
        return out

    def on_train_batch_end(self, info: TrainInfo) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if info.epoch_steps % 8 == 0:
                self._bar.set_postfix(self._postfix(info), refresh=False)

    def on_epoch_end(self, info: TrainInfo) -> None:
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(info))
            self._bar.close()
            self._bar = None
