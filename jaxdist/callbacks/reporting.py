"""Callbacks that report: a progress bar, TensorBoard event files (process 0 only)."""

from __future__ import annotations

import time
from typing import Any

import jax

from jaxdist.callbacks.core import Callback, TrainInfo


class ProgressBar(Callback):
    """A tqdm bar per epoch showing the running metrics and examples per second (process 0 only).

    A resumed epoch's bar starts at the batch training resumes from (``TrainInfo.position``).
    """

    def __init__(self, *, leave: bool = True):
        self._leave = leave
        self._bar: Any = None
        self._t0 = 0.0
        self._start = 0  # the epoch's batches done before this run (a resumed epoch's position)

    def on_epoch_begin(self, info: TrainInfo) -> None:
        if jax.process_index() != 0:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=info.steps_per_epoch, desc=f"epoch {info.epoch + 1}/{info.epochs}",
                         unit="step", leave=self._leave, dynamic_ncols=True,
                         initial=info.position)
        self._t0, self._start = time.perf_counter(), info.position

    def _postfix(self, info: TrainInfo) -> dict:
        out = {k: f"{v:.4f}" for k, v in info.logs.items()}
        elapsed = time.perf_counter() - self._t0
        if info.global_batch_size and elapsed > 0:
            done = info.epoch_steps - self._start
            out["ex/s"] = f"{done * info.global_batch_size / elapsed:,.0f}"
        return out

    def on_train_batch_end(self, info: TrainInfo) -> None:
        if self._bar is not None:
            self._bar.update(info.call_steps)
            # Every 8th step (with steps_per_execution, the call that completes it).
            if info.epoch_steps // 8 > (info.epoch_steps - info.call_steps) // 8:
                self._bar.set_postfix(self._postfix(info), refresh=False)

    def on_epoch_end(self, info: TrainInfo) -> None:
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(info))
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class TensorBoard(Callback):
    """Writes the epoch (and optionally batch) logs as TensorBoard scalars (process 0 only).

    Epoch logs go to tags ``epoch/<name>`` at step = epoch; with ``update_freq=N`` the running logs
    also go to ``batch/<name>`` every N optimizer steps at the global step (those logs lag the
    newest step by a few steps, as ``fit`` reads metrics late; with ``steps_per_execution=K``,
    at the first call's end at or past every N-th step). Uses ``tensorboardX``.

    Args:
      log_dir: directory for the event files (created if missing).
      update_freq: ``"epoch"``, ``"batch"`` (every step) or an int N >= 1.

    Raises:
      ValueError: a bad ``update_freq``.

    >>> tb = TensorBoard("/tmp/jaxdist_logs", update_freq=100)
    >>> # jaxdist.fit(step, state, data, callbacks=[tb])
    >>> # then, in a shell: tensorboard --logdir /tmp/jaxdist_logs
    """

    def __init__(self, log_dir: str, *, update_freq: int | str = "epoch"):
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and not (isinstance(update_freq, int)
                                           and not isinstance(update_freq, bool)
                                           and update_freq >= 1):
            raise ValueError(f"TensorBoard update_freq={update_freq!r}; expected 'epoch', "
                             "'batch' or an int >= 1 (steps between batch-level writes)")
        self.log_dir = str(log_dir)
        self.update_freq = update_freq
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None and jax.process_index() == 0:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(self.log_dir)
        return self._writer

    def _write(self, prefix: str, logs: dict[str, float], step: int) -> None:
        writer = self._open()
        if writer is None:
            return
        for name, value in logs.items():
            writer.add_scalar(f"{prefix}/{name}", float(value), global_step=step)

    def on_train_begin(self, info: TrainInfo) -> None:
        self._open()

    def on_train_batch_end(self, info: TrainInfo) -> None:
        f = self.update_freq
        # A multiple of N among the steps this call completed (one, or steps_per_execution).
        if isinstance(f, int) and info.step // f > (info.step - info.call_steps) // f and info.logs:
            self._write("batch", info.logs, info.step)

    def on_epoch_end(self, info: TrainInfo) -> None:
        self._write("epoch", info.logs, info.epoch)

    def close(self) -> None:  # fit calls it last, also after an error: events stay readable
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
