"""Mixed precision and gradient accumulation: step time and memory, as ratios to float32 / k=1.

One invocation measures, on the same devices, model and global batch:

* step time of ``mixed_bfloat16`` and ``mixed_float16`` against ``float32`` (repetitions
  interleaved, order alternated each round, compilation excluded; median of the per-round ratios);
* memory of the compiled step: XLA's temporary buffers (activations and gradients) and the live
  arguments (state + batch), from ``compiled.memory_analysis()``;
* the same memory figures for gradient accumulation with k = 1, 2, 4, 8 micro-batches (and step
  time against k = 1).

The model is the benchmark MLP (784-256-128-10 by default; ``--hidden`` to change), Adam.
Syncs every 8 steps (XLA:CPU deadlocks with too many queued collectives).

    python benchmarks/precision.py [--devices 8] [--batch 4096] [--reps 5] [--steps 16]
    python benchmarks/precision.py --quick   # every row at tiny sizes: the plumbing, seconds
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096, help="global batch")
    ap.add_argument("--hidden", default="256,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--wide-hidden", default="1024,1024",
                    help="the activation-bound model of the memory-only section")
    ap.add_argument("--wide-batch", type=int, default=16384)
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing in seconds: every row on 2 devices, a small "
                         "MLP (the memory-only section's too), 2 rounds of 2 steps")
    args = ap.parse_args()
    if args.quick:  # options given explicitly still win
        # the memory-only section on the timed model and batch: it reuses their measurements
        ap.set_defaults(devices=2, batch=64, hidden="32,32", reps=2, steps=2, wide_hidden="32,32",
                        wide_batch=64)
        args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jaxdist
    from jaxdist import models

    strategy = jaxdist.MirroredStrategy(jax.devices()[:args.devices])
    x, y = jaxdist.datasets.synthetic(max(args.batch, args.wide_batch), shape=(784,))
    batch = next(iter(strategy.distribute((x[:args.batch], y[:args.batch]), args.batch)))
    hidden = tuple(int(h) for h in args.hidden.split(","))

    def make_state(precision, model=hidden):
        return strategy.put(models.create_train_state(models.MLP(hidden=model), x[:1],
                                                      precision=precision))

    @functools.cache  # one step per k: it compiles once per state and batch shape it meets
    def make_step(k):
        # the public distributed step (what `@jaxdist.mirrored` builds): it traces the step in the
        # strategy's replica context itself, which accumulation needs to split each replica's rows
        return strategy.step(functools.partial(models.classifier_train_step, accumulate=k))

    measured = {}

    def memory(k, precision, model=hidden, on=None, state=None):
        """Temporary and argument bytes of the compiled step, each program compiled once (the
        sections share programs: float32 k=1 always, every one but the last under --quick)."""
        on = batch if on is None else on
        key = (k, precision, model, jax.tree.leaves(on)[0].shape)
        if key not in measured:
            state = make_state(precision, model) if state is None else state
            m = make_step(k).lower(state, on).compile().memory_analysis()
            measured[key] = m.temp_size_in_bytes, m.argument_size_in_bytes
        return measured[key]

    def run(step, state):
        state, m = step(state, batch)  # warm (compiled already)
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, m = step(state, batch)
            if i % 8 == 7:
                jax.block_until_ready(m)
        jax.block_until_ready((state, m))
        return (time.perf_counter() - t0) / args.steps, state

    def compare(variants: dict, baseline: str) -> dict:
        """Median over rounds of (variant time / baseline time); order alternates per round."""
        states = {name: s for name, (_, s) in variants.items()}
        ratios: dict[str, list[float]] = {n: [] for n in variants if n != baseline}
        times: dict[str, list[float]] = {n: [] for n in variants}
        names = list(variants)
        for r in range(args.reps):
            order = names if r % 2 == 0 else names[::-1]
            got = {}
            for n in order:
                got[n], states[n] = run(variants[n][0], states[n])
                times[n].append(got[n])
            for n in ratios:
                ratios[n].append(got[n] / got[baseline])
        return {n: (statistics.median(times[n]),
                    statistics.median(ratios[n]) if n in ratios else 1.0) for n in names}

    print(f"{args.devices} CPU devices, MLP 784-{'-'.join(map(str, hidden))}-10, Adam, global batch "
          f"{args.batch}, {args.reps} interleaved rounds of {args.steps} steps")
    print("\n[precision] step time and compiled-step memory vs float32")
    variants = {}
    for p in ("float32", "mixed_bfloat16", "mixed_float16"):
        step, state = make_step(1), make_state(p)
        variants[p] = (step, state)
    mem = {p: memory(1, p, state=st) for p, (_, st) in variants.items()}
    res = compare(variants, "float32")
    for p, (t, ratio) in res.items():
        temp, arg = mem[p]
        print(f"  {p:15s} {t * 1e3:8.2f} ms/step  time x{ratio:5.2f}  temp {temp / 2**20:7.2f} MiB "
              f"(x{temp / mem['float32'][0]:.2f})  args {arg / 2**20:6.2f} MiB")

    print("\n[accumulation] float32, k micro-batches per step vs k=1")
    ks = [k for k in (1, 2, 4, 8) if (args.batch // args.devices) % k == 0]
    variants = {f"k={k}": (make_step(k), make_state("float32")) for k in ks}
    mem = {f"k={k}": memory(k, "float32", state=variants[f"k={k}"][1]) for k in ks}
    res = compare(variants, "k=1")
    for n, (t, ratio) in res.items():
        temp, arg = mem[n]
        print(f"  {n:5s} {t * 1e3:8.2f} ms/step  time x{ratio:5.2f}  temp {temp / 2**20:7.2f} MiB "
              f"(x{temp / mem['k=1'][0]:.2f})")

    wide = tuple(int(h) for h in args.wide_hidden.split(","))
    wb = args.wide_batch
    big = next(iter(strategy.distribute((x[:wb], y[:wb]), wb)))
    print(f"\n[memory only, activation-bound] MLP 784-{'-'.join(map(str, wide))}-10, global batch "
          f"{wb} ({wb // args.devices} rows a device); per-device bytes of the compiled step")
    base = None
    for p, k in [("float32", 1), ("mixed_bfloat16", 1), ("mixed_float16", 1), ("float32", 2),
                 ("float32", 4), ("float32", 8), ("mixed_bfloat16", 8)]:
        temp, arg = memory(k, p, wide, on=big)
        base = base or temp
        print(f"  {p:15s} k={k}  temp {temp / 2**20:8.2f} MiB (x{temp / base:.2f})  "
              f"args {arg / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
