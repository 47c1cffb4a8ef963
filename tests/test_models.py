"""Built-in models: the reshape max-pool against flax's reduce_window pooling."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import models


@pytest.mark.parametrize("shape,window", [((3, 8, 8, 5), (2, 2)), ((2, 7, 9, 3), (2, 2)),
                                          ((2, 9, 12, 4), (3, 4)), ((4, 10, 3), (2,)),
                                          ((2, 4, 6, 4, 2), (2, 3, 2))])
def test_max_pool_matches_flax_values_and_gradients(shape, window):
    x = jax.random.normal(jax.random.key(0), shape)
    ref = lambda v: nn.max_pool(v, window, strides=window)  # noqa: E731
    ours = lambda v: models.max_pool(v, window)  # noqa: E731
    np.testing.assert_array_equal(ours(x), ref(x))
    # Through a ReLU, as in a CNN: tied zeros get no gradient either way; random floats do not tie.
    w = jax.random.normal(jax.random.key(1), ref(x).shape)
    g_ref = jax.grad(lambda v: (ref(jax.nn.relu(v)) * w).sum())(x)
    g_ours = jax.grad(lambda v: (ours(jax.nn.relu(v)) * w).sum())(x)
    np.testing.assert_array_equal(g_ours, g_ref)


def test_max_pool_rejects_a_window_of_the_wrong_rank():
    with pytest.raises(ValueError, match=r"one positive size per spatial axis \(2\)"):
        models.max_pool(jnp.zeros((1, 4, 4, 1)), (2,))


class _FlaxPoolCNN(nn.Module):
    """models.CNN as it was, with nn.max_pool: the same parameters must train the same way."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def test_cnn_trains_like_the_reduce_window_version():
    x = jax.random.normal(jax.random.key(0), (32, 13, 13, 1))  # odd sizes: a row and column dropped
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)
    states = [models.create_train_state(m, x[:1]) for m in (models.CNN(), _FlaxPoolCNN())]
    assert jax.tree.structure(states[0].params) == jax.tree.structure(states[1].params)

    @jax.jit
    def step(state):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, g = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=g), loss

    losses = [[], []]
    for _ in range(5):
        for i in range(2):
            states[i], loss = step(states[i])
            losses[i].append(float(loss))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
