"""Equinox: a module with static fields (its activation functions) as the state of a distributed step.

    python examples/equinox_mlp.py [--epochs 3]

jaxdist partitions a state as ``eqx.partition(state, eqx.is_array)`` would: array leaves are
placed, traced, donated and checkpointed; other leaves (functions, strings) travel unchanged.
So the step is plain Equinox (``eqx.filter_value_and_grad``, ``eqx.apply_updates``) and needs no
``eqx.filter_jit``: the strategy compiles it.
"""

import argparse
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist  # noqa: E402

OPTIMIZER = optax.adam(3e-3)


def loss_fn(model, x, y, mask):
    logits = jax.vmap(model)(x.reshape(x.shape[0], -1))
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jaxdist.compute_average_loss(per_example, mask)  # mean over the real examples


def train_step(state, batch):
    model, opt_state = state
    (x, y), mask = batch
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, mask)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), {"loss": loss}


def eval_step(state, batch):
    model, _ = state
    (x, y), mask = batch
    logits = jax.vmap(model)(x.reshape(x.shape[0], -1))
    return {"accuracy": jaxdist.compute_average_loss((logits.argmax(-1) == y).astype(jnp.float32),
                                                     mask)}


def new_state(seed):
    model = eqx.nn.MLP(64, 10, 128, depth=1, key=jax.random.key(seed))
    return model, OPTIMIZER.init(eqx.filter(model, eqx.is_array))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    strategy = jaxdist.MirroredStrategy()
    history = jaxdist.fit(strategy.step(train_step), new_state(0),
                          strategy.distribute((x, y), 128, shuffle=True), epochs=args.epochs,
                          eval_step=eval_step, eval_data=strategy.distribute((x_test, y_test), 128),
                          verbose=0)
    model = history.state[0]
    print(f"Equinox MLP ({model.activation.__name__} kept as a static field), "
          f"{strategy.num_replicas_in_sync} replicas, test accuracy "
          f"{history.history['val_accuracy'][-1]:.4f}")

    with tempfile.TemporaryDirectory() as ckpt:
        mgr = jaxdist.checkpoint.CheckpointManager(ckpt, async_save=False)
        mgr.save(args.epochs, history.state)  # the arrays; the functions are the target's
        restored, _ = mgr.restore(target=new_state(1), strategy=jaxdist.OneDeviceStrategy())
    flat = x_test.reshape(len(x_test), -1)
    # The same parameters (the restored bytes) on 1 device: the logits of the one model and the
    # other may differ only by float32 rounding of a differently placed computation, a few ulps.
    np.testing.assert_allclose(jax.vmap(restored)(flat), jax.vmap(model)(flat), rtol=1e-5,
                               atol=1e-5)
    print(f"restored on 1 device: the same predictions for {len(flat)} test examples")


if __name__ == "__main__":
    main()
