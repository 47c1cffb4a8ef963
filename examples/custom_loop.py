"""A tf.distribute-style custom training loop: strategy.run, jaxdist.all_reduce, strategy.reduce.

    python examples/custom_loop.py [--epochs 5] [--devices 4]

Each replica computes local gradients on its slice of the global batch; `jaxdist.all_reduce` sums
them (the one place they are combined); `strategy.reduce` sums the replicas' shares of the loss.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist import models  # noqa: E402


def replica_step(state, batch):
    (x, y), mask = batch

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return jaxdist.compute_average_loss(  # local sum / global count of real examples
            optax.softmax_cross_entropy_with_integer_labels(logits, y), mask)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jaxdist.all_reduce(grads, "sum")
    return state.apply_gradients(grads=grads), loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    args = ap.parse_args()
    strategy = jaxdist.MirroredStrategy(jax.devices()[:args.devices] if args.devices else None)
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(), x[:1], learning_rate=3e-3)
    dataset = strategy.distribute((x, y), 128, shuffle=True)
    for epoch in range(args.epochs):
        total = []
        for batch in dataset:
            state, loss = strategy.run(replica_step, args=(state, batch))
            total.append(strategy.reduce("sum", loss))
        print(f"epoch {epoch + 1}: loss {float(np.mean(jax.device_get(total))):.4f}")
    # One copy. The check is exact (bit for bit), not a tolerance: every replica applied the
    # same all-reduced gradients to the same parameters with the same float32 operations.
    state = strategy.to_mirrored(state, check=True)
    logits = state.apply_fn({"params": state.params}, x_test)
    accuracy = float((np.argmax(logits, -1) == y_test).mean())
    print(f"{strategy.num_replicas_in_sync} replicas, test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
