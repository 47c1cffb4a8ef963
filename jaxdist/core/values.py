"""Distributed values: a global ``Batch`` and the ``PerReplica`` values ``strategy.run`` returns.

These are the values that cross between the user and a strategy, kept apart from the strategies
themselves so that input, step and checkpoint code can name them without importing a strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist.core._types import PyTree


class Batch(NamedTuple):
    """One global batch: ``data`` (the pytree the dataset yields) and ``mask`` (bool ``[batch]``).

    ``data`` is sharded over the replicas along its first axis. ``mask[i]`` is False for padding
    rows added to complete a final partial batch; pass it to ``jaxdist.compute_average_loss`` and
    use it in metrics. ``distribute`` replicates the mask on every device when each process knows
    the whole global batch (the count of real rows then costs no collective), and shards it like
    the data otherwise; a step reads it the same way either way.
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

    What ``strategy.run`` returns holds the replicas' values of rank >= 1 *concatenated* along
    their first axis (each device's shard is exactly its replica's value: shape
    ``(num_replicas * d0, ...)``), which is what its pytree leaf is; ``stacked`` reshapes that to
    ``(num_replicas, d0, ...)`` when read. Fed back into ``run``, such a value reaches each replica
    with no reshape in the compiled step: a reshape between a step's update and its donated output
    makes XLA:CPU recompute the update and copy the state (measured: ~8% of an MLP step).

    Reading one as a number on the host (``float(loss)``) is a ``TypeError`` that names
    ``strategy.reduce``.

    >>> import jax.numpy as jnp
    >>> PerReplica(jnp.zeros((2, 3)))
    PerReplica((2, 3))
    """

    __slots__ = ("_value", "_blocks", "_mask")

    def __init__(self, stacked: PyTree):
        self._value = stacked
        self._blocks = 0  # 0: ``_value`` is stacked; n: n replicas' values concatenated on axis 0
        # The global batch mask when this value has one row per example of a Batch that
        # strategy.run split (set by run): reduce / gather along axis 0 then count real rows only.
        self._mask: Any = None

    @classmethod
    def _from_blocks(cls, value: Any, num_replicas: int) -> PerReplica:
        """A ``PerReplica`` over ``value``: ``num_replicas`` values concatenated along axis 0."""
        obj = object.__new__(cls)
        obj._value, obj._blocks, obj._mask = value, num_replicas, None
        return obj

    @property
    def stacked(self) -> PyTree:
        """The replicas' values stacked on a leading axis of length ``num_replicas_in_sync``."""
        if not self._blocks:
            return self._value
        n = self._blocks
        return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + tuple(x.shape[1:])),
                            self._value)

    def tree_flatten(self):
        return (self._value,), self._blocks

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._value, obj._blocks, obj._mask = children[0], aux, None
        return obj

    # A per-replica value has no single number: reading it as one on the host (tf habits:
    # float(loss), f"{loss:.4f}", np.asarray(loss)) says how to combine the replicas first.
    def _not_one_value(self, what: str):
        raise TypeError(
            f"{what} of a jaxdist.PerReplica: it holds one value per replica, not one value. "
            "Combine them first: strategy.reduce('sum', value) (a loss from "
            "jaxdist.compute_average_loss: each replica's share of the global mean) or "
            "strategy.reduce('mean', value); strategy.experimental_local_results(value) gives "
            "each replica's own")

    def __float__(self):
        self._not_one_value("float()")

    def __int__(self):
        self._not_one_value("int()")

    def __array__(self, dtype=None, copy=None):
        self._not_one_value("a numpy array")

    def __format__(self, spec: str) -> str:
        if spec:
            self._not_one_value(f"formatting with {spec!r}")
        return repr(self)

    def __repr__(self) -> str:
        n = self._blocks

        def shape(x):
            s = getattr(x, "shape", None)
            if s is None:
                return x
            return (n, s[0] // n) + tuple(s[1:]) if n else tuple(s)

        return f"PerReplica({jax.tree.map(shape, self._value)})"


_BATCH_HINT = (
    "jaxdist: the step was given a jaxdist.Batch, which unpacks as ((x, y), mask): the data the "
    "dataset yields and a bool [batch] mask, False on the padding rows of a partial last batch. "
    "So `xb, yb = batch` binds xb to (x, y) and yb to the mask. Write `(xb, yb), mask = batch` "
    "(or `xb, yb = batch.data`) and pass mask to jaxdist.compute_average_loss(per_example, mask).")


@contextlib.contextmanager
def explaining_batch_errors(batch: Any):
    """Traces a step on ``batch``: an error that looks like the step unpacked a ``Batch`` as its
    data gets ``explain_batch_error``'s note."""
    try:
        yield
    except (TypeError, AttributeError, ValueError) as e:
        explain_batch_error(e, batch)
        raise


def explain_batch_error(error: BaseException, batch: Any) -> None:
    """Adds a note saying what a ``Batch`` is to an error raised while tracing a step on one, when
    it looks like the step unpacked the Batch as its data (``xb, yb = batch``): the data then
    reaches the model as a tuple / dict, or the bool mask as labels."""
    if not isinstance(batch, Batch) or not isinstance(batch.data, (tuple, list, dict)):
        return
    text = str(error)
    if any(word in text for word in ("tuple", "dict", "list", "bool")):
        error.add_note(_BATCH_HINT)


def is_per_replica(x: Any) -> bool:
    """``is_leaf`` for walking a nest down to its ``PerReplica`` values."""
    return isinstance(x, PerReplica)


def has_per_replica(tree: PyTree) -> bool:
    """True when some node of ``tree`` is a ``PerReplica``."""
    return any(isinstance(x, PerReplica) for x in jax.tree.leaves(tree, is_leaf=is_per_replica))


_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, jax.ShapeDtypeStruct)


def is_static_leaf(x: Any) -> bool:
    """Whether a state leaf is static: not an array nor a number (an Equinox module's activation
    function, a string, a Flax NNX module's non-array attribute, ...).

    Only array leaves are placed on devices, traced and checkpointed; static leaves travel with
    the state's structure unchanged, as ``eqx.partition(tree, eqx.is_array)`` would split them
    (Python numbers stay arrays here, as jaxdist has always placed them).

    >>> import jax.numpy as jnp
    >>> [is_static_leaf(x) for x in (jnp.ones(2), 1.0, jnp.tanh, "relu")]
    [False, False, True, True]
    """
    return not isinstance(x, _ARRAY_LEAVES) and not hasattr(x, "__jax_array__")


def split_static(tree: PyTree) -> tuple[list, Any, dict[int, Any]]:
    """``tree``'s array leaves, its treedef and its static leaves by leaf index: what a compiled
    step, a checkpoint or a snapshot takes (the arrays), and what puts the tree back together.

    >>> import jax.numpy as jnp
    >>> arrays, treedef, statics = split_static({"w": jnp.ones(2), "act": jnp.tanh})
    >>> len(arrays), statics == {0: jnp.tanh}
    (1, True)
    >>> join_static(treedef, statics, [jnp.zeros(2)])["act"] is jnp.tanh
    True
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays, statics = split_leaves(leaves)
    return arrays, treedef, statics


def split_leaves(leaves: list) -> tuple[list, dict[int, Any]]:
    """``split_static`` of an already flattened tree: (array leaves, static leaves by index)."""
    statics = {i: x for i, x in enumerate(leaves) if is_static_leaf(x)}
    return [x for i, x in enumerate(leaves) if i not in statics], statics


def join_static(treedef: Any, statics: Any, arrays: Any) -> PyTree:
    """The tree ``split_static`` took apart: leaf ``i`` is ``statics[i]`` where given, else the
    next of ``arrays`` (any iterable, in leaf order)."""
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [statics[i] if i in statics else next(it)
                                        for i in range(treedef.num_leaves)])


class StaticKey:
    """A static leaf as part of a compilation key: equal when the values are (the same object or
    ``==``), hashed by value when hashable, else by identity."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any):
        self.value = value
        try:
            self._hash = hash((type(value), value))
        except TypeError:
            self._hash = id(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, StaticKey):
            return NotImplemented
        a, b = self.value, other.value
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 (an __eq__ that returns arrays, or raises)
            return False
