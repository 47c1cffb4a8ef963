"""The CNN's max-pool: flax's ``nn.max_pool`` (reduce_window) against ``jaxdist.models.max_pool``.

Times one training step (Adam, softmax cross-entropy) of Conv32(3x3, SAME)-MaxPool2-Dense64-10
(``jaxdist.models.CNN``) under ``@jaxdist.mirrored``, written twice: pooling with
``nn.max_pool(x, (2, 2), strides=(2, 2))``, whose gradient is a select-and-scatter, and with
``models.max_pool`` (reshape + max), whose gradient is a compare and a select. Same parameters, same
values; the parameters after the timed steps are checked to agree. Each device count runs in its
own process (the count is fixed when JAX starts); inside it the two versions alternate order every
repetition, compilation excluded; the ratio is the median of the per-repetition ratios.

What a user's own model can do: pool with ``jaxdist.models.max_pool`` wherever the windows do not
overlap (window == strides, VALID padding). Overlapping windows still need ``nn.max_pool``.

    python benchmarks/cnn_pool.py [--devices 1 8] [--batch 512] [--reps 7] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _measure(devices: int, batch: int, reps: int, steps: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import flax.linen as nn
    import numpy as np
    import optax

    import jaxdist
    from jaxdist import models

    class FlaxPoolCNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    def train_step(state, batch):
        x, y = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    step = jaxdist.mirrored(devices=jax.devices()[:devices])(train_step)
    data = step.strategy.layout.put_batch((x, y))
    names = {"nn.max_pool": FlaxPoolCNN(), "models.max_pool": models.CNN()}
    states = {n: step.strategy.put(models.create_train_state(m, x[:1])) for n, m in names.items()}
    for n in names:  # compile and warm up
        states[n], m = step(states[n], data)
        jax.block_until_ready(m)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in (list(names) if r % 2 == 0 else list(names)[::-1]):
            t0 = time.perf_counter()
            for _ in range(steps):
                states[n], m = step(states[n], data)
            jax.block_until_ready((states[n], m))
            times[n].append((time.perf_counter() - t0) / steps)
    a, b = (jax.tree.leaves(jax.device_get(states[n].params)) for n in names)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    ratios = [w / r for w, r in zip(times["nn.max_pool"], times["models.max_pool"])]
    return {"devices": devices, "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "speedup": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--batch", type=int, default=512, help="global batch")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="steps per timed window")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per device count")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(_measure(args.worker, args.batch, args.reps, args.steps)))
        return
    import jax

    print(f"CNN Conv32-MaxPool2-Dense64-10, Adam, global batch {args.batch}, {args.steps} steps x "
          f"{args.reps} interleaved reps, jax {jax.__version__}\n")
    print("| devices | nn.max_pool step (ms) | models.max_pool step (ms) | speed-up (median, min-max) |")
    print("|---|---|---|---|")
    for n in args.devices:
        out = subprocess.run([sys.executable, __file__, "--worker", str(n), "--batch", str(args.batch),
                              "--reps", str(args.reps), "--steps", str(args.steps)],
                             capture_output=True, text=True, timeout=args.timeout, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {n} | {r['ms']['nn.max_pool']:.1f} | {r['ms']['models.max_pool']:.1f} | "
              f"{r['speedup']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
