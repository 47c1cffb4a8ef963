"""Turning a user's step into a compiled distributed step: the global and the per-replica view."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist import replica
from jaxdist._types import PyTree
from jaxdist.input import Batch
from jaxdist.strategy.base import PerReplica

if TYPE_CHECKING:
    from jaxdist.strategy.base import MeshStrategy


def _same_layout(a: PyTree, b: PyTree) -> bool:
    """True when ``b`` could be stored in ``a``'s buffers (same structure, shapes and dtypes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(np.shape(x) == np.shape(y) and jax.numpy.result_type(x) == jax.numpy.result_type(y)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class DistributedStep:
    """A user's global-view ``fn(state, batch)`` compiled for a strategy.

    The state is placed the strategy's way (replicated for mirrored strategies) and donated, the
    batch is sharded on the strategy's batch axes, and XLA's partitioner inserts the cross-replica
    reductions, so a mean over the batch is a mean over the *global* batch whatever the device count.
    One compilation per input structure and shape.

    Donation is skipped automatically when ``fn`` does not return ``(new_state, ...)`` with the
    state's layout (an eval step returning only metrics must not consume the state it was given).

    Attributes:
      strategy: the strategy the step runs under.
    """

    def __init__(self, fn: Callable, strategy: "MeshStrategy", /, *, donate: bool = True):
        if not callable(fn):
            raise TypeError(f"expected a step function fn(state, batch), got {type(fn).__name__}")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.strategy = strategy
        self._donate = donate
        self._compiled: dict[Any, Callable] = {}

    def __repr__(self) -> str:
        return f"DistributedStep({getattr(self._fn, '__qualname__', self._fn)!r}, {self.strategy!r})"

    def __call__(self, state: PyTree, batch: PyTree, /):
        strategy = self.strategy
        state = strategy.put(state)
        batch = strategy._put_batch(batch)  # a Batch or a raw pytree: every leaf on the batch axis
        key = (jax.tree.structure(state), jax.tree.structure(batch))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._build(state, batch)
        with replica.enter(strategy._context(per_replica=False)):
            return compiled(state, batch)

    def _build(self, state: PyTree, batch: PyTree) -> Callable:
        strategy = self.strategy
        state_sh = strategy._state_shardings(state)
        batch_sh = jax.tree.map(lambda _: strategy._batch_sharding, batch)
        fn = strategy._wrap_step(self._fn)
        with replica.enter(strategy._context(per_replica=False)):
            out = jax.eval_shape(fn, state, batch)
        returns_state = isinstance(out, tuple) and len(out) == 2 and _same_layout(state, out[0])
        if returns_state:
            out_sh = (state_sh, jax.tree.map(lambda _: strategy._replicated, out[1]))
        else:
            out_sh = jax.tree.map(lambda _: strategy._replicated, out)
        return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=out_sh,
                       donate_argnums=(0,) if (self._donate and returns_state) else ())


# --- the per-replica view ----------------------------------------------------------------------------

_REPLICATED, _SPLIT, _PER_REPLICA = "replicated", "split", "per_replica"


def _classify(strategy: "MeshStrategy", top: Any) -> str:
    if isinstance(top, PerReplica):
        return _PER_REPLICA
    if isinstance(top, Batch):
        return _SPLIT
    # Anything else is copied to every replica, as tf.distribute does with plain tensors: guessing
    # from an array's sharding would split state that merely happens to be laid out on the batch axis.
    return _REPLICATED


def run_per_replica(strategy: "MeshStrategy", fn: Callable, args: tuple, kwargs: dict) -> PerReplica:
    """``strategy.run``: ``fn`` once per replica under ``jax.shard_map`` (``check_vma=False``).

    ``check_vma=False`` matters: with it on, JAX marks replicated parameters as varying inside the
    map and the transpose of that is a psum, so ``jax.grad`` would already return gradients summed
    over replicas and the user's ``all_reduce`` would double-count. Here gradients stay local.
    """
    is_top = lambda x: isinstance(x, (PerReplica, Batch))  # noqa: E731
    tops, treedef = jax.tree.flatten((tuple(args), dict(kwargs)), is_leaf=is_top)
    kinds = tuple(_classify(strategy, t) for t in tops)
    placed = []
    for kind, top in zip(kinds, tops):
        if kind == _REPLICATED:
            placed.append(strategy._put_replicated(top))
        elif kind == _SPLIT:
            placed.append(strategy._put_batch(top))
        else:
            placed.append(top)
    compiled = _compiled_run(strategy, fn, treedef, kinds)
    with replica.enter(strategy._context(per_replica=True)):
        return PerReplica(compiled(*placed))


@functools.lru_cache(maxsize=256)
def _compiled_run(strategy: "MeshStrategy", fn: Callable, treedef, kinds: tuple[str, ...]):
    split = jax.P(strategy._data_axes)
    in_specs = tuple(jax.P() if k == _REPLICATED else split for k in kinds)

    def body(*tops):
        tops = [jax.tree.map(lambda x: x[0], t.stacked) if k == _PER_REPLICA else t
                for k, t in zip(kinds, tops)]
        args, kwargs = jax.tree.unflatten(treedef, tops)
        out = fn(*args, **kwargs)
        return jax.tree.map(lambda x: jax.numpy.asarray(x)[None], out)

    mapped = jax.shard_map(body, mesh=strategy.mesh, in_specs=in_specs, out_specs=split,
                           check_vma=False)
    return jax.jit(mapped)
