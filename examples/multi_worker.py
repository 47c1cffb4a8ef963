"""Multi-worker training of the digits MLP, resumable after a crash or a preemption.

    jaxdist launch -n 2 --devices-per-process 2 examples/multi_worker.py [--backup DIR]

The same file runs under SLURM (`srun python examples/multi_worker.py`), on a TF_CONFIG cluster,
or as one plain process. Rerun the same command after a kill and it resumes where it stopped.
"""

import argparse
import os
import tempfile

import jaxdist

jaxdist.initialize()  # before any other JAX call: finds the cluster (one process if none)

import jax  # noqa: E402

from jaxdist import models  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backup", default=os.path.join(tempfile.gettempdir(),
                                                     "jaxdist-multi-worker-backup"))
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(), x[:1])
    history = jaxdist.fit(
        strategy.step(models.classifier_train_step), state,
        strategy.distribute((x, y), 128, shuffle=True), epochs=args.epochs,
        eval_step=models.classifier_eval_step, eval_data=strategy.distribute((x_test, y_test), 128),
        callbacks=[jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=20,
                                                      delete_on_success=True)])
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} devices: test "
              f"accuracy {history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
