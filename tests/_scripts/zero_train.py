"""Trains the digits MLP at every zero_stage and saves each stage's parameters; used by
tests/test_zero_multiprocess.py.

Runs as one process (MirroredStrategy over JAX_NUM_CPU_DEVICES devices) or under `jaxdist launch`
(MultiWorkerMirroredStrategy after jaxdist.initialize()).

    python zero_train.py --out params.npz [--stages 0,1,2,3]
"""

import argparse
import os

import jax
import numpy as np

import jaxdist
from jaxdist import models, zero


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2,3")
    args = ap.parse_args()
    multi = "JAXDIST_NUM_PROCESSES" in os.environ
    if multi:
        jaxdist.initialize()
    (x, y), _ = jaxdist.datasets.digits()
    x, y = x[:420], y[:420]  # 420 / 64: 7 batches, the last one padded
    out = {}
    for stage in (int(s) for s in args.stages.split(",")):
        strategy = (jaxdist.MultiWorkerMirroredStrategy(zero_stage=stage) if multi
                    else jaxdist.MirroredStrategy(zero_stage=stage))
        state = models.create_train_state(models.MLP(hidden=(256, 128)), x[:1], seed=1)
        hist = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                           strategy.distribute((x, y), 64), epochs=2, verbose=0)
        local = zero.bytes_per_device(hist.state.opt_state)
        print(f"stage {stage}: opt_state bytes per device {sorted(set(local.values()))}", flush=True)
        out[f"bytes{stage}"] = max(local.values())
        # Gather the sharded leaves to every process (all processes call it).
        params = _fetch(hist.state.params)
        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]:
            out[f"{stage}{jax.tree_util.keystr(p)}"] = v
        out[f"step{stage}"] = int(hist.state.step)
    if jax.process_index() == 0:
        np.savez(args.out, **out)
    print("done", flush=True)


def _fetch(tree):
    """Every leaf as a numpy array on every process, whatever its sharding."""
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


if __name__ == "__main__":
    main()
