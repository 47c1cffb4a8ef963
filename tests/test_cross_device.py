"""Every cross_device_ops choice trains like "xla" through strategy.run + jaxdist.all_reduce."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models


def _train_per_replica(strategy, data, steps=3):
    x, y = data
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    for k, batch in enumerate(strategy.distribute((x[:200], y[:200]), 64)):
        if k == steps:
            break
        state, _ = strategy.local_results(
            strategy.run(models.classifier_replica_step, args=(state, batch)))[0]
    return jax.device_get(state.params)


@pytest.mark.parametrize("options, rtol", [
    (dict(cross_device_ops="ring"), 1e-5),
    (dict(cross_device_ops="hierarchical"), 1e-5),
    (dict(cross_device_ops="one_device"), 1e-5),
    (dict(cross_device_ops="ring", pack_bytes=1 << 16), 1e-5),
    (dict(cross_device_ops="xla", compress="bf16"), 2e-2),
])
def test_cross_device_ops_train_like_xla(digits, options, rtol):
    (x, y), _ = digits
    devices = jax.devices()[:4]
    ref = _train_per_replica(jaxdist.MirroredStrategy(devices), (x, y))
    got = _train_per_replica(jaxdist.MirroredStrategy(devices, **options), (x, y))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10)


def test_the_strategy_choice_reaches_the_compiled_program():
    s = jaxdist.MirroredStrategy(jax.devices()[:4], cross_device_ops="ring")
    from jaxdist.core.collectives import _count_collectives
    from jaxdist.core.per_replica import lower

    def fn(v):
        return jaxdist.all_reduce(v, "sum")

    v = s.put(np.ones(1000, np.float32))
    assert float(s.local_results(s.run(fn, args=(v,)))[0][0]) == 4.0
    hlo = lower(s, fn, args=(v,)).compile().as_text()
    counts = _count_collectives(hlo)
    assert counts.get("collective-permute", 0) >= 1 and counts.get("all-reduce", 0) == 0
