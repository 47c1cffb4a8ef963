"""`jaxdist launch`: runs N local processes of one job, with restarts.

    python -m jaxdist.launch -n 2 --devices-per-process 2 train.py --epochs 3

Each process gets `JAXDIST_COORDINATOR=127.0.0.1:PORT`, `JAXDIST_NUM_PROCESSES`,
`JAXDIST_PROCESS_ID` and `JAXDIST_RESTART_COUNT`, so `jaxdist.initialize()` joins the job with
no arguments, and torchrun's `RANK`, `LOCAL_RANK`, `WORLD_SIZE` and `LOCAL_WORLD_SIZE` (with
`GROUP_RANK`, `GROUP_WORLD_SIZE`: the host's place), for scripts written for torchrun. On a host
with GPUs each process gets its own (``jaxdist.launch._placement``). Output lines are prefixed
with the rank. When one process fails, the group is
killed; with `--max-restarts R` it is started again (on a fresh port) up to R times. SIGINT and
SIGTERM are forwarded to every process; after a grace period the stragglers are killed.
POSIX only: each process runs in its own session so that killing it kills its children too.
On Linux each process also gets a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``),
so a launcher killed with SIGKILL (which it cannot catch) takes its processes with it.

Fault tolerance (see ``docs/guides/fault_tolerance.md``): the launcher gives the job a host-local
state directory in shared memory (``JAXDIST_STATE_DIR``) where ``BackupAndRestore`` keeps the
newest completed steps (``jaxdist.memstate``), so a restarted group resumes at most one step back;
a rank that reports no completed step for ``--hang-timeout`` seconds is declared hung and handled
as a failure (``jaxdist.launch.hang``); JAX's persistent compilation cache (in that directory unless
``JAX_COMPILATION_CACHE_DIR`` is set) makes a restart skip compilation; and every process the job
started, including daemons that left its sessions, is killed when a group ends
(``jaxdist.launch.reaper``).

This module is the entry point (`run`, the command line); the process group it drives is
``jaxdist.launch.group``.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from jaxdist import _output
from jaxdist.launch import reaper
from jaxdist.launch._procs import free_ports as free_ports
from jaxdist.launch.cluster import parse_count, split_address
from jaxdist.launch.group import ENV_INIT_TIMEOUT as ENV_INIT_TIMEOUT
from jaxdist.launch.group import EXIT_HUNG as EXIT_HUNG
from jaxdist.launch.group import EXIT_TIMEOUT as EXIT_TIMEOUT
from jaxdist.launch.group import _Launcher, _Options


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `run` returns.

    Attributes:
      returncode: 0 on success; the failing rank's exit code (128 + signal number if it was
        killed by a signal); 124 on timeout; 128 + signal number when the launcher was
        interrupted.
      output: every process's lines prefixed with "[rank] ", and the launcher's own messages,
        in arrival order.
      restarts: how many times the group was restarted.
    """

    returncode: int
    output: str
    restarts: int


def run(target: Sequence[str], *, num_processes: int | None = None,
        devices_per_process: int | None = None,
        max_restarts: int = 0, port: int | None = None, timeout_s: float | None = None,
        grace_period_s: float = 20.0, env: Mapping[str, str] | None = None,
        cwd: str | None = None, num_ps: int = 0, num_workers: int = 0,
        hang_timeout_s: float | None = None, init_timeout_s: float | None = None,
        nnodes: tuple[int, int] | None = None, rdzv_endpoint: str | None = None,
        rdzv_id: str = "jaxdist", rdzv_timeout_s: float = 120.0,
        rdzv_last_call_s: float = 10.0) -> LaunchResult:
    """Runs a script as N local processes of one job and collects their output.

    Args:
      target: what follows the options on the command line: `["script.py", *args]` or
        `["-m", "module", *args]`; run with the current Python interpreter.
      num_processes: number of processes (an SPMD job; not with ``num_ps``).
      devices_per_process: on a host with GPUs, how many GPUs each process gets (default: the
        host's GPUs split evenly; process i of the host gets GPUs i*K..i*K+K-1, as JAX's
        ``local_device_ids``, see ``jaxdist.launch._placement``); elsewhere, or with
        ``JAX_PLATFORMS=cpu``, simulated CPU devices per process (sets `JAX_NUM_CPU_DEVICES`).
      max_restarts: how many times to restart the group after a failure.
      port: coordinator port; a free one is picked when None.
      timeout_s: kill the job after this many seconds (returncode 124).
      grace_period_s: after a forwarded signal, how long to wait before killing.
      env: the processes' base environment (default `os.environ`).
      cwd: the processes' working directory.
      num_ps, num_workers: instead of ``num_processes``, a parameter-server job of one chief,
        ``num_workers`` workers and ``num_ps`` servers (TF_CONFIG per task, a generated
        ``JAXDIST_PS_TOKEN``; failed workers and servers are restarted alone up to
        ``max_restarts`` times each; the chief's exit code is the job's).
      hang_timeout_s: a rank that completes no step for this long is hung: the group is killed
        and restarted (exit code 125 when no restart is left). None adapts it to the step time
        (see ``jaxdist.launch.hang``).
      init_timeout_s: how long ``jaxdist.initialize()`` waits for every process to join
        (``JAXDIST_INIT_TIMEOUT``; default 300 s).
      nnodes: ``(MIN, MAX)``: run as this host's elastic agent (``jaxdist.launch.elastic``), with
        ``num_processes`` processes here; the job runs on MIN to MAX hosts.
      rdzv_endpoint: ``HOST:PORT`` of the rendezvous store (served by the agent that can bind it).
      rdzv_id: the job's name in the store.
      rdzv_timeout_s: how long an agent waits for MIN agents before it exits.
      rdzv_last_call_s: the first round closes this long after the first registration (or
        at once with MAX agents).

    Returns:
      A `LaunchResult`.

    Raises:
      ValueError: an option is out of range, ``rdzv_endpoint`` is not ``HOST:PORT``, or the
        processes need more GPUs than the host has.

    >>> result = run(["-c", "print('hi')"], num_processes=2, timeout_s=60)
    >>> result.returncode, sorted(result.output.split("\\n"))
    (0, ['', '[0] hi', '[1] hi'])
    """
    if rdzv_endpoint is not None:
        _check_endpoint(rdzv_endpoint)
    options = _Options(num_processes, devices_per_process, max_restarts, port, timeout_s,
                       grace_period_s, num_ps, num_workers, hang_timeout_s, init_timeout_s,
                       nnodes, rdzv_endpoint, rdzv_id, rdzv_timeout_s, rdzv_last_call_s)
    lines: list[bytes] = []
    lock = threading.Lock()

    def emit(stream: str, line: bytes) -> None:
        with lock:
            lines.append(line)

    launcher = _Launcher(target, options, emit, env, cwd)
    code = launcher.run()
    return LaunchResult(code, b"".join(lines).decode("utf-8", "replace"), launcher.restarts)


def _check_endpoint(text: str) -> str:
    """Checks a ``--rdzv-endpoint`` value before anything starts; returns it.

    Raises:
      ValueError: it is not ``HOST:PORT`` with a port in 1..65535 (the message names the flag,
        what is wrong and the expected form).

    >>> _check_endpoint("head-node:29400")
    'head-node:29400'
    >>> _check_endpoint(":29611")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --rdzv-endpoint ':29611': no host; expected HOST:PORT with a port in 1..65535 ...
    """
    host, colon, port = text.rpartition(":")
    try:
        split_address(text)
    except ValueError as e:
        problem = ("no port" if not colon or not port or text.endswith("]")
                   else "no host" if not host else str(e))
        raise ValueError(f"--rdzv-endpoint {text!r}: {problem}; expected HOST:PORT with a port "
                         "in 1..65535 (an IPv6 address in brackets: [ADDR]:PORT), e.g. "
                         "--rdzv-endpoint head-node:29400") from None
    return text


# torchrun's spellings of the options that mean the same here (its underscores too).
_TORCHRUN_ALIASES = {"--num-processes": ("--nproc-per-node", "--nproc_per_node"),
                     "--max-restarts": ("--max_restarts",),
                     "--rdzv-endpoint": ("--rdzv_endpoint",), "--rdzv-id": ("--rdzv_id",),
                     "--rdzv-timeout": ("--rdzv_timeout",)}
# torchrun's options that have no equivalent of the same meaning: what to write instead.
_TORCHRUN_INSTEAD = {
    "--standalone": "leave it out: `jaxdist launch -n N script.py` is a one-host job with its own "
                    "coordinator",
    "--node-rank": "leave it out: an elastic job (--nnodes MIN:MAX --rdzv-endpoint HOST:PORT) "
                   "numbers its hosts itself",
    "--master-addr": "on one host leave it out (--port picks the port); across hosts use "
                     "--nnodes MIN:MAX --rdzv-endpoint HOST:PORT",
    "--rdzv-backend": "leave it out: the rendezvous store is jaxdist's own (--rdzv-endpoint)",
}
_LEAVE_OUT = "leave it out: jaxdist launch has no such option; "
_TORCHRUN_INSTEAD.update({
    "--rdzv-conf": "leave it out: the rendezvous has its own options (--rdzv-timeout, "
                   "--rdzv-last-call)",
    "--monitor-interval": _LEAVE_OUT + "a process's exit is seen at once, a hang by "
                                       "--hang-timeout",
    "--start-method": _LEAVE_OUT + "every process is a fresh interpreter (a subprocess)",
    "--role": _LEAVE_OUT + "every process of an SPMD job has the same role",
    "--tee": _LEAVE_OUT + "every process's output is printed, prefixed with its rank",
    "--redirects": _LEAVE_OUT + "every process's output is printed, prefixed with its rank",
    "--log-dir": _LEAVE_OUT + "redirect the launcher's output (every line names its rank)",
    "--logs-specs": _LEAVE_OUT + "redirect the launcher's output (every line names its rank)",
    "--local-ranks-filter": _LEAVE_OUT + "every line names its rank: filter it with grep",
    "--local-addr": _LEAVE_OUT + "each host's address comes from its rendezvous registration",
    "--no-python": _LEAVE_OUT + "the target is a Python script or -m module",
    "--run-path": _LEAVE_OUT + "give the script's path (script.py) or -m module",
})
_TORCHRUN_INSTEAD.update({"--node_rank": _TORCHRUN_INSTEAD["--node-rank"],
                          "--master_addr": _TORCHRUN_INSTEAD["--master-addr"],
                          "--master-port": _TORCHRUN_INSTEAD["--master-addr"],
                          "--master_port": _TORCHRUN_INSTEAD["--master-addr"],
                          "--rdzv_backend": _TORCHRUN_INSTEAD["--rdzv-backend"],
                          **{o.replace("-", "_").replace("__", "--", 1): _TORCHRUN_INSTEAD[o]
                             for o in ("--rdzv-conf", "--monitor-interval", "--start-method",
                                       "--log-dir", "--logs-specs", "--local-ranks-filter",
                                       "--local-addr", "--no-python", "--run-path")},
                          "-r": _TORCHRUN_INSTEAD["--redirects"],
                          "-t": _TORCHRUN_INSTEAD["--tee"]})

_VALUE_OPTIONS = {"-n", "--num-processes", "--devices-per-process", "--max-restarts", "--port",
                  "--timeout", "--grace-period", "--ps", "--workers", "--hang-timeout",
                  "--init-timeout", "--nnodes", "--rdzv-endpoint", "--rdzv-id",
                  "--rdzv-timeout", "--rdzv-last-call",
                  *(a for names in _TORCHRUN_ALIASES.values() for a in names),
                  *(o for o in _TORCHRUN_INSTEAD if o not in ("--standalone", "--no-python"))}


def _torchrun_mistake(options_argv: Sequence[str]) -> str | None:
    """One line for a torchrun option that means something else here (None: none given)."""
    for arg in options_argv:
        name = arg.split("=", 1)[0]
        if name in _TORCHRUN_INSTEAD:
            return f"{name} is torchrun's; {_TORCHRUN_INSTEAD[name]}"
    return None


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's options and the target (script or -m module + args)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if arg == "-m" or not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in _VALUE_OPTIONS else 1
    return list(argv), []


def _count(flag: str):
    """An argparse type: ASCII decimal digits only (``int`` also takes " 2 " and "٢")."""

    def parse(text: str) -> int:
        try:
            return parse_count(flag, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "integer"
    return parse


_MAX_SECONDS = 1e7  # about 116 days: longer is a typo, and time arithmetic stays exact


def _seconds(*, above: float | None = None, at_least: float | None = None,
             example: float) -> Callable[[str], float]:
    """An argparse type for a duration: finite (``nan`` and ``inf`` would wait for ever) and in
    range, with the one-line error of ``jaxdist._output.real``."""
    return _output.real(above=above, at_least=at_least, at_most=_MAX_SECONDS, example=example)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxdist launch",
        usage="%(prog)s (-n N | --ps P --workers W) [options] (script.py | -m module) "
              "[args ...]",
        description="Run N local processes of one multi-process JAX job, or a "
                    "parameter-server job of 1 chief, W workers and P servers.",
        formatter_class=_output.DefaultsHelpFormatter)
    parser.add_argument("-n", "--num-processes", *_TORCHRUN_ALIASES["--num-processes"],
                        type=_count("--num-processes"),
                        help="number of processes (on this host, with --nnodes); torchrun's "
                             "--nproc-per-node N is the same")
    parser.add_argument("--ps", type=_count("--ps"), metavar="P",
                        help="parameter-server job: P servers (with --workers)")
    parser.add_argument("--workers", type=_count("--workers"), metavar="W",
                        help="parameter-server job: W workers (with --ps)")
    parser.add_argument("--devices-per-process", type=_count("--devices-per-process"),
                        metavar="K",
                        help="on a host with GPUs: K GPUs per process (default: the host's "
                             "GPUs split evenly over -n); elsewhere (or with JAX_PLATFORMS=cpu): "
                             "K simulated CPU devices per process")
    parser.add_argument("--max-restarts", *_TORCHRUN_ALIASES["--max-restarts"],
                        type=_count("--max-restarts"), default=0, metavar="R",
                        help="restart the whole group up to R times after a failure "
                             "(--ps jobs: each failed worker / server, R times each)")
    parser.add_argument("--port", type=_count("--port"),
                        help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=_seconds(above=0, example=3600), metavar="SECONDS",
                        help="kill the job after this long (exit code 124)")
    parser.add_argument("--grace-period", type=_seconds(at_least=0, example=20), default=20.0,
                        metavar="SECONDS",
                        help="after forwarding SIGINT/SIGTERM, wait this long before SIGKILL")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show every output line, gloo's per-connection lines too "
                             "(also: JAXDIST_VERBOSE=1)")
    parser.add_argument("--hang-timeout", type=_seconds(above=0, example=60), metavar="SECONDS",
                        help="a rank that completes no step for this long is hung and handled "
                             "as a failure (default: 50 x the median step time, 60-300 s)")
    parser.add_argument("--init-timeout", type=_seconds(above=0, example=300), metavar="SECONDS",
                        help="how long jaxdist.initialize() waits for all processes to join "
                             "(default 300)")
    parser.add_argument("--nnodes", metavar="MIN:MAX",
                        help="elastic job: run this host's agent; the job runs on MIN to MAX "
                             "hosts (with --rdzv-endpoint)")
    parser.add_argument("--rdzv-endpoint", *_TORCHRUN_ALIASES["--rdzv-endpoint"], metavar="HOST:PORT",
                        help="the rendezvous store (the agent that can bind it serves it)")
    parser.add_argument("--rdzv-id", *_TORCHRUN_ALIASES["--rdzv-id"], default="jaxdist",
                        metavar="JOB",
                        help="the job's name in the rendezvous store")
    parser.add_argument("--rdzv-timeout", *_TORCHRUN_ALIASES["--rdzv-timeout"],
                        type=_seconds(at_least=1, example=120), default=120.0, metavar="SECONDS",
                        help="how long an agent waits for MIN agents to register")
    parser.add_argument("--rdzv-last-call", type=_seconds(at_least=0, example=10), default=10.0,
                        metavar="SECONDS",
                        help="the first round closes this long after the first agent "
                             "registered (at once when MAX have)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `jaxdist launch` and `python -m jaxdist.launch`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    options_argv, target = _split_argv(argv)
    mistake = _torchrun_mistake(options_argv)
    if mistake:
        parser.error(mistake)
    args = parser.parse_args(options_argv)
    if not target or target == ["-m"]:
        parser.error("expected a script (script.py [args]) or a module (-m module [args])")
    if args.num_processes is None and args.ps is None and args.workers is None:
        parser.error("expected -n N (an SPMD job) or --ps P --workers W (a parameter-server "
                     "job)")
    try:
        nnodes = None
        if args.nnodes is not None:
            from jaxdist.launch.elastic import parse_nnodes

            nnodes = parse_nnodes(args.nnodes)
            if args.rdzv_endpoint is None:
                raise ValueError(
                    "--nnodes 1 is torchrun's one-host job: leave out --nnodes "
                    "(`jaxdist launch -n N script.py` is one)" if nnodes == (1, 1) else
                    f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every "
                    "host: where one of them serves the rendezvous store)")
        if args.rdzv_endpoint is not None:
            _check_endpoint(args.rdzv_endpoint)
        options = _Options(args.num_processes, args.devices_per_process, args.max_restarts,
                           args.port, args.timeout, args.grace_period, args.ps or 0,
                           args.workers or 0, args.hang_timeout, args.init_timeout,
                           nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_timeout,
                           args.rdzv_last_call)
    except ValueError as e:
        parser.error(str(e))
    lock = threading.Lock()
    verbose = args.verbose or _output.verbose_from_env()
    folder = None if verbose else _output.TracebackFolder()  # a survivor's peer-death traceback

    def emit(stream: str, line: bytes) -> None:
        if not _output.keep_line(line, verbose):
            return  # gloo's "[Gloo] Rank N is connected" chatter (see jaxdist/_output.py)
        out = sys.stdout if stream == "stdout" else sys.stderr
        with lock:  # whole lines only, so ranks never interleave within a line
            lines = folder.feed(line) if folder is not None and stream == "stderr" else [line]
            write(out, lines)

    def write(out, lines: list[bytes]) -> None:
        try:
            for line in lines:
                out.buffer.write(line)
            out.buffer.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (`| head`); keep draining so children never block

    try:
        launcher = _Launcher(target, options, emit, None, None)
    except ValueError as e:  # too few GPUs for -n x --devices-per-process: before anything starts
        parser.error(str(e))
    # Orphaned descendants (daemons that left the ranks' sessions) become ours to kill and reap.
    launcher.subreaper = reaper.become_subreaper()
    previous = {sig: signal.signal(sig, lambda signum, _: launcher.request_stop(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    from jaxdist.launch.rendezvous import RendezvousError  # grpc: only once a job runs

    try:
        return launcher.run()
    except RendezvousError as e:  # its message names the problem and the fix: no traceback
        sys.stderr.write(f"jaxdist launch: error: {e}\n")
        sys.stderr.flush()
        return 1
    finally:
        if folder is not None:
            with lock:
                write(sys.stderr, folder.flush())  # a traceback cut off by its process's end
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
