"""The side-car evaluator: evaluate every checkpoint a training job writes, as it appears.

tf.distribute's ``evaluator`` task (and Keras's ``SidecarEvaluator``): a separate process, not part of
the training job, watches the checkpoint directory, evaluates each new checkpoint, writes the
metrics to TensorBoard and to a JSON-lines log, and stops after the *final* checkpoint. Training
marks that one: ``ModelCheckpoint`` writes ``final_step.json`` into the directory (atomically, once
the checkpoint is durable) when ``fit`` ends.

Run it with ``jaxdist evaluate --watch DIR``, as a ``TF_CONFIG`` ``evaluator`` task
(``jaxdist train`` on such a task evaluates instead of training), or from Python with
:func:`watch`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

FINAL_MARKER = "final_step.json"


def mark_final(directory: str | os.PathLike, step: int) -> None:
    """Records that ``step`` is the last checkpoint training writes to ``directory`` (process 0).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); mark_final(d, 42); final_step(d)
    42
    """
    path = os.path.join(os.fspath(directory), FINAL_MARKER)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": int(step)}, f)
    os.replace(tmp, path)  # atomic: an evaluator never reads half a marker


def final_step(directory: str | os.PathLike) -> int | None:
    """The step marked final in ``directory``, or None while training goes on."""
    try:
        with open(os.path.join(os.fspath(directory), FINAL_MARKER)) as f:
            return int(json.load(f)["step"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


class _Writers:
    def __init__(self, tensorboard: str | None, log_path: str | None):
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(tensorboard)
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed in close()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"eval/{k}", float(v), global_step=step)
            self._tb.flush()
        if self._log is not None:
            self._log.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()},
                                        "time": time.time()}) + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._log is not None:
            self._log.close()


def watch(directory: str | os.PathLike, evaluate_fn: Callable[[Any, int], dict[str, float]], *,
          tensorboard: str | None = None, log_path: str | None = None, poll_s: float = 1.0,
          timeout_s: float | None = 3600.0) -> dict[int, dict[str, float]]:
    """Evaluates each new checkpoint in ``directory`` until the final one has been evaluated.

    Args:
      directory: the training job's checkpoint directory.
      evaluate_fn: ``evaluate_fn(manager, step) -> metrics``; ``manager`` is a
        ``jaxdist.checkpoint.CheckpointManager`` on ``directory`` (``manager.restore(step)`` needs
        no template).
      tensorboard: write ``eval/<metric>`` scalars at each checkpoint's step here.
      log_path: append one JSON line per checkpoint (``{"step", <metrics>, "time"}``).
      poll_s: seconds between looks at the directory.
      timeout_s: give up when no new checkpoint appears for this long (None: wait forever).

    Returns:
      ``{step: metrics}`` for every checkpoint evaluated.

    Raises:
      TimeoutError: nothing new for ``timeout_s`` seconds and no final marker.

    >>> import tempfile, jax.numpy as jnp
    >>> from jaxdist.checkpoint import CheckpointManager
    >>> d = tempfile.mkdtemp()
    >>> _ = CheckpointManager(d, async_save=False).save(5, {"w": jnp.ones(2)}); mark_final(d, 5)
    >>> watch(d, lambda mgr, step: {"sum": float(mgr.restore(step)["w"].sum())})
    {5: {'sum': 2.0}}
    """
    from jaxdist.checkpoint.manager import CheckpointError, CheckpointManager

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    mgr = CheckpointManager(directory, max_to_keep=None, async_save=False)
    writers = _Writers(tensorboard, log_path)
    results: dict[int, dict[str, float]] = {}
    last_progress = time.monotonic()
    try:
        while True:
            final = final_step(directory)  # read before listing: the final step is then listed
            mgr.reload()
            new = [s for s in mgr.all_steps() if s not in results]
            for step in new:
                try:
                    metrics = evaluate_fn(mgr, step)
                except CheckpointError as e:
                    mgr.reload()
                    if step in mgr.all_steps():
                        raise
                    logger.warning("checkpoint %d was deleted before it could be evaluated (%s)",
                                   step, e)
                    results[step] = {}
                    continue
                results[step] = metrics
                writers.write(step, metrics)
                logger.info("evaluated checkpoint %d: %s", step,
                            ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                last_progress = time.monotonic()
            if final is not None and (final in results or not new and all(
                    s <= final for s in results)):
                return {s: m for s, m in results.items() if m}
            if timeout_s is not None and time.monotonic() - last_progress > timeout_s:
                raise TimeoutError(
                    f"no new checkpoint in {directory} for {timeout_s:.0f}s and no "
                    f"{FINAL_MARKER} (evaluated steps: {sorted(results) or 'none'}); is training "
                    "running and writing there? Raise --timeout for long gaps between saves")
            time.sleep(poll_s)
    finally:
        writers.close()
        mgr.close()
