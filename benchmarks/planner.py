"""Validates `jaxdist plan` on this machine: predicted against measured step times.

For the MLP 784-256-128-10 (Adam, per-device batch 64), it measures here only what the planner
is meant to be given: one device's step time (and its batch-independent part), XLA's all-reduce
over 2 participants (the link, fitted to the ring model), and how many devices compute in parallel
(the same step on every device at once with no all-reduce). From those it predicts the
hand-written data-parallel step (``jax.jit`` with shardings) on

* 8 simulated devices in one process (the link measured on 2 simulated devices), and
* 2 and 4 processes x 1 device under ``jaxdist launch`` (the link measured over 2 processes),

then measures those steps and prints predicted vs measured. The 4-device and 4-process cases
extrapolate the 2-participant link; the 8-device case extrapolates it 4x.

    python benchmarks/planner.py [--batch 64] [--procs 2,4] [--out benchmarks/results]
    python benchmarks/planner.py --quick   # every row, short windows: the plumbing, under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# How long each measurement is: windows x steps of a data-parallel step, the one-device step's
# (steps, windows), the all-reduce's message sizes and calls per size.
FULL = {"windows": 5, "steps": 16, "one_device": (20, 3), "sizes": (2**16, 2**20, 2**22),
        "ar_reps": 5}
QUICK = {"windows": 1, "steps": 4, "one_device": (4, 1), "sizes": (2**12, 2**16), "ar_reps": 1}


def _mlp_parts(batch: int, n_devices: int):
    import jax
    import numpy as np
    import optax

    from jaxdist import models

    net = models.MLP()

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            net.apply({"params": params}, x), y).mean()

    def step(state, batch):
        x, y = batch
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * n_devices, 784), dtype=np.float32)
    y = rng.integers(0, 10, batch * n_devices).astype(np.int32)
    return net, step, x, y


def _window(fn, state, batch, steps=16, reps=5, sync=8):
    import jax

    state = fn(state, batch)
    jax.block_until_ready(state)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(steps):
            state = fn(state, batch)
            if i % sync == sync - 1:
                jax.block_until_ready(state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - t0) / steps)
    return sorted(samples)[len(samples) // 2]


def measure_data_parallel(batch: int, how: dict = FULL) -> dict:
    """In this process (one or several under launch): the hand-written step over all devices, and
    the same step on every device at once with no all-reduce (compute only)."""
    import jax
    from jax.sharding import AxisType, NamedSharding

    from jaxdist import models

    devices = jax.devices()
    n = len(devices)
    net, step, x, y = _mlp_parts(batch, n)
    mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,), devices=devices)
    rep, dat = NamedSharding(mesh, jax.P()), NamedSharding(mesh, jax.P("d"))
    placed = (jax.device_put(x, dat), jax.device_put(y, dat))
    hand = jax.jit(step, in_shardings=(rep, dat), out_shardings=rep, donate_argnums=0)
    state = jax.device_put(models.create_train_state(net, x[:1]), rep)
    from jaxdist.core.collectives import _count_collectives

    # the all-reduces XLA actually emits for the step (its combiner may merge the six gradients)
    all_reduces = _count_collectives(hand.lower(state, placed).compile().as_text())["all-reduce"]
    measured = _window(hand, state, placed, how["steps"], how["windows"])
    # compute only: every device its own replica of the state and its own slice, no all-reduce
    local = jax.jit(jax.shard_map(lambda s, b: jax.tree.map(lambda v: v[None], step(
        jax.tree.map(lambda v: v[0], s), b)), mesh=mesh, in_specs=(jax.P("d"), jax.P("d")),
        out_specs=jax.P("d"), check_vma=False), donate_argnums=0)
    import numpy as np

    stacked = jax.tree.map(lambda v: jax.device_put(np.broadcast_to(np.asarray(v), (n, *np.shape(v))), dat),
                           models.create_train_state(net, x[:1]))
    compute_only = _window(local, stacked, placed, how["steps"], how["windows"])
    return {"devices": n, "measured_s": measured, "compute_only_s": compute_only,
            "all_reduces": all_reduces}


def proc_worker(args) -> int:
    import jaxdist

    jaxdist.initialize()
    import jax

    from jaxdist.plan import measure as plan_measure

    how = QUICK if args.quick else FULL
    link = plan_measure.measure_allreduce(name=f"psum over {jax.process_count()} processes (gloo)",
                                          sizes=how["sizes"], reps=how["ar_reps"])
    out = measure_data_parallel(args.batch, how)
    out.update(latency_s=link.latency_s, bandwidth=link.bandwidth, sync_s=link.sync_s)
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="per-device batch")
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing in under a minute: every row (the 2- and "
                         "4-process jobs too), one short window per measurement (its errors are "
                         "not a result)")
    ap.add_argument("--proc-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.proc_worker:
        return proc_worker(args)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, REPO)
    from jaxdist.plan import cost as plan
    from jaxdist.plan import measure as plan_measure

    how = QUICK if args.quick else FULL
    load0 = os.getloadavg()[0]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    param_bytes, leaves = plan_measure.model_size("mlp")
    steps, reps = how["one_device"]
    t1, fixed = plan_measure.measure_step("mlp", args.batch, steps=steps, reps=reps)
    rows = []
    link_sim = plan_measure.measure_allreduce(jax.devices()[:2], name="psum over 2 simulated devices",
                                              sizes=how["sizes"], reps=how["ar_reps"])
    sim = measure_data_parallel(args.batch, how)
    par = min(8.0, max(1.0, sim["devices"] * t1 / sim["compute_only_s"]))
    pred = plan.predict(param_bytes, t1, devices_per_host=8, batch_per_device=args.batch,
                        fixed_s=fixed, num_leaves=sim["all_reduces"], intra=link_sim,
                        compute_parallelism=par)
    rows.append((f"8 simulated devices, 1 process ({sim['all_reduces']} all-reduce ops)", link_sim,
                 par, pred, sim["measured_s"]))
    link_proc = step_link = None
    for p in [int(v) for v in args.procs.split(",") if v]:
        cmd = [sys.executable, "-m", "jaxdist.launch", "-n", str(p), "--devices-per-process", "1",
               "--timeout", "500", os.path.abspath(__file__), "--proc-worker", "--batch", str(args.batch),
               *(["--quick"] if args.quick else [])]
        env = {**os.environ, "PYTHONPATH": REPO}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=560)
        line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
        if line is None:
            print(f"{p} processes failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                  f"{proc.stderr[-2000:]}")
            continue
        r = json.loads(line.split("RESULT ", 1)[1])
        here = plan.Link(f"psum over {p} processes (gloo)", r["latency_s"], r["bandwidth"], "measured",
                         r["sync_s"])
        link_proc = link_proc or here  # the first (2-process) measurement calibrates the rest
        ppar = min(float(p), max(1.0, p * t1 / r["compute_only_s"]))
        kw = dict(hosts=p, devices_per_host=1, batch_per_device=args.batch, fixed_s=fixed,
                  num_leaves=r["all_reduces"], compute_parallelism=ppar)
        pred = plan.predict(param_bytes, t1, intra=link_proc, **kw)
        rows.append((f"{p} processes x 1 device ({r['all_reduces']} all-reduce ops)", link_proc, ppar,
                     pred, r["measured_s"]))
        if step_link is None:
            # Calibrate the per-step start cost on this (smallest) job's measured step instead of
            # the raw psum call: what a planner user gets by timing one small job first.
            extra = max(0.0, r["measured_s"] - pred.step_s) / (p - 1)
            step_link = dataclasses.replace(link_proc, name=link_proc.name + ", start cost fitted "
                                            f"to the {p}-process step", sync_s=link_proc.sync_s + extra)
        else:
            rows.append((f"{p} processes x 1 device", step_link, ppar,
                         plan.predict(param_bytes, t1, intra=step_link, **kw), r["measured_s"]))
    load1 = os.getloadavg()[0]
    lines = [f"# `jaxdist plan` against measurements here ({stamp})", "",
             f"{os.cpu_count()} CPU cores, jax {jax.__version__}, load average {load0:.1f} at the "
             f"start and {load1:.1f} at the end. MLP 784-256-128-10 ({param_bytes} gradient bytes in "
             f"{leaves} leaves), Adam, {args.batch} examples per device, hand-written `jax.jit` step.",
             f"One device: {t1 * 1e3:.3f} ms per step, {fixed * 1e3:.3f} ms of it batch-independent.",
             "", "| job | link used (alpha, bandwidth) | compute parallelism | predicted compute ms "
             "| predicted all-reduce ms | predicted step ms | measured step ms | error |",
             "|---|---|---|---|---|---|---|---|"]
    for name, link, par, pred, measured in rows:
        err = pred.step_s / measured - 1
        lines.append(f"| {name} | {link.name}: {link.latency_s * 1e6:.0f} us, "
                     f"{link.bandwidth / 1e9:.2f} GB/s, start {link.sync_s * 1e3:.2f} ms x (p-1) | "
                     f"{par:.2f} | {pred.compute_s * 1e3:.2f} | "
                     f"{pred.allreduce_s * 1e3:.2f} | {pred.step_s * 1e3:.2f} | {measured * 1e3:.2f} | "
                     f"{err:+.0%} |")
    lines += ["", f"(`python benchmarks/planner.py {' '.join(argv if argv is not None else sys.argv[1:])}`)"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "planner.md"), "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
