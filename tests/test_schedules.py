"""The linear scaling rule with warm-up (jaxdist.schedules)."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models
from jaxdist.schedules import linear_scaling_rule


def test_rate_scales_with_the_replicas_after_a_linear_warmup():
    per_replica = 16
    for replicas in (1, 2, 8):
        s = linear_scaling_rule(0.01, base_batch_size=per_replica,
                                global_batch_size=per_replica * replicas, warmup_steps=10)
        assert float(s(0)) == pytest.approx(0.01)
        assert float(s(5)) == pytest.approx(0.01 + (0.01 * replicas - 0.01) / 2)
        assert float(s(10)) == pytest.approx(0.01 * replicas)
        assert float(s(10_000)) == pytest.approx(0.01 * replicas)


def test_decay_after_warmup_starts_from_the_peak():
    s = linear_scaling_rule(0.1, base_batch_size=32, global_batch_size=128, warmup_steps=4,
                            after=lambda peak: optax.cosine_decay_schedule(peak, 100))
    assert float(s(4)) == pytest.approx(0.4)
    assert float(s(54)) == pytest.approx(0.2, rel=1e-3)
    assert float(s(104)) == pytest.approx(0.0, abs=1e-7)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="global_batch_size=0"):
        linear_scaling_rule(0.1, base_batch_size=32, global_batch_size=0)


def test_schedule_drives_training_through_fit(digits):
    (x, y), (xt, yt) = digits
    strategy = jaxdist.MirroredStrategy()
    lr = linear_scaling_rule(1e-3, base_batch_size=16, global_batch_size=16 * 8, warmup_steps=20)
    state = models.create_train_state(models.MLP(), x[:1], tx=optax.adam(lr))
    hist = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                       strategy.distribute((x, y), 128, shuffle=True), epochs=4, verbose=0)
    assert np.all(np.diff(hist.history["loss"]) < 0)
    acc = jaxdist.evaluate(models.classifier_eval_step, hist.state, strategy.distribute((xt, yt), 128))
    assert acc["accuracy"] >= 0.9
