"""Checkpoints over Orbax: every process writes its shards, restores reshard onto any strategy.

A checkpoint holds the train state (arrays, including any RNG key data kept in it), the step, and
the input iterator's position, so that a run killed and resumed continues from exactly the next
batch. Orbax writes each step into a temporary directory and renames it only once every process has
finished, so a crash mid-save never leaves a step that restores as valid. Each step also records a
digest of every array and a checksum of its metadata, checked on restore, so a file damaged later
(a flipped bit, a truncated copy) raises ``CheckpointError`` instead of restoring other values;
restoring "the latest" falls back past such steps to the newest intact one.

Multi-process contract: every process constructs the manager with the same directory and calls
``save`` / ``restore`` / ``wait_until_finished`` for the same steps (they synchronise internally).

One job owns a directory: the first ``save`` takes an exclusive ``flock`` on
``<directory>/.jaxdist-owner.lock`` (process 0 takes it for the whole job, and writes its pid, host
and command line there), held until ``close()`` or until the process ends, however it ends, so a
crashed owner never leaves the directory stuck. A second job's first ``save`` raises
``CheckpointError`` naming the owner. Reading (``restore``, ``metadata``, a side-car evaluator)
needs no claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.checkpoint._digest import dispatch_digests, path_name, tree_digests
from jaxdist.checkpoint._integrity import (
    CompleteSteps,
    DigestsHandler,
    DigestsRestore,
    DigestsSave,
    Pending,
    meta_checksum,
)
from jaxdist.core import PyTree
from jaxdist.core.values import has_per_replica, is_static_leaf, join_static, split_static

if TYPE_CHECKING:
    from jaxdist.strategy.base import Strategy

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing or cannot be read; the message names it and the usable ones."""


class CheckpointMismatchError(CheckpointError):
    """The restore ``target`` differs from what the step holds (dtype, shape or structure).

    Not damage: the step is intact, so ``restore_latest`` raises this at once instead of
    skipping good steps as corrupt. The message lists what differs.
    """


def _leaf_specs(tree: PyTree) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    is_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        dtype = x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)
        # 64-bit values saved without x64 restore into their 32-bit twins: not a difference
        out[path_name(path)] = (shape, np.dtype(jax.dtypes.canonicalize_dtype(dtype)))
    return out


def _differences(saved: PyTree, target: PyTree, limit: int = 6) -> list[str]:
    """What differs between the saved tree's metadata and a restore target, in words."""
    want, have = _leaf_specs(saved), _leaf_specs(target)
    out = []
    only_saved = sorted(set(want) - set(have))
    only_target = sorted(set(have) - set(want))
    if only_saved or only_target:
        out.append(f"structure: the checkpoint has leaves {only_saved[:limit]} the target lacks, "
                   f"the target has {only_target[:limit]} the checkpoint lacks")
    for k in sorted(set(want) & set(have)):
        (ws, wd), (hs, hd) = want[k], have[k]
        if wd != hd:
            out.append(f"{k}: dtype {wd.name} in the checkpoint, {hd.name} in the target")
        if ws != hs:
            out.append(f"{k}: shape {ws} in the checkpoint, {hs} in the target")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _abstract(target: PyTree, strategy: "Strategy | None", full: PyTree = None) -> PyTree:
    """Shapes, dtypes and the shardings to restore into (the target strategy's, if given).

    Without a strategy each leaf keeps the sharding it has (a ``jax.Array`` or a
    ``ShapeDtypeStruct`` with one), else goes to this process's first device.
    """
    if strategy is not None:
        if full is None:
            shardings = strategy.layout.state_shardings(target)  # type: ignore[attr-defined]
        else:  # target is full's array leaves: their places are decided on the whole state
            shardings = [sh for x, sh in zip(jax.tree.leaves(full),
                                             jax.tree.leaves(strategy.layout.state_shardings(full)))  # type: ignore[attr-defined]
                         if not is_static_leaf(x)]
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


class Restored(NamedTuple):
    """What ``CheckpointManager.restore_latest`` returns: the step it read, the state and the
    metadata saved with it (``{"step", "data", "user"}``)."""

    step: int
    state: PyTree
    metadata: dict


OWNER_FILE = ".jaxdist-owner.lock"
# directory -> [open lock file, managers of this process using it]; one job's process may run
# several managers on one directory (a callback's and the user's), they share the claim.
_CLAIMS: dict[str, list] = {}
_CLAIMS_LOCK = threading.Lock()


def _owner_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "job": os.environ.get("JAXDIST_COORDINATOR") or os.environ.get("SLURM_JOB_ID"),
            "argv": " ".join(sys.argv)[:200], "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _claim(directory: str) -> str | None:
    """Takes this process's claim on ``directory`` (an ``flock`` on its owner file, which the
    kernel drops when the process ends, however it ends); returns None, or the error text
    naming the owner when another process holds it."""
    with _CLAIMS_LOCK:
        if directory in _CLAIMS:
            _CLAIMS[directory][1] += 1
            return None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, OWNER_FILE)
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            owner = fh.read(500).strip() or "unknown (no owner record)"
            fh.close()
            return (f"checkpoint directory {directory} is owned by another running job: {owner}. "
                    "Two jobs writing one directory overwrite each other's steps; give this job "
                    "its own directory, or stop the other one (its claim ends with its process, "
                    "even when that process crashed)")
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(_owner_record()) + "\n")
        fh.flush()
        _CLAIMS[directory] = [fh, 1]
        return None


def _release(directory: str) -> None:
    with _CLAIMS_LOCK:
        entry = _CLAIMS.get(directory)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _CLAIMS[directory]
            with contextlib.suppress(OSError):
                fcntl.flock(entry[0], fcntl.LOCK_UN)
            entry[0].close()


def _array_part(tree: PyTree) -> tuple[PyTree, Any]:
    """A state with static leaves (an Equinox module's functions, say) as the list of its array
    leaves, which is what is saved, and what ``join_static`` needs to put it back; other states
    as they are."""
    if tree is None:
        return tree, None
    arrays, treedef, statics = split_static(tree)
    return (tree, None) if not statics else (arrays, (treedef, statics))


def _all_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective when there are several)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


# What JAX, gloo and the coordination service say when a process of the job is gone: a save's
# barrier (or a collective inside it) then fails on the survivors.
_PEER_GONE = re.compile(
    r"Gloo|Connection (?:reset|closed) by peer|DEADLINE_EXCEEDED|UNAVAILABLE|Barrier timed out|"
    r"unhealthy|stopped sending heartbeats|heartbeat|coordination service|"
    r"task:\d+[^\n]{0,80}(?:died|disconnected|not found|shut ?down)", re.I)


def _peer_failure(error: BaseException) -> str | None:
    """The words that say a save failed because a peer process is gone (None: another cause).

    >>> _peer_failure(RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: save_7"))
    'DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: save_7'
    >>> _peer_failure(OSError(28, "No space left on device")) is None
    True
    """
    seen = 0
    while error is not None and seen < 8:  # the error and what it was raised from
        text = str(error)
        if _PEER_GONE.search(text):
            return text.strip().splitlines()[0][:200]
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


class CheckpointManager:
    """Saves and restores train states with Orbax (async by default), verifying what it reads.

    Every save records a digest of each array of the state (computed from the global value, so it
    does not depend on the sharding; see ``jaxdist.checkpoint._digest``) and a checksum of its metadata.
    A restore recomputes the digests of what it read, on whatever devices it restores to, and
    raises ``CheckpointError`` naming the step if any differs: a flipped bit in a file never
    restores silently. ``restore()`` without a step, ``restore_latest`` and ``latest_step`` fall
    back to the newest step that is intact, logging a warning naming each step they skip.

    Args:
      directory: where steps are written (``<directory>/<step>/``); created if missing.
      max_to_keep: checkpoints kept (the others are deleted after a successful save): the newest,
        or with ``best_metric`` the best ones.
      async_save: write in the background; ``save`` returns once the device arrays are copied.
      best_metric: keep the ``max_to_keep`` checkpoints with the best value of this metric (passed
        to ``save(metrics=...)``) instead of the newest; steps saved without it are kept too.
      best_mode: ``"min"`` or ``"max"``: which values of ``best_metric`` are better.
      verify: write digests on save and check them on restore (about 1 s per GB of state on
        2 loaded CPU cores; benchmarks/checkpoint.py). Steps written without them restore unverified.

    >>> import tempfile, jax.numpy as jnp
    >>> with tempfile.TemporaryDirectory() as d:
    ...     mgr = CheckpointManager(d, async_save=False)
    ...     _ = mgr.save(3, {"w": jnp.arange(3.0)})
    ...     mgr.latest_step(), mgr.restore(target={"w": jnp.zeros(3)})["w"].tolist()
    (3, [0.0, 1.0, 2.0])
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = True, best_metric: str | None = None, best_mode: str = "min",
                 verify: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={best_mode!r}; expected 'min' or 'max'")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            # else Orbax fails at the first save or restore, deep in a traceback
            raise ValueError(f"checkpoint directory {os.fspath(directory)!r} is a file, not a "
                             "directory; pass a directory (it is created if missing)")
        self.best_metric = best_metric
        self.verify = verify
        self._async = async_save
        self._names = CompleteSteps(self.directory)
        best = {} if best_metric is None else dict(
            best_fn=lambda metrics: float(metrics[best_metric]), best_mode=best_mode,
            keep_checkpoints_without_metrics=True)
        self._mgr = ocp.CheckpointManager(
            self.directory,
            # Handlers named up front, so that reading metadata (a template-free restore, a
            # side-car evaluator) works on a manager that has not saved anything itself.
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler(), "digests": DigestsHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=async_save,
                                                 step_name_format=self._names, **best))
        self._pending: int | None = None  # the step an async save is writing
        self._failed = False
        self._owner: weakref.finalize | None = None  # this job's claim on the directory
        self._damaged: set[int] = set()  # steps a restore skipped as unreadable or corrupt

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

        Raises:
          TypeError: ``state`` holds per-replica values (save ``strategy.to_mirrored(state)``).
          ValueError: ``metrics`` lacks ``best_metric``.
          CheckpointError: another running job owns the directory (the message names it), or
            this save, or the previous asynchronous one, failed (a full disk, say);
            the steps on disk stay listed and restorable.
        """
        if self._owner is None:
            self._take_ownership()
        if int(step) in self._damaged:
            self._move_aside(int(step))
        if has_per_replica(state):
            raise TypeError(
                "CheckpointManager.save got per-replica values (the state returned by strategy.run); "
                "save one copy that restores on any device count: "
                "mgr.save(step, strategy.to_mirrored(state))")
        state, _ = _array_part(state)  # an Equinox module's functions are not saved
        if self.best_metric is not None and metrics is not None and self.best_metric not in metrics:
            raise ValueError(f"save(metrics={sorted(metrics)}) lacks best_metric "
                             f"{self.best_metric!r}, which decides the checkpoints kept")
        metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        if data_state is None and data_iterator is not None:
            data_state = data_iterator.state()
        meta = {"step": int(step), "data": data_state, "user": metadata or {},
                "digested": self.verify}
        meta["checksum"] = meta_checksum(meta)
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        pending = Pending()
        if self.verify:
            items["digests"] = DigestsSave(pending)
            if not self._async:  # Orbax writes the items before save() returns
                pending.set(dispatch_digests(state))
        try:
            with self._failures(f"saving checkpoint step {step}"):
                started = self._mgr.save(int(step), args=ocp.args.Composite(**items), force=force,
                                         metrics=metrics)
            if started and self.verify and self._async:
                # Computed on the devices while Orbax writes the arrays in the background.
                pending.set(dispatch_digests(state))
        except BaseException as e:  # never leave Orbax's background commit waiting for them
            pending.set(e)
            raise
        self._pending = int(step) if started else self._pending
        return started

    def _take_ownership(self) -> None:
        """Claims the directory for this job before its first save (process 0 claims for the
        job; every process agrees on the outcome, so all of them raise or none does)."""
        error = _claim(self.directory) if jax.process_index() == 0 else None
        if not _all_agree(error is None):
            raise CheckpointError(error or f"checkpoint directory {self.directory} is owned by "
                                  "another running job (process 0 of this job names it)")
        # released on close(), or when this manager is garbage-collected
        self._owner = weakref.finalize(self, _release, self.directory) if \
            jax.process_index() == 0 else weakref.finalize(self, lambda: None)

    def _move_aside(self, step: int) -> None:
        """Renames damaged step ``step`` out of the way of a new save of the same step.

        A resume that fell back past it retrains to that step; Orbax would refuse the save
        (``StepAlreadyExistsError``) on every restart. Kept, not deleted: it may be inspected.
        """
        self._damaged.discard(step)
        name = self._names.build_name(step)
        src = os.path.join(self.directory, name)
        dst = os.path.join(self.directory, f"damaged-step-{name}-{int(time.time())}")
        error = None
        if jax.process_index() == 0 and os.path.isdir(src):
            try:
                os.rename(src, dst)
                logger.warning("moved damaged checkpoint step %d aside to %s before saving "
                               "step %d again", step, dst, step)
            except OSError as e:
                error = e
        if not _all_agree(error is None):  # every process waits for the rename
            raise CheckpointError(f"damaged checkpoint step {step} in {self.directory} could not be "
                                  f"moved aside ({error or 'on process 0'}); remove {src} and rerun")
        self._mgr.reload()

    @contextlib.contextmanager
    def _failures(self, what: str):
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            # Orbax drops the failed step, and with max_to_keep the ones it meant to delete after
            # it, from its cached list; the directory is the truth.
            pending = (f" (or the asynchronous save of step {self._pending} before it)"
                       if self._pending is not None and f"step {self._pending}" not in what else "")
            self._mgr.reload()
            self._failed, self._pending = True, None
            peer = _peer_failure(e)
            if peer:  # not the disk: a save's cross-process barrier, whose peer is gone
                logger.debug("%s failed", what, exc_info=e)
                raise CheckpointError(
                    f"{what}{pending} failed because a collective across processes failed: a "
                    f"peer process died or stopped responding ({peer}); the steps on disk stay "
                    f"restorable ({self.all_steps() or 'none'}), and a restarted job resumes "
                    "from them or from memory") from None
            raise CheckpointError(
                f"{what}{pending} failed: {type(e).__name__}: {str(e)[:500]}. Steps on disk, "
                f"still restorable: {self.all_steps() or 'none'}. Check free space and "
                f"permissions in {self.directory}") from e

    def step_name(self, step: int) -> str:
        """The name of step ``step``'s folder inside ``directory``."""
        return self._names.build_name(step)

    def reload(self) -> None:
        """Re-reads the directory (steps another process wrote since this manager was made)."""
        self._mgr.reload()

    def all_steps(self) -> list[int]:
        """Steps whose directories a completed save left, read from the directory on each call."""
        return sorted(m.step for m in self._names.find_all(self.directory))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint whose metadata reads and verifies, or None.

        Steps that are incomplete (a stray empty directory) or whose metadata is damaged are
        skipped with a warning naming them. Array files are only verified by ``restore``: a step
        can pass here and still fail there, and ``restore()`` then falls back further.
        """
        for step in reversed(self.all_steps()):
            try:
                self.metadata(step)
                return step
            except CheckpointError as e:
                logger.warning("skipping checkpoint step %d: %s", step, e)
        return None

    def _check_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}; save one first, or "
                                      "check the directory (a save that crashed midway is not "
                                      "listed)")
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available "
                                  f"steps: {steps or 'none'}")
        return step

    def restore(self, step: int | None = None, *, target: PyTree = None,
                strategy: "Strategy | None" = None) -> PyTree:
        """Reads checkpoint ``step`` (the newest intact one when None) into arrays like ``target``.

        Args:
          step: the step to read; None reads the newest step that restores intact, skipping (with
            a warning naming them) newer ones that are incomplete or corrupt.
          target: a pytree with the structure, shapes and dtypes of the saved state (a freshly
            initialised state, or its ``jax.ShapeDtypeStruct``\\ s); its values are not used.
            ``None`` rebuilds the tree from the checkpoint's own metadata: nested dicts and lists
            of arrays (a flax ``TrainState`` comes back as ``{"params": ..., "opt_state": ...,
            "step": ...}``), enough for inference (``apply_fn({"params": tree["params"]}, x)``).
          strategy: place the result the way this strategy places state. It need not be the one
            that saved: a checkpoint written by 2 processes × 2 devices restores on 1 × 8 or on 1.

        Returns:
          The restored state.

        Raises:
          CheckpointMismatchError: ``target`` differs from the saved state in dtype, shape or
            structure (the message lists the differences; the step is not damaged).
          CheckpointError: no such step, or its files are corrupt (a digest differs); the
            message names the step and lists the other steps.
        """
        if step is None:
            return self.restore_latest(target=target, strategy=strategy, _required=True).state
        return self._restore(self._check_step(step), target, strategy)

    def restore_latest(self, *, target: PyTree = None, strategy: "Strategy | None" = None,
                       _required: bool = False) -> Restored | None:
        """The newest step that restores intact, with its state and metadata; None if no steps.

        Newer steps that are incomplete, corrupt or unreadable are skipped with a warning naming
        each. Every process must call it (it agrees with the others on which step succeeded).

        Args:
          target, strategy: as for ``restore``.

        Returns:
          ``Restored(step, state, metadata)``, or None when the directory holds no checkpoint.

        Raises:
          CheckpointMismatchError: the newest intact step does not fit ``target`` (dtype, shape
            or structure); older steps are not tried, and none is reported corrupt.
          CheckpointError: there are steps, but none restores (the message gives each one's error).

        >>> import tempfile, jax.numpy as jnp
        >>> with tempfile.TemporaryDirectory() as d:
        ...     mgr = CheckpointManager(d, async_save=False)
        ...     _ = mgr.save(5, {"w": jnp.ones(2)})
        ...     os.mkdir(os.path.join(d, "99"))   # stray: ignored, with a warning
        ...     r = mgr.restore_latest(target={"w": jnp.zeros(2)})
        ...     r.step, r.state["w"].tolist(), r.metadata["step"]
        (5, [1.0, 1.0], 5)
        """
        steps = self.all_steps()
        if not steps:
            if _required:
                self._check_step(None)
            return None
        errors = []
        for step in reversed(steps):
            try:
                meta = self.metadata(step)
                state = self._restore(step, target, strategy)
            except CheckpointMismatchError:
                raise  # the step is intact; an older one would not fit the target either
            except CheckpointError as e:
                errors.append(f"step {step}: {e}")
                self._damaged.add(step)  # a save of this step again moves it aside first
                logger.warning("skipping checkpoint step %d, falling back to an older one: %s",
                               step, e)
                continue
            return Restored(step, state, meta)
        raise CheckpointError(f"none of the checkpoints in {self.directory} restores ("
                              + "; ".join(errors) + "). Check `target`, or move the damaged "
                              "steps away and start from scratch")

    def _restore(self, step: int, target: PyTree, strategy: "Strategy | None") -> PyTree:
        others = [s for s in self.all_steps() if s != step]
        hint = f"steps you can try instead: {others or 'none'}"
        out, error = None, None
        full = target
        target, statics = _array_part(target)  # restored arrays go back beside them at the end
        try:
            if target is None:
                target = self._saved_tree(step)
            abstract = _abstract(target, strategy, full if statics is not None else None)
            out = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:  # orbax/tensorstore raise many types; name the step either way
            error = e
        # Across processes a file may fail on one only: all fall back together, never split.
        ok = _all_agree(error is None)
        if not ok:
            # A target of another shape or structure fails to read: say which, not "damaged".
            self._check_target(step, target)
            msg = (f"{type(error).__name__}: {str(error)[:500]}" if error is not None
                   else "another process could not read its part")
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be restored: {msg}. Check that "
                f"`target` has the saved state's structure, shapes and dtypes; if this step's "
                f"files are damaged, restore another one ({hint})") from error
        if self.verify:
            self._verify(step, out, hint, target)
        return out if statics is None else join_static(*statics, out)  # type: ignore[call-arg]  # (treedef, statics)

    def _check_target(self, step: int, target: PyTree) -> None:
        """Raises ``CheckpointMismatchError`` when ``target`` differs from step's saved tree.

        Compared only on the way to reporting a failure (a read error, a digest mismatch), so
        that a restore that works is never refused by this comparison.
        """
        if target is None:
            return
        try:
            saved = self._mgr.item_metadata(step)["state"]
            saved = getattr(saved, "tree", saved)
            diffs = _differences(saved, target)
        except Exception:  # unreadable metadata: that is for the damage path to report
            return
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} does not match the restore target "
                f"(the step is intact; the target differs): {'; '.join(diffs)}. Pass a target "
                "with the saved structure, shapes and dtypes (cast after restoring), or "
                "target=None to restore the saved tree as it is")

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

    def _verify(self, step: int, state: PyTree, hint: str, target: PyTree = None) -> None:
        if not self.metadata(step).get("digested"):
            logger.info("checkpoint step %d has no digests (written unverified); not checked", step)
            return
        try:
            record = dict(self._mgr.restore(step, args=ocp.args.Composite(
                digests=DigestsRestore()))["digests"])
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: its digests cannot "
                                  f"be read ({type(e).__name__}: {e}); restore another step "
                                  f"({hint})") from e
        saved = record.get("digests")
        if record.get("checksum") != meta_checksum({"digests": saved}):
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is corrupt: its "
                                  f"digest file fails its checksum. Restore another step ({hint})")
        now = tree_digests(state)
        bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if bad:
            # Orbax casts to the target's dtype, so a bfloat16 target digests differently
            # from the float32 it read: that is the target, not damage.
            self._check_target(step, target)
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is corrupt: the arrays read for "
                f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} differ from what was saved "
                f"(digest mismatch; a damaged or altered file). Restore another step ({hint})")

    def metadata(self, step: int | None = None) -> dict:
        """``{"step", "data" (iterator state or None), "user"}`` saved with checkpoint ``step``.

        Raises:
          CheckpointError: no such step, or its metadata is unreadable or fails its checksum.
        """
        step = self._check_step(step)
        try:
            meta = dict(self._mgr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"])
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: metadata cannot be "
                                  f"read ({type(e).__name__}: {e})") from e
        # Required whenever the step was written with digests (which came with checksums): a
        # flipped bit in the key "checksum" must not switch the check off.
        digested = bool(meta.get("digested")) or os.path.isdir(
            os.path.join(self.directory, self._names.build_name(step), "digests"))
        if "checksum" not in meta and digested:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: its metadata "
                                  "lacks its checksum though the step was written with digests "
                                  "(a damaged or altered file); restore another step")
        if "checksum" in meta and meta["checksum"] != meta_checksum(meta):
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: its metadata "
                                  "fails its checksum (a damaged or altered file); restore "
                                  "another step")
        return meta

    def wait_until_finished(self) -> None:
        """Blocks until background writes are durable (call before exiting).

        Raises:
          CheckpointError: the background save failed (a full disk, say), naming its step.
        """
        if self._pending is None and self._failed:
            # Orbax re-raises a failed background save on every wait; it was reported once.
            with contextlib.suppress(Exception):
                self._mgr.wait_until_finished()
            return
        what = (f"saving checkpoint step {self._pending}" if self._pending is not None
                else "a checkpoint save")
        with self._failures(what):
            self._mgr.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Waits for background writes and releases Orbax's threads.

        Raises:
          CheckpointError: a background save failed that was not reported before.
        """
        try:
            self._mgr.close()
        except Exception as e:
            if self._failed:  # already raised to the caller once; don't mask its traceback
                logger.warning("closing %s after a failed save: %s", self.directory, e)
                return
            self._mgr.reload()
            raise CheckpointError(f"a checkpoint save in {self.directory} failed: {e}; steps "
                                  f"on disk: {self.all_steps() or 'none'}") from e
        finally:
            if self._owner is not None:
                self._owner()  # gives the directory back (once)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
