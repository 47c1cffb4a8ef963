"""Checkpoints over Orbax: every process writes its shards, restores reshard onto any strategy.

A checkpoint holds the train state (arrays, including any RNG key data kept in it), the step, and
the input iterator's position, so that a run killed and resumed continues from exactly the next
batch. Orbax writes each step into a temporary directory and renames it only once every process has
finished, so a crash mid-save never leaves a step that restores as valid.

Multi-process contract: every process constructs the manager with the same directory and calls
``save`` / ``restore`` / ``wait_until_finished`` for the same steps (they synchronise internally).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist._types import PyTree
from jaxdist.values import has_per_replica

if TYPE_CHECKING:
    from jaxdist.strategy.base import Strategy

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing or cannot be read; the message names it and the usable ones."""


def _abstract(target: PyTree, strategy: "Strategy | None") -> PyTree:
    """Shapes, dtypes and the shardings to restore into (the target strategy's, if given).

    Without a strategy each leaf keeps the sharding it has (a ``jax.Array`` or a
    ``ShapeDtypeStruct`` with one), else goes to this process's first device.
    """
    if strategy is not None:
        shardings = strategy.layout.state_shardings(target)
    else:
        local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def own(x):
            s = getattr(x, "sharding", None)
            return s if isinstance(s, jax.sharding.Sharding) else local

        shardings = jax.tree.map(own, target)

    def abstract(x, s):
        shape = x.shape if hasattr(x, "shape") else np.shape(x)
        dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=s)

    return jax.tree.map(abstract, target, shardings)


class CheckpointManager:
    """Saves and restores train states with Orbax (async by default).

    Args:
      directory: where steps are written (``<directory>/<step>/``); created if missing.
      max_to_keep: checkpoints kept (the others are deleted after a successful save): the newest,
        or with ``best_metric`` the best ones.
      async_save: write in the background; ``save`` returns once the device arrays are copied.
      best_metric: keep the ``max_to_keep`` checkpoints with the best value of this metric (passed
        to ``save(metrics=...)``) instead of the newest; steps saved without it are kept too.
      best_mode: ``"min"`` or ``"max"``: which values of ``best_metric`` are better.

    >>> import tempfile, jax.numpy as jnp
    >>> with tempfile.TemporaryDirectory() as d:
    ...     mgr = CheckpointManager(d, async_save=False)
    ...     _ = mgr.save(3, {"w": jnp.arange(3.0)})
    ...     mgr.latest_step(), mgr.restore(target={"w": jnp.zeros(3)})["w"].tolist()
    (3, [0.0, 1.0, 2.0])
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = True, best_metric: str | None = None, best_mode: str = "min"):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={best_mode!r}; expected 'min' or 'max'")
        self.directory = os.path.abspath(os.fspath(directory))
        self.best_metric = best_metric
        best = {} if best_metric is None else dict(
            best_fn=lambda metrics: float(metrics[best_metric]), best_mode=best_mode,
            keep_checkpoints_without_metrics=True)
        self._mgr = ocp.CheckpointManager(
            self.directory,
            # Handlers named up front, so that reading metadata (a template-free restore, a
            # side-car evaluator) works on a manager that has not saved anything itself.
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=async_save, **best))

    def save(self, step: int, state: PyTree, *, data_iterator: Any = None,
             data_state: dict | None = None, metadata: dict | None = None,
             metrics: dict[str, float] | None = None, force: bool = True) -> bool:
        """Writes ``state`` (and the iterator position) as checkpoint ``step``; all processes call it.

        Args:
          step: the step number (the checkpoint's name).
          state: a pytree of arrays, laid out however the running strategy placed it.
          data_iterator: a ``DistributedIterator`` (or anything with ``state() -> dict``).
          data_state: the input position as a dict, instead of ``data_iterator``.
          metadata: small JSON-serialisable extras.
          metrics: scalar metrics of this step; with ``best_metric`` they decide what is kept.

        Returns:
          Whether a save was started.
        """
        if has_per_replica(state):
            raise TypeError(
                "CheckpointManager.save got per-replica values (the state returned by strategy.run); "
                "save one copy that restores on any device count: "
                "mgr.save(step, strategy.to_mirrored(state))")
        if data_state is None and data_iterator is not None:
            data_state = data_iterator.state()
        meta = {"step": int(step), "data": data_state,
                "user": metadata or {}}
        if self.best_metric is not None and metrics is not None and self.best_metric not in metrics:
            raise ValueError(f"save(metrics={sorted(metrics)}) lacks best_metric "
                             f"{self.best_metric!r}, which decides the checkpoints kept")
        metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        return self._mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force,
            metrics=metrics)

    def reload(self) -> None:
        """Re-reads the directory (steps another process wrote since this manager was made)."""
        self._mgr.reload()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def _check_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}; save one first, or check "
                                      "the directory (a save that crashed midway is not listed)")
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available "
                                  f"steps: {steps or 'none'}")
        return step

    def restore(self, step: int | None = None, *, target: PyTree = None,
                strategy: "Strategy | None" = None) -> PyTree:
        """Reads checkpoint ``step`` (the latest when None) into arrays shaped like ``target``.

        Args:
          target: a pytree with the structure, shapes and dtypes of the saved state (a freshly
            initialised state, or its ``jax.ShapeDtypeStruct``\\ s); its values are not used.
            ``None`` rebuilds the tree from the checkpoint's own metadata: nested dicts and lists
            of arrays (a flax ``TrainState`` comes back as ``{"params": ..., "opt_state": ...,
            "step": ...}``), enough for inference (``apply_fn({"params": tree["params"]}, x)``).
          strategy: place the result the way this strategy places state. It need not be the one
            that saved: a checkpoint written by 2 processes × 2 devices restores on 1 × 8 or on 1.

        Raises:
          CheckpointError: no such step, or its files are corrupt / do not match ``target`` (the
            message lists the other steps, which stay usable).
        """
        step = self._check_step(step)
        try:
            if target is None:
                target = self._saved_tree(step)
            out = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target, strategy))))
        except Exception as e:  # orbax/tensorstore raise many types; name the step either way
            others = [s for s in self.all_steps() if s != step]
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be restored: "
                f"{type(e).__name__}: {str(e)[:500]}. Check that `target` has the saved state's "
                f"structure, shapes and dtypes; if this step's files are damaged, restore another "
                f"one (steps you can restore: {others or 'none'})") from e
        return out["state"]

    def _saved_tree(self, step: int) -> PyTree:
        """Shapes and dtypes of the state saved at ``step``, from Orbax's tree metadata."""
        tree = self._mgr.item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)

        def leaf(m):
            dtype = np.dtype(m.dtype)
            if dtype.itemsize == 8 and not jax.config.jax_enable_x64:  # a Python int step counter
                dtype = np.dtype(dtype.kind + "4")
            return jax.ShapeDtypeStruct(tuple(m.shape), dtype)

        return jax.tree.map(leaf, tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))

    def metadata(self, step: int | None = None) -> dict:
        """``{"step", "data" (iterator state or None), "user"}`` saved with checkpoint ``step``."""
        step = self._check_step(step)
        try:
            return dict(self._mgr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"])
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: metadata cannot be "
                                  f"read ({type(e).__name__}: {e})") from e

    def wait_until_finished(self) -> None:
        """Blocks until background writes are durable (call before exiting)."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
