"""``jaxdist ps``: run one task of a parameter-server job, or launch a whole job locally.

::

    jaxdist ps --role ps --index 0 [--checkpoint-dir D]        # serves; needs no script
    jaxdist ps --role worker --index 1 script.py [args...]     # runs the job script as a worker
    jaxdist ps --role coordinator script.py [args...]
    jaxdist ps launch --ps 2 --workers 3 script.py [args...]   # all of them on this machine

Addresses come from ``--cluster '{"ps": [...], "worker": [...]}'`` or ``TF_CONFIG``; ``--role`` /
``--index`` default to ``TF_CONFIG``'s task. The shared token is read from ``JAXDIST_PS_TOKEN``
(never from the command line, where other users could read it).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import jaxdist
from jaxdist.launch import free_ports

__all__ = ["main", "LocalJob", "launch_local", "free_ports"]


def _tf_config() -> dict:
    raw = os.environ.get("TF_CONFIG")
    return json.loads(raw) if raw else {}


def _run_task(args: argparse.Namespace) -> int:
    cfg = _tf_config()
    cluster = json.loads(args.cluster) if args.cluster else cfg.get("cluster")
    if not cluster or not cluster.get("ps") or not cluster.get("worker"):
        print("jaxdist ps: no cluster: pass --cluster '{\"ps\": [...], \"worker\": [...]}' or "
              "set TF_CONFIG", file=sys.stderr)
        return 2
    task = cfg.get("task", {})
    role = args.role or {"chief": "coordinator"}.get(task.get("type"), task.get("type"))
    index = args.index if args.index is not None else int(task.get("index", 0))
    if role not in ("ps", "worker", "coordinator"):
        print(f"jaxdist ps: --role must be ps, worker or coordinator (got {role!r})",
              file=sys.stderr)
        return 2
    if role == "ps":
        from jaxdist.ps.transport import PS_SERVICE, PSService, serve_until_stopped
        print(f"jaxdist ps: ps {index} serving on {cluster['ps'][index]}", flush=True)
        serve_until_stopped(PSService(index, checkpoint_dir=args.checkpoint_dir),
                            cluster["ps"][index], PS_SERVICE,
                            token=os.environ.get("JAXDIST_PS_TOKEN"))
        return 0
    if not args.script:
        print(f"jaxdist ps: role {role} runs the job script: jaxdist ps --role {role} "
              "script.py [args...]", file=sys.stderr)
        return 2
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": role, "index": index}})
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


class LocalJob:
    """The processes of a job launched on this machine by :func:`launch_local`."""

    def __init__(self, cluster: dict[str, list[str]], commands: dict[tuple[str, int], list[str]],
                 envs, log_dir: str | None):
        self.cluster = cluster  # {"ps": [addresses], "worker": [addresses]}
        self.commands, self.envs, self.log_dir = commands, envs, log_dir
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self._logs = []
        for key in commands:
            self.start(*key)

    def start(self, role: str, index: int = 0) -> subprocess.Popen:
        """(Re)starts one task with its original command."""
        out = None
        if self.log_dir:
            out = open(os.path.join(self.log_dir, f"{role}{index}.log"), "ab")
            self._logs.append(out)
        proc = subprocess.Popen(self.commands[role, index], env=self.envs[role, index],
                                stdout=out, stderr=subprocess.STDOUT if out else None)
        self.procs[role, index] = proc
        return proc

    def kill(self, role: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[role, index]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        """Waits for the coordinator; returns its exit code (raises TimeoutExpired)."""
        return self.procs["coordinator", 0].wait(timeout=timeout)

    def close(self, grace_s: float = 5.0) -> None:
        """Waits briefly for every task to exit, then kills the rest."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._logs:
            f.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close(grace_s=0 if exc[0] else 5.0)


def launch_local(script: str, script_args: Sequence[str] = (), *, num_ps: int = 2,
                 num_workers: int = 3, checkpoint_dir: str | None = None,
                 token: str | None = None, log_dir: str | None = None,
                 extra_env: dict[str, str] | None = None) -> LocalJob:
    """Starts ``num_ps`` servers, ``num_workers`` workers and a coordinator on 127.0.0.1.

    Each process gets a ``TF_CONFIG`` naming its task, ``PYTHONPATH`` with this checkout, and the
    token in ``JAXDIST_PS_TOKEN``. Use the returned job as a context manager so stragglers are
    killed.

    Returns:
      A :class:`LocalJob`.
    """
    ports = free_ports(num_ps + num_workers)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]}
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxdist.__file__)))
    base = dict(os.environ, **(extra_env or {}))
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [root, base.get("PYTHONPATH")]))
    if token is not None:
        base["JAXDIST_PS_TOKEN"] = token
    cli = [sys.executable, "-m", "jaxdist.ps.cli"]
    commands, envs = {}, {}
    tasks = ([("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
             + [("coordinator", 0)])
    for role, index in tasks:
        env = dict(base, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": role, "index": index}}))
        cmd = [*cli, "--role", role, "--index", str(index)]
        if role == "ps":
            cmd += ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
        else:
            cmd += [script, *script_args]
        commands[role, index], envs[role, index] = cmd, env
    return LocalJob(cluster, commands, envs, log_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxdist ps`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        p = argparse.ArgumentParser(prog="jaxdist ps launch", description="Start a whole "
                                    "parameter-server job on this machine (one process per task).")
        p.add_argument("--ps", type=int, default=2, help="number of parameter servers (default 2)")
        p.add_argument("--workers", type=int, default=3, help="number of workers (default 3)")
        p.add_argument("--checkpoint-dir", default=None,
                       help="directory where each server checkpoints its shard")
        p.add_argument("--timeout", type=float, default=None, help="seconds; kill after")
        p.add_argument("script", help="the job script; the coordinator and workers run it")
        p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
        a = p.parse_args(argv[1:])
        with launch_local(a.script, a.script_args, num_ps=a.ps, num_workers=a.workers,
                          checkpoint_dir=a.checkpoint_dir) as job:
            return job.wait(timeout=a.timeout)
    p = argparse.ArgumentParser(
        prog="jaxdist ps", description="Run one task of a parameter-server job.",
        epilog="subcommands:\n  launch    start a whole job on this machine: jaxdist ps launch "
               "--ps 2 --workers 3 script.py [args] (jaxdist ps launch -h)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("ps", "worker", "coordinator"), default=None,
                   help="this task's role (default: TF_CONFIG's task type)")
    p.add_argument("--index", type=int, default=None,
                   help="this task's index within its role (default: TF_CONFIG's task index)")
    p.add_argument("--cluster", default=None, help='JSON {"ps": [...], "worker": [...]}')
    p.add_argument("--checkpoint-dir", default=None, help="ps role: checkpoint directory")
    p.add_argument("script", nargs="?", help="the job script (worker and coordinator roles)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return _run_task(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
