"""The README's two hand-written loops, run long (>= 400 steps) on the simulated devices.

Usage: readme_loops.py {global,per_replica} EPOCHS BATCH OUT.npz
Without a bound on the steps in flight, ~100 queued steps on 8 simulated devices abort the process
in XLA:CPU's collective rendezvous; this script must finish.
"""

import sys

import jax
import numpy as np
import optax

import jaxdist
from jaxdist import models

view, epochs, batch_size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
(x, y), _ = jaxdist.datasets.digits()
state = models.create_train_state(models.MLP(), x[:1])


@jaxdist.mirrored
def train_step(state, batch):
    (xb, yb), mask = batch

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, xb)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return jaxdist.compute_average_loss(per_example, mask)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


strategy = train_step.strategy
dataset = strategy.distribute((x, y), batch_size, shuffle=True)
steps = 0
for _epoch in range(epochs):
    for batch in dataset:
        if view == "global":
            state, metrics = train_step(state, batch)
        else:
            state, loss = strategy.run(models.classifier_replica_step, args=(state, batch))
        steps += 1
if view != "global":
    state = strategy.to_mirrored(state)
leaves = [np.asarray(v) for v in jax.tree.leaves(state.params)]
np.savez(out, *leaves, steps=steps, devices=strategy.num_replicas_in_sync)
print(f"{view}: {steps} steps on {strategy.num_replicas_in_sync} devices")
