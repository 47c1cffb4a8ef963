"""Workers: pull parameters, compute gradients with a jitted function, push them to the servers.

A scheduled function runs as ``fn(worker, *args)`` where ``worker`` is the :class:`WorkerRuntime`
of the worker it landed on; it calls :meth:`WorkerRuntime.step` for each training step. Across
processes, scheduled functions travel by name: decorate them with :func:`remote` at module level
so every process of the job defines them (a worker never runs code named by a peer unless it was
registered that way).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np

from jaxdist.ps import placement as placement_lib
from jaxdist.ps import wire
from jaxdist.ps._retry import retry
from jaxdist.ps.server import PushRejected, check_number
from jaxdist.ps.transport import ServerClient, Unavailable

__all__ = ["AckBook", "WorkerRuntime", "remote", "strategy_grad_fn", "resolve", "make_step_id", "GradFn",
           "WorkerService", "WORKER_SERVICE", "to_plain"]

logger = logging.getLogger(__name__)

WORKER_SERVICE = "jaxdist.ps.Worker"
GradFn = Callable[[Any, Any], tuple[Any, Any]]  # (params, batch) -> (loss, grads)
_STEP_BITS = 10
_REGISTRY: dict[str, Callable] = {}


def make_step_id(closure_id: int, k: int = 0) -> int:
    """Step id of the ``k``-th :meth:`WorkerRuntime.step` of closure ``closure_id``.

    A re-run closure reproduces the same ids, which is what makes re-running it safe.

    >>> make_step_id(3), make_step_id(3, 1)
    (3072, 3073)
    """
    if not 0 <= k < 1 << _STEP_BITS:
        raise ValueError(f"a closure may run at most {1 << _STEP_BITS} steps, got step {k}")
    return closure_id << _STEP_BITS | k


def strategy_grad_fn(strategy: Any, loss_fn: Callable[[Any, Any], Any]) -> GradFn:
    """A worker's gradient function computed by a local strategy's compiled step.

    This is how a worker uses all its devices: with ``jaxdist.MirroredStrategy()`` the worker's
    batch is split over its local devices and the gradient is the mean over the whole batch
    (the batch size must divide the strategy's replica count).

    Args:
      strategy: a jaxdist strategy with ``step(fn, donate=...)`` (global view).
      loss_fn: ``loss_fn(params, batch) -> scalar``.

    Returns:
      ``grad_fn(params, batch) -> (loss, grads)``.
    """
    def fn(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return params, {"loss": loss, "grads": grads}

    step = strategy.step(fn, donate=False)  # the servers own the parameters; never donate them

    def grad_fn(params, batch):
        _, out = step(params, batch)
        return out["loss"], out["grads"]

    return grad_fn


def remote(fn: Callable) -> Callable:
    """Registers ``fn`` so a coordinator in another process can schedule it by name.

    Use as a decorator on a module-level function; every process of the job must import it.
    """
    _REGISTRY[f"{fn.__module__}:{fn.__qualname__}"] = fn
    return fn


def name_of(fn: Callable) -> str:
    name = f"{fn.__module__}:{fn.__qualname__}"
    if _REGISTRY.get(name) is not fn:
        raise ValueError(f"{name} is not registered for remote execution: decorate it with "
                         "@jaxdist.ps.remote at module level so worker processes define it too")
    return name


def resolve(name: str) -> Callable:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LookupError(f"{name!r} is not registered in this worker process "
                          f"(registered: {sorted(_REGISTRY)}); define it with @jaxdist.ps.remote "
                          "at module level of the script every process runs") from None


def to_plain(x: Any) -> Any:
    """Converts a closure's result into msgpack-able values (arrays become nested lists)."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x).tolist()
    if isinstance(x, Mapping):
        return {str(k): to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    return x


class AckBook:
    """Which versions each server acknowledged, per server incarnation: the bookkeeping workers
    keep and the coordinator merges to count updates lost to a server restart.

    >>> book = AckBook()
    >>> book.add(0, 111, -1, 57); book.add(0, 222, 40, 90)
    >>> book.lost_updates()
    {0: 17}
    """

    def __init__(self):
        # shard -> {server incarnation: [restored version, highest acknowledged version]}
        self._seen: dict[int, dict[int, list[int]]] = {}

    def add(self, shard: int, incarnation: int, restored: int, version: int) -> None:
        seen = self._seen.setdefault(shard, {}).setdefault(incarnation, [restored, version])
        seen[1] = max(seen[1], version)

    def rows(self) -> list[list[int]]:
        """``[shard, incarnation, restored version, highest acknowledged version]`` rows."""
        return [[s, inc, r, v] for s, by_inc in self._seen.items()
                for inc, (r, v) in by_inc.items()]

    def lost_updates(self) -> dict[int, int]:
        """Per shard: for every restart, the highest version acknowledged before it minus the
        version the server was restored from."""
        out = {}
        for shard, by_inc in self._seen.items():
            # one [restored version, highest ack] per incarnation; restores only move forward
            # in time, and the fresh start (-1) comes first
            runs = sorted(by_inc.values())
            out[shard] = sum(max(0, prev[1] - cur[0]) for prev, cur in zip(runs, runs[1:]))
        return out


class WorkerRuntime:
    """One worker: its server clients, the placement, the gradient function and its datasets.

    Args:
      index: worker index (its id in pushes).
      clients: one :class:`~jaxdist.ps.transport.ServerClient` per parameter server.
      placement: where each leaf lives.
      treedef: structure of the parameter tree.
      grad_fn: ``(params, batch) -> (loss, grads)``; the seam where a local strategy's compiled
        step can be plugged in. Default callers pass ``jax.jit(jax.value_and_grad(loss_fn))``.
      retry_timeout_s: how long to keep retrying a server that is unavailable (restarting).
      max_stale_retries: pulls-and-recomputes allowed per step before giving up.
    """

    def __init__(self, index: int, clients: Sequence[ServerClient],
                 placement: placement_lib.Placement, treedef: Any, grad_fn: GradFn, *,
                 retry_timeout_s: float = 60.0, max_stale_retries: int = 1000,
                 sync_timeout_s: float = 120.0):
        self.index = index
        self.num_workers: int | None = None
        self.clients = list(clients)
        self.placement = placement
        self.treedef = treedef
        self.grad_fn = grad_fn
        self.retry_timeout_s = check_number("retry_timeout_s", retry_timeout_s)
        self.max_stale_retries = check_number("max_stale_retries", max_stale_retries,
                                              integer=True)
        self.sync_timeout_s = check_number("sync_timeout_s", sync_timeout_s, lo_open=True)
        self.datasets: dict[int, Any] = {}
        self.acks = AckBook()
        self.stale_retries = 0
        self._closure_id = 0
        self._k = 0
        self._cached: tuple[list[int], list[Mapping[str, np.ndarray]]] | None = None
        self._pool = futures.ThreadPoolExecutor(max(1, len(self.clients)))

    def begin(self, closure_id: int) -> None:
        """Called by the dispatcher before running closure ``closure_id`` here."""
        self._closure_id, self._k = closure_id, 0

    def _each(self, fn: Callable[[int], Any], shards: Sequence[int]) -> dict[int, Any]:
        """Runs ``fn(shard)`` for each shard, in parallel, retrying while a server is down."""
        def retrying(shard):
            return retry(lambda _left: fn(shard), timeout_s=self.retry_timeout_s,
                         retry_on=Unavailable)
        if len(shards) == 1:
            return {shards[0]: retrying(shards[0])}
        return dict(zip(shards, self._pool.map(retrying, shards)))

    def pull(self) -> tuple[list[int], Any]:
        """Pulls every shard; returns ``(versions, params tree)``."""
        if self._cached is not None:
            (versions, shards), self._cached = self._cached, None
        else:
            got = self._each(lambda s: self.clients[s].pull(), range(len(self.clients)))
            versions = [got[s][0] for s in range(len(self.clients))]
            shards = [got[s][1] for s in range(len(self.clients))]
        flat = self.placement.assemble(shards)
        return versions, placement_lib.unflatten(self.treedef, flat)

    def _ack(self, shard: int, result) -> None:
        self.acks.add(shard, result.incarnation, result.restored_version, result.version)

    def ack_rows(self) -> list[list[int]]:
        """``[shard, incarnation, restored version, highest acknowledged version]`` rows."""
        return self.acks.rows()

    def step(self, batch: Any) -> float:
        """One training step: pull, compute gradients, push them to every shard.

        A shard that answers ``"stale"`` (bounded staleness, or a server restored from a
        checkpoint) makes the worker pull and recompute; shards that already took this step id
        answer ``"duplicate"`` on the retry, so each is updated once. In synchronous mode the
        call returns when the round containing this push has been applied.

        Returns:
          The loss on ``batch``, as a Python float.

        Raises:
          RuntimeError: the step was still stale after ``max_stale_retries`` attempts.
          PushRejected: a server refused the gradients (wrong structure for the placement).
        """
        step_id = make_step_id(self._closure_id, self._k)
        self._k += 1
        todo = list(range(len(self.clients)))
        waits: dict[int, int] = {}
        for _ in range(self.max_stale_retries):
            versions, params = self.pull()
            loss, grads = self.grad_fn(params, batch)
            flat, _ = placement_lib.flatten(grads)
            parts = self.placement.split({k: np.asarray(v) for k, v in flat.items()})
            results = self._each(lambda s, versions=versions, parts=parts: self.clients[s].push(  # type: ignore[misc]
                worker=self.index, step_id=step_id, version=versions[s], grads=parts[s]), todo)
            for shard, result in results.items():
                if result.status in ("applied", "pending"):
                    self._ack(shard, result)
                if result.status == "pending":
                    waits[shard] = result.version
            todo = [s for s in todo if results[s].status == "stale"]
            if not todo:
                break
            self.stale_retries += 1
        else:
            raise RuntimeError(f"worker {self.index}: step {step_id} was refused as stale "
                               f"{self.max_stale_retries} times; is staleness=0 with many "
                               "workers? Raise staleness or max_stale_retries")
        if waits:
            got = self._each(lambda s: self.clients[s].pull(
                min_version=waits.get(s), timeout=self.sync_timeout_s),
                range(len(self.clients)))
            self._cached = ([got[s][0] for s in range(len(self.clients))],
                            [got[s][1] for s in range(len(self.clients))])
        return float(loss)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class WorkerService:
    """The gRPC face of a worker process: runs registered closures for the coordinator."""

    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime
        self.incarnation = int(time.time_ns() & ((1 << 48) - 1))
        self.stopped = threading.Event()
        self._lock = threading.Lock()  # one closure at a time, like a tf.distribute worker

    def methods(self) -> dict[str, Callable[[bytes], bytes]]:
        return {"Run": self.run, "CreateDataset": self.create_dataset,
                "Heartbeat": self.heartbeat, "Shutdown": self.shutdown}

    def _args(self, args: list) -> list:
        out = []
        for a in args:
            if isinstance(a, dict) and set(a) == {"__dataset__"}:
                try:
                    a = self.runtime.datasets[a["__dataset__"]]
                except KeyError:
                    raise PushRejected(f"per-worker dataset {a['__dataset__']} was never "
                                       f"created on worker {self.runtime.index}") from None
            out.append(a)
        return out

    def run(self, request: bytes, call: Any = None) -> bytes:
        h, _ = wire.decode(request)
        fn = resolve(h["name"])
        with self._lock:
            self.runtime.begin(int(h["closure_id"]))
            try:
                result = {"ok": to_plain(fn(self.runtime, *self._args(h["args"]),
                                            **h.get("kwargs", {})))}
            except Exception as e:  # the closure's own failure: report it, keep serving
                logger.exception("closure %s failed", h["name"])
                result = {"error": f"{type(e).__name__}: {e}"}
        result["acks"] = self.runtime.ack_rows()
        return wire.encode(result)

    def create_dataset(self, request: bytes, call: Any = None) -> bytes:
        h, _ = wire.decode(request)
        fn = resolve(h["name"])
        self.runtime.num_workers = int(h["num_workers"])
        self.runtime.datasets[int(h["handle"])] = iter(fn(self.runtime.index,
                                                          int(h["num_workers"])))
        return b""

    def heartbeat(self, request: bytes, call: Any = None) -> bytes:
        return wire.encode({"incarnation": self.incarnation, "index": self.runtime.index})

    def shutdown(self, request: bytes, call: Any = None) -> bytes:
        self.stopped.set()
        return b""
