"""Smaller tf.distribute parity: device strings, cross_device_ops aliases, ReduceOp."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

import jaxdist


@pytest.mark.parametrize("spec, index", [
    ("/cpu:0", 0), ("/CPU:3", 3), ("cpu:5", 5), ("/device:CPU:7", 7),
    ("/job:localhost/replica:0/task:0/device:CPU:2", 2),
])
def test_device_strings_resolve_like_tf(spec, index):
    s = jaxdist.OneDeviceStrategy(spec)
    assert list(s.mesh.devices.flat) == [jax.local_devices()[index]]
    assert s.num_replicas_in_sync == 1


def test_mirrored_takes_device_strings():
    s = jaxdist.MirroredStrategy(["/cpu:1", "/device:CPU:0"])
    assert list(s.mesh.devices.flat) == [jax.devices()[1], jax.devices()[0]]


@pytest.mark.parametrize("spec, message", [
    ("/gpu:0", r"no device '/gpu:0': task 0 has 0 GPU device\(s\); this process has: /cpu:0, .*/cpu:7"),
    ("/cpu:8", r"no device '/cpu:8': task 0 has 8 CPU device\(s\)"),
])
def test_missing_devices_list_the_ones_there_are(spec, message):
    s = jaxdist.OneDeviceStrategy(spec)  # resolved lazily: the backend may not be up yet
    with pytest.raises(ValueError, match=message):
        _ = s.mesh


@pytest.mark.parametrize("bad", ["gpu0", "/gpu:-1", "/xpu:0"])
def test_malformed_device_strings_fail_at_construction(bad):
    with pytest.raises(ValueError, match="cannot read the device string.*'/gpu:0'"):
        jaxdist.OneDeviceStrategy(bad)
    with pytest.raises(ValueError, match="cannot read the device string"):
        jaxdist.MirroredStrategy([bad])
    with pytest.raises(TypeError, match="wrap it in a list"):
        jaxdist.MirroredStrategy("/cpu:0")


@pytest.mark.parametrize("alias", ["auto", "nccl"])
def test_tf_cross_device_names_mean_xla(alias, caplog):
    s = jaxdist.MirroredStrategy(jax.devices()[:4], cross_device_ops=alias)
    with caplog.at_level(logging.WARNING):
        assert s.layout.implementation == "xla"
    assert ("NCCL needs GPUs" in caplog.text) == (alias == "nccl")
    out = s.run(lambda: jaxdist.all_reduce(jaxdist.replica_id().astype(jnp.float32), "sum"))
    assert [float(v) for v in s.local_results(out)] == [6.0] * 4
    with pytest.raises(ValueError, match=r"also takes tf.distribute's \('auto', 'nccl'\)"):
        jaxdist.MirroredStrategy(cross_device_ops="NCCL2")


def test_reduce_op_keeps_tf_members():
    assert {m.name for m in jaxdist.ReduceOp} == {"SUM", "MEAN"}
    assert jaxdist.ReduceOp.parse("Sum") is jaxdist.ReduceOp.SUM
