"""``jaxdist ps``: run one task of a parameter-server job.

::

    jaxdist ps --role ps --index 0 [--checkpoint-dir D]        # serves; needs no script
    jaxdist ps --role worker --index 1 script.py [args...]     # runs the job script as a worker
    jaxdist ps --role chief script.py [args...]                # the coordinator
    jaxdist ps launch --ps 2 --workers 3 script.py [args...]   # = jaxdist launch --ps 2 ...

The cluster comes from ``--cluster '{"chief": [...], "worker": [...], "ps": [...]}'`` or
``TF_CONFIG`` and is read by :meth:`jaxdist.ClusterSpec.from_tf_config` (addresses, ports and
indexes validated); ``--role`` / ``--index`` default to ``TF_CONFIG``'s task. Roles are
TF_CONFIG's task types. The shared token is read from ``JAXDIST_PS_TOKEN`` (never from the command
line, where other users could read it); TLS files from ``JAXDIST_PS_TLS_CERT`` / ``_KEY`` /
``_CA``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys
from collections.abc import Sequence

from jaxdist._output import RawDescriptionDefaultsHelpFormatter
from jaxdist.launch.cluster import ClusterSpec

__all__ = ["main"]


def _spec(args: argparse.Namespace) -> ClusterSpec:
    """This task's spec from --cluster / --role / --index, falling back on TF_CONFIG."""
    raw = os.environ.get("TF_CONFIG")
    if raw:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError:
            return ClusterSpec.from_tf_config(raw)  # raises the validated reader's error
    else:
        config = {}
    if not isinstance(config, dict):
        return ClusterSpec.from_tf_config(config)
    if args.cluster:
        try:
            cluster = json.loads(args.cluster)
        except json.JSONDecodeError as e:
            raise ValueError(f"--cluster is not valid JSON ({e}): {args.cluster[:200]!r}. Fix: "
                             '--cluster \'{"chief": ["h:p"], "worker": ["h:p"], "ps": ["h:p"]}\''
                             ) from None
    else:
        cluster = config.get("cluster")
    if not cluster:
        raise ValueError('no cluster: pass --cluster \'{"chief": [...], "worker": [...], '
                         '"ps": [...]}\' or set TF_CONFIG')
    task = dict(config.get("task") or {})
    if args.role is not None:
        task["type"] = args.role
    if args.index is not None:
        task["index"] = args.index
    task.setdefault("index", 0)
    return ClusterSpec.from_tf_config({"cluster": cluster, "task": task})


def _run_task(args: argparse.Namespace) -> int:
    try:
        spec = _spec(args)
        if spec.task_type not in ("chief", "worker", "ps"):
            raise ValueError(f"task type {spec.task_type!r} has no part in a parameter-server "
                             "job; expected chief, worker or ps")
    except ValueError as e:
        print(f"jaxdist ps: {e}", file=sys.stderr)
        return 2
    if spec.task_type == "ps":
        from jaxdist.ps.transport import (
            HEADER_SLACK,
            PS_SERVICE,
            PSService,
            TLSConfig,
            resolve_token,
            serve_until_stopped,
        )
        try:
            token = resolve_token(None, authenticate=not args.no_auth)
            tls = TLSConfig.from_env()
        except ValueError as e:
            print(f"jaxdist ps: {e}", file=sys.stderr)
            return 2
        address = spec.ps[spec.task_index]

        def serving(port: int) -> None:
            print(f"jaxdist ps: ps {spec.task_index} serving on {address}"
                  f"{' (TLS)' if tls else ''}{'' if token else ' WITHOUT authentication'}",
                  flush=True)

        try:
            if not (math.isfinite(args.max_message_mb) and args.max_message_mb > 0):
                raise ValueError(f"--max-message-mb {args.max_message_mb}: expected a finite "
                                 "number > 0")
            # serve() checks the TLS files and the address before binding; this prints
            # "serving on" only once the port is bound (on_serving)
            serve_until_stopped(PSService(spec.task_index, checkpoint_dir=args.checkpoint_dir),
                                address, PS_SERVICE, token=token, tls=tls,
                                max_receive_bytes=int(args.max_message_mb * (1 << 20))
                                + HEADER_SLACK, on_serving=serving)
        except (ValueError, RuntimeError) as e:
            print(f"jaxdist ps: ps {spec.task_index} on {address}: {e}", file=sys.stderr)
            return 2
        return 0
    if not args.script:
        print(f"jaxdist ps: role {spec.task_type} runs the job script: jaxdist ps --role "
              f"{spec.task_type} script.py [args...]", file=sys.stderr)
        return 2
    cluster = {"chief": list(spec.chief), "worker": list(spec.worker_tasks), "ps": list(spec.ps)}
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": spec.task_type, "index": spec.task_index}})
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxdist ps`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # one launcher for every kind of job
        from jaxdist.launch import launcher as launch
        return launch.main(argv[1:])
    p = argparse.ArgumentParser(
        prog="jaxdist ps", description="Run one task of a parameter-server job.",
        epilog="subcommands:\n  launch    start a whole job on this machine: jaxdist ps launch "
               "--ps 2 --workers 3 script.py [args] (the same as jaxdist launch --ps 2 "
               "--workers 3; jaxdist ps launch -h)",
        formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("--role", choices=("chief", "worker", "ps"), default=None,
                   help="this task's role (default: TF_CONFIG's task type); the chief "
                        "coordinates, as in tf.distribute")
    p.add_argument("--index", type=int, default=None,
                   help="this task's index within its role (default: TF_CONFIG's task index)")
    p.add_argument("--cluster", default=None,
                   help='JSON {"chief": [...], "worker": [...], "ps": [...]}')
    p.add_argument("--checkpoint-dir", default=None, help="ps role: checkpoint directory")
    p.add_argument("--max-message-mb", type=float, default=512.0,
                   help="ps role: largest request accepted (size it from the shard)")
    p.add_argument("--no-auth", action="store_true",
                   help="ps role: serve without a token (a trusted network only)")
    p.add_argument("script", nargs="?", help="the job script (chief and worker roles)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return _run_task(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
