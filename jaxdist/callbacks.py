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
      position: batches of ``epoch`` already consumed when training (re)starts; a callback that
        restores a backup in ``on_train_begin`` sets it (with ``epoch`` and ``step``).
      iterator: the epoch's ``DistributedIterator`` (its ``state()`` is the input position).
      strategy: the strategy the step runs under.
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


class Callback:
    """Base class: override the hooks you need (all are no-ops here)."""

    def on_train_begin(self, info: TrainInfo) -> None: ...

    def on_epoch_begin(self, info: TrainInfo) -> None: ...

    def on_train_batch_end(self, info: TrainInfo) -> None: ...

    def on_epoch_end(self, info: TrainInfo) -> None: ...

    def on_train_end(self, info: TrainInfo) -> None: ...

    def close(self) -> None:
        """Releases resources; ``fit`` calls it last, also when training raised."""


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
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class TrainingPreempted(SystemExit):
    """Raised (after a checkpoint is durable) when training stops for a preemption notice (SIGTERM).

    It is a ``SystemExit``: uncaught, the process exits with ``code`` (0 by default, a clean exit);
    rerunning the same command resumes from the checkpoint.
    """


class _PreemptionNotice:
    """Whether every process has agreed to stop at this step.

    Across processes, JAX's preemption sync manager (started by ``jax.distributed.initialize``)
    catches SIGTERM and picks a step that every process reaches; on one process a SIGTERM handler
    sets a flag that the next step boundary reads.
    """

    def __init__(self):
        self._flag = False
        self._previous = None

    def install(self) -> None:
        import signal
        import threading

        if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning("SIGTERM received: saving a checkpoint at the next step boundary")
        self._flag = True

    def uninstall(self) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._flag


class ModelCheckpoint(Callback):
    """Saves the state (and the input position) every ``every_n_steps`` and at each epoch end.

    Args:
      directory: checkpoint directory (shared by all processes).
      every_n_steps: save period in optimizer steps (None: only at epoch ends).
      save_at_epoch_end: also save when an epoch finishes.
      max_to_keep, async_save: passed to ``jaxdist.checkpoint.CheckpointManager``.
    """

    def __init__(self, directory: str, *, every_n_steps: int | None = None,
                 save_at_epoch_end: bool = True, max_to_keep: int | None = 3,
                 async_save: bool = True):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        from jaxdist.checkpoint import CheckpointManager

        self.manager = CheckpointManager(directory, max_to_keep=max_to_keep, async_save=async_save)
        self._every = every_n_steps
        self._at_epoch_end = save_at_epoch_end
        self._last_saved: int | None = self.manager.latest_step()

    def _save(self, info: TrainInfo, *, epoch_done: bool = False) -> None:
        if info.step == self._last_saved:
            return
        # After an epoch ends, the next batch to train on is the first of the next epoch.
        data = ({"epoch": info.epoch + 1, "position": 0} if epoch_done
                else info.iterator.state() if info.iterator is not None else None)
        self.manager.save(info.step, info.state, data_state=data, metadata={"logs": info.logs})
        self._last_saved = info.step

    def on_train_batch_end(self, info: TrainInfo) -> None:
        if self._every and info.step % self._every == 0:
            self._save(info)

    def on_epoch_end(self, info: TrainInfo) -> None:
        if self._at_epoch_end:
            self._save(info, epoch_done=True)

    def on_train_end(self, info: TrainInfo) -> None:
        self.manager.wait_until_finished()


class BackupAndRestore(ModelCheckpoint):
    """Resumes an interrupted ``fit`` exactly where its last backup left it; saves on SIGTERM.

    At the start of training, if ``directory`` holds a backup, the state, the step counter and the
    input position (epoch and batch) are restored, so the resumed run sees exactly the batches the
    uninterrupted one would have, and ends with the same parameters. On a preemption notice
    (SIGTERM; agreed across processes) a backup is written at the next step boundary, made durable,
    and ``TrainingPreempted`` ends the process cleanly.

    Args:
      directory: backup directory (shared by all processes).
      every_n_steps: backup period in steps (None: epoch ends only).
      delete_on_success: remove the backups when training completes (as Keras does).
      preemption_exit_code: exit status after a preemption save.
    """

    def __init__(self, directory: str, *, every_n_steps: int | None = None,
                 delete_on_success: bool = False, preemption_exit_code: int = 0):
        super().__init__(directory, every_n_steps=every_n_steps, max_to_keep=2)
        self._delete = delete_on_success
        self._exit_code = preemption_exit_code
        self._notice = _PreemptionNotice()
        self.restored_step: int | None = None

    def on_train_begin(self, info: TrainInfo) -> None:
        self._notice.install()
        step = self.manager.latest_step()
        if step is None:
            return
        meta = self.manager.metadata(step)
        info.state = self.manager.restore(step, target=info.state, strategy=info.strategy)
        info.step = meta["step"]
        if meta.get("data"):
            info.epoch, info.position = meta["data"]["epoch"], meta["data"]["position"]
        self.restored_step = step
        logger.info("restored backup step %d (epoch %d, batch %d)", step, info.epoch, info.position)

    def on_train_batch_end(self, info: TrainInfo) -> None:
        super().on_train_batch_end(info)
        if self._notice.reached(info.step):
            self._save(info)
            self.manager.wait_until_finished()
            self._notice.uninstall()
            raise TrainingPreempted(self._exit_code)

    def on_train_end(self, info: TrainInfo) -> None:
        super().on_train_end(info)
        if self._delete and jax.process_index() == 0:
            import shutil

            shutil.rmtree(self.manager.directory, ignore_errors=True)

    def close(self) -> None:
        self._notice.uninstall()
