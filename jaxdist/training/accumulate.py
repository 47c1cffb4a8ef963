"""Gradient accumulation inside one compiled step: k micro-batches, the memory of one.

``accumulate_gradients`` splits the step's batch into ``k`` micro-batches and runs the user's
``value_and_grad`` over them with ``lax.scan``, so only one micro-batch's activations are alive at a
time; the gradients are combined weighted by each micro-batch's number of *real* examples, which
makes the result the gradient of the mean over the whole batch (padding rows included or not).

Micro-batch ``i`` takes the ``i``-th block of ``rows / k`` rows of each replica's slice, so every
replica keeps working on its own rows (no data moves between devices, and the batch is not copied),
in both views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.core import PyTree, replica
from jaxdist.input.dataset import Batch


def _micro(x: jax.Array, replicas: int, k: int, i: jax.Array) -> jax.Array:
    """Micro-batch ``i`` of ``k``: rows ``[i*m, (i+1)*m)`` of each replica's slice of ``x``.

    ``[B, ...]`` is viewed as ``[replicas, k, m, ...]`` (a reshape that keeps every replica's rows
    where they are, so no copy of the batch) and sliced on the ``k`` axis.
    """
    m = x.shape[0] // (replicas * k)
    view = x.reshape(replicas, k, m, *x.shape[1:])
    part = jax.lax.dynamic_index_in_dim(view, i, axis=1, keepdims=False)
    return part.reshape(replicas * m, *x.shape[1:])


def accumulate_gradients(value_and_grad_fn: Callable, params: PyTree, batch: Any, /, *,
                         steps: int, has_aux: bool = False) -> tuple[Any, PyTree]:
    """The loss and gradients of ``batch`` computed as ``steps`` micro-batches under ``lax.scan``.

    Use it inside a train step (global view, or per-replica inside ``strategy.run``) in place of
    calling ``value_and_grad_fn(params, batch)`` once. The result equals that call on the whole
    batch (to float tolerance) while holding one micro-batch's activations at a time.

    Args:
      value_and_grad_fn: ``fn(params, micro_batch) -> (loss, grads)`` (``((loss, aux), grads)``
        with ``has_aux``), e.g. ``jax.value_and_grad(loss_fn)`` or
        ``jaxdist.precision.value_and_grad(loss_fn, state)``. ``loss`` must be the mean over the
        micro-batch's real examples (``jaxdist.compute_average_loss(per_example, micro.mask)``).
      params: the parameters to differentiate.
      batch: a ``jaxdist.Batch`` (its ``mask`` weights the micro-batches) or a raw pytree of arrays
        with a leading batch axis (equal weights).
      steps: micro-batches per step; each replica's rows must divide by it.
      has_aux: ``aux`` is averaged over micro-batches with the same weights (floating leaves).

    Returns:
      ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), as for the whole batch.

    Raises:
      ValueError: ``steps`` < 1 or a replica's rows do not divide by it.

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.arange(8.0)
    >>> vg = jax.value_and_grad(lambda w, xb: jnp.mean((w * xb) ** 2))
    >>> loss, g = accumulate_gradients(vg, 1.0, x, steps=4)
    >>> bool(jnp.allclose(g, vg(1.0, x)[1]))
    True
    """
    if steps < 1:
        raise ValueError(f"accumulate_gradients(steps={steps}): need steps >= 1")
    if steps == 1:
        return value_and_grad_fn(params, batch)
    ctx = replica.current()
    per_replica = ctx is not None and ctx.per_replica
    replicas = 1 if per_replica or ctx is None else ctx.num_replicas
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0]
    if rows % replicas or (rows // replicas) % steps:
        raise ValueError(
            f"accumulate_gradients(steps={steps}): each replica holds {rows // max(replicas, 1)} rows "
            f"of the batch, which do not divide into {steps} micro-batches; use a global batch "
            f"that is a multiple of {replicas * steps} (replicas x steps)")
    mask = batch.mask if isinstance(batch, Batch) else None
    take = lambda i: jax.tree.map(lambda x: _micro(x, replicas, steps, i), batch)  # noqa: E731

    def weight(m):
        if mask is None:
            return jnp.ones((), jnp.float32)
        w = jnp.sum(m.mask, dtype=jnp.float32)
        if per_replica and ctx.axes:
            w = jax.lax.psum(w, ctx.axes)
        return w

    def body(carry, i):
        mb = take(i)
        out, grads = value_and_grad_fn(params, mb)
        w = weight(mb)
        acc_out, acc_grads, acc_w = carry
        add = lambda a, b: a + (w * b).astype(a.dtype)  # noqa: E731
        return (jax.tree.map(add, acc_out, _floats(out)), jax.tree.map(add, acc_grads, grads),
                acc_w + w), None

    out_shape, grad_shape = jax.eval_shape(value_and_grad_fn, params, take(0))
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
    init = (zeros(_floats(out_shape)), zeros(grad_shape), jnp.zeros((), jnp.float32))
    (out, grads, total), _ = jax.lax.scan(body, init, jnp.arange(steps))
    total = jnp.maximum(total, 1.0)
    div = lambda t: jax.tree.map(lambda x: (x / total).astype(x.dtype), t)  # noqa: E731
    return div(out), div(grads)


def _floats(tree: PyTree) -> PyTree:
    """Leaves that can be averaged: floating arrays (or their shapes); others become float32 zeros."""
    def one(x):
        dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32) if isinstance(
            x, jax.ShapeDtypeStruct) else jnp.asarray(x, jnp.float32)
    return jax.tree.map(one, tree)
