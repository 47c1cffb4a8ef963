"""Where things live under a strategy: one frozen value that input, step and checkpoint code take.

A strategy *builds* a ``Layout`` (``strategy.layout``); the code that places batches, compiles steps
or restores checkpoints reads only the layout, never a strategy's private members, so the imports
run one way: ``layout`` <- ``input`` / ``step`` <- ``strategy`` <- ``fit`` / ``checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.core import mesh as mesh_lib
from jaxdist.core import replica
from jaxdist.core._datacheck import check_fits_jax_dtype
from jaxdist.core._types import PyTree
from jaxdist.core.values import Batch, is_static_leaf


def _identity_step(fn: Callable) -> Callable:
    return fn


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The mesh, the axes the batch is split over, and where state and batches are placed.

    Attributes:
      mesh: the device mesh every replica belongs to.
      data_axes: mesh axes the global batch (and the replicas) span, in mesh order; ``()`` for a
        single replica without a mesh axis.
      state_sharding: where one state leaf lives between steps (default: a copy on every replica).
      adapt_step: wraps a user's global-view step for where the state lives (default: as it is).
      implementation, pack_bytes, compress: the cross-device options ``jaxdist.all_reduce`` uses.
      state_tree_sharding: where every leaf of a whole state lives (a tree of shardings), for rules
        that depend on a leaf's place in the state (``zero_stage``: optimizer state vs parameters);
        when set it takes precedence over ``state_sharding``.

    >>> import jax
    >>> from jaxdist.core import mesh
    >>> lay = Layout(mesh.local_mesh(jax.devices()[:1]), ("data",))
    >>> lay.num_replicas, lay.batch.spec
    (1, P('data',))
    """

    mesh: Mesh
    data_axes: tuple[str, ...]
    state_sharding: Callable[[Any], jax.sharding.Sharding] | None = None
    adapt_step: Callable[[Callable], Callable] = _identity_step
    implementation: str = "xla"
    pack_bytes: int | None = None
    compress: str | None = None
    state_tree_sharding: Callable[[PyTree], PyTree] | None = None

    @functools.cached_property
    def num_replicas(self) -> int:
        """Replicas: the devices along ``data_axes`` (a mesh may also have axes of the user's own,
        over which each replica's work is split by the user's shardings)."""
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @functools.cached_property
    def other_axes(self) -> tuple[str, ...]:
        """Mesh axes that carry no replicas: axes of a user's own mesh that their code shards."""
        return mesh_lib.other_axes(self.mesh, self.data_axes)

    def mesh_context(self) -> contextlib.AbstractContextManager:
        """Where a step is called and traced: the caller's context, unless the caller set another
        mesh (``jax.set_mesh(user_mesh)``, Explicit axes, say), which the strategy's arrays do not
        live on; then this layout's own mesh for the duration of the call."""
        context = jax.sharding.get_abstract_mesh()
        if context.empty or context == self.mesh.abstract_mesh:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """A full copy on every device of the mesh."""
        return NamedSharding(self.mesh, jax.P())

    @functools.cached_property
    def batch(self) -> NamedSharding:
        """The first axis split over ``data_axes`` (a global batch, or a stack of per-replica values)."""
        return NamedSharding(self.mesh, jax.P(self.data_axes))

    @functools.cached_property
    def local_devices(self) -> tuple[jax.Device, ...]:
        """The mesh's devices owned by this process, in replica order."""
        me = jax.process_index()
        devices = self.mesh.devices
        if self.other_axes:  # one device per replica: the first along the user's other axes
            names = list(self.mesh.axis_names)
            order = [names.index(a) for a in self.data_axes]
            order += [i for i in range(len(names)) if i not in order]
            devices = devices.transpose(order).reshape(self.num_replicas, -1)[:, 0]
        return tuple(d for d in devices.flat if d.process_index == me)

    @functools.cached_property
    def _contexts(self) -> dict[bool, replica.ReplicaContext]:
        return {per_replica: replica.ReplicaContext(
            axes=self.data_axes, num_replicas=self.num_replicas, per_replica=per_replica,
            implementation=self.implementation, pack_bytes=self.pack_bytes,
            compress=self.compress) for per_replica in (False, True)}

    def context(self, per_replica: bool) -> replica.ReplicaContext:
        """The replica context user code is traced in (per-replica view or global view)."""
        return self._contexts[per_replica]

    # --- placement ------------------------------------------------------------------------------
    def leaf_sharding(self, leaf: Any) -> jax.sharding.Sharding:
        """Where one state leaf lives between steps."""
        if self.state_sharding is not None:
            return self.state_sharding(leaf)
        if self.other_axes and isinstance(leaf, jax.Array):
            return self._users_own(leaf.sharding)
        return self.replicated

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a layout lives as long as its strategy)
    def _users_own(self, sharding: jax.sharding.Sharding) -> NamedSharding:
        """A leaf the user sharded over their mesh's other axes keeps that layout (a copy per
        replica of each of its shards); anything else is replicated."""
        if not (isinstance(sharding, NamedSharding)
                and sharding.mesh.axis_names == self.mesh.axis_names
                and sharding.mesh.devices.shape == self.mesh.devices.shape
                and (sharding.mesh.devices == self.mesh.devices).all()):
            return self.replicated
        used = {a for entry in sharding.spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)}
        if not used or used & set(self.data_axes):
            return self.replicated
        return self._on_other_axes(sharding.spec)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a layout lives as long as its strategy)
    def _on_other_axes(self, spec: jax.sharding.PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def state_shardings(self, tree: PyTree) -> PyTree:
        """The sharding of every leaf of a state, as a tree shaped like ``tree``."""
        if self.state_tree_sharding is not None:
            return self.state_tree_sharding(tree)
        return jax.tree.map(self.leaf_sharding, tree)

    def leaf_targets(self, leaves: list, treedef: Any, tree: PyTree) -> list:
        """Where each of ``tree``'s flattened ``leaves`` lives between steps, in leaf order."""
        rule = self.state_tree_sharding
        if rule is None:
            return [self.leaf_sharding(x) for x in leaves]
        fast = getattr(rule, "leaf_targets", None)  # jaxdist.zero's: cached per structure
        if fast is not None:
            return fast(leaves, treedef, tree)
        return jax.tree.leaves(rule(tree))

    def is_placed(self, tree: PyTree) -> bool:
        """True when every leaf already lives where state lives: the steady state of a loop, a
        step's output fed straight back in. Much cheaper than rebuilding the tree."""
        leaves, treedef = jax.tree.flatten(tree)
        return all((isinstance(x, jax.Array) and (x.sharding is t or x.sharding == t))
                   or is_static_leaf(x)
                   for x, t in zip(leaves, self.leaf_targets(leaves, treedef, tree)))

    def put_state(self, tree: PyTree) -> PyTree:
        """Every leaf placed where state lives; leaves already there are kept (a step may donate
        them), any other leaf is copied so that the caller's own arrays stay valid."""
        if self.is_placed(tree):
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        targets = self.leaf_targets(leaves, treedef, tree)
        # Only a leaf on exactly the target sharding is kept: it is what a step returned, so the
        # next step may donate it. A user's array on an equivalent sharding (a single-device array
        # on a one-device mesh) is copied, or donation would delete the caller's own array.
        # Static leaves (an Equinox module's functions, say) stay as they are.
        return jax.tree.unflatten(treedef, [
            x if is_static_leaf(x) else
            x if isinstance(x, jax.Array) and x.sharding == t
            else _placed_copy(x, t) for x, t in zip(leaves, targets)])

    def put_replicated(self, tree: PyTree) -> PyTree:
        """A copy of every leaf in each replica's device memory (what per-replica code reads);
        static leaves are kept as they are."""
        return jax.tree.map(lambda x: x if is_static_leaf(x) else place_all(x, self.replicated),
                            tree)

    def put_batch(self, batch: PyTree) -> PyTree:
        """Places a global batch on ``data_axes``: a ``Batch`` or a raw pytree of arrays (the same
        values on every process); leaves already there are kept, and so is a ``Batch`` mask that
        is already replicated (what ``distribute`` makes: see ``mask_sharding``)."""
        if all(placed_on(x, self.batch) for x in jax.tree.leaves(batch)):
            return batch
        if isinstance(batch, Batch) and self.mask_sharding(batch.mask) is self.replicated:
            data = self.put_batch(batch.data)
            return batch if data is batch.data else Batch(data, batch.mask)
        check_batch_leaves(batch, self.num_replicas, what="batch")
        return place_all(batch, self.batch)

    def mask_sharding(self, mask: Any) -> NamedSharding:
        """Where a ``Batch`` mask is laid out: replicated when it was placed so, else on the batch.

        ``distribute`` replicates the mask (a byte a row) whenever every process knows the whole
        global batch's mask: then ``sum(mask)``, the count ``compute_average_loss`` divides by, is
        computed on every device without a collective, so a masked step has one all-reduce (the
        gradients', with the loss) instead of two, the first of them on the critical path before
        the backward pass (measured: 0.93 -> 0.97 of an unmasked step on 8 CPU devices).
        """
        # With one replica the two layouts are the same one; the batch's is kept, as before.
        if self.num_replicas > 1 and placed_on(mask, self.replicated):
            return self.replicated
        return self.batch

    def batch_shardings(self, batch: PyTree) -> PyTree:
        """The sharding of every leaf of a (placed) global batch, for a compiled step's inputs."""
        if isinstance(batch, Batch) and batch.mask is not None:
            return Batch(jax.tree.map(lambda _: self.batch, batch.data),
                         self.mask_sharding(batch.mask))
        return jax.tree.map(lambda _: self.batch, batch)


def placed_on(x: Any, sharding: jax.sharding.Sharding) -> bool:
    """``x`` is a ``jax.Array`` laid out as ``sharding`` (or an equivalent one: on one device a
    compiled step reports ``P()`` for what was placed as ``P("data")``).

    An array on another mesh is not placed even when its devices hold the same rows (a user's
    ``jax.make_mesh``, with Explicit axes): a step refuses inputs on two meshes, so it is moved
    onto ``sharding``'s mesh, which ``jax.device_put`` does without copying the buffers."""
    return isinstance(x, jax.Array) and (
        x.sharding == sharding or _equivalent(x.sharding, sharding, x.ndim))


@functools.lru_cache(maxsize=256)
def _equivalent(a: jax.sharding.Sharding, b: jax.sharding.Sharding, ndim: int) -> bool:
    """Remembered, so that a steady loop's check is a lookup, not a comparison of device maps."""
    if isinstance(a, NamedSharding) and isinstance(b, NamedSharding) and a.mesh != b.mesh:
        return False
    return a.is_equivalent_to(b, ndim)


def _device_put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if (isinstance(x, jax.Array) and x.is_fully_addressable
            and not sharding.is_fully_addressable):
        # A value living on this process alone (a local result, say) placed on a mesh that spans
        # several processes: JAX does not move arrays across hosts, but every process holds the
        # same value, so each contributes its own copy.
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def place_all(tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """Every leaf of ``tree`` on ``sharding``; leaves already there are kept as they are."""
    return jax.tree.map(lambda x: x if placed_on(x, sharding) else _device_put(x, sharding), tree)


def _placed_copy(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed on ``sharding`` in buffers of its own.

    The placed copy is donated by the next step, so it must not share a buffer with the caller's
    array: ``device_put`` reuses the source buffer for the shard on the source's device even with
    ``may_alias=False`` when it replicates (seen on jax 0.10.2), hence the explicit copy.
    """
    goes_through_host = (isinstance(x, jax.Array) and x.is_fully_addressable
                         and not sharding.is_fully_addressable)
    if isinstance(x, jax.Array) and not goes_through_host:
        x = jnp.array(x, copy=True)
    return _device_put(x, sharding)


def _path_str(path) -> str:
    return "data" + "".join(str(k) for k in path)


def check_batch_leaves(tree: PyTree, num_replicas: int, *, what: str) -> int:
    """Checks that every leaf is an array with the same leading dimension; returns it.

    Raises:
      ValueError: naming the offending leaf and its shape/type, or a value that does not fit the
        dtype JAX will store it in (uint64 2**63 without x64, say).
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not flat:
        raise ValueError(f"{what} has no array leaves; expected e.g. (x, y) or {{'x': x, 'y': y}}")
    sizes = {}
    for path, leaf in flat:
        if not isinstance(leaf, (np.ndarray, jax.Array)) or np.ndim(leaf) == 0:
            kind = type(leaf).__name__ if not hasattr(leaf, "shape") else f"a scalar of shape {leaf.shape}"
            raise ValueError(
                f"{what} leaf {_path_str(path)} is {kind}; every leaf must be a numpy or jax array "
                "whose first axis indexes examples (convert lists with np.asarray)")
        sizes[_path_str(path)] = np.shape(leaf)[0]
    check_fits_jax_dtype(tree, what=what)
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{what} leaves have different leading (example) dimensions: {sizes}; "
                         "every leaf must have one row per example")
    n = next(iter(sizes.values()))
    if what == "batch" and n % num_replicas:
        raise ValueError(
            f"batch has {n} examples, which does not divide over {num_replicas} replicas; use "
            f"strategy.distribute(data, global_batch_size) (it pads the last batch with a mask) or a "
            f"batch size that is a multiple of {num_replicas}")
    return n
