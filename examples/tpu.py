"""TPUStrategy over every TPU core (a Cloud TPU VM, a Colab TPU runtime, or a multi-host slice).

    python examples/tpu.py [--epochs 10]          # on a TPU VM: pip install "jaxdist[tpu]"
    python examples/tpu.py --require-tpu          # exit with status 2 instead of falling back

Without a TPU it says so and falls back to MirroredStrategy over the devices it has (8 simulated
CPU devices on a CPU), so the script itself can be tried anywhere. On a multi-host slice, run the
same command on every host (`gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...`);
`jaxdist.initialize()` finds the other hosts through the TPU metadata.
"""

import argparse
import sys

import jaxdist

jaxdist.initialize()  # before any other JAX call: on a slice, joins the other hosts

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # only the CPU fallback reads this

from jaxdist import models  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--require-tpu", action="store_true", help="fail instead of falling back")
    args = ap.parse_args()
    try:
        strategy = jaxdist.TPUStrategy()
    except RuntimeError as e:
        if args.require_tpu:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        strategy = jaxdist.MirroredStrategy()
        print(f"No TPU here ({jax.default_backend()} backend): falling back to MirroredStrategy "
              f"over {strategy.num_replicas_in_sync} {jax.default_backend()} devices. "
              "On a Cloud TPU VM or a Colab TPU runtime, `pip install \"jaxdist[tpu]\"` and rerun.")
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(), x[:1], learning_rate=3e-3)
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                          strategy.distribute((x, y), 128, shuffle=True), epochs=args.epochs,
                          eval_step=models.classifier_eval_step,
                          eval_data=strategy.distribute((x_test, y_test), 128),
                          verbose=int(jax.process_index() == 0))
    if jax.process_index() == 0:
        print(f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replicas on "
              f"{jax.process_count()} host(s), test accuracy {history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
