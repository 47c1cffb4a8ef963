"""Train the digits MLP with @jaxdist.mirrored and jaxdist.fit on every local device (8 simulated on a CPU).

    python examples/mirrored_digits.py [--epochs 10]

The step is written for one device over the global batch; the decorator replicates the state,
shards each batch over the devices, and XLA inserts the gradient all-reduce.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import optax  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist import models  # noqa: E402


@jaxdist.mirrored  # == jaxdist.MirroredStrategy().step(train_step)
def train_step(state, batch):
    (x, y), mask = batch  # a jaxdist.Batch: the data and a mask of real rows

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jaxdist.compute_average_loss(per_example, mask)  # mean over the real examples

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    strategy = train_step.strategy
    state = models.create_train_state(models.MLP(), x[:1])
    history = jaxdist.fit(train_step, state, strategy.distribute((x, y), 128, shuffle=True),
                          epochs=args.epochs, eval_step=models.classifier_eval_step,
                          eval_data=strategy.distribute((x_test, y_test), 128))
    print(f"{strategy.num_replicas_in_sync} replicas, test accuracy "
          f"{history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
