"""The README's common path, as pasted (no jaxdist.initialize()): `readme_mirrored.py OUT_PREFIX`.

Under `jaxdist launch -n 2` it must train one job: each process writes OUT_PREFIX<rank>.npz with
its parameters and jax.process_index(); run alone it writes OUT_PREFIX0.npz.
"""

import os
import sys

import jax
import numpy as np
import optax

import jaxdist
from jaxdist import models

(x, y), _ = jaxdist.datasets.digits()
x, y = x[:512], y[:512]
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
history = jaxdist.fit(train_step, state, strategy.distribute((x, y), 128, shuffle=True), epochs=2,
                      verbose=0)
params = {jax.tree_util.keystr(p): np.asarray(jax.device_get(v))
          for p, v in jax.tree_util.tree_flatten_with_path(history.state.params)[0]}
np.savez(f"{sys.argv[1]}{os.environ.get('RANK', '0')}.npz", process_index=jax.process_index(),
         process_count=jax.process_count(), replicas=strategy.num_replicas_in_sync, **params)
