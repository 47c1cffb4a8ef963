"""All-reduce benchmark: jaxdist's ring / hierarchical / one-device implementations against XLA's psum.

Runs on 8 simulated CPU devices as a (2, 4) = (host, local) mesh, so that every implementation,
hierarchical included, reduces over the same 8 replicas. For each message size (bytes held by each
replica, float32) it times every implementation with interleaved repetitions (compile excluded,
blocking on the result), and prints the median time, the bus bandwidth 2(n-1)/n * S / t (the
nccl-tests definition) and the ratio of that bandwidth to psum's. Then it measures what
`pack_bytes` does to a pytree of many small leaves: collectives in the compiled program, and time.

    python benchmarks/allreduce.py           # 4 KiB .. 64 MiB, 200 leaves: minutes on 2 cores
    python benchmarks/allreduce.py --quick   # 4 to 64 KiB, 16 leaves: the plumbing, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts

import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxdist.core.collectives import IMPLEMENTATIONS, _count_collectives, reduce_tree  # noqa: E402

AXES = ("host", "local")
MESH_SHAPE = (2, 4)


def _mesh() -> jax.sharding.Mesh:
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(MESH_SHAPE, AXES, axis_types=auto, devices=jax.devices()[:8])


def _reducer(mesh, implementation, iters, pack_bytes=None):
    """A compiled program applying `iters` all-reduces (mean, so values stay bounded) back to back.

    Several reductions per call amortise the dispatch cost, which would otherwise dominate small
    messages; each one depends on the previous, so none can be skipped or overlapped.
    """

    def per_replica(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        def body(_, t):
            return reduce_tree(t, "mean", axes=AXES, implementation=implementation, pack_bytes=pack_bytes)
        tree = lax.fori_loop(0, iters, body, tree)
        return jax.tree.map(lambda x: x[None], tree)

    spec = jax.P(AXES)
    return jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _per_replica_input(mesh, tree_of_shapes, seed=0):
    n = mesh.size
    rng = np.random.default_rng(seed)
    sharding = jax.sharding.NamedSharding(mesh, jax.P(AXES))
    return jax.tree.map(
        lambda shape: jax.device_put(rng.standard_normal((n, *shape), dtype=np.float32), sharding),
        tree_of_shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def _time_interleaved(fns: dict, arg, reps: int) -> dict[str, float]:
    """Median seconds per call of each fn, repetitions interleaved so drifts in load hit all alike."""
    for fn in fns.values():  # compile and warm up
        jax.block_until_ready(fn(arg))
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(arg))
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.4g} {unit}"
        b /= 1024
    raise AssertionError


def bench_sizes(mesh, sizes: list[int], reps: int) -> None:
    n = mesh.size
    print(f"\nAll-reduce of one float32 message of S bytes per replica, n={n} replicas, "
          f"mesh {MESH_SHAPE} {AXES}")
    print("time = median per all-reduce; busbw = 2(n-1)/n*S/t; ratio = busbw / xla busbw (same invocation)")
    header = f"{'S':>10} " + " ".join(f"{impl:>26}" for impl in IMPLEMENTATIONS)
    print(header)
    for size in sizes:
        # Enough back-to-back reductions per call that dispatch (~0.1 ms) stays small against them.
        iters = int(max(1, min(32, 2**20 // size)))
        fns = {impl: _reducer(mesh, impl, iters) for impl in IMPLEMENTATIONS}
        x = _per_replica_input(mesh, (size // 4,))
        times = {k: t / iters for k, t in _time_interleaved(fns, x, reps).items()}
        busbw = {k: 2 * (n - 1) / n * size / t for k, t in times.items()}
        cells = [
            f"{times[k] * 1e3:8.3f} ms {busbw[k] / 1e9:6.3f} GB/s x{busbw[k] / busbw['xla']:4.2f}"
            for k in IMPLEMENTATIONS
        ]
        print(f"{_fmt_bytes(size):>10} " + " ".join(f"{c:>26}" for c in cells), flush=True)
        del x, fns


def bench_packing(mesh, num_leaves: int, reps: int, pack_bytes: int) -> None:
    rng = np.random.default_rng(1)
    shapes = [tuple(int(d) for d in rng.integers(1, 17, size=rng.integers(1, 3))) for _ in range(num_leaves)]
    total = sum(4 * int(np.prod(s)) for s in shapes)
    x = _per_replica_input(mesh, shapes, seed=2)
    print(
        f"\npack_bytes: a pytree of {num_leaves} small float32 leaves ({_fmt_bytes(total)} per replica), "
        f"one all-reduce per call, pack_bytes={pack_bytes} vs None"
    )
    print(f"{'impl':>13} {'collectives (None -> packed)':>44} {'time None':>11} {'time packed':>12} "
          f"{'speed-up':>9}")
    for impl in IMPLEMENTATIONS:
        fns = {pb: _reducer(mesh, impl, 1, pack_bytes=pb) for pb in (None, pack_bytes)}
        counts = {pb: _count_collectives(fn.lower(x).compile().as_text()) for pb, fn in fns.items()}
        times = _time_interleaved(fns, x, reps)
        desc = {pb: ",".join(f"{k}:{v}" for k, v in c.items() if v) for pb, c in counts.items()}
        print(
            f"{impl:>13} {desc[None] + ' -> ' + desc[pack_bytes]:>44} {times[None] * 1e3:8.3f} ms "
            f"{times[pack_bytes] * 1e3:9.3f} ms {times[None] / times[pack_bytes]:8.2f}x",
            flush=True,
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a check of the plumbing in seconds: every implementation and both "
                             "sections at tiny sizes (4 to 64 KiB, 16 leaves, 3 repetitions)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per measurement")
    parser.add_argument("--max-bytes", type=int, default=2**26,
                        help="largest message per replica (sizes 4 KiB, 16 KiB, ... up to it)")
    parser.add_argument("--leaves", type=int, default=200, help="leaves of the pack_bytes pytree")
    args = parser.parse_args(argv)
    if args.quick:  # options given explicitly still win
        parser.set_defaults(reps=3, max_bytes=2**16, leaves=16)
        args = parser.parse_args(argv)
    sizes = [4**k for k in range(6, 14) if 4**k <= args.max_bytes]  # 4 KiB .. 64 MiB
    mesh = _mesh()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} CPU cores")
    start = time.perf_counter()
    bench_sizes(mesh, sizes, args.reps)
    bench_packing(mesh, num_leaves=args.leaves, reps=args.reps, pack_bytes=2**20)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
