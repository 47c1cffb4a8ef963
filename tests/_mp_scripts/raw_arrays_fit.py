"""`fit` with a plain step and raw arrays (no strategy named) in every process of a launched job."""
import jax

import jaxdist
from jaxdist import models

(x, y), _ = jaxdist.datasets.digits()
x, y = x[:256], y[:256]
state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
h = jaxdist.fit(models.classifier_train_step, state, (x, y), batch_size=64, epochs=1, verbose=0)
print("rank", jax.process_index(), "loss", repr(h.history["loss"][0]), flush=True)
