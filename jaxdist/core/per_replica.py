"""The per-replica view: ``strategy.run`` and reading its ``PerReplica`` results.

``run`` traces the user's function once per replica under ``jax.shard_map`` and returns the
function's own output structure with a ``PerReplica`` in place of each array, as tf.distribute does.
A ``PerReplica`` is a stack whose leading axis is sharded over the replicas, so feeding it back into
``run`` splits it with no copy at all: the state of a per-replica loop never leaves the devices, and
under several processes never crosses hosts.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxdist.core import replica
from jaxdist.core._types import PyTree
from jaxdist.core.layout import Layout, place_all, placed_on
from jaxdist.core.replica import ReduceOp
from jaxdist.core.step import InFlight, returns_state
from jaxdist.core.values import (Batch, PerReplica, explaining_batch_errors, is_per_replica, join_static,
                            split_leaves)

logger = logging.getLogger(__name__)

_REP, _SPLIT, _PER, _BLOCKS, _STATIC = "replicated", "split", "per_replica", "blocks", "static"
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _is_distributed(x: Any) -> bool:
    return isinstance(x, (PerReplica, Batch))


class RunCache:
    """The compiled per-replica functions of one strategy, and its steps in flight.

    Entries are keyed on the user's function the way ``jax.jit`` keys its cache: by the function
    object, held weakly, so a cache never keeps a user's closure (and what it captured) alive. A
    bound method is keyed on its instance (weakly) and its function, so ``run(self.step, ...)``
    compiles once although every attribute access makes a new method object. The compiled code
    reaches the user's function through the same weak reference.
    """

    def __init__(self, max_in_flight: int = 8):
        self._by_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._by_id: dict[int, tuple[weakref.ref, dict]] = {}  # owners that are not hashable
        self.in_flight = InFlight(max_in_flight)

    def _entries(self, owner: Any) -> dict | None:
        try:
            return self._by_owner.setdefault(owner, {})
        except TypeError:  # unhashable (a mutable dataclass, say): keyed on identity instead
            pass
        key = id(owner)
        found = self._by_id.get(key)
        if found is None or found[0]() is not owner:
            try:
                ref = weakref.ref(owner, lambda _, key=key: self._by_id.pop(key, None))
            except TypeError:  # cannot be weakly referenced: compile, do not keep
                return None
            found = self._by_id[key] = (ref, {})
        return found[1]

    @staticmethod
    def _split(fn: Callable) -> tuple[Any, Callable | None]:
        if inspect.ismethod(fn):
            return fn.__self__, fn.__func__
        return fn, None

    def lookup(self, fn: Callable, key: Any, build: Callable[[Callable[[], Callable]], Any]):
        """The entry for ``(fn, key)``, built by ``build(get_fn)`` on a miss."""
        owner, func = self._split(fn)
        per_owner = self._entries(owner)
        if per_owner is None:
            return build(lambda: fn)
        entry = per_owner.get((func, key))
        if entry is None:
            ref = weakref.ref(owner)
            get_fn = (lambda: ref()) if func is None else (lambda: func.__get__(ref()))
            entry = per_owner[(func, key)] = build(get_fn)
        return entry

    def last_plan(self, fn: Callable) -> _Plan | None:
        """What the previous ``run`` of ``fn`` found, held as weakly as the compiled entries."""
        owner, func = self._split(fn)
        try:
            per_owner = self._by_owner.get(owner)
        except TypeError:  # unhashable: keyed on identity, as in _entries
            found = self._by_id.get(id(owner))
            per_owner = found[1] if found is not None and found[0]() is owner else None
        return None if per_owner is None else per_owner.get((func, _PLAN))

    def remember(self, fn: Callable, plan: _Plan) -> None:
        owner, func = self._split(fn)
        per_owner = self._entries(owner)
        if per_owner is not None:
            per_owner[(func, _PLAN)] = plan


_PLAN = object()  # the key, beside a function's compiled entries, of its last call's plan
_UNSEEN = object()


class _Plan:
    """The previous call's argument structure, kinds and placements, and what it compiled to.

    A loop calls ``run(step, args=(state, batch))`` with the same structure every step; checking
    the new arguments against the previous call's (``flatten_up_to`` its treedef, then one type
    and sharding identity test per argument) costs a few microseconds, where classifying them
    afresh costs tens. Anything that does not match goes the full way, which raises the errors.
    """

    __slots__ = ("treedef", "kinds", "statics", "shardings", "entry", "n")

    def __init__(self, treedef, kinds, statics, values, entry, n):
        self.treedef, self.kinds, self.statics, self.entry, self.n = (
            treedef, kinds, statics, entry, n)
        vals = iter(values)
        self.shardings = [_UNSEEN if k is _STATIC or k is _SPLIT else _sharding(next(vals))
                          for k in kinds]

    def match(self, layout: Layout, args: tuple, kwargs: dict) -> list | None:
        """The placed argument values when the arguments match this plan, else None."""
        try:
            tops = self.treedef.flatten_up_to((args, kwargs))
        except (ValueError, TypeError):
            return None
        values, statics, shardings = [], iter(self.statics), self.shardings
        for i, (kind, top) in enumerate(zip(self.kinds, tops)):
            if kind is _BLOCKS or kind is _PER:
                if type(top) is not PerReplica or top._blocks != (self.n if kind is _BLOCKS else 0):
                    return None
                value = top._value
                if not (isinstance(value, jax.Array) and value.sharding is shardings[i]
                        and (kind is _BLOCKS or (value.ndim and value.shape[0] == self.n))):
                    value = _placed(layout, top)._value
                    shardings[i] = _sharding(value)
            elif kind is _SPLIT:
                if type(top) is not Batch:
                    return None
                value = layout.put_batch(top)
            elif kind is _REP:
                if not (isinstance(top, jax.Array) and top.sharding is shardings[i]):
                    if not (isinstance(top, _ARRAY_TYPES) or hasattr(top, "__jax_array__")):
                        return None
                    top = layout.put_replicated(top)
                    shardings[i] = _sharding(top)
                value = top
            else:
                static = next(statics)
                if type(top) is not type(static) or top != static:
                    return None
                continue
            values.append(value)
        return values


def _sharding(value: Any) -> Any:
    return value.sharding if isinstance(value, jax.Array) else _UNSEEN


def _classify(layout: Layout, top: Any) -> tuple[str, Any]:
    if isinstance(top, PerReplica):
        return (_BLOCKS if top._blocks else _PER), _placed(layout, top)._value
    if isinstance(top, Batch):
        return _SPLIT, layout.put_batch(top)
    if isinstance(top, _ARRAY_TYPES) or hasattr(top, "__jax_array__"):
        # Copied to every replica, as tf.distribute does with plain tensors: guessing from an
        # array's sharding would split state that merely happens to lie on the batch axis.
        return _REP, layout.put_replicated(top)
    try:
        hash(top)
    except TypeError:
        raise TypeError(
            f"strategy.run got an argument leaf of type {type(top).__name__} that is neither an "
            "array nor hashable; pass arrays (or pytrees of them), or hashable Python values, which "
            "are compiled in as constants") from None
    return _STATIC, top


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


def run(layout: Layout, cache: RunCache, fn: Callable, args: tuple, kwargs: dict) -> PyTree:
    """``strategy.run``: ``fn`` once per replica under ``jax.shard_map`` (``check_vma=False``).

    ``check_vma=False`` matters: with it on, JAX marks replicated parameters as varying inside the
    map and the transpose of that is a psum, so ``jax.grad`` would already return gradients summed
    over replicas and the user's ``all_reduce`` would double-count. Here gradients stay local.
    """
    with layout.mesh_context():  # inside a user's own jax.set_mesh, on the strategy's mesh
        compiled, keeps_state, values = _prepare(layout, cache, fn, args, kwargs)
        with replica.enter(layout.context(per_replica=True)):
            out = compiled(*values)  # already fn's structure of PerReplica values (see _compile)
    if keeps_state:
        cache.in_flight.add(out[1], out[0], trains=True)
    else:
        cache.in_flight.add(out, ())
    masks = [v.mask for v in values if type(v) is Batch and v.mask is not None]
    if masks:
        _mark_rows(out[1] if keeps_state else out, masks, layout.num_replicas)
    return out


def _mark_rows(out: PyTree, masks: list, n: int) -> None:
    """Tags outputs with one row per example of a batch with its mask (not the new state).

    A partial last batch is padded; tf's own ``reduce(..., axis=0)`` and ``gather`` see only the
    real rows (its replicas get fewer), so ours must skip the padding rows to give tf's numbers.
    An output with as many rows as several of the batches gets all their masks: which batch it
    came from is not known, and ``_row_mask`` decides when it is read.
    """
    for leaf in jax.tree.leaves(out, is_leaf=is_per_replica):
        if (isinstance(leaf, PerReplica) and leaf._blocks == n
                and isinstance(leaf._value, jax.Array)):
            fits = [m for m in masks if leaf._value.shape[0] == m.shape[0] // n * n]
            if fits:
                leaf._mask = fits[0] if all(m is fits[0] for m in fits) else tuple(fits)


def lower(strategy: Any, fn: Callable, args: tuple = (), kwargs: dict | None = None):
    """The per-replica program ``strategy.run(fn, args, kwargs)`` runs, lowered, not executed.

    For inspection, as ``jax.jit(f).lower(...)``: ``.as_text()``, ``.compile().as_text()``,
    ``.compile().cost_analysis()``.

    >>> import jax, jaxdist
    >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
    >>> "all_reduce" in lower(s, lambda v: jaxdist.all_reduce(v, "sum"), args=(1.0,)).as_text()
    True
    """
    layout = strategy.layout
    compiled, _, values = _prepare(layout, strategy._run_cache, fn, tuple(args), kwargs or {})
    with replica.enter(layout.context(per_replica=True)):
        return compiled.lower(*values)


def _prepare(layout: Layout, cache: RunCache, fn: Callable, args: tuple, kwargs: dict):
    """Places the arguments and finds (or compiles) the per-replica program for them."""
    args = tuple(args)
    plan = cache.last_plan(fn)
    if plan is not None:
        values = plan.match(layout, args, kwargs if type(kwargs) is dict else dict(kwargs))
        if values is not None:
            return (*plan.entry, values)
    if not callable(fn):
        raise TypeError(f"strategy.run(fn, ...) expects a callable, got {type(fn).__name__}")
    tops, treedef = jax.tree.flatten((args, dict(kwargs)), is_leaf=_is_distributed)
    num_first = len(jax.tree.leaves(args[0], is_leaf=_is_distributed)) if args else 0
    kinds, values, statics = [], [], []
    for top in tops:
        kind, value = _classify(layout, top)
        kinds.append(kind)
        (statics if kind == _STATIC else values).append(value)
    key = (treedef, tuple(kinds), tuple(statics), num_first)
    entry = cache.lookup(fn, key, lambda get_fn: _compile(
        layout, get_fn, treedef, tuple(kinds), tuple(statics), num_first, values))
    cache.remember(fn, _Plan(treedef, tuple(kinds), tuple(statics), values, entry,
                             layout.num_replicas))
    return (*entry, values)


def _compile(layout: Layout, get_fn: Callable[[], Callable], treedef, kinds: tuple[str, ...],
             statics: tuple, num_first: int, values: list) -> tuple[Callable, bool]:
    split = jax.P(layout.data_axes)
    n = layout.num_replicas
    traced_returns_state, out_ranks, out_statics, out_defs = [], [], {}, []

    def body(*vals):
        vals, consts = iter(vals), iter(statics)
        tops = []
        for kind in kinds:
            if kind == _STATIC:
                tops.append(next(consts))
            elif kind == _PER:
                tops.append(jax.tree.map(lambda x: x[0], next(vals)))
            else:  # a replicated value, a batch's slice, or a replica's own block: as they are
                tops.append(next(vals))
        args, kwargs = jax.tree.unflatten(treedef, tops)
        out = get_fn()(*args, **kwargs)
        traced_returns_state.append(bool(args) and returns_state(args[0], out))
        leaves, out_def = jax.tree.flatten(out)
        # Static leaves (an Equinox module's functions in a returned state) leave the program
        # beside it, not through it: only arrays can.
        leaves, statics_here = split_leaves(leaves)
        out_statics.clear()
        out_statics.update(statics_here)
        leaves = [jnp.asarray(x) for x in leaves]
        out_ranks[:] = [x.ndim for x in leaves]
        # A value of rank >= 1 leaves as its replica's block of a concatenation (no reshape: see
        # PerReplica); only scalars gain the leading replica axis.
        leaves = [x if x.ndim else x[None] for x in leaves]
        if out_statics:
            out_defs[:] = [out_def]
            return leaves
        return jax.tree.unflatten(out_def, leaves)

    in_specs = tuple(jax.P() if k == _REP else split for k in kinds if k != _STATIC)
    mapped = jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=split,
                           check_vma=False)

    def program(*vals):
        leaves, out_def = jax.tree.flatten(mapped(*vals))
        # Wrapped inside the compiled function, so jit's C++ path builds the PerReplica values.
        return jax.tree.unflatten(out_def, [
            PerReplica._from_blocks(x, n) if rank else PerReplica(x)
            for x, rank in zip(leaves, out_ranks)])

    batch = next((v for v in values if type(v) is Batch), None)
    with replica.enter(layout.context(per_replica=True)), explaining_batch_errors(batch):
        jax.eval_shape(mapped, *values)
    keeps_state = traced_returns_state[-1]
    # The per-replica state (the PerReplica leaves of the first argument) is donated when the
    # function hands back a new state in its place: its buffers hold the new state.
    value_kinds = [k for k in kinds if k != _STATIC]
    first_values = sum(1 for k in kinds[:num_first] if k != _STATIC)
    donate = tuple(i for i in range(first_values)
                   if value_kinds[i] in (_PER, _BLOCKS)) if keeps_state else ()
    compiled = jax.jit(program, donate_argnums=donate)
    if not out_statics:
        return compiled, keeps_state
    # The program returns the arrays; the output tree is rebuilt around them.
    out_def, statics_at = out_defs[0], dict(out_statics)

    def with_statics(*vals):
        return join_static(out_def, statics_at, compiled(*vals))

    with_statics.lower = compiled.lower
    return with_statics, keeps_state


# --- reading per-replica values --------------------------------------------------------------------

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


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reduce_stacked(op: str, axis: int | None, out_sharding: NamedSharding, values):
    def one(x):
        if axis is not None and not -(x.ndim - 1) <= axis < x.ndim - 1:
            raise ValueError(f"strategy.reduce(axis={axis}) is out of range for per-replica values "
                             f"of shape {x.shape[1:]}; use axis=None to reduce across replicas only")
        axes = (0,) if axis is None else (0, 1 + axis % (x.ndim - 1))
        total = jnp.sum(x, axis=axes)
        if op == "mean":
            total = total / np.prod([x.shape[a] for a in axes])
        return jax.lax.with_sharding_constraint(total, out_sharding)

    return jax.tree.map(one, [v.stacked for v in values])


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
