"""CentralStorageStrategy: one copy of the state in host memory, the step on every device.

    python examples/central_storage.py [--epochs 10]

Between steps the parameters and optimizer state live once, in host memory (`pinned_host`),
partitioned over the replicas; each step moves them to the devices and writes them back.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import jaxdist  # noqa: E402
from jaxdist import models  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    strategy = jaxdist.CentralStorageStrategy()
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(), x[:1], learning_rate=3e-3)
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                          strategy.distribute((x, y), 128, shuffle=True), epochs=args.epochs,
                          eval_step=models.classifier_eval_step,
                          eval_data=strategy.distribute((x_test, y_test), 128))
    kernel = history.state.params["Dense_0"]["kernel"]
    print(f"state in {kernel.sharding.memory_kind} memory, kernel {kernel.shape} held as "
          f"{len(kernel.addressable_shards)} shards of {kernel.addressable_shards[0].data.shape}")
    print(f"{strategy.num_replicas_in_sync} replicas, test accuracy "
          f"{history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
