"""Example models (Flax linen) used by the CLI, the examples and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxdist.core.loss import compute_average_loss
from jaxdist.input.dataset import Batch


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


def max_pool(x: jax.Array, window: Sequence[int] = (2, 2)) -> jax.Array:
    """Non-overlapping max pooling of ``[batch, H, W, ..., C]`` (strides = window, VALID padding).

    The same values as ``flax.linen.max_pool(x, window, strides=window)``, computed as a reshape and
    a max instead of ``lax.reduce_window``. What differs is the gradient's program: reduce_window's
    is a select-and-scatter, which XLA:CPU runs several times slower than the whole rest of a small
    CNN's step, while a max's gradient is a compare and a select that fuse with their neighbours
    (``benchmarks/cnn_pool.py`` measures both). Use it in your own models for pooling whose windows
    do not overlap. Gradients agree except where several entries of a window tie for the maximum
    (the max splits the gradient between them, reduce_window gives it to the first); after a ReLU
    such ties are zeros, whose gradient the ReLU zeroes anyway. Trailing rows or columns that do
    not fill a window are dropped, as with VALID padding.

    >>> import jax.numpy as jnp
    >>> max_pool(jnp.arange(16.0).reshape(1, 4, 4, 1))[0, ..., 0].tolist()
    [[5.0, 7.0], [13.0, 15.0]]
    """
    window = tuple(int(w) for w in window)
    spatial = x.ndim - 2
    if len(window) != spatial or min(window, default=1) < 1:
        raise ValueError(f"max_pool got window {window} for an input of shape {x.shape}; it needs one "
                         f"positive size per spatial axis ({spatial}), e.g. (2, 2) for [B, H, W, C]")
    sizes = [d // w for d, w in zip(x.shape[1:-1], window)]
    x = x[(slice(None), *(slice(0, n * w) for n, w in zip(sizes, window)))]
    split = [x.shape[0]]
    for n, w in zip(sizes, window):
        split += [n, w]
    x = x.reshape(*split, x.shape[-1])
    return x.max(axis=tuple(range(2, 2 * spatial + 1, 2)))


class CNN(nn.Module):
    """Conv(32, 3×3) – max-pool 2×2 – Dense(64) – Dense(classes), on ``[batch, H, W, C]`` images.

    The pooling is :func:`max_pool` (same values as ``nn.max_pool``; its gradient runs ~2x faster
    on one CPU device and ~4-5x on eight, see ``benchmarks/cnn_pool.py``). Parameter names are
    those of the ``nn.max_pool`` version, so older checkpoints restore.
    """

    features: int = 32
    dense: int = 64
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        if x.ndim == 3:
            x = x[..., None]
        x = nn.relu(nn.Conv(self.features, (3, 3))(x))
        x = max_pool(x, (2, 2))
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
                       seed: int = 0, precision: str = "float32", tx=None):
    """Initialises ``model`` on ``sample_input`` with Adam; the same seed gives the same state.

    Args:
      precision: a policy name (``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``); mixed
        policies give a ``jaxdist.precision.TrainState`` (float16 with a dynamic loss scale).
      tx: an optax optimizer to use instead of ``optax.adam(learning_rate)``.

    >>> import numpy as np
    >>> s = create_train_state(MLP(hidden=(4,)), np.ones((1, 3)), precision="mixed_float16")
    >>> s.policy.compute_dtype, float(s.loss_scale.scale)
    ('float16', 32768.0)
    """
    params = model.init(jax.random.key(seed), jnp.asarray(sample_input))["params"]
    tx = optax.adam(learning_rate) if tx is None else tx
    if precision == "float32":
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    from jaxdist.training.precision import TrainState

    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, policy=precision)


def _unpack(batch):
    if isinstance(batch, Batch):
        return batch.data, batch.mask
    return batch, None


def _logits_and_loss(params, state, x, y, mask):
    policy = getattr(state, "policy", None)
    if policy is not None:
        x = policy.cast_to_compute(x)
    logits = state.apply_fn({"params": params}, x).astype(jnp.float32)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return compute_average_loss(per_example, mask), logits


def _grads(state, batch, accumulate: int):
    """``((loss, logits-or-accuracy), grads)`` for a batch, in micro-batches when ``accumulate > 1``."""
    from jaxdist.training.accumulate import accumulate_gradients
    from jaxdist.training.precision import value_and_grad

    def loss_fn(params, b):
        (x, y), mask = _unpack(b)
        loss, logits = _logits_and_loss(params, state, x, y, mask)
        return loss, _accuracy(logits, y, mask)

    vg = value_and_grad(loss_fn, state, has_aux=True)
    return accumulate_gradients(vg, state.params, batch, steps=accumulate, has_aux=True)


def _accuracy(logits, y, mask):
    return compute_average_loss((jnp.argmax(logits, -1) == y).astype(jnp.float32), mask)


def classifier_train_step(state: train_state.TrainState, batch, *, accumulate: int = 1):
    """A single-device classification step: ``(state, Batch((x, y), mask)) -> (state, metrics)``.

    Written for one device over the global batch; under ``@jaxdist.mirrored`` the same code is
    distributed with no change. A ``jaxdist.precision.TrainState`` runs it in mixed precision;
    ``accumulate=k`` (bind it with ``functools.partial``) takes the gradient in ``k`` micro-batches.
    """
    (loss, accuracy), grads = _grads(state, batch, accumulate)
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def classifier_replica_step(state: train_state.TrainState, batch, *, accumulate: int = 1):
    """The per-replica (``strategy.run``) form of :func:`classifier_train_step`.

    Gradients are local to the replica; ``jaxdist.all_reduce(grads, "sum")`` combines them, and
    because ``compute_average_loss`` divides by the global example count the sum is the gradient of
    the global mean.
    """
    from jaxdist.core.replica import all_reduce

    (loss, accuracy), grads = _grads(state, batch, accumulate)
    grads = all_reduce(grads, "sum")
    metrics = all_reduce({"loss": loss, "accuracy": accuracy}, "sum")
    return state.apply_gradients(grads=grads), metrics


def classifier_eval_step(state: train_state.TrainState, batch):
    """Loss and accuracy over the real examples of a batch."""
    (x, y), mask = _unpack(batch)
    loss, logits = _logits_and_loss(state.params, state, x, y, mask)
    return {"loss": loss, "accuracy": _accuracy(logits, y, mask)}


def classifier_predict_step(state: train_state.TrainState, batch):
    """Float32 logits for a batch of inputs ``x`` (or of ``(x, y)`` pairs, labels ignored)."""
    data, _ = _unpack(batch)
    x = data[0] if isinstance(data, (tuple, list)) else data
    policy = getattr(state, "policy", None)
    if policy is not None:
        x = policy.cast_to_compute(x)
    return state.apply_fn({"params": state.params}, x).astype(jnp.float32)
