"""Turning a user's global-view step into a compiled distributed step, with bounded run-ahead.

A step is one compiled call per batch, or (``DistributedStep.steps``, what ``fit``'s
``steps_per_execution`` runs) one compiled call for several batches stacked on a new leading axis:
a loop on the device runs the user's step once per batch, so the host dispatches once for all.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jaxdist.core import progress, replica
from jaxdist.core._types import PyTree
from jaxdist.core.values import (
    Batch,
    StaticKey,
    explaining_batch_errors,
    is_static_leaf,
    join_static,
    split_leaves,
    split_static,
)

MAX_IN_FLIGHT = 32
"""The most steps a loop may keep queued: on XLA:CPU with several devices, ~100 queued steps with
collectives deadlock XLA's rendezvous and abort the process; syncing every <= 32 steps avoids it."""


def check_max_in_flight(max_in_flight: int) -> int:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, (int, np.integer)) or not (
            1 <= max_in_flight <= MAX_IN_FLIGHT):
        raise ValueError(f"max_in_flight={max_in_flight!r} must be an int in [1, {MAX_IN_FLIGHT}]: "
                         "more queued steps deadlock XLA:CPU's collectives")
    return int(max_in_flight)


class InFlight:
    """Bounds how many dispatched steps (compiled calls) may still be running.

    A call of ``DistributedStep.steps`` counts once, whatever the number of steps it runs: the
    deadlock this guards against comes from queued *executions*, each of which needs every device's
    thread to join XLA:CPU's rendezvous at once; the steps inside one execution run one after the
    other in that execution and join it one at a time.

    JAX dispatches asynchronously, so a plain ``for`` loop over a compiled step queues steps as fast
    as Python can issue them. After each step this keeps a handle on one of its outputs that the
    next step will not consume; once more than ``max_in_flight`` steps are pending it waits for the
    one half a window back (so at most ``max_in_flight`` steps are ever queued behind the newest,
    and Python wakes once per half window rather than once per step). All outputs
    of one execution become ready together, so one leaf stands for the whole step. A step whose
    outputs are all donated to the next one leaves no such handle: then every ``max_in_flight``-th
    step is waited for before its outputs are handed back.
    """

    def __init__(self, max_in_flight: int):
        self.max_in_flight = check_max_in_flight(max_in_flight)
        self._pending: collections.deque = collections.deque()
        self._calls = 0

    def add(self, keep: PyTree, consumed: PyTree, *, trains: bool = False, steps: int = 1) -> None:
        """Records a dispatched call: ``keep`` survives the next call, ``consumed`` may not;
        ``trains``: a training call (it handed back a new state) of ``steps`` steps, reported as
        progress."""
        leaves = jax.tree.leaves(keep)
        # The first leaf that can be waited for (static leaves, an Equinox module's functions
        # say, cannot); usually the very first.
        if leaves and hasattr(leaves[0], "block_until_ready"):
            self.add_handle(leaves[0], consumed, trains=trains, steps=steps)
        else:
            self.add_handle(next((x for x in leaves if hasattr(x, "block_until_ready")), None),
                            consumed, trains=trains, steps=steps)

    def add_handle(self, handle: Any, consumed: PyTree, *, trains: bool = False,
                   steps: int = 1) -> None:
        """``add`` given the leaf of ``keep`` to wait for (None: it has none)."""
        self._calls += 1
        if trains:
            progress.report(steps, handle)
        if handle is None:
            if self._calls % self.max_in_flight == 0:
                jax.block_until_ready(consumed)
            return
        self._pending.append(handle)
        if len(self._pending) > self.max_in_flight:
            # Wait for the step half the window back, not the oldest: one wake-up per half window
            # instead of one per step (each wake-up takes a core from the devices' threads on a
            # small CPU host), and between max_in_flight / 2 and max_in_flight steps stay queued.
            keep = max(1, self.max_in_flight // 2)
            while len(self._pending) > keep + 1:
                self._pending.popleft()
            old = self._pending.popleft()
            if not old.is_deleted():  # a caller may have donated it to a step of its own
                old.block_until_ready()


def _shape_key(layout: Any, leaves: list) -> tuple | None:
    """Part of a compiled step's cache key: where a state leaf lives may depend on its shape and
    dtype (``zero_stage``'s rule, CentralStorage's divisibility), and a compiled step's shardings
    were fixed for the first state it saw; with the default (replicated) placement it does not."""
    if layout.state_sharding is None and layout.state_tree_sharding is None:
        return None
    return tuple((x.shape, x.dtype) for x in leaves)


def _same_layout(a: PyTree, b: PyTree) -> bool:
    """True when ``b`` could be stored in ``a``'s buffers (same structure, shapes and dtypes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):  # type: ignore[operator]
        return False
    return all(_same_leaf(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _same_leaf(x: Any, y: Any) -> bool:
    if is_static_leaf(x) or is_static_leaf(y):  # an Equinox module's function, say
        return StaticKey(x) == StaticKey(y)
    return np.shape(x) == np.shape(y) and jax.numpy.result_type(x) == jax.numpy.result_type(y)


def returns_state(state: PyTree, out: Any) -> bool:
    """True when ``out`` is ``(new_state, extras)`` with ``new_state`` laid out like ``state``."""
    return isinstance(out, tuple) and len(out) == 2 and _same_layout(state, out[0])


def _traced_in(ctx: Any, fn: Callable) -> Callable:
    """``fn`` entering the replica context whenever it is traced. The context only matters while
    tracing (``jaxdist.all_reduce`` reads it then), so a call of the compiled step needs none."""
    @functools.wraps(fn)
    def traced(*args):
        with replica.enter(ctx):
            return fn(*args)

    return traced


def stacked_sharding(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` with a new unsplit leading axis: where a stack of batches (or masks) lives."""
    return NamedSharding(sharding.mesh, jax.P(None, *sharding.spec),
                         memory_kind=sharding.memory_kind)


def _loop(fn: Callable, keeps_state: bool, extras: PyTree) -> Callable:
    """``fn(state, batch)`` run over the leading axis of stacked batches in one program.

    ``count`` (traced) batches are run, at most the stack's length: a stack padded to its usual
    length for a shorter group (an epoch's tail) runs only its real batches, so padding never
    touches the state (no optimizer step is counted for it). The extras (metrics) of step ``i``
    are row ``i`` of the stacked extras; rows past ``count`` are zeros.
    """
    def program(state, batches, count):
        length = jax.tree.leaves(batches)[0].shape[0]
        rows = jax.tree.map(lambda s: jnp.zeros((length,) + tuple(s.shape), s.dtype), extras)

        def one(i, carry):
            current, rows = carry
            batch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False),
                                 batches)
            out = fn(current, batch)
            new, extra = out if keeps_state else (current, out)
            rows = jax.tree.map(lambda r, v: lax.dynamic_update_index_in_dim(r, v, i, 0),
                                rows, extra)
            return new, rows

        if keeps_state:
            return lax.fori_loop(0, count, one, (state, rows))
        # An evaluation: the state is read, not carried (a carry would copy it every call).
        return lax.fori_loop(0, count, lambda i, r: one(i, (state, r))[1], rows)

    return program


class _Plan:
    """What the previous call found, so that a loop's next call can skip placing and keying: the
    state it expects (the previous output, held weakly: as one frozen object, or leaf by leaf),
    the batch's structure and shardings."""

    __slots__ = ("whole", "treedef", "refs", "batch_def", "batch_shardings", "compiled",
                 "keeps_state")

    def __init__(self, batch_def: Any, batch_shardings: tuple, compiled: Callable,
                 keeps_state: bool):
        self.whole: Any = None  # a weakref to a frozen state object (a flax TrainState)
        self.treedef: Any = None
        self.refs: tuple = ()  # ... or to each leaf of another state
        self.batch_def, self.batch_shardings = batch_def, batch_shardings
        self.compiled, self.keeps_state = compiled, keeps_state


_FROZEN: dict[type, bool] = {}


def _frozen(kind: type) -> bool:
    """Instances of ``kind`` cannot change their leaves (a frozen dataclass: flax's TrainState, an
    Equinox module), so one identity test stands for the whole state."""
    found = _FROZEN.get(kind)
    if found is None:
        params = getattr(kind, "__dataclass_params__", None)
        found = _FROZEN[kind] = bool(params is not None and params.frozen
                                     and hasattr(kind, "__weakref__"))
    return found


def _expects(plan: _Plan, state: PyTree) -> bool:
    """``state`` is the one the previous call returned (placed, the same structure)."""
    if plan.whole is not None:
        return plan.whole() is state
    leaves, treedef = jax.tree.flatten(state)
    if treedef != plan.treedef:
        return False
    for ref, x in zip(plan.refs, leaves):
        if ref() is not x:
            return False
    return True


def _has_shardings(leaves: list, shardings: tuple) -> bool:
    """Whether each leaf has, by identity, the sharding recorded for it (a steady-state check)."""
    for x, s in zip(leaves, shardings):
        if getattr(x, "sharding", None) is not s:
            return False
    return True


class DistributedStep:
    """A user's global-view ``fn(state, batch)`` compiled for a strategy.

    The state is placed the strategy's way (replicated for mirrored strategies) and donated, the
    batch is sharded on the strategy's batch axes, and XLA's partitioner inserts the cross-replica
    reductions, so a mean over the batch is a mean over the *global* batch whatever the device count.
    One compilation per input structure and shape.

    Donation is skipped automatically when ``fn`` does not return ``(new_state, ...)`` with the
    state's layout (an eval step returning only metrics must not consume the state it was given).
    At most ``max_in_flight`` calls are left running: a plain ``for`` loop over the step never
    queues enough work to deadlock XLA's collectives.

    Attributes:
      strategy: the strategy the step runs under.
    """

    def __init__(self, fn: Callable, strategy: Any, /, *, donate: bool = True,
                 max_in_flight: int = 8):
        if not callable(fn):
            raise TypeError(f"expected a step function fn(state, batch), got {type(fn).__name__}")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.strategy = strategy
        self._donate = donate
        self._in_flight = InFlight(max_in_flight)
        self._compiled: dict[Any, tuple] = {}  # (compiled, keeps_state, ...): per entry point
        self._plan: _Plan | None = None
        self._counts: dict[int, jax.Array] = {}  # steps() counts, placed once each

    def __repr__(self) -> str:
        return f"DistributedStep({getattr(self._fn, '__qualname__', self._fn)!r}, {self.strategy!r})"

    def __call__(self, state: PyTree, batch: PyTree, /):
        layout = self.strategy.layout
        plan = self._plan
        if plan is not None and _expects(plan, state):
            # The steady state of a loop: the state is what the previous call returned and the
            # batch is laid out as the previous one was, so nothing needs placing or keying.
            batch_leaves, batch_def = jax.tree.flatten(batch)
            if batch_def == plan.batch_def and _has_shardings(batch_leaves, plan.batch_shardings):
                if jax.sharding.get_abstract_mesh().empty:  # no mesh of the caller's to leave
                    out = plan.compiled(state, batch)
                else:
                    with layout.mesh_context():
                        out = plan.compiled(state, batch)
                return self._finish(out, plan, state)
        # Called inside the user's own ``jax.set_mesh`` (Explicit axes, say): run on ours.
        with layout.mesh_context():
            return self._call(state, batch)

    def _finish(self, out: Any, plan: _Plan, state: PyTree):
        """Bounds the run-ahead and remembers what the next call of a loop will pass."""
        if plan.keeps_state:
            expected, metrics = out
            leaves = jax.tree.leaves(metrics)
            if leaves and hasattr(leaves[0], "block_until_ready"):
                self._in_flight.add_handle(leaves[0], expected, trains=True)
            else:
                self._in_flight.add(metrics, expected, trains=True)
        else:
            self._in_flight.add(out, ())
            expected = state
        if _frozen(type(expected)):
            plan.whole = weakref.ref(expected)
        else:
            leaves, plan.treedef = jax.tree.flatten(expected)
            plan.whole, plan.refs = None, tuple(weakref.ref(x) for x in leaves)
        self._plan = plan
        return out

    def _placed(self, state: PyTree, batch: PyTree):
        """State and batch placed the strategy's way, the state's leaves and treedef, and where
        the batch's mask lives: what a call and ``lower`` both start from."""
        layout = self.strategy.layout
        state = self.strategy.put(state)
        batch = layout.put_batch(batch)  # a Batch or a raw pytree: every leaf on the batch axis
        mask_at = layout.mask_sharding(batch.mask) if isinstance(batch, Batch) else None
        leaves, treedef = jax.tree.flatten(state)
        return state, batch, leaves, treedef, mask_at

    def _entry(self, state: PyTree, batch: PyTree, leaves: list, treedef: Any,
               mask_at: Any) -> tuple[Any, bool]:
        """The compiled step for an all-array ``state`` (compiled on first use)."""
        key = (treedef, jax.tree.structure(batch), mask_at,
               _shape_key(self.strategy.layout, leaves))
        entry = self._compiled.get(key)
        if entry is None:
            entry = self._compiled[key] = self._build(state, batch)
        return entry

    def _call(self, state: PyTree, batch: PyTree, /):
        self._plan = None
        given_def = jax.tree.structure(batch)
        state, batch, leaves, treedef, mask_at = self._placed(state, batch)
        if not all(isinstance(x, jax.Array) for x in leaves):  # placed: the rest are static
            return self._call_static(state, leaves, treedef, batch, mask_at)
        compiled, keeps_state = self._entry(state, batch, leaves, treedef, mask_at)
        out = compiled(state, batch)
        shardings = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(batch))
        return self._finish(out, _Plan(given_def, shardings, compiled, keeps_state), state)

    # --- several steps per call (fit's steps_per_execution) ------------------------------------
    def steps(self, state: PyTree, batches: PyTree, count: int, /):
        """Runs ``count`` steps in one compiled call, on the batches stacked along a new axis.

        Step ``i`` gets ``batches``' entry ``i`` (every leaf, and a ``Batch``'s mask, indexed on its
        leading axis); only the first ``count`` entries are run, so a stack padded to its usual
        length for a shorter group runs only the real batches and compiles nothing new. The
        numbers are those of ``count`` calls of the step one batch at a time, to float rounding.

        Args:
          state: as for a call; donated.
          batches: a ``Batch`` (or raw pytree) whose leaves are batches stacked on axis 0, as
            ``dataset.iterator(group_size=K)`` makes them (``Group.batches``, placed
            ``P(None, data)``).
          count: steps to run, ``1 <= count <= `` the stack's length.

        Returns:
          ``(new_state, extras)`` (or ``extras`` for a step that returns no state) with every
          leaf of ``extras`` stacked: entry ``i`` is step ``i``'s, entries from ``count`` on zeros.

        Raises:
          ValueError: ``count`` out of range.
        """
        length = jax.tree.leaves(batches)[0].shape[0]
        if not 1 <= count <= length:
            raise ValueError(f"steps(count={count}) must run between 1 and the {length} stacked "
                             "batches")
        with self.strategy.layout.mesh_context():
            return self._call_steps(state, batches, np.int32(count))

    def _placed_count(self, count: np.int32) -> jax.Array:
        """``count`` on the devices, placed once: a loop of ``steps`` calls sends nothing for it."""
        placed = self._counts.get(int(count))
        if placed is None:
            on, value = self.strategy.layout.replicated, np.asarray(count, np.int32)
            placed = self._counts[int(count)] = (
                jax.device_put(value, on) if jax.process_count() == 1
                else jax.make_array_from_process_local_data(on, value, value.shape))
        return placed

    def _placed_stack(self, batches: PyTree) -> tuple[PyTree, Any]:
        layout = self.strategy.layout
        on = stacked_sharding(layout.batch)
        if isinstance(batches, Batch):
            mask = batches.mask
            mask_at = layout.mask_sharding(mask) if mask is not None else None
            # A stack of replicated masks is itself replicated; keep it so.
            mask_on = layout.replicated if mask_at is layout.replicated else on
            data = _place_each(batches.data, on)
            mask = None if mask is None else _place_each(mask, mask_on)
            return Batch(data, mask), mask_at
        return _place_each(batches, on), None

    def _call_steps(self, state: PyTree, batches: PyTree, count: np.int32):
        self._plan = None
        layout = self.strategy.layout
        state = self.strategy.put(state)
        batches, mask_at = self._placed_stack(batches)
        leaves, treedef = jax.tree.flatten(state)
        if not all(isinstance(x, jax.Array) for x in leaves):
            return self._call_static_steps(state, leaves, treedef, batches, mask_at, count)
        key = ("steps", treedef, jax.tree.structure(batches), mask_at,
               _shape_key(layout, leaves))
        entry = self._compiled.get(key)
        if entry is None:
            entry = self._compiled[key] = self._build_steps(state, batches)
        compiled, keeps_state = entry
        out = compiled(state, batches, self._placed_count(count))
        if keeps_state:
            self._in_flight.add(out[1], out[0], trains=True, steps=int(count))
        else:
            self._in_flight.add(out, ())
        return out

    def _one_of(self, batches: PyTree) -> PyTree:
        """An abstract single batch of a stack (what the user's step is traced on)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batches)

    def _build_steps(self, state: PyTree, batches: PyTree) -> tuple[Callable, bool]:
        layout = self.strategy.layout
        ctx = layout.context(per_replica=False)
        fn = _traced_in(ctx, layout.adapt_step(self._fn))
        one = self._one_of(batches)
        with explaining_batch_errors(batches):
            out = jax.eval_shape(fn, state, one)
        keeps_state = returns_state(state, out)
        state_sh = layout.state_shardings(state)
        stacked_sh = jax.tree.map(lambda x: x.sharding, batches)
        extras = out[1] if keeps_state else out
        extras_sh = jax.tree.map(lambda _: layout.replicated, extras)
        out_sh = (state_sh, extras_sh) if keeps_state else extras_sh
        donates = self._donate and keeps_state
        return jax.jit(_loop(fn, keeps_state, extras),
                       in_shardings=(state_sh, stacked_sh, layout.replicated),
                       out_shardings=out_sh, donate_argnums=(0,) if donates else ()), keeps_state

    def lower(self, state: PyTree, batch: PyTree, /) -> jax.stages.Lowered:
        """The step lowered for ``state`` and ``batch`` as a call would compile it.

        ``.compile().as_text()`` shows the collectives XLA inserted (``all-reduce``,
        ``reduce-scatter``, ``all-gather``); ``.compile().memory_analysis()`` its temporary memory.
        The step's own cache is used, so lowering does not add a compilation to later calls.

        Args:
          state, batch: as for a call (placed the same way first).

        Returns:
          A ``jax.stages.Lowered``.
        """
        state, batch, leaves, treedef, mask_at = self._placed(state, batch)
        if not all(isinstance(x, jax.Array) for x in leaves):
            raise NotImplementedError(
                "DistributedStep.lower: this state holds static (non-array) leaves; lower a "
                "state of its array leaves only (eqx.partition / nnx.split), which compiles the "
                "same collectives")
        with replica.enter(self.strategy.layout.context(per_replica=False)):
            return self._entry(state, batch, leaves, treedef, mask_at)[0].lower(state, batch)

    def _build(self, state: PyTree, batch: PyTree) -> tuple[Callable, bool]:
        layout = self.strategy.layout
        state_sh = layout.state_shardings(state)
        batch_sh = layout.batch_shardings(batch)
        fn = _traced_in(layout.context(per_replica=False), layout.adapt_step(self._fn))
        with explaining_batch_errors(batch):
            out = jax.eval_shape(fn, state, batch)
        keeps_state = returns_state(state, out)
        if keeps_state:
            out_sh = (state_sh, jax.tree.map(lambda _: layout.replicated, out[1]))
        else:
            out_sh = jax.tree.map(lambda _: layout.replicated, out)
        donates = self._donate and keeps_state
        return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=out_sh,
                       donate_argnums=(0,) if donates else ()), keeps_state

    # --- states with static leaves (Equinox modules, NNX graphs, functions) ------------------------
    def _call_static(self, state: PyTree, leaves: list, treedef: Any, batch: PyTree, mask_at: Any):
        """Runs a step on a state holding static leaves: only its arrays enter the compiled step
        (as ``eqx.filter_jit`` does); static leaves are compiled in, and the step's outputs get
        their static leaves back from the trace."""
        layout = self.strategy.layout
        arrays, statics = split_leaves(leaves)  # placed: every other leaf is a jax.Array
        key = ("static", treedef, tuple(statics), tuple(StaticKey(v) for v in statics.values()),
               jax.tree.structure(batch), mask_at, _shape_key(layout, arrays))
        entry = self._compiled.get(key)
        if entry is None:
            targets = layout.leaf_targets(leaves, treedef, state)
            array_sh = [t for i, t in enumerate(targets) if i not in statics]
            entry = self._compiled[key] = self._build_static(treedef, statics, arrays, batch,
                                                             array_sh)
        compiled, keeps_state, n_state, rebuild = entry
        with replica.enter(layout.context(per_replica=False)):
            flat = compiled(arrays, batch)
        if keeps_state:
            self._in_flight.add(flat[n_state:], flat[:n_state], trains=True)
        else:
            self._in_flight.add(flat, ())
        return rebuild(flat)

    def _trace_static(self, treedef, statics, arrays, batch):
        """The step as a function of the state's arrays, traced once on ``batch``: it, whether it
        returns a state, the state's array count, and the output's treedef and static leaves."""
        fn = self.strategy.layout.adapt_step(self._fn)
        found: dict[str, Any] = {}

        def flat_fn(arrays_in, batch_in):
            state_in = join_static(treedef, statics, arrays_in)
            out = fn(state_in, batch_in)
            out_arrays, out_def, out_statics = split_static(out)
            keeps = returns_state(state_in, out)
            found.update(out_def=out_def, keeps=keeps, statics=out_statics,
                         n_state=len(split_static(out[0])[0]) if keeps else 0)
            return out_arrays

        with (replica.enter(self.strategy.layout.context(per_replica=False)),
              explaining_batch_errors(batch)):
            shapes = jax.eval_shape(flat_fn, arrays, batch)
        return (flat_fn, found["keeps"], found["n_state"], found["out_def"], found["statics"],
                shapes)

    def _build_static(self, treedef, statics, arrays, batch, array_sh):
        layout = self.strategy.layout
        flat_fn, keeps, n_state, out_def, out_statics, _ = self._trace_static(
            treedef, statics, arrays, batch)
        n_out = out_def.num_leaves - len(out_statics)
        out_sh = (array_sh if keeps else []) + [layout.replicated] * (n_out - n_state)
        donates = self._donate and keeps
        compiled = jax.jit(flat_fn, in_shardings=(array_sh, layout.batch_shardings(batch)),
                           out_shardings=out_sh, donate_argnums=(0,) if donates else ())

        return compiled, keeps, n_state, functools.partial(join_static, out_def, out_statics)

    def _call_static_steps(self, state: PyTree, leaves: list, treedef: Any, batches: PyTree,
                           mask_at: Any, count: np.int32):
        """``steps`` for a state holding static leaves: the loop runs over its arrays only."""
        layout = self.strategy.layout
        arrays, statics = split_leaves(leaves)
        key = ("static steps", treedef, tuple(statics),
               tuple(StaticKey(v) for v in statics.values()), jax.tree.structure(batches),
               mask_at, _shape_key(layout, arrays))
        entry = self._compiled.get(key)
        if entry is None:
            targets = layout.leaf_targets(leaves, treedef, state)
            array_sh = [t for i, t in enumerate(targets) if i not in statics]
            flat_fn, keeps, n_state, out_def, out_statics, shapes = self._trace_static(
                treedef, statics, arrays, self._one_of(batches))
            extras = shapes[n_state:]
            if keeps:
                def pair(arrays_in, batch_in):
                    out = flat_fn(arrays_in, batch_in)
                    return out[:n_state], out[n_state:]
            else:
                pair = flat_fn
            ctx = layout.context(per_replica=False)
            out_sh = ((array_sh, [layout.replicated] * len(extras)) if keeps
                      else [layout.replicated] * len(extras))
            compiled = jax.jit(_loop(_traced_in(ctx, pair), keeps, extras),
                               in_shardings=(array_sh, jax.tree.map(lambda x: x.sharding, batches),
                                             layout.replicated),
                               out_shardings=out_sh,
                               donate_argnums=(0,) if self._donate and keeps else ())
            entry = self._compiled[key] = (compiled, keeps, functools.partial(
                join_static, out_def, out_statics))
        compiled, keeps, rebuild = entry
        out = compiled(arrays, batches, self._placed_count(count))
        if keeps:
            new, extras = out
            self._in_flight.add(extras, new, trains=True, steps=int(count))
            return rebuild([*new, *extras])
        self._in_flight.add(out, ())
        return rebuild(out)


def _place_each(tree: PyTree, sharding: NamedSharding) -> PyTree:
    """Every leaf on ``sharding`` (kept when already there: what ``next_group`` made)."""
    def put(x):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)
