"""Digits MLP pieces shared by the parameter-server tests, and a multi-process job script.

Run by every process of a job (``jaxdist launch --ps 2 --workers 3 digits_job.py ...``):
the coordinator trains for ``--steps`` closures and writes a JSON summary to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist
import jaxdist.ps as ps


def digits():
    """``(x_train, y_train), (x_test, y_test)`` of jaxdist's built-in digits (fixed 80/20 split)."""
    return jaxdist.datasets.digits()


MODEL = jaxdist.models.MLP(hidden=(64,))


def init_params(seed=0):
    return MODEL.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"]


def loss_fn(params, batch):
    x, y = batch
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params, x, y):
    logits = MODEL.apply({"params": params}, jnp.asarray(x))
    return float((jnp.argmax(logits, -1) == jnp.asarray(y)).mean())


@ps.remote
def batches(worker_index, num_workers, batch_size=32):
    """Endless shuffled batches of this worker's shard of the training set."""
    (x, y), _ = digits()
    x, y = x[worker_index::num_workers], y[worker_index::num_workers]
    rng = np.random.default_rng(worker_index)
    while True:
        order = rng.permutation(len(x))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            yield x[idx], y[idx]


@ps.remote
def train_step(worker, iterator):
    return worker.step(next(iterator))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", required=True)
    p.add_argument("--staleness", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--dead-after", type=float, default=5.0)
    p.add_argument("--wait-workers-at", type=int, default=None,
                   help="after scheduling this many steps, join and wait until every worker "
                        "is live (a killed and restarted worker has rejoined)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s: %(message)s")
    strategy = ps.ParameterServerStrategy(None, staleness=a.staleness,
                                          checkpoint_dir=a.checkpoint_dir,
                                          checkpoint_every=a.checkpoint_every,
                                          dead_after_s=a.dead_after)
    coord = strategy.start(init_params(), ps.optimizer("adam", learning_rate=3e-3), loss_fn)
    try:
        it = coord.create_per_worker_dataset(batches)
        values = []
        for i in range(a.steps):
            values.append(coord.schedule(train_step, args=(it,)))
            if a.wait_workers_at == i + 1:
                coord.join()
                deadline = time.monotonic() + 120
                while len(coord.live_workers()) < coord.num_workers:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"live workers: {coord.live_workers()}")
                    time.sleep(0.1)
        coord.join()
        (_, _), (xt, yt) = digits()
        summary = {
            "accuracy": accuracy(coord.fetch_params(), xt, yt),
            "closure_ids": [v.closure_id for v in values],
            "logs": [[list(map(int, (r.step_id, r.worker, r.computed_on, r.applied_at)))
                      for r in log] for log in coord.server_logs()],
            "rescheduled": coord.rescheduled,
            "lost_updates": {str(k): v for k, v in coord.lost_updates().items()},
            "final_loss": float(values[-1].fetch()),
        }
        with open(a.out, "w") as f:
            json.dump(summary, f)
    finally:
        coord.shutdown()


if __name__ == "__main__":
    sys.exit(main())
