"""Gradient accumulation: k micro-batches in one compiled step equal one step on the whole batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models
from jaxdist.training.accumulate import accumulate_gradients


def _state(x):
    return models.create_train_state(models.MLP(hidden=(32,)), x[:1], tx=optax.sgd(0.5))


def _batches(strategy, x, y):
    # 100 examples, global batch 64: the second batch has 36 real rows and 28 padding rows.
    return list(strategy.distribute((x[:100], y[:100]), 64))


def _assert_same(a, b):
    for u, v in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_global_view_accumulated_step_equals_one_large_step(digits, k):
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    batches = _batches(strategy, x, y)
    assert int(np.sum(jax.device_get(batches[1].mask))) == 36
    plain = strategy.step(models.classifier_train_step, donate=False)
    accum = strategy.step(functools.partial(models.classifier_train_step, accumulate=k),
                          donate=False)
    for batch in batches:
        ref, ref_m = plain(_state(x), batch)
        got, got_m = accum(_state(x), batch)
        _assert_same(ref.params, got.params)
        np.testing.assert_allclose(float(ref_m["loss"]), float(got_m["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(ref_m["accuracy"]), float(got_m["accuracy"]), rtol=1e-5)


def test_per_replica_view_accumulated_step_equals_one_large_step(digits):
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    for batch in _batches(strategy, x, y):
        ref = strategy.local_results(strategy.run(models.classifier_replica_step,
                                                  args=(_state(x), batch)))
        got = strategy.local_results(strategy.run(
            functools.partial(models.classifier_replica_step, accumulate=4),
            args=(_state(x), batch)))
        for r, g in zip(ref, got):
            _assert_same(r[0].params, g[0].params)
            np.testing.assert_allclose(float(r[1]["loss"]), float(g[1]["loss"]), rtol=1e-5)
        # The global view over the same batch agrees with both.
        glob, _ = strategy.step(models.classifier_train_step, donate=False)(_state(x), batch)
        _assert_same(glob.params, got[0][0].params)


def test_accumulation_with_mixed_precision_matches_without(digits):
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    batch = _batches(strategy, x, y)[1]
    s = models.create_train_state(models.MLP(hidden=(32,)), x[:1], tx=optax.sgd(0.5),
                                  precision="mixed_bfloat16")
    ref, _ = strategy.step(models.classifier_train_step, donate=False)(s, batch)
    got, _ = strategy.step(functools.partial(models.classifier_train_step, accumulate=4),
                           donate=False)(s, batch)
    for u, v in zip(jax.tree.leaves(jax.device_get(ref.params)),
                    jax.tree.leaves(jax.device_get(got.params))):
        np.testing.assert_allclose(u, v, atol=2e-2)  # bfloat16 arithmetic, different sum order


def test_accumulation_holds_one_micro_batch_of_activations():
    # A wide layer on a large batch: XLA's own buffer accounting for the compiled step.
    w = jnp.zeros((64, 2048))
    x = jnp.ones((2048, 64))

    def loss(w, xb):
        return jnp.mean(jnp.tanh(xb @ w) ** 2)

    def temp_bytes(k):
        fn = jax.jit(lambda w, x: accumulate_gradients(jax.value_and_grad(loss), w, x, steps=k))
        return fn.lower(w, x).compile().memory_analysis().temp_size_in_bytes

    one, eight = temp_bytes(1), temp_bytes(8)
    activations = 2048 * 2048 * 4
    assert one >= activations
    assert eight < one / 4, (one, eight)


def test_rows_that_do_not_divide_name_the_fix():
    vg = jax.value_and_grad(lambda w, xb: jnp.mean(w * xb))
    with pytest.raises(ValueError, match="multiple of 3"):
        accumulate_gradients(vg, 1.0, jnp.ones(8), steps=3)
