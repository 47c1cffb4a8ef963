"""Reading what ``strategy.run`` returned: ``reduce``, ``gather``, ``local_results``, ``to_mirrored``.

A ``PerReplica`` holds the replicas' values stacked (or concatenated) on a leading axis sharded over
them; these read it on the host the way tf.distribute's ``Strategy`` methods do, each in one small
compiled call where a computation is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxdist.core._types import PyTree
from jaxdist.core.layout import Layout, place_all, placed_on
from jaxdist.core.replica import ReduceOp
from jaxdist.core.values import PerReplica, is_per_replica


def _placed(layout: Layout, value: PerReplica) -> PerReplica:
    """``value`` with its arrays on the batch sharding (kept when already there), its form kept."""
    n, raw = layout.num_replicas, value._value
    if isinstance(raw, jax.Array) and placed_on(raw, layout.batch):
        if value._blocks == n or (not value._blocks and raw.ndim and raw.shape[0] == n):
            return value  # the steady state: an output of run fed back in
    if value._blocks and value._blocks != n:
        raise ValueError(
            f"a PerReplica value was made by a strategy with {value._blocks} replicas, but this "
            f"strategy has {n}; read it with that strategy (reduce / gather / to_mirrored) first")
    for leaf in jax.tree.leaves(raw):
        if not value._blocks and (np.ndim(leaf) == 0 or np.shape(leaf)[0] != n):
            raise ValueError(
                f"a PerReplica value holds a leaf of shape {np.shape(leaf)}, but this strategy has "
                f"{n} replicas, so its leading axis must be {n}; was it made by another strategy?")
    placed = place_all(raw, layout.batch)
    return PerReplica._from_blocks(placed, n) if value._blocks else PerReplica(placed)


def _split_nest(value: PyTree):
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
    return leaves, treedef, [i for i, x in enumerate(leaves) if isinstance(x, PerReplica)]


def _plain_reduce(layout: Layout, op: ReduceOp, x: Any, axis: int | None):
    """``reduce`` of a value that is the same on every replica.

    As tf: every replica holds ``x``, so ``"sum"`` along ``axis`` is the sum over the replicas of
    each one's sum (``[1, 2, 3]`` on 2 replicas: 12), and ``"mean"`` is the mean of ``x``.
    """
    if axis is not None:
        if op is ReduceOp.SUM:
            return jnp.sum(x, axis=axis) * layout.num_replicas
        return jnp.mean(x, axis=axis)
    if op is ReduceOp.SUM and layout.num_replicas > 1:
        raise ValueError(
            "strategy.reduce('sum', value) got a value that is not per-replica, so summing it "
            f"over {layout.num_replicas} replicas is ambiguous; pass the PerReplica values "
            "returned by strategy.run, or use 'mean'")
    return x


def reduce(layout: Layout, op: ReduceOp | str, value: PyTree, axis: int | None) -> PyTree:
    if (type(value) is PerReplica and isinstance(value._value, jax.Array)
            and (axis is None or value._mask is None)):
        # One per-replica array (the README loop's loss every step): one compiled call on it.
        return _reducer(op if op == "sum" or op == "mean" else ReduceOp.parse(op).value, axis,
                        layout, value._blocks)(value._value)
    op = ReduceOp.parse(op)
    leaves, treedef, per = _split_nest(value)
    if not per:
        return jax.tree.map(lambda x: _plain_reduce(layout, op, x, axis), value)
    reduced = _reduce_stacked(op.value, axis, layout.replicated, [leaves[i] for i in per])
    if axis is not None:  # rows of a padded batch: count the real ones only, as tf does
        for k, i in enumerate(per):
            x = leaves[i]
            if x._mask is not None and axis % x._value.ndim == 0:
                mask = _row_mask(layout, x, "reduce")
                reduced[k] = _masked_reduce(op.value, layout.replicated, x._value, mask)
    out = [_plain_reduce(layout, op, x, axis) if not isinstance(x, PerReplica) else None
           for x in leaves]
    for i, r in zip(per, reduced):
        out[i] = r
    return jax.tree.unflatten(treedef, out)


def _reduce_one(op: str, axis: int | None, out_sharding: NamedSharding, x: jax.Array):
    """``reduce`` of one stacked per-replica array (traced)."""
    if axis is not None and not -(x.ndim - 1) <= axis < x.ndim - 1:
        raise ValueError(f"strategy.reduce(axis={axis}) is out of range for per-replica values "
                         f"of shape {x.shape[1:]}; use axis=None to reduce across replicas only")
    axes = (0,) if axis is None else (0, 1 + axis % (x.ndim - 1))
    total = jnp.sum(x, axis=axes)
    if op == "mean":
        total = total / np.prod([x.shape[a] for a in axes])
    return jax.lax.with_sharding_constraint(total, out_sharding)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reduce_stacked(op: str, axis: int | None, out_sharding: NamedSharding, values):
    return jax.tree.map(functools.partial(_reduce_one, op, axis, out_sharding),
                        [v.stacked for v in values])


@functools.lru_cache(maxsize=64)
def _reducer(op: str, axis: int | None, layout: Layout, blocks: int) -> Callable:
    """``reduce`` of one per-replica array (stacked, or ``blocks`` replicas' values
    concatenated), compiled with everything but the array fixed: a call passes the array alone,
    no static arguments to hash nor ``PerReplica`` to flatten."""
    def one(x):
        if blocks:
            x = x.reshape((blocks, x.shape[0] // blocks) + tuple(x.shape[1:]))
        return _reduce_one(op, axis, layout.replicated, x)

    return jax.jit(one)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _masked_reduce(op: str, out_sharding: NamedSharding, rows: jax.Array, mask: jax.Array):
    keep = mask.reshape(mask.shape + (1,) * (rows.ndim - 1))
    total = jnp.sum(jnp.where(keep, rows, jnp.zeros((), rows.dtype)), axis=0)
    if op == "mean":
        total = total / jnp.sum(mask, dtype=total.dtype)
    return jax.lax.with_sharding_constraint(total, out_sharding)


def _host_mask(layout: Layout, mask: jax.Array) -> np.ndarray:
    if mask.is_fully_addressable:
        return np.asarray(mask)
    # sharded over several processes: replicate it first (every process reads it all)
    return np.asarray(place_all(mask, layout.replicated).addressable_data(0))


def _row_mask(layout: Layout, value: PerReplica, what: str) -> jax.Array:
    """The mask of the batch whose rows ``value`` holds (``_mark_rows``).

    Given several batches of its size, the step's output could be any one's rows: fine when
    their masks agree (no padding in any, or the same batch twice), refused when they do not.
    """
    if not isinstance(value._mask, tuple):
        return value._mask
    first, *others = [_host_mask(layout, m) for m in value._mask]
    if all(np.array_equal(first, m) for m in others):
        return value._mask[0]
    raise ValueError(
        f"strategy.{what}(..., axis=0) got a per-example value of {value._value.shape[0]} rows "
        f"from a strategy.run given {len(value._mask)} batches of that size whose padding "
        "differs (a partial last batch), so which of its rows are real is not known. Fix: "
        "reduce it inside the step with its batch's mask (jaxdist.compute_average_loss(values, "
        "batch.mask)), or give each batch a strategy.run of its own.")


def _real_rows(layout: Layout, gathered: jax.Array, mask: jax.Array) -> jax.Array:
    """The rows of a gathered per-example value whose mask is True (a host read of the mask)."""
    keep = np.flatnonzero(_host_mask(layout, mask))
    if keep.size == mask.shape[0]:
        return gathered
    return place_all(gathered[jnp.asarray(keep)], layout.replicated)


def gather(layout: Layout, value: PyTree, axis: int) -> PyTree:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"strategy.gather(value, axis) needs an int axis, got {axis!r}")
    leaves, treedef, per = _split_nest(value)
    if len(per) < len(leaves) and layout.num_replicas > 1:
        raise ValueError(
            f"strategy.gather got a value that is not per-replica; with {layout.num_replicas} "
            "replicas only the PerReplica values returned by strategy.run can be gathered")
    gathered = _gather_stacked(int(axis), layout.replicated, [leaves[i] for i in per])
    for k, i in enumerate(per):
        x = leaves[i]
        if x._mask is not None and axis % x._value.ndim == 0:
            gathered[k] = _real_rows(layout, gathered[k], _row_mask(layout, x, "gather"))
    out = list(leaves)
    for i, g in zip(per, gathered):
        out[i] = g
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gather_stacked(axis: int, out_sharding: NamedSharding, values):
    def one(x):
        ndim = x.ndim - 1
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"strategy.gather(axis={axis}) is out of range for per-replica values of shape "
                f"{x.shape[1:]}" + ("; a scalar per replica has no axis to concatenate along: "
                                    "gather x[None] instead, or use strategy.local_results"
                                    if ndim == 0 else ""))
        a = axis % ndim
        moved = jnp.moveaxis(x, 0, a)  # (..., replicas, rows, ...): replicas outermost of the two
        shape = moved.shape[:a] + (moved.shape[a] * moved.shape[a + 1],) + moved.shape[a + 2:]
        return jax.lax.with_sharding_constraint(moved.reshape(shape), out_sharding)

    return jax.tree.map(one, [v.stacked for v in values])


def local_results(layout: Layout, value: PyTree) -> tuple:
    leaves, treedef, per = _split_nest(value)
    if not per:
        return (value,)
    devices = layout.local_devices
    columns: dict[int, list] = {}
    for i in per:
        arrays, sub = jax.tree.flatten(leaves[i]._value)
        shards = [{s.device: s.data for s in a.addressable_shards} for a in arrays]
        # A concatenation's shard is its replica's value; a stack's is that value with an axis.
        own = (lambda x: x) if leaves[i]._blocks else (lambda x: x[0])
        columns[i] = [jax.tree.unflatten(sub, [own(by_device[d]) for by_device in shards])
                      for d in devices]
    return tuple(jax.tree.unflatten(treedef, [columns[i][r] if i in columns else x
                                              for i, x in enumerate(leaves)])
                 for r in range(len(devices)))


def to_mirrored(layout: Layout, value: PyTree, *, check: bool = False) -> PyTree:
    leaves, treedef, per = _split_nest(value)
    stacks = [_placed(layout, leaves[i]) for i in per]
    if check and stacks:
        _check_agree(layout, treedef, leaves, per, stacks)
    mirrored = _unstack(layout.mesh, layout.data_axes)(stacks) if stacks else []
    out = [layout.put_replicated(x) if not isinstance(x, PerReplica) else None for x in leaves]
    for i, m in zip(per, mirrored):
        out[i] = m
    return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=32)
def _unstack(mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> Callable:
    """Each device's own entry of a per-replica stack becomes its copy of a replicated array.

    ``out_specs=P()`` with ``check_vma=False`` declares the outputs replicated without checking:
    no collective runs, each device keeps what it has. Callers vouch that the entries agree.
    """
    def own(values):  # each device's block of a concatenation, or its entry of a stack
        return [v._value if v._blocks else jax.tree.map(lambda x: x[0], v._value) for v in values]

    return jax.jit(jax.shard_map(own, mesh=mesh, in_specs=jax.P(data_axes), out_specs=jax.P(),
                                 check_vma=False))


@jax.jit
def _agree(values):
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating):  # bitwise, so that NaN agrees with NaN
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
        return jnp.all(x == x[:1])

    return [one(x) for x in jax.tree.leaves([v.stacked for v in values])]


def _check_agree(layout, treedef, leaves, per, stacks) -> None:
    flags = [bool(f) for f in jax.device_get(_agree(stacks))]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, leaves), is_leaf=is_per_replica)[0]]
    flat_paths = []
    for i, value in zip(per, stacks):
        for sub, _ in jax.tree_util.tree_flatten_with_path(value._value)[0]:
            flat_paths.append(paths[i] + jax.tree_util.keystr(sub))
    bad = [p or "value" for p, ok in zip(flat_paths, flags) if not ok]
    if bad:
        raise ValueError(
            f"strategy.to_mirrored(check=True): the {layout.num_replicas} replicas hold different "
            f"values for {bad}; only values every replica agrees on (all-reduced) can be mirrored. "
            "Reduce them with jaxdist.all_reduce inside the step, or read them with "
            "strategy.reduce / strategy.gather instead")
