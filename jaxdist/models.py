"""Example models (Flax linen) used by the CLI, the examples and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxdist.input import Batch
from jaxdist.loss import compute_average_loss


class MLP(nn.Module):
    """A multilayer perceptron over flattened inputs (the benchmark's 784-256-128-10 by default).

    >>> import jax, jax.numpy as jnp
    >>> m = MLP(hidden=(16,), num_classes=3)
    >>> m.apply(m.init(jax.random.key(0), jnp.ones((2, 4))), jnp.ones((2, 4))).shape
    (2, 3)
    """

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Conv(32, 3×3) – max-pool 2×2 – Dense(64) – Dense(classes), on ``[batch, H, W, C]`` images."""

    features: int = 32
    dense: int = 64
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        if x.ndim == 3:
            x = x[..., None]
        x = nn.relu(nn.Conv(self.features, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense)(x))
        return nn.Dense(self.num_classes)(x)


def get(name: str, num_classes: int = 10) -> nn.Module:
    """A model by CLI name: ``"mlp"`` or ``"cnn"``."""
    if name == "mlp":
        return MLP(num_classes=num_classes)
    if name == "cnn":
        return CNN(num_classes=num_classes)
    raise ValueError(f"unknown model {name!r}; expected 'mlp' or 'cnn'")


def create_train_state(model: nn.Module, sample_input, *, learning_rate: float = 1e-3,
                       seed: int = 0) -> train_state.TrainState:
    """Initialises ``model`` on ``sample_input`` with Adam; the same seed gives the same state."""
    params = model.init(jax.random.key(seed), jnp.asarray(sample_input))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(learning_rate))


def _unpack(batch):
    if isinstance(batch, Batch):
        return batch.data, batch.mask
    return batch, None


def _logits_and_loss(params, state, x, y, mask):
    logits = state.apply_fn({"params": params}, x)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return compute_average_loss(per_example, mask), logits


def _accuracy(logits, y, mask):
    return compute_average_loss((jnp.argmax(logits, -1) == y).astype(jnp.float32), mask)


def classifier_train_step(state: train_state.TrainState, batch):
    """A single-device classification step: ``(state, Batch((x, y), mask)) -> (state, metrics)``.

    Written for one device over the global batch; under ``@jaxdist.mirrored`` the same code is
    distributed with no change.
    """
    (x, y), mask = _unpack(batch)
    (loss, logits), grads = jax.value_and_grad(_logits_and_loss, has_aux=True)(
        state.params, state, x, y, mask)
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": _accuracy(logits, y, mask)}


def classifier_replica_step(state: train_state.TrainState, batch):
    """The per-replica (``strategy.run``) form of :func:`classifier_train_step`.

    Gradients are local to the replica; ``jaxdist.all_reduce(grads, "sum")`` combines them, and
    because ``compute_average_loss`` divides by the global example count the sum is the gradient of
    the global mean.
    """
    from jaxdist.replica import all_reduce

    (x, y), mask = _unpack(batch)
    (loss, logits), grads = jax.value_and_grad(_logits_and_loss, has_aux=True)(
        state.params, state, x, y, mask)
    grads = all_reduce(grads, "sum")
    metrics = all_reduce({"loss": loss, "accuracy": _accuracy(logits, y, mask)}, "sum")
    return state.apply_gradients(grads=grads), metrics


def classifier_eval_step(state: train_state.TrainState, batch):
    """Loss and accuracy over the real examples of a batch."""
    (x, y), mask = _unpack(batch)
    loss, logits = _logits_and_loss(state.params, state, x, y, mask)
    return {"loss": loss, "accuracy": _accuracy(logits, y, mask)}
