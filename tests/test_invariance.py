"""Device-count invariance: same seed and global batch => same parameters on 1, 2, 4, 8 devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models

STEPS = 4
GLOBAL_BATCH = 64


def _train(model, n, view, data):
    x, y = data
    strategy = jaxdist.MirroredStrategy(jax.devices()[:n])
    state = models.create_train_state(model, x[:1], seed=0)
    # 250 examples: the 4th batch is partial (58 real rows), so padding is exercised too.
    batches = strategy.distribute((x[:250], y[:250]), GLOBAL_BATCH, shuffle=True, seed=3)
    step = strategy.step(models.classifier_train_step)
    metrics = []
    for batch in batches:
        if view == "global":
            state, m = step(state, batch)
        else:
            state, m = strategy.local_results(
                strategy.run(models.classifier_replica_step, args=(state, batch)))[0]
        metrics.append(jax.device_get(m))
    assert len(metrics) == STEPS
    return jax.device_get(state.params), metrics


@pytest.mark.parametrize("view", ["global", "per_replica"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_same_parameters_on_1_2_4_8_devices(digits, model_name, view):
    (x, y), _ = digits
    model = models.get(model_name)
    ref_params, ref_metrics = _train(model, 1, view, (x, y))
    for n in (2, 4, 8):
        params, metrics = _train(model, n, view, (x, y))
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"{n} devices")
        for a, b in zip(ref_metrics, metrics):
            for k in a:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=f"{k} on {n} devices")


def test_global_and_per_replica_views_agree(digits):
    (x, y), _ = digits
    g, _ = _train(models.MLP(), 4, "global", (x, y))
    r, _ = _train(models.MLP(), 4, "per_replica", (x, y))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_training_actually_changes_parameters(digits):
    (x, y), _ = digits
    init = jax.device_get(models.create_train_state(models.MLP(), x[:1], seed=0).params)
    trained, _ = _train(models.MLP(), 2, "global", (x, y))
    diffs = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(trained))]
    assert min(diffs) > 1e-4


def test_gradients_in_run_are_local_until_all_reduced():
    """Pins down the check_vma trap: inside run, jax.grad must not already sum over replicas."""
    import jax.numpy as jnp

    strategy = jaxdist.MirroredStrategy(jax.devices()[:4])
    w = jnp.ones(3)
    x = jnp.arange(12.0).reshape(4, 3)
    batch = jaxdist.Batch(x, jnp.ones(4, bool))

    def grads(w, batch):
        g = jax.grad(lambda w: jnp.sum(w * batch.data))(w)
        return g, jaxdist.all_reduce(g, "sum")

    local, summed = (v.stacked for v in strategy.run(grads, args=(w, batch)))
    np.testing.assert_array_equal(np.asarray(local), np.asarray(x))  # replica r sees row r only
    np.testing.assert_array_equal(np.asarray(summed), np.tile(x.sum(0), (4, 1)))
