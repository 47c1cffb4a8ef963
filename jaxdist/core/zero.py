"""Sharded state (ZeRO stages 1-3): which state leaves live split over the replicas, and how.

A mirrored strategy with ``zero_stage=K`` keeps the same mesh, batch layout and user step as
``zero_stage=0``; only where state lives between steps changes, and XLA's SPMD partitioner inserts
the collectives that follow from it (reduce-scatter, all-gather). The numbers do not change.

- stage 0: every leaf replicated (plain data parallelism).
- stage 1: optimizer state sharded: every leaf under a key or attribute named ``opt_state``
  (``flax.training.train_state.TrainState.opt_state``, ``{"opt_state": ...}`` in a dict, a
  NamedTuple field). Everything else replicated.
- stage 2: stage 1, and the gradients handed to the optimizer are constrained to the optimizer
  state's sharding, so their cross-replica sum is a reduce-scatter and no device holds the whole
  summed gradient. The constraint is applied where jaxdist can see the gradients: the ``tx`` of a
  state with ``apply_gradients`` and ``tx`` (flax's ``TrainState`` and ``jaxdist.precision``'s).
  A plain pytree state whose optimizer lives in the user's closure gets stage 1's program.
- stage 3: every leaf sharded between steps (parameters too); each step starts by gathering the
  parameters (one all-gather), so the forward and backward passes are stage 0's, and the update
  is computed on each device's shard; the gradient constraint of stage 2 applies.

Which leaves are sharded, and along which dimension (``shard_dim``): a leaf smaller than
``MIN_SHARD_BYTES`` stays replicated (sharding it would save little memory and cost a collective);
otherwise it is split along its largest dimension that the replica count divides (the first such
dimension on a tie); a leaf with no such dimension stays replicated. Nothing is padded, so a
checkpoint holds exactly the arrays of a replicated run and restores at any stage and device count.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.core._types import PyTree

logger = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
"""The accepted values of ``zero_stage``."""

MIN_SHARD_BYTES = 16 * 1024
"""Leaves smaller than this stay replicated at every stage (16 KiB: 4096 float32 values)."""

OPT_STATE_KEY = "opt_state"
"""The key or attribute name under which optimizer state is recognised."""


def check_zero_stage(owner: str, stage: Any) -> int:
    """Validates a ``zero_stage`` value.

    Args:
      owner: the name shown in the error (the strategy or function).
      stage: the value given.

    Returns:
      ``stage`` as an int.

    Raises:
      ValueError: ``stage`` is not one of 0, 1, 2, 3.

    >>> check_zero_stage("MirroredStrategy", 2)
    2
    """
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or stage not in ZERO_STAGES:
        raise ValueError(f"{owner}(zero_stage={stage!r}): expected one of {ZERO_STAGES} (0 replicated, "
                         "1 optimizer state sharded, 2 + gradients reduce-scattered, 3 + parameters "
                         "sharded)")
    return int(stage)


def shard_dim(shape: tuple[int, ...], itemsize: int, num_shards: int, *,
              min_bytes: int = MIN_SHARD_BYTES) -> int | None:
    """The dimension a leaf is split along over ``num_shards`` replicas, or None to replicate it.

    Args:
      shape: the leaf's shape.
      itemsize: bytes per element.
      num_shards: the replica count.
      min_bytes: leaves with fewer bytes are replicated.

    Returns:
      The index of the largest dimension divisible by ``num_shards`` (the first on a tie), or
      ``None`` when the leaf is small, a scalar, ``num_shards`` is 1, or no dimension divides.

    >>> shard_dim((784, 256), 4, 8), shard_dim((10,), 4, 8), shard_dim((4099, 3), 4, 8)
    (0, None, None)
    >>> shard_dim((100, 4096), 4, 8)
    1
    """
    if num_shards <= 1 or not shape or int(np.prod(shape)) * itemsize < min_bytes:
        return None
    best = None
    for i, d in enumerate(shape):
        if d % num_shards == 0 and (best is None or d > shape[best]):
            best = i
    return best


def _is_opt_path(path) -> bool:
    for k in path:
        name = getattr(k, "key", None)
        if name is None:
            name = getattr(k, "name", None)
        if name == OPT_STATE_KEY:
            return True
    return False


def _itemsize(x: Any) -> int:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype).itemsize if dtype is not None else np.asarray(x).dtype.itemsize


class ZeroShardings:
    """Where each state leaf lives at one stage on one mesh (a tree-level ``state_sharding``).

    Args:
      mesh: the strategy's mesh.
      data_axes: the mesh axes the replicas span.
      stage: 1, 2 or 3.
      min_bytes: leaves smaller than this stay replicated.

    >>> import jax, jax.numpy as jnp
    >>> from jaxdist.core import mesh
    >>> z = ZeroShardings(mesh.local_mesh(jax.devices()[:2]), ("data",), 1, min_bytes=0)
    >>> sh = z({"params": jnp.ones((4, 2)), "opt_state": jnp.ones((4, 2))})
    >>> sh["params"].spec, sh["opt_state"].spec
    (P(), P('data', None))
    """

    def __init__(self, mesh: Mesh, data_axes: tuple[str, ...], stage: int, *,
                 min_bytes: int = MIN_SHARD_BYTES):
        self.mesh, self.data_axes, self.stage, self.min_bytes = mesh, tuple(data_axes), stage, min_bytes
        self.num_shards = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.replicated = NamedSharding(mesh, jax.P())
        self._by_dim: dict[tuple[int, int], NamedSharding] = {}
        self._cache: dict[Any, list] = {}

    def sharding_for(self, shape: tuple[int, ...], itemsize: int, shard: bool) -> NamedSharding:
        """The (cached, so identity-comparable) sharding of one leaf.

        Args:
          shape, itemsize: the leaf's shape and bytes per element.
          shard: whether the leaf's role is sharded at this stage (``shard_dim`` still decides).

        Returns:
          A ``NamedSharding``: replicated, or split along ``shard_dim``'s dimension.
        """
        dim = shard_dim(tuple(shape), itemsize, self.num_shards, min_bytes=self.min_bytes) \
            if shard else None
        if dim is None:
            return self.replicated
        key = (len(shape), dim)
        if key not in self._by_dim:
            axes = self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes
            spec: list = [None] * len(shape)
            spec[dim] = axes
            self._by_dim[key] = NamedSharding(self.mesh, jax.P(*spec))
        return self._by_dim[key]

    def __call__(self, tree: PyTree) -> PyTree:
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, self.leaf_targets(leaves, treedef, tree))

    def leaf_targets(self, leaves: list, treedef: Any, tree: PyTree) -> list:
        """The shardings of ``tree``'s leaves, in order (remembered per structure and shapes:
        a steady loop's check that its state is placed is a dictionary lookup).

        Args:
          leaves, treedef: ``jax.tree.flatten(tree)``.
          tree: the state.

        Returns:
          A list of ``NamedSharding``, one per leaf.
        """
        key = (treedef, tuple((x.shape, x.dtype) if isinstance(x, jax.Array)
                              else (np.shape(x), _itemsize(x)) for x in leaves))
        targets = self._cache.get(key)
        if targets is None:
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
            is_opt = [_is_opt_path(p) for p in paths]
            targets = [self.sharding_for(np.shape(x), _itemsize(x), self.stage >= 3 or opt)
                       for opt, x in zip(is_opt, leaves)]
            if self.stage < 3 and self.num_shards > 1 and leaves and not any(is_opt):
                logger.warning(
                    "zero_stage=%d: the state (%s) has no leaf under a key or attribute named %r, "
                    "so nothing is sharded; keep the optimizer state in state.opt_state (flax's "
                    "TrainState) or {'opt_state': ...}, or use zero_stage=3", self.stage,
                    type(tree).__name__, OPT_STATE_KEY)
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = targets
        return targets

    def grad_shardings(self, grads: PyTree) -> PyTree:
        """Where gradients go before the optimizer update (stage >= 2): split like the state.

        Args:
          grads: a gradient pytree (shaped like the parameters).

        Returns:
          A pytree of ``NamedSharding`` shaped like ``grads``.
        """
        return jax.tree.map(lambda g: self.sharding_for(np.shape(g), _itemsize(g), True), grads)


def _constrained_tx(tx: Any, shardings: ZeroShardings) -> Any:
    """``tx`` with its gradients constrained to the sharded layout before each update."""

    def update(updates, state, params=None, **extra):
        updates = jax.lax.with_sharding_constraint(updates, shardings.grad_shardings(updates))
        return tx.update(updates, state, params, **extra)

    return tx._replace(update=update) if hasattr(tx, "_replace") else tx


def _gather_params(state: PyTree, replicated: NamedSharding) -> PyTree:
    """Every leaf outside the optimizer state constrained to a whole copy per device."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    return jax.tree.unflatten(treedef, [
        x if _is_opt_path(p) or not hasattr(x, "shape")
        else jax.lax.with_sharding_constraint(x, replicated) for p, x in flat])


def adapt_step(shardings: ZeroShardings) -> Callable[[Callable], Callable]:
    """A ``Layout.adapt_step`` for stages 2 and 3.

    Stage 3: the step starts by gathering the parameters (every leaf outside the optimizer state)
    into a whole copy per device, so the user's forward and backward passes compute exactly what
    they compute at stage 0 (the same numbers, bit for bit on CPU); the new parameters are stored
    sharded again. Left to itself, XLA's partitioner may instead split a matmul over the sharded
    dimension, which changes the order of float sums (measured: 4e-3 apart after 7 float16 steps).

    Stages 2 and 3: when the state has ``tx`` and ``apply_gradients`` (flax's ``TrainState``), the
    step runs with a ``tx`` that first constrains its gradients to the sharded layout; the original
    ``tx`` is put back on the returned state, so the state's structure (and the compiled step's
    donation) is unchanged. Any other state runs the step as it is.

    Args:
      shardings: the stage's ``ZeroShardings``.

    Returns:
      A function taking a global-view step and returning the adapted step.
    """
    gather = shardings.stage >= 3

    def adapt(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def zero_step(state, *args, **kwargs):
            if gather:
                state = _gather_params(state, shardings.replicated)
            tx = getattr(state, "tx", None)
            if tx is None or not hasattr(state, "apply_gradients") or not hasattr(state, "replace"):
                return fn(state, *args, **kwargs)
            out = fn(state.replace(tx=_constrained_tx(tx, shardings)), *args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and type(out[0]) is type(state):
                return (out[0].replace(tx=tx), out[1])
            if type(out) is type(state):
                return out.replace(tx=tx)
            return out

        return zero_step

    return adapt


def layout_hooks(mesh: Mesh, data_axes: tuple[str, ...], stage: int) -> dict[str, Any]:
    """The ``Layout`` fields a strategy with ``zero_stage=stage`` sets (none at stage 0).

    Args:
      mesh: the strategy's mesh.
      data_axes: the mesh axes the replicas span.
      stage: the ``zero_stage``.

    Returns:
      A dict of ``Layout`` keyword arguments: ``state_tree_sharding`` from stage 1,
      ``adapt_step`` from stage 2.
    """
    if stage == 0:
        return {}
    shardings = ZeroShardings(mesh, data_axes, stage)
    hooks: dict[str, Any] = {"state_tree_sharding": shardings}
    if stage >= 2:
        hooks["adapt_step"] = adapt_step(shardings)
    return hooks


def bytes_per_device(tree: PyTree) -> dict[str, int]:
    """Bytes of ``tree`` held on each device, read from the arrays' addressable shards.

    Args:
      tree: a pytree of ``jax.Array`` (a placed state).

    Returns:
      ``{str(device): bytes}`` for this process's devices.

    >>> import jax, jax.numpy as jnp
    >>> bytes_per_device({"w": jax.device_put(jnp.ones(4), jax.devices()[0])})
    {'cpu:0': 16}
    """
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        for s in x.addressable_shards:
            out[str(s.device)] = out.get(str(s.device), 0) + s.data.nbytes
    return out
