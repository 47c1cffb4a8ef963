"""What per-process input costs: an input function (a key-value exchange per step across processes)
against ``strategy.distribute`` of in-memory arrays (no exchange), same rows, same global batch.

Both only iterate (host batches assembled and placed on the devices; no training step), so the
difference is the input path itself. Repetitions alternate the order. Run it under the launcher:

    jaxdist launch -n 2 --devices-per-process 2 benchmarks/input_sync.py [--steps 200] [--reps 5]

(one process works too: then no exchange happens at all.) ``--quick``: 10 steps, 2 repetitions,
the plumbing in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing in seconds: 10 steps, 2 repetitions")
    args = ap.parse_args()
    if args.quick:  # options given explicitly still win
        ap.set_defaults(steps=10, reps=2)
        args = ap.parse_args()

    import jaxdist

    jaxdist.initialize()
    import jax
    import numpy as np

    s = jaxdist.MultiWorkerMirroredStrategy()
    n = args.steps * args.batch
    x = np.random.default_rng(0).normal(size=(n, 64)).astype(np.float32)
    y = np.arange(n, dtype=np.int32)

    def fn(ctx):
        size = ctx.get_per_replica_batch_size(args.batch)
        mine = np.arange(ctx.input_pipeline_id, n, ctx.num_input_pipelines)
        return [(x[mine[i:i + size]], y[mine[i:i + size]]) for i in range(0, len(mine), size)]

    arrays = s.distribute((x, y), args.batch)
    from_fn = s.distribute_datasets_from_function(fn)

    def epoch(ds) -> float:
        t0 = time.perf_counter()
        steps = 0
        for b in ds:  # noqa: B007 (the last batch is waited for below)
            steps += 1
        jax.block_until_ready(b)
        assert steps == args.steps, steps
        return (time.perf_counter() - t0) / steps * 1e3

    epoch(arrays), epoch(from_fn)  # warm-up
    times = {"arrays": [], "from_fn": []}
    for rep in range(args.reps):
        order = ("arrays", "from_fn") if rep % 2 == 0 else ("from_fn", "arrays")
        for name in order:
            times[name].append(epoch(arrays if name == "arrays" else from_fn))
    if jax.process_index() == 0:
        a, f = statistics.median(times["arrays"]), statistics.median(times["from_fn"])
        print(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices, global "
              f"batch {args.batch}, {args.steps} steps x {args.reps} reps (median ms/step): "
              f"distribute(arrays) {a:.3f}, distribute_datasets_from_function {f:.3f}, "
              f"ratio {f / a:.2f}, difference {f - a:+.3f} ms/step")


if __name__ == "__main__":
    main()
