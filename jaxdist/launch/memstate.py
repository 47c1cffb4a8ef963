"""The in-memory state tier: the newest completed steps' state, where a restarted process finds it.

Under ``jaxdist launch`` every process gets ``JAXDIST_STATE_DIR``, a host-local directory in
shared memory (``/dev/shm`` where it exists) that outlives the processes but not the launcher.
After each completed step, a background thread copies the (replicated) train state, the step
number and the input position into ``<dir>/<rank>/step-<N>.npz`` (written to a temporary name and
renamed, so a reader never sees half a file) and touches the rank's heartbeat, which the launcher
reads to detect hung ranks. The two newest steps are kept.

On a restart, :meth:`StateTier.resume` is called by every process: the processes agree (one
all-gather) on the newest step any of them holds, one holder reads it and it reaches the others
through a collective broadcast over the job's own network (JAX's cross-process collectives), so a
process on a new host gets the state from a live peer, never from disk. ``BackupAndRestore`` does
all of this automatically; a custom loop calls ``save`` after each step and ``resume`` at start.

Only data-parallel state is supported here (every leaf fully replicated, or held whole by this
process); a sharded state disables the tier with a warning, leaving the persistent backup.
Files are plain ``.npz`` read with ``allow_pickle=False``: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist.core._types import PyTree
from jaxdist.core.values import is_static_leaf, join_static, split_static

logger = logging.getLogger(__name__)

ENV_STATE_DIR = "JAXDIST_STATE_DIR"
"""The environment variable naming this host's state directory (set by ``jaxdist launch``)."""

_META = "__meta__"
_KEEP = 2


class Snapshot(NamedTuple):
    """A state read back from the memory tier by :meth:`StateTier.resume`.

    Attributes:
      step: the completed step the state belongs to.
      state: the train state, placed like the ``target`` (or the strategy's way).
      data_state: the input position after that step (``{"epoch": E, "position": P}``) or None.
      source: the process that held it (it reached the others over the network).
    """

    step: int
    state: PyTree
    data_state: dict | None
    source: int


def heartbeat_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` reports its completed steps (``"<step> <unix time>"``)."""
    return os.path.join(directory, str(rank), "heartbeat")


def read_heartbeat(directory: str, rank: int | str) -> int | None:
    """The last completed step ``rank`` reported, or None if it reported none.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> read_heartbeat(d, 0) is None
    True
    >>> _write_atomic(heartbeat_path(d, 0), b"7 0")
    >>> read_heartbeat(d, 0)
    7
    """
    try:
        with open(heartbeat_path(directory, rank), "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_path(directory: str) -> str:
    """Where the elastic agent writes the step every process of this host stops at."""
    return os.path.join(directory, "stop")


def write_stop(directory: str, step: int) -> None:
    """Asks every process of this host to stop after ``step`` (read by ``StateTier.stop_step``)."""
    _write_atomic(stop_path(directory), str(int(step)).encode())


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _local_copy(x: Any) -> np.ndarray:
    """A whole copy of a leaf on this host (the leaf is replicated or fully addressable)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _supported(state: PyTree) -> bool:
    return all(not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated
               for x in jax.tree.leaves(state))


@jax.jit
def _copy_tree(tree):
    # A fresh buffer per leaf: the next step donates (and so deletes) the state's own buffers.
    return jax.tree.map(lambda x: x.copy(), tree)


class StateTier:
    """Keeps the newest completed steps' state in host memory; restores it after a restart.

    Args:
      directory: this host's state directory (default: ``$JAXDIST_STATE_DIR``; with neither,
        the tier is disabled and every method is a no-op returning None).
      rank: this process's index (default: ``jax.process_index()``).

    >>> import tempfile, jax.numpy as jnp
    >>> tier = StateTier(tempfile.mkdtemp(), rank=0)
    >>> tier.save(3, {"w": jnp.ones(2)}, {"epoch": 0, "position": 3})
    >>> tier.flush()
    >>> snap = tier.resume({"w": jnp.zeros(2)})
    >>> snap.step, snap.state["w"].tolist(), snap.data_state
    (3, [1.0, 1.0], {'epoch': 0, 'position': 3})
    >>> tier.close()
    """

    def __init__(self, directory: str | None = None, *, rank: int | None = None):
        self.directory = directory if directory is not None else os.environ.get(ENV_STATE_DIR)
        self._rank = rank
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._written = threading.Event()
        self._written.set()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._disabled = self.directory is None
        self.last_written: int | None = None

    @property
    def enabled(self) -> bool:
        """Whether snapshots are kept (a directory is known and the state is supported)."""
        return not self._disabled

    def _my_dir(self) -> str:
        rank = jax.process_index() if self._rank is None else self._rank
        return os.path.join(self.directory, str(rank))

    def beat(self, step: int) -> None:
        """Reports ``step`` as completed to the launcher's hang detector (cheap; any thread)."""
        if self.directory is not None:
            _write_atomic(os.path.join(self._my_dir(), "heartbeat"),
                          f"{int(step)} {time.time():.3f}".encode())

    def save(self, step: int, state: PyTree, data_state: Mapping | None = None) -> None:
        """Snapshots the state after ``step`` (asynchronously; at most one snapshot in flight).

        Call it on every process after each step, before the next step is dispatched. It waits
        for the previous snapshot to be written, so the newest snapshot on disk is never more than
        one step behind the newest completed step.

        Args:
          step: optimizer steps completed.
          state: the train state after that step.
          data_state: the input position after that step (``iterator.state()``).

        Raises:
          RuntimeError: writing an earlier snapshot failed.
        """
        if self._disabled:
            return
        if not _supported(state):
            logger.warning("the in-memory state tier needs a data-parallel (replicated) state; "
                           "this one is sharded, so recovery uses the persistent backup only")
            self._disabled = True
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="jaxdist-memstate",
                                            daemon=True)
            self._thread.start()
        self._written.wait()
        if self._error is not None:
            raise RuntimeError(f"the in-memory state tier failed to write: {self._error}")
        copy = _copy_tree(_arrays(state))  # may raise: before clear(), or close() would hang
        self._written.clear()
        self._queue.put((int(step), copy, None if data_state is None else dict(data_state)))

    def stop_step(self) -> int | None:
        """The step at which the elastic agent asked the job to stop (to re-form), or None.

        The agent writes it to ``<dir>/stop``; every process reads it after each step (a
        ``stat``, plus a read when it changes).
        """
        if self.directory is None:
            return None
        path = stop_path(self.directory)
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return None
        if mtime != getattr(self, "_stop_mtime", None):
            try:
                with open(path, "rb") as f:
                    self._stop_step = int(f.read())
            except (OSError, ValueError):
                return None
            self._stop_mtime = mtime
        return self._stop_step

    def flush(self) -> None:
        """Waits until the newest snapshot is written."""
        self._written.wait()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, copy, data = item
            try:
                leaves = [_local_copy(x) for x in jax.tree.leaves(copy)]  # waits for the step
                del copy
                self._write(step, leaves, data)
                self.beat(step)
                self.last_written = step
            except BaseException as e:  # noqa: BLE001 - reported by the next save()
                self._error = e
            finally:
                self._written.set()

    def _write(self, step: int, leaves: list[np.ndarray], data: dict | None) -> None:
        directory = self._my_dir()
        os.makedirs(directory, exist_ok=True)
        meta = json.dumps({"step": step, "data": data, "num_leaves": len(leaves)}).encode()
        arrays = {f"leaf{i:05d}": a for i, a in enumerate(leaves)}
        arrays[_META] = np.frombuffer(meta, np.uint8)
        path = os.path.join(directory, f"step-{step}.npz")
        tmp = f"{path}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
        for old in _steps_in(directory)[:-_KEEP]:
            try:
                os.remove(os.path.join(directory, f"step-{old}.npz"))
            except FileNotFoundError:
                pass

    def newest_local(self) -> tuple[int, str] | None:
        """The newest readable snapshot on this host (any rank's): ``(step, path)`` or None."""
        if self.directory is None or not os.path.isdir(self.directory):
            return None
        found = []
        for rank in os.listdir(self.directory):
            sub = os.path.join(self.directory, rank)
            if os.path.isdir(sub):
                found += [(s, os.path.join(sub, f"step-{s}.npz")) for s in _steps_in(sub)]
        return max(found, default=None)

    def resume(self, target: PyTree, strategy=None) -> Snapshot | None:
        """Every process: the newest step any process holds, with its state; None if none.

        Collective: call it on every process of the job at the same point (start of training).

        Args:
          target: a state with the saved one's structure, shapes and dtypes (values unused).
          strategy: place the result the strategy's way (default: like ``target``).

        Returns:
          A :class:`Snapshot`, or None when no process holds one (or the tier is disabled).
        """
        if self.directory is None or not _supported(target):
            return None
        local = self.newest_local()
        tleaves, treedef, statics = split_static(target)
        loaded = None
        if local is not None:
            try:
                loaded = _load(local[1], tleaves)
            except (OSError, ValueError, KeyError) as e:
                logger.warning("in-memory snapshot %s unreadable (%s); ignoring it", local[1], e)
        mine = loaded[0] if loaded is not None else -1
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            steps = np.asarray(multihost_utils.process_allgather(np.int64(mine))).reshape(-1)
        else:
            steps = np.array([mine])
        best = int(steps.max())
        if best < 0:
            return None
        everyone = bool(np.all(steps == best))
        if everyone:  # every process holds it: no broadcast needed
            source = jax.process_index()
            _, leaves, data = loaded
        else:
            source = int(np.argmax(steps))
            leaves, data = _from_source(loaded, tleaves, jax.process_index() == source)
        # static leaves (an Equinox module's functions) go back in place
        state = join_static(treedef, statics, [np.asarray(x) for x in leaves])
        state = strategy.put(state) if strategy is not None else _like(state, target)
        if everyone:
            logger.info("resuming from step %d held in memory by every process", best)
        else:
            logger.info("resuming from step %d held in memory by process %d", best, source)
        return Snapshot(best, state, data, source)

    def close(self) -> None:
        """Writes the pending snapshot and stops the writer thread."""
        if self._thread is not None:
            self._written.wait()
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _arrays(tree: PyTree) -> list:
    return split_static(tree)[0]


def _from_source(loaded: tuple | None, tleaves: list, is_source: bool) -> tuple[list, dict | None]:
    """The source process's snapshot leaves and input position, on every process (a broadcast
    over the job's network: a process without the step gets it from the one that has it)."""
    if is_source:
        _, leaves, data = loaded
    else:
        leaves = [np.zeros(np.shape(t), _dtype(t)) for t in tleaves]
        data = None
    position = np.array([-1, -1] if data is None else [data["epoch"], data["position"]],
                        np.int64)
    from jax.experimental import multihost_utils

    leaves, position = multihost_utils.broadcast_one_to_all((leaves, position),
                                                            is_source=is_source)
    position = [int(v) for v in np.asarray(position)]
    return leaves, None if position[0] < 0 else {"epoch": position[0], "position": position[1]}


def _dtype(x: Any):
    # A Python scalar leaf (a fresh TrainState's step is 0) becomes JAX's default dtype in a step.
    return x.dtype if hasattr(x, "dtype") else jax.dtypes.canonicalize_dtype(np.result_type(x))


def _like(state: PyTree, target: PyTree) -> PyTree:
    def place(x, t):
        if isinstance(t, jax.Array) and not is_static_leaf(x):
            return jax.device_put(x, t.sharding)
        return x
    return jax.tree.map(place, state, target)


def _steps_in(directory: str) -> list[int]:
    steps = []
    for name in os.listdir(directory):
        if name.startswith("step-") and name.endswith(".npz") and ".tmp" not in name:
            try:
                steps.append(int(name[5:-4]))
            except ValueError:
                pass
    return sorted(steps)


def _load(path: str, tleaves: list) -> tuple[int, list[np.ndarray], dict | None]:
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(f[_META].tobytes().decode())
        leaves = [f[f"leaf{i:05d}"] for i in range(meta["num_leaves"])]
    if len(leaves) != len(tleaves) or any(
            np.shape(a) != np.shape(t) or a.dtype != _dtype(t) for a, t in zip(leaves, tleaves)):
        raise ValueError("its structure, shapes or dtypes differ from the state being trained")
    return int(meta["step"]), leaves, meta["data"]
