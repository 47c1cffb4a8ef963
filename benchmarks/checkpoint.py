"""Async vs synchronous checkpoint saves of a >= 100 MB train state: time the caller is blocked.

Interleaved repetitions, each save into a fresh step of one CheckpointManager per mode; "blocking"
is the time `save()` holds the training loop, "total" adds `wait_until_finished()` (durable).

    python benchmarks/checkpoint.py [--mb 256] [--reps 3] [--devices 8]
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
    managers = {"async": CheckpointManager(f"{root}/async", max_to_keep=1, async_save=True),
                "sync": CheckpointManager(f"{root}/sync", max_to_keep=1, async_save=False)}
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in managers}
    try:
        for mode, mgr in managers.items():  # warm-up: first saves pay one-off setup costs
            mgr.save(0, state)
            mgr.wait_until_finished()
        for rep in range(1, args.reps + 1):
            for mode, mgr in managers.items():
                t0 = time.perf_counter()
                mgr.save(rep, state)
                blocked = time.perf_counter() - t0
                mgr.wait_until_finished()
                results[mode].append((blocked, time.perf_counter() - t0))
                print(f"rep {rep} {mode:5s}: blocking {blocked:7.3f} s   total {results[mode][-1][1]:7.3f} s")
    finally:
        for mgr in managers.values():
            mgr.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {m: (statistics.median(b for b, _ in r), statistics.median(t for _, t in r))
           for m, r in results.items()}
    print(f"\nstate {size:.0f} MB replicated on {strategy.num_replicas_in_sync} devices, "
          f"{args.reps} interleaved reps, medians:")
    for m, (b, t) in med.items():
        print(f"  {m:5s}: blocking {b:.3f} s, total {t:.3f} s ({size / t:.0f} MB/s)")
    print(f"async blocking / sync save time = {med['async'][0] / med['sync'][1]:.3f}  "
          f"(target <= 0.2)")


if __name__ == "__main__":
    main()
