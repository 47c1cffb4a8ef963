"""Mixed precision: a dtype policy and dynamic loss scaling, carried by the train state.

Keras's ``"mixed_bfloat16"`` / ``"mixed_float16"``: parameters stay float32, the forward and backward
pass run in 16 bits, outputs and the loss are float32. With float16 the loss is multiplied by a
*loss scale* before differentiating (small gradients would otherwise flush to zero) and the
gradients divided by it after; a step whose gradients are not finite is skipped and the scale
halved, and after ``period`` finite steps in a row the scale doubles (Keras's
``LossScaleOptimizer``, ``tf.keras.mixed_precision``).

Everything lives in the state (:class:`TrainState`), so one step function works under
``@jaxdist.mirrored``, ``strategy.run``, ``jaxdist.fit`` and the CLI. The skip decision is taken on
the gradients ``apply_gradients`` receives: in the global view these are the global gradients; in
the per-replica view they are what the user all-reduced, and the finite flag is additionally
AND-ed across replicas, so every replica (and host) takes the same decision by construction.

Why not a library: DeepMind's ``jmp`` does this arithmetic and still imports and runs on jax 0.10.2
(checked), but its last release (0.0.4) is from January 2023; flax's ``DynamicScale`` is maintained
but computes the gradients itself with a ``pmap``-style ``axis_name``, so it cannot take its decision
after jaxdist's own all-reduce. The ~100 lines here follow jmp's and Keras's semantics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

from jaxdist.core import PyTree, replica

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are kept in, computed in, and returned in.

    Attributes:
      param_dtype, compute_dtype, output_dtype: dtype names (``"float32"``, ``"bfloat16"``,
        ``"float16"``).

    >>> p = Policy.named("mixed_bfloat16")
    >>> p.compute_dtype, p.cast_to_compute(jnp.ones(2)).dtype.name, p.needs_loss_scaling
    ('bfloat16', 'bfloat16', False)
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    output_dtype: str = "float32"

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(f"Policy({field}={getattr(self, field)!r}) is not a supported "
                                 f"dtype; expected one of {sorted(_DTYPES)}")

    @classmethod
    def named(cls, name: "str | Policy") -> "Policy":
        """``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"`` (Keras's names), or ``"bfloat16"``.

        Raises:
          ValueError: an unknown name (the message lists the known ones).
        """
        if isinstance(name, Policy):
            return name
        if name in ("float32", "bfloat16", "float16"):
            return cls(name, name, name)
        if name in ("mixed_bfloat16", "mixed_float16"):
            return cls("float32", name.removeprefix("mixed_"), "float32")
        raise ValueError(f"unknown precision policy {name!r}; expected 'float32', 'mixed_bfloat16' "
                         "or 'mixed_float16'")

    @property
    def name(self) -> str:
        if self.param_dtype == self.compute_dtype == self.output_dtype:
            return self.param_dtype
        return f"mixed_{self.compute_dtype}"

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the computation runs in float16 (bfloat16 has float32's exponent range)."""
        return self.compute_dtype == "float16"

    def _cast(self, tree: PyTree, dtype: str) -> PyTree:
        target = _DTYPES[dtype]
        return jax.tree.map(
            lambda x: x.astype(target) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
            tree)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating leaves to the compute dtype (integers, labels say, are left alone)."""
        return self._cast(tree, self.compute_dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        return self._cast(tree, self.param_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        return self._cast(tree, self.output_dtype)


class DynamicLossScale(struct.PyTreeNode):
    """A loss scale that halves on non-finite gradients and doubles after ``period`` finite steps.

    Defaults are Keras's ``LossScaleOptimizer`` (initial 2**15, growth every 2000 steps).

    >>> s = DynamicLossScale.create(initial=8.0, period=2)
    >>> float(s.adjust(jnp.array(False)).scale), float(s.adjust(True).adjust(True).scale)
    (4.0, 16.0)
    """

    scale: jax.Array
    counter: jax.Array
    period: int = struct.field(pytree_node=False, default=2000)
    factor: float = struct.field(pytree_node=False, default=2.0)
    min_scale: float = struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, initial: float = 2.0**15, *, period: int = 2000, factor: float = 2.0,
               min_scale: float = 1.0) -> "DynamicLossScale":
        if initial < min_scale or period < 1 or factor <= 1:
            raise ValueError(f"DynamicLossScale(initial={initial}, period={period}, factor={factor}) "
                             f"needs initial >= min_scale ({min_scale}), period >= 1, factor > 1")
        return cls(jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32), period, factor,
                   min_scale)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss.astype(jnp.float32) * self.scale

    def unscale(self, grads: PyTree) -> PyTree:
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / self.scale).astype(g.dtype), grads)

    def adjust(self, finite: jax.Array) -> "DynamicLossScale":
        """The scale after a step whose gradients were (not) all finite."""
        grow = jnp.logical_and(finite, self.counter + 1 >= self.period)
        scale = jnp.where(finite, jnp.where(grow, self.scale * self.factor, self.scale),
                          jnp.maximum(self.scale / self.factor, self.min_scale))
        counter = jnp.where(jnp.logical_and(finite, jnp.logical_not(grow)), self.counter + 1, 0)
        return self.replace(scale=scale, counter=counter.astype(jnp.int32))


def all_finite(tree: PyTree) -> jax.Array:
    """True when every element of every floating leaf is finite.

    Inside ``strategy.run`` the flag is AND-ed over the replicas, so all of them agree.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
    ctx = replica.current()
    if ctx is not None and ctx.per_replica and ctx.axes:
        finite = jax.lax.pmin(finite.astype(jnp.int32), ctx.axes) > 0
    return finite


class TrainState(train_state.TrainState):
    """flax's ``TrainState`` with a precision ``policy`` and, for float16, a dynamic loss scale.

    ``apply_gradients`` skips the update (parameters, optimizer state and ``step`` unchanged, as
    TF's loss-scale optimizer) when the gradients are not finite, and adjusts the scale.

    >>> import optax, jax.numpy as jnp
    >>> s = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
    ...                       policy="mixed_float16")
    >>> s = s.apply_gradients(grads={"w": jnp.array([1.0, jnp.inf])})
    >>> s.params["w"].tolist(), float(s.loss_scale.scale), int(s.skipped)
    ([1.0, 1.0], 16384.0, 1)
    """

    policy: Policy = struct.field(pytree_node=False, default=Policy())
    loss_scale: DynamicLossScale | None = None
    skipped: jax.Array | int = 0

    @classmethod
    def create(cls, *, apply_fn, params, tx, policy: "str | Policy" = "float32",
               loss_scale: DynamicLossScale | None = None, **kwargs) -> "TrainState":
        """A state for ``policy``; float16 computation gets ``DynamicLossScale.create()`` by default.

        Raises:
          ValueError: an unknown policy name.
        """
        policy = Policy.named(policy)
        if loss_scale is None and policy.needs_loss_scaling:
            loss_scale = DynamicLossScale.create()
        params = policy.cast_to_param(params)
        return super().create(apply_fn=apply_fn, params=params, tx=tx, policy=policy,
                              loss_scale=loss_scale, skipped=jnp.zeros((), jnp.int32), **kwargs)

    def apply_gradients(self, *, grads, **kwargs) -> "TrainState":
        if self.loss_scale is None:
            return super().apply_gradients(grads=grads, **kwargs)
        finite = all_finite(grads)

        # lax.cond rather than computing the update and selecting: on a skipped step only the
        # untouched state is kept, and on a taken step no second copy of the parameters and
        # optimizer state is live. The predicate is the same on every replica (see all_finite).
        def take(grads):
            new = super(TrainState, self).apply_gradients(grads=grads, **kwargs)
            return new.step, new.params, new.opt_state

        def skip(grads):
            return self.step, self.params, self.opt_state

        step, params, opt_state = jax.lax.cond(finite, take, skip, grads)
        return self.replace(step=step, params=params, opt_state=opt_state,
                            loss_scale=self.loss_scale.adjust(finite),
                            skipped=self.skipped + jnp.logical_not(finite).astype(jnp.int32))


def value_and_grad(loss_fn: Callable, state: Any, *, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad(loss_fn)`` under ``state``'s precision policy.

    The returned function takes the float32 parameters (and any further arguments), hands
    ``loss_fn`` the parameters cast to the compute dtype, scales the loss by the state's loss scale
    (float16), and returns the float32 loss and float32, unscaled gradients. With a state that has
    no policy (a plain flax ``TrainState``) it is exactly ``jax.value_and_grad``.

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      state: the train state (a :class:`TrainState`, or anything else for plain float32).
      has_aux: as ``jax.value_and_grad``.

    Returns:
      ``fn(params, *args) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``).

    >>> import optax
    >>> s = TrainState.create(apply_fn=None, params=jnp.ones(3), tx=optax.sgd(1.0),
    ...                       policy="mixed_float16")
    >>> loss, g = value_and_grad(lambda p: jnp.mean(p * p), s)(s.params)
    >>> float(loss), g.dtype.name, [round(v, 3) for v in g.tolist()]
    (1.0, 'float32', [0.667, 0.667, 0.667])
    """
    policy: Policy | None = getattr(state, "policy", None)
    if policy is None or policy == Policy():
        return jax.value_and_grad(loss_fn, has_aux=has_aux)
    scale = getattr(state, "loss_scale", None)

    def scaled(params, *args):
        out = loss_fn(policy.cast_to_compute(params), *args)
        loss, aux = out if has_aux else (out, None)
        loss = loss.astype(jnp.float32)
        return (loss if scale is None else scale.scale_loss(loss)), (loss, aux)

    def fn(params, *args):
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params, *args)
        if scale is not None:
            grads = scale.unscale(grads)
        return ((loss, aux) if has_aux else loss), grads

    return fn
