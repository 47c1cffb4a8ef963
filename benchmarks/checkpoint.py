"""Async vs synchronous checkpoint saves of a >= 100 MB train state: time the caller is blocked.

Interleaved repetitions, each save into a fresh step of one CheckpointManager per mode; "blocking"
is the time `save()` holds the training loop, "total" adds `wait_until_finished()` (durable).
Each mode runs with integrity digests (the default, `verify=True`) and without (`-nodigest`),
and each rep also times a restore of the step just written: the ratios with / without digests
are the cost of corruption detection.

    python benchmarks/checkpoint.py [--mb 256] [--reps 3] [--devices 8]
    python benchmarks/checkpoint.py --quick   # every mode on a 4 MB state: the plumbing, seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB (float32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing in seconds: every mode, a 4 MB state on 2 "
                         "devices, 2 repetitions")
    args = ap.parse_args()
    if args.quick:  # options given explicitly still win
        ap.set_defaults(mb=4, reps=2, devices=2)
        args = ap.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        raise SystemExit(f"benchmarks/checkpoint.py: --dir {args.dir} is not a directory; create it "
                         "or leave --dir out to write under a temporary directory")

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp

    import jaxdist
    from jaxdist.checkpoint import CheckpointManager

    strategy = jaxdist.MirroredStrategy()
    n_leaves = 8
    per_leaf = args.mb * (1 << 20) // 4 // n_leaves
    state = strategy.put({f"w{i}": jnp.full((per_leaf,), float(i), jnp.float32)
                          for i in range(n_leaves)})
    jax.block_until_ready(state)
    size = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
    root = tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-", dir=args.dir)
    managers = {f"{mode}{tag}": CheckpointManager(f"{root}/{mode}{tag}", max_to_keep=1,
                                                   async_save=mode == "async", verify=verify)
                for mode in ("async", "sync") for tag, verify in (("", True), ("-nodigest", False))}
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in managers}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    try:
        for mgr in managers.values():  # warm-up: first saves pay one-off setup costs
            mgr.save(0, state)
            mgr.wait_until_finished()
        for mgr in managers.values():  # warm-up of the restore path too
            jax.block_until_ready(mgr.restore(0, target=target, strategy=strategy))
        for rep in range(1, args.reps + 1):
            order = list(managers.items())
            for mode, mgr in order if rep % 2 else order[::-1]:  # alternate the order
                t0 = time.perf_counter()
                mgr.save(rep, state)
                blocked = time.perf_counter() - t0
                mgr.wait_until_finished()
                total = time.perf_counter() - t0
                t1 = time.perf_counter()
                jax.block_until_ready(mgr.restore(rep, target=target, strategy=strategy))
                results[mode].append((blocked, total, time.perf_counter() - t1))
                print(f"rep {rep} {mode:14s}: blocking {blocked:7.3f} s   total {total:7.3f} s"
                      f"   restore {results[mode][-1][2]:7.3f} s")
    finally:
        for mgr in managers.values():
            mgr.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {m: tuple(statistics.median(x[i] for x in r) for i in range(3))
           for m, r in results.items()}
    print(f"\nstate {size:.0f} MB replicated on {strategy.num_replicas_in_sync} devices, "
          f"{args.reps} interleaved reps, medians:")
    for m, (b, t, r) in med.items():
        print(f"  {m:14s}: blocking {b:.3f} s, total {t:.3f} s ({size / t:.0f} MB/s), "
              f"restore {r:.3f} s")
    print(f"async blocking / sync save time = {med['async'][0] / med['sync'][1]:.3f}  "
          f"(target <= 0.2)")

    def restore(tag: str) -> float:
        return statistics.median([med[f"async{tag}"][2], med[f"sync{tag}"][2]])

    print("with / without digests: "
          f"async blocking {med['async'][0] / med['async-nodigest'][0]:.2f}, "
          f"async total {med['async'][1] / med['async-nodigest'][1]:.2f}, "
          f"sync save {med['sync'][1] / med['sync-nodigest'][1]:.2f}, "
          f"restore {restore('') / restore('-nodigest'):.2f}")


if __name__ == "__main__":
    main()
