"""jaxdist.predict under `jaxdist launch` (or one process): writes this process's predictions.

    python predict_job.py --out preds_RANK.npz
"""

import argparse
import os

import jaxdist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if "JAXDIST_NUM_PROCESSES" in os.environ:
        jaxdist.initialize()
        strategy = jaxdist.MultiWorkerMirroredStrategy()
    else:
        strategy = jaxdist.MirroredStrategy()
    import jax
    import numpy as np

    from jaxdist import models

    (x, _), _ = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=3)
    # 101 examples, global batch 24: the fifth batch holds 5 real rows and 19 padding rows.
    preds = jaxdist.predict(strategy.step(models.classifier_predict_step), state,
                            strategy.distribute(x[:101], 24))
    np.savez(args.out.replace("RANK", str(jax.process_index())), preds=preds)
    print(f"process {jax.process_index()}: {preds.shape[0]} predictions")


if __name__ == "__main__":
    main()
