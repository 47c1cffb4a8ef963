"""Joining and synchronising a multi-process job: `initialize`, `barrier`.

`initialize` joins the JAX distributed runtime for the `ClusterSpec` it is given or finds in
the environment (see `jaxdist.cluster`), with a bounded wait and clear errors; `barrier`
synchronises processes over the runtime's coordination service and, unlike
`multihost_utils.sync_global_devices`, gives up after a timeout naming who did not arrive.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from jaxdist.launch import compile_cache
from jaxdist.launch._placement import slurm_local_device_ids
from jaxdist.launch.cluster import (
    ENV_JOIN_ON_IMPORT,
    ENV_NUM_PROCESSES,
    ClusterSpec,
    _fail,
    cluster_from_environment,
    split_address,
)
from jaxdist.launch.cluster import BarrierTimeoutError as BarrierTimeoutError
from jaxdist.launch.cluster import CoordinatorTimeoutError as CoordinatorTimeoutError

logger = logging.getLogger(__name__)


_lock = threading.Lock()
_current: ClusterSpec | None = None


def current_cluster() -> ClusterSpec | None:
    """The spec `initialize` joined, or None before `initialize`."""
    return _current


def initialize(cluster: ClusterSpec | None = None, *,
               timeout_s: float | None = None) -> ClusterSpec:
    """Joins the multi-process job; call it first, on every process, before other JAX calls.

    The spec is `cluster` if given, else `TF_CONFIG`, else `JAXDIST_*` (set by `jaxdist
    launch`), else whatever `jax.distributed.initialize()` detects (SLURM, Open MPI,
    Kubernetes, Cloud TPU); with none of those this is a one-process job. A one-process job,
    a ps task and an evaluator task do not start JAX's distributed runtime. Under SLURM, a
    task bound to its own GPUs (``--gpus-per-task``) drives those, and a node's only task all
    of the node's GPUs, where JAX alone would pick GPU ``SLURM_LOCALID``.

    Calling it again with the same job (coordinator, process count and id) or with no spec is
    a no-op that returns the current spec.

    Args:
      cluster: an explicit spec.
      timeout_s: how long to wait for the coordinator and for all processes to join (default:
        ``$JAXDIST_INIT_TIMEOUT``, set by ``jaxdist launch --init-timeout``, else 300 s). A
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
    if timeout_s is None:
        timeout_s = float(os.environ.get("JAXDIST_INIT_TIMEOUT") or 300.0)
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
        if spec.is_jax_process:
            compile_cache.off_for_multiprocess_cpu(spec.num_processes)
        _current = spec
        return spec


def join_if_launched() -> ClusterSpec | None:
    """Joins the job ``jaxdist launch`` started this process in; ``import jaxdist`` calls it.

    The launcher gives each process of an SPMD job everything ``initialize`` needs, and a
    ``@jaxdist.mirrored`` script must train one job, not one per process; JAX's runtime can only be
    joined before its backend starts, which the script's first array does, so the join happens
    here rather than when a strategy is first used. The launcher's marker is removed so that
    processes the script starts (data workers, a side-car evaluator) do not try to join too.
    ``JAXDIST_JOIN_ON_IMPORT=0`` in the launcher's environment leaves the join to the script
    (``jaxdist.initialize()`` or ``jax.distributed.initialize(...)``). Nothing happens for a
    process that already joined, or whose backend has started (a strategy then says what to do).

    Returns:
      The spec joined, or None when nothing was joined here.
    """
    if not _marked_for_this_process(os.environ.pop(ENV_JOIN_ON_IMPORT, "")) or \
            _current is not None:
        return None
    try:
        spec = cluster_from_environment()
    except ValueError:
        return None  # jaxdist.initialize() (or a strategy) says what is wrong, in the script
    if spec is None or spec.num_processes <= 1 or not spec.is_jax_process:
        return None
    if _distributed_state().client is not None or _backend_started():
        return None
    joined = initialize(spec)
    _accept_the_same_join(joined)
    return joined


def _marked_for_this_process(marker: str) -> bool:
    """Whether the join marker is meant for this process: ``launcher:<pid>`` when this process's
    parent is that launcher (not a worker the script started, which inherits the marker when the
    pool starts before ``import jaxdist``), ``1`` from a user's own environment.

    >>> _marked_for_this_process("1"), _marked_for_this_process("0"), _marked_for_this_process("")
    (True, False, False)
    >>> _marked_for_this_process(f"launcher:{os.getppid()}"), _marked_for_this_process("launcher:1x")
    (True, False)
    """
    if marker == "1":
        return True
    kind, _, pid = marker.partition(":")
    return kind == "launcher" and pid.isdigit() and int(pid) == os.getppid()


def _accept_the_same_join(joined: ClusterSpec) -> None:
    """Lets the script's own ``jax.distributed.initialize(...)`` of the job it already joined on
    import be a no-op (a torchrun-style script calls it with MASTER_ADDR, WORLD_SIZE and RANK);
    JAX would raise "should only be called once". A call naming another job still raises, with
    the reason and the fix. Also for a script that bound the function before importing jaxdist
    (``from jax.distributed import initialize``): JAX's own state is asked the same way."""
    import inspect

    import jax

    original = jax.distributed.initialize
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return

    def initialize_once(*args, **kwargs):
        _same_join(joined, signature.bind_partial(*args, **kwargs).arguments)

    initialize_once.__wrapped__ = original  # type: ignore[attr-defined]
    jax.distributed.initialize = initialize_once
    try:  # JAX's private state: where it moved, a name bound early gets JAX's own error
        from jax._src import distributed as _distributed

        state = _distributed.global_state
        state_signature = inspect.signature(state.initialize)
    except (ImportError, AttributeError, TypeError, ValueError):
        return

    def state_initialize_once(*args, **kwargs):
        _same_join(joined, state_signature.bind_partial(*args, **kwargs).arguments)

    state.initialize = state_initialize_once  # type: ignore[method-assign]


def _same_join(joined: ClusterSpec, given: dict) -> None:
    """Nothing (said at INFO) when ``given`` (``initialize``'s arguments) names the job this
    process joined on import; else a RuntimeError of one line with the fix."""
    address, count, pid = (given.get("coordinator_address"), given.get("num_processes"),
                           given.get("process_id"))
    ours_port = (joined.coordinator_address or "").rpartition(":")[2]
    if ((address is None or str(address).rpartition(":")[2] == ours_port)
            and count in (None, joined.num_processes) and pid in (None, joined.process_id)):
        logger.info("jax.distributed.initialize: this process already joined %s when it "
                    "imported jaxdist; nothing to do", _job(joined))
        return
    raise RuntimeError(
        f"jax.distributed.initialize(coordinator_address={address!r}, num_processes={count!r}, "
        f"process_id={pid!r}): this process already joined {_job(joined)} when it imported "
        "jaxdist (jaxdist launch does that). Fix: leave this call out, or launch with "
        "JAXDIST_JOIN_ON_IMPORT=0 to join on your own.")


def _backend_started() -> bool:
    """Whether JAX's backend has started (JAX has no public predicate for it; where the private
    one is missing, joining is tried and JAX's own error says what went wrong)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def check_joined(what: str) -> None:
    """Raises when this process was launched as one of several but runs alone (two silent jobs).

    Args:
      what: the strategy asking, for the message.
    """
    launched = os.environ.get(ENV_NUM_PROCESSES, "1")
    if not launched.isdigit() or int(launched) <= 1 or os.environ.get("TF_CONFIG"):
        return
    import jax

    if jax.process_count() > 1:
        return
    raise RuntimeError(
        f"{what}: this process is one of {launched} ({ENV_NUM_PROCESSES}) but has not joined "
        "their job, so each would train its own copy. Fix: `import jaxdist` (or call "
        "jaxdist.initialize()) before any other JAX call, so that the process joins the job "
        "before JAX's backend starts.")


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

    arrivals = _Arrivals(port) if spec.process_id == 0 else None

    def message() -> str:  # built when the watchdog fires: process 0 can then say who came
        who = (_who_is_missing(spec, arrivals.most()) if arrivals else
               "Process 0's log says how many connected, and from where.")
        return (f"{where}: not all {spec.num_processes} processes joined the coordinator at "
                f"{spec.coordinator_address} within {timeout_s:g} s. {who} Check that all "
                f"{spec.num_processes} processes were started with the same coordinator "
                "address and process count and distinct process ids, and the logs of the "
                "missing ones.")
    try:
        with _Watchdog(remaining, message):
            jax.distributed.initialize(
                coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                process_id=spec.process_id,
                # JAX itself would fill an unset local_device_ids from SLURM's variables (those
                # of the sbatch recipes too): [SLURM_LOCALID], wrong for a bound or lone task.
                local_device_ids=(spec.local_device_ids if spec.local_device_ids is not None
                                  else slurm_local_device_ids()),
                initialization_timeout=math.ceil(remaining) + _JAX_DEADLINE_MARGIN_S)
    finally:
        if arrivals:
            arrivals.stop()
    _shutdown_at_exit()


_shutdown_registered = False  # whether `_shutdown_at_exit` has registered its handler


def _shutdown_at_exit() -> None:
    """Leaves the runtime cleanly at interpreter exit (``jax.distributed.shutdown``).

    Without it, a finished process's peers see it vanish and may abort, and schedulers that
    watch exit codes relaunch jobs that had in fact finished. A process of a launched job that
    ends on an error leaves another way (``_leave_after_error``).
    """
    global _shutdown_registered
    import atexit

    if _shutdown_registered:
        return
    _shutdown_registered = True

    def shutdown():
        import jax

        if _failure_code() is not None:  # the error path ran the handlers: no barrier now
            return
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001 - a peer already gone: nothing left to leave
            logger.info("jax.distributed.shutdown at exit: %s", e)
    atexit.register(shutdown)
    if os.environ.get("JAXDIST_LAUNCH_ID") and _distributed_state().client is not None:
        _watch_exit_code()
        import threading

        # Runs at interpreter shutdown before it joins non-daemon threads (those of a loop whose
        # peers wait in a collective would never end), however the main code ended: whatever
        # excepthook the script installed, and for sys.exit too.
        _exit_guard.start()  # now: no thread can start once the interpreter is ending
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_leave_after_error)
        else:  # pragma: no cover - CPython has had it since 3.9
            sys.excepthook = _exit_after_error(sys.excepthook)


_exit_code: list = [None]  # the status a script passed to sys.exit (None: not called)


def _watch_exit_code() -> None:
    """Records the status ``sys.exit(status)`` is called with (argparse's errors included): the
    interpreter does not tell the exit handlers why it is ending."""
    real_exit = sys.exit
    if getattr(real_exit, "_jaxdist", False):
        return

    def exit(status=None):
        _exit_code[0] = status
        real_exit(status)
    exit._jaxdist = True  # type: ignore[attr-defined]
    exit.__doc__ = real_exit.__doc__
    sys.exit = exit


def _failure_code() -> int | None:
    """The status a failing process ends with, or None when it ends normally: an uncaught
    exception (the interpreter keeps it in ``sys.last_value``, whatever the excepthook) or a
    non-zero ``sys.exit``."""
    status = _exit_code[0]
    if status not in (None, 0):
        return status if isinstance(status, int) else 1
    last = getattr(sys, "last_value", None)
    if last is not None and not (isinstance(last, SystemExit) and last.code in (None, 0)):
        return 1
    return None


_LEAVE_HANDLERS_S = 10.0  # how long a failing process gives the exit handlers


def _leave_after_error() -> None:
    """Ends a failing process of a launched job within seconds, keeping what its code wrote.

    The normal exit would wait for the loop's threads and then run ``jax.distributed.shutdown()``,
    whose barrier waits for every peer while the peers wait for this process inside the step's
    collective: the job hung until the hang timeout blamed a healthy rank. What the shutdown is
    for (peers that see a clean leave) does not apply to a process that failed: the launcher
    ends the group as soon as one exits. So: the script's ``atexit`` handlers (at most
    ``_LEAVE_HANDLERS_S``, bounded by ``_exit_guard``; ``logging.shutdown`` is one of them, and
    JAX's own finds no runtime to leave unless the peers leave too: ``_detach_from_the_job``),
    every open file flushed, the heartbeat's last progress written, then ``os._exit`` with the
    failure's status.
    """
    code = _failure_code()
    if code is None:
        return
    try:
        _mark_failing()
        import atexit

        from jaxdist.launch import heartbeat

        beat = heartbeat._current  # made by the training loop, if it ran
        if beat is not None:
            beat.close()
        if not getattr(getattr(sys, "last_value", None), "peers_leave_too", False):
            _detach_from_the_job()
        # On this (the main) thread: Python 3.12 starts no thread once the interpreter is ending.
        _exit_guard.arm(code)
        atexit._run_exitfuncs()
        _flush_open_files()
    finally:
        os._exit(code)


_detached: list = []  # the runtime's objects a failing process let go of, kept alive to the end


def _detach_from_the_job() -> None:
    """Makes JAX's own exit handler find no runtime to leave: its ``jax.distributed.shutdown``
    waits in a barrier for every peer, and the peers of a process that failed on its own wait
    for it in the step's collective, so the process would wait out ``_LEAVE_HANDLERS_S`` (the
    launcher ends the peers once it exits). The objects are kept, not destroyed: a destructor
    could wait the same way. Not for an error every process knows of at once (an exception
    with ``peers_leave_too``, such as a joiner's ``StateMismatchError``): the others then leave
    cleanly, and their shutdown waits for this process's until JAX's heartbeat timeout."""
    state = _distributed_state()
    for name in ("preemption_sync_manager", "client", "service"):
        _detached.append(getattr(state, name, None))
        setattr(state, name, None)


class _ExitGuard:
    """A thread started while the process runs that, once armed by a failing exit, ends the
    process ``_LEAVE_HANDLERS_S`` later if the exit handlers have not finished (one of them may
    wait for a peer that will never come). It has to exist beforehand: from Python 3.12 on, no
    thread can be started at interpreter shutdown, where ``_leave_after_error`` runs."""

    def __init__(self) -> None:
        self._armed = threading.Event()
        self._code = 1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxdist-exit-guard",
                                            daemon=True)
            self._thread.start()

    def arm(self, code: int) -> None:
        self._code = code
        self._armed.set()

    def _watch(self) -> None:
        self._armed.wait()
        time.sleep(_LEAVE_HANDLERS_S)
        logger.warning("the exit handlers did not finish within %g s; leaving without them",
                       _LEAVE_HANDLERS_S)
        _flush_open_files()
        os._exit(self._code)


_exit_guard = _ExitGuard()


def _mark_failing() -> None:
    """Tells the launcher when this process began to fail (``statedir.mark_failing``)."""
    directory = os.environ.get("JAXDIST_STATE_DIR")
    rank = _current.process_id if _current is not None else os.environ.get("JAXDIST_PROCESS_ID")
    if not directory or rank is None:
        return
    try:
        from jaxdist.launch import statedir

        statedir.mark_failing(directory, rank)
    except OSError:  # a full /dev/shm: the launcher then names the first process it saw exit
        pass


def _flush_open_files() -> None:
    """Flushes every open file object (what the interpreter's own finalization would do)."""
    import gc
    import io

    for obj in gc.get_objects():
        try:
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a broken stream must not keep the process alive
            continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            continue


def _exit_after_error(print_error: Callable) -> Callable:
    """An excepthook that prints the error, then leaves as ``_leave_after_error`` does (for an
    interpreter without ``threading._register_atexit``)."""
    def hook(kind, value, tb):
        try:
            print_error(kind, value, tb)
        finally:
            sys.last_value = value
            _leave_after_error()
    return hook


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
            # Under SLURM, the GPUs of this task where JAX's guess ([SLURM_LOCALID]) is wrong.
            jax.distributed.initialize(
                local_device_ids=slurm_local_device_ids(),
                initialization_timeout=math.ceil(timeout_s) + _JAX_DEADLINE_MARGIN_S)
        except ValueError as e:
            # JAX's signal that no cluster environment was detected.
            if state.client is not None or "coordinator_address" not in str(e):
                raise
            logger.info("no cluster configuration found; running as a single process")
            return ClusterSpec.single_process()
    _shutdown_at_exit()
    return _adopt_running_runtime()


def _peer_connections(port: int) -> list[tuple[str, int]] | None:
    """Source ``(address, port)`` of the other processes connected to this process's coordinator.

    JAX's coordination service (hosted by process 0) names nobody when a process never
    registers, and it cannot be asked before every process has; the kernel's socket table
    can. Reads ``/proc/net/tcp{,6}`` for established connections accepted on `port` by this
    process, minus this process's own client. None where there is no such table (not Linux).
    """
    mine = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(link[8:-1])
        rows = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows += [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return None
    # Columns: sl local remote state ... uid timeout inode; 01 is ESTABLISHED.
    live = [(_proc_address(r[1]), _proc_address(r[2])) for r in rows
            if len(r) > 9 and r[3] == "01" and r[9] in mine]
    accepted = [remote for local, remote in live if local[1] == port]
    own_clients = {local for local, remote in live if remote[1] == port}
    return sorted(peer for peer in accepted if peer not in own_clients)


def _proc_address(field: str) -> tuple[str, int]:
    """("10.0.0.2", 1234) from /proc/net/tcp's "0200000A:04D2" (IPv6 and v4-mapped too)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]  # an IPv4 peer on a dual-stack socket
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(hex_port, 16)


class _Arrivals:
    """Samples `_peer_connections` while process 0 waits, keeping the fullest view.

    The processes that did connect time out at about the same moment as process 0 and exit, so
    the socket table at the deadline may already have lost them. Only connections seen in two
    samples in a row count: a peer's port probe (`_wait_for_listener`) comes and goes at once.
    """

    def __init__(self, port: int, every_s: float = 0.5):
        self._port, self._every_s = port, every_s
        self._last: set | None = None
        self._best: list[str] | None = None
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="jaxdist-arrivals", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._sample()
            self._stopped.wait(self._every_s)

    def _sample(self) -> None:
        peers = _peer_connections(self._port)
        if peers is None:
            return
        stable = set(peers) & self._last if self._last is not None else set()
        self._last = set(peers)
        if self._best is None or len(stable) > len(self._best):
            self._best = sorted(host for host, _ in stable)

    def most(self) -> list[str] | None:
        """Hosts of the most connections seen at once (one entry per connection); None without
        a socket table."""
        return self._best

    def stop(self) -> None:
        self._stopped.set()


def _who_is_missing(spec: ClusterSpec, peers: list[str] | None) -> str:
    """Process 0's account of which processes have connected to its coordinator and which not."""
    others = spec.num_processes - 1
    if peers is None:
        return ""
    came = ", ".join(f"{h} ({peers.count(h)})" for h in sorted(set(peers)))
    text = (f"{len(peers)} of the {others} other processes connected (from {came}); "
            f"{max(others - len(peers), 0)} did not." if peers else
            f"None of the {others} other processes connected.")
    if len(spec.workers) != spec.num_processes or len(peers) >= others:
        return text  # the job's addresses are unknown (JAXDIST_* / scheduler): counts only
    hosts = {pid: split_address(spec.workers[pid])[0] for pid in range(1, spec.num_processes)}
    coordinator, me = split_address(spec.coordinator_address)[0], socket.gethostname()
    resolved = _resolve_all({*hosts.values(), coordinator, me})
    local = {"127.0.0.1", "::1"} | resolved[coordinator] | resolved[me]
    by_host: dict[frozenset, list[int]] = {}
    unknown = []
    for pid, host in hosts.items():
        addresses = resolved[host]
        if not addresses:
            unknown.append(pid)  # not resolved here: cannot tell whether it came
            continue
        key = frozenset({"this host"} if addresses & local else addresses)
        by_host.setdefault(key, []).append(pid)
    missing = []
    for key, pids in by_host.items():
        seen = sum(1 for h in peers if (h in local and "this host" in key) or h in key)
        if seen < len(pids):
            names = ", ".join(f"{pid} ({spec.workers[pid]})" for pid in pids)
            missing.append(f"process {names}" if len(pids) == 1 else
                           f"{len(pids) - seen} of processes {names}")
    if missing:
        text += f" No connection seen from: {'; '.join(missing)}."
    if unknown:
        text += f" Processes {unknown}: their hosts do not resolve here."
    return text


def _resolve_all(hosts: set[str], timeout_s: float = 3.0) -> dict[str, set[str]]:
    """``{host: addresses}``, resolved in parallel within `timeout_s` in all (empty if not)."""
    out: dict[str, set[str]] = {h: set() for h in hosts}

    def lookup(host):
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return
        out[host] = found

    threads = [threading.Thread(target=lookup, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s  # DNS has no timeout of its own; the exit must come
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return {h: set(a) for h, a in out.items()}


# JAX's own deadline is set past ours so that the watchdog's clear message comes first.
_JAX_DEADLINE_MARGIN_S = 10


class _Watchdog:
    """Exits the process with a clear message if the guarded block outlives `timeout_s`.

    `message` is the text, or a function that makes it when the time is up.
    """

    def __init__(self, timeout_s: float, message: str | Callable[[], str]):
        self._timer = threading.Timer(timeout_s, self._fire, args=(message,))
        self._timer.daemon = True

    @staticmethod
    def _fire(message: str | Callable[[], str]) -> None:
        if callable(message):
            try:
                message = message()
            except Exception as e:  # noqa: BLE001 - the exit must happen whatever the probe did
                message = f"(could not describe who is missing: {type(e).__name__}: {e})"
        logger.critical("jaxdist.initialize failed: %s Exiting with status 1.", message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def __enter__(self):
        self._timer.start()

    def __exit__(self, *exc_info):
        self._timer.cancel()


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
