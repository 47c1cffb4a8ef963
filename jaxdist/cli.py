"""The ``jaxdist`` command: ``train`` (the main job), ``launch``, ``ps`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
import time

STRATEGIES = ("default", "one_device", "mirrored", "central_storage")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a built-in model on built-in data",
                       description="Train a model on offline data under a distribution strategy.")
    p.add_argument("--strategy", choices=STRATEGIES, default="mirrored")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to use; on a CPU-only machine this many are simulated "
                        "(default: all local devices)")
    p.add_argument("--dataset", choices=("digits", "mnist", "synthetic"), default="digits")
    p.add_argument("--data-dir", default=None, help="directory of the MNIST IDX files (--dataset mnist)")
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _select_devices(n: int | None):
    import jax

    if n is None:
        return jax.local_devices()
    devices = jax.local_devices()
    if len(devices) < n:
        raise SystemExit(f"jaxdist train: --devices {n} but only {len(devices)} "
                         f"{jax.default_backend()} devices are available")
    return devices[:n]


def train(args: argparse.Namespace) -> int:
    import jax

    if args.devices is not None:
        if args.devices < 1:
            raise SystemExit("jaxdist train: --devices must be >= 1")
        # Only affects the CPU backend, so it is harmless when an accelerator is present.
        jax.config.update("jax_num_cpu_devices", max(args.devices, 1))
    import jaxdist
    from jaxdist import datasets, models

    devices = _select_devices(args.devices)
    if args.strategy == "mirrored":
        strategy = jaxdist.MirroredStrategy(devices)
    elif args.strategy == "central_storage":
        strategy = jaxdist.CentralStorageStrategy(devices)
    elif args.strategy == "one_device":
        strategy = jaxdist.OneDeviceStrategy(devices[0])
    else:
        strategy = jaxdist.DefaultStrategy()
    if args.dataset == "digits":
        (x, y), (xt, yt) = datasets.digits(seed=args.seed)
    elif args.dataset == "mnist":
        if not args.data_dir:
            raise SystemExit("jaxdist train: --dataset mnist needs --data-dir DIR holding the IDX files")
        (x, y), (xt, yt) = datasets.mnist(args.data_dir)
    else:
        x, y = datasets.synthetic(4096, seed=args.seed)
        xt, yt = datasets.synthetic(1024, seed=args.seed + 1)
    n = strategy.num_replicas_in_sync
    if args.batch_size % n:
        raise SystemExit(f"jaxdist train: --batch-size {args.batch_size} must be a multiple of the "
                         f"{n} replicas")
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"jaxdist {jaxdist.__version__}: {type(strategy).__name__} over {n} "
        f"{jax.default_backend()} device(s); {args.model} on {args.dataset} "
        f"({len(x)} train / {len(xt)} test), global batch {args.batch_size}")
    state = models.create_train_state(models.get(args.model), x[:1],
                                      learning_rate=args.learning_rate, seed=args.seed)
    step = strategy.step(models.classifier_train_step)
    t0 = time.perf_counter()
    hist = jaxdist.fit(step, state, strategy.distribute((x, y), args.batch_size, shuffle=True,
                                                        seed=args.seed),
                       epochs=args.epochs, eval_step=models.classifier_eval_step,
                       eval_data=strategy.distribute((xt, yt), args.batch_size),
                       verbose=0 if args.quiet else 1)
    elapsed = time.perf_counter() - t0
    for e, (loss, acc, vl, va) in enumerate(zip(*(hist.history[k] for k in (
            "loss", "accuracy", "val_loss", "val_accuracy")))):
        say(f"epoch {e + 1:3d}: loss {loss:.4f}  accuracy {acc:.4f}  "
            f"val_loss {vl:.4f}  val_accuracy {va:.4f}")
    say(f"trained {args.epochs} epochs in {elapsed:.1f}s "
        f"({args.epochs * len(x) / elapsed:,.0f} examples/s incl. compilation and evaluation)")
    final = jaxdist.evaluate(models.classifier_eval_step, hist.state,
                             strategy.distribute((xt, yt), args.batch_size))
    say(f"test accuracy: {final['accuracy']:.4f}")
    return 0


def _plan_parser(sub) -> None:
    from jaxdist import plan

    p = sub.add_parser("plan", help="predict step time and scaling efficiency on N hosts x M devices",
                       description="Predict data-parallel step time and scaling efficiency from a "
                                   "model's gradient bytes and one device's step time, and "
                                   "recommend cross_device_ops, pack_bytes and a global batch.")
    plan.add_arguments(p)


def bench(argv: list[str]) -> int:
    """``jaxdist bench NAME [args]``: runs ``benchmarks/NAME.py`` of the source checkout."""
    import os
    import runpy

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    names = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py")) if os.path.isdir(root) else []
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: jaxdist bench NAME [args]   (NAME: {', '.join(names) or 'none found'})")
        return 0 if argv else 2
    if argv[0] not in names:
        raise SystemExit(f"jaxdist bench: no benchmark {argv[0]!r}; available: {names or 'none'} "
                         f"(benchmarks ship with the source checkout, not the wheel)")
    sys.argv = [os.path.join(root, argv[0] + ".py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


def _asks_for_parameter_servers(argv: list[str]) -> bool:
    """Whether launch options (those before the script) name --ps / --workers."""
    for arg in argv:
        if arg in ("-m",) or not arg.startswith("-") and arg.endswith(".py"):
            return False
        if arg.split("=", 1)[0] in ("--ps", "--workers"):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # launch and ps pass everything after their own options to a script: parse them separately.
    if argv and argv[0] == "launch":
        if _asks_for_parameter_servers(argv[1:]):  # jaxdist launch --ps 2 --workers 3 script.py
            from jaxdist.ps import cli as ps_cli

            return ps_cli.main(["launch", *argv[1:]])
        from jaxdist import launch

        return launch.main(argv[1:])
    if argv and argv[0] == "ps":
        from jaxdist.ps import cli as ps_cli

        return ps_cli.main(argv[1:])
    if argv and argv[0] == "bench":
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="jaxdist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _plan_parser(sub)
    sub.add_parser("launch", help="run a script as N local processes (jaxdist launch -h)")
    sub.add_parser("ps", help="run a parameter-server role (jaxdist ps -h)")
    sub.add_parser("bench", help="run a benchmark from benchmarks/ (jaxdist bench -h)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "plan":
        from jaxdist import plan

        print(plan.run_cli(args))
        return 0
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
