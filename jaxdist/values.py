"""Distributed values: a global ``Batch`` and the ``PerReplica`` values ``strategy.run`` returns.

These are the values that cross between the user and a strategy, kept apart from the strategies
themselves so that input, step and checkpoint code can name them without importing a strategy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxdist._types import PyTree


class Batch(NamedTuple):
    """One global batch: ``data`` (the pytree the dataset yields) and ``mask`` (bool ``[batch]``).

    Both are ``jax.Array``\\ s sharded over the replicas along their first axis. ``mask[i]`` is False
    for padding rows added to complete a final partial batch; pass it to
    ``jaxdist.compute_average_loss`` and use it in metrics.
    """

    data: PyTree
    mask: Any


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """A value that differs between replicas (tf: ``tf.distribute.DistributedValues``).

    ``strategy.run`` returns the function's own output structure with a ``PerReplica`` in place of
    each array. ``stacked`` is the array (or, when built by hand, a pytree of arrays) whose leading
    axis of length ``num_replicas_in_sync`` is sharded so that entry ``r`` lives on replica ``r``'s
    device. Pass it back to ``strategy.run`` and each replica gets its own entry without the value
    leaving the devices; read it with ``strategy.reduce`` / ``gather`` / ``local_results``, or turn
    values the replicas agree on into one replicated value with ``strategy.to_mirrored``.

    >>> import jax.numpy as jnp
    >>> PerReplica(jnp.zeros((2, 3)))
    PerReplica((2, 3))
    """

    __slots__ = ("stacked",)

    def __init__(self, stacked: PyTree):
        self.stacked = stacked

    def tree_flatten(self):
        return (self.stacked,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children[0])

    def __repr__(self) -> str:
        shapes = jax.tree.map(lambda x: getattr(x, "shape", x), self.stacked)
        return f"PerReplica({shapes})"


def is_per_replica(x: Any) -> bool:
    """``is_leaf`` for walking a nest down to its ``PerReplica`` values."""
    return isinstance(x, PerReplica)


def has_per_replica(tree: PyTree) -> bool:
    """True when some node of ``tree`` is a ``PerReplica``."""
    return any(isinstance(x, PerReplica) for x in jax.tree.leaves(tree, is_leaf=is_per_replica))
