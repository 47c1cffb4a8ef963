"""The replica context: what ``jaxdist.all_reduce`` and friends see while a step is traced.

A strategy enters a context while it traces user code. In the per-replica view
(``strategy.run``) the context names the mesh axes the replicas span and the cross-device
implementation to reduce with; in the global view (``strategy.step``) it only records that reductions
are XLA's business, so that a stray ``all_reduce`` fails loudly instead of double-counting.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxdist.core._types import PyTree


class ReduceOp(str, enum.Enum):
    """How values from several replicas are combined (as ``tf.distribute.ReduceOp``).

    As tf's, it is built from its name, in any case: ``ReduceOp("SUM") is ReduceOp.SUM``.

    >>> ReduceOp("SUM"), ReduceOp("mean")
    (<ReduceOp.SUM: 'sum'>, <ReduceOp.MEAN: 'mean'>)
    """

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value.lower() in {m.value for m in cls}:
            return cls(value.lower())
        return None

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        """Accepts a ``ReduceOp`` or its name in any case.

        >>> ReduceOp.parse("MEAN")
        <ReduceOp.MEAN: 'mean'>
        """
        try:
            return cls(op)  # a member, or its name in any case (``_missing_``)
        except ValueError:
            pass
        raise ValueError(f"unknown reduce op {op!r}; expected one of 'sum', 'mean' "
                         "(or jaxdist.ReduceOp.SUM / MEAN)")


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """Where user code is being traced.

    Attributes:
      axes: mesh axes the replicas span; ``()`` when there is a single replica and no mesh axis.
      num_replicas: replicas in sync.
      per_replica: True inside ``strategy.run``; False in a global-view step.
      implementation, pack_bytes, compress: the strategy's cross-device options.
    """

    axes: tuple[str, ...]
    num_replicas: int
    per_replica: bool
    implementation: str = "xla"
    pack_bytes: int | None = None
    compress: str | None = None


_CONTEXT: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "jaxdist_replica_context", default=None)


@contextlib.contextmanager
def enter(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current() -> ReplicaContext | None:
    """The context user code is traced in, or None outside any strategy."""
    return _CONTEXT.get()


def _per_replica_context(fn_name: str) -> ReplicaContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            f"jaxdist.{fn_name}() was called outside a replica context. Call it inside the "
            f"function you pass to strategy.run(fn, args=...), which runs once per replica.")
    if not ctx.per_replica:
        raise RuntimeError(
            f"jaxdist.{fn_name}() was called inside a global-view step (strategy.step / "
            "@jaxdist.mirrored). There the step sees the whole global batch and XLA inserts the "
            "cross-device reduction itself, so remove the call; use strategy.run(fn, ...) if you "
            "want per-replica code with explicit all-reduces.")
    return ctx


_EXTREMA = {"max": jax.lax.pmax, "min": jax.lax.pmin}


def all_reduce(tree: PyTree, op: ReduceOp | str = "mean") -> PyTree:
    """Reduces every leaf of ``tree`` across the replicas of the active strategy.

    Uses the strategy's ``cross_device_ops`` implementation for ``"sum"`` and ``"mean"``. Only
    valid inside per-replica code (the function given to ``strategy.run``); gradients computed
    there are local to the replica, so this is the one place they are combined.

    Args:
      tree: pytree of arrays, the same structure and shapes on every replica.
      op: ``"sum"`` or ``"mean"`` (``jaxdist.ReduceOp``), or ``"max"`` / ``"min"`` (element-wise
        over the replicas, always with XLA's own collective).

    Returns:
      The reduced pytree, identical on every replica.

    Raises:
      RuntimeError: outside ``strategy.run``.
      ValueError: an unknown ``op``.
    """
    ctx = _per_replica_context("all_reduce")
    if isinstance(op, str) and op.lower() in _EXTREMA:
        extremum = _EXTREMA[op.lower()]
        return tree if not ctx.axes else jax.tree.map(lambda x: extremum(x, ctx.axes), tree)
    try:
        op = ReduceOp.parse(op)
    except ValueError:
        raise ValueError(f"unknown all_reduce op {op!r}; expected 'sum', 'mean', 'max' or 'min'") \
            from None
    if not ctx.axes:
        return tree
    from jaxdist.core import collectives  # late: collectives is heavier and only needed when tracing

    if ctx.num_replicas == 1:
        # Nothing to reduce; XLA:CPU would still copy every leaf through a one-device all-reduce
        # (~2% of a one-device MLP step). The leaves are checked as for many replicas, so code that
        # is wrong on 8 devices fails on 1 as well.
        jax.tree_util.tree_map_with_path(
            lambda path, leaf: collectives._check_leaf(path, jnp.asarray(leaf), op.value), tree)
        return tree

    return collectives.reduce_tree(
        tree, op.value, axes=ctx.axes, implementation=ctx.implementation,
        pack_bytes=ctx.pack_bytes, compress=ctx.compress)


def all_gather(tree: PyTree, axis: int = 0) -> PyTree:
    """Concatenates every replica's value along ``axis``, on every replica (per-replica code only).

    As tf's ``ReplicaContext.all_gather``: each leaf of shape ``(..., d, ...)`` becomes
    ``(..., num_replicas() * d, ...)``, replica 0's rows first.

    Args:
      tree: pytree of arrays of rank >= 1, the same shapes on every replica.
      axis: the axis to concatenate along.

    Returns:
      The gathered pytree, identical on every replica.

    Raises:
      RuntimeError: outside ``strategy.run``.
      ValueError: a scalar leaf, or ``axis`` out of range.
    """
    ctx = _per_replica_context("all_gather")

    def one(x):
        x = jnp.asarray(x)
        if not -x.ndim <= axis < x.ndim or x.ndim == 0:
            raise ValueError(f"jaxdist.all_gather(axis={axis}) is out of range for a leaf of shape "
                             f"{x.shape}" + ("; gather x[None] to stack scalars" if x.ndim == 0 else ""))
        if not ctx.axes:
            return x
        return jax.lax.all_gather(x, ctx.axes, axis=axis % x.ndim, tiled=True)

    return jax.tree.map(one, tree)


def replica_id() -> jax.Array:
    """This replica's index in ``[0, num_replicas())`` as an int32 scalar (per-replica code only).

    Raises:
      RuntimeError: outside ``strategy.run``.
    """
    ctx = _per_replica_context("replica_id")
    if not ctx.axes:
        return jnp.int32(0)
    return jax.lax.axis_index(ctx.axes).astype(jnp.int32)


def num_replicas() -> int:
    """Replicas in sync for the code being traced; 1 outside any strategy (as tf's default context).

    >>> num_replicas()
    1
    """
    ctx = _CONTEXT.get()
    return 1 if ctx is None else ctx.num_replicas
