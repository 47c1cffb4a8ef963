"""A Keras-like training loop over a compiled distributed step.

Two properties matter more than features here:

* **Bounded run-ahead, no idle devices.** JAX dispatches asynchronously; at most
  ``max_in_flight`` calls stay unfinished (the step's own bound, and the metrics' past it). On
  XLA:CPU with several devices, ~100 queued steps containing collectives deadlock XLA's rendezvous
  and abort the process; on an accelerator a loop that waits for a step's metrics while few are
  queued leaves the devices idle as it refills them.
* **Exact metrics.** Each step's metrics are means over the real examples of its batch; the epoch's
  value weights them by those counts, so a padded final batch is neither dropped nor over-counted.
  Metrics are copied to the host as their steps finish and read, several at a time, only once
  they are ready: below ``max_in_flight`` unfinished calls the loop never waits on the devices
  (a callback that wants the newest values waits for them itself: ``TrainInfo.latest_logs``).

``steps_per_execution=K`` (Keras's name and meaning) runs ``K`` steps per compiled call: the
epoch's batches are stacked ``K`` at a time and a loop on the device runs the step on each
(``DistributedStep.steps``), so the host dispatches, transfers and reads back once per ``K`` steps.
The numbers are the same as with ``K=1``: an epoch's last group of fewer than ``K`` batches runs
exactly those (no padded step touches the state). As in Keras, per-batch callbacks run once per
call, at each ``K`` boundary, with ``TrainInfo.step`` the step the call ended on and
``TrainInfo.call_steps`` the steps it ran; so checkpoints, backups, a preemption's save and a stop
asked for by the elastic launcher happen at those boundaries.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.callbacks import Callback, ProgressBar, Resume, TrainInfo
from jaxdist.checkpoint import InMemoryTier
from jaxdist.core import PyTree
from jaxdist.core.step import DistributedStep, check_max_in_flight
from jaxdist.input.protocols import EpochSource, GroupedEpochSource, InMemoryData
from jaxdist.launch.cluster import ENV_LAST_FAILURE, ENV_LAST_FAILURE_STEP

logger = logging.getLogger(__name__)


class _Metrics(dict):
    """``History.history``: a metric that no epoch produced raises a KeyError that says why."""

    nothing_trained = ""  # set when fit trained no epoch (a restored final state, say)

    def __missing__(self, key):
        if self.nothing_trained:
            raise KeyError(f"history[{key!r}]: fit trained no epoch, so there are no metrics: "
                           f"{self.nothing_trained}")
        raise KeyError(key)


@dataclasses.dataclass
class History:
    """What ``fit`` returns: per-epoch metrics (``history["loss"]`` …) and the trained ``state``.

    ``partial`` maps each epoch whose metrics cover only part of it to ``(first, count)``: a
    resumed epoch's metrics are over the ``count`` batches from batch ``first`` (0-based) that this
    ``fit`` trained. When ``fit`` trains no epoch (a backup that already holds the final state),
    ``history`` is empty and ``history["loss"]`` raises a KeyError saying so.
    """

    history: dict[str, list[float]]
    state: PyTree
    epochs: list[int]
    partial: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)


class _Meter:
    """Count-weighted running means of step metrics, read back once the devices have them.

    ``push`` takes one call's metrics and its batch's real-example count, or (a call of several
    steps) the metrics stacked on a leading axis and a tuple of counts, one per step run. Either
    way the sums are accumulated step by step in order, so the means are the same however the
    reads fall.

    Values are read only once they are ready, several at a time (one wake-up per ``max_in_flight
    / 2`` calls): the loop never waits on the devices while at most ``max_in_flight`` calls are
    unfinished. Past that (a step that bounds nothing itself) it waits for the calls that leave
    half of them running. Leaves that cannot say whether they are ready (a parameter server's
    ``RemoteValue`` says ``done()``) count as not ready.
    """

    def __init__(self, max_in_flight: int):
        self._pending: collections.deque = collections.deque()  # (flat metrics, count), oldest first
        self._max = max_in_flight
        self._batch = max(1, max_in_flight // 2)
        self._ready = 0  # pending calls, from the oldest, known to be finished
        self._copies: bool | None = None  # whether reading needs a transfer (not on a CPU)
        self._sums: dict[str, float] = {}
        self._count = 0
        self.reads = 0  # how many times values were read back (the logs changed)

    def push(self, metrics: PyTree, num_real: int | tuple) -> None:
        flat = _flatten_metrics(metrics)
        if self._copies is None:
            self._copies = any(isinstance(v, jax.Array) and next(iter(v.devices())).platform
                               != "cpu" for v in flat.values())
        if self._copies:
            _start_copies(flat)
        pending = self._pending
        pending.append((flat, num_real))
        while self._ready < len(pending) and _finished(pending[self._ready][0]):
            self._ready += 1
        if len(pending) - self._ready > self._max:
            self._read(len(pending) - self._batch)  # waits: more than max_in_flight unfinished
        elif self._ready >= self._batch:
            self._read(self._ready)

    def _read(self, count: int) -> None:
        if not count:
            return
        batch = [self._pending.popleft() for _ in range(count)]
        self._ready = max(0, self._ready - count)
        sums = self._sums
        for flat, (_, n) in zip(_fetch([f for f, _ in batch]), batch):
            if isinstance(n, tuple):  # a call of len(n) steps: row i is step i's
                for i, ni in enumerate(n):
                    for k, v in flat.items():
                        sums[k] = sums.get(k, 0.0) + float(v[i]) * ni
                    self._count += ni
                continue
            for k, v in flat.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
            self._count += n
        self.reads += 1

    def drain(self) -> dict[str, float]:
        self._read(len(self._pending))
        return self.result()

    def result(self) -> dict[str, float]:
        return {k: s / self._count for k, s in self._sums.items()} if self._count else {}


def _finished(flat: dict[str, Any]) -> bool:
    """Whether every value of one call's metrics can be read without waiting."""
    for v in flat.values():
        if isinstance(v, jax.Array):
            if not v.is_ready():  # type: ignore[attr-defined]
                return False
        elif isinstance(v, (np.ndarray, np.generic, int, float)):
            continue
        elif not getattr(v, "done", lambda: False)():
            return False
    return True


def _fetch(flats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls' metrics on the host (their copies were started when they were pushed)."""
    return [{k: np.asarray(v) if isinstance(v, jax.Array) else v for k, v in f.items()}
            for f in flats]


def _start_copies(flat: dict[str, Any]) -> None:
    """Starts copying the metrics to the host as soon as the devices have them, so that reading
    them later waits for nothing but their step (not for a transfer behind it)."""
    for leaf in flat.values():
        copy = getattr(leaf, "copy_to_host_async", None)
        if copy is not None and getattr(leaf, "is_fully_addressable", False):
            copy()


def _flatten_metrics(metrics: PyTree) -> dict[str, Any]:
    if type(metrics) is dict and all(type(k) is str and not isinstance(v, dict)
                                     for k, v in metrics.items()):
        return metrics  # the common case, {"loss": ..., "accuracy": ...}: flat already
    if isinstance(metrics, dict) and all(isinstance(k, str) for k in metrics):
        flat = {}
        for k, v in metrics.items():
            if isinstance(v, dict):
                flat.update({f"{k}/{kk}": vv for kk, vv in _flatten_metrics(v).items()})
            else:
                flat[k] = v
        return flat
    leaves = jax.tree_util.tree_flatten_with_path(metrics)[0]
    return {jax.tree_util.keystr(p) or "value": v for p, v in leaves}


def _check_scalars(flat: dict[str, Any], stacked: bool = False) -> None:
    for k, v in flat.items():
        shape = np.shape(v)[1:] if stacked else np.shape(v)
        if shape != ():
            raise ValueError(f"metric {k!r} has shape {shape}; a step must return scalar "
                             "metrics (means over the real examples of the batch)")


def _check_steps_per_execution(k: Any) -> int:
    """``k`` as an int >= 1, or a ValueError naming it."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"steps_per_execution={k!r}; expected an int >= 1 (steps run per "
                         "compiled call; 1 runs one step per call)")
    return int(k)


def _grouped_step(step: Callable, dataset: EpochSource, k: int, what: str) -> None:
    """Refuses ``steps_per_execution > 1`` where it cannot run, saying why."""
    if not hasattr(step, "steps"):
        raise ValueError(
            f"{what}(steps_per_execution={k}) needs a step compiled by strategy.step / "
            f"@jaxdist.mirrored (or a plain function), got {type(step).__name__}, which runs its "
            "steps elsewhere; use steps_per_execution=1")
    if not isinstance(dataset, GroupedEpochSource):
        raise ValueError(
            f"{what}(steps_per_execution={k}) needs a source that hands out groups of batches "
            f"(jaxdist.input.GroupedEpochSource: strategy.distribute's datasets, or raw arrays "
            f"with batch_size=), got {type(dataset).__name__}; use steps_per_execution=1")


def _as_dataset(data: EpochSource | InMemoryData, strategy, batch_size: int | None,
                shuffle: bool, seed: int, what: str) -> EpochSource:
    """``data`` as a source ``fit`` reads: an ``EpochSource`` as it is, in-memory arrays through
    ``strategy.distribute``; anything else refused in one line saying what to pass."""
    if isinstance(data, EpochSource):
        return data
    if isinstance(data, (tuple, dict, np.ndarray, jax.Array)):
        if batch_size is None:
            raise ValueError(f"{what} is not a jaxdist.DistributedDataset, so pass batch_size= "
                             "(the global batch size) or build one with "
                             "strategy.distribute(data, batch)")
        return strategy.distribute(data, batch_size, shuffle=shuffle, seed=seed)
    raise TypeError(_not_a_source(data, what))


def _grouped(source: EpochSource, what: str) -> GroupedEpochSource:
    """``source`` where ``evaluate`` and ``predict`` need a ``GroupedEpochSource`` (they count
    epochs and read ``shuffle``), or a one-line TypeError."""
    if not isinstance(source, GroupedEpochSource):
        raise TypeError(f"{what}: a {type(source).__name__} has no next_epoch / shuffle (see "
                        "jaxdist.input.GroupedEpochSource): pass strategy.distribute(data, "
                        "global_batch_size) or in-memory arrays with batch_size=")
    return source


def _not_a_source(data: object, what: str) -> str:
    kind = ("a list" if isinstance(data, list) else "a generator"
            if inspect.isgenerator(data) or inspect.isgeneratorfunction(data)
            else f"a {type(data).__name__}")
    missing = " and no ".join(m for m in ("iterator", "global_batch_size")
                              if not hasattr(data, m))
    return (f"{what}: {kind} is not a source fit can read (it has no {missing}; see "
            "jaxdist.input.EpochSource): pass strategy.distribute(data, global_batch_size), "
            "which takes arrays, an iterable of batches or a generator function, or in-memory "
            "arrays (x, y) with batch_size=")


def _as_step(step_fn: Callable, strategy, *, donate: bool) -> Any:  # a DistributedStep, or ps.fit's
    if isinstance(step_fn, DistributedStep):
        return step_fn
    return strategy.step(step_fn, donate=donate)


def _strategy_of(step_fn: Callable, data: Any):
    from jaxdist.strategy.mirrored import DefaultStrategy, MirroredStrategy

    s = getattr(step_fn, "strategy", None)
    if s is None and isinstance(data, EpochSource):
        s = getattr(data, "strategy", None)
    if s is None:  # one of several launched processes that never joined: one line, not alone
        from jaxdist.launch import runtime

        runtime.check_joined("fit")
    if s is None and jax.process_count() > 1:
        # One job across the processes (as @jaxdist.mirrored under `jaxdist launch`): the
        # default strategy's one device belongs to process 0, which every other process cannot
        # place anything on.
        logger.info("fit: a plain step in a %d-process job runs under MirroredStrategy() over "
                    "the job's %d devices", jax.process_count(), jax.device_count())
        return MirroredStrategy()
    return s or DefaultStrategy()


def evaluate(eval_step: Callable, state: PyTree, data: EpochSource | InMemoryData, /, *,
             batch_size: int | None = None,
             steps: int | None = None, max_in_flight: int = 4,
             steps_per_execution: int = 1) -> dict[str, float]:
    """Runs ``eval_step(state, batch) -> metrics`` over ``data``; returns count-weighted means.

    Args:
      eval_step: a plain function or one compiled with ``strategy.step``; it must return scalar
        metrics averaged over the batch's real examples (use ``batch.mask``).
      state: the state to evaluate (not consumed).
      data: a ``DistributedDataset``, or raw data with ``batch_size``.
      steps: stop after this many batches.
      max_in_flight: calls dispatched before the oldest one's metrics are read back.
      steps_per_execution: batches evaluated per compiled call (as ``fit``'s); same numbers.

    Returns:
      ``{name: mean over all real examples}``.

    Raises:
      ValueError: a step returning no metrics, or a bad ``steps_per_execution``.

    >>> import jax.numpy as jnp, numpy as np, jaxdist
    >>> s = jaxdist.MirroredStrategy()
    >>> mean = lambda w, b: {"x": jaxdist.compute_average_loss(b.data * w, b.mask)}
    >>> evaluate(mean, jnp.float32(2.0), s.distribute(np.arange(20.0), 8), steps_per_execution=2)
    {'x': 19.0}
    """
    group = _check_steps_per_execution(steps_per_execution)
    strategy = _strategy_of(eval_step, data)
    step = _as_step(eval_step, strategy, donate=False)
    dataset = _grouped(_as_dataset(data, strategy, batch_size, False, 0, "evaluate data"),
                       "evaluate data")
    if group > 1:
        _grouped_step(step, dataset, group, "evaluate")
    meter = _Meter(max_in_flight)
    # The next epoch, as iter(dataset): a shuffled dataset visits the order K=1 would.
    run = dataset.next_epoch(group_size=group, steps=steps) if group > 1 else dataset.next_epoch()
    with run as it:
        for k, item in enumerate(it):
            if group == 1 and steps is not None and k >= steps:
                break
            if group > 1:
                metrics, counts = step.steps(state, item.batches, len(item.num_real)), item.num_real
            else:
                metrics, counts = step(state, item), it.last_num_real
            if k == 0 and not jax.tree.leaves(metrics):
                raise ValueError("eval_step returned no metrics; it must return a pytree of scalars "
                                 "such as {'loss': ..., 'accuracy': ...}")
            meter.push(metrics, counts)
    return meter.drain()


def _to_host(x: Any) -> np.ndarray:
    """A global array as numpy on this process, whatever its sharding (all processes call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def predict(predict_step: Callable, state: PyTree, data: EpochSource | InMemoryData, /, *,
            batch_size: int | None = None,
            steps: int | None = None, max_in_flight: int = 4,
            steps_per_execution: int = 1) -> PyTree:
    """Runs ``predict_step(state, batch) -> predictions`` over ``data``; returns them in input order.

    Every process calls it (under a multi-process strategy) and every process gets all the
    predictions: each batch's outputs are gathered from every replica and process, and the rows
    that only pad the final batch are removed (Keras's ``model.predict``).

    Args:
      predict_step: a plain function or one compiled with ``strategy.step``; it returns a pytree of
        arrays whose leading axis is the batch (logits, say).
      state: the state to predict with (not consumed).
      data: a ``DistributedDataset`` built with ``shuffle=False``, or raw data with ``batch_size``.
      steps: stop after this many batches.
      max_in_flight: calls dispatched before the oldest one is read back.
      steps_per_execution: batches predicted per compiled call (as ``fit``'s); same predictions.

    Returns:
      The predictions' pytree with numpy leaves of leading size = the number of examples.

    Raises:
      ValueError: a shuffled dataset (the order would not be the input's), outputs without the
        batch axis, or a bad ``steps_per_execution``.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxdist
    >>> s = jaxdist.MirroredStrategy()
    >>> out = predict(lambda w, b: b.data * w, jnp.float32(2.0), s.distribute(np.arange(10.0), 8))
    >>> out.tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0]
    >>> predict(lambda w, b: b.data * w, jnp.float32(2.0), s.distribute(np.arange(20.0), 8),
    ...         steps_per_execution=2).tolist() == (2 * np.arange(20.0)).tolist()
    True
    """
    group = _check_steps_per_execution(steps_per_execution)
    strategy = _strategy_of(predict_step, data)
    step = _as_step(predict_step, strategy, donate=False)
    dataset = _grouped(_as_dataset(data, strategy, batch_size, False, 0, "predict data"),
                       "predict data")
    if dataset.shuffle:
        raise ValueError("predict got a dataset built with shuffle=True, so the predictions could not "
                         "be in input order; build it with strategy.distribute(data, batch_size)")
    if group > 1:
        _grouped_step(step, dataset, group, "predict")
    gb = dataset.global_batch_size
    pending: collections.deque = collections.deque()
    chunks: list = []

    def read_oldest():
        out, mask, count = pending.popleft()
        keep = _to_host(mask)
        leaves = jax.tree.leaves(out)
        lead = 0 if count is None else 1  # a call of several steps: axis 0 is the step
        if any(np.ndim(v) <= lead or np.shape(v)[lead] != gb for v in leaves):
            shapes = [np.shape(v)[lead:] for v in leaves]
            raise ValueError(f"predict_step returned shapes {shapes}; every "
                             f"output needs the batch as its leading axis ({gb} rows)")
        if count is None:
            chunks.append(jax.tree.map(lambda v: _to_host(v)[keep], out))
            return
        host = jax.tree.map(_to_host, out)
        chunks.extend(jax.tree.map(lambda v, i=i: v[i][keep[i]], host) for i in range(count))

    run = dataset.next_epoch(group_size=group, steps=steps) if group > 1 else dataset.next_epoch()
    with run as it:
        for k, item in enumerate(it):
            if group > 1:
                count = len(item.num_real)
                pending.append((step.steps(state, item.batches, count), item.batches.mask, count))
            else:
                if steps is not None and k >= steps:
                    break
                pending.append((step(state, item), item.mask, None))
            while len(pending) > max_in_flight:
                read_oldest()
    while pending:
        read_oldest()
    if not chunks:
        return None
    return jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)


_EMPTY = ("fit data is empty: {n} examples give no batch of global size {gb}, so there is "
          "nothing to train on. Check the data (an empty train split, a filter that drops "
          "everything) and the batch size")


def _warn_nonfinite(info: TrainInfo) -> bool:
    """Warns (process 0) that training goes on on NaN/Inf metrics; True once it has warned."""
    bad = sorted(k for k, v in info.logs.items()
                 if isinstance(v, (float, int)) and not math.isfinite(v))
    if not bad or info.stop_training:  # nothing wrong, or a callback (TerminateOnNaN) stops it
        return False
    if jax.process_index() == 0:
        warnings.warn(
            f"fit: {', '.join(bad)} became NaN or Inf by step {info.step} (epoch {info.epoch}) "
            "and training goes on. Common causes: labels outside the model's classes [0, "
            "num_classes) (integer-label cross-entropy gives NaN for them), NaN or Inf in the "
            "inputs, too high a learning rate. Add jaxdist.callbacks.TerminateOnNaN() to stop "
            "at the first NaN", RuntimeWarning, stacklevel=3)
    return True


_DONATED_NOTE = (
    "jaxdist.fit: the in-memory tier dropped the device snapshot it held beside this step, but "
    "the step's inputs were donated to it, so the step cannot run again; the tier copies "
    "directly for the rest of this process, a restarted run takes snapshots again: leave device "
    "memory for one more copy of the state beside the step (a smaller batch or model)")


def _memory_tiers(cbs: list) -> list[InMemoryTier]:
    """The in-memory tiers the callbacks copy the state with (``BackupAndRestore.memory``)."""
    return [tier for cb in cbs if isinstance(tier := getattr(cb, "memory", None), InMemoryTier)]


def _run_step(call: Callable, state: PyTree, batch: Any, tiers: list, *rest: Any) -> Any:
    """``call(state, batch, *rest)``, run once more when it ran out of device memory while an
    in-memory tier held a device snapshot of the state beside it: the tier drops the snapshot
    and copies directly from then on (one warning line). Not when the step's inputs are gone
    (donated): its error then says the snapshot was dropped. A second failure is raised."""
    try:
        return call(state, batch, *rest)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) or not any([t.drop_snapshot(e) for t in tiers]):
            raise
        if any(isinstance(x, jax.Array) and x.is_deleted()
               for x in jax.tree.leaves((state, batch))):
            e.add_note(_DONATED_NOTE)
            raise
    return call(state, batch, *rest)


def _train_epoch(step: Any, it: Any, info: TrainInfo, meter: _Meter, cbs: list, group: int,
                 steps_per_epoch: int | None, max_in_flight: int, warned: bool) -> bool:
    """One epoch's calls (one step each, or ``group`` with ``steps_per_execution``): the state,
    the metrics read a few calls late, the callbacks once per call. Returns ``warned``."""
    first, calls, reads = True, 0, -1
    logs: dict[str, float] = {}
    tiers = _memory_tiers(cbs)
    for item in it:
        if group == 1:
            count, num_real = 1, it.last_num_real
            info.state, metrics = _run_step(step, info.state, item, tiers)
        else:
            count, num_real = len(item.num_real), item.num_real
            info.state, metrics = _run_step(step.steps, info.state, item.batches, tiers, count)
        if first:
            _check_scalars(_flatten_metrics(metrics), stacked=group > 1)
            has_metrics, first = bool(jax.tree.leaves(metrics)), False
        meter.push(metrics, num_real)
        calls += 1
        info.step += count
        info.epoch_steps += count
        info.call_steps = count
        info.position = it.position
        if not has_metrics and calls % max_in_flight == 0:
            # Nothing to read back, so nothing else would bound the run-ahead.
            jax.block_until_ready(info.state)
        changed = meter.reads != reads
        if changed:  # new values were read back; otherwise the logs are what they were
            reads, logs = meter.reads, meter.result()
        info.logs = dict(logs)
        for cb in cbs:
            cb.on_train_batch_end(info)
        if changed:
            warned = warned or _warn_nonfinite(info)
        if info.stop_training or (steps_per_epoch is not None
                                  and info.epoch_steps >= steps_per_epoch):
            break
    return warned


def _num_examples(dataset: Any) -> Any:
    n = getattr(dataset, "num_examples", None)
    return n if isinstance(n, int) else "its"


@dataclasses.dataclass
class _Run:
    """One ``fit`` call's moving parts, shared by the helpers below."""

    step: Callable
    dataset: Any
    info: TrainInfo
    cbs: list
    group: int
    steps_per_epoch: int | None
    max_in_flight: int
    evaluation: tuple | None  # (eval_step, eval_dataset), or None
    verbose: int
    history: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    done_epochs: list = dataclasses.field(default_factory=list)
    partial: dict = dataclasses.field(default_factory=dict)
    warned: bool = False  # about NaN/Inf metrics, once per fit
    resumed: Resume | None = None
    resumed_by: Callback | None = None


def _planned_steps(dataset: Any, steps_per_epoch: int | None) -> int | None:
    """Steps per epoch: the dataset's length, capped by ``steps_per_epoch`` (None: unknown)."""
    try:
        planned = len(dataset)
    except TypeError:
        planned = None
    if steps_per_epoch is not None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch}; expected >= 1 (or None: one "
                             "pass over the data)")
        planned = steps_per_epoch if planned is None else min(planned, steps_per_epoch)
    if planned == 0:
        raise ValueError(_EMPTY.format(n=_num_examples(dataset), gb=dataset.global_batch_size))
    return planned


def _known_eval_step(train_step: Callable) -> Callable | None:
    """The evaluation step that goes with a built-in train step (Keras: the compiled model's)."""
    from jaxdist.training import models

    fn = getattr(train_step, "_fn", train_step)
    fn = getattr(fn, "func", fn)  # functools.partial(classifier_train_step, accumulate=...)
    return models.classifier_eval_step if fn is models.classifier_train_step else None


def _evaluation(train_step: Callable, strategy, dataset: Any, eval_step: Callable | None,
                eval_data: Any, validation_data: Any, validation_batch_size: int | None,
                batch_size: int | None) -> tuple | None:
    """``(eval_step, eval dataset)`` from jaxdist's ``eval_step``/``eval_data`` or Keras's
    ``validation_data`` (distributed with the strategy), or None when there is nothing to evaluate."""
    if validation_data is not None:
        if eval_data is not None:
            raise ValueError("fit got both eval_data= and validation_data= (Keras's name for the "
                             "same thing); pass one of them")
        eval_step = eval_step or _known_eval_step(train_step)
        if eval_step is None:
            raise ValueError("fit(validation_data=...) needs eval_step=: a function "
                             "eval_step(state, batch) -> {'loss': ..., ...} (e.g. "
                             "jaxdist.models.classifier_eval_step); jaxdist has no compiled model to "
                             "take the evaluation from")
        if isinstance(validation_data, list):
            validation_data = tuple(validation_data)
        eval_data = _as_dataset(validation_data, strategy,
                                validation_batch_size or dataset.global_batch_size, False, 0,
                                "validation_data")
    if eval_step is None or eval_data is None:
        return None
    return (_as_step(eval_step, strategy, donate=False),
            _as_dataset(eval_data, strategy, batch_size, False, 0, "eval_data"))


def _check_validation_data(validation_data: Any) -> Any:
    """``validation_data`` as ``(x_val, y_val)`` or a dataset; anything else is refused in one
    line at ``fit``'s call, before any training (not deep in the model, or after an epoch)."""
    if validation_data is None or isinstance(validation_data, EpochSource):
        return validation_data
    if isinstance(validation_data, list):
        validation_data = tuple(validation_data)
    if isinstance(validation_data, tuple) and len(validation_data) == 3:
        raise ValueError("fit(validation_data=(x_val, y_val, sample_weight)): sample weights are not "
                         "supported; pass (x_val, y_val), or weight the loss inside eval_step "
                         "with your own weights in the batch (eval_data=strategy.distribute(...))")
    if not (isinstance(validation_data, tuple) and len(validation_data) == 2):
        what = (f"a {len(validation_data)}-tuple" if isinstance(validation_data, tuple)
                else f"a {type(validation_data).__name__}")
        raise ValueError(f"fit(validation_data=...) got {what}; pass (x_val, y_val) as Keras "
                         "does, or a dataset: eval_data=strategy.distribute(your_data, batch) "
                         "(any structure your eval_step takes, a dict of arrays included)")
    return validation_data


def _split_validation(data: Any, validation_split: float | None, validation_data: Any):
    """Keras's ``validation_split``: the last fraction of in-memory ``(x, y)``, before shuffling."""
    if validation_split is None:
        return data, validation_data
    if not (isinstance(validation_split, (int, float)) and 0.0 < validation_split < 1.0):
        raise ValueError(f"validation_split={validation_split!r}; expected a fraction between 0 "
                         "and 1 (e.g. 0.1)")
    if validation_data is not None:
        raise ValueError("fit got both validation_split= and validation_data=; pass one of them")
    if isinstance(data, list):
        data = tuple(data)
    if not (isinstance(data, tuple) and len(data) == 2):
        raise ValueError("validation_split= needs in-memory (x, y) arrays (as Keras's); with a "
                         "dataset, split it yourself and pass validation_data=(x_val, y_val)")
    n = len(jax.tree.leaves(data[0])[0])
    at = int(n * (1.0 - validation_split))
    if at < 1 or at >= n:
        raise ValueError(f"validation_split={validation_split} of {n} examples leaves "
                         f"{at} to train on and {n - at} to validate; choose a fraction that "
                         "leaves both non-empty")
    head = jax.tree.map(lambda a: a[:at], data)
    tail = jax.tree.map(lambda a: a[at:], data)
    return head, tail


def _fit_parts(train_step: Callable, strategy, data: EpochSource | InMemoryData, group: int,
               batch_size: int | None, shuffle: bool, seed: int,
               evaluate_with: tuple) -> tuple[Any, Any, tuple | None]:
    """``fit``'s compiled step, training dataset and evaluation (see ``_evaluation``)."""
    step = _as_step(train_step, strategy, donate=True)
    dataset = _as_dataset(data, strategy, batch_size, shuffle, seed, "fit data")
    if group > 1:
        _grouped_step(step, dataset, group, "fit")
    eval_step, eval_data, validation_data, validation_batch_size = evaluate_with
    return step, dataset, _evaluation(train_step, strategy, dataset, eval_step, eval_data,
                                      validation_data, validation_batch_size, batch_size)


def _resume(run: _Run) -> None:
    """Asks the callbacks whether to resume (at most one may) and says where training resumes."""
    info = run.info
    for cb in run.cbs:
        resume = cb.on_train_begin(info)
        if not isinstance(resume, Resume):
            continue
        if run.resumed is not None:
            raise ValueError(f"two callbacks resume training ({type(run.resumed_by).__name__} and "
                             f"{type(cb).__name__}); keep one BackupAndRestore")
        run.resumed, run.resumed_by = resume, cb
        info.state, info.step = resume.state, resume.step
        info.epoch, info.position = resume.epoch, resume.position


def _resume_line(run: _Run, start_epoch: int, start_position: int, epochs: int) -> str:
    """The one line a recovery prints: what failed, where training resumes from, what it costs."""
    resume, info = run.resumed, run.info
    source = "memory" if str(resume.source).startswith("memory") else "backup"
    failed = os.environ.get(ENV_LAST_FAILURE)
    failed_step = os.environ.get(ENV_LAST_FAILURE_STEP, "")
    cause = f"after {failed}" if failed else "after an earlier run of this job stopped"
    if failed_step.isdigit() and int(failed_step) >= resume.step:
        again = int(failed_step) - resume.step
        cost = f"{again} step(s) computed again (the failed run reached step {failed_step})"
    else:
        cost = f"the steps after {resume.step} are computed again"
    if start_epoch >= epochs:
        return (f"jaxdist: restored the final state (step {resume.step}) from {source}: nothing "
                f"left to train (epochs={epochs}); use a new backup directory, or "
                "BackupAndRestore(delete_checkpoint=True), to train again")
    planned = info.steps_per_epoch
    where = (f"epoch {start_epoch + 1}, after batch {start_position}"
             + (f" of {planned}" if planned else "") if start_position
             else f"the start of epoch {start_epoch + 1}")
    line = f"jaxdist: resumed {cause}: from {source} step {resume.step} ({where}); {cost}"
    if start_position:
        line += (f"; epoch {start_epoch + 1}'s metrics cover its batches {start_position + 1}"
                 f"-{planned or 'end'} only")
    return line


def _one_epoch(run: _Run, epoch: int, position: int) -> None:
    """Trains, evaluates and reports one epoch that starts at batch ``position``."""
    info, dataset, group = run.info, run.dataset, run.group
    info.epoch, info.epoch_steps, info.position, info.logs = epoch, position, position, {}
    for cb in run.cbs:
        cb.on_epoch_begin(info)
    meter = _Meter(run.max_in_flight)
    options = {} if group == 1 else {"group_size": group}
    if run.steps_per_epoch is not None and isinstance(dataset, GroupedEpochSource):
        options["steps"] = max(1, run.steps_per_epoch - position)  # none made past the last
    info._read_all = meter.drain
    with dataset.iterator(epoch=epoch, position=position, **options) as it:
        info.iterator = it
        run.warned = _train_epoch(run.step, it, info, meter, run.cbs, group, run.steps_per_epoch,
                                  run.max_in_flight, run.warned)
    info._read_all = None
    if info.epoch_steps == 0 and position == 0:  # a dataset without a length
        raise ValueError(_EMPTY.format(n="no", gb=dataset.global_batch_size))
    info.logs = meter.drain()
    if run.evaluation is not None:
        eval_step, eval_data = run.evaluation
        val = evaluate(eval_step, info.state, eval_data, max_in_flight=run.max_in_flight,
                       steps_per_execution=group)
        info.logs.update({f"val_{k}": v for k, v in val.items()})
    for cb in run.cbs:
        cb.on_epoch_end(info)
    run.warned = run.warned or _warn_nonfinite(info)
    # After the callbacks (as Keras's History): values they add, a learning rate say, stay.
    for k, v in info.logs.items():
        run.history[k].append(v)
    run.done_epochs.append(epoch)
    if position:  # a resumed epoch: its metrics cover the batches trained in this run only
        run.partial[epoch] = (position, info.epoch_steps - position)
    if jax.process_index() == 0 and run.verbose:
        part = (f" (batches {position + 1}-{info.epoch_steps} only: resumed at batch {position})"
                if position else "")
        logger.info("epoch %d%s: %s", epoch + 1, part,
                    ", ".join(f"{k}={v:.4f}" for k, v in info.logs.items()))


def _train(run: _Run, epochs: int) -> str:
    """Every epoch from where training (re)starts; returns why nothing was trained, or ''."""
    info = run.info
    # Carry on from a resumed run's epoch and batch. A backup taken after an epoch's last step
    # resumes at the next epoch, not with one step too many.
    start_epoch, start_position = info.epoch, info.position
    if info.steps_per_epoch is not None and start_position >= info.steps_per_epoch:
        start_epoch, start_position = start_epoch + 1, 0
    nothing = ""
    if run.resumed is not None:
        line = _resume_line(run, start_epoch, start_position, epochs)
        if jax.process_index() == 0:
            logger.warning("%s", line)
        if start_epoch >= epochs:
            nothing = line.removeprefix("jaxdist: ")
    elif start_epoch >= epochs:
        nothing = f"initial_epoch={start_epoch} is not below epochs={epochs}"
    for epoch in range(start_epoch, epochs):
        _one_epoch(run, epoch, start_position if epoch == start_epoch else 0)
        if info.stop_training:
            break
    return nothing


def fit(train_step: Callable, state: PyTree, data: EpochSource | InMemoryData, /, *,
        epochs: int = 1, steps_per_epoch: int | None = None, eval_step: Callable | None = None,
        eval_data: Any = None, callbacks: Sequence[Callback] = (), verbose: int = 1,
        batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
        initial_epoch: int = 0, max_in_flight: int = 8,
        steps_per_execution: int = 1, validation_data: Any = None,
        validation_batch_size: int | None = None,
        validation_split: float | None = None) -> History:
    """Trains ``state`` with ``train_step(state, batch) -> (state, metrics)`` for ``epochs``.

    Args:
      train_step: a step from ``@jaxdist.mirrored`` / ``strategy.step``, or a plain function (it is
        then compiled with the dataset's strategy, or the default strategy).
      state: the initial train state; it is donated to the first step once placed.
      data: ``strategy.distribute(...)``'s dataset or any ``jaxdist.input.EpochSource``
        (``GroupedEpochSource`` for ``steps_per_execution > 1``), or in-memory arrays with
        ``batch_size``; anything else (a list, a generator) is a ``TypeError`` at the call.
      epochs: train until this epoch (exclusive of ``initial_epoch``'s predecessors).
      steps_per_epoch: cap on steps per epoch (default: one pass over the data).
      eval_step, eval_data: evaluated after each epoch; metrics are logged as ``val_<name>``.
      validation_data: Keras's spelling: ``(x_val, y_val)`` (or a ``DistributedDataset``),
        distributed with the step's strategy in batches of ``validation_batch_size`` (default:
        the training batch size) and evaluated with ``eval_step``, which may be left out for
        ``jaxdist.models.classifier_train_step`` (its ``classifier_eval_step`` is used).
      validation_split: Keras's: the last fraction of in-memory ``(x, y)`` (before shuffling) is
        held out as ``validation_data`` (whose sample weights are not supported).
      callbacks: ``jaxdist.callbacks.Callback`` instances.
      verbose: 1 shows a progress bar per epoch (process 0 only), 0 is silent.
      max_in_flight: most compiled calls dispatched but not finished (the module docstring
        says why); with ``steps_per_execution=K`` up to ``max_in_flight * K`` steps.
      steps_per_execution: steps run per compiled call (Keras's name). ``K > 1`` stacks ``K``
        batches and loops over them on the device: the host dispatches, transfers and reads
        metrics back once per ``K`` steps, which speeds up small models whose steps take less
        time than their host work. The parameters and metrics are those of ``K=1`` (to float
        rounding; an epoch's last, shorter group runs only its real batches). Per-batch callbacks
        run once per call, after its ``K`` steps (``TrainInfo.step`` is the last of them,
        ``TrainInfo.call_steps`` their count), so checkpoints, backups and preemption saves
        happen at ``K`` boundaries. Memory: ``K`` batches per call on the devices, and the
        metrics of ``K`` steps. One compilation (a shorter group runs in the same program).

    Returns:
      ``History`` with ``history`` (per-epoch metrics), ``state`` (trained), ``epochs`` and
      ``partial`` (a resumed epoch's metrics cover the batches trained after the resume).

    A callback that resumes (``BackupAndRestore``) makes process 0 log one line (a warning, so it
    shows without any logging set up): what failed, the memory or backup step training resumes
    from, how many steps are computed again and, for an epoch resumed midway, that its metrics
    cover only the batches after the resume; the resumed epoch's progress bar starts there.

    Raises:
      ValueError: ``max_in_flight`` out of range, ``steps_per_epoch`` < 1, no batch, non-scalar
        metrics, ``steps_per_execution`` not an int >= 1 (or > 1 with a step or data it cannot
        group: a parameter-server step, say); ``validation_data`` with ``eval_data``, without
        an ``eval_step``, or not ``(x_val, y_val)`` or a dataset; a bad ``validation_split``.

    >>> import jax.numpy as jnp, numpy as np, jaxdist
    >>> s = jaxdist.MirroredStrategy()
    >>> @jaxdist.mirrored
    ... def step(w, batch):
    ...     loss, g = jax.value_and_grad(
    ...         lambda w: jaxdist.compute_average_loss((batch.data * w - 1.0) ** 2, batch.mask))(w)
    ...     return w - 0.1 * g, {"loss": loss}
    >>> data = s.distribute(np.linspace(0.0, 1.0, 20, dtype=np.float32), 8)
    >>> one = fit(step, jnp.float32(0.0), data, epochs=3, verbose=0)
    >>> nine = fit(step, jnp.float32(0.0), data, epochs=3, verbose=0, steps_per_execution=9)
    >>> bool(jnp.allclose(one.state, nine.state)), one.history["loss"] == nine.history["loss"]
    (True, True)

    Warns:
      RuntimeWarning: once, when a metric read back becomes NaN or Inf and no callback stops
        training (``jaxdist.callbacks.TerminateOnNaN`` does).
    """
    check_max_in_flight(max_in_flight)
    group = _check_steps_per_execution(steps_per_execution)
    data, validation_data = _split_validation(data, validation_split, validation_data)
    strategy = _strategy_of(train_step, data)
    step, dataset, evaluation = _fit_parts(
        train_step, strategy, data, group, batch_size, shuffle, seed,
        (eval_step, eval_data, _check_validation_data(validation_data), validation_batch_size))
    # A step that trains elsewhere (ParameterServerStrategy's) brings callbacks that drive its
    # cluster: join at epoch end and hand back the trained state, as Keras's fit does.
    cbs = [*getattr(step, "callbacks", ()), *callbacks]
    if verbose and not any(isinstance(c, ProgressBar) for c in cbs):
        cbs.append(ProgressBar())
    info = TrainInfo(epoch=initial_epoch, state=state,
                     steps_per_epoch=_planned_steps(dataset, steps_per_epoch), epochs=epochs,
                     global_batch_size=dataset.global_batch_size, strategy=strategy,
                     steps_per_execution=group)
    run = _Run(step, dataset, info, cbs, group, steps_per_epoch, max_in_flight, evaluation, verbose)
    try:
        _resume(run)
        nothing = _train(run, epochs)
        for cb in cbs:
            cb.on_train_end(info)
    finally:
        for cb in cbs:  # also when a step or a callback raised: signal handlers, open files
            cb.close()
    metrics = _Metrics(run.history)
    metrics.nothing_trained = nothing
    return History(metrics, info.state, run.done_epochs, run.partial)
