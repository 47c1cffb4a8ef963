"""zero_stage 0-3 on one mesh: step time ratios vs stage 0, bytes per device, collectives.

The same MLP step (784-256-128-10 by default, Adam, global batch 512, `models.classifier_train_step`)
under `MirroredStrategy(zero_stage=K)` for K = 0..3, on the same device-resident batches and the same
8 simulated devices; compilation excluded. Repetitions are interleaved and the order of the stages
rotates from one repetition to the next, so machine noise hits all alike; each ratio is stage 0's
time / the stage's time in the same repetition (> 1: faster than stage 0), median over repetitions.
Bytes per device are read from the state's addressable shards; temporary bytes from the compiled
step's `memory_analysis()`; collectives from its HLO. The stages' parameters after the timed steps
are checked against stage 0's (2e-5).

    python benchmarks/sharding.py [--devices 8] [--reps 16] [--steps 32] [--hidden 256 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np

    import jaxdist
    from jaxdist import models, zero

    x, y = jaxdist.datasets.synthetic(args.batch * 4, shape=(784,))
    stages = (0, 1, 2, 3)
    runs = {}
    for k in stages:
        s = jaxdist.MirroredStrategy(jax.devices()[:args.devices], zero_stage=k)
        state = models.create_train_state(models.MLP(hidden=tuple(args.hidden)), x[:1], seed=0)
        step = s.step(models.classifier_train_step)
        batches = [s.layout.put_batch((x[i:i + args.batch], y[i:i + args.batch]))
                   for i in range(0, len(x), args.batch)]
        compiled = step.lower(state, batches[0]).compile()
        txt = compiled.as_text()
        ops = sorted(set(re.findall(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all)"
                                    r"(?:-start)?\(", txt)))
        counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", txt)) for op in ops}
        mem = compiled.memory_analysis()
        state, _ = step(state, batches[0])  # compile and warm up
        jax.block_until_ready(state)
        per_dev = {part: max(zero.bytes_per_device(getattr(state, part)).values())
                   for part in ("params", "opt_state")}
        runs[k] = dict(strategy=s, step=step, state=state, batches=batches, ops=counts,
                       temp=mem.temp_size_in_bytes, bytes=per_dev, times=[])

    def timed(k):
        r = runs[k]
        state, step, batches = r["state"], r["step"], r["batches"]
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        r["state"] = state
        return (time.perf_counter() - t0) / args.steps

    load0 = os.getloadavg()
    ratios = {k: [] for k in stages}
    for rep in range(args.reps):
        order = stages[rep % 4:] + stages[:rep % 4]
        got = {k: timed(k) for k in order}
        for k in stages:
            runs[k]["times"].append(got[k])
            ratios[k].append(got[0] / got[k])
    load1 = os.getloadavg()

    ref = jax.device_get(runs[0]["state"].params)
    for k in stages[1:]:
        got = jax.device_get(runs[k]["state"].params)
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"stage {k}")

    def kib(b):
        return f"{b / 1024:,.1f}"

    b0 = runs[0]["bytes"]
    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}; {args.devices} simulated CPU devices; "
        f"MLP 784-{'-'.join(map(str, args.hidden))}-10, Adam, global batch {args.batch}; "
        f"{args.steps} steps a window, {args.reps} interleaved repetitions; load average "
        f"{' '.join(f'{v:.2f}' for v in load0)} at the start, "
        f"{' '.join(f'{v:.2f}' for v in load1)} at the end", "",
        "| zero_stage | median step (ms) | stage 0 ÷ it, same rep (median) | min..max ratio | "
        "params KiB/device | opt state KiB/device | state vs stage 0 | temp KiB (compiled) | "
        "collectives in the step |",
        "|---|---|---|---|---|---|---|---|---|"]
    for k in stages:
        r = runs[k]
        state_frac = sum(r["bytes"].values()) / sum(b0.values())
        ops = ", ".join(f"{n} {op}" for op, n in r["ops"].items())
        lines.append(
            f"| {k} | {statistics.median(r['times']) * 1e3:.3f} | {statistics.median(ratios[k]):.3f} | "
            f"{min(ratios[k]):.2f}..{max(ratios[k]):.2f} | {kib(r['bytes']['params'])} | "
            f"{kib(r['bytes']['opt_state'])} | {state_frac:.3f} | {kib(r['temp'])} | {ops} |")
    lines += ["", "parameters after the timed steps: stages 1-3 equal stage 0's to 2e-5 (checked)",
              "", "`python benchmarks/sharding.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "out" and v is not None) + "`"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
