"""The Strategy protocol and the mesh-backed implementation the concrete strategies share.

A strategy is a small immutable value naming *where* state lives and *how* replicas agree. All the
work happens in the functions it returns (``step``) or runs (``run``); building one touches no device.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist import replica
from jaxdist._types import PyTree
from jaxdist.replica import ReduceOp


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """Values that differ between replicas, as returned by ``strategy.run``.

    ``stacked`` is a pytree whose leaves carry a leading axis of length ``num_replicas_in_sync``,
    sharded so that entry ``r`` lives on replica ``r``'s device. Read it with ``strategy.reduce``
    or ``strategy.local_results``; pass it back to ``strategy.run`` and each replica gets its own entry.
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


class Strategy(abc.ABC):
    """What every distribution strategy offers (mirrors ``tf.distribute.Strategy``)."""

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in every step."""

    @property
    @abc.abstractmethod
    def mesh(self) -> Mesh | None:
        """The device mesh the strategy runs on."""

    @abc.abstractmethod
    def put(self, tree: PyTree) -> PyTree:
        """Places state the strategy's way (tf: creating variables under ``scope()``)."""

    @abc.abstractmethod
    def distribute(self, data: Any, global_batch_size: int, *, shuffle: bool = False, seed: int = 0,
                   drop_remainder: bool = False):
        """Turns a dataset into a stream of globally-sharded ``jaxdist.Batch`` values."""

    @abc.abstractmethod
    def step(self, fn: Callable, /, *, donate: bool = True) -> Callable:
        """Compiles a global-view ``fn(state, batch) -> (state, metrics)``."""

    @abc.abstractmethod
    def run(self, fn: Callable, /, args: tuple = (), kwargs: dict | None = None) -> PerReplica:
        """Runs ``fn`` once per replica on its slice of the distributed arguments."""

    @abc.abstractmethod
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> jax.Array:
        """Combines a per-replica value across replicas."""

    @abc.abstractmethod
    def local_results(self, value: Any) -> tuple:
        """This process's per-replica values, in replica order."""


class MeshStrategy(Strategy):
    """A strategy whose replicas are the devices of a mesh, state replicated, batch on ``data_axes``.

    Subclasses are frozen dataclasses that define ``_build_mesh()``; the mesh and the shardings are
    derived lazily (``functools.cached_property``) so that constructing a strategy does no device work.
    """

    # --- what subclasses provide --------------------------------------------------------------
    @abc.abstractmethod
    def _build_mesh(self) -> Mesh: ...

    _implementation: str = "xla"
    _pack_bytes: int | None = None
    _compress: str | None = None

    # --- derived --------------------------------------------------------------------------------
    @functools.cached_property
    def _mesh(self) -> Mesh:
        return self._build_mesh()

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @functools.cached_property
    def _data_axes(self) -> tuple[str, ...]:
        return tuple(self._mesh.axis_names)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._mesh.devices.size

    @functools.cached_property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self._mesh, jax.P())

    @functools.cached_property
    def _batch_sharding(self) -> NamedSharding:
        return NamedSharding(self._mesh, jax.P(self._data_axes))

    @functools.cached_property
    def _local_devices(self) -> tuple[jax.Device, ...]:
        """The mesh's devices owned by this process, in replica order."""
        me = jax.process_index()
        return tuple(d for d in self._mesh.devices.flat if d.process_index == me)

    @functools.cached_property
    def _contexts(self) -> dict[bool, replica.ReplicaContext]:
        return {per_replica: replica.ReplicaContext(
            axes=self._data_axes, num_replicas=self.num_replicas_in_sync, per_replica=per_replica,
            implementation=self._implementation, pack_bytes=self._pack_bytes,
            compress=self._compress) for per_replica in (False, True)}

    def _context(self, per_replica: bool) -> replica.ReplicaContext:
        return self._contexts[per_replica]

    # --- placement ------------------------------------------------------------------------------
    def _leaf_sharding(self, leaf: Any) -> jax.sharding.Sharding:
        """Where one state leaf lives between steps (a copy on every replica, here)."""
        return self._replicated

    def _state_shardings(self, tree: PyTree) -> PyTree:
        return jax.tree.map(self._leaf_sharding, tree)

    def _wrap_step(self, fn: Callable) -> Callable:
        """Adapts a user's global-view step to where this strategy keeps state (identity here)."""
        return fn

    def put(self, tree: PyTree) -> PyTree:
        """Places every leaf of ``tree`` the strategy's way (a copy on each replica's device).

        Leaves already placed that way are returned as they are (no copy), and a train step then
        donates them; any other leaf is copied, so the caller's own arrays stay valid.

        >>> import jax, jaxdist
        >>> s = jaxdist.OneDeviceStrategy(jax.devices()[0])
        >>> s.put({"w": 1.0})["w"].sharding.is_fully_replicated
        True
        """
        leaves, treedef = jax.tree.flatten(tree)
        targets = [self._leaf_sharding(x) for x in leaves]
        # The steady state: a step's output fed straight back in, already placed. Checking the
        # leaves is much cheaper than rebuilding the tree.
        if all(isinstance(x, jax.Array) and x.sharding is t for x, t in zip(leaves, targets)):
            return tree
        return jax.tree.unflatten(treedef, [
            x if _placed_on(x, t) else _placed_copy(x, t)
            for x, t in zip(leaves, targets)])

    def _put_replicated(self, tree: PyTree) -> PyTree:
        """A copy of every leaf in each replica's device memory (what per-replica code reads)."""
        return _place_all(tree, self._replicated)

    def _put_batch(self, batch: PyTree) -> PyTree:
        """Places a global batch on ``data_axes``: a ``Batch`` or a raw pytree of arrays (the same
        values on every process); leaves already there are kept."""
        from jaxdist.input import check_batch_leaves  # input imports this module

        sharding = self._batch_sharding
        if all(_placed_on(x, sharding) for x in jax.tree.leaves(batch)):
            return batch
        check_batch_leaves(batch, self.num_replicas_in_sync, what="batch")
        return _place_all(batch, sharding)

    def distribute(self, data: Any, global_batch_size: int, *, shuffle: bool = False, seed: int = 0,
                   drop_remainder: bool = False, prefetch: int = 2):
        """Shards ``data`` into global batches laid out on the replicas.

        Args:
          data: an in-memory dataset (a tuple / dict / pytree of numpy arrays with a common leading
            example axis), or an iterable of such batches (a list, a generator function, a grain
            ``MapDataset.batch(...)``), each with at most ``global_batch_size`` examples.
          global_batch_size: examples per step across all replicas; must divide evenly over them.
          shuffle: reshuffle in-memory data every epoch, deterministically from ``seed``.
          seed: shuffling seed.
          drop_remainder: drop a final partial batch instead of padding it (padded rows carry
            ``mask == False``, so no example is dropped or counted twice either way).
          prefetch: batches prepared ahead on a background thread (bounded).

        Returns:
          A ``jaxdist.DistributedDataset``; iterating it yields ``jaxdist.Batch(data, mask)``.

        Raises:
          ValueError: the batch size does not divide over the replicas, leaves are not arrays,
            or their leading dimensions differ.
        """
        from jaxdist.input import DistributedDataset

        return DistributedDataset(self, data, global_batch_size, shuffle=shuffle, seed=seed,
                                  drop_remainder=drop_remainder, prefetch=prefetch)

    # --- the two views ----------------------------------------------------------------------------
    def step(self, fn: Callable, /, *, donate: bool = True) -> Callable:
        from jaxdist.step import DistributedStep

        return DistributedStep(fn, self, donate=donate)

    def run(self, fn: Callable, /, args: tuple = (), kwargs: dict | None = None) -> PerReplica:
        """Runs ``fn(*args, **kwargs)`` once per replica under ``jax.shard_map``.

        Distributed arguments (a ``jaxdist.Batch`` from ``distribute``, or a ``PerReplica`` from an
        earlier ``run``) are split so that each replica sees its own slice; everything else is
        copied to every replica, as tf.distribute does with plain tensors. Gradients taken inside
        ``fn`` are *local* to the replica: combine them with ``jaxdist.all_reduce``.

        Returns:
          ``PerReplica`` holding every replica's outputs.
        """
        from jaxdist.step import run_per_replica

        return run_per_replica(self, fn, args, {} if kwargs is None else kwargs)

    # --- reading results on the host ---------------------------------------------------------------
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> PyTree:
        """Combines a per-replica value across replicas, as ``tf.distribute.Strategy.reduce``.

        Args:
          op: ``"sum"`` or ``"mean"``.
          value: a ``PerReplica`` (or a value that is the same on every replica).
          axis: ``None`` reduces across replicas only; an int also reduces along that axis of each
            replica's value (``"mean"`` then averages over all those elements, the global batch mean).

        Returns:
          The reduced pytree of arrays, replicated.
        """
        op = ReduceOp.parse(op)
        if not isinstance(value, PerReplica):
            if axis is not None:
                fn = jnp.sum if op is ReduceOp.SUM else jnp.mean
                return jax.tree.map(lambda x: fn(x, axis=axis), value)
            if op is ReduceOp.SUM and self.num_replicas_in_sync > 1:
                raise ValueError(
                    "strategy.reduce('sum', value) got a value that is not per-replica, so summing it "
                    f"over {self.num_replicas_in_sync} replicas is ambiguous; pass the PerReplica "
                    "returned by strategy.run, or use 'mean'")
            return value
        return _reduce_stacked(op.value, axis, self._replicated, value.stacked)

    def local_results(self, value: Any) -> tuple:
        """This process's per-replica values as a tuple (one entry per local replica).

        A value that is not ``PerReplica`` is returned as a 1-tuple, as in tf.distribute.
        """
        if not isinstance(value, PerReplica):
            return (value,)
        leaves, treedef = jax.tree.flatten(value.stacked)
        per_leaf = []
        for leaf in leaves:
            by_device = {s.device: s.data for s in leaf.addressable_shards}
            per_leaf.append([by_device[d][0] for d in self._local_devices])
        return tuple(jax.tree.unflatten(treedef, [col[r] for col in per_leaf])
                     for r in range(len(self._local_devices)))


def _placed_on(x: Any, sharding: jax.sharding.Sharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding == sharding


def _place_all(tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """Every leaf of ``tree`` on ``sharding``; leaves already there are kept as they are."""
    return jax.tree.map(lambda x: x if _placed_on(x, sharding) else jax.device_put(x, sharding),
                        tree)


def _placed_copy(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed on ``sharding`` in buffers of its own.

    The placed copy is donated by the next step, so it must not share a buffer with the caller's
    array: ``device_put`` reuses the source buffer for the shard on the source's device even with
    ``may_alias=False`` when it replicates (seen on jax 0.10.2), hence the explicit copy.
    """
    if isinstance(x, jax.Array):
        x = jnp.array(x, copy=True)
    return jax.device_put(x, sharding)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reduce_stacked(op: str, axis: int | None, out_sharding: NamedSharding, stacked):
    def one(x):
        if axis is not None and not -(x.ndim - 1) <= axis < x.ndim - 1:
            raise ValueError(f"strategy.reduce(axis={axis}) is out of range for per-replica values "
                             f"of shape {x.shape[1:]}; use axis=None to reduce across replicas only")
        axes = (0,) if axis is None else (0, 1 + axis % (x.ndim - 1))
        total = jnp.sum(x, axis=axes)
        if op == "mean":
            total = total / np.prod([x.shape[a] for a in axes])
        return jax.lax.with_sharding_constraint(total, out_sharding)

    return jax.tree.map(one, stacked)


def resolve_devices(devices: Sequence[jax.Device] | None, what: str) -> tuple[jax.Device, ...]:
    """Validates an explicit device list (or returns this process's devices for None)."""
    if devices is None:
        return tuple(jax.local_devices())
    devices = tuple(devices)
    if not devices:
        raise ValueError(f"{what}(devices=()) got no devices; pass None for all local devices")
    if not all(isinstance(d, jax.Device) for d in devices):
        bad = [type(d).__name__ for d in devices if not isinstance(d, jax.Device)]
        raise TypeError(f"{what}(devices=...) expects jax.Device objects (e.g. jax.devices()[:4]), "
                        f"got {bad}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{what}(devices=...) lists a device more than once: {list(devices)}")
    return devices
