"""Cluster configuration for multi-process jobs: `ClusterSpec`, `initialize`, `barrier`.

A job is described by one `ClusterSpec` per process. It comes from an explicit value, from
`TF_CONFIG` (so tf.distribute launch scripts keep working), from the `JAXDIST_*` variables that
`jaxdist launch` sets, or from JAX's own detection of SLURM / Open MPI / Kubernetes / Cloud TPU.
`initialize` joins the JAX distributed runtime with a bounded wait and clear errors; `barrier`
synchronises processes over the runtime's coordination service and, unlike
`multihost_utils.sync_global_devices`, gives up after a timeout naming who did not arrive.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
# Task types whose processes run the synchronous training job (and join JAX's runtime).
_JAX_TASK_TYPES = ("chief", "worker")

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_RESTART_COUNT = "JAXDIST_RESTART_COUNT"

_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


def split_address(address: Any) -> tuple[str, int]:
    """Splits "host:port" (IPv6 hosts in brackets) into `(host, port)`.

    >>> split_address("[::1]:8476")
    ('::1', 8476)
    """
    if not isinstance(address, str):
        raise ValueError(f"expected a 'host:port' string, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError("expected 'host:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 host must be written in brackets, '[addr]:port'")
    if not host or any(c.isspace() for c in host):
        raise ValueError("empty host or whitespace in host")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port {port!r} is not an integer in 1..65535")
    return host, int(port)


def _fail(field: str, value: Any, problem: str, fix: str) -> ValueError:
    return ValueError(f"{field} = {value!r}: {problem}. Fix: {fix}.")


def _check_address(field: str, value: Any) -> None:
    try:
        split_address(value)
    except ValueError as e:
        raise _fail(field, value, str(e),
                    "write it as 'host:port', e.g. '10.0.0.1:1234' or '[::1]:1234'") from None


def _check_addresses(groups: Mapping[str, Sequence[str]]) -> None:
    """Validates every address of every named group; no address may appear twice."""
    seen: dict[str, str] = {}
    for group, addresses in groups.items():
        for i, address in enumerate(addresses):
            field = f"{group}[{i}]"
            _check_address(field, address)
            if address in seen:
                raise _fail(field, address, f"duplicate address, also {seen[address]}",
                            "give every task its own host:port")
            seen[address] = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a multi-process job.

    Processes of the synchronous job (TF's chief and workers) have a `process_id`; `ps` and
    `evaluator` tasks are not part of it and have `process_id=None`.

    Attributes:
      coordinator_address: "host:port" of process 0, where JAX's coordination service runs.
        May be None only for a one-process job.
      num_processes: number of processes in the synchronous job.
      process_id: this process's id in `[0, num_processes)`, or None for a ps / evaluator task.
      task_type: "chief" | "worker" | "ps" | "evaluator".
      task_index: index of this task within its task type (defaults to `process_id`).
      ps: parameter-server addresses, kept for the parameter-server mode.
      workers: addresses of the job's processes ordered by process id (chief first), when known.
      evaluator: evaluator addresses, when known.
      local_device_ids: restricts the devices this process uses (passed to JAX).

    >>> spec = ClusterSpec(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    >>> spec.task_type, spec.task_index, spec.is_chief
    ('worker', 1, False)
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int | None
    task_type: str = "worker"
    task_index: int | None = None
    ps: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("ps", "workers", "evaluator"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise _fail(name, value, "expected a sequence of 'host:port' addresses",
                            f"pass {name}=('host:port', ...)")
            object.__setattr__(self, name, tuple(value))
        if self.local_device_ids is not None:
            ids = self.local_device_ids
            ids = (ids,) if _is_int(ids) else tuple(ids)
            if not all(_is_int(i) and i >= 0 for i in ids):
                raise _fail("local_device_ids", self.local_device_ids,
                            "expected non-negative integers", "pass e.g. (0, 1)")
            object.__setattr__(self, "local_device_ids", ids)
        if not _is_int(self.num_processes) or self.num_processes < 1:
            raise _fail("num_processes", self.num_processes, "expected an integer >= 1",
                        "pass the number of processes in the job")
        if self.task_type not in TASK_TYPES:
            raise _fail("task_type", self.task_type, f"unknown task type; expected one of "
                        f"{TASK_TYPES}", "use 'chief' or 'worker' for training processes")
        if self.process_id is None:
            if self.task_type in _JAX_TASK_TYPES:
                raise _fail("process_id", None, f"a {self.task_type!r} task is a process of "
                            "the job and needs an id", "pass process_id in [0, num_processes)")
        elif not _is_int(self.process_id) or not 0 <= self.process_id < self.num_processes:
            raise _fail("process_id", self.process_id,
                        f"expected an integer in [0, {self.num_processes}) since "
                        f"num_processes = {self.num_processes}",
                        "give each process a distinct id 0 .. num_processes-1, or raise "
                        "num_processes")
        elif self.task_type not in _JAX_TASK_TYPES:
            raise _fail("process_id", self.process_id, f"a {self.task_type!r} task is not a "
                        "process of the synchronous job", "pass process_id=None")
        if self.task_index is None:
            object.__setattr__(self, "task_index", self.process_id or 0)
        elif not _is_int(self.task_index) or self.task_index < 0:
            raise _fail("task_index", self.task_index, "expected an integer >= 0",
                        "pass the task's index within its task type")
        if self.coordinator_address is None:
            if self.num_processes > 1:
                raise _fail("coordinator_address", None, f"a job of {self.num_processes} "
                            "processes needs a coordinator", "pass process 0's 'host:port'")
        else:
            _check_address("coordinator_address", self.coordinator_address)
        _check_addresses({name: getattr(self, name) for name in ("workers", "ps", "evaluator")})
        if self.workers:
            if len(self.workers) != self.num_processes:
                raise _fail("workers", self.workers, f"{len(self.workers)} addresses but "
                            f"num_processes = {self.num_processes}",
                            "list one address per process of the job")
            if self.coordinator_address != self.workers[0]:
                raise _fail("coordinator_address", self.coordinator_address,
                            f"process 0's address is {self.workers[0]!r}",
                            "use process 0's address as the coordinator")

    @property
    def is_jax_process(self) -> bool:
        """True for processes of the synchronous job (chief / workers), False for ps / evaluator."""
        return self.process_id is not None

    @property
    def is_chief(self) -> bool:
        """True on process 0, the process that writes summaries and coordinates."""
        return self.process_id == 0

    @classmethod
    def single_process(cls) -> ClusterSpec:
        """The spec of a one-process job (no distributed runtime).

        >>> ClusterSpec.single_process().num_processes
        1
        """
        return cls(coordinator_address=None, num_processes=1, process_id=0)

    def to_env(self) -> dict[str, str]:
        """The `JAXDIST_*` variables that make `ClusterSpec.from_env` rebuild this spec.

        >>> ClusterSpec("127.0.0.1:1234", 2, 1).to_env()["JAXDIST_PROCESS_ID"]
        '1'
        """
        if self.process_id is None or self.coordinator_address is None:
            raise ValueError(f"to_env() needs a process of a multi-process job; got {self!r}")
        return {ENV_COORDINATOR: self.coordinator_address,
                ENV_NUM_PROCESSES: str(self.num_processes),
                ENV_PROCESS_ID: str(self.process_id)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterSpec:
        """Reads `JAXDIST_COORDINATOR`, `JAXDIST_NUM_PROCESSES`, `JAXDIST_PROCESS_ID`.

        Args:
          environ: the environment to read (default `os.environ`).

        Returns:
          The spec these variables describe.

        Raises:
          ValueError: a variable is missing or malformed.

        >>> ClusterSpec.from_env({"JAXDIST_COORDINATOR": "127.0.0.1:1234",
        ...                       "JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": "0"}).is_chief
        True
        """
        environ = os.environ if environ is None else environ
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        missing = [n for n in names if not environ.get(n)]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set (found: "
                             f"{ {n: environ.get(n) for n in names} }). Fix: set all three, or "
                             "start the processes with `jaxdist launch -n N script.py`.")
        values = {}
        for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise _fail(name, environ[name], "not an integer",
                            f"set {name} to a decimal integer") from None
        return cls(coordinator_address=environ[ENV_COORDINATOR],
                   num_processes=values[ENV_NUM_PROCESSES],
                   process_id=values[ENV_PROCESS_ID])

    @classmethod
    def from_tf_config(cls, json_or_env: str | Mapping[str, Any] | None = None) -> ClusterSpec:
        """Builds the spec from a tf.distribute `TF_CONFIG`.

        The chief (if any) is process 0 and the coordinator, followed by the workers in order;
        without a chief, worker 0 is process 0. `ps` addresses are kept; `evaluator` tasks are
        recognised and get `process_id=None`.

        Args:
          json_or_env: the TF_CONFIG as a JSON string or a dict; None reads the `TF_CONFIG`
            environment variable.

        Returns:
          This task's spec.

        Raises:
          ValueError: bad JSON, a missing key, an unknown task type, an index out of range,
            a malformed or duplicate address; the message names the field and the fix.

        >>> spec = ClusterSpec.from_tf_config({
        ...     "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
        ...                 "ps": ["h3:2222"]},
        ...     "task": {"type": "worker", "index": 1}})
        >>> spec.coordinator_address, spec.num_processes, spec.process_id, spec.ps
        ('h0:2222', 3, 2, ('h3:2222',))
        """
        source = "TF_CONFIG"
        if json_or_env is None:
            json_or_env = os.environ.get("TF_CONFIG")
            if not json_or_env:
                raise ValueError("TF_CONFIG is not set. Fix: export TF_CONFIG='"
                                 f"{_TF_CONFIG_EXAMPLE}', or pass the config explicitly.")
        if isinstance(json_or_env, str):
            try:
                config = json.loads(json_or_env)
            except json.JSONDecodeError as e:
                raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {json_or_env[:200]!r}. "
                                 f"Fix: use the form {_TF_CONFIG_EXAMPLE}") from None
        else:
            config = json_or_env
        if not isinstance(config, Mapping):
            raise _fail(source, config, "expected a JSON object",
                        f"use the form {_TF_CONFIG_EXAMPLE}")
        return _spec_from_tf_config(config)


def _spec_from_tf_config(config: Mapping[str, Any]) -> ClusterSpec:
    form = f"use the form {_TF_CONFIG_EXAMPLE}"
    for key in ("cluster", "task"):
        if not isinstance(config.get(key), Mapping):
            raise _fail(f"TF_CONFIG[{key!r}]", config.get(key), "missing or not an object", form)
    cluster, task = config["cluster"], config["task"]
    jobs: dict[str, tuple[str, ...]] = {}
    for job, addresses in cluster.items():
        if job not in TASK_TYPES:
            raise _fail(f"TF_CONFIG['cluster'][{job!r}]", addresses,
                        f"unknown task type {job!r}; expected one of {TASK_TYPES}",
                        "rename the job ('master' is now 'chief') or remove it")
        if isinstance(addresses, str) or not isinstance(addresses, Sequence):
            raise _fail(f"TF_CONFIG['cluster'][{job!r}]", addresses,
                        "expected a list of 'host:port' addresses", f'write "{job}": ["host:port"]')
        jobs[job] = tuple(addresses)
    _check_addresses({f"TF_CONFIG['cluster'][{job!r}]": a for job, a in jobs.items()})
    if len(jobs.get("chief", ())) > 1:
        raise _fail("TF_CONFIG['cluster']['chief']", list(jobs["chief"]),
                    "at most one chief is allowed", "move the others to 'worker'")
    processes = jobs.get("chief", ()) + jobs.get("worker", ())
    if not processes:
        raise _fail("TF_CONFIG['cluster']", dict(cluster), "no 'chief' and no 'worker' task",
                    "list the training processes under 'chief' and/or 'worker'")
    for key in ("type", "index"):
        if key not in task:
            raise _fail(f"TF_CONFIG['task'][{key!r}]", None, "missing",
                        'write "task": {"type": "worker", "index": 0}')
    task_type, index = task["type"], task["index"]
    if task_type not in TASK_TYPES:
        raise _fail("TF_CONFIG['task']['type']", task_type,
                    f"unknown task type; expected one of {TASK_TYPES}", "use one of those")
    if task_type not in jobs:
        raise _fail("TF_CONFIG['task']['type']", task_type, "the cluster has no such job "
                    f"(jobs: {sorted(jobs)})", f"add a {task_type!r} list to 'cluster'")
    n = len(jobs[task_type])
    if not _is_int(index) or not 0 <= index < n:
        raise _fail("TF_CONFIG['task']['index']", index,
                    f"out of range: cluster[{task_type!r}] has {n} address(es), valid indexes "
                    f"0..{n - 1}", "use an integer index within the job's list")
    if task_type == "chief":
        process_id = 0
    elif task_type == "worker":
        process_id = len(jobs.get("chief", ())) + index
    else:
        process_id = None
    return ClusterSpec(coordinator_address=processes[0], num_processes=len(processes),
                       process_id=process_id, task_type=task_type, task_index=index,
                       ps=jobs.get("ps", ()), workers=processes,
                       evaluator=jobs.get("evaluator", ()))


def cluster_from_environment(environ: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Resolves this process's spec from `TF_CONFIG`, else `JAXDIST_*`, without initializing.

    Args:
      environ: the environment to read (default `os.environ`).

    Returns:
      The spec, or None when neither is set (`initialize` then defers to JAX's detection of
      SLURM / Open MPI / Kubernetes / Cloud TPU).

    Raises:
      ValueError: a variable is set but invalid.

    >>> cluster_from_environment({}) is None
    True
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG"):
        return ClusterSpec.from_tf_config(environ["TF_CONFIG"])
    if any(environ.get(n) for n in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)):
        return ClusterSpec.from_env(environ)
    return None


class CoordinatorTimeoutError(TimeoutError):
    """The coordinator did not answer within the timeout."""


_lock = threading.Lock()
_current: ClusterSpec | None = None


def current_cluster() -> ClusterSpec | None:
    """The spec `initialize` joined, or None before `initialize`."""
    return _current


def initialize(cluster: ClusterSpec | None = None, *, timeout_s: float = 300.0) -> ClusterSpec:
    """Joins the multi-process job; call it first, on every process, before other JAX calls.

    The spec is `cluster` if given, else `TF_CONFIG`, else `JAXDIST_*` (set by `jaxdist
    launch`), else whatever `jax.distributed.initialize()` detects (SLURM, Open MPI,
    Kubernetes, Cloud TPU); with none of those this is a one-process job. A one-process job,
    a ps task and an evaluator task do not start JAX's distributed runtime.

    Calling it again with the same job (coordinator, process count and id) or with no spec is
    a no-op that returns the current spec.

    Args:
      cluster: an explicit spec.
      timeout_s: how long to wait for the coordinator and for all processes to join. A
        process other than 0 that cannot reach the coordinator raises; a process still
        waiting for peers when it expires logs the reason and exits with status 1, because
        JAX's runtime cannot be abandoned mid-connect (it would abort the process).

    Returns:
      The spec this process joined.

    Raises:
      CoordinatorTimeoutError: the coordinator did not accept connections within timeout_s.
      RuntimeError: a conflicting job was already initialized, the coordinator port is taken,
        or JAX's backend started before this call.
      ValueError: the environment's cluster description is invalid.

    >>> initialize(ClusterSpec.single_process()).num_processes
    1
    """
    global _current
    spec = cluster if cluster is not None else cluster_from_environment()
    with _lock:
        if _current is None:
            _current = _adopt_running_runtime()
        if _current is not None:
            if spec is None or _same_job(spec, _current):
                return _current
            raise RuntimeError(f"jaxdist.initialize: this process already joined "
                               f"{_job(_current)}; cannot also join {_job(spec)}. Fix: call "
                               "initialize once per process, with one cluster configuration.")
        if spec is None:
            spec = _join_autodetected(timeout_s)
        elif not spec.is_jax_process:
            logger.info("%s task %d is not a process of the training job; not joining JAX's "
                        "distributed runtime", spec.task_type, spec.task_index)
        elif spec.num_processes > 1:
            _join(spec, timeout_s)
        _current = spec
        return spec


def _job(spec: ClusterSpec) -> str:
    return (f"the job at {spec.coordinator_address} as process {spec.process_id} of "
            f"{spec.num_processes}")


def _same_job(a: ClusterSpec, b: ClusterSpec) -> bool:
    if a.num_processes == b.num_processes == 1 and a.process_id == b.process_id:
        return True  # no runtime, so the coordinator address means nothing
    return ((a.coordinator_address, a.num_processes, a.process_id)
            == (b.coordinator_address, b.num_processes, b.process_id))


def _distributed_state():
    from jax._src import distributed  # the runtime's client lives only here
    return distributed.global_state


def _adopt_running_runtime() -> ClusterSpec | None:
    """The spec of a runtime someone started with `jax.distributed.initialize` directly."""
    state = _distributed_state()
    if state.client is None:
        return None
    return ClusterSpec(coordinator_address=state.coordinator_address,
                       num_processes=state.num_processes, process_id=state.process_id)


def _check_backend_not_started() -> None:
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jaxdist.initialize must run before anything starts JAX's backend "
                           "(jax.devices(), creating arrays, building a strategy, ...). Fix: "
                           "call jaxdist.initialize() first thing in main().")


def _check_port_free(port: int, address: str) -> None:
    """Fails early if process 0 cannot bind the coordinator's port (JAX would crash)."""
    families = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with sock:
            # gRPC binds with SO_REUSEADDR too, so a port in TIME_WAIT is not reported as taken.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError as e:
                error = e
        raise RuntimeError(f"process 0 cannot start the coordinator on port {port} of "
                           f"{address}: {error}. Fix: choose a free port (or stop the process "
                           "holding this one), the same for all processes.")


def _wait_for_listener(host: str, port: int, timeout_s: float,
                       error: Callable[[str], Exception]) -> float:
    """Waits until host:port accepts TCP connections; returns the time left of timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return max(left, 1.0)
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        if deadline - time.monotonic() <= 0:
            raise error(last)
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def _join(spec: ClusterSpec, timeout_s: float) -> None:
    import jax
    _check_backend_not_started()
    host, port = split_address(spec.coordinator_address)
    where = f"process {spec.process_id} of {spec.num_processes}"
    if spec.process_id == 0:
        if not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
            _check_port_free(port, spec.coordinator_address)
        remaining = timeout_s
    else:
        # JAX's client aborts the whole process when the coordinator is unreachable; probing the
        # port first turns the common failure into an exception the caller can handle.
        remaining = _wait_for_listener(host, port, timeout_s, lambda last: CoordinatorTimeoutError(
            f"{where} could not reach the coordinator at {spec.coordinator_address} within "
            f"{timeout_s:g} s (last error: {last}). Check that process 0 was started and called "
            "jaxdist.initialize, that every process uses this coordinator address, and that "
            "the host and port are reachable from here (DNS, firewall)."))
    logger.info("%s joining the job at %s", where, spec.coordinator_address)
    with _Watchdog(remaining, f"{where}: not all {spec.num_processes} processes joined the "
                   f"coordinator at {spec.coordinator_address} within {timeout_s:g} s. Check "
                   f"that all {spec.num_processes} processes were started with the same "
                   "coordinator address and process count and distinct process ids, and the "
                   "logs of the missing ones."):
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
            process_id=spec.process_id, local_device_ids=spec.local_device_ids,
            initialization_timeout=math.ceil(remaining) + _JAX_DEADLINE_MARGIN_S)


def _join_autodetected(timeout_s: float) -> ClusterSpec:
    import jax
    from jax._src import xla_bridge
    state = _distributed_state()
    if xla_bridge.backends_are_initialized():
        # Too late to join anything: this process can only be a job of its own.
        logger.warning("JAX's backend started before jaxdist.initialize(); continuing as a "
                       "single process. In a multi-process job, call jaxdist.initialize() "
                       "before any other JAX call.")
        return ClusterSpec.single_process()
    with _Watchdog(timeout_s, f"the job detected from the environment (SLURM / Open MPI / "
                   f"Kubernetes / Cloud TPU) did not come up within {timeout_s:g} s. Check the "
                   "scheduler's logs for processes that failed to start."):
        try:
            jax.distributed.initialize(
                initialization_timeout=math.ceil(timeout_s) + _JAX_DEADLINE_MARGIN_S)
        except ValueError as e:
            # JAX's signal that no cluster environment was detected.
            if state.client is not None or "coordinator_address" not in str(e):
                raise
            logger.info("no cluster configuration found; running as a single process")
            return ClusterSpec.single_process()
    return _adopt_running_runtime()


# JAX's own deadline is set past ours so that the watchdog's clear message comes first.
_JAX_DEADLINE_MARGIN_S = 10


class _Watchdog:
    """Exits the process with a clear message if the guarded block outlives `timeout_s`."""

    def __init__(self, timeout_s: float, message: str):
        self._timer = threading.Timer(timeout_s, self._fire, args=(message,))
        self._timer.daemon = True

    @staticmethod
    def _fire(message: str) -> None:
        logger.critical("jaxdist.initialize failed: %s Exiting with status 1.", message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def __enter__(self):
        self._timer.start()

    def __exit__(self, *exc_info):
        self._timer.cancel()


class BarrierTimeoutError(TimeoutError):
    """Not every process reached a `barrier` in time.

    Attributes:
      name: the barrier's name.
      missing: ids of the processes that did not arrive.
      timeout_s: the timeout that expired.
    """

    def __init__(self, message: str, *, name: str, missing: tuple[int, ...], timeout_s: float):
        super().__init__(message)
        self.name, self.missing, self.timeout_s = name, missing, timeout_s


_barrier_counts: dict[str, int] = {}
_KV_PREFIX = "jaxdist/barrier"


def barrier(name: str, /, *, timeout_s: float = 60.0,
            process_ids: Sequence[int] | None = None) -> None:
    """Blocks until every process (or every one of `process_ids`) has called `barrier(name)`.

    Must be called on all processes (all of `process_ids`), the same number of times and in
    the same order. In a one-process job it returns at once.

    Args:
      name: identifies the barrier; the same name may be used again (each call is a new
        barrier). No "/".
      timeout_s: how long to wait for the others.
      process_ids: the processes that take part; all of them when None.

    Raises:
      BarrierTimeoutError: some processes did not arrive within timeout_s; the message and
        its `missing` attribute name them.
      ValueError: the name is empty or contains "/".

    >>> barrier("setup-done")  # one process: returns at once
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise _fail("name", name, "expected a non-empty string without '/'",
                    "pass a name such as 'after-restore'")
    state = _distributed_state()
    client = state.client
    if client is None or state.num_processes == 1:
        return
    me = state.process_id
    expected = tuple(range(state.num_processes)) if process_ids is None else tuple(process_ids)
    if me not in expected:
        raise _fail("process_ids", list(expected), f"this process ({me}) is not one of them",
                    "call barrier only on the processes listed, or add this one")
    # A subset's barrier is a different barrier from the full one of the same name.
    tag = name if process_ids is None else f"{name}@{'-'.join(map(str, expected))}"
    with _lock:
        count = _barrier_counts.get(tag, 0)
        _barrier_counts[tag] = count + 1
    directory = f"{_KV_PREFIX}/{tag}/{count}/"
    # Arrival keys let a process that times out say who is missing; the "at" key says where
    # each process last waited, which points at a mismatched barrier name.
    client.key_value_set(directory + str(me), "1")
    client.key_value_set(f"{_KV_PREFIX}-at/{me}", f"{name!r} (call #{count})",
                         allow_overwrite=True)
    from jax.errors import JaxRuntimeError
    try:
        client.wait_at_barrier(f"jaxdist:{tag}:{count}", max(1, int(timeout_s * 1000)),
                               process_ids=None if process_ids is None else list(expected))
    except JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(directory)}
        missing = tuple(p for p in expected if p not in arrived)
        who = (f"process(es) {list(missing)} of {list(expected)} did not arrive "
               f"({_last_seen(client, missing)})" if missing else
               f"all of {list(expected)} arrived, the last ones after the deadline")
        raise BarrierTimeoutError(
            f"barrier {name!r} (call #{count}) timed out after {timeout_s:g} s on process {me}: "
            f"{who}. Fix: call jaxdist.barrier({name!r}) on every "
            "process in the same order; check the missing processes' logs for an error or a "
            "slow step, or raise timeout_s.",
            name=name, missing=missing, timeout_s=timeout_s) from e
    client.key_value_delete(directory + str(me))


def _last_seen(client, missing: Sequence[int]) -> str:
    from jax.errors import JaxRuntimeError
    seen = []
    for p in missing:
        try:
            seen.append(f"process {p} last entered barrier "
                        f"{client.key_value_try_get(f'{_KV_PREFIX}-at/{p}')}")
        except JaxRuntimeError:
            seen.append(f"process {p} has entered no barrier")
    return "; ".join(seen)
