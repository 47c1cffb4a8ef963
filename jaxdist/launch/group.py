"""The process group behind `jaxdist launch`: spawning the ranks, reading their output,
watching for failures and hangs, restarting, and killing everything the job started.

`jaxdist.launch` is the entry point (`run`, the CLI); `jaxdist.launch.elastic`'s agents drive a
`_Launcher` round by round.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from jaxdist.launch import _owned, _placement, compile_cache, reaper, statedir
from jaxdist.launch._procs import describe_exit, exit_code, free_ports
from jaxdist.launch.cluster import (
    ENV_COORDINATOR,
    ENV_JOIN_ON_IMPORT,
    ENV_LAST_FAILURE,
    ENV_LAST_FAILURE_STEP,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_PS_TOKEN,
    ENV_RESTART_COUNT,
    ClusterSpec,
    split_address,
)
from jaxdist.launch.hang import HangDetector, request_stacks, stack_ranks, waited_for
from jaxdist.launch.hang import process_state as hang_process_state
from jaxdist.launch.heartbeat import ENV_STATE_DIR, heartbeat_path

_PREFIX = "jaxdist launch: "
EXIT_TIMEOUT = 124
EXIT_HUNG = 125
ENV_INIT_TIMEOUT = "JAXDIST_INIT_TIMEOUT"
# How long, in all, to wait for the output readers once a group's processes are gone.
_READER_JOIN_S = 2.0
# How long hung ranks get to print their Python stacks before the group is killed.
_STACKS_S = 2.0
# How long the survivors of a failure get to write their newest copy of the state (plus a
# second per 500 MB of it).
_FLUSH_S = 3.0
_FIRST_FAILURE_WAIT_S = 12.0  # a failing process's exit handlers get 10 s (runtime._LEAVE_HANDLERS_S)
_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Exit|Interrupt|Full|Failure)|"
                         r"[\w.]*BadZipFile|Killed|Segmentation fault|Fatal Python error)\b.*")


@dataclasses.dataclass(frozen=True)
class _Options:
    num_processes: int | None
    devices_per_process: int | None = None
    max_restarts: int = 0
    port: int | None = None
    timeout_s: float | None = None
    grace_period_s: float = 20.0
    num_ps: int = 0
    num_workers: int = 0
    hang_timeout_s: float | None = None
    init_timeout_s: float | None = None
    nnodes: tuple[int, int] | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "jaxdist"
    rdzv_timeout_s: float = 120.0
    rdzv_last_call_s: float = 10.0

    def __post_init__(self):
        def check(name, ok, expected):
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected {expected}.")
        if self.num_ps or self.num_workers:
            check("num_ps", self.num_ps >= 1, "an integer >= 1 with --workers")
            check("num_workers", self.num_workers >= 1, "an integer >= 1 with --ps")
            check("num_processes", self.num_processes is None,
                  "no -n with --ps/--workers (the job is 1 chief + workers + ps)")
            return check("port", self.port is None, "no --port with --ps/--workers")
        check("num_processes", self.num_processes is not None and self.num_processes >= 1,
              "an integer >= 1")
        check("devices_per_process",
              self.devices_per_process is None or self.devices_per_process >= 1, ">= 1")
        check("max_restarts", self.max_restarts >= 0, ">= 0")
        check("port", self.port is None or 0 < self.port < 65536, "a port in 1..65535")
        check("timeout_s", self.timeout_s is None or self.timeout_s > 0, "> 0 seconds")
        check("grace_period_s", self.grace_period_s >= 0, ">= 0 seconds")
        check("hang_timeout_s", self.hang_timeout_s is None or self.hang_timeout_s > 0,
              "> 0 seconds")
        check("init_timeout_s", self.init_timeout_s is None or self.init_timeout_s > 0,
              "> 0 seconds")
        check("rdzv_endpoint", (self.nnodes is None) == (self.rdzv_endpoint is None),
              "HOST:PORT together with --nnodes (and only with it)")
        check("rdzv_id", bool(self.rdzv_id) and "/" not in self.rdzv_id,
              "a non-empty name without '/'")
        check("rdzv_timeout_s", 1 <= self.rdzv_timeout_s <= _MAX_S, "1 to 1e7 seconds")
        check("rdzv_last_call_s", 0 <= self.rdzv_last_call_s <= _MAX_S, "0 to 1e7 seconds")
        check("rdzv_id", len(self.rdzv_id) <= 128 and self.rdzv_id.isascii()
              and self.rdzv_id.isprintable(), "at most 128 printable ASCII characters")
        for name in ("timeout_s", "grace_period_s", "hang_timeout_s", "init_timeout_s"):
            value = getattr(self, name)  # nan passes every comparison above: it waits for ever
            check(name, value is None or math.isfinite(value) and value <= _MAX_S,
                  "a finite number of seconds, at most 1e7")


_MAX_S = 1e7  # the longest wait an option may ask for (about 116 days)


# Run before the rank's own interpreter: ask for SIGKILL when the parent (the launcher) dies,
# then exec the real command (the setting survives execve of a non-setuid binary). Doing this in
# a bootstrap rather than a preexec_fn keeps Python code out of the fork of a threaded parent.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the launcher died before prctl took effect\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _die_with_parent(command: list[str]) -> list[str]:
    """``command`` wrapped so that the process gets SIGKILL when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def _make_state_dir() -> tuple[str, int]:
    """A private directory for the job's in-memory state tier, in shared memory if there is one,
    and the descriptor whose lock claims it (``jaxdist.launch._owned``).

    Directories left by launchers that died without cleaning up (SIGKILL) are removed here: only
    those whose owner's lock is free, never one a live job holds (whatever its name's pid).
    """
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    _owned.remove_stale(base or tempfile.gettempdir(), r"jaxdist-state-\d+-\w+")
    _owned.remove_stale(tempfile.gettempdir(), r"jaxdist-xla-cache-\d+-\w+")
    return _owned.make(f"jaxdist-state-{os.getpid()}-", base)


def _tier_on(env: Mapping[str, str]) -> bool:
    """Whether ``JAXDIST_MEMORY_TIER`` leaves the in-memory tier on (the default).

    >>> _tier_on({}), _tier_on({"JAXDIST_MEMORY_TIER": "off"}), _tier_on({"JAXDIST_MEMORY_TIER": "1"})
    (True, False, True)
    """
    return statedir.tier_on(env.get(statedir.ENV_TIER))


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole session has exited already


class _Launcher:
    def __init__(self, target: Sequence[str], options: _Options,
                 emit: Callable[[str, bytes], None],
                 env: Mapping[str, str] | None, cwd: str | None):
        self._command = [sys.executable, *target]
        self._options = options
        self._emit = emit
        self._env = dict(os.environ if env is None else env)
        self._cwd = cwd
        self._signal: int | None = None
        self._wake = threading.Event()
        self.restarts = 0
        self._token = secrets.token_hex(8)
        self._env[reaper.ENV_LAUNCH_ID] = self._token
        # True where this process is a subreaper that starts nothing but the job (jaxdist
        # launch): once a group's processes are gone, every child left is an adopted orphan.
        self.subreaper = False
        self._state_dir: str | None = None
        self._own_state_dir = True  # made here (removed at the end), not the user's
        self._tails: dict[str, collections.deque] = {}
        self._failures: list[tuple] = []  # signatures of this job's failures, in order
        self._tier_seen: float | None = None
        self._tier_said: dict | None = None  # the tier's bounds as last announced
        self._open_line = False  # the last line shown ended with "\r" (a progress bar)
        # On a GPU host: each SPMD process's own GPUs (a ValueError, before anything starts,
        # when there are too few); a parameter-server job's processes share the GPUs.
        self._gpus = None if options.num_ps else _placement.plan_gpus(
            self._env, options.num_processes, options.devices_per_process)
        self._gpu_host = self._gpus is not None or (
            bool(options.num_ps) and _placement.visible_gpus(self._env)[0] > 0)
        if self._gpus is not None:
            self.say(self._gpus.describe())
        # The tier's settings, checked before anything starts (a usage error, not a traceback).
        self._tier = not options.num_ps and _tier_on(self._env)
        if not self._tier and options.nnodes is not None and not options.num_ps:
            raise ValueError("JAXDIST_MEMORY_TIER=0 cannot be used with --nnodes: an elastic "
                             "job re-forms from the in-memory tier; unset it")
        given = self._env.get(ENV_STATE_DIR)
        if self._tier and given and os.path.exists(given) and not os.path.isdir(given):
            raise ValueError(f"{ENV_STATE_DIR}={given!r} is a file, not a directory: point it at "
                             "a directory (a kept state, say) or unset it")
        token = self._env.get("JAXDIST_RDZV_TOKEN")
        if options.nnodes is not None and token and not (token.isascii() and token.isprintable()):
            # gRPC sends it as a header: anything else failed every call ("Invalid metadata")
            raise ValueError(f"JAXDIST_RDZV_TOKEN={token!r}: expected printable ASCII characters "
                             "(e.g. the output of `openssl rand -hex 16`), the same on every host")

    def say(self, message: str) -> None:
        # On its own line: after a rank's progress bar (a line ended by "\r") the terminal's
        # cursor is still on the bar, which the message would overwrite.
        start = b"\n" if self._open_line else b""
        self._open_line = False
        self._emit("stderr", start + (_PREFIX + message + "\n").encode())

    # What the elastic agent (elastic.Agent) reads of this launcher, besides say, restarts,
    # repeated and end_group.
    @property
    def options(self) -> _Options:
        return self._options

    @property
    def stop_signal(self) -> int | None:
        """The signal this launcher was asked to stop with (SIGKILL after a second); None before."""
        return self._signal

    @property
    def state_dir(self) -> str | None:
        """The state directory its processes share (heartbeats, the in-memory tier); None when off."""
        return self._state_dir

    @property
    def last_failure(self) -> str:
        """How this job's last failure was described ("" before any)."""
        return self._failures[-1][3] if self._failures else ""

    def request_stop(self, signum: int) -> None:
        """Called from a signal handler: forward `signum`; a second signal kills at once."""
        self._signal = signal.SIGKILL if self._signal is not None else signum
        self._wake.set()

    def run(self) -> int:
        options = self._options
        deadline = None if options.timeout_s is None else time.monotonic() + options.timeout_s
        if self._env.pop("TF_CONFIG", None) is not None:
            self.say("ignoring TF_CONFIG: the launcher defines the cluster")
        if options.num_ps:
            try:
                return self._run_ps_job(deadline)
            finally:
                reaper.kill_tagged(self._token)
        # JAXDIST_MEMORY_TIER=0 turns the in-memory tier off (what restarts cost without it).
        if self._tier:
            given = self._env.get(ENV_STATE_DIR)
            if given:  # the user's (a kept tier to resume from, say): used, never removed
                self._state_dir, self._own_state_dir = given, False
                os.makedirs(given, exist_ok=True)
            else:
                self._state_dir, self._state_lock = _make_state_dir()
        code = 1
        try:
            if options.nnodes is not None:
                from jaxdist.launch.elastic import Agent, host_timeout_from_env

                code = Agent(self, nnodes=options.nnodes, endpoint=options.rdzv_endpoint,
                             rdzv_id=options.rdzv_id, nproc=options.num_processes,
                             max_restarts=options.max_restarts,
                             rdzv_timeout_s=options.rdzv_timeout_s,
                             host_timeout_s=host_timeout_from_env(),
                             last_call_s=options.rdzv_last_call_s).run()
            else:
                code = self._run_spmd(deadline)
            return code
        finally:
            reaper.kill_tagged(self._token)
            if getattr(self, "_cache_dir", None) is not None:
                shutil.rmtree(self._cache_dir, ignore_errors=True)
            if self._state_dir is not None and self._own_state_dir:
                self._keep_or_remove_state(failed=code != 0 and self._signal is None)
            for fd in (getattr(self, "_cache_lock", None), getattr(self, "_state_lock", None)):
                if fd is not None:
                    os.close(fd)  # gives the claim up (a kept directory is not reaped: its name)

    def _run_spmd(self, deadline: float | None) -> int:
        options = self._options
        for attempt in range(options.max_restarts + 1):
            port = options.port or free_ports(1)[0]
            code, failure = self._run_group(attempt, port, deadline)
            if failure is None or self._signal is not None or failure == "timeout":
                return code
            if attempt == options.max_restarts:
                self.say(f"job failed: {failure}" + (
                    f" (after {attempt} restart(s))" if attempt else ""))
                return code
            if self.repeated(failure):
                return code
            self.restarts += 1
            self.say(f"{failure}; restarting the group "
                     f"(restart {attempt + 1} of {options.max_restarts})")
        raise AssertionError("unreachable")

    def _compile_cache(self) -> str:
        import tempfile

        if getattr(self, "_cache_dir", None) is None:
            self._cache_dir, self._cache_lock = _owned.make(
                f"jaxdist-xla-cache-{os.getpid()}-", tempfile.gettempdir())
        return self._cache_dir

    def _cache_hangs(self, env: Mapping[str, str], num_processes: int) -> bool:
        """Whether this job's processes would hang reading executables from a persistent cache
        (several processes on the CPU under jax 0.12: `compile_cache.cache_hangs`); said once."""
        cpu = self._options.devices_per_process is not None and self._gpus is None
        hangs = compile_cache.cache_hangs(num_processes,
                                          env.get("JAX_PLATFORMS") or ("cpu" if cpu else ""))
        if hangs and not getattr(self, "_said_cache_off", False):
            self._said_cache_off = True
            self.say("no persistent compilation cache for this job: on this JAX (0.12), the "
                     "executables of a multi-process job on the CPU, read back from one, hang in "
                     "their collectives")
        return hangs

    def child_env(self, extra: Mapping[str, str], attempt: int, *,
                  local_rank: int | None = None, group_rank: int = 0,
                  group_world_size: int = 1) -> dict[str, str]:
        """A process's environment: ``extra`` (its ``JAXDIST_*`` or TF_CONFIG) over the job's.

        A process of the SPMD job (``local_rank`` given: its rank on this host; ``group_rank``
        and ``group_world_size``: this host's place among the job's hosts) also gets torchrun's
        variables and, on a GPU host, its own GPUs; a parameter-server task gets neither.
        """
        env = dict(self._env)
        env.update(extra)
        for name in (*_placement.TORCHRUN_VARS, "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # each process's own, never the launcher's (stale) values
        if local_rank is not None:
            env.update(_placement.torchrun_env(
                int(extra[ENV_PROCESS_ID]), int(extra[ENV_NUM_PROCESSES]), local_rank,
                self._options.num_processes, group_rank, group_world_size))
            # torchrun's rendezvous address: the job's coordinator (as torchrun's MASTER_*).
            env["MASTER_ADDR"], port = split_address(extra[ENV_COORDINATOR])
            env["MASTER_PORT"] = str(port)
            if self._gpus is not None:
                env.update(self._gpus.env(local_rank))
        if self._gpu_host:
            env.update(_placement.gpu_host_env(env, self._options.hang_timeout_s,
                                               shared=local_rank is None))
        env[ENV_RESTART_COUNT] = str(attempt)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)  # never the launcher's own (stale) value
        if local_rank is not None:  # a process of the SPMD job
            env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)  # torchrun's name for it
            if env.get(ENV_JOIN_ON_IMPORT, "").strip() != "0":
                # `import jaxdist` joins the job. The marker names this launcher, the process's
                # parent: a worker pool the script started before importing jaxdist inherits it,
                # but its workers' parent is the script, so they do not join.
                env[ENV_JOIN_ON_IMPORT] = f"launcher:{os.getpid()}"
        for name in (ENV_LAST_FAILURE, ENV_LAST_FAILURE_STEP):
            env.pop(name, None)
        if attempt and self._failures:  # what a resumed run's line says failed, and when
            _, _, _, description, step = self._failures[-1]
            env[ENV_LAST_FAILURE] = description
            if step is not None:
                env[ENV_LAST_FAILURE_STEP] = str(step)
        env.pop(ENV_STATE_DIR, None)
        # A second run, and every restart, reads its compiled steps from the persistent cache
        # (jaxdist.launch.compile_cache: on by default; the launcher's own environment may turn
        # it off). The cache lives on disk, not in the tier's shared memory: a full /dev/shm must
        # not leave truncated entries that every restart reads again.
        cached = compile_cache.cache_env({**os.environ, **env})
        # Cache turned off: restarts of this job still skip compilation (its own cache, removed
        # with the job).
        own = (self._state_dir is not None and not cached
               and not env.get("JAX_COMPILATION_CACHE_DIR"))
        # Neither, where the job's executables would hang when read back from a cache.
        if (local_rank is not None and (cached or own)
                and self._cache_hangs(env, int(extra[ENV_NUM_PROCESSES]))):
            cached, own = {}, False
        if cached and not getattr(self, "_cache_healed", False):
            compile_cache.heal(cached.get("JAX_COMPILATION_CACHE_DIR", ""))
            self._cache_healed = True
        env.update(cached)
        if self._state_dir is not None:
            env[ENV_STATE_DIR] = self._state_dir
            if own:
                env["JAX_COMPILATION_CACHE_DIR"] = self._compile_cache()
                env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
                env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        if self._options.init_timeout_s is not None:
            env[ENV_INIT_TIMEOUT] = f"{self._options.init_timeout_s:g}"
        env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
        if self._options.devices_per_process is not None and self._gpus is None:
            env["JAX_NUM_CPU_DEVICES"] = str(self._options.devices_per_process)
            env.setdefault("JAX_PLATFORMS", "cpu")
        return env

    def record_failure(self, description: str, steps: Mapping[int, int | None],
                       ranks: Sequence[str] = ()) -> None:
        """Remembers a failure's signature: what failed, the error the ranks printed last, and
        the step it failed after (a fault that comes back is the same on all three)."""
        errors = tuple(self.last_error(r) for r in ranks)
        known = [v for v in steps.values() if v is not None]
        step = max(known, default=None)
        # A process that raised the same error is the same fault wherever it struck, whichever
        # rank raised it first; one killed (by a signal, or hung) is the same only at the same
        # step (an OOM at one batch, say).
        what = re.sub(r"pid \d+|[\d.]+ s\b", "", description)
        if any(errors):
            what = re.sub(r"\brank \d+", "rank", what)
        where = None if any(errors) else step
        self._failures.append((what, errors, where, description, step))

    def repeated(self, failure: str) -> bool:
        """True (after saying so) when the last two failures were the same: retrying a fault
        that comes back the same way spends every restart and helps nothing."""
        if len(self._failures) < 2 or self._failures[-1][:3] != self._failures[-2][:3]:
            return False
        _, errors, _, _, step = self._failures[-1]
        error = next((e for e in errors if e), None)
        where = f"after step {step}" if step is not None else "before any step"
        self.say(f"the same failure twice in a row ({failure}, {where}"
                 + (f": {error}" if error else "") + "): it comes back each time, so the job is "
                 "not restarted again. Fix its cause, then run the same command again: it "
                 "resumes from the newest backup (BackupAndRestore's directory)"
                 + (" or from the in-memory state kept below" if self._state_dir else ""))
        return True

    def last_error(self, label: str) -> str | None:
        """The last error line a process printed (a Python exception's last line, say)."""
        for line in reversed(self._tails.get(label, ())):
            if _ERROR_LINE.match(line):
                return line[:300]
        return None

    def _keep_or_remove_state(self, failed: bool) -> None:
        """A failed job's in-memory state is kept (it may be all that saves the work); a job that
        ended well removes it."""
        kept = failed and any(True for _ in statedir.slots(self._state_dir))
        if not kept:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            return
        head, name = os.path.split(self._state_dir.rstrip("/"))
        target = os.path.join(head, name.replace("jaxdist-state-", "jaxdist-state-kept-", 1))
        try:
            os.replace(self._state_dir, target)
        except OSError:
            target = self._state_dir
        for junk in ("xla-cache",):
            shutil.rmtree(os.path.join(target, junk), ignore_errors=True)
        self.say(f"the job failed; its in-memory state is kept in {target} (host memory: remove "
                 f"it with `rm -r {target}` when done). To resume from it, run the same command "
                 f"with {ENV_STATE_DIR}={target} in the environment")

    def announce_tier(self) -> None:
        """Prints rank 0's in-memory tier cadence once it is known, and again only when what a
        failure can cost changes materially (``tier_changed``), not each time the cadence adapts."""
        if self._state_dir is None:
            return
        path = statedir.tier_path(self._state_dir, 0)
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._tier_seen:
                return
            with open(path, "rb") as f:
                info = json.loads(f.read())
            self._tier_seen = mtime
            if tier_changed(self._tier_said, info):
                self._tier_said = info
                self.say(statedir.describe_tier(info))
        except (OSError, ValueError):
            pass

    def flush_survivors(self, procs: Mapping[int, subprocess.Popen]) -> None:
        """Before a failed group is killed: asks its live processes to write their newest copy
        of the state (``jaxdist.checkpoint.memstate``), and waits a few seconds for them. For a
        replicated state any survivor's copy holds the whole step, so the restart loses at
        most the steps since that copy, not since the last write."""
        if self._state_dir is None:
            return
        try:
            self._flush_survivors(procs)
        except OSError as e:  # the tier is optional: never the launcher's end (a full /dev/shm)
            self.say(f"could not ask the survivors to write their in-memory state ({e}); going on "
                     "without it")

    def _flush_survivors(self, procs: Mapping[int, subprocess.Popen]) -> None:
        d = self._state_dir
        alive = {r: p for r, p in procs.items()
                 if p.poll() is None and statedir.watches_flush(d, r)
                 and hang_process_state(p.pid) != "stopped"}
        if not alive:
            return
        token = statedir.request_flush(d)
        size = max((statedir.read_tier(d, r) or {}).get("bytes", 0) for r in alive)
        end = time.monotonic() + _FLUSH_S + size / 5e8
        while time.monotonic() < end and any(
                p.poll() is None and not statedir.flushed(d, r, token) for r, p in alive.items()):
            time.sleep(0.02)

    def dump_stacks(self, ranks: Mapping[int, int]) -> None:
        """Has the ``{rank: pid}`` processes print their Python stacks, and waits for the lines."""
        ready = stack_ranks(self._state_dir or "/nonexistent", ranks)
        if ready:
            # Said first: a rank's stack can reach the output before this thread runs again.
            self.say(f"rank(s) {list(ready)}: their Python stacks follow (all threads)")
            request_stacks(ready)
            time.sleep(_STACKS_S)

    def spawn(self, label: str, env: Mapping[str, str],
              readers: list[threading.Thread]) -> subprocess.Popen:
        """Starts one process of the job; its output lines are prefixed with ``[label] ``."""
        proc = subprocess.Popen(_die_with_parent(self._command), env=env, cwd=self._cwd,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            reader = threading.Thread(target=self._pump, args=(label, stream, pipe), daemon=True)
            reader.start()
            readers.append(reader)
        return proc

    def _run_group(self, attempt: int, port: int,
                   deadline: float | None) -> tuple[int, str | None]:
        """Runs one attempt; returns (exit code, failure description or None)."""
        n = self._options.num_processes
        procs: list[subprocess.Popen] = []
        readers: list[threading.Thread] = []
        try:
            for rank in range(n if self._state_dir is not None else 0):
                for path in (heartbeat_path(self._state_dir, rank),
                             statedir.outcome_path(self._state_dir, rank)):
                    try:  # what the previous attempt reported must not count for this one
                        os.remove(path)
                    except FileNotFoundError:
                        pass
            for rank in range(n):
                env = self.child_env(ClusterSpec(f"127.0.0.1:{port}", n, rank).to_env(), attempt,
                                     local_rank=rank)
                procs.append(self.spawn(str(rank), env, readers))
            return self._supervise(procs, deadline)
        finally:
            self.end_group(procs, readers)

    def end_group(self, procs: list[subprocess.Popen], readers: list[threading.Thread]) -> None:
        for proc in procs:  # also reaps grandchildren left behind by a finished rank
            _kill_group(proc, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        # Daemons that left the ranks' sessions (setsid) still hold the output pipes.
        reaper.kill_tagged(self._token)
        if self.subreaper:  # ... and those that also cleared their environment
            reaper.kill_children()
        end = time.monotonic() + _READER_JOIN_S
        for reader in readers:
            reader.join(timeout=max(0.0, end - time.monotonic()))

    def _run_ps_job(self, deadline: float | None) -> int:
        """A parameter-server job: one chief, ``num_workers`` workers, ``num_ps`` servers.

        Every task runs the same script with a TF_CONFIG naming its task (tf.distribute's
        convention) and the job's token in ``JAXDIST_PS_TOKEN`` (made here unless the
        environment has one). The chief's exit ends the job with its code; a worker or server
        that fails is restarted alone, on its address, up to ``max_restarts`` times each (the
        coordinator re-schedules a lost worker's closures; a server restores its checkpoint).
        """
        o = self._options
        addresses = [f"127.0.0.1:{p}" for p in free_ports(1 + o.num_workers + o.num_ps)]
        cluster = {"chief": addresses[:1], "worker": addresses[1:1 + o.num_workers],
                   "ps": addresses[1 + o.num_workers:]}
        if not self._env.get(ENV_PS_TOKEN):
            self._env[ENV_PS_TOKEN] = secrets.token_urlsafe(32)
        tasks = [(job, i) for job in ("chief", "worker", "ps") for i in range(len(cluster[job]))]
        self.say(f"parameter-server job, cluster {json.dumps(cluster)}")
        procs: dict[tuple[str, int], subprocess.Popen] = {}
        restarts = dict.fromkeys(tasks, 0)
        readers: list[threading.Thread] = []

        def start(task: tuple[str, int]) -> None:
            tf_config = json.dumps({"cluster": cluster,
                                    "task": {"type": task[0], "index": task[1]}})
            env = self.child_env({"TF_CONFIG": tf_config}, restarts[task])
            procs[task] = self.spawn(f"{task[0]} {task[1]}", env, readers)
            self.say(f"{task[0]} {task[1]} started (pid {procs[task].pid})")
        try:
            for task in tasks:
                start(task)
            while True:
                if self._signal is not None:
                    return self.forward_and_wait(list(procs.values()))
                code = procs["chief", 0].poll()
                if code is not None:
                    if code != 0:
                        self.say(f"chief {describe_exit(code)}; stopping the job")
                    grace_end = time.monotonic() + self._options.grace_period_s
                    while (any(p.poll() is None for p in procs.values())  # after Shutdown
                           and time.monotonic() < grace_end):
                        self._wake.wait(0.05)
                    return exit_code(code)
                for task in tasks[1:]:
                    code = procs[task].poll()
                    if code in (None, 0) or restarts[task] < 0:
                        continue
                    if restarts[task] < o.max_restarts:
                        restarts[task] += 1
                        self.restarts += 1
                        self.say(f"{task[0]} {task[1]} {describe_exit(code)}; restarting it "
                                 f"(restart {restarts[task]} of {o.max_restarts})")
                        start(task)
                    else:
                        self.say(f"{task[0]} {task[1]} {describe_exit(code)}; not restarted "
                                 f"(--max-restarts {o.max_restarts})")
                        restarts[task] = -1
                if deadline is not None and time.monotonic() > deadline:
                    self.say(f"timed out after {o.timeout_s:g} s; killing the job")
                    return EXIT_TIMEOUT
                self._wake.wait(0.05)
        finally:
            self.end_group(list(procs.values()), readers)

    def _first_failure(self, procs: list[subprocess.Popen], failed: list[tuple[int, int]],
                       since: float) -> tuple[int, int]:
        """The failed ``(rank, code)`` to name: the process that began to fail first, by the
        marks failing processes leave in the state directory before their exit handlers run
        (``statedir.mark_failing``), else the lowest rank that exited. A peer whose collective
        fails as soon as the failing process leaves the job (jax 0.12 on the CPU) may exit
        before that process's handlers are done: this waits for the first one's exit
        (its handlers are bounded, runtime._LEAVE_HANDLERS_S). Marks older than ``since`` (the
        attempt's start, ``time.time()``) are an earlier attempt's."""
        if self._state_dir is None:
            return failed[0]
        marks = {r: statedir.failing_since(self._state_dir, r) for r in range(len(procs))}
        started = sorted((t, r) for r, t in marks.items() if t is not None and t >= since)
        if not started:
            return failed[0]
        first = started[0][1]
        end = time.monotonic() + _FIRST_FAILURE_WAIT_S
        while procs[first].poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        code = procs[first].poll()
        return (first, code) if code not in (None, 0) else failed[0]

    def _supervise(self, procs: list[subprocess.Popen],
                   deadline: float | None) -> tuple[int, str | None]:
        detector = HangDetector(self._state_dir or "/nonexistent",
                                {r: p.pid for r, p in enumerate(procs)},
                                timeout_s=self._options.hang_timeout_s)
        host = socket.gethostname()
        next_check = 0.0
        started = time.time() - 1.0  # (the processes started just before)
        while True:
            if self._signal is not None:
                return self.forward_and_wait(procs), "interrupted"
            codes = [proc.poll() for proc in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = self._first_failure(procs, failed, started)
                others = [p for p in procs if p.poll() is None]
                self.say(f"rank {rank} {describe_exit(code)}; killing the other "
                         f"{len(others)} running process(es)")
                self.flush_survivors(dict(enumerate(procs)))
                time.sleep(0.2)  # its last lines (the error) reach the readers
                self.record_failure(f"rank {rank} {describe_exit(code)}", detector.last_steps(),
                                    [str(rank)])
                return exit_code(code), f"rank {rank} {describe_exit(code)}"
            if all(code == 0 for code in codes):
                return 0, None
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.25
                self.announce_tier()
                running = [r for r, code in enumerate(codes) if code is None]
                hung = detector.check(running)
                if hung:
                    for h in hung:
                        self.say(h.describe(host, detector.timeout_s))
                    self.say(waited_for({r: None if b is None else b.dispatched
                                         for r, b in detector.progress().items()}))
                    self.dump_stacks({r: procs[r].pid for r in running})
                    self.flush_survivors(dict(enumerate(procs)))
                    self.say(f"killing the group ({len(procs)} process(es))")
                    failure = (f"rank(s) {[h.rank for h in hung]} hung (no step for "
                               f"{detector.timeout_s:g} s)")
                    self.record_failure(failure, detector.last_steps(),
                                        [str(h.rank) for h in hung])
                    return EXIT_HUNG, failure
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, code in enumerate(codes) if code is None]
                self.say(f"timed out after {self._options.timeout_s:g} s with rank(s) "
                         f"{running} still running; killing the group")
                return EXIT_TIMEOUT, "timeout"
            self._wake.wait(0.05)

    def forward_and_wait(self, procs: list[subprocess.Popen]) -> int:
        signum = self._signal
        self.say(f"received {signal.Signals(signum).name}; forwarding it to all "
                 f"{len(procs)} processes (grace period {self._options.grace_period_s:g} s)")
        for proc in procs:
            _kill_group(proc, signum)
        grace_end = time.monotonic() + self._options.grace_period_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > grace_end or self._signal == signal.SIGKILL:
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                self.say(f"rank(s) {running} still running; killing them")
                break
            self._wake.clear()
            self._wake.wait(0.05)
        return 128 + signum

    def _pump(self, label: str, stream: str, pipe) -> None:
        # "\r" ends a line too, so that rank 0's progress bar shows while it runs.
        prefix, pending = f"[{label}] ".encode(), b""
        tail = self._tails.setdefault(label, collections.deque(maxlen=40))
        with pipe:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                pending += chunk
                start = 0
                for end in _LINE_END.finditer(pending):
                    line = pending[start:end.end()]
                    self._open_line = line.endswith(b"\r")
                    self._emit(stream, prefix + line)
                    if stream == "stderr":
                        tail.append(line.decode(errors="replace").strip())
                    start = end.end()
                pending = pending[start:]
        if pending:
            self._emit(stream, prefix + pending + b"\n")


def tier_changed(said: Mapping | None, info: Mapping) -> bool:
    """Whether the tier's bounds moved enough since the line last said them to say them again:
    at least doubled or halved (the cadence adapts to step times every few steps; a bound that
    goes 2 -> 3 -> 2 is the same promise).

    >>> tier_changed(None, {"bound": 2, "bound_all": 9})
    True
    >>> tier_changed({"bound": 2, "bound_all": 9}, {"bound": 3, "bound_all": 12})
    False
    >>> tier_changed({"bound": 2, "bound_all": 9}, {"bound": 4, "bound_all": 9})
    True
    """
    if said is None:
        return True
    for key in ("bound", "bound_all"):
        old, new = said.get(key), info.get(key)
        if not isinstance(old, (int, float)) or not isinstance(new, (int, float)):
            if old != new:
                return True
            continue
        if max(old, new) >= 2 * max(min(old, new), 1) and old != new:
            return True
    return False


_LINE_END = re.compile(rb"\r\n|\r(?!$)|\n")
