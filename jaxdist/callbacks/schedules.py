"""Callbacks that steer training over epochs: ``LearningRateScheduler`` and ``EarlyStopping``.

Hyperparameters live in the optimizer state (``optax.inject_hyperparams``); they are read and
written with ``optax.tree_utils.tree_get_all_with_path`` / ``tree_set``, which find them through
chains, nested states and any train-state pytree.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
from optax import tree_utils as otu

from jaxdist.callbacks.core import Callback, TrainInfo
from jaxdist.core import PyTree

logger = logging.getLogger(__name__)


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


def _opt_state_of(state: PyTree) -> PyTree:
    return state.opt_state if hasattr(state, "opt_state") else state


def _with_hyperparam(state: PyTree, name: str, fn: Any) -> PyTree:
    """``state`` with every hyperparameter ``name`` replaced by ``fn(old value)``."""
    def setter(tree):
        found = otu.tree_get_all_with_path(tree, name)
        if not found:
            return tree
        new = fn(found[0][1])
        return otu.tree_set(tree, **{name: new})

    if hasattr(state, "opt_state") and hasattr(state, "replace"):
        return state.replace(opt_state=setter(state.opt_state))
    return setter(state)


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
    return [v for _, v in otu.tree_get_all_with_path(_opt_state_of(state), name)]


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

        info.state = _with_hyperparam(info.state, self.hyperparam, place)
        logger.debug("epoch %d: %s = %g", info.epoch, self.hyperparam, value)

    def on_epoch_end(self, info: TrainInfo) -> None:
        info.logs[self.hyperparam] = float(jax.device_get(self._current(info.state)[0]))


class TerminateOnNaN(Callback):
    """Stops training as soon as the loss read back is NaN or infinite (Keras's ``TerminateOnNaN``).

    As in Keras, it watches ``logs["loss"]`` after every batch and does nothing when the logs have
    no such key. ``fit`` reads metrics a few steps late (bounded run-ahead), so training stops
    within those few steps of the first NaN; the logs are running means over the epoch, so once
    NaN they stay NaN. It checks again at each epoch's end, where ``fit`` has read every step, so
    an epoch shorter than the run-ahead window still stops training (``stopped_step`` is then the
    epoch's last step).

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
        self._check(info)

    def on_epoch_end(self, info: TrainInfo) -> None:
        # ``fit`` reads an epoch's last metrics only at its end: an epoch of at most
        # ``max_in_flight`` steps shows no loss to ``on_train_batch_end`` at all.
        if self.stopped_step is None:
            self._check(info)

    def _check(self, info: TrainInfo) -> None:
        value = info.logs.get(self.monitor)
        if value is not None and not math.isfinite(float(value)):
            self.stopped_step = info.step
            info.stop_training = True
            logger.warning("step %d: invalid %s %s, terminating training", info.step,
                           self.monitor, value)
