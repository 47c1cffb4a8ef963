"""The per-replica view: ``strategy.run`` (its results are read by ``jaxdist.core.reading``).

``run`` traces the user's function once per replica under ``jax.shard_map`` and returns the
function's own output structure with a ``PerReplica`` in place of each array, as tf.distribute does.
A ``PerReplica`` is a stack whose leading axis is sharded over the replicas, so feeding it back into
``run`` splits it with no copy at all: the state of a per-replica loop never leaves the devices, and
under several processes never crosses hosts.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.core import replica
from jaxdist.core._types import PyTree
from jaxdist.core.layout import Layout
from jaxdist.core.reading import _placed
from jaxdist.core.reading import gather as gather
from jaxdist.core.reading import local_results as local_results
from jaxdist.core.reading import reduce as reduce
from jaxdist.core.reading import to_mirrored as to_mirrored
from jaxdist.core.step import InFlight, _frozen, _has_shardings, returns_state
from jaxdist.core.values import (
    Batch,
    PerReplica,
    explaining_batch_errors,
    is_per_replica,
    join_static,
    split_leaves,
)

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
        self._recent: tuple = (None, None)  # (weakref to the function run last, its plan)

    def _entries(self, owner: Any) -> dict | None:
        try:
            return self._by_owner.setdefault(owner, {})
        except TypeError:  # unhashable (a mutable dataclass, say): keyed on identity instead
            pass
        key = id(owner)
        found = self._by_id.get(key)
        if found is None or found[0]() is not owner:
            try:
                ref = weakref.ref(owner, lambda _, key=key: self._by_id.pop(key, None))  # type: ignore[misc]
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
        ref, plan = self._recent
        if ref is not None and ref() is fn:  # a loop running the same function: no lookup
            return plan
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
            try:
                self._recent = (weakref.ref(fn), plan)
            except TypeError:  # a callable that cannot be weakly referenced: looked up each time
                self._recent = (None, None)


_PLAN = object()  # the key, beside a function's compiled entries, of its last call's plan
_UNSEEN = object()


class _Plan:
    """The previous call's argument structure, kinds and placements, and what it compiled to.

    A loop calls ``run(step, args=(state, batch))`` with the same structure every step; checking
    the new arguments against the previous call's (``flatten_up_to`` its treedef, then one type
    and sharding identity test per argument) costs a few microseconds, where classifying them
    afresh costs tens. Anything that does not match goes the full way, which raises the errors.
    """

    __slots__ = ("treedef", "kinds", "statics", "shardings", "entry", "n", "num_first",
                 "rest_def", "fed_back", "fed_values", "verified", "feedable", "batches",
                 "batch_shardings", "forget", "__weakref__")

    def __init__(self, treedef, kinds, statics, values, entry, n, num_first=0, rest_def=None):
        self.treedef, self.kinds, self.statics, self.entry, self.n = (
            treedef, kinds, statics, entry, n)
        vals = iter(values)
        self.shardings = [_UNSEEN if k is _STATIC or k is _SPLIT else _sharding(next(vals))
                          for k in kinds]
        # The state a loop feeds back (the previous call's new state, a frozen object such as a
        # flax TrainState, held weakly) stands for its first ``num_first`` arguments: the same
        # object has the same leaves, which this plan's program made, so they need no checks.
        self.num_first, self.rest_def = num_first, rest_def
        self.fed_back, self.fed_values, self.verified = None, (), None
        self.feedable = bool(rest_def is not None and num_first and all(
            k is _BLOCKS or k is _PER for k in kinds[:num_first]))
        self.batches = [i for i, v in enumerate(values) if type(v) is Batch]
        self.batch_shardings: dict[int, tuple] = {}  # a batch's leaves' shardings, by position
        self.forget = functools.partial(_forget, weakref.ref(self))

    def expect(self, state: Any, arrays: list) -> None:
        """Notes that the next call will likely pass ``state`` (this call's new state, whose
        ``PerReplica`` leaves hold ``arrays``) first."""
        self.fed_back = None
        if not self.feedable or not _frozen(type(state)):
            return
        if self.verified is None:  # every call of this plan's program returns the same form
            leaves = jax.tree.leaves(state, is_leaf=is_per_replica)
            self.verified = len(leaves) == self.num_first and all(
                type(x) is PerReplica and isinstance(x._value, jax.Array)
                and x._blocks == (self.n if k is _BLOCKS else 0)
                and x._value.sharding is self.shardings[i]
                for i, (x, k) in enumerate(zip(leaves, self.kinds)))
        if self.verified:
            # The arrays are the state's own, held only while the state lives.
            self.fed_back = weakref.ref(state, self.forget)
            self.fed_values = arrays

    def _fed_back(self, layout: Layout, args: tuple, kwargs: dict) -> list | None:
        if not args or self.fed_back() is not args[0]:
            return None
        try:
            rest = self.rest_def.flatten_up_to((args[1:], kwargs))
        except (ValueError, TypeError):
            return None
        tail = self._match_tops(layout, rest, self.num_first)
        if tail is None or not self.fed_values:
            return None
        return [*self.fed_values, *tail]

    def match(self, layout: Layout, args: tuple, kwargs: dict) -> list | None:
        """The placed argument values when the arguments match this plan, else None."""
        if self.fed_back is not None:
            values = self._fed_back(layout, args, kwargs)
            if values is not None:
                return values
        try:
            tops = self.treedef.flatten_up_to((args, kwargs))
        except (ValueError, TypeError):
            return None
        return self._match_tops(layout, tops, 0)

    def _match_tops(self, layout: Layout, tops: list, start: int) -> list | None:
        values, shardings = [], self.shardings
        statics = iter(self.statics)  # a fed-back state (start > 0) holds none
        for i, kind, top in zip(itertools.count(start), self.kinds[start:], tops):
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
                leaves = jax.tree.leaves(top)
                known = self.batch_shardings.get(i)
                if (known is not None and len(known) == len(leaves)
                        and _has_shardings(leaves, known)):
                    value = top  # laid out as the previous batch at this place was
                else:
                    value = layout.put_batch(top)
                    self.batch_shardings[i] = tuple(getattr(x, "sharding", None)
                                                    for x in jax.tree.leaves(value))
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


def _forget(plan_ref: weakref.ref, state_ref: weakref.ref) -> None:
    """The state a plan expected back died: drop its arrays (unless a newer state replaced it)."""
    plan = plan_ref()
    if plan is not None and plan.fed_back is state_ref:
        plan.fed_back, plan.fed_values = None, ()


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


def run(layout: Layout, cache: RunCache, fn: Callable, args: tuple, kwargs: dict) -> PyTree:
    """``strategy.run``: ``fn`` once per replica under ``jax.shard_map`` (``check_vma=False``).

    ``check_vma=False`` matters: with it on, JAX marks replicated parameters as varying inside the
    map and the transpose of that is a psum, so ``jax.grad`` would already return gradients summed
    over replicas and the user's ``all_reduce`` would double-count. Here gradients stay local.
    """
    if jax.sharding.get_abstract_mesh().empty:  # no mesh of the caller's to leave
        compiled, keeps_state, values, plan = _prepare(layout, cache, fn, args, kwargs)
        out, raw = compiled.call(*values)  # fn's structure of PerReplica values, its arrays
    else:
        with layout.mesh_context():  # inside a user's own jax.set_mesh, on the strategy's mesh
            compiled, keeps_state, values, plan = _prepare(layout, cache, fn, args, kwargs)
            out, raw = compiled.call(*values)
    if keeps_state:
        n_state = compiled.state_leaves
        if len(raw) > n_state:  # an output the next step does not consume: wait on it
            cache.in_flight.add_handle(raw[n_state], out[0], trains=True)
        else:
            cache.in_flight.add(out[1], out[0], trains=True)
        plan.expect(out[0], raw[:n_state])
    else:
        cache.in_flight.add(out, ())
    masks = [values[i].mask for i in plan.batches if values[i].mask is not None]
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
    compiled, _, values, _ = _prepare(layout, strategy._run_cache, fn, tuple(args), kwargs or {})
    return compiled.lower(*values)


def _prepare(layout: Layout, cache: RunCache, fn: Callable, args: tuple, kwargs: dict):
    """Places the arguments and finds (or compiles) the per-replica program for them."""
    args = tuple(args)
    plan = cache.last_plan(fn)
    if plan is not None:
        values = plan.match(layout, args, kwargs if type(kwargs) is dict else dict(kwargs))
        if values is not None:
            return (*plan.entry, values, plan)
    if not callable(fn):
        raise TypeError(f"strategy.run(fn, ...) expects a callable, got {type(fn).__name__}")
    tops, treedef = jax.tree.flatten((args, dict(kwargs)), is_leaf=_is_distributed)
    num_first = len(jax.tree.leaves(args[0], is_leaf=_is_distributed)) if args else 0
    kinds, values, statics = [], [], []  # type: ignore[var-annotated]
    for top in tops:
        kind, value = _classify(layout, top)
        kinds.append(kind)
        (statics if kind == _STATIC else values).append(value)
    key = (treedef, tuple(kinds), tuple(statics), num_first)
    entry = cache.lookup(fn, key, lambda get_fn: _compile(
        layout, get_fn, treedef, tuple(kinds), tuple(statics), num_first, values))
    rest_def = (jax.tree.structure((args[1:], dict(kwargs)), is_leaf=_is_distributed)
                if args else None)
    plan = _Plan(treedef, tuple(kinds), tuple(statics), values, entry, layout.num_replicas,
                 num_first, rest_def)
    cache.remember(fn, plan)
    return (*entry, values, plan)


def _compile(layout: Layout, get_fn: Callable[[], Callable], treedef, kinds: tuple[str, ...],
             statics: tuple, num_first: int, values: list) -> tuple[_Program, bool]:
    split = jax.P(layout.data_axes)
    n = layout.num_replicas
    ctx = layout.context(per_replica=True)
    out_ranks: list = []
    out_statics: dict = {}
    out_defs: list = []
    traced_returns_state, state_leaves = [], [0]

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
        # The context matters only while tracing (jaxdist.all_reduce reads it then), so it is
        # entered here rather than around every call of the compiled program.
        with replica.enter(ctx):
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
        out_defs[:] = [out_def]
        state_leaves[:] = [len(jax.tree.leaves(out[0])) if traced_returns_state[-1] else 0]
        # A value of rank >= 1 leaves as its replica's block of a concatenation (no reshape: see
        # PerReplica); only scalars gain the leading replica axis.
        return [x if x.ndim else x[None] for x in leaves]

    in_specs = tuple(jax.P() if k == _REP else split for k in kinds if k != _STATIC)
    mapped = jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=split,
                           check_vma=False)

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
    return _Program(jax.jit(mapped, donate_argnums=donate), n, out_defs, out_ranks, out_statics,
                    state_leaves), keeps_state


class _Program:
    """A compiled per-replica program: it returns its output arrays, and this builds ``fn``'s
    output structure around them, a ``PerReplica`` in place of each. The output's form is read
    from the latest trace (a new input shape retraces with the same structure)."""

    def __init__(self, jitted, n, out_defs, out_ranks, out_statics, state_leaves):
        self.jitted, self.n = jitted, n
        self._defs, self._ranks, self._statics, self._state = (out_defs, out_ranks, out_statics,
                                                                state_leaves)

    def __call__(self, *vals):
        return self.call(*vals)[0]

    @property
    def state_leaves(self) -> int:
        """How many of the output arrays belong to a returned new state (they come first)."""
        return self._state[0]

    def call(self, *vals) -> tuple[PyTree, list]:
        """The output tree, and its arrays in order."""
        raw = self.jitted(*vals)
        n = self.n
        wrapped = [PerReplica._from_blocks(x, n) if rank else PerReplica(x)
                   for x, rank in zip(raw, self._ranks)]
        if self._statics:
            return join_static(self._defs[0], self._statics, wrapped), raw
        return self._defs[0].unflatten(wrapped), raw

    def lower(self, *vals):
        return self.jitted.lower(*vals)
