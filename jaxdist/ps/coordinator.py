"""The coordinator (chief): schedules closures on workers, re-schedules those of dead workers.

Modelled on ``tf.distribute.experimental.coordinator.ClusterCoordinator``: :meth:`schedule`
queues ``fn(worker, *args)`` and returns a :class:`RemoteValue` at once; one dispatcher thread per
worker takes closures off the queue. A worker that fails a call, or misses heartbeats for
``dead_after_s``, is marked dead and its in-flight closure goes back to the front of the queue
(it keeps its closure id, hence its step ids, so servers drop pushes it had already made). A
worker that answers heartbeats again rejoins, and its per-worker datasets are rebuilt.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from jaxdist.ps import placement as placement_lib
from jaxdist.ps import wire
from jaxdist.ps.server import UpdateRecord, check_number
from jaxdist.ps.transport import Channel, ServerClient, TLSConfig, Unavailable
from jaxdist.ps.worker import WORKER_SERVICE, AckBook, WorkerRuntime, name_of, to_plain

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerDataset", "WorkerLost",
           "ClosureError", "LocalWorker", "GrpcWorker"]

logger = logging.getLogger(__name__)


class WorkerLost(ConnectionError):
    """The worker died or stopped answering; its closure is re-scheduled elsewhere."""


class ClosureError(RuntimeError):
    """A scheduled function raised on its worker."""


class RemoteValue:
    """The future result of a scheduled closure."""

    def __init__(self, closure_id: int):
        self.closure_id = closure_id
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def __float__(self) -> float:
        """The result as a float, waiting for it (how ``jaxdist.fit`` reads scheduled losses,
        as Keras resolves ``RemoteValue`` logs when a callback reads them)."""
        return float(self.fetch())

    def fetch(self, timeout: float | None = None) -> Any:
        """Blocks until the closure finished; returns its result.

        Raises:
          ClosureError: the function raised on its worker.
          TimeoutError: not finished within ``timeout`` seconds.
        """
        if timeout is not None:
            timeout = check_number("fetch timeout", timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"closure {self.closure_id} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value


@dataclasses.dataclass(frozen=True)
class PerWorkerDataset:
    """A dataset each worker builds for itself; pass it in ``schedule(..., args=)`` and the
    function receives that worker's iterator."""

    handle: int
    dataset_fn: Callable = dataclasses.field(compare=False, repr=False)


class WorkerHandle(Protocol):
    """What the coordinator needs from one worker (in-process or remote)."""

    index: int

    def check(self, closure_id: int, fn: Callable, args: tuple, kwargs: dict) -> None:
        """Raises ValueError at ``schedule`` time if this closure could never run there."""

    def run(self, closure_id: int, fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, list]:
        """Runs ``fn`` there; returns (result, ack rows). Raises WorkerLost / ClosureError."""

    def create_dataset(self, ds: PerWorkerDataset, num_workers: int) -> None: ...

    def ping(self, timeout: float) -> int: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None:
        """Tells the worker's process to exit (no-op in process)."""

    def close(self) -> None: ...


class LocalWorker:
    """An in-process worker (a thread of this process). ``kill()`` simulates its death."""

    def __init__(self, runtime: WorkerRuntime):
        self.index = runtime.index
        self.runtime = runtime
        self.killed = False

    def _check(self):
        if self.killed:
            raise WorkerLost(f"in-process worker {self.index} was killed")

    def check(self, closure_id, fn, args, kwargs):
        pass  # any Python callable runs in process

    def run(self, closure_id, fn, args, kwargs):
        self._check()
        self.runtime.begin(closure_id)
        args = tuple(self.runtime.datasets[a.handle] if isinstance(a, PerWorkerDataset) else a
                     for a in args)
        try:
            result = fn(self.runtime, *args, **kwargs)
        except Exception as e:
            raise ClosureError(f"closure {closure_id} failed on worker {self.index}: "
                               f"{type(e).__name__}: {e}") from e
        self._check()  # a worker killed mid-closure never reports its result
        return result, self.runtime.ack_rows()

    def create_dataset(self, ds, num_workers):
        self.runtime.num_workers = num_workers
        self.runtime.datasets[ds.handle] = iter(ds.dataset_fn(self.index, num_workers))

    def ping(self, timeout):
        self._check()
        return 0

    def abort(self):
        pass

    def shutdown(self):
        pass

    def close(self):
        self.runtime.close()


class GrpcWorker:
    """A worker process reached over gRPC (see :class:`jaxdist.ps.worker.WorkerService`)."""

    def __init__(self, index: int, address: str, *, token: str | None = None,
                 tls: TLSConfig | None = None):
        self.index = index
        self.address = address
        self._ch = Channel(address, WORKER_SERVICE, token=token, tls=tls)
        self._inflight = None

    @staticmethod
    def request(closure_id, fn, args, kwargs) -> bytes:
        """The Run message; raises ValueError for an unregistered function or arguments that
        cannot travel (anything but plain values and per-worker datasets)."""
        wire_args = [{"__dataset__": a.handle} if isinstance(a, PerWorkerDataset) else a
                     for a in args]
        try:
            return wire.encode({"closure_id": closure_id, "name": name_of(fn),
                                "args": to_plain(wire_args), "kwargs": to_plain(kwargs)})
        except TypeError as e:  # msgpack: an object it cannot serialize
            raise ValueError(f"arguments of {fn.__qualname__} cannot be sent to a worker "
                             f"process ({e}); pass numbers, strings, lists, dicts, arrays "
                             "or per-worker datasets") from None

    def check(self, closure_id, fn, args, kwargs):
        self.request(closure_id, fn, args, kwargs)

    def run(self, closure_id, fn, args, kwargs):
        self._inflight = fut = self._ch.future("Run", self.request(closure_id, fn, args, kwargs))
        try:
            reply = fut.result()
        except grpc.FutureCancelledError:
            raise WorkerLost(f"worker {self.index} at {self.address} missed its heartbeats; "
                             "its closure was cancelled") from None
        except grpc.RpcError as e:
            raise WorkerLost(f"worker {self.index} at {self.address}: {e.code().name}: "
                             f"{e.details()}") from None
        finally:
            self._inflight = None
        h, _ = wire.decode(reply)
        if "error" in h:
            raise ClosureError(f"closure {closure_id} failed on worker {self.index}: "
                               f"{h['error']}")
        return h["ok"], h["acks"]

    def create_dataset(self, ds, num_workers):
        try:
            self._ch.call("CreateDataset", wire.encode({
                "handle": ds.handle, "name": name_of(ds.dataset_fn),
                "num_workers": num_workers}), timeout=60)
        except (Unavailable, TimeoutError) as e:
            raise WorkerLost(str(e)) from None

    def ping(self, timeout):
        try:
            return wire.decode(self._ch.call("Heartbeat", b"", timeout=timeout))[0]["incarnation"]
        except (Unavailable, TimeoutError) as e:
            raise WorkerLost(str(e)) from None

    def abort(self):
        fut = self._inflight
        if fut is not None:
            fut.cancel()

    def shutdown(self):
        try:
            self._ch.call("Shutdown", b"", timeout=5)
        except Exception as e:  # already gone is fine at shutdown
            logger.debug("worker %d shutdown: %s", self.index, e)

    def close(self):
        self._ch.close()


@dataclasses.dataclass
class _Closure:
    id: int
    fn: Callable
    args: tuple
    kwargs: dict
    value: RemoteValue
    attempts: int = 0


class ClusterCoordinator:
    """Schedules closures on workers and collects their results.

    Built by :meth:`jaxdist.ParameterServerStrategy.start`; usable as a context manager that
    shuts the job down on exit.

    Args:
      workers: :class:`WorkerHandle` of each worker (in-process or gRPC).
      servers: :class:`~jaxdist.ps.transport.ServerClient` of each server, in shard order.
      placement, treedef: to reassemble the parameters in :meth:`fetch_params`.
      heartbeat_s: seconds between heartbeats to each worker.
      dead_after_s: a worker whose heartbeats fail for this long is marked dead.
      max_attempts: a closure that loses its worker this many times fails with
        :class:`ClosureError` instead of being re-scheduled again.
      on_shutdown: called by :meth:`shutdown` (stops the servers of a multi-process job).
    """

    def __init__(self, workers: Sequence[WorkerHandle], *, servers: Sequence[ServerClient],
                 placement: placement_lib.Placement, treedef: Any,
                 heartbeat_s: float = 0.5, dead_after_s: float = 5.0,
                 max_attempts: int = 10, on_shutdown: Callable[[], None] | None = None):
        self.workers = list(workers)
        self.servers = list(servers)
        self.placement = placement
        self._treedef = treedef
        self._queue: collections.deque[_Closure] = collections.deque()
        self._cond = threading.Condition()
        self._unfinished = 0
        self._errors: list[BaseException] = []
        self._ids = itertools.count()
        self._datasets: list[PerWorkerDataset] = []
        self._alive = {w.index: True for w in self.workers}
        self._incarnation: dict[int, int] = {}
        self._last_ok = {w.index: time.monotonic() for w in self.workers}
        self._acks = AckBook()
        self.rescheduled = 0
        self._heartbeat_s = check_number("heartbeat_s", heartbeat_s, lo_open=True)
        self._dead_after_s = check_number("dead_after_s", dead_after_s, lo_open=True)
        self._max_attempts = check_number("max_attempts", max_attempts, lo=1, integer=True)
        self._on_shutdown = on_shutdown
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._dispatch, args=(w,), daemon=True,
                                          name=f"ps-dispatch-{w.index}") for w in self.workers]
        self._threads.append(threading.Thread(target=self._heartbeat, daemon=True,
                                              name="ps-heartbeat"))
        for t in self._threads:
            t.start()

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    # --- scheduling ----------------------------------------------------------------------------

    def schedule(self, fn: Callable, /, args: tuple = (), kwargs: dict | None = None
                 ) -> RemoteValue:
        """Queues ``fn(worker, *args, **kwargs)`` to run on some worker.

        Args:
          fn: the function; for multi-process jobs it must be decorated with
            :func:`jaxdist.ps.remote` and its arguments must be plain values (numbers,
            strings, lists, dicts) or :class:`PerWorkerDataset`.
          args, kwargs: its arguments.

        Returns:
          A :class:`RemoteValue`.

        Raises:
          ValueError: (multi-process) ``fn`` is not registered or an argument cannot travel.
        """
        closure = _Closure(next(self._ids), fn, tuple(args), dict(kwargs or {}), None)
        closure.value = RemoteValue(closure.id)
        for w in self.workers:  # fail here, early, not on a worker later
            w.check(closure.id, fn, closure.args, closure.kwargs)
        with self._cond:
            self._unfinished += 1
            self._queue.append(closure)
            self._cond.notify_all()
        return closure.value

    def join(self, timeout: float | None = None) -> None:
        """Waits for every scheduled closure.

        Raises:
          ClosureError: the first error raised by a closure (all closures still ran).
          TimeoutError: closures were still unfinished after ``timeout`` seconds.
        """
        with self._cond:
            if timeout is not None:
                timeout = check_number("join timeout", timeout)
            if not self._cond.wait_for(lambda: self._unfinished == 0, timeout):
                alive = [i for i, a in self._alive.items() if a]
                raise TimeoutError(f"{self._unfinished} closure(s) unfinished after {timeout}s; "
                                   f"live workers: {alive}")
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def live_workers(self) -> list[int]:
        """Indices of the workers currently taking closures."""
        with self._cond:
            return [i for i, alive in self._alive.items() if alive]

    def done(self) -> bool:
        with self._cond:
            return self._unfinished == 0

    def create_per_worker_dataset(self, dataset_fn: Callable[[int, int], Any]
                                  ) -> PerWorkerDataset:
        """Has every worker build ``dataset_fn(worker_index, num_workers)`` (an iterable).

        Multi-process jobs need ``dataset_fn`` decorated with :func:`jaxdist.ps.remote`.
        """
        ds = PerWorkerDataset(len(self._datasets), dataset_fn)
        for w in self.workers:
            if self._alive[w.index]:
                try:
                    w.create_dataset(ds, self.num_workers)
                except WorkerLost as e:
                    self._mark_dead(w, e)
        self._datasets.append(ds)
        return ds

    def _next(self, w: WorkerHandle) -> _Closure | None:
        with self._cond:
            while not self._stop.is_set():
                if self._alive[w.index] and self._queue:
                    return self._queue.popleft()
                self._cond.wait(0.2)
        return None

    def _dispatch(self, w: WorkerHandle) -> None:
        while (closure := self._next(w)) is not None:
            closure.attempts += 1
            try:
                result, acks = w.run(closure.id, closure.fn, closure.args, closure.kwargs)
            except WorkerLost as e:
                self._mark_dead(w, e)
                if closure.attempts < self._max_attempts:
                    with self._cond:
                        self.rescheduled += 1
                        self._queue.appendleft(closure)
                        self._cond.notify_all()
                    logger.warning("closure %d re-scheduled: worker %d lost", closure.id,
                                   w.index)
                    continue
                result, acks, error = None, [], ClosureError(
                    f"closure {closure.id} lost a worker on each of its {closure.attempts} "
                    f"attempts (last: {e}); does it crash its worker?")
            except ClosureError as e:
                result, acks, error = None, [], e
            except Exception as e:  # never let one closure stop this worker's dispatcher
                logger.exception("dispatching closure %d", closure.id)
                result, acks, error = None, [], ClosureError(
                    f"closure {closure.id} could not run: {type(e).__name__}: {e}")
            else:
                error = None
            self._record_acks(acks)
            closure.value._set(result, error)
            with self._cond:
                self._unfinished -= 1
                if error is not None:
                    self._errors.append(error)
                self._cond.notify_all()

    # --- liveness ------------------------------------------------------------------------------

    def _mark_dead(self, w: WorkerHandle, why: Exception) -> None:
        with self._cond:
            was_alive, self._alive[w.index] = self._alive[w.index], False
        if was_alive:
            logger.warning("worker %d marked dead: %s", w.index, why)
            w.abort()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            for w in self.workers:
                try:
                    incarnation = w.ping(timeout=max(self._heartbeat_s, 1.0))
                except WorkerLost as e:
                    if (self._alive[w.index] and
                            time.monotonic() - self._last_ok[w.index] > self._dead_after_s):
                        self._mark_dead(w, e)
                    continue
                self._last_ok[w.index] = time.monotonic()
                if self._alive[w.index]:
                    self._incarnation.setdefault(w.index, incarnation)
                    continue
                try:  # a worker that answers again rejoins with fresh datasets
                    if self._incarnation.get(w.index) != incarnation:
                        for ds in self._datasets:
                            w.create_dataset(ds, self.num_workers)
                    self._incarnation[w.index] = incarnation
                except WorkerLost:
                    continue
                logger.warning("worker %d rejoined", w.index)
                with self._cond:
                    self._alive[w.index] = True
                    self._cond.notify_all()

    # --- servers -------------------------------------------------------------------------------

    def _record_acks(self, rows: list) -> None:
        with self._cond:
            for row in rows:
                self._acks.add(*row)

    def lost_updates(self) -> dict[int, int]:
        """Updates each server lost to restarts: for every restart, the highest version workers
        saw acknowledged before it minus the version the server was restored from (at most the
        checkpoint interval)."""
        with self._cond:
            return self._acks.lost_updates()

    def fetch_params(self) -> Any:
        """Pulls every shard and returns the whole parameter tree (numpy leaves)."""
        shards = [s.pull()[1] for s in self.servers]
        return placement_lib.unflatten(self._treedef, self.placement.assemble(shards))

    def server_logs(self) -> list[list[UpdateRecord]]:
        """Each server's log of applied pushes."""
        return [list(s.log()) for s in self.servers]

    def server_status(self) -> list[dict[str, Any]]:
        return [s.status() for s in self.servers]

    def shutdown(self) -> None:
        """Stops dispatching, and for multi-process jobs tells workers and servers to exit."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        for w in self.workers:
            w.shutdown()
            w.close()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
