"""Turning a user's global-view step into a compiled distributed step, with bounded run-ahead."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist.core import progress, replica
from jaxdist.core._types import PyTree
from jaxdist.core.values import (Batch, StaticKey, explaining_batch_errors, is_static_leaf, join_static,
                            split_leaves, split_static)

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
    """Bounds how many dispatched steps may still be running.

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

    def add(self, keep: PyTree, consumed: PyTree, *, trains: bool = False) -> None:
        """Records a dispatched step: ``keep`` survives the next step, ``consumed`` may not;
        ``trains``: a training step (it handed back a new state), reported as progress."""
        self._calls += 1
        # The first leaf that can be waited for (static leaves, an Equinox module's functions
        # say, cannot).
        handle = next((x for x in jax.tree.leaves(keep) if hasattr(x, "block_until_ready")),
                      None)
        if trains:
            progress.report(1, handle)
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
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(_same_leaf(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _same_leaf(x: Any, y: Any) -> bool:
    if is_static_leaf(x) or is_static_leaf(y):  # an Equinox module's function, say
        return StaticKey(x) == StaticKey(y)
    return np.shape(x) == np.shape(y) and jax.numpy.result_type(x) == jax.numpy.result_type(y)


def returns_state(state: PyTree, out: Any) -> bool:
    """True when ``out`` is ``(new_state, extras)`` with ``new_state`` laid out like ``state``."""
    return isinstance(out, tuple) and len(out) == 2 and _same_layout(state, out[0])


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
        self._compiled: dict[Any, tuple[Callable, bool]] = {}

    def __repr__(self) -> str:
        return f"DistributedStep({getattr(self._fn, '__qualname__', self._fn)!r}, {self.strategy!r})"

    def __call__(self, state: PyTree, batch: PyTree, /):
        # Called inside the user's own ``jax.set_mesh`` (Explicit axes, say): run on ours.
        with self.strategy.layout.mesh_context():
            return self._call(state, batch)

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
               mask_at: Any) -> tuple[Callable, bool]:
        """The compiled step for an all-array ``state`` (compiled on first use)."""
        key = (treedef, jax.tree.structure(batch), mask_at,
               _shape_key(self.strategy.layout, leaves))
        entry = self._compiled.get(key)
        if entry is None:
            entry = self._compiled[key] = self._build(state, batch)
        return entry

    def _call(self, state: PyTree, batch: PyTree, /):
        layout = self.strategy.layout
        state, batch, leaves, treedef, mask_at = self._placed(state, batch)
        if not all(isinstance(x, jax.Array) for x in leaves):  # placed: the rest are static
            return self._call_static(state, leaves, treedef, batch, mask_at)
        compiled, keeps_state = self._entry(state, batch, leaves, treedef, mask_at)
        with replica.enter(layout.context(per_replica=False)):
            out = compiled(state, batch)
        if keeps_state:
            self._in_flight.add(out[1], out[0], trains=True)
        else:
            self._in_flight.add(out, ())
        return out

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
        fn = layout.adapt_step(self._fn)
        with replica.enter(layout.context(per_replica=False)), explaining_batch_errors(batch):
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

    def _build_static(self, treedef, statics, arrays, batch, array_sh):
        layout = self.strategy.layout
        fn = layout.adapt_step(self._fn)
        found: dict[str, Any] = {}

        def flat_fn(arrays_in, batch_in):
            state_in = join_static(treedef, statics, arrays_in)
            out = fn(state_in, batch_in)
            out_arrays, out_def, out_statics = split_static(out)
            keeps = returns_state(state_in, out)
            found.update(out_def=out_def, keeps=keeps, statics=out_statics,
                         n_state=len(split_static(out[0])[0]) if keeps else 0)
            return out_arrays

        with replica.enter(layout.context(per_replica=False)), explaining_batch_errors(batch):
            jax.eval_shape(flat_fn, arrays, batch)
        keeps, n_state, out_def, out_statics = (found["keeps"], found["n_state"],
                                                found["out_def"], found["statics"])
        n_out = out_def.num_leaves - len(out_statics)
        out_sh = (array_sh if keeps else []) + [layout.replicated] * (n_out - n_state)
        donates = self._donate and keeps
        compiled = jax.jit(flat_fn, in_shardings=(array_sh, layout.batch_shardings(batch)),
                           out_shardings=out_sh, donate_argnums=(0,) if donates else ())

        return compiled, keeps, n_state, functools.partial(join_static, out_def, out_statics)
