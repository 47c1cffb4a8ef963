"""What users run (@jaxdist.mirrored, strategy.run, distribute-fed loops, fit) vs a hand-written jax.jit step.

All run the same MLP step (784-256-128-10, Adam, global batch 512) on the same device-resident
batches and the same mesh; compilation is excluded; repetitions are interleaved, and the order of
the three rotates from one repetition to the next, so machine noise and warm caches hit all alike.
The hand-written loop syncs every 8 steps (XLA:CPU deadlocks with too many queued collectives);
jaxdist's loops are plain `for` loops, as users write them, relying on the library's own bound. The
per-replica loop is `state, m = strategy.run(step, args=(state, batch))`, the state staying
per-replica between steps and the loss all-reduced inside the step; `readme` is the README's loop
exactly: the loss left per replica and `strategy.reduce("sum", loss)` after every `run`. `masked` is
the global view of the step that `distribute` batches need (`compute_average_loss` over
`batch.mask`) on pre-placed batches: the step's own cost, without the input pipeline. The
`distribute` loop and `fit` take their batches from `strategy.distribute` (host arrays -> device;
for in-memory arrays the batches are made on the loop's thread by default, `distribute_thread` makes
them on a prefetch thread) instead of pre-placed ones; `fit` also reads metrics and runs its
callbacks: they are what users run. `fit_k` is `fit` with `steps_per_execution=K` (`--spe`, default
9): K steps per compiled call. `hand_fed` is the hand-written step fed the same batches from host
arrays with `jax.device_put` each step: the input cost a hand-written loop pays too; the fed loops
are also printed against it. `fit_host` is `fit` with the dataset's batches gathered on the host and
sent each epoch (`distribute(..., on_device=False)`, what every in-memory dataset did before they
were kept on the devices); `fit_iter` is `fit` over an iterable of the same host batches (a
generator function), which a producer thread streams ahead of the step.

The loops must end on the hand-written loop's parameters. `--check final` (the default on CPU)
compares the timed loops' final parameters (rtol 1e-4); on a GPU or TPU, whose default matmul
precision (TF32 / bfloat16 passes) lets programs that differ in their masking or looping drift
apart, `--check highest` (the default there) runs every loop again for 8 steps (at most `--steps`)
from the same state at `jax.default_matmul_precision("highest")` and compares those at the same
tolerance, and prints the timed loops' largest difference without failing on it. `--json PATH`
writes the table.

`--model tiny` is the dispatch-bound case: an MLP 64-32-10 on the digits, batch 32, 1 device by
default, where the host's work per step decides the speed (a small model on a fast accelerator):

    python benchmarks/overhead.py [--devices 8] [--reps 24] [--steps 64] [--loops global fit ...]
    python benchmarks/overhead.py --model tiny [--reps 24] [--steps 72]
    python benchmarks/overhead.py --devices 1 --loops fit fit_host fit_iter   # the input path

The summary ends with the table of host CPU per step and throughput against the hand-written loop,
and the ratios the targets name: fit and distribute / hand_fed CPU (<= 1.25), per_replica and readme
/ global CPU (<= 1.5), fit_k / fit steps/s (>= 2 on the tiny model at K=9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    # The model decides the other defaults (--help shows the MLP's unless --model tiny is given).
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=("mlp", "tiny"), default="mlp")
    tiny = pre.parse_known_args()[0].model == "tiny"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "tiny"), default="mlp",
                    help="mlp: 784-256-128-10 on synthetic data; tiny: 64-32-10 on the digits "
                         "(dispatch-bound: the host's work per step decides the speed; its "
                         "defaults: 1 device, 72 steps, batch 32)")
    ap.add_argument("--devices", type=int, default=1 if tiny else 8)
    ap.add_argument("--reps", type=int, default=24,
                    help="interleaved repetitions (24: medians stable to about +-2%% here)")
    ap.add_argument("--steps", type=int, default=72 if tiny else 64)
    ap.add_argument("--batch", type=int, default=32 if tiny else 512)
    ap.add_argument("--spe", type=int, default=9, help="fit_k's steps_per_execution")
    ap.add_argument("--loops", nargs="+",
                    default=["hand", "global", "per_replica", "readme", "masked", "hand_fed", "distribute",
                             "fit", "fit_k", "fit_iter"],
                    help="which loops to time (hand is the baseline and always runs); also "
                         "distribute_thread, fit_host")
    ap.add_argument("--check", choices=("auto", "final", "highest"), default="auto",
                    help="how the loops' agreement is checked (auto: final on CPU, highest "
                         "elsewhere; see the module docstring)")
    ap.add_argument("--json", help="write the table and the run's facts to this file")
    args = ap.parse_args()
    args.loops = ["hand", *[n for n in args.loops if n != "hand"]]

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding

    import jaxdist
    from jaxdist import models

    devices = jax.devices()[:args.devices]
    if tiny:
        (x, y), _ = jaxdist.datasets.digits()
        x, y = x[:args.batch * 4].reshape(args.batch * 4, -1), y[:args.batch * 4]
        hidden, model_name = (32,), "MLP 64-32-10 on the digits"
    else:
        x, y = jaxdist.datasets.synthetic(args.batch * 4, shape=(784,))
        hidden, model_name = (256, 128), "MLP 784-256-128-10"

    def train_step(state, batch):
        xb, yb = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    # Hand-written: the mesh, shardings and jit a JAX expert would write.
    mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
    rep, dat = NamedSharding(mesh, jax.P()), NamedSharding(mesh, jax.P("batch"))
    hand = jax.jit(train_step, in_shardings=(rep, dat), out_shardings=(rep, rep),
                   donate_argnums=0)
    ours = jaxdist.mirrored(devices=devices)(train_step)

    strategy = ours.strategy

    def local_loss_and_grads(state, batch):  # the local mean's share of the global mean
        xb, yb = batch.data

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return per_example.mean() / jaxdist.num_replicas()

        return jax.value_and_grad(loss_fn)(state.params)

    def replica_step(state, batch):
        loss, grads = local_loss_and_grads(state, batch)
        grads = jaxdist.all_reduce(grads, "sum")
        return state.apply_gradients(grads=grads), {"loss": jaxdist.all_reduce(loss, "sum")}

    def per_replica(state, batch):
        return strategy.run(replica_step, args=(state, jaxdist.Batch(batch, None)))

    def readme_step(state, batch):  # the README's replica step: the loss is left per replica
        loss, grads = local_loss_and_grads(state, batch)
        return state.apply_gradients(grads=jaxdist.all_reduce(grads, "sum")), loss

    def readme(state, batch):  # the README's loop: run, then reduce the loss every step
        state, loss = strategy.run(readme_step, args=(state, jaxdist.Batch(batch, None)))
        return state, strategy.reduce("sum", loss)

    def make_state():
        return models.create_train_state(models.MLP(hidden=hidden), x[:1])

    def masked_step(state, batch):  # the same step over a jaxdist.Batch (what distribute yields)
        (xb, yb), mask = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return jaxdist.compute_average_loss(per_example, mask)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    ours_masked = strategy.step(masked_step)
    # Batch k of an epoch is x[k % 4::4], as in the pre-placed loops, so every loop sees the same
    # sequence of batches and must end with the same parameters.
    order = np.concatenate([np.arange(x.shape[0])[k % 4::4] for k in range(args.steps)])
    xo, yo = x[order], y[order]
    dataset = strategy.distribute((xo, yo), args.batch)
    thread_dataset = strategy.distribute((xo, yo), args.batch, prefetch=2)
    host_dataset = strategy.distribute((xo, yo), args.batch, on_device=False)

    def host_batches():  # an iterable source: the same batches, made on the host
        for lo in range(0, len(yo), args.batch):
            yield xo[lo:lo + args.batch], yo[lo:lo + args.batch]

    iter_dataset = strategy.distribute(host_batches, args.batch)

    stalls: list[float] = []  # the distribute loop's waits for its input, per timed window

    def distribute_fed(state, steps, dataset=dataset):
        with dataset.iterator(epoch=0) as it:
            for _, batch in zip(range(steps), it):
                state, m = ours_masked(state, batch)
        stalls.append(getattr(it, "stall_s", float("nan")))  # nan: a jaxdist before stall_s
        return state, m

    def distribute_thread(state, steps):  # batches made ahead on a prefetch thread (prefetch=2)
        return distribute_fed(state, steps, thread_dataset)

    def fit(state, steps, k=1, dataset=dataset):
        history = jaxdist.fit(ours_masked, state, dataset, epochs=1, steps_per_epoch=steps,
                              verbose=0, **({"steps_per_execution": k} if k > 1 else {}))
        return history.state, history.state.step

    def fit_k(state, steps):  # K steps per compiled call
        return fit(state, steps, args.spe)

    def fit_host(state, steps):  # in-memory batches gathered on the host, sent every epoch
        return fit(state, steps, dataset=host_dataset)

    def fit_iter(state, steps):  # an iterable, streamed ahead by the producer thread
        return fit(state, steps, dataset=iter_dataset)

    def hand_fed(state, steps):  # a hand-written loop that feeds host arrays, as experts write it
        for i in range(steps):
            lo = i * args.batch
            batch = jax.device_put((xo[lo:lo + args.batch], yo[lo:lo + args.batch]), dat)
            state, m = hand(state, batch)
            if i % 8 == 7:
                jax.block_until_ready(m)
        return state, m

    hand_batches = [jax.device_put((x[i::4], y[i::4]), dat) for i in range(4)]
    our_batches = [ours.strategy.layout.put_batch((x[i::4], y[i::4])) for i in range(4)]
    full_mask = next(iter(dataset)).mask  # placed as distribute places it (replicated)
    masked_batches = [jaxdist.Batch(b, full_mask) for b in our_batches]
    def loop_over(fn, batches, sync_every=None):
        def run(state, steps):
            for i in range(steps):
                state, m = fn(state, batches[i % 4])
                if sync_every and i % sync_every == sync_every - 1:
                    jax.block_until_ready(m)
            return state, m
        return run

    def fresh_states():
        placed = {n: strategy.put(make_state())
                  for n in ("global", "masked", "distribute", "distribute_thread", "fit", "fit_k",
                            "fit_host", "fit_iter")}
        return {"hand": jax.device_put(make_state(), rep),
                "hand_fed": jax.device_put(make_state(), rep),
                "per_replica": make_state(), "readme": make_state(), **placed}

    states = fresh_states()
    loops = {"hand": loop_over(hand, hand_batches, sync_every=8), "hand_fed": hand_fed,
             "global": loop_over(ours, our_batches),
             "per_replica": loop_over(per_replica, our_batches),
             "readme": loop_over(readme, our_batches),
             "masked": loop_over(ours_masked, masked_batches),
             "distribute": distribute_fed, "distribute_thread": distribute_thread, "fit": fit,
             "fit_k": fit_k, "fit_host": fit_host, "fit_iter": fit_iter}
    names = [n for n in loops if n in args.loops]

    def timed(name):
        run = loops[name]
        # Compile / warm on the epoch's first two batches (per-replica: the replicated, then the
        # per-replica state), so every loop sees the same batches in the same order.
        state, m = run(states[name], 2)
        jax.block_until_ready(m)
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = run(state, args.steps)
        jax.block_until_ready((state, m))
        states[name] = state
        cpu[name].append((time.process_time() - c0) / args.steps)
        elapsed = time.perf_counter() - t0
        if name == "distribute":
            stall_share.append(stalls[-1] / elapsed)
        return args.steps / elapsed

    rows: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU seconds per step, all threads
    stall_share: list[float] = []
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        speed = {n: timed(n) for n in order}
        for n in names:
            rows[n].append(speed[n])
        print(f"rep {r} ({' > '.join(order)}): " + "   ".join(
            f"{n} {speed[n]:7.1f} steps/s" + ("" if n == "hand" else f" ({speed[n] / speed['hand']:.3f})")
            for n in names))
    print(f"\n{len(devices)} devices, {model_name}, global batch {args.batch}, "
          f"{args.steps} steps x {args.reps} interleaved reps (jax {jax.__version__}, "
          f"{devices[0].device_kind})")
    for n in names:
        print(f"median throughput {n:12s} {statistics.median(rows[n]) * args.batch:10,.0f} ex/s")
    for n in names[1:]:
        ratios = [o / h for o, h in zip(rows[n], rows["hand"])]
        print(f"{n} / hand-written steps/s: min {min(ratios):.3f}  median "
              f"{statistics.median(ratios):.3f}  max {max(ratios):.3f}   (target: median >= 0.97)")
    if "global" in names and "per_replica" in names:
        ratios = [p / g for p, g in zip(rows["per_replica"], rows["global"])]
        print(f"per_replica / global steps/s: min {min(ratios):.3f}  median "
              f"{statistics.median(ratios):.3f}  max {max(ratios):.3f}   (target: median >= 0.97)")
    if "hand_fed" in names:
        for n in [n for n in ("distribute", "fit") if n in names]:
            ratios = [o / h for o, h in zip(rows[n], rows["hand_fed"])]
            print(f"{n} / hand-written fed from host arrays: median {statistics.median(ratios):.3f}")
    if stall_share:
        print(f"distribute loop: share of its time spent in next() (making a batch of in-memory "
              f"arrays on the loop's thread, or waiting for the prefetch thread): median "
              f"{statistics.median(stall_share):.1%}")
    # CPU time is what a loop's host work takes from the cores the devices compute on; it is less
    # disturbed than wall time when other jobs share the machine.
    for n in names[1:]:
        ratios = [h / o for o, h in zip(cpu[n], cpu["hand"])]
        print(f"{n} / hand-written CPU per step: median {statistics.median(ratios):.3f} "
              f"({statistics.median(cpu[n]) * 1e3:.2f} vs {statistics.median(cpu['hand']) * 1e3:.2f} "
              "ms of CPU per step)")
    # The table: what a step costs the host, and what the devices get done.
    print("\n| loop | host CPU per step | throughput vs hand-written |\n|---|---|---|")
    table = []
    for n in names:
        ratios = [o / h for o, h in zip(rows[n], rows["hand"])]
        ratio = statistics.median(ratios)
        print(f"| {n} | {statistics.median(cpu[n]) * 1e3:.3f} ms | {ratio:.2f} |")
        table.append({"loop": n, "cpu_ms_per_step": statistics.median(cpu[n]) * 1e3,
                      "vs_hand": ratio, "vs_hand_min": min(ratios), "vs_hand_max": max(ratios),
                      "examples_per_s": statistics.median(rows[n]) * args.batch})
    for a, b, target in (("fit", "hand_fed", "<= 1.25"), ("distribute", "hand_fed", "<= 1.25"),
                         ("per_replica", "global", "<= 1.5"), ("readme", "global", "<= 1.5")):
        if a in names and b in names:
            ratios = [ca / cb for ca, cb in zip(cpu[a], cpu[b])]
            print(f"CPU per step {a} / {b}: median {statistics.median(ratios):.3f} (min "
                  f"{min(ratios):.3f}, max {max(ratios):.3f}; target {target})")
    if "fit" in names and "fit_k" in names:
        ratios = [k / o for k, o in zip(rows["fit_k"], rows["fit"])]
        print(f"fit_k (steps_per_execution={args.spe}) / fit steps/s: median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}; "
              "target >= 2 on the tiny model at K=9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_name, "devices": len(devices), "batch": args.batch,
                       "steps": args.steps, "reps": args.reps, "spe": args.spe,
                       "device_kind": devices[0].device_kind, "platform": devices[0].platform,
                       "jax": jax.__version__, "table": table}, f, indent=1)
    check = args.check if args.check != "auto" else (
        "final" if devices[0].platform == "cpu" else "highest")

    def all_params(found):  # every leaf: a loop that trains one layer wrong differs somewhere
        return {n: [np.asarray(a) for a in jax.tree.leaves(
            jax.device_get(strategy.to_mirrored(found[n]).params))] for n in names}

    final = all_params(states)
    if check == "highest":
        worst = max(float(np.max(np.abs(a - b))) for n in names[1:]
                    for a, b in zip(final["hand"], final[n]))
        print(f"timed loops' parameters at the default matmul precision: largest difference from "
              f"the hand-written loop's {worst:.2e} (not checked)")
        # Every loop again from the same state, where programs that mask or loop differently
        # compute the same matmuls: the agreement that tells whether they compute the same step.
        with jax.default_matmul_precision("highest"):
            fresh = fresh_states()
            for n in names:
                fresh[n] = loops[n](fresh[n], min(8, args.steps))[0]
            jax.block_until_ready(fresh)
        final = all_params(fresh)
    for n in names[1:]:  # same computation, so the same parameters after the same steps
        for i, (a, b) in enumerate(zip(final["hand"], final[n])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{n} ended away from "
                                       f"the hand-written loop ({check}), parameter leaf {i}")
    print(f"every loop ended on the hand-written loop's parameters (check: {check})")
    if args.json:  # what a reader of the file (benchmarks/gpu_verdict.py) holds the run to
        with open(args.json) as f:
            written = json.load(f)
        with open(args.json, "w") as f:
            json.dump({**written, "same_numbers": check}, f, indent=1)
    del jnp


if __name__ == "__main__":
    main()
