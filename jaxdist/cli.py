"""The ``jaxdist`` command: ``train`` (the main job), ``evaluate``, ``plan``, ``launch``, ``ps`` and
``bench``.

``jaxdist train``, ``evaluate`` and ``plan`` check every option before any work starts and report a
mistake in one line naming the flag (exit status 2, argparse's); ``launch``, ``ps`` and ``bench``
parse their own options.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxdist import _output


def _plan_parser(sub) -> None:
    from jaxdist.plan import measure as plan_measure

    p = sub.add_parser("plan", help="predict step time and scaling efficiency on N hosts x M devices",
                       description="Predict data-parallel step time and scaling efficiency from a "
                                   "model's gradient bytes and one device's step time, and "
                                   "recommend cross_device_ops, pack_bytes and a global batch.")
    plan_measure.add_arguments(p)


def bench(argv: list[str]) -> int:
    """``jaxdist bench NAME [args]``: runs ``benchmarks/NAME.py`` of the source checkout."""
    import os
    import runpy

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    names = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py")) if os.path.isdir(root) else []
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: jaxdist bench NAME [args]   (NAME: {', '.join(names) or 'none found'}; "
              f"jaxdist bench NAME -h: its options and their defaults)")
        return 0 if argv else 2
    if argv[0] not in names:
        raise SystemExit(f"jaxdist bench: no benchmark {argv[0]!r}; available: {names or 'none'} "
                         f"(benchmarks ship with the source checkout, not the wheel)")
    sys.argv = [os.path.join(root, argv[0] + ".py"), *argv[1:]]
    # Each benchmark builds a plain parser of its own; `jaxdist bench NAME --help` shows defaults as
    # every other subcommand's help does.
    parse = argparse.ArgumentParser.parse_known_args
    setattr(argparse.ArgumentParser, "parse_known_args",  # noqa: B010 (mypy: no method assignment)
            lambda self, *args, **kwargs: parse(_output.show_defaults(self), *args, **kwargs))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        setattr(argparse.ArgumentParser, "parse_known_args", parse)  # noqa: B010
    return 0


# What `jaxdist --help` says above the commands (plain text: argparse prints it as it is).
_DESCRIPTION = ("TensorFlow's distribution strategies for JAX. Train on the built-in data with "
                "`jaxdist train --strategy mirrored --devices 8`; predict scaling with "
                "`jaxdist plan`.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # launch and ps pass everything after their own options to a script: parse them separately.
    if argv and argv[0] == "launch":  # SPMD (-n N) and parameter-server (--ps/--workers) jobs
        from jaxdist.launch import launcher as launch

        return launch.main(argv[1:])
    if argv and argv[0] == "ps":
        from jaxdist.ps import cli as ps_cli

        return ps_cli.main(argv[1:])
    if argv and argv[0] == "bench":
        return bench(argv[1:])
    import jaxdist

    parser = _output.ArgumentParser(prog="jaxdist", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"jaxdist {jaxdist.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (jaxdist COMMAND -h: its options)")
    from jaxdist.training import cli as train_cli

    train_cli.add_parser(sub)
    train_cli.add_evaluate_parser(sub)
    _plan_parser(sub)
    sub.add_parser("launch", help="run a script as N local processes (jaxdist launch -h)")
    sub.add_parser("ps", help="run a parameter-server role (jaxdist ps -h)")
    sub.add_parser("bench", help="run a benchmark from benchmarks/ (jaxdist bench -h)")
    args = _output.show_defaults(parser).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "evaluate":
        return train_cli.evaluate(args)
    if args.command == "plan":
        from jaxdist.plan import measure as plan_measure

        print(plan_measure.run_cli(args))
        return 0
    return train_cli.train(args)


if __name__ == "__main__":
    sys.exit(main())
