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


def _profile_steps(value: int | str | tuple[int, int]) -> tuple[int, int] | None:
    """Keras's ``profile_batch`` as ``(start, stop)``, or None for no trace.

    >>> _profile_steps(0), _profile_steps(3), _profile_steps("2,4"), _profile_steps((5, 8))
    (None, (3, 3), (2, 4), (5, 8))
    """
    parts: tuple
    if isinstance(value, str):
        parts = tuple(p.strip() for p in value.split(","))
    elif isinstance(value, (tuple, list)):
        parts = tuple(value)
    else:
        parts = (value, value)
    try:
        start, stop = (int(p) for p in parts)
        ok = len(parts) == 2 and not any(isinstance(p, bool) for p in parts)
    except (TypeError, ValueError):
        ok = False
    if not ok or (start, stop) != (0, 0) and not 1 <= start <= stop:
        raise ValueError(f"TensorBoard profile_batch={value!r}; expected 0 (no trace), a step "
                         "N >= 1, or (start, stop) with 1 <= start <= stop, e.g. (10, 20)")
    return None if start == 0 else (start, stop)


class TensorBoard(Callback):
    """Writes the epoch (and optionally batch) logs as TensorBoard scalars (process 0 only).

    Epoch logs go to tags ``epoch/<name>`` at step = epoch; with ``update_freq=N`` the running logs
    also go to ``batch/<name>`` every N optimizer steps at the global step (those logs lag the
    newest step by a few steps, as ``fit`` reads metrics late; with ``steps_per_execution=K``,
    at the first call's end at or past every N-th step). Uses ``tensorboardX``.

    Args:
      log_dir: directory for the event files (created if missing).
      update_freq: ``"epoch"``, ``"batch"`` (every step) or an int N >= 1.
      profile_batch: Keras's: ``(start, stop)`` (or one step N, or ``"start,stop"``) traces
        optimizer steps ``start..stop`` (1-based, inclusive) with the JAX profiler, written under
        ``log_dir/plugins/profile/<time>/`` (process 0): TensorBoard's profile plugin reads the
        ``.xplane.pb``, Perfetto (ui.perfetto.dev) the ``perfetto_trace.json.gz``. ``0`` (the
        default) traces nothing. With ``steps_per_execution=K`` the trace spans whole calls.

    Raises:
      ValueError: a bad ``update_freq`` or ``profile_batch``.

    >>> tb = TensorBoard("/tmp/jaxdist_logs", update_freq=100)
    >>> # jaxdist.fit(step, state, data, callbacks=[tb])
    >>> # then, in a shell: tensorboard --logdir /tmp/jaxdist_logs
    """

    def __init__(self, log_dir: str, *, update_freq: int | str = "epoch",
                 profile_batch: int | str | tuple[int, int] = 0):
        self.profile_batch = _profile_steps(profile_batch)
        self._tracing = False
        self.traced: tuple[int, int] | None = None  # the first and last step the trace spans
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
        self._profile(info)

    def _profile(self, info: TrainInfo) -> None:
        """Starts the trace before the call that runs step ``start``; stops it once step
        ``stop`` is done (waited for, so that its device work is in the trace)."""
        if self.profile_batch is None or jax.process_index() != 0:
            return
        start, stop = self.profile_batch
        if not self._tracing and self.traced is None and info.step < start <= \
                info.step + info.steps_per_execution:
            jax.block_until_ready(info.state)  # the steps before stay out of the trace
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self._tracing, self.traced = True, (info.step + 1, info.step + 1)
        elif self._tracing and info.step >= stop:
            jax.block_until_ready(info.state)
            self._stop_trace(info.step)

    def _stop_trace(self, last: int) -> None:
        jax.profiler.stop_trace()
        self._tracing = False
        self.traced = (self.traced[0] if self.traced else last, last)

    def on_train_batch_end(self, info: TrainInfo) -> None:
        self._profile(info)
        f = self.update_freq
        # A multiple of N among the steps this call completed (one, or steps_per_execution).
        if isinstance(f, int) and info.step // f > (info.step - info.call_steps) // f and info.logs:
            self._write("batch", info.logs, info.step)

    def on_epoch_end(self, info: TrainInfo) -> None:
        self._write("epoch", info.logs, info.epoch)

    def close(self) -> None:  # fit calls it last, also after an error: events stay readable
        if self._tracing:  # training ended inside the traced steps: keep what was traced
            self._stop_trace(self.traced[1] if self.traced else 0)
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
