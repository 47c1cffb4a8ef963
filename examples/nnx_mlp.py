"""Flax NNX: a module and its optimizer passed straight to a distributed step, fit, predict, checkpoint.

    python examples/nnx_mlp.py [--epochs 3]

NNX modules are pytrees of their arrays, so jaxdist places, shards and checkpoints them like any
state: no ``nnx.split`` needed (it works too). The step mutates the module the NNX way and returns
it; jaxdist compiles it once for all the replicas.
"""

import argparse
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxdist  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1))))


def loss_fn(model, x, y, mask):
    per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return jaxdist.compute_average_loss(per_example, mask)  # mean over the real examples


@jaxdist.mirrored  # MirroredStrategy() over every device
def train_step(state, batch):
    model, optimizer = state
    (x, y), mask = batch
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, mask)
    optimizer.update(model, grads)
    return (model, optimizer), {"loss": loss}


def eval_step(state, batch):
    model, _ = state
    (x, y), mask = batch
    correct = (model(x).argmax(-1) == y).astype(np.float32)
    return {"accuracy": jaxdist.compute_average_loss(correct, mask)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    strategy = train_step.strategy
    model = MLP(rngs=nnx.Rngs(0))
    state = (model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param))
    history = jaxdist.fit(train_step, state, strategy.distribute((x, y), 128, shuffle=True),
                          epochs=args.epochs, eval_step=eval_step,
                          eval_data=strategy.distribute((x_test, y_test), 128), verbose=0)
    accuracy = history.history["val_accuracy"][-1]
    print(f"NNX MLP, {strategy.num_replicas_in_sync} replicas, test accuracy {accuracy:.4f}")

    predict = lambda state, batch: state[0](batch.data[0])  # noqa: E731
    logits = jaxdist.predict(predict, history.state, strategy.distribute((x_test, y_test), 128))
    with tempfile.TemporaryDirectory() as ckpt:
        mgr = jaxdist.checkpoint.CheckpointManager(ckpt, async_save=False)
        mgr.save(args.epochs, history.state)
        fresh = MLP(rngs=nnx.Rngs(1))
        one = jaxdist.OneDeviceStrategy()
        restored = mgr.restore(target=(fresh, nnx.Optimizer(fresh, optax.adam(3e-3), wrt=nnx.Param)),
                               strategy=one)
    again = jaxdist.predict(one.step(predict, donate=False), restored,
                            one.distribute((x_test, y_test), 128))
    # The same parameters (the restored bytes) on 1 device instead of 8: a row's logits do not
    # depend on other rows, but XLA may tile the matmul differently for another number of rows
    # per device, so float32 rounding may differ by a few ulps: 1e-5 relative.
    np.testing.assert_allclose(again, logits, rtol=1e-5, atol=1e-5 * float(np.abs(logits).max()))
    print(f"restored on 1 device: the same {len(again)} predictions")


if __name__ == "__main__":
    main()
