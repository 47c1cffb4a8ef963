"""Callbacks for ``jaxdist.fit``: hooks that see a ``TrainInfo`` and may stop or redirect training.

The library never owns a mutable model: a callback that changes the state (a restore, say) assigns
``info.state``, and ``fit`` carries on from that value.
"""

from __future__ import annotations

import dataclasses
import logging
import math
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


class TerminateOnNaN(Callback):
    """Stops training as soon as the loss read back is NaN or infinite (Keras's ``TerminateOnNaN``).

    As in Keras, it watches ``logs["loss"]`` after every batch and does nothing when the logs have
    no such key. ``fit`` reads metrics a few steps late (bounded run-ahead), so training stops
    within those few steps of the first NaN; the logs are running means over the epoch, so once
    NaN they stay NaN.

    Args:
      monitor: the log to watch (``"loss"`` as Keras; change it if your step names it otherwise).

    >>> cb = TerminateOnNaN()
    >>> info = TrainInfo(step=5, logs={"loss": float("nan")})
    >>> cb.on_train_batch_end(info)
    >>> info.stop_training, cb.stopped_step
    (True, 5)
    """

    def __init__(self, monitor: str = "loss"):
        self.monitor = monitor
        self.stopped_step: int | None = None

    def on_train_batch_end(self, info: TrainInfo) -> None:
        value = info.logs.get(self.monitor)
        if value is not None and not math.isfinite(float(value)):
            self.stopped_step = info.step
            info.stop_training = True
            logger.warning("step %d: invalid %s %s, terminating training", info.step,
                           self.monitor, value)


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
    input position (epoch and batch) are restored from the newest backup that restores intact
    (newer ones that are corrupt or incomplete are skipped with a warning), so the resumed run sees
    exactly the batches the uninterrupted one would have, and ends with the same parameters. On a
    preemption notice (SIGTERM; agreed across processes) a backup is written at the next step
    boundary, made durable, and ``TrainingPreempted`` ends the process cleanly.

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
        # The newest backup that restores intact: a corrupt or half-written newer one is skipped
        # with a warning naming it, so a restarted job resumes instead of failing every restart.
        found = self.manager.restore_latest(target=info.state, strategy=info.strategy)
        if found is None:
            return
        step, info.state, meta = found
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
            raise TrainingPreempted(self._exit_code)  # fit's cleanup calls close()

    def on_train_end(self, info: TrainInfo) -> None:
        super().on_train_end(info)
        if self._delete and jax.process_index() == 0:
            import shutil

            shutil.rmtree(self.manager.directory, ignore_errors=True)

    def close(self) -> None:
        self._notice.uninstall()


class EarlyStopping(Callback):
    """Stops training when a monitored epoch metric has stopped improving (Keras semantics).

    At each epoch end the value ``info.logs[monitor]`` is compared with the best so far; after
    ``patience`` epochs without an improvement of more than ``min_delta``, ``info.stop_training`` is
    set. With ``restore_best_state``, the best epoch's state is kept on the host and put back
    (placed with ``info.strategy.put``) when training ends, whether or not it stopped early.

    Args:
      monitor: the epoch log to watch, e.g. ``"val_loss"`` (``fit`` logs eval metrics as ``val_*``).
      min_delta: smallest change that counts as an improvement.
      patience: epochs without improvement before stopping.
      mode: ``"min"``, ``"max"``, or ``"auto"`` (``"max"`` when ``monitor`` contains ``"acc"``).
      restore_best_state: end training with the best epoch's state instead of the last one.

    Raises:
      ValueError: a bad option, or (at the first epoch end) ``monitor`` missing from the logs.

    >>> es = EarlyStopping("val_accuracy", patience=2, restore_best_state=True)
    >>> es.mode
    'max'
    >>> # history = jaxdist.fit(step, state, data, eval_step=..., eval_data=..., callbacks=[es])
    """

    def __init__(self, monitor: str = "val_loss", *, min_delta: float = 0.0, patience: int = 0,
                 mode: str = "auto", restore_best_state: bool = False):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping mode={mode!r}; expected 'auto', 'min' or 'max'")
        if patience < 0:
            raise ValueError(f"EarlyStopping patience={patience}; expected an int >= 0")
        self.monitor = monitor
        self.min_delta = abs(float(min_delta))
        self.patience = int(patience)
        self.mode = mode if mode != "auto" else ("max" if "acc" in monitor else "min")
        self.restore_best_state = restore_best_state
        self._reset()

    def _reset(self) -> None:
        self.best = float("inf") if self.mode == "min" else -float("inf")
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.wait = 0
        self._best_state: PyTree = None

    def _improves(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_train_begin(self, info: TrainInfo) -> None:
        self._reset()

    def on_epoch_end(self, info: TrainInfo) -> None:
        if self.monitor not in info.logs:
            hint = (" (val_* metrics need fit(..., eval_step=..., eval_data=...))"
                    if self.monitor.startswith("val_") else "")
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, but the epoch logs hold "
                             f"{sorted(info.logs)}{hint}; pass one of those as monitor=")
        value = float(info.logs[self.monitor])
        # As in Keras: with nothing better ever seen, the first epoch's state is the one restored.
        if self.restore_best_state and self._best_state is None:
            self._best_state = jax.device_get(info.state)
        self.wait += 1
        if self._improves(value):
            self.best, self.best_epoch, self.wait = value, info.epoch, 0
            if self.restore_best_state:
                self._best_state = jax.device_get(info.state)
            return
        if self.wait >= self.patience and info.epoch > 0:
            self.stopped_epoch = info.epoch
            info.stop_training = True
            if jax.process_index() == 0:
                logger.info("early stopping at epoch %d: %s has not improved on %.6g (epoch %s) "
                            "for %d epochs", info.epoch + 1, self.monitor, self.best,
                            None if self.best_epoch is None else self.best_epoch + 1, self.wait)

    def on_train_end(self, info: TrainInfo) -> None:
        if not self.restore_best_state or self._best_state is None:
            return
        best, self._best_state = self._best_state, None
        if info.strategy is not None:
            info.state = info.strategy.put(best)
        else:
            info.state = jax.tree.map(
                lambda h, cur: jax.device_put(h, cur.sharding) if isinstance(cur, jax.Array) else h,
                best, info.state)


_WRAP_HINT = ("wrap the optimizer with optax.inject_hyperparams so the value lives in the "
              "optimizer state, e.g. tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)")


def _holds_hyperparam(node: Any, name: str) -> bool:
    hp = getattr(node, "hyperparams", None)
    return isinstance(hp, dict) and name in hp


def _rebuild(node: Any, **fields: Any) -> Any:
    if hasattr(node, "_replace"):
        return node._replace(**fields)
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(node, **fields)
    if hasattr(node, "replace"):
        return node.replace(**fields)
    raise TypeError(f"cannot rebuild {type(node).__name__} with a new hyperparameter: it is "
                    "neither a NamedTuple nor a dataclass and has no .replace()")


def _map_hyperparam(tree: PyTree, name: str, fn: Any) -> PyTree:
    """Applies ``fn`` to every ``hyperparams[name]`` in ``tree`` (nested inject states included)."""

    def visit(node):
        if not _holds_hyperparam(node, name):
            return node
        hp = dict(node.hyperparams)
        hp[name] = fn(hp[name])
        others = {}
        if hasattr(node, "_fields"):
            others = {f: _map_hyperparam(getattr(node, f), name, fn)
                      for f in node._fields if f != "hyperparams"}
        return _rebuild(node, hyperparams=hp, **others)

    return jax.tree.map(visit, tree, is_leaf=lambda n: _holds_hyperparam(n, name))


def _opt_state_of(state: PyTree) -> PyTree:
    return state.opt_state if hasattr(state, "opt_state") else state


def _with_opt_state(state: PyTree, name: str, fn: Any) -> PyTree:
    if hasattr(state, "opt_state") and hasattr(state, "replace"):
        return state.replace(opt_state=_map_hyperparam(state.opt_state, name, fn))
    # A dict / tuple / NamedTuple state: rebuild the whole tree around the changed leaves.
    return _map_hyperparam(state, name, fn)


def get_hyperparam(state: PyTree, name: str = "learning_rate") -> list:
    """The values of every ``optax.inject_hyperparams`` hyperparameter ``name`` inside ``state``.

    Args:
      state: a train state (flax ``TrainState``, dict, tuple…) or an optimizer state.
      name: the hyperparameter.

    Returns:
      The values found (device arrays), in tree order; empty when there are none.

    >>> import optax, jax.numpy as jnp
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    >>> [float(v) for v in get_hyperparam({"opt_state": tx.init(jnp.zeros(2))})]
    [0.5]
    """
    found: list = []

    def keep(v):
        found.append(v)
        return v

    _map_hyperparam(_opt_state_of(state), name, keep)
    return found


def _schedule_arity(schedule: Any) -> int:
    import inspect

    try:
        params = inspect.signature(schedule).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return 1
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    required = [p for p in positional if p.default is p.empty]
    # Two required positionals, or (epoch=0, lr=None)-style defaults: pass the current value too.
    return 2 if len(required) >= 2 or (not required and len(positional) >= 2) else 1


class LearningRateScheduler(Callback):
    """Sets the learning rate (an ``optax.inject_hyperparams`` hyperparameter) at each epoch start.

    JAX optimizers are functions, so the rate must live in the optimizer *state*: build the
    optimizer with ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``. At each epoch start
    every ``hyperparams[hyperparam]`` in ``info.state`` (through chains, nested states, a flax
    ``TrainState`` or a plain dict) is replaced by the scheduled value, with the same dtype and
    placement, so the compiled step is reused. The value in effect is logged at epoch end as
    ``logs[hyperparam]`` (put ``TensorBoard`` after this callback to see it there).

    Args:
      schedule: ``schedule(epoch) -> float`` or, like Keras, ``schedule(epoch, current) -> float``
        (epochs are 0-based).
      hyperparam: the hyperparameter to set.

    Raises:
      ValueError: (at the first epoch start) the state holds no such hyperparameter, or the
        schedule returned something that is not a number.

    >>> sched = LearningRateScheduler(lambda epoch, lr: lr * 0.9 if epoch >= 2 else lr)
    >>> # tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    >>> # jaxdist.fit(step, state, data, epochs=10, callbacks=[sched])
    """

    def __init__(self, schedule: Any, *, hyperparam: str = "learning_rate"):
        if not callable(schedule):
            raise TypeError(f"schedule must be callable (epoch -> float), got {schedule!r}")
        self.schedule = schedule
        self.hyperparam = hyperparam
        self._arity = _schedule_arity(schedule)

    def _current(self, state: PyTree) -> list:
        found = get_hyperparam(state, self.hyperparam)
        if not found:
            raise ValueError(
                f"LearningRateScheduler: the train state has no optax.inject_hyperparams "
                f"hyperparameter {self.hyperparam!r} (state type {type(state).__name__}); "
                f"{_WRAP_HINT}")
        return found

    def on_epoch_begin(self, info: TrainInfo) -> None:
        found = self._current(info.state)
        if self._arity == 2:
            value = self.schedule(info.epoch, float(jax.device_get(found[0])))
        else:
            value = self.schedule(info.epoch)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"LearningRateScheduler: schedule({info.epoch}) returned {value!r}; "
                             "it must return a float") from None

        def place(old):
            import numpy as np

            new = np.asarray(value, dtype=old.dtype if hasattr(old, "dtype") else np.float32)
            return jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new

        info.state = _with_opt_state(info.state, self.hyperparam, place)
        logger.debug("epoch %d: %s = %g", info.epoch, self.hyperparam, value)

    def on_epoch_end(self, info: TrainInfo) -> None:
        info.logs[self.hyperparam] = float(jax.device_get(self._current(info.state)[0]))


class TensorBoard(Callback):
    """Writes the epoch (and optionally batch) logs as TensorBoard scalars (process 0 only).

    Epoch logs go to tags ``epoch/<name>`` at step = epoch; with ``update_freq=N`` the running logs
    also go to ``batch/<name>`` every N optimizer steps at the global step (those logs lag the
    newest step by a few steps, as ``fit`` reads metrics late). Uses ``tensorboardX``.

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
        if isinstance(self.update_freq, int) and info.step % self.update_freq == 0 and info.logs:
            self._write("batch", info.logs, info.step)

    def on_epoch_end(self, info: TrainInfo) -> None:
        self._write("epoch", info.logs, info.epoch)

    def close(self) -> None:  # fit calls it last, also after an error: events stay readable
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
