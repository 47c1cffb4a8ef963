"""CentralStorageStrategy keeps one copy of the state in host memory; TPUStrategy without a TPU."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from jaxdist.checkpoint import CheckpointManager


def _train(strategy, data, view="global"):
    x, y = data
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
    step = strategy.step(models.classifier_train_step)
    for batch in strategy.distribute((x[:300], y[:300]), 64, shuffle=True):
        if view == "global":
            state, _ = step(state, batch)
        else:
            state, _ = strategy.local_results(
                strategy.run(models.classifier_replica_step, args=(state, batch)))[0]
    return state


def test_state_lives_once_in_host_memory_and_training_matches_mirrored(digits):
    (x, y), _ = digits
    devices = jax.devices()[:4]
    central = _train(jaxdist.CentralStorageStrategy(devices), (x, y))
    mirrored = _train(jaxdist.MirroredStrategy(devices), (x, y))
    kernel = central.params["Dense_0"]["kernel"]  # [64, 32]: partitioned over the 4 replicas
    assert kernel.sharding.memory_kind == "pinned_host"
    assert kernel.sharding.spec == jax.P("data")
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 32)}  # one copy in all
    bias = central.params["Dense_1"]["bias"]  # [10]: does not divide by 4, kept whole
    assert bias.sharding.memory_kind == "pinned_host" and bias.sharding.spec == jax.P()
    assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in jax.tree.leaves(central))
    for a, b in zip(jax.tree.leaves(central.params), jax.tree.leaves(mirrored.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_per_replica_view_and_one_device(digits):
    (x, y), _ = digits
    ref = _train(jaxdist.MirroredStrategy(jax.devices()[:2]), (x, y))
    per_replica = _train(jaxdist.CentralStorageStrategy(jax.devices()[:2]), (x, y), "per_replica")
    one = _train(jaxdist.CentralStorageStrategy(jax.devices()[:1]), (x, y))
    assert jax.tree.leaves(one)[0].sharding.memory_kind == "device"  # degenerates to the device
    for other in (per_replica, one):
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(other.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_checkpoint_restores_into_host_memory(tmp_path, digits):
    (x, y), _ = digits
    trained = _train(jaxdist.MirroredStrategy(jax.devices()[:2]), (x, y))
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, trained)
    s = jaxdist.CentralStorageStrategy(jax.devices()[:4])
    restored = mgr.restore(target=trained, strategy=s)
    assert jax.tree.leaves(restored)[0].sharding.memory_kind == "pinned_host"
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tpu_strategy_without_a_tpu_says_so():
    with pytest.raises(RuntimeError, match=r"TPUStrategy found no TPU.*jaxdist\[tpu\].*"
                                           r"jaxdist\.MirroredStrategy\(\)"):
        jaxdist.TPUStrategy()
