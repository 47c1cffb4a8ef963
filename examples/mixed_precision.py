"""Mixed precision + gradient accumulation + the linear scaling rule, with a user-written step.

bfloat16 (or float16 with dynamic loss scaling) compute and float32 parameters; each global batch
of 256 is taken in 4 micro-batches inside one compiled step (the activation memory of 64 rows);
the learning rate follows the linear scaling rule with a warm-up; the best epoch is checkpointed
and used for predictions.

    python examples/mixed_precision.py [--precision mixed_float16] [--accumulate 4] [--epochs 12]
"""

import argparse
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist import models, precision  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="mixed_bfloat16",
                    choices=("float32", "mixed_bfloat16", "mixed_float16"))
    ap.add_argument("--accumulate", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=12)
    args = ap.parse_args()

    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    strategy = jaxdist.MirroredStrategy()
    global_batch = 32 * strategy.num_replicas_in_sync
    lr = jaxdist.schedules.linear_scaling_rule(1e-3, base_batch_size=32,
                                               global_batch_size=global_batch, warmup_steps=20)
    model = models.MLP()
    params = model.init(jax.random.key(0), x[:1])["params"]
    state = precision.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr),
                                        policy=args.precision)

    @strategy.step
    def train_step(state, batch):
        def loss_fn(params, micro):
            (xb, yb), mask = micro
            logits = state.apply_fn({"params": params}, state.policy.cast_to_compute(xb))
            per_example = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), yb)
            return jaxdist.compute_average_loss(per_example, mask)

        loss, grads = jaxdist.accumulate_gradients(
            precision.value_and_grad(loss_fn, state), state.params, batch, steps=args.accumulate)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with tempfile.TemporaryDirectory(prefix="jaxdist-mp-") as ckpt:  # removed afterwards
        history = jaxdist.fit(train_step, state,
                              strategy.distribute((x, y), global_batch, shuffle=True),
                              epochs=args.epochs, eval_step=models.classifier_eval_step,
                              eval_data=strategy.distribute((x_test, y_test), global_batch),
                              verbose=0, callbacks=[jaxdist.callbacks.ModelCheckpoint(
                                  ckpt, monitor="val_accuracy", save_best_only=True,
                                  max_to_keep=1)])
        best = jaxdist.checkpoint.CheckpointManager(ckpt).restore()  # no template needed
    logits = jaxdist.predict(lambda p, b: model.apply({"params": p}, b.data[0]), best["params"],
                             strategy.distribute((x_test, y_test), global_batch))
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    skipped = int(history.state.skipped)
    print(f"{args.precision}, {args.accumulate} micro-batches of {global_batch // args.accumulate}: "
          f"best checkpoint test accuracy {accuracy:.4f} (skipped steps: {skipped})")


if __name__ == "__main__":
    main()
