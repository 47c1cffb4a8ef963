"""Loss helpers that mean the same thing on any number of replicas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.core import replica


def compute_average_loss(per_example_loss: jax.Array, mask: jax.Array | None = None, *,
                         sample_weight: jax.Array | float | None = None,
                         global_batch_size: int | None = None) -> jax.Array:
    """The mean of ``per_example_loss`` over the real examples of the *global* batch.

    In a global-view step this is ``sum(loss * mask) / sum(mask)``. Inside ``strategy.run`` each
    replica holds a slice: the local sum is divided by the number of real examples across *all*
    replicas, so summing the replicas' gradients (``jaxdist.all_reduce(grads, "sum")``) gives the
    gradient of the global mean, as ``tf.nn.compute_average_loss`` does.

    Padded rows are excluded with ``where`` rather than multiplied by zero, so a NaN in a padded
    row cannot leak into the value (its gradient still would: ``distribute`` pads with copies of
    real rows so that padded rows are as finite as real ones). Trailing axes (per-token losses,
    say) are averaged per example.

    ``sample_weight`` has the meaning of tf's ``tf.nn.compute_average_loss(per_example_loss,
    sample_weight)``: each example's loss is scaled by its weight and the sum is divided by the
    number of examples, not by the sum of the weights (losses ``[1, 2, 3, 4]``, weights
    ``[1, 0, 1, 0.5]``: ``6 / 4 = 1.5``, tf's value). Padding rows still count for nothing.

    ``global_batch_size`` has the meaning of tf's too: the (weighted, masked) sum is divided by
    it instead of by the number of real examples, in either view. On a full batch that is the
    same number; on a padded last batch of 5 real rows in batches of 8 the result is 5/8 of
    their mean, as tf's is on its short last batch. Leave it out for the exact mean.

    Args:
      per_example_loss: ``[batch, ...]`` losses.
      mask: optional bool ``[batch]``; False marks padding (``jaxdist.Batch.mask``).
      sample_weight: optional weights, a scalar or ``[batch]`` (tf's ``sample_weight``).
      global_batch_size: optional divisor, a positive int (tf's ``global_batch_size``).

    Returns:
      A scalar.

    Raises:
      TypeError: a ``mask`` that is not boolean (a float mask is ambiguous: pass weights as
        ``sample_weight``).
      ValueError: a scalar loss, a mask / weights of another batch shape, or a
        ``global_batch_size`` that is not a positive int.

    >>> import jax.numpy as jnp
    >>> float(compute_average_loss(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
    2.0
    >>> float(compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0]),
    ...                            sample_weight=jnp.array([1.0, 0.0, 1.0, 0.5])))
    1.5
    >>> float(compute_average_loss(jnp.array([1.0, 3.0]), global_batch_size=4))  # tf: 4 / 4
    1.0
    """
    _check_global_batch_size(global_batch_size)
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError("compute_average_loss expects per-example losses of shape [batch, ...], "
                         "got a scalar; do not average before calling it")
    if loss.ndim > 1:
        loss = loss.reshape(loss.shape[0], -1).mean(axis=1)
    if mask is None:
        mask = jnp.ones(loss.shape[0], dtype=bool)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"compute_average_loss(mask=...) takes a boolean mask (padding rows False, as "
            f"batch.mask), got dtype {mask.dtype}. For per-example weights use "
            "sample_weight=..., which has tf.nn.compute_average_loss's meaning: "
            "sum(loss * weight) / number of examples")
    if mask.shape != loss.shape:
        raise ValueError(f"mask has shape {mask.shape} but the per-example loss has batch shape "
                         f"{loss.shape}; pass batch.mask of the same batch")
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight)
        if weight.ndim > 1 and weight.shape[1:] == (1,) * (weight.ndim - 1):
            weight = weight.reshape(weight.shape[0])  # tf's [batch, 1] weights
        if weight.ndim and weight.shape != loss.shape:
            raise ValueError(f"sample_weight has shape {weight.shape} but the per-example loss "
                             f"has batch shape {loss.shape}; pass a scalar or one weight per "
                             "example")
        loss = loss * weight
    total = jnp.sum(jnp.where(mask, loss, 0.0))
    if global_batch_size is not None:  # tf's divisor: the same in both views, no collective
        return total / jnp.asarray(global_batch_size, total.dtype)
    count = jnp.sum(mask, dtype=jnp.float32)
    ctx = replica.current()
    if ctx is not None and ctx.per_replica and ctx.axes:
        count = jax.lax.psum(count, ctx.axes)
    return total / jnp.maximum(count, 1)


def _check_global_batch_size(global_batch_size) -> None:
    """tf requires a positive integer scalar; a traced one is taken as it is."""
    if global_batch_size is None:
        return
    try:
        value = np.asarray(global_batch_size)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if value.ndim or value.dtype.kind not in "iu" or isinstance(global_batch_size, bool) \
            or int(value) <= 0:
        raise ValueError(f"compute_average_loss(global_batch_size=...) takes a positive int, the "
                         f"global batch size that tf divides the summed loss by (e.g. 128), got "
                         f"{global_batch_size!r}; or leave it out and pass mask=batch.mask for the "
                         "mean over the real examples")
