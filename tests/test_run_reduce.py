"""Per-replica view: run / reduce / local_results / replica_id against hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist

ALL = [("default", None), ("one_device", None), ("mirrored", 1), ("mirrored", 2), ("mirrored", 4),
       ("mirrored", 8)]


def _strategy(kind, n):
    if kind == "default":
        return jaxdist.DefaultStrategy()
    if kind == "one_device":
        return jaxdist.OneDeviceStrategy(jax.devices()[0])
    return jaxdist.MirroredStrategy(jax.devices()[:n])


@pytest.mark.parametrize("kind, n", ALL)
def test_replica_ids_and_counts(kind, n):
    s = _strategy(kind, n)
    out = s.run(lambda: (jaxdist.replica_id(), jnp.int32(jaxdist.num_replicas())))
    ids = [int(r[0]) for r in s.local_results(out)]
    counts = {int(r[1]) for r in s.local_results(out)}
    assert ids == list(range(s.num_replicas_in_sync))
    assert counts == {s.num_replicas_in_sync}


@pytest.mark.parametrize("kind, n", ALL)
def test_run_splits_batches_and_reduce_matches_hand_computation(kind, n):
    s = _strategy(kind, n)
    r = s.num_replicas_in_sync
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    batch = next(iter(s.distribute((x,), 8)))

    def fn(scale, batch):
        local = batch.data[0]  # [8 / r, 3]
        return {"rowsum": jnp.sum(local * scale), "rows": local, "n": jnp.sum(batch.mask)}

    out = s.run(fn, args=(2.0, batch))
    local = s.local_results(out)
    assert len(local) == r
    np.testing.assert_array_equal(np.concatenate([np.asarray(v["rows"]) for v in local]), x)
    chunks = np.split(x * 2, r)
    np.testing.assert_allclose([float(v["rowsum"]) for v in local], [c.sum() for c in chunks])
    np.testing.assert_allclose(float(s.reduce("sum", out, axis=None)["rowsum"]),
                               x.sum() * 2)
    np.testing.assert_allclose(float(s.reduce(jaxdist.ReduceOp.MEAN, out)["rowsum"]), x.sum() * 2 / r)
    # axis=0 also reduces along each replica's batch axis: the global batch mean / sum.
    rows = out["rows"]
    np.testing.assert_allclose(np.asarray(s.reduce("mean", rows, axis=0)), x.mean(0))
    np.testing.assert_allclose(np.asarray(s.reduce("SUM", rows, axis=0)), x.sum(0))
    with pytest.raises(ValueError, match=r"axis=0\) is out of range .* shape \(\)"):
        s.reduce("sum", out, axis=0)
    assert int(s.reduce("sum", out)["n"]) == 8


def test_per_replica_values_feed_back_into_run():
    s = _strategy("mirrored", 4)
    ids = s.run(lambda: jaxdist.replica_id() * 10)
    out = s.run(lambda v: v + jaxdist.replica_id(), args=(ids,))
    assert [int(v) for v in s.local_results(out)] == [0, 11, 22, 33]


@pytest.mark.parametrize("op, expected", [("sum", 0 + 1 + 2 + 3), ("mean", 1.5)])
def test_all_reduce_inside_run(op, expected):
    s = _strategy("mirrored", 4)
    out = s.run(lambda: jaxdist.all_reduce({"v": jaxdist.replica_id().astype(jnp.float32)}, op))
    assert [float(v["v"]) for v in s.local_results(out)] == [expected] * 4


def test_compute_average_loss_is_global_in_both_views():
    s = _strategy("mirrored", 4)
    loss = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0, 100.0], np.float32)
    mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], bool)
    batch = jaxdist.Batch((loss,), mask)
    per = s.run(lambda b: jaxdist.compute_average_loss(b.data[0], b.mask), args=(batch,))
    assert float(s.reduce("sum", per)) == pytest.approx(3.5)
    step = s.step(lambda st, b: (st, {"l": jaxdist.compute_average_loss(b.data[0], b.mask)}))
    assert float(step(jnp.zeros(()), batch)[1]["l"]) == pytest.approx(3.5)


def test_all_reduce_outside_a_replica_context_says_where_to_call_it():
    with pytest.raises(RuntimeError, match=r"outside a replica context.*strategy\.run"):
        jaxdist.all_reduce(jnp.ones(3))
    with pytest.raises(RuntimeError, match=r"outside a replica context"):
        jaxdist.replica_id()
    s = _strategy("mirrored", 2)
    step = s.step(lambda st, b: (st, {"m": jaxdist.all_reduce(jnp.mean(b))}))
    with pytest.raises(RuntimeError, match=r"global-view step.*XLA inserts"):
        step(jnp.zeros(()), np.ones(4, np.float32))


def test_reduce_of_a_non_per_replica_value():
    s = _strategy("mirrored", 2)
    assert float(s.reduce("mean", jnp.float32(3.0))) == 3.0
    with pytest.raises(ValueError, match="not per-replica"):
        s.reduce("sum", jnp.float32(3.0))
    assert s.local_results(5) == (5,)
    with pytest.raises(ValueError, match="unknown reduce op 'max'"):
        s.reduce("max", jnp.float32(3.0))


def test_plain_arrays_are_copied_to_every_replica_even_if_laid_out_on_the_batch_axis():
    s = _strategy("mirrored", 4)
    v = jax.device_put(np.arange(8.0, dtype=np.float32), s.layout.batch)
    out = s.run(lambda v: v.shape[0] * jnp.ones(()), args=(v,))
    assert [float(r) for r in s.local_results(out)] == [8.0] * 4


@pytest.mark.parametrize("n", [1, 2])
def test_all_reduce_refuses_an_integer_mean_on_one_replica_as_on_many(n):
    # One replica skips the collective, not the check: code that fails on 8 devices fails on 1.
    s = _strategy("mirrored", n)
    with pytest.raises(TypeError, match="integer leaf"):
        s.run(lambda: jaxdist.all_reduce({"k": jnp.int32(3)}, "mean"))
    out = s.run(lambda: jaxdist.all_reduce({"k": jnp.int32(3)}, "sum"))
    assert [int(v["k"]) for v in s.local_results(out)] == [3 * n] * n
