"""Calibrating the scaling planner on the machine at hand, and the ``jaxdist plan`` command.

``jaxdist.plan`` is the cost model; this module measures what it needs (an all-reduce's latency and
bandwidth, one device's step time, a model's gradient bytes) and formats its predictions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from jaxdist import _output
from jaxdist._output import integer, real, size
from jaxdist.plan.cost import (
    LINKS,
    OPTIMIZER_SLOTS,
    PRECISIONS,
    Link,
    _fmt_bytes,
    _link,
    allreduce_time,
    predict,
    recommend,
    recommend_stage,
    stage_memory,
)

logger = logging.getLogger(__name__)


def fit_link(name: str, sizes: Sequence[float], times: Sequence[float], participants: int) -> Link:
    """The `Link` whose ring all-reduce over `participants` best fits measured (size, time) pairs.

    A least-squares line ``t = a + c * S`` gives ``alpha = a / (2(p-1))`` and
    ``bandwidth = 2(p-1)/p / c``.

    >>> link = fit_link("x", [1e6, 3e6], [0.0016, 0.0046], 4)
    >>> round(link.latency_s * 1e6, 2), round(link.bandwidth / 1e9, 3)
    (16.67, 1.0)
    """
    if participants < 2 or len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"need >= 2 participants and >= 2 (size, time) pairs; got {participants} "
                         f"participants, {len(sizes)} sizes, {len(times)} times")
    n = len(sizes)
    ms, mt = sum(sizes) / n, sum(times) / n
    var = sum((s - ms) ** 2 for s in sizes)
    c = sum((s - ms) * (t - mt) for s, t in zip(sizes, times)) / var if var else 0.0
    a = max(0.0, mt - c * ms)
    c = max(c, 1e-15)
    k = participants
    return Link(name, a / (2 * (k - 1)), 2 * (k - 1) / k / c, "measured here")


def measure_allreduce(devices=None, sizes: Sequence[int] = (2**16, 2**20, 2**22), reps: int = 5,
                      name: str | None = None, iters: int = 8) -> Link:
    """Measures XLA's all-reduce (psum) over `devices` and fits a `Link` to it (`fit_link`).

    Works in one process (simulated or real devices) and across processes (every process calls it
    with the same arguments; the default `devices` is ``jax.devices()``). As
    ``benchmarks/allreduce.py`` does, each call runs `iters` dependent all-reduces back to back, so
    that dispatching the program (paid once per step, not per collective) is not counted as
    latency. Compile is excluded; each size is the median of `reps` calls.

    Returns:
      the fitted `Link`.

    Raises:
      ValueError: fewer than two devices.

    >>> import jax
    >>> measure_allreduce(jax.devices()[:2], sizes=(2**12, 2**14), reps=1).bandwidth > 0
    True
    """
    import jax
    import numpy as np

    devices = list(devices or jax.devices())
    if len(devices) < 2:
        raise ValueError(f"measure_allreduce needs >= 2 devices, got {len(devices)}; on CPU set "
                         "jax.config.update('jax_num_cpu_devices', N) before JAX starts")
    k = len(devices)
    mesh = jax.make_mesh((k,), ("d",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("d"))

    def body(x):  # mean keeps values bounded; each reduction depends on the previous one
        return jax.lax.fori_loop(0, iters, lambda _, v: jax.lax.psum(v, "d") / k, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"),
                               check_vma=False))
    mine = sum(d.process_index == jax.process_index() for d in devices)
    times = []
    for nbytes in sizes:
        n = nbytes // 4
        x = jax.make_array_from_process_local_data(sharding, np.ones((n * mine,), np.float32),
                                                   (n * k,))
        jax.block_until_ready(fn(x))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            samples.append((time.perf_counter() - t0) / iters)
        times.append(sorted(samples)[len(samples) // 2])
    link = fit_link(name or f"psum over {k} {devices[0].platform} devices", sizes, times, k)
    # one small all-reduce per call: what a step pays once to start its collectives
    once = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=jax.P("d"),
                                 out_specs=jax.P("d"), check_vma=False))
    x = jax.make_array_from_process_local_data(sharding, np.ones((1024 * mine,), np.float32),
                                               (1024 * k,))
    jax.block_until_ready(once(x))
    samples = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        jax.block_until_ready(once(x))
        samples.append(time.perf_counter() - t0)
    call = sorted(samples)[len(samples) // 2]
    sync = max(0.0, call - allreduce_time(4096, devices_per_host=k, intra=link)) / (k - 1)
    link = dataclasses.replace(link, sync_s=sync)
    logger.info("measured %s: %s; one call %.3g s", link.name, list(zip(sizes, times)), call)
    return link


def measure_step(model: str = "mlp", batch: int = 64, *, steps: int = 20,
                 reps: int = 3) -> tuple[float, float]:
    """One device's step time for a built-in model (Adam, cross-entropy) and its batch-independent part.

    Times ``batch`` and ``2 * batch`` on ``jax.devices()[0]`` (compile excluded, median of `reps`
    windows of `steps`), and splits the step as ``fixed + batch * per_example``.

    Returns:
      ``(step_time_s at batch, fixed_s)``.

    >>> step_s, fixed_s = measure_step("mlp", 8, steps=2, reps=1)
    >>> step_s > 0 and 0 <= fixed_s < step_s
    True
    """
    import jax
    import numpy as np
    import optax

    from jaxdist.training import models

    net = models.get(model)
    shape = (784,) if model == "mlp" else (28, 28, 1)

    def loss_fn(params, x, y):
        logits = net.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    fn = jax.jit(step, donate_argnums=0)
    out = {}
    for b in (batch, 2 * batch):
        rng = np.random.default_rng(0)
        x = jax.device_put(rng.standard_normal((b, *shape), dtype=np.float32))
        y = jax.device_put(rng.integers(0, 10, b).astype(np.int32))
        state = fn(models.create_train_state(net, x[:1]), x, y)
        jax.block_until_ready(state)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                state = fn(state, x, y)
            jax.block_until_ready(state)
            samples.append((time.perf_counter() - t0) / steps)
        out[b] = sorted(samples)[len(samples) // 2]
    per_example = max(0.0, (out[2 * batch] - out[batch]) / batch)
    fixed = min(max(0.0, out[batch] - batch * per_example), 0.95 * out[batch])
    return out[batch], fixed


def model_size(model: str) -> tuple[int, int]:
    """``(parameter bytes, leaf count)`` of a built-in model (``"mlp"`` or ``"cnn"``), float32.

    >>> model_size("mlp")  # 784*256+256 + 256*128+128 + 128*10+10 parameters
    (940584, 6)
    """
    import jax
    import jax.numpy as jnp

    from jaxdist.training import models

    shape = (1, 784) if model == "mlp" else (1, 28, 28, 1)
    params = jax.eval_shape(lambda: models.get(model).init(jax.random.key(0), jnp.zeros(shape)))
    leaves = jax.tree.leaves(params)
    return sum(4 * x.size for x in leaves), len(leaves)


def factory_size(spec: str) -> tuple[int, int, int | None, int]:
    """``(parameter bytes, leaf count, optimizer-state bytes or None, parameter count)`` from a
    ``module:factory``.

    The factory takes no arguments and returns a train state (anything with ``.params``, such as
    flax's ``TrainState``: its ``.opt_state`` is measured too), a state that holds the optimizer
    beside the model (``(model, nnx.Optimizer(...))``, an Equinox ``(model, opt_state)``,
    ``(params, opt.init(params))``: the optimizer's part is measured as optimizer state, not as
    parameters) or a parameter pytree (a linen ``model.init(...)`` result, an NNX module or
    ``nnx.state(model)``, a dict of arrays). It runs under ``jax.eval_shape`` where it can, so no
    memory is allocated for the arrays.

    Raises:
      SystemExit: the spec is malformed, does not import, or returns no arrays.

    >>> factory_size("jaxdist.plan.measure:_example_factory")  # Adam: mu, nu and an int32 count
    (400, 2, 804, 100)
    """
    import importlib
    import os
    import sys

    import jax

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"jaxdist plan: --model {spec!r} is not mlp, cnn or MODULE:FACTORY "
                         "(e.g. --model mypkg.models:make_state)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"jaxdist plan: --model {spec!r}: {e}") from None
    try:
        out = jax.eval_shape(factory)
    except Exception:  # not traceable (numpy inside, a module object): build it for real
        out = factory()
    params, opt = _params_and_optimizer(out)

    def arrays(tree):
        return [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")]

    leaves = arrays(params)
    if not leaves:
        raise SystemExit(f"jaxdist plan: --model {spec!r} returned {type(out).__name__} with no "
                         "arrays; return a train state or a parameter pytree, e.g. "
                         "model.init(jax.random.key(0), sample_input)")
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    opt_bytes = sum(x.size * x.dtype.itemsize for x in arrays(opt)) if opt is not None else None
    return int(nbytes), len(leaves), opt_bytes, int(sum(x.size for x in leaves))


def _params_and_optimizer(state):
    """A factory's result as (parameters, optimizer state or None).

    jaxdist's states keep the optimizer beside the model (``(model, nnx.Optimizer)``, ``(model,
    opt_state)``, ``{"params": ..., "opt": ...}``): the parts that hold an optimizer's state are
    the optimizer, the others the parameters, so Adam's two slots are not counted as gradients.
    """
    if hasattr(state, "params"):  # flax's TrainState and its kind
        return state.params, getattr(state, "opt_state", None)
    if type(state) in (tuple, list, dict):  # not a NamedTuple: optax's states are those
        parts = list(state.values()) if isinstance(state, dict) else list(state)
        opt = [part for part in parts if _holds_optimizer(part)]
        if opt and len(opt) < len(parts):
            return [part for part in parts if not _holds_optimizer(part)], opt
    return state, None


def _holds_optimizer(tree) -> bool:
    """Whether ``tree`` holds an optax state (optax's NamedTuples) or a Flax NNX optimizer."""
    import sys

    import jax

    nnx = sys.modules.get("flax.nnx")  # loaded by whoever built an nnx.Optimizer

    def is_optimizer(x):
        return (type(x).__module__.partition(".")[0] == "optax"
                or (nnx is not None and isinstance(x, nnx.Optimizer)))

    return any(is_optimizer(x) for x in jax.tree.leaves(tree, is_leaf=is_optimizer))


def _example_factory():
    """A 100-parameter state with Adam: the ``factory_size`` example."""
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    params = {"w": jnp.zeros((10, 9)), "b": jnp.zeros(10)}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))


def memory_table(memory: list) -> str:
    """A markdown table of bytes per device at each ``zero_stage``.

    Args:
      memory: ``plan.stage_memory(...)``'s rows.

    Returns:
      The table, one row per stage.

    >>> print(memory_table(stage_memory(1e9, 8)).splitlines()[2])
    | 0 | 3.725 GiB | 7.451 GiB | 3.725 GiB | 14.9 GiB |
    """
    lines = ["| zero_stage | parameters | optimizer state | + during a step | peak per device |",
             "|---|---|---|---|---|"]
    for m in memory:
        lines.append(f"| {m.stage} | {_fmt_bytes(m.params)} | {_fmt_bytes(m.opt_state)} | "
                     f"{_fmt_bytes(m.step_extra)} | {_fmt_bytes(m.peak)} |")
    return "\n".join(lines)


def _bytes(text: str | float) -> float:
    """``"16GiB"`` (binary), ``"80GB"`` (decimal) or a plain number of bytes (``jaxdist._output``'s
    parser, which every size option of the command line uses).

    >>> _bytes("16GiB") == 16 * 2**30, _bytes("80GB"), _bytes("1e6")
    (True, 80000000000.0, 1000000.0)
    """
    return _output.parse_bytes(text)


def scaling_table(param_bytes: float, step_time_s: float, *, hosts: int, devices_per_host: int,
                  algorithm: str, **kwargs) -> str:
    """A markdown table of predictions from one device up to ``hosts x devices_per_host``.

    >>> print(scaling_table(4e6, 0.01, hosts=1, devices_per_host=2, algorithm="ring",
    ...                     intra=Link("l", 1e-5, 1e9)).splitlines()[-1])
    | 1 x 2 | 14.02 | 4.02 | 4.02 | 71.3% | 1.43 |
    """
    shapes = [(1, m) for m in _powers(devices_per_host)] + [(n, devices_per_host)
                                                          for n in _powers(hosts) if n > 1]
    lines = ["| hosts x devices | step ms | all-reduce ms | exposed ms | efficiency | speed-up |",
             "|---|---|---|---|---|---|"]
    for n, m in shapes:
        p = predict(param_bytes, step_time_s, hosts=n, devices_per_host=m, algorithm=algorithm,
                    **kwargs)
        lines.append(f"| {n} x {m} | {p.step_s * 1e3:.2f} | {p.allreduce_s * 1e3:.2f} | "
                     f"{p.exposed_allreduce_s * 1e3:.2f} | {p.efficiency:.1%} | {p.speedup:.2f} |")
    return "\n".join(lines)


def _powers(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def _seconds(text: str | float) -> float:
    """``"12ms"``, ``"0.3s"``, ``"250us"`` or a plain number of seconds (``jaxdist._output``'s parser).

    >>> _seconds("12ms"), _seconds(0.5)
    (0.012, 0.5)
    """
    return _output.parse_seconds(text)


def _usage(message: str):
    _output.usage_error("jaxdist plan", message)


def run_cli(args) -> str:
    """``jaxdist plan``: the report for parsed command-line arguments (see ``jaxdist plan -h``).

    Raises:
      SystemExit: missing or contradictory options, with what to pass instead.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> print(run_cli(parser.parse_args(["--model", "mlp", "--step-time", "2ms"])).splitlines()[0])
    model: 918.5 KiB of gradients in 6 leaves; one device: 2.000 ms per step at batch 64
    """
    check_args(args)
    lines = []
    if args.calibrate:
        import jax

        jax.config.update("jax_num_cpu_devices", max(2, args.calibrate_devices))
    param_bytes: float | None
    num_params: float | None
    opt_bytes = num_params = None
    if args.model in ("mlp", "cnn"):
        param_bytes, leaves = model_size(args.model)
    elif args.model:
        param_bytes, leaves, opt_bytes, num_params = factory_size(args.model)
        if args.calibrate and not args.step_time:
            _usage("--calibrate measures the built-in models only; give --step-time for your "
                   "own model (e.g. --step-time 12ms)")
    else:
        param_bytes, leaves = None, None
    param_bytes = _bytes(args.param_bytes) if args.param_bytes else param_bytes
    leaves = args.leaves or leaves or 1
    if param_bytes is None:
        _usage("give --model {mlp,cnn,MODULE:FACTORY} or --param-bytes (e.g. --param-bytes 100MB, "
               "and --leaves L)")
    fixed = args.fixed_time and _seconds(args.fixed_time) or 0.0
    if args.step_time:
        step = _seconds(args.step_time)
    elif args.calibrate and args.model in ("mlp", "cnn"):
        step, fixed = measure_step(args.model, args.batch)
        lines.append(f"measured here: one device, {args.model} at batch {args.batch}: "
                     f"{step * 1e3:.3f} ms per step, of which {fixed * 1e3:.3f} ms batch-independent")
    else:
        raise AssertionError("check_args lets no plan through without a step time")
    intra, inter = args.intra, args.inter
    if args.calibrate:
        import jax

        link = measure_allreduce(jax.devices()[:args.calibrate_devices])
        lines.append(f"measured here: {link.name}: alpha {link.latency_s * 1e6:.1f} us, "
                     f"bandwidth {link.bandwidth / 1e9:.3f} GB/s (ring fit), "
                     f"{link.sync_s * 1e6:.0f} us per step to start")
        intra = link if intra == "measured" else intra
        inter = link if inter == "measured" else inter
    rec = recommend(param_bytes, step, hosts=args.hosts, devices_per_host=args.devices_per_host,
                    batch_per_device=args.batch, num_leaves=leaves, intra=intra, inter=inter,
                    fixed_s=fixed, overlap=args.overlap, fused=args.fused,
                    compute_parallelism=args.compute_parallelism,
                    target_efficiency=args.target_efficiency)
    lines += [f"model: {_fmt_bytes(param_bytes)} of gradients in {leaves} leaves; one device: "
              f"{step * 1e3:.3f} ms per step at batch {args.batch}",
              f"job: {args.hosts} host(s) x {args.devices_per_host} device(s); links: "
              f"{_link(intra).name} inside a host, {_link(inter or intra).name} between hosts", "",
              f"predicted with cross_device_ops={rec.cross_device_ops!r}, pack_bytes={rec.pack_bytes}, "
              f"batch {args.batch} per device:", "",
              scaling_table(param_bytes, step, hosts=args.hosts, devices_per_host=args.devices_per_host,
                            algorithm=rec.by_algorithm[rec.cross_device_ops].algorithm,
                            batch_per_device=args.batch, num_leaves=leaves, intra=intra, inter=inter,
                            fixed_s=fixed, overlap=args.overlap, fused=args.fused,
                            pack_bytes=rec.pack_bytes, compute_parallelism=args.compute_parallelism),
              "", "recommendation:"]
    lines += [f"  {r}" for r in rec.reasons]
    devices = args.hosts * args.devices_per_host
    if num_params is None or args.param_bytes:
        num_params = param_bytes / 4  # float32 gradients
    memory = stage_memory(num_params, devices, optimizer=args.optimizer, precision=args.precision,
                          opt_bytes=opt_bytes)
    stage = 0
    if args.device_memory:
        stage, why = recommend_stage(memory, _bytes(args.device_memory))
        lines.append(f"  memory: {why}")
    # More than one host is MultiWorkerMirroredStrategy's job (one process per host).
    name = "MultiWorkerMirroredStrategy" if args.hosts > 1 else "MirroredStrategy"
    zero = f", zero_stage={stage}" if stage else ""
    lines.append(f"  -> jaxdist.{name}(cross_device_ops={rec.cross_device_ops!r}, "
                 f"pack_bytes={rec.pack_bytes}{zero}) with global batch {rec.global_batch}")
    lines += ["", f"memory per device over {devices} devices ({num_params:,.0f} parameters, "
              f"{args.optimizer if opt_bytes is None else 'optimizer state as measured'}, "
              f"{args.precision}; activations not included):", "",
              memory_table(memory)]
    return "\n".join(lines)


# The checks of ``jaxdist plan`` that involve several options, run before any work (importing a
# factory, measuring): (is it wrong?, what to say). Each message names the flag and a valid value.
PLAN_CHECKS = [
    (lambda a: not a.model and not a.param_bytes,
     lambda a: "give --model {mlp,cnn,MODULE:FACTORY} or --param-bytes (e.g. --param-bytes 100MB, "
               "and --leaves L)"),
    (lambda a: not a.step_time and not (a.calibrate and a.model in ("mlp", "cnn")),
     lambda a: "give --step-time (one device's step, e.g. --step-time 12ms) or --calibrate with "
               "--model mlp|cnn to measure it here"),
    (lambda a: a.step_time and a.fixed_time and _seconds(a.fixed_time) >= _seconds(a.step_time),
     lambda a: f"--fixed-time {a.fixed_time} must be less than --step-time {a.step_time} (it is "
               "the part of the step that does not grow with the batch)"),
    (lambda a: "measured" in (a.intra, a.inter) and not a.calibrate,
     lambda a: f"--{'intra' if a.intra == 'measured' else 'inter'} measured needs --calibrate "
               "(or name a link, e.g. --intra nvlink3)"),
    # Between hosts the network, not NVLink, sets the pace: the planner used to take --intra for
    # it, predicting 4 hosts as if their GPUs shared one NVLink domain. It asks instead.
    (lambda a: a.hosts > 1 and a.inter is None,
     lambda a: f"--hosts {a.hosts} needs --inter, the link between hosts (e.g. --inter "
               f"ethernet-25g; one of {', '.join(sorted(LINKS))}, or measured)"),
    (lambda a: a.calibrate and a.calibrate_devices < 2,
     lambda a: f"--calibrate-devices {a.calibrate_devices}: an all-reduce needs at least 2 "
               "devices (e.g. --calibrate-devices 8)"),
]


def check_args(args) -> None:
    """Runs ``PLAN_CHECKS``: the first that fails ends the command (one line, exit status 2)."""
    for wrong, message in PLAN_CHECKS:
        if wrong(args):
            _usage(message(args))


def add_arguments(p) -> None:
    """The options of ``jaxdist plan`` on an ``argparse`` parser.

    Every value is checked as it is parsed (sizes and times take units: ``100MB``, ``12ms``).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> parser.parse_args(["--model", "cnn"]).devices_per_host
    8
    >>> parser.parse_args(["--param-bytes", "100MB", "--step-time", "12ms"]).param_bytes
    100000000.0
    """
    links = (*sorted(LINKS), "measured")
    p.add_argument("--model", metavar="{mlp,cnn} | MODULE:FACTORY",
                   type=_output.module_factory(builtins=("mlp", "cnn"),
                                               example="mypkg.models:make_state"),
                   help="a built-in model, or your own: a factory returning a train state "
                        "(a TrainState, (model, optimizer), (params, opt_state)) or a parameter "
                        "pytree (sizes read from it)")
    p.add_argument("--param-bytes", type=size(example="100MB"), metavar="BYTES",
                   help="gradient bytes all-reduced per step (e.g. 100MB, 1.5GiB, 102e6)")
    p.add_argument("--leaves", type=integer(example=161), default=None,
                   help="gradient leaves (arrays)")
    p.add_argument("--step-time", type=_output.duration(example="12ms"), metavar="TIME",
                   help="one device's step time at --batch (e.g. 12ms, 0.3s)")
    p.add_argument("--fixed-time", type=_output.duration(example="2ms", zero=True), metavar="TIME",
                   help="the part of --step-time that does not grow with the batch (e.g. 2ms)")
    p.add_argument("--batch", type=integer(example=64), default=64,
                   help="per-device batch of --step-time")
    p.add_argument("--hosts", type=integer(example=4), default=1)
    p.add_argument("--devices-per-host", type=integer(example=8), default=8)
    p.add_argument("--intra", default="nvlink3", choices=links, metavar="LINK",
                   help=f"link inside a host: one of {', '.join(links)}")
    p.add_argument("--inter", default=None, choices=links, metavar="LINK",
                   help="link between hosts (needed with --hosts > 1; same choices as --intra)")
    p.add_argument("--overlap", type=real(at_least=0, at_most=1, example=0.5), default=0.0,
                   help="fraction of the all-reduce hidden behind the backward pass (0..1)")
    p.add_argument("--fused", action="store_true",
                   help="all gradients in one all-reduce (XLA's combiner on GPU/TPU)")
    p.add_argument("--compute-parallelism", type=real(above=0, example=1), default=None,
                   help="devices that compute truly in parallel (1 for simulated CPU devices)")
    p.add_argument("--target-efficiency", type=real(above=0, at_most=1, example=0.9), default=0.9)
    p.add_argument("--calibrate", action="store_true",
                   help="measure here: one device's step time (--model) and XLA's all-reduce "
                        "over --calibrate-devices simulated devices (use with --intra measured)")
    p.add_argument("--calibrate-devices", type=integer(at_least=2, example=8), default=8)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_SLOTS), default="adam",
                   help="optimizer state per parameter for the memory table")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="float32",
                   help="jaxdist.precision policy for the memory table")
    p.add_argument("--device-memory", default=None, metavar="BYTES", type=size(example="16GiB"),
                   help="memory per device (e.g. 16GiB, 80e9): recommends a zero_stage when the "
                        "replicated state does not fit")
