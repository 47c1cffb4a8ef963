"""Per-process input: the auto-shard policy, sources that expose shards, and ending an epoch together.

When each process reads only its own share of the data (``AutoShardPolicy.FILE`` / ``OFF``, or
``strategy.distribute_datasets_from_function``), the processes' pipelines may run out at different
steps. A global batch needs every process, so a process whose pipeline has ended keeps contributing
rows that the mask marks as padding, until *every* pipeline has ended (tf.distribute all-reduces
"does any worker still have data" for the same reason). Processes agree on that step by step through
JAX's distributed key-value store: each publishes how many real rows it holds and reads the others'
counts, with a deadline, so a missing or failed process is named instead of hanging the job. The
counts also give the number of real rows in the global batch without a device round-trip.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np

from jaxdist.core import PyTree
from jaxdist.core.layout import Layout, check_batch_leaves

__all__ = ["AutoShardPolicy", "FileSource", "InputSyncTimeoutError", "ShardableSource"]

logger = logging.getLogger(__name__)

_KV_PREFIX = "jaxdist/input"
_stream_ids = itertools.count()  # every process creates its synced datasets in the same order


class AutoShardPolicy(enum.Enum):
    """How ``strategy.distribute`` splits an *iterable* source between processes.

    The meanings are tf's ``tf.data.experimental.AutoShardPolicy``:

    - ``AUTO``: ``FILE`` when the source exposes shards (a ``ShardableSource`` such as
      ``jaxdist.FileSource``), ``DATA`` otherwise.
    - ``FILE``: process ``p`` of ``P`` reads only the shards ``p, p + P, ...`` (``source.shard(p, P)``),
      and its rows are regrouped into its share of each global batch. Needs at least ``P`` shards.
    - ``DATA``: every process reads the whole stream of global batches and keeps its rows of each
      (each process reads everything; a batch keeps the rows it was read with).
    - ``OFF``: no sharding: each process's iterable is its own input, regrouped into its share of
      each global batch. Identical streams on every process mean each example is used once per
      process, as in tf; use it for sources that are already split per process.

    With one process every policy reads the whole source once. In-memory arrays are always split by
    rows without reading anything twice (``AUTO`` / ``DATA``).

    >>> AutoShardPolicy("file") is AutoShardPolicy.FILE
    True
    """

    AUTO = "auto"
    FILE = "file"
    DATA = "data"
    OFF = "off"

    @classmethod
    def _missing_(cls, value: object):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        return None


@runtime_checkable
class ShardableSource(Protocol):
    """A source that can hand out a part of itself: what ``AutoShardPolicy.FILE`` reads."""

    def shard(self, index: int, count: int) -> Iterable:
        """The batches of shard ``index`` of ``count`` (each shard's files read by one process)."""


@dataclasses.dataclass(frozen=True)
class FileSource:
    """A dataset stored as files: ``read(path)`` yields the batches of one file.

    Iterating it reads every file in order; ``shard(index, count)`` reads ``paths[index::count]``,
    which is how ``AutoShardPolicy.FILE`` (and ``AUTO``) gives each process its own files.

    Args:
      paths: the files, in a fixed order (the same on every process).
      read: ``path -> iterable of batches`` (each a pytree of arrays with a common leading axis).

    >>> src = FileSource(("a", "b", "c"), lambda p: [(np.array([ord(p)]),)])
    >>> [int(b[0][0]) for b in src.shard(1, 2)]
    [98]
    """

    paths: Sequence[str]
    read: Callable[[str], Iterable]

    def __post_init__(self):
        paths = tuple(self.paths) if not isinstance(self.paths, str) else None
        if not paths or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"FileSource(paths=...) needs a non-empty sequence of str paths, got "
                             f"{self.paths!r}")
        if not callable(self.read):
            raise TypeError(f"FileSource(read=...) must be callable as read(path), got "
                            f"{type(self.read).__name__}")
        object.__setattr__(self, "paths", paths)

    def __iter__(self) -> Iterator:
        for path in self.paths:
            yield from self.read(path)

    def shard(self, index: int, count: int) -> Iterable:
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} is not in [0, {count})")
        if count > len(self.paths):
            raise ValueError(
                f"AutoShardPolicy.FILE gives each of {count} input pipelines its own files, but the "
                f"source has only {len(self.paths)}; split the data into at least {count} files, or "
                "use AutoShardPolicy.DATA (every process reads everything and keeps its rows)")
        return FileSource(self.paths[index::count], self.read)


class InputSyncTimeoutError(TimeoutError):
    """Processes' input pipelines did not report a step in time (a missing or stalled process)."""


class InputSyncCancelled(Exception):
    """The iterator waiting for the other processes was closed."""


def pipelines(layout: Layout) -> tuple[tuple[int, ...], int]:
    """The processes whose devices the mesh spans (one input pipeline each), and this one's index."""
    peers = tuple(sorted({d.process_index for d in layout.mesh.devices.flat}))
    return peers, peers.index(jax.process_index())


def new_stream_name() -> str:
    return str(next(_stream_ids))


class StepSync:
    """Exchanges, for each step, how many real rows every input pipeline holds.

    One process (or a mesh within one process) needs no exchange. Otherwise every process of
    ``peers`` publishes ``"<count> <width>"`` under ``<prefix>/<name>/<process>/<chunk>/<i>`` (step
    ``chunk * 32 + i``) and reads the other processes' entries, all within ``timeout_s`` per step:
    one write and one read per other process per step. A process deletes its own chunk ``c - 2``
    when it starts chunk ``c`` (one deletion per 32 steps): by then every process has read it.
    """

    _CHUNK = 32

    def __init__(self, name: str, peers: Sequence[int], timeout_s: float, *,
                 previous: str | None = None, cancel: threading.Event | None = None):
        self._peers, self._timeout_s = tuple(peers), float(timeout_s)
        self._me = jax.process_index()
        self._dir = f"{_KV_PREFIX}/{name}/"
        # The previous exchange of the same dataset: once every process has reported step 0 of
        # this one, all of them are done reading it, so this process's entries can go.
        self._previous = None if previous is None else f"{_KV_PREFIX}/{previous}/{self._me}/"
        self._cancel = cancel or threading.Event()
        self._client = None
        if len(self._peers) > 1:
            from jax._src import distributed  # the runtime's key-value client lives only here
            self._client = distributed.global_state.client
            if self._client is None:
                raise RuntimeError("the mesh spans several processes but JAX's distributed runtime "
                                   "is not running; call jaxdist.initialize() first")

    def _key(self, p: int, step: int) -> str:
        return f"{self._dir}{p}/{step // self._CHUNK}/{step % self._CHUNK}"

    def exchange(self, step: int, count: int, width: int = 0) -> list[int]:
        """Every pipeline's real-row count at ``step`` (in ``peers`` order)."""
        if self._client is None:
            return [count]
        self._client.key_value_set(self._key(self._me, step), f"{count} {width}")
        chunk, i = divmod(step, self._CHUNK)
        if i == 0 and chunk >= 2:
            self._client.key_value_delete(f"{self._dir}{self._me}/{chunk - 2}/")
        deadline = time.monotonic() + self._timeout_s
        counts, widths = [], {}
        for p in self._peers:
            value = f"{count} {width}" if p == self._me else self._get(p, step, deadline)
            if value.startswith("error"):
                raise RuntimeError(
                    f"the input pipeline of process {p} failed at step {step} "
                    f"({value[6:] or 'no detail'}); see that process's log for the error")
            n, w = (int(v) for v in value.split())
            counts.append(n)
            widths[p] = w
        if step == 0 and self._previous is not None:
            self._client.key_value_delete(self._previous)
        if len(set(widths.values())) > 1:
            raise ValueError(
                f"the input pipelines disagree on the per-replica batch size: {widths} (process: "
                "rows); every process must batch with the same size. Fix: pass global_batch_size= "
                "to distribute_datasets_from_function, or batch with "
                "ctx.get_per_replica_batch_size(global_batch_size)")
        return counts

    def _get(self, p: int, step: int, deadline: float) -> str:
        from jax.errors import JaxRuntimeError

        while True:  # in slices of a second, so that a closed iterator's thread stops soon
            left = deadline - time.monotonic()
            try:
                return self._client.blocking_key_value_get(
                    self._key(p, step), max(1, int(min(left, 1.0) * 1000)))
            except JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                if self._cancel.is_set():
                    raise InputSyncCancelled(f"input step {step}: iterator closed") from None
                if left <= 1.0:
                    missing = [q for q in self._peers if not self._arrived(q, step)]
                    raise InputSyncTimeoutError(
                        f"input step {step}: process(es) {missing} of {list(self._peers)} did not "
                        f"report within {self._timeout_s:g} s whether their input pipelines still "
                        "have data. Every process must iterate the same datasets in the same order "
                        "(a dataset iterated on some processes only waits here); check the missing "
                        "processes' logs, or raise sync_timeout_s for a slow pipeline.") from e

    def _arrived(self, p: int, step: int) -> bool:
        from jax.errors import JaxRuntimeError

        try:
            self._client.key_value_try_get(self._key(p, step))
            return True
        except JaxRuntimeError:
            return False

    def fail(self, step: int, error: BaseException) -> None:
        """Tells the other processes this pipeline failed, so that they stop waiting for it."""
        if self._client is None:
            return
        try:
            self._client.key_value_set(self._key(self._me, step), f"error {type(error).__name__}",
                                       allow_overwrite=True)
        except Exception:  # noqa: BLE001  the original error is the one worth raising
            logger.warning("could not tell the other processes that input step %d failed", step)


class LocalStep(NamedTuple):
    """This process's rows of one global batch, the mask of its real rows, and their count."""

    local: PyTree
    mask: np.ndarray
    real: int


def rows_of(item: Any, what: str) -> int:
    """The rows of one batch read from a source; 0 rows is an error (nothing to pad from)."""
    n = check_batch_leaves(item, 1, what=what)
    if n == 0:
        raise ValueError(f"{what} has 0 examples; every batch must hold at least one (drop empty "
                         "batches at the source, e.g. with a filter after batching)")
    return n


def take(tree: PyTree, idx: np.ndarray) -> PyTree:
    return jax.tree.map(lambda a: np.asarray(a)[idx], tree)


def padded(tree: PyTree, real: int, size: int) -> tuple[PyTree, np.ndarray]:
    """``tree``'s ``real`` rows padded to ``size`` with copies of real rows, and the mask."""
    return take(tree, np.resize(np.arange(real), size)), np.arange(size) < real


def regroup(items: Iterable, local_rows: int) -> Iterator[LocalStep]:
    """Rows of batches of any size, regrouped into blocks of ``local_rows`` (the last one padded)."""
    rows, start, end = None, 0, 0  # rows[start:end] are read and not handed out yet
    for k, item in enumerate(items):
        n = rows_of(item, f"batch {k} read by this process")
        item = jax.tree.map(np.asarray, item)
        rows = item if start == end else jax.tree.map(
            lambda a, b, lo=start, hi=end: np.concatenate([a[lo:hi], b]), rows, item)
        start, end = 0, (end - start) + n
        while end - start >= local_rows:
            yield LocalStep(jax.tree.map(lambda a, lo=start: a[lo:lo + local_rows], rows),
                            np.ones(local_rows, bool), local_rows)
            start += local_rows
    if end > start:
        yield LocalStep(*padded(jax.tree.map(lambda a: a[start:end], rows), end - start,
                                local_rows), end - start)


def per_replica(items: Iterator, num_local: int, size: int) -> Iterator[LocalStep]:
    """One per-replica batch (at most ``size`` rows) for each of ``num_local`` replicas per step.

    As tf's ``distribute_datasets_from_function``: the pipeline is batched per replica and each step
    takes one batch per local replica. Short batches are padded; when the pipeline ends within a
    step, the remaining replicas get rows that the mask marks as padding.
    """
    k = 0
    while True:
        got = []
        for item in itertools.islice(items, num_local):
            n = rows_of(item, f"per-replica batch {k} of this process's pipeline")
            if n > size:
                raise ValueError(
                    f"per-replica batch {k} of this process's pipeline has {n} examples, more than "
                    f"the per-replica batch size {size}; batch the dataset with "
                    "ctx.get_per_replica_batch_size(global_batch_size)")
            got.append((jax.tree.map(np.asarray, item), n))
            k += 1
        if not got:
            return
        parts, masks = [], []
        for r in range(num_local):
            tree, n = got[r] if r < len(got) else (got[0][0], 0)
            part, mask = padded(tree, max(n, 1), size)
            parts.append(part)
            masks.append(mask if n else np.zeros(size, bool))
        yield LocalStep(jax.tree.map(lambda *xs: np.concatenate(xs), *parts),
                        np.concatenate(masks), sum(n for _, n in got))
        if len(got) < num_local:
            return


def synced(steps: Iterator[LocalStep], sync: StepSync, *, local_rows: int, position: int = 0,
           width: int = 0, min_real: int = 0) -> Iterator[tuple[LocalStep, int]]:
    """Steps until every process's pipeline has ended, with the global count of real rows.

    A process whose pipeline ended contributes padding (copies of its last real row, mask False).
    Steps with fewer than ``min_real`` real rows in all are skipped (``drop_remainder``); the first
    ``position`` steps handed out are skipped (resume).
    """
    step, emitted, last, ended = 0, 0, None, False
    try:
        while True:
            item = None if ended else next(steps, None)
            ended = item is None
            counts = sync.exchange(step, 0 if ended else item.real, width)
            step += 1
            total = sum(counts)
            if total == 0:
                return
            if ended:
                if last is None:
                    raise ValueError(
                        "this process's input pipeline produced no example in this epoch while "
                        f"others did (real rows per process: {counts}); a padding row needs the "
                        "data's shapes, so give every process at least one example (more files or "
                        "examples than processes)")
                item = LocalStep(take(last.local, np.zeros(local_rows, int)),
                                 np.zeros(local_rows, bool), 0)
            else:
                last = item
            if total < min_real:
                continue
            emitted += 1
            if emitted > position:
                yield item, total
    except InputSyncCancelled:
        return
    except Exception as e:
        sync.fail(step, e)
        raise
