"""Loss helpers that mean the same thing on any number of replicas."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist import replica


def compute_average_loss(per_example_loss: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The mean of ``per_example_loss`` over the real examples of the *global* batch.

    In a global-view step this is ``sum(loss * mask) / sum(mask)``. Inside ``strategy.run`` each
    replica holds a slice: the local sum is divided by the number of real examples across *all*
    replicas, so summing the replicas' gradients (``jaxdist.all_reduce(grads, "sum")``) gives the
    gradient of the global mean, as ``tf.nn.compute_average_loss`` does.

    Padded rows are excluded with ``where`` rather than multiplied by zero, so a NaN in a padded
    row cannot leak into the value (its gradient still would: ``distribute`` pads with copies of
    real rows so that padded rows are as finite as real ones). Trailing axes (per-token losses,
    say) are averaged per example.

    Args:
      per_example_loss: ``[batch, ...]`` losses.
      mask: optional bool ``[batch]``; False marks padding (``jaxdist.Batch.mask``).

    Returns:
      A scalar.

    >>> import jax.numpy as jnp
    >>> float(compute_average_loss(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
    2.0
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError("compute_average_loss expects per-example losses of shape [batch, ...], "
                         "got a scalar; do not average before calling it")
    if loss.ndim > 1:
        loss = loss.reshape(loss.shape[0], -1).mean(axis=1)
    if mask is None:
        mask = jnp.ones(loss.shape[0], dtype=bool)
    mask = jnp.asarray(mask)
    if mask.shape != loss.shape:
        raise ValueError(f"mask has shape {mask.shape} but the per-example loss has batch shape "
                         f"{loss.shape}; pass batch.mask of the same batch")
    total = jnp.sum(jnp.where(mask, loss, 0.0))
    count = jnp.sum(mask, dtype=jnp.float32)
    ctx = replica.current()
    if ctx is not None and ctx.per_replica and ctx.axes:
        count = jax.lax.psum(count, ctx.axes)
    return total / jnp.maximum(count, 1)
