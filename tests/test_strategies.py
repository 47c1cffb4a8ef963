"""Strategies are cheap immutable values; the decorator and donation behave as documented."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxdist


def test_strategies_are_immutable_comparable_values():
    a = jaxdist.MirroredStrategy(jax.devices()[:2])
    assert a == jaxdist.MirroredStrategy(list(jax.devices()[:2])) and hash(a) == hash(
        jaxdist.MirroredStrategy(jax.devices()[:2]))
    assert a != jaxdist.MirroredStrategy(jax.devices()[:4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.devices = ()


def test_construction_does_no_device_work(monkeypatch):
    calls = []
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: calls.append(1) or [])
    jaxdist.MirroredStrategy()
    jaxdist.OneDeviceStrategy()
    jaxdist.DefaultStrategy()
    assert calls == []


@pytest.mark.parametrize("n", [1, 3, 8])
def test_mirrored_uses_exactly_the_devices_given(n):
    devs = jax.devices()[8 - n:]
    s = jaxdist.MirroredStrategy(devs)
    assert s.num_replicas_in_sync == n
    assert list(s.mesh.devices.flat) == list(devs)
    assert s.mesh.axis_types == (AxisType.Auto,)
    assert jaxdist.MirroredStrategy().num_replicas_in_sync == len(jax.local_devices())


def test_hierarchical_builds_a_host_local_mesh():
    s = jaxdist.MirroredStrategy(jax.devices()[:4], cross_device_ops="hierarchical")
    assert dict(s.mesh.shape) == {"host": 1, "local": 4}


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cross_device_ops="nccl2"), ValueError, r"cross_device_ops='nccl2'.*'xla', 'ring'"),
    (dict(pack_bytes=-1), ValueError, r"pack_bytes=-1"),
    (dict(compress="fp8"), ValueError, r"compress='fp8'"),
    (dict(devices=[]), ValueError, r"got no devices"),
    (dict(devices=[0]), TypeError, r"expects jax.Device objects"),
])
def test_bad_strategy_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jaxdist.MirroredStrategy(**kwargs)
    if "devices" in kwargs and kwargs["devices"]:
        return
    with pytest.raises(ValueError, match="more than once"):
        jaxdist.MirroredStrategy([jax.devices()[0]] * 2)


def test_one_device_and_default():
    d = jax.devices()[3]
    s = jaxdist.OneDeviceStrategy(d)
    assert s.num_replicas_in_sync == 1
    assert s.put({"w": np.ones(2)})["w"].devices() == {d}
    assert jaxdist.DefaultStrategy().num_replicas_in_sync == 1
    with pytest.raises(TypeError, match="expects a jax.Device"):
        jaxdist.OneDeviceStrategy(3)
    with pytest.raises(ValueError, match="cannot read the device string 'cpu'"):
        jaxdist.OneDeviceStrategy("cpu")


def _sgd(w, batch):
    return w - 0.5 * jnp.mean(batch), {"m": jnp.mean(batch)}


def test_decorator_bare_and_with_arguments():
    bare = jaxdist.mirrored(_sgd)
    assert bare.strategy == jaxdist.MirroredStrategy()
    assert bare.__name__ == "_sgd"
    four = jaxdist.mirrored(devices=jax.devices()[:4], cross_device_ops="ring")(_sgd)
    assert four.strategy.num_replicas_in_sync == 4 and four.strategy.cross_device_ops == "ring"
    w, m = four(jnp.float32(1.0), np.arange(8, dtype=np.float32))
    assert float(w) == pytest.approx(1.0 - 0.5 * 3.5) and float(m["m"]) == pytest.approx(3.5)
    assert w.sharding.is_fully_replicated and len(w.sharding.device_set) == 4


def test_state_is_donated_but_an_eval_step_does_not_consume_it():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    train = s.step(_sgd)
    evaluate = s.step(lambda w, batch: {"m": jnp.mean(batch) * jnp.sum(w)})
    w = s.put(jnp.ones(4))
    evaluate(w, np.ones(2, np.float32))
    assert not w.is_deleted()  # not donated: the step returns only metrics
    new_w, _ = train(w, np.ones(2, np.float32))
    assert w.is_deleted() and not new_w.is_deleted()
    keep = s.step(_sgd, donate=False)
    keep(new_w, np.ones(2, np.float32))
    assert not new_w.is_deleted()


@pytest.mark.parametrize("make", [jaxdist.DefaultStrategy, jaxdist.OneDeviceStrategy,
                                  lambda: jaxdist.MirroredStrategy(jax.devices()[:2])])
def test_a_step_never_deletes_the_callers_unplaced_state(make):
    s = make()
    w0 = jnp.ones(4)  # the user's own array, not placed by the strategy
    w1, _ = s.step(_sgd)(w0, np.ones(2, np.float32))
    assert not w0.is_deleted() and float(w0[0]) == 1.0
    assert float(w1[0]) == pytest.approx(0.5)
