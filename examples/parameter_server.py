"""Train the digits MLP with 2 parameter servers and 3 workers (asynchronous updates).

    python examples/parameter_server.py               # servers and workers as threads
    python examples/parameter_server.py --processes   # 2 ps + 3 workers + coordinator, over gRPC

With ``--processes`` this script launches itself once per task; each copy reads its role from
``TF_CONFIG`` (which is also how it runs under ``jaxdist ps --role ... examples/parameter_server.py``
on several machines).
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist
import jaxdist.ps as ps

MODEL = jaxdist.models.MLP(hidden=(64,))


def loss_fn(params, batch):
    x, y = batch
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@ps.remote
def dataset_fn(worker_index, num_workers):
    """Each worker shuffles its own shard of the training set, endlessly, 32 at a time."""
    (x, y), _ = jaxdist.datasets.digits()
    x, y = x[worker_index::num_workers], y[worker_index::num_workers]
    rng = np.random.default_rng(worker_index)
    while True:
        order = rng.permutation(len(x))
        for i in range(0, len(order) - 31, 32):
            yield x[order[i:i + 32]], y[order[i:i + 32]]


@ps.remote
def train_step(worker, iterator):
    return worker.step(next(iterator))


def train(cluster, steps):
    strategy = ps.ParameterServerStrategy(cluster, placement="greedy")
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    # Servers rebuild the optimizer from its name, so it can travel to other processes.
    with strategy.start(params, ps.optimizer("adam", learning_rate=3e-3), loss_fn) as coord:
        print(strategy.placement_report())
        iterator = coord.create_per_worker_dataset(dataset_fn)
        losses = [coord.schedule(train_step, args=(iterator,)) for _ in range(steps)]
        coord.join()
        _, (x_test, y_test) = jaxdist.datasets.digits()
        logits = MODEL.apply({"params": coord.fetch_params()}, x_test)
        accuracy = float((np.argmax(logits, -1) == y_test).mean())
        print(f"{strategy.num_replicas_in_sync} workers, {steps} async steps: "
              f"last loss {losses[-1].fetch():.3f}, test accuracy {accuracy:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--processes", action="store_true")
    a = ap.parse_args()
    if "TF_CONFIG" in os.environ:  # a task of a multi-process job
        train(None, a.steps)
    elif a.processes:
        from jaxdist import launch
        result = launch.run([__file__, "--steps", str(a.steps)], num_ps=2, num_workers=3,
                            timeout_s=600)
        print(result.output, end="")
        sys.exit(result.returncode)
    else:
        train(ps.LocalCluster(num_ps=2, num_workers=3), a.steps)


if __name__ == "__main__":
    main()
