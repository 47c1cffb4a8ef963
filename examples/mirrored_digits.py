"""Train the digits MLP with @jaxdist.mirrored on every local device (8 simulated on a CPU).

    python examples/mirrored_digits.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import jaxdist  # noqa: E402
from jaxdist import models  # noqa: E402


def main():
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    train_step = jaxdist.mirrored(models.classifier_train_step)
    strategy = train_step.strategy
    state = models.create_train_state(models.MLP(), x[:1])
    history = jaxdist.fit(train_step, state, strategy.distribute((x, y), 128, shuffle=True),
                          epochs=10, eval_step=models.classifier_eval_step,
                          eval_data=strategy.distribute((x_test, y_test), 128))
    print(f"{strategy.num_replicas_in_sync} replicas, test accuracy "
          f"{history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
