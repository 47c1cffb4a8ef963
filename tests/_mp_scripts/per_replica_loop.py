"""The README's per-replica loop, unchanged, on whatever the job has: one process or several.

Usage: per_replica_loop.py OUT.npz. Under `jaxdist launch -n 2` the strategy is
MultiWorkerMirroredStrategy over every process's devices; alone, MirroredStrategy over the local
devices. Process 0 writes the trained parameters (mirrored) and the reduced losses.
"""

import sys

import jaxdist

jaxdist.initialize()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdist import models  # noqa: E402

(x, y), _ = jaxdist.datasets.digits()
x, y = x[:600], y[:600]  # 600 = 4 * 128 + 88: the last batch of each epoch is padded
state = models.create_train_state(models.MLP(), x[:1])
strategy = (jaxdist.MultiWorkerMirroredStrategy() if jax.process_count() > 1
            else jaxdist.MirroredStrategy())


def replica_step(state, batch):                # runs once per replica on its slice
    (xb, yb), mask = batch

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, xb)
        return jaxdist.compute_average_loss(      # local sum / global count
            optax.softmax_cross_entropy_with_integer_labels(logits, yb), mask)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)   # local gradients
    grads = jaxdist.all_reduce(grads, "sum")                   # the one place they are combined
    return state.apply_gradients(grads=grads), loss


dataset = strategy.distribute((x, y), 128, shuffle=True)
losses = []
for _epoch in range(2):
    for batch in dataset:
        state, loss = strategy.run(replica_step, args=(state, batch))   # per-replica values
        loss = strategy.reduce("sum", loss)    # each replica's share of the global mean, summed
        losses.append(float(loss))

state = strategy.to_mirrored(state, check=True)            # one replicated copy of the agreed state
leaves = [np.asarray(v) for v in jax.tree.leaves(state.params)]
if jax.process_index() == 0:
    np.savez(sys.argv[1], *leaves, losses=np.asarray(losses), replicas=strategy.num_replicas_in_sync)
print(f"process {jax.process_index()}: {len(losses)} steps on {strategy.num_replicas_in_sync} replicas")
