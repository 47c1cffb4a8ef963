"""Mixed precision: bf16 / fp16 training, dynamic loss scaling, identical skip decisions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models, precision


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_digits(digits, policy):
    (x, y), (xt, yt) = digits
    strategy = jaxdist.MirroredStrategy()
    state = models.create_train_state(models.MLP(), x[:1], precision=policy, learning_rate=3e-3)
    assert isinstance(state, precision.TrainState)
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32  # parameters stay float32
    hist = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                       strategy.distribute((x, y), 128, shuffle=True), epochs=12, verbose=0)
    acc = jaxdist.evaluate(models.classifier_eval_step, hist.state,
                           strategy.distribute((xt, yt), 128))["accuracy"]
    assert acc >= 0.95, (policy, acc)
    assert jax.tree.leaves(hist.state.params)[0].dtype == jnp.float32
    if policy == "mixed_float16":
        assert hist.state.loss_scale is not None


def test_mixed_precision_computes_in_16_bits():
    seen = {}

    def loss_fn(params, x):
        seen["dtype"] = params["w"].dtype
        return jnp.mean((x @ params["w"]) ** 2)

    for policy, want in [("mixed_bfloat16", jnp.bfloat16), ("mixed_float16", jnp.float16)]:
        s = precision.TrainState.create(apply_fn=None, params={"w": jnp.ones((3, 2))},
                                        tx=optax.sgd(0.1), policy=policy,
                                        loss_scale=precision.DynamicLossScale.create(2.0**10))
        loss, grads = precision.value_and_grad(loss_fn, s)(s.params, jnp.ones((4, 3)))
        assert seen["dtype"] == want
        assert loss.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
        np.testing.assert_allclose(grads["w"], 2 * 3 * np.ones((3, 2)) / 2, rtol=1e-2)


def _poisoned_replica_step(state, batch, *, bad_replica):
    (x, y), mask = batch

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, state.policy.cast_to_compute(x))
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        loss = jaxdist.compute_average_loss(per_example, mask)
        # One replica's gradient becomes inf: the skip must still happen on every replica.
        return loss * jnp.where(jaxdist.replica_id() == bad_replica, jnp.inf, 1.0)

    loss, grads = precision.value_and_grad(loss_fn, state)(state.params)
    grads = jaxdist.all_reduce(grads, "sum")
    return state.apply_gradients(grads=grads)


def test_inf_gradient_on_one_replica_is_skipped_on_all_and_the_scale_halves(digits):
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], precision="mixed_float16")
    before = jax.device_get(state.params)
    batch = next(iter(strategy.distribute((x[:64], y[:64]), 64)))
    out = strategy.run(functools.partial(_poisoned_replica_step, bad_replica=3),
                       args=(state, batch))
    replicas = strategy.local_results(out)
    assert len(replicas) == 8
    for r in replicas:
        assert float(r.loss_scale.scale) == 2.0**14  # halved from Keras's 2**15
        assert int(r.skipped) == 1 and int(r.step) == 0
        for a, b in zip(jax.tree.leaves(jax.device_get(r.params)), jax.tree.leaves(before)):
            np.testing.assert_array_equal(a, b)
    # The same step with no poisoned replica updates every replica and keeps the scale.
    out = strategy.run(functools.partial(_poisoned_replica_step, bad_replica=-1),
                       args=(state, batch))
    for r in strategy.local_results(out):
        assert float(r.loss_scale.scale) == 2.0**15 and int(r.step) == 1 and int(r.skipped) == 0


def _scale_trace(devices, x, y):
    strategy = jaxdist.MirroredStrategy(devices)
    state = models.create_train_state(models.MLP(hidden=(64,)), x[:1], learning_rate=1e-2,
                                      tx=optax.adam(1e-2), precision="mixed_float16")
    # Start far too high and grow quickly, so that the run both skips and grows.
    state = state.replace(loss_scale=precision.DynamicLossScale.create(2.0**28, period=3))
    step = strategy.step(models.classifier_train_step)
    trace = []
    for k, batch in enumerate(strategy.distribute((x, y), 64)):
        state, _ = step(state, batch)
        trace.append((float(state.loss_scale.scale), int(state.skipped)))
        if k == 19:
            break
    return trace


def test_one_and_eight_devices_take_the_same_skip_decisions(digits):
    (x, y), _ = digits
    one = _scale_trace(jax.devices()[:1], x, y)
    eight = _scale_trace(jax.devices(), x, y)
    assert one == eight
    assert one[-1][1] >= 3, one                       # some steps were skipped ...
    assert any(b[0] > a[0] for a, b in zip(one, one[1:])), one   # ... and the scale also grew


def test_dynamic_loss_scale_arithmetic():
    s = precision.DynamicLossScale.create(4.0, period=2, min_scale=2.0)
    s = s.adjust(jnp.array(False))
    assert float(s.scale) == 2.0
    s = s.adjust(jnp.array(False))
    assert float(s.scale) == 2.0  # never below min_scale
    s = s.adjust(jnp.array(True)).adjust(jnp.array(True))
    assert float(s.scale) == 4.0 and int(s.counter) == 0


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        precision.Policy.named("mixed_fp8")


@pytest.mark.slow
def test_the_mixed_precision_example_runs():
    from tests.conftest import run_python

    proc = run_python(["examples/mixed_precision.py", "--precision", "mixed_float16", "--epochs",
                       "6"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("mixed_float16, 4 micro-batches of 64: best checkpoint test accuracy")
    assert float(line.split("accuracy ")[1].split()[0]) >= 0.9
