"""@jaxdist.mirrored vs a hand-written jax.jit step with explicit shardings, same 8-device mesh.

Both run the same MLP step (784-256-128-10, Adam, global batch 512) on the same device-resident
batches; compilation is excluded; repetitions are interleaved so machine noise hits both alike.
Each repetition syncs every 8 steps (XLA:CPU deadlocks with too many queued collectives).

    python benchmarks/overhead.py [--devices 8] [--reps 7] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding

    import jaxdist
    from jaxdist import models

    devices = jax.devices()[:args.devices]
    x, y = jaxdist.datasets.synthetic(args.batch * 4, shape=(784,))

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

    def make_state():
        return models.create_train_state(models.MLP(hidden=(256, 128)), x[:1])

    hand_batches = [jax.device_put((x[i::4], y[i::4]), dat) for i in range(4)]
    our_batches = [ours.strategy.layout.put_batch((x[i::4], y[i::4])) for i in range(4)]
    states = {"hand": jax.device_put(make_state(), rep), "jaxdist": ours.strategy.put(make_state())}

    def timed(name, fn, batches):
        state = states[name]
        state, m = fn(state, batches[0])  # compile / warm
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, m = fn(state, batches[i % 4])
            if i % 8 == 7:
                jax.block_until_ready(m)
        jax.block_until_ready((state, m))
        states[name] = state
        return args.steps / (time.perf_counter() - t0)

    ratios, rows = [], []
    for r in range(args.reps):
        h = timed("hand", hand, hand_batches)
        o = timed("jaxdist", ours, our_batches)
        ratios.append(o / h)
        rows.append((h, o))
        print(f"rep {r}: hand-written {h:8.1f} steps/s   jaxdist {o:8.1f} steps/s   ratio {o / h:.3f}")
    med_h = statistics.median(h for h, _ in rows)
    med_o = statistics.median(o for _, o in rows)
    print(f"\n{len(devices)} devices, MLP 784-256-128-10, global batch {args.batch}, "
          f"{args.steps} steps x {args.reps} interleaved reps (jax {jax.__version__})")
    print(f"median throughput: hand-written {med_h * args.batch:,.0f} ex/s, "
          f"jaxdist {med_o * args.batch:,.0f} ex/s")
    print(f"jaxdist / hand-written steps/s: min {min(ratios):.3f}  median "
          f"{statistics.median(ratios):.3f}  max {max(ratios):.3f}   (target: median >= 0.95)")
    np.testing.assert_allclose(  # same computation, so the same parameters after the same steps
        jax.tree.leaves(jax.device_get(states["hand"].params))[0],
        jax.tree.leaves(jax.device_get(states["jaxdist"].params))[0], rtol=1e-4, atol=1e-5)
    del jnp


if __name__ == "__main__":
    main()
