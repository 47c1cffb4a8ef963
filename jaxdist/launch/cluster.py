"""Describing a multi-process job: `ClusterSpec` and where it comes from.

A job is described by one `ClusterSpec` per process. It comes from an explicit value, from
`TF_CONFIG` (so tf.distribute launch scripts keep working), from the `JAXDIST_*` variables that
`jaxdist launch` sets, or, when none of those is set, from JAX's own detection of SLURM /
Open MPI / Kubernetes / Cloud TPU at `initialize` time. Nothing here touches JAX or the network;
joining the job and synchronising its processes live in `jaxdist.launch.runtime` (`jaxdist.initialize`,
`jaxdist.barrier`), which builds on this module and never the other way round. The errors those
raise are defined here, so `jaxdist.cluster.CoordinatorTimeoutError` and
`jaxdist.cluster.BarrierTimeoutError` name them without importing the runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
# Task types whose processes run the synchronous training job (and join JAX's runtime).
_JAX_TASK_TYPES = ("chief", "worker")

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_RESTART_COUNT = "JAXDIST_RESTART_COUNT"
# What made the launcher restart the job, and the newest step a process of it reported: a resumed
# run's line says what failed and how many steps it computes again.
ENV_LAST_FAILURE = "JAXDIST_LAST_FAILURE"
ENV_LAST_FAILURE_STEP = "JAXDIST_LAST_FAILURE_STEP"
# Set by `jaxdist launch` for each process of an SPMD job: `import jaxdist` joins the job (and
# removes the variable, so that processes the script starts do not try to join too).
ENV_JOIN_ON_IMPORT = "JAXDIST_JOIN_ON_IMPORT"
# The shared secret of a parameter-server job (`jaxdist launch --ps` makes one).
ENV_PS_TOKEN = "JAXDIST_PS_TOKEN"

_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


class CoordinatorTimeoutError(TimeoutError):
    """The coordinator did not answer within the timeout (raised by `jaxdist.initialize`)."""


class BarrierTimeoutError(TimeoutError):
    """Not every process reached a `jaxdist.barrier` in time.

    Attributes:
      name: the barrier's name.
      missing: ids of the processes that did not arrive.
      timeout_s: the timeout that expired.
    """

    def __init__(self, message: str, *, name: str, missing: tuple[int, ...], timeout_s: float):
        super().__init__(message)
        self.name, self.missing, self.timeout_s = name, missing, timeout_s


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
    if not is_decimal(port) or not 0 < int(port) < 65536:
        raise ValueError(f"port {port!r} is not an integer in 1..65535")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """``split_address``'s inverse: "host:port", an IPv6 host in brackets (as gRPC binds it).

    >>> join_address("::1", 29400), join_address("head-node", 29400)
    ('[::1]:29400', 'head-node:29400')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def is_decimal(text: str) -> bool:
    """Whether ``text`` is a plain ASCII decimal number: ``"12"``, not ``" 2 "``, ``"+2"`` or
    ``"٢"`` (``int()`` accepts all three, and any Unicode digits).

    >>> [is_decimal(t) for t in ("12", " 2 ", "+2", "\u0662", "")]
    [True, False, False, False, False]
    """
    return text.isascii() and text.isdigit()


def parse_count(name: str, text: str) -> int:
    """Parses a process count, id or port given as text (an env var, a command-line option).

    Args:
      name: what the value is, for the error (e.g. ``"JAXDIST_NUM_PROCESSES"``).
      text: the text.

    Returns:
      The integer.

    Raises:
      ValueError: ``text`` is not made only of ASCII digits 0-9.

    >>> parse_count("-n", "4")
    4
    """
    if not isinstance(text, str) or not is_decimal(text):
        raise _fail(name, text, "not an integer (only the ASCII digits 0-9, no sign, spaces or "
                    "other scripts' digits)", f"write {name} as e.g. 2")
    return int(text)


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
      ps: parameter-server addresses (TF_CONFIG's `ps` job), for `ParameterServerStrategy`.
      workers: addresses of the job's processes ordered by process id (chief first), when known.
      chief: the chief's address as a 1-tuple when the job has a `chief` task (it is then
        `workers[0]`), else `()`; `worker_tasks` are the addresses of the `worker` job.
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
    chief: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("ps", "workers", "evaluator", "chief"):
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
        if self.chief and (len(self.chief) != 1 or self.workers[:1] != self.chief):
            raise _fail("chief", self.chief, "expected one address, equal to workers[0]",
                        "list the chief first in workers and pass chief=(workers[0],)")

    @property
    def worker_tasks(self) -> tuple[str, ...]:
        """Addresses of the `worker` job (the processes after the chief, if there is one).

        >>> ClusterSpec("h0:1", 3, 0, "chief", workers=("h0:1", "h1:1", "h2:1"),
        ...             chief=("h0:1",)).worker_tasks
        ('h1:1', 'h2:1')
        """
        return self.workers[len(self.chief):]

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
            values[name] = parse_count(name, environ[name])
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
        if isinstance(addresses, Mapping):
            addresses = _dense_job(job, addresses)
        if isinstance(addresses, str) or not isinstance(addresses, Sequence):
            raise _fail(f"TF_CONFIG['cluster'][{job!r}]", addresses,
                        "expected a list of 'host:port' addresses", f'write "{job}": ["host:port"]')
        jobs[job] = tuple(addresses)
    _check_addresses({f"TF_CONFIG['cluster'][{job!r}]": a for job, a in jobs.items()})
    if len(jobs.get("evaluator", ())) > 1:
        # As tf's ClusterSpec validation: one evaluator task, which evaluates every checkpoint.
        raise _fail("TF_CONFIG['cluster']['evaluator']", list(jobs["evaluator"]),
                    "at most one evaluator is allowed (as in tf.distribute)",
                    "keep one evaluator; run further evaluations as separate jobs")
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
    if not _is_int(index):  # "0" and true (a bool is an int in Python) are not indexes
        raise _fail("TF_CONFIG['task']['index']", index,
                    f"not an integer (a JSON {type(index).__name__}); expected a number in "
                    f"0..{n - 1}", 'write the index as a JSON number, e.g. "index": 0')
    if not 0 <= index < n:
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
                       evaluator=jobs.get("evaluator", ()), chief=jobs.get("chief", ()))


def _dense_job(job: str, tasks: Mapping[Any, Any]) -> list:
    """tf's sparse job form, ``{"0": "h0:2222", "1": "h1:2222"}`` (task index -> address), as a
    list in index order; every index from 0 must be there: each task is a process of the job."""
    field = f"TF_CONFIG['cluster'][{job!r}]"
    by_index = {}
    for key, address in tasks.items():
        index = key if _is_int(key) else int(key) if isinstance(key, str) and is_decimal(key) else None
        if index is None:
            raise _fail(field, dict(tasks), f"task index {key!r} is not an integer",
                        'write the sparse form as {"0": "host:port", "1": "host:port"}')
        if index in by_index:
            raise _fail(field, dict(tasks), f"task index {index} is given twice",
                        "list each task once")
        by_index[index] = address
    missing = sorted(set(range(len(by_index))) - set(by_index))
    if missing:
        raise _fail(field, dict(tasks), f"task indexes {missing} are missing; jaxdist needs every "
                    f"task of a job from 0 to {max(by_index)}",
                    "list every task, or renumber them from 0")
    return [by_index[i] for i in range(len(by_index))]


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
