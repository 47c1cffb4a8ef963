"""``jaxdist train``: a built-in or your own model and data, under a strategy, from the command line.

Every option is checked before any work starts: its own value as it is parsed (the types of
``jaxdist._output``), then the options together (``TRAIN_CHECKS``), then against the data once it
is loaded (a global batch larger than the training set is refused: it would be one padded step an
epoch). A mistake a user can fix (a bad number, a missing directory, a bad ``module:factory``)
ends with one line, ``jaxdist train: error: ...`` naming the flag and a value that works, and exit
status 2 (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxdist import _output
from jaxdist._output import directory, duration, integer, module_factory, real

STRATEGIES = ("default", "one_device", "mirrored", "central_storage", "multi_worker", "tpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
# The strategies that keep a copy of the state per replica, which zero_stage shards.
ZERO_STRATEGIES = ("mirrored", "multi_worker", "tpu")


def _data_and_model_args(p) -> None:
    p.add_argument("--dataset", choices=("digits", "mnist", "synthetic"), default="digits")
    p.add_argument("--data-dir", default=None, type=directory(exists=True),
                   help="directory of the MNIST IDX files (--dataset mnist)")
    p.add_argument("--data", default=None, metavar="MODULE:FACTORY",
                   type=module_factory(example="mypkg.data:load"),
                   help="your own data: FACTORY() returns ((x_train, y_train), (x_test, y_test)) "
                        "numpy arrays, integer labels (replaces --dataset)")
    p.add_argument("--model", default="mlp", metavar="{mlp,cnn} | MODULE:FACTORY",
                   type=module_factory(builtins=("mlp", "cnn"), example="mypkg.models:make"),
                   help="a built-in model, or FACTORY(num_classes=...) returning a flax Module "
                        "that maps a batch of inputs to logits")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model on offline data",
                       description="Train a model on offline data under a distribution strategy.")
    p.add_argument("--strategy", choices=STRATEGIES, default="mirrored",
                   help="multi_worker: one job across the processes of `jaxdist launch -n N` "
                        "(or TF_CONFIG / JAXDIST_* / SLURM); tpu: every TPU core (TPUStrategy)")
    p.add_argument("--devices", type=integer(example=8), default=None,
                   help="devices to use; on a CPU-only machine this many are simulated "
                        "(default: all local devices)")
    _data_and_model_args(p)
    p.add_argument("--epochs", type=integer(example=10), default=10)
    p.add_argument("--batch-size", type=integer(example=128), default=128,
                   help="global batch size: a multiple of the replicas (x --accumulate), at most "
                        "the number of training examples")
    p.add_argument("--learning-rate", type=real(above=0, example="1e-3"), default=1e-3)
    p.add_argument("--precision", choices=PRECISIONS, default="float32",
                   help="mixed_* keeps float32 parameters and computes in 16 bits "
                        "(float16 with dynamic loss scaling)")
    p.add_argument("--accumulate", type=integer(example=4), default=1, metavar="K",
                   help="split each global batch into K micro-batches (gradient accumulation)")
    p.add_argument("--checkpoint-dir", default=None, type=directory(exists=False),
                   help="save a checkpoint at every epoch end (all processes, shared directory); "
                        "on a TF_CONFIG evaluator task, the directory to evaluate")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--tensorboard", default=None, metavar="DIR", type=directory(exists=False),
                   help="write TensorBoard event files (process 0)")
    p.add_argument("--seed", type=integer(at_least=0, at_most=2**63 - 1, example=0), default=0)
    p.add_argument("--zero-stage", type=integer(at_least=0, at_most=3, example=1), default=0,
                   metavar="K",
                   help="shard the state over the replicas (mirrored / multi_worker / tpu "
                        "strategies): 0 replicated, 1 optimizer state, 2 + gradients, "
                        "3 + parameters")
    p.add_argument("--steps-per-execution", type=integer(at_most=1 << 20, example=9), default=1,
                   metavar="K",
                   help="run K training steps per compiled call (Keras's steps_per_execution): "
                        "faster for small models, same numbers; callbacks run every K steps")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile from nothing (by default compiled steps are kept in "
                        "~/.cache/jaxdist/xla, or $JAXDIST_COMPILE_CACHE, so a second run does "
                        "not compile again)")


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="evaluate every checkpoint a training job writes",
                       description="The side-car evaluator: evaluate each new checkpoint in DIR as "
                                   "it appears; stop after training's final checkpoint.")
    p.add_argument("--watch", required=True, metavar="DIR", type=directory(exists=False),
                   help="the training checkpoint directory")
    _data_and_model_args(p)
    p.add_argument("--batch-size", type=integer(example=128), default=128)
    p.add_argument("--tensorboard", default=None, metavar="DIR", type=directory(exists=False),
                   help="write eval/* scalars here")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="append one JSON line per checkpoint (default: DIR/eval_log.jsonl)")
    p.add_argument("--poll", type=duration(example="1s"), default=1.0,
                   help="time between looks at DIR (e.g. 500ms, 2s; a plain number is seconds)")
    p.add_argument("--timeout", type=duration(example="1h"), default=3600.0,
                   help="give up after this long without a new checkpoint (e.g. 30min, 1h)")
    p.add_argument("--seed", type=integer(at_least=0, at_most=2**63 - 1, example=0), default=0)


def _replicas_before_jax(args) -> int | None:
    """The replica count when the options alone fix it (no JAX needed), else None."""
    if args.strategy in ("default", "one_device"):
        return 1
    if args.strategy in ("mirrored", "central_storage"):
        return args.devices
    return None


def _multiple(n: int, of: int) -> int:
    """The multiple of ``of`` nearest ``n`` (at least ``of``): the value an error suggests."""
    return max(of, round(n / of) * of)


# The checks that involve several options, run in order before any work starts: (is it wrong?,
# what to say). Each message names the flag and a value that works. Checks of one option's own
# value belong in its argparse type; a new option's cross-checks go here.
TRAIN_CHECKS: list[tuple[Callable[[Any], Any], Callable[[Any], str]]] = [
    (lambda a: a.resume and not a.checkpoint_dir,
     lambda a: "--resume needs --checkpoint-dir DIR (the directory to resume from)"),
    (lambda a: a.dataset == "mnist" and not a.data and not a.data_dir,
     lambda a: "--dataset mnist needs --data-dir DIR holding the IDX files (e.g. --data-dir "
               "~/mnist; examples/cnn_mnist.py --write-from-digits writes some)"),
    (lambda a: a.zero_stage and a.strategy not in ZERO_STRATEGIES,
     lambda a: f"--zero-stage {a.zero_stage} needs --strategy mirrored, multi_worker or tpu (the "
               f"strategies that keep a copy of the state per replica), not {a.strategy}"),
    (lambda a: a.strategy == "tpu" and a.devices is not None,
     lambda a: f"--strategy tpu runs on every TPU core; drop --devices {a.devices} (or use "
               "--strategy mirrored --devices N)"),
    (lambda a: a.batch_size % a.accumulate,
     lambda a: f"--batch-size {a.batch_size} must be a multiple of --accumulate {a.accumulate} "
               f"(e.g. --batch-size {_multiple(a.batch_size, a.accumulate)})"),
    (lambda a: _replicas_before_jax(a) and a.batch_size % (_replicas_before_jax(a) * a.accumulate),
     lambda a: _batch_message(a, _replicas_before_jax(a))),
]


def _batch_message(args, replicas: int) -> str:
    per = replicas * args.accumulate
    return (f"--batch-size {args.batch_size} must be a multiple of the {replicas} replicas"
            + (f" x --accumulate {args.accumulate}" if args.accumulate > 1 else "")
            + f" (e.g. --batch-size {_multiple(args.batch_size, per)})")


def check_train_args(args: argparse.Namespace) -> None:
    """Runs ``TRAIN_CHECKS``: the first that fails ends the command (one line, exit status 2).

    >>> import argparse
    >>> args = argparse.Namespace(resume=False, checkpoint_dir=None, dataset="digits", data=None,
    ...     data_dir=None, zero_stage=0, strategy="mirrored", devices=8, batch_size=100,
    ...     accumulate=1)
    >>> check_train_args(args)  # doctest: +SKIP
    jaxdist train: error: --batch-size 100 must be a multiple of the 8 replicas (e.g. --batch-size 96)
    """
    for wrong, message in TRAIN_CHECKS:
        if wrong(args):
            _fail(message(args))


_PROG = ["jaxdist train"]  # the command whose errors _fail reports (evaluate sets its own)


def _fail(msg: str):
    """A mistake the user can fix: one line naming the flag, exit status 2 (no traceback)."""
    _output.usage_error(_PROG[0], msg)


def _load_factory(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        _fail(f"{what} {spec!r} is not MODULE:FACTORY (e.g. {what} mypkg.models:make)")
    if os.getcwd() not in sys.path:  # `jaxdist` as a console script does not put the cwd there
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        _fail(f"{what} {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?")
    factory = getattr(module, attr, None)
    if not callable(factory):
        _fail(f"{what} {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def _load_data(args) -> tuple[tuple, tuple]:
    import numpy as np

    from jaxdist.input import datasets

    if args.data:
        factory = _load_factory(args.data, "--data")
        try:
            out = factory()
        except Exception as e:  # the user's code: one line naming it, not a traceback
            _fail(f"--data {args.data}: the factory raised {type(e).__name__}: {_one_line(e)}")
        try:
            (x, y), (xt, yt) = out
            arrays = tuple(np.asarray(a) for a in (x, y, xt, yt))
        except Exception:
            _fail(f"--data {args.data}: the factory must return ((x_train, y_train), (x_test, "
                  f"y_test)) of numpy arrays, got {type(out).__name__}")
        x, y, xt, yt = arrays
        if x.dtype.kind not in "biuf" or xt.dtype.kind not in "biuf":
            _fail(f"--data {args.data}: inputs must be numeric arrays, got {x.dtype} / {xt.dtype}")
        for name, xs, ys in (("train", x, y), ("test", xt, yt)):
            if xs.ndim == 0 or ys.ndim != 1 or len(xs) != len(ys):
                _fail(f"--data {args.data}: {name} inputs {xs.shape} and labels {ys.shape} do not "
                      "pair up; expected x [n, ...] and y [n]")
        return (x, y), (xt, yt)
    if args.dataset == "digits":
        return datasets.digits(seed=args.seed)
    if args.dataset == "mnist":
        if not args.data_dir:
            _fail("--dataset mnist needs --data-dir DIR holding the IDX files")
        try:
            return datasets.mnist(args.data_dir)
        except (OSError, ValueError) as e:
            _fail(f"--data-dir {args.data_dir}: {e}")
    # One draw, then split: train and test must share the labelling teacher.
    x, y = datasets.synthetic(5120, seed=args.seed)
    return (x[:4096], y[:4096]), (x[4096:], y[4096:])


# Classes of the built-in datasets: their labels must lie in [0, K). MNIST's IDX files (and
# drop-ins such as Fashion-MNIST) have 10.
_BUILTIN_CLASSES = {"digits": 10, "mnist": 10, "synthetic": 10}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + (" ..." if len(text) > 300 else "")


def _num_classes(args, y, yt) -> int:
    """The class count, and labels checked against it (a one-line error, never a traceback).

    Rule: a built-in dataset has a fixed count (``_BUILTIN_CLASSES``); labels outside
    ``[0, K)`` are refused. For ``--data`` the labels are ids ``0..K-1`` with ``K = max(train
    label) + 1``: a test label the training split never reaches is refused, and a K more than
    twice the number of distinct training labels (labels such as 0 and 200) is refused as not
    ids. The model is never sized from a stray large label.
    """
    import numpy as np

    source = f"--data {args.data}" if args.data else f"--dataset {args.dataset}"
    if len(y) == 0:
        _fail(f"{source}: the train split is empty (0 examples); nothing to train on")
    for name, labels in (("train", y), ("test", yt)):
        if labels.dtype.kind not in "iu":
            _fail(f"{source}: {name} labels have dtype {labels.dtype}; expected integer class "
                  "ids 0..K-1")
        if len(labels) and labels.min() < 0:
            _fail(f"{source}: {name} labels include {int(labels.min())}; class ids start at 0")
    if not args.data:
        k = _BUILTIN_CLASSES[args.dataset]
        for name, labels in (("train", y), ("test", yt)):
            if len(labels) and labels.max() >= k:
                _fail(f"{source}: {name} labels include {int(labels.max())}, but this dataset "
                      f"has {k} classes (ids 0..{k - 1}); the files are not {args.dataset} labels")
        return k
    k = int(y.max()) + 1
    if len(yt) and yt.max() >= k:
        _fail(f"{source}: test labels include {int(yt.max())}, but the training labels stop at "
              f"{k - 1}; a class the model never trains on cannot be predicted")
    distinct = len(np.unique(y))
    if k > 2 * distinct:
        _fail(f"{source}: the largest training label is {k - 1} but only {distinct} distinct "
              f"labels occur; labels must be class ids 0..K-1 (remap them, e.g. with "
              "np.unique(y, return_inverse=True))")
    return k


def _build_model(args, num_classes: int):
    from jaxdist.training import models

    if args.model in ("mlp", "cnn"):
        return models.get(args.model, num_classes)
    factory = _load_factory(args.model, "--model")
    try:
        takes = "num_classes" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes = False
    try:
        model = factory(num_classes=num_classes) if takes else factory()
    except Exception as e:  # the user's code: one line naming it, not a traceback
        _fail(f"--model {args.model}: the factory raised {type(e).__name__}: {_one_line(e)}")
    return _as_linen_like(model, args.model)


class _NNXClassifier:
    """A Flax NNX module seen through linen's ``init`` / ``apply``, which the CLI's train state
    and steps use: its ``nnx.Param`` values are the trained parameters (a plain dict, as a linen
    model's, so checkpoints and ``jaxdist evaluate`` read them alike); any other state (batch
    statistics, RNG counters) stays as the factory built it. The factory initialises the
    weights itself (its ``nnx.Rngs``), so ``--seed`` does not change them."""

    def __init__(self, module):
        from flax import nnx

        self._graphdef, params, self._rest = nnx.split(module, nnx.Param, ...)
        self._params = nnx.to_pure_dict(params)
        self._template = params

    def init(self, rng, x):
        return {"params": self._params}

    def apply(self, variables, x):
        from flax import nnx

        params = nnx.State(self._template)  # a fresh copy: replace_by_pure_dict writes in place
        nnx.replace_by_pure_dict(params, variables["params"])
        return nnx.merge(self._graphdef, params, self._rest)(x)


def _as_linen_like(model: Any, spec: str) -> Any:
    """A linen module as it is; a Flax NNX module wrapped (``_NNXClassifier``); anything else
    refused with what the factory must return."""
    if hasattr(model, "init") and hasattr(model, "apply"):
        return model
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        return _NNXClassifier(model)
    _fail(f"--model {spec}: the factory returned a {type(model).__name__}; it must return a "
          "flax.linen Module (with init / apply) or a flax.nnx Module (called as module(x), "
          "returning logits)")


def _strategy(args, devices):
    import jax

    from jaxdist import strategy as strategies

    zero_stage = getattr(args, "zero_stage", 0)
    if args.strategy == "multi_worker":
        return strategies.MultiWorkerMirroredStrategy(zero_stage=zero_stage)
    if args.strategy == "tpu":
        try:
            return strategies.TPUStrategy(zero_stage=zero_stage)
        except RuntimeError:
            _fail(f"--strategy tpu: no TPU here (JAX's backend is {jax.default_backend()}); on a "
                  'Cloud TPU VM or a Colab TPU runtime install "jaxdist[tpu]", elsewhere use '
                  "--strategy mirrored")
    if args.strategy == "mirrored":
        return strategies.MirroredStrategy(devices, zero_stage=zero_stage)
    if args.strategy == "central_storage":
        return strategies.CentralStorageStrategy(devices)
    if args.strategy == "one_device":
        return strategies.OneDeviceStrategy(devices[0])
    return strategies.DefaultStrategy()


def _callbacks(args) -> list:
    from jaxdist import callbacks
    from jaxdist.checkpoint.manager import CheckpointManager

    cbs: list = []
    if args.checkpoint_dir:
        if args.resume:
            cbs.append(callbacks.BackupAndRestore(args.checkpoint_dir))
        else:
            latest = (CheckpointManager(args.checkpoint_dir).latest_step()
                      if os.path.isdir(args.checkpoint_dir) else None)
            if latest is not None:
                _fail(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (latest "
                      f"step {latest}); pass --resume to continue from it, or use an empty directory")
            cbs.append(callbacks.ModelCheckpoint(args.checkpoint_dir))
    if args.tensorboard:
        cbs.append(callbacks.TensorBoard(args.tensorboard))
    return cbs


def _select_devices(n: int | None):
    import jax

    devices = jax.local_devices()
    if n is None:
        return devices
    if len(devices) < n:
        _fail(f"--devices {n} but only {len(devices)} {jax.default_backend()} devices are "
              f"available (e.g. --devices {len(devices)})")
    return devices[:n]


def _check_batch_against_data(args, num_examples: int, replicas: int) -> None:
    """The global batch against the replicas (known now) and the training set's size.

    A batch larger than the training set is refused rather than warned about: every epoch would be
    one step of mostly padding (1,438 digits in a batch of 5,000 trained to 0.12 accuracy), which
    is never what was meant; a batch of exactly the training set (full-batch training) is allowed.
    """
    if args.batch_size % (replicas * args.accumulate):
        _fail(_batch_message(args, replicas))
    if args.batch_size > num_examples:
        fits = num_examples // (replicas * args.accumulate) * replicas * args.accumulate
        _fail(f"--batch-size {args.batch_size} is more than the {num_examples} training examples "
              f"of {args.data or args.dataset}: each epoch would be one step, mostly padding; use "
              f"at most {num_examples} (e.g. --batch-size {min(128, fits) or fits})")


def _show_epoch_lines(args) -> bool:
    """Whether to print a line per epoch after training: not when the progress bars, which end
    showing the same metrics, are on the same terminal (the issue's "every epoch twice")."""
    return bool(args.quiet or not (sys.stdout.isatty() and sys.stderr.isatty()))


def train(args: argparse.Namespace) -> int:
    """Runs ``jaxdist train``; returns the exit status."""
    check_train_args(args)  # before JAX starts: a mistake costs no compilation
    import jax

    if args.devices is not None:
        # Only affects the CPU backend, so it is harmless when an accelerator is present.
        jax.config.update("jax_num_cpu_devices", args.devices)
    if not args.no_compile_cache:
        from jaxdist.launch import compile_cache

        compile_cache.enable()  # before the first compilation
    from jaxdist.launch.cluster import cluster_from_environment

    try:
        spec = cluster_from_environment()
    except ValueError as e:
        _fail(str(e))
    if spec is not None and spec.task_type == "evaluator":
        if not args.checkpoint_dir:
            _fail("this is a TF_CONFIG evaluator task: pass --checkpoint-dir DIR (the training "
                  "job's) to evaluate its checkpoints")
        print(f"jaxdist train: TF_CONFIG evaluator task {spec.task_index}: evaluating the "
              f"checkpoints in {args.checkpoint_dir}", flush=True)
        args.watch, args.log, args.poll, args.timeout = args.checkpoint_dir, None, 1.0, 3600.0
        return evaluate(args)
    from jaxdist._version import __version__
    from jaxdist.launch import runtime
    from jaxdist.training import fit as loop
    from jaxdist.training import models

    if args.strategy == "multi_worker":
        runtime.initialize()  # before any computation: joins the job `jaxdist launch` describes
    # --strategy mirrored without --devices is one job over every process's devices (as the
    # library's MirroredStrategy() is); a device list of its own keeps each process alone.
    every_process = args.devices is None and args.strategy == "mirrored"
    if args.strategy not in ("multi_worker", "tpu") and not every_process \
            and jax.process_count() > 1:
        print(f"jaxdist train: warning: --strategy {args.strategy} with --devices under a "
              "multi-process launch runs one independent job per process; leave out --devices "
              "(or use --strategy multi_worker) for one job across them", file=sys.stderr)
    (x, y), (xt, yt) = _load_data(args)
    strategy = _strategy(args, None if args.strategy in ("multi_worker", "tpu") or every_process
                         else _select_devices(args.devices))
    n = strategy.num_replicas_in_sync
    num_classes = _num_classes(args, y, yt)  # labels first: a wrong file beats a batch size
    _check_batch_against_data(args, len(x), n)
    cbs = _callbacks(args)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"jaxdist {__version__}: {type(strategy).__name__} over {n} "
        f"{jax.default_backend()} device(s) in {jax.process_count()} process(es); {args.model} on "
        f"{args.data or args.dataset} ({len(x)} train / {len(xt)} test), global batch "
        f"{args.batch_size}, {args.precision}"
        + (f", {args.accumulate} micro-batches per step" if args.accumulate > 1 else ""))
    model = _build_model(args, num_classes)
    state = models.create_train_state(model, x[:1], learning_rate=args.learning_rate,
                                      seed=args.seed, precision=args.precision)
    step = strategy.step(functools.partial(models.classifier_train_step, accumulate=args.accumulate))
    t0 = time.perf_counter()
    hist = loop.fit(step, state, strategy.distribute((x, y), args.batch_size, shuffle=True,
                                                        seed=args.seed),
                       epochs=args.epochs, eval_step=models.classifier_eval_step,
                       eval_data=strategy.distribute((xt, yt), args.batch_size), callbacks=cbs,
                       verbose=0 if args.quiet else 1,
                       steps_per_execution=args.steps_per_execution)
    elapsed = time.perf_counter() - t0
    if _show_epoch_lines(args):
        for epoch, (loss, acc, vl, va) in zip(hist.epochs, zip(*(hist.history[k] for k in (
                "loss", "accuracy", "val_loss", "val_accuracy")))):
            say(f"epoch {epoch + 1:3d}: loss {loss:.4f}  accuracy {acc:.4f}  "
                f"val_loss {vl:.4f}  val_accuracy {va:.4f}")
    trained = len(hist.epochs)
    say(f"trained {trained} epochs in {elapsed:.1f}s "
        f"({trained * len(x) / max(elapsed, 1e-9):,.0f} examples/s incl. compilation and evaluation)")
    final = loop.evaluate(models.classifier_eval_step, hist.state,
                             strategy.distribute((xt, yt), args.batch_size))
    say(f"test accuracy: {final['accuracy']:.4f}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """Runs ``jaxdist evaluate --watch DIR`` (and a TF_CONFIG evaluator task); returns the status."""
    import jax
    import optax
    from flax.training import train_state

    from jaxdist import strategy as strategies
    from jaxdist.checkpoint import evaluator
    from jaxdist.training import fit as loop
    from jaxdist.training import models

    if getattr(args, "command", None) == "evaluate":
        _PROG[0] = "jaxdist evaluate"
    (_, y), (xt, yt) = _load_data(args)
    model = _build_model(args, _num_classes(args, y, yt))
    strategy = strategies.MirroredStrategy(jax.local_devices())
    n = strategy.num_replicas_in_sync
    batch = max(n, args.batch_size // n * n)
    data = strategy.distribute((xt, yt), batch)
    step_fn = strategy.step(models.classifier_eval_step, donate=False)

    def evaluate_checkpoint(mgr, step):
        params = mgr.restore(step, strategy=strategy)["params"]  # no template: saved metadata
        state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                              tx=optax.identity())
        return loop.evaluate(step_fn, state, data)

    log = args.log or os.path.join(args.watch, "eval_log.jsonl")
    print(f"jaxdist evaluate: watching {args.watch}; log {log}"
          + (f", TensorBoard {args.tensorboard}" if args.tensorboard else ""), flush=True)
    try:
        results = evaluator.watch(args.watch, evaluate_checkpoint, tensorboard=args.tensorboard,
                                  log_path=log, poll_s=args.poll, timeout_s=args.timeout)
    except TimeoutError as e:  # not a usage mistake: exit status 1
        raise SystemExit(f"jaxdist evaluate: {e}") from None
    for step, m in sorted(results.items()):
        print(f"checkpoint {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True)
    print(f"evaluated {len(results)} checkpoints; the final one was step {max(results, default=None)}")
    return 0
